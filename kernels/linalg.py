"""Matrix products through BLAS (`np.dot` inside Numba reaches scipy's BLAS).

Transposes are never copied: the binding passes `A.T` views, which Numba
sees as Fortran-ordered arrays and hands to BLAS with a transpose flag.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import binding
from .layout import element_strides


@njit(cache=True, error_model="numpy")
def _gemm(a, b, out, alpha):
    """out = alpha · a · b."""
    np.dot(a, b, out)
    if alpha != 1.0:
        for i in range(out.shape[0]):
            for j in range(out.shape[1]):
                out[i, j] *= alpha


@njit(cache=True, error_model="numpy")
def _gemm_bias(a, b, c, out, alpha, beta, c_row_stride, c_col_stride):
    """out = alpha · a · b + beta · c, with c broadcast through its element strides."""
    np.dot(a, b, out)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = alpha * out[i, j] + beta * c[i * c_row_stride + j * c_col_stride]


@njit(cache=True, error_model="numpy")
def _batched_matmul(a, b, out, a_index, b_index):
    """out[k] = a[a_index[k]] · b[b_index[k]] over flattened batch dimensions."""
    for k in range(out.shape[0]):
        np.dot(a[a_index[k]], b[b_index[k]], out[k])


@binding("Gemm")
def Gemm(inputs, outputs, alpha=1.0, beta=1.0, transA=0, transB=0):
    a = inputs[0].T if transA else inputs[0]
    b = inputs[1].T if transB else inputs[1]
    out = outputs[0]
    c = inputs[2] if len(inputs) > 2 else None
    if c is None or beta == 0.0:
        return [(_gemm, (a, b, out, out.dtype.type(alpha)))]
    row_stride, col_stride = element_strides(c.shape, out.shape)[-2:] if c.ndim else (0, 0)
    if c.ndim == 1:
        row_stride, col_stride = 0, element_strides(c.shape, out.shape)[-1]
    return [(_gemm_bias, (a, b, c.reshape(-1), out, out.dtype.type(alpha), out.dtype.type(beta), row_stride, col_stride))]


@binding("MatMul")
def MatMul(inputs, outputs):
    a, b, out = inputs[0], inputs[1], outputs[0]
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if b.ndim == 2:  # a batch of rows times one matrix: a single BLAS call
        return [(_gemm, (a.reshape(-1, k), b, out.reshape(-1, n), out.dtype.type(1.0)))]
    batch = out.shape[:-2]
    count = int(np.prod(batch, dtype=np.int64))
    a_index = _batch_index(a.shape[:-2], batch)
    b_index = _batch_index(b.shape[:-2], batch)
    return [(_batched_matmul, (a.reshape(-1, m, k), b.reshape(-1, k, n), out.reshape(count, m, n), a_index, b_index))]


def _batch_index(shape: tuple, batch: tuple) -> np.ndarray:
    """For each flat batch position of the output, the flat batch position of an operand."""
    strides = np.array(element_strides(shape, batch) if batch else [], dtype=np.int64)
    grid = np.indices(batch).reshape(len(batch), -1) if batch else np.zeros((0, 1), dtype=np.int64)
    return (strides[:, None] * grid).sum(axis=0).astype(np.int64)
