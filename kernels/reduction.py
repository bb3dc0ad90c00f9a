"""Reductions: sums over axes (ReduceSum, ReduceMean, SumToShape), the other folds (ReduceMax,
ReduceMin, ReduceL1, ReduceL2, ReduceSumSquare, ReduceLogSum, ReduceLogSumExp, ReduceProd),
their broadcasts back, ArgMax/ArgMin, Hardmax, TopK, and CumSum/CumProd.

An op along one axis (ArgMax, CumSum) sees its input as [outer, axis, inner]."""
from __future__ import annotations

import numpy as np

from .jit import njit

from .registry import ODTRAIN_DOMAIN, binding
from .copies import gather_call, sum_call
from .layout import coalesce, element_strides, flat


def _keepdims_shape(shape: tuple, axes: tuple) -> tuple:
    return tuple(1 if a in axes else d for a, d in enumerate(shape))


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


FOLD = {"ReduceMax": 0, "ReduceMin": 1, "ReduceL2": 2, "ReduceL1": 3, "ReduceSumSquare": 4, "ReduceLogSum": 5,
        "ReduceLogSumExp": 6, "ReduceProd": 7}


@njit(cache=True, error_model="numpy")
def _fold_strided(code, x, out, dims, sx, so, init):
    """out[strided] = the fold of x over the axes where out's stride is 0: max (code 0), min (1), √Σx² (2),
    Σ|x| (3), Σx² (4), log Σx (5), log Σ exp x (6, accumulated as a running log-add-exp), Π x (7)."""
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
                    elif code == 2 or code == 4:
                        out[o] += v * v
                    elif code == 3:
                        out[o] += abs(v)
                    elif code == 5:
                        out[o] += v
                    elif code == 6:
                        top = max(out[o], v)
                        if top != -np.inf:
                            out[o] = top + np.log1p(np.exp(-abs(out[o] - v)))
                    else:
                        out[o] *= v
    if code == 2:
        for i in range(out.size):
            out[i] = np.sqrt(out[i])
    elif code == 5:
        for i in range(out.size):
            out[i] = np.log(out[i])


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


def _fold_start(code: int, dtype: np.dtype):
    """The value a fold starts from: the identity of its operation."""
    if code == 7:
        return 1
    if code not in (0, 1, 6):
        return 0
    if np.issubdtype(dtype, np.floating):
        return np.inf if code == 1 else -np.inf
    if dtype == np.bool_:
        return code == 1
    info = np.iinfo(dtype)
    return info.max if code == 1 else info.min


def _make_fold(code: int):
    def bind(inputs, outputs, axes=None, keepdims=1, noop_with_empty_axes=0):
        x, out = inputs[0], outputs[0]
        reduced = _axes(x, axes, noop_with_empty_axes, inputs[1] if len(inputs) > 1 else None)
        dims, sx, so = coalesce(x.shape, element_strides(x.shape, x.shape),
                                element_strides(_keepdims_shape(x.shape, reduced), x.shape))
        start = out.dtype.type(_fold_start(code, out.dtype))
        return [(_fold_strided, (code, flat(x), flat(out), dims, sx, so, start))]

    return bind


for _name, _code in FOLD.items():
    binding(_name)(_make_fold(_code))


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


def _outer_axis_inner(shape: tuple, axis: int) -> tuple[int, int, int]:
    return (int(np.prod(shape[:axis], dtype=np.int64)), int(shape[axis]),
            int(np.prod(shape[axis + 1:], dtype=np.int64)))


@njit(cache=True, error_model="numpy")
def _arg_extremum(x, out, outer, n, inner, smallest, last):
    """out[o, i] = the position along the middle axis of x [outer, n, inner] of its largest (or smallest)
    element, the first one among ties (or the last)."""
    for o in range(outer):
        for i in range(inner):
            base = o * n * inner + i
            best, at = x[base], 0
            for k in range(1, n):
                v = x[base + k * inner]
                better = (v < best) if smallest else (v > best)
                if better or (last and v == best):
                    best, at = v, k
            out[o * inner + i] = at


