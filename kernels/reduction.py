"""Reductions: sums over axes (ReduceSum, ReduceMean, SumToShape), maxima, minima and L2 norms
(ReduceMax, ReduceMin, ReduceL2), and their broadcasts back."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import ODTRAIN_DOMAIN, binding
from .elementwise import COPY, _unary, gather_call
from .layout import coalesce, element_strides, flat


@njit(cache=True, error_model="numpy", fastmath={"reassoc"})
def _sum_strided(x, out, dims, sx, so, scale):
    """out[strided] = scale · Σ x[strided] over the axes where out's stride is 0."""
    for i in range(out.size):
        out[i] = 0
    if dims[0] == dims[1] == 1 and sx[3] == 1 and sx[2] == dims[3]:
        # rows of a contiguous matrix: summed into a row vector (a bias gradient) or into one value per row
        rows, cols = dims[2], dims[3]
        if so[3] == 1 and so[2] == 0:
            for r in range(rows):
                for c in range(cols):
                    out[c] += x[r * cols + c]
        elif so[3] == 0:
            for r in range(rows):
                total = x[r * cols] * 0
                for c in range(cols):
                    total += x[r * cols + c]
                out[r * so[2]] += total
        else:
            _sum_general(x, out, dims, sx, so)
    else:
        _sum_general(x, out, dims, sx, so)
    if scale != 1.0:
        for i in range(out.size):
            out[i] *= scale


@njit(cache=True, inline="always", error_model="numpy", fastmath={"reassoc"})
def _sum_general(x, out, dims, sx, so):
    for i0 in range(dims[0]):
        for i1 in range(dims[1]):
            for i2 in range(dims[2]):
                ix = i0 * sx[0] + i1 * sx[1] + i2 * sx[2]
                io = i0 * so[0] + i1 * so[1] + i2 * so[2]
                for i3 in range(dims[3]):
                    out[io + i3 * so[3]] += x[ix + i3 * sx[3]]


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


@njit(cache=True, error_model="numpy")
def _extremum_strided(code, x, out, dims, sx, so, init):
    """out[strided] = max (code 0), min (1) or √Σx² (2) of x over the axes where out's stride is 0."""
    for i in range(out.size):
        out[i] = init
    for i0 in range(dims[0]):
        for i1 in range(dims[1]):
            for i2 in range(dims[2]):
                ix = i0 * sx[0] + i1 * sx[1] + i2 * sx[2]
                io = i0 * so[0] + i1 * so[1] + i2 * so[2]
                for i3 in range(dims[3]):
                    v = x[ix + i3 * sx[3]]
                    o = io + i3 * so[3]
                    if code == 0:
                        out[o] = max(out[o], v)
                    elif code == 1:
                        out[o] = min(out[o], v)
                    else:
                        out[o] += v * v
    if code == 2:
        for i in range(out.size):
            out[i] = np.sqrt(out[i])


@njit(cache=True, error_model="numpy")
def _extremum_grad(dy, x, y, dx, dims, sx, sy, ties):
    """dx = dy / (number of ties) where x equals its group's extremum y, else 0."""
    for i in range(ties.size):
        ties[i] = 0
    for i0 in range(dims[0]):
        for i1 in range(dims[1]):
            for i2 in range(dims[2]):
                ix = i0 * sx[0] + i1 * sx[1] + i2 * sx[2]
                iy = i0 * sy[0] + i1 * sy[1] + i2 * sy[2]
                for i3 in range(dims[3]):
                    o = iy + i3 * sy[3]
                    if x[ix + i3 * sx[3]] == y[o]:
                        ties[o] += 1
    for i0 in range(dims[0]):
        for i1 in range(dims[1]):
            for i2 in range(dims[2]):
                ix = i0 * sx[0] + i1 * sx[1] + i2 * sx[2]
                iy = i0 * sy[0] + i1 * sy[1] + i2 * sy[2]
                for i3 in range(dims[3]):
                    o = iy + i3 * sy[3]
                    k = ix + i3 * sx[3]
                    dx[k] = dy[o] / ties[o] if x[k] == y[o] else 0


def _extremum(code, inputs, outputs, axes, keepdims, noop_with_empty_axes):
    x, out = inputs[0], outputs[0]
    reduced = _axes(x, axes, noop_with_empty_axes, inputs[1] if len(inputs) > 1 else None)
    dims, sx, so = coalesce(x.shape, element_strides(x.shape, x.shape),
                            element_strides(_keepdims_shape(x.shape, reduced), x.shape))
    if code == 2:
        init = 0
    elif np.issubdtype(out.dtype, np.floating):
        init = -np.inf if code == 0 else np.inf
    elif out.dtype == np.bool_:
        init = code == 1
    else:
        info = np.iinfo(out.dtype)
        init = info.min if code == 0 else info.max
    return [(_extremum_strided, (code, flat(x), flat(out), dims, sx, so, out.dtype.type(init)))]


@binding("ReduceMax")
def ReduceMax(inputs, outputs, axes=None, keepdims=1, noop_with_empty_axes=0):
    return _extremum(0, inputs, outputs, axes, keepdims, noop_with_empty_axes)


@binding("ReduceMin")
def ReduceMin(inputs, outputs, axes=None, keepdims=1, noop_with_empty_axes=0):
    return _extremum(1, inputs, outputs, axes, keepdims, noop_with_empty_axes)


@binding("ReduceL2")
def ReduceL2(inputs, outputs, axes=None, keepdims=1, noop_with_empty_axes=0):
    return _extremum(2, inputs, outputs, axes, keepdims, noop_with_empty_axes)


def _ties_bytes(input_specs, output_specs, **attrs):
    """One float32 count per reduced group (Y's size)."""
    return 4 * int(np.prod(input_specs[2][0], dtype=np.int64))


@binding("ReduceExtremumGrad", ODTRAIN_DOMAIN, scratch=_ties_bytes)
def ReduceExtremumGrad(inputs, outputs, axes=None, keepdims=1, noop_with_empty_axes=0, scratch=None):
    dy, x, y = inputs
    dx = outputs[0]
    reduced = _axes(x, axes, noop_with_empty_axes)
    dims, sx, sy = coalesce(x.shape, element_strides(x.shape, x.shape),
                            element_strides(_keepdims_shape(x.shape, reduced), x.shape))
    ties = scratch.view(np.float32)[:y.size]  # the count of ties per group
    return [(_extremum_grad, (flat(dy), flat(x), flat(y), flat(dx), dims, sx, sy, ties))]
