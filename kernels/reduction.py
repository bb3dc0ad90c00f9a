"""Reductions: sums over axes (ReduceSum, ReduceMean, SumToShape) and their broadcasts back."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import ODTRAIN_DOMAIN, binding
from .elementwise import COPY, _unary, gather_call
from .layout import coalesce, element_strides, flat


@njit(cache=True, error_model="numpy")
def _sum_strided(x, out, dims, sx, so, scale):
    """out[strided] = scale · Σ x[strided] over the axes where out's stride is 0."""
    for i in range(out.size):
        out[i] = 0
    for i0 in range(dims[0]):
        for i1 in range(dims[1]):
            for i2 in range(dims[2]):
                ix = i0 * sx[0] + i1 * sx[1] + i2 * sx[2]
                io = i0 * so[0] + i1 * so[1] + i2 * so[2]
                for i3 in range(dims[3]):
                    out[io + i3 * so[3]] += x[ix + i3 * sx[3]]
    if scale != 1.0:
        for i in range(out.size):
            out[i] *= scale


def _keepdims_shape(shape: tuple, axes: tuple) -> tuple:
    return tuple(1 if a in axes else d for a, d in enumerate(shape))


def sum_call(x: np.ndarray, out: np.ndarray, kept_shape: tuple, scale: float):
    """Sum x over the axes where `kept_shape` (out's shape with reduced axes as 1) is 1."""
    if x.size == out.size:
        return [(_unary, (COPY, flat(x), flat(out)))] if scale == 1.0 else \
            [gather_call(x, out, *coalesce(x.shape, element_strides(x.shape, x.shape)), scale)]
    dims, sx, so = coalesce(x.shape, element_strides(x.shape, x.shape), element_strides(kept_shape, x.shape))
    return [(_sum_strided, (flat(x), flat(out), dims, sx, so, out.dtype.type(scale)))]


def _axes(x, axes, noop_with_empty_axes, axes_input=None):
    if axes is None and axes_input is not None:
        axes = [int(a) for a in axes_input.reshape(-1)]
    if not axes:
        return () if noop_with_empty_axes else tuple(range(x.ndim))
    return tuple(sorted(int(a) % x.ndim for a in axes))


@binding("ReduceSum")
def ReduceSum(inputs, outputs, axes=None, keepdims=1, noop_with_empty_axes=0):
    x = inputs[0]
    reduced = _axes(x, axes, noop_with_empty_axes, inputs[1] if len(inputs) > 1 else None)
    return sum_call(x, outputs[0], _keepdims_shape(x.shape, reduced), 1.0)


@binding("ReduceMean")
def ReduceMean(inputs, outputs, axes=None, keepdims=1, noop_with_empty_axes=0):
    x = inputs[0]
    reduced = _axes(x, axes, noop_with_empty_axes, inputs[1] if len(inputs) > 1 else None)
    count = int(np.prod([x.shape[a] for a in reduced], dtype=np.int64))
    return sum_call(x, outputs[0], _keepdims_shape(x.shape, reduced), 1.0 / max(count, 1))


@binding("SumToShape", ODTRAIN_DOMAIN)
def SumToShape(inputs, outputs):
    g, out = inputs[0], outputs[0]
    rank = g.ndim
    kept = (1,) * (rank - out.ndim) + tuple(out.shape)
    return sum_call(g, out, kept, 1.0)


@binding("ReduceGrad", ODTRAIN_DOMAIN)
def ReduceGrad(inputs, outputs, axes=None, keepdims=1, mean=0, noop_with_empty_axes=0):
    """dX = broadcast of dY over the reduced axes (÷ count for a mean)."""
    dy, x_shape, out = inputs[0], outputs[0].shape, outputs[0]
    reduced = _axes(out, axes, noop_with_empty_axes)
    kept = _keepdims_shape(x_shape, reduced)
    count = int(np.prod([x_shape[a] for a in reduced], dtype=np.int64)) if mean else 1
    dims, sx = coalesce(x_shape, element_strides(kept, x_shape))
    return [gather_call(dy, out, dims, sx, 1.0 / max(count, 1))]