def _make_arg(smallest: bool):
    def bind(inputs, outputs, axis=0, keepdims=1, select_last_index=0):
        x = inputs[0]
        outer, n, inner = _outer_axis_inner(x.shape, int(axis) % max(x.ndim, 1))
        return [(_arg_extremum, (flat(x), flat(outputs[0]), outer, n, inner, smallest, bool(select_last_index)))]

    return bind


binding("ArgMax")(_make_arg(False))
binding("ArgMin")(_make_arg(True))


@njit(cache=True, error_model="numpy")
def _hardmax(x, out, outer, n, inner):
    """out [outer, n, inner] = 1 at the first largest element of x along the middle axis, else 0."""
    for o in range(outer):
        for i in range(inner):
            base = o * n * inner + i
            at = 0
            for k in range(n):
                out[base + k * inner] = 0
                if x[base + k * inner] > x[base + at * inner]:
                    at = k
            out[base + at * inner] = 1


@binding("Hardmax")
def Hardmax(inputs, outputs, axis=-1):
    x = inputs[0]
    outer, n, inner = _outer_axis_inner(x.shape, int(axis) % max(x.ndim, 1))
    return [(_hardmax, (flat(x), flat(outputs[0]), outer, n, inner))]


@njit(cache=True, error_model="numpy")
def _top_k(x, values, indices, outer, n, inner, k, largest):
    """values, indices [outer, k, inner] = the k largest (smallest) elements of x [outer, n, inner] along the middle
    axis and their positions, sorted, the first of equal elements first: each element is inserted after those
    at least as good, into a list kept in the outputs."""
    for o in range(outer):
        for i in range(inner):
            base = o * n * inner + i
            top = o * k * inner + i
            kept = 0
            for j in range(n):
                v = x[base + j * inner]
                p = kept
                while p > 0:
                    kept_value = values[top + (p - 1) * inner]
                    if not ((v > kept_value) if largest else (v < kept_value)):
                        break
                    p -= 1
                if p >= k:
                    continue
                for q in range(min(kept, k - 1), p, -1):  # shift the worse ones down by one
                    values[top + q * inner] = values[top + (q - 1) * inner]
                    indices[top + q * inner] = indices[top + (q - 1) * inner]
                values[top + p * inner] = v
                indices[top + p * inner] = j
                kept = min(kept + 1, k)


@binding("TopK")
def TopK(inputs, outputs, axis=-1, largest=1, sorted=1):
    x = inputs[0]
    axis = int(axis) % max(x.ndim, 1)
    outer, n, inner = _outer_axis_inner(x.shape, axis)
    k = outputs[0].shape[axis]
    return [(_top_k, (flat(x), flat(outputs[0]), flat(outputs[1]), outer, n, inner, k, bool(largest)))]


@njit(cache=True, error_model="numpy")
def _cumulative(x, out, outer, n, inner, exclusive, reverse, product):
    """out = running sums (or products) of x [outer, n, inner] along the middle axis (from its end when
    reversed; each element left out of its own total when exclusive)."""
    for o in range(outer):
        for i in range(inner):
            base = o * n * inner + i
            total = x[base] * 0 + product
            for step in range(n):
                k = n - 1 - step if reverse else step
                v = x[base + k * inner]
                if exclusive:
                    out[base + k * inner] = total
                total = total * v if product else total + v
                if not exclusive:
                    out[base + k * inner] = total


def _make_cumulative(product: bool):
    def bind(inputs, outputs, exclusive=0, reverse=0):
        x = inputs[0]
        outer, n, inner = _outer_axis_inner(x.shape, int(inputs[1].reshape(())) % x.ndim)
        return [(_cumulative, (flat(x), flat(outputs[0]), outer, n, inner, bool(exclusive), bool(reverse), product))]

    return bind


binding("CumSum")(_make_cumulative(False))
binding("CumProd")(_make_cumulative(True))
