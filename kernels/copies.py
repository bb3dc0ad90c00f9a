"""Copies, gathers and sums over strided layouts: the call builders that several families share.

- `copy_call`: a strided copy, `_copy_strided`, over a coalesced index space of 6 axes with a start offset
  and element strides for the source and the destination, so a slice, a concatenation slot, a broadcast, a
  transpose or a tile is a stride pattern computed once when the graph is bound (kernels/tensor.py's ops,
  Einsum's operand layouts in kernels/linalg.py). The outer five axes are rows, walked by an odometer
  (`first_row`, `next_row`: no division per row); the last axis is a run, copied through slices when both
  strides are 1 (or repeating one value when the source's is 0), which LLVM vectorises, where an
  element-by-element copy does not (bench_ops.DecoderLayoutOps, a head Transpose). With threads, a copy
  that writes each element once splits its rows into parallel parts.
- `gather_call`: out (flat, C order) = scale · x read through a 4-D layout (kernels/layout.py): a bias
  broadcast before a product, Expand, a mean's gradient.
- `sum_call`: out = scale · Σ x over the axes a kept shape reduces to 1 (ReduceSum, a bias gradient,
  Einsum's summed labels).
- `same_buffer`: whether the planner put an output over its input.

Each call builder returns `(kernel, args)` calls; the kernels write into `out` and allocate nothing.
Imports numpy and the base modules jit, layout and parallel_split.
"""
from __future__ import annotations

import numpy as np

from .jit import njit, prange  # noqa: F401 (prange: the loops of the generated twins)

from .layout import coalesce, element_strides, flat
from .parallel_split import parallel_twin, split

COPY_DIMS = 6


# ---- strided copies ---------------------------------------------------------------------------


@njit(cache=True, inline="always", error_model="numpy")
def _copy_run(x, ix, sx, out, io, so, n, accumulate):
    """out[io + k·so] (+)= x[ix + k·sx] for k < n. Unit and zero strides go through slices, whose indices
    LLVM knows are in range (no wraparound select per element), so those runs vectorise."""
    if so == 1 and sx == 1:
        target, source = out[io:io + n], x[ix:ix + n]
        if accumulate:
            for k in range(n):
                target[k] += source[k]
        else:
            for k in range(n):
                target[k] = source[k]
    elif so == 1 and sx == 0 and not accumulate:  # a value repeated along the run (Expand of a last axis)
        target, value = out[io:io + n], x[ix]
        for k in range(n):
            target[k] = value
    elif accumulate:
        for k in range(n):
            out[io + k * so] += x[ix + k * sx]
    else:
        for k in range(n):
            out[io + k * so] = x[ix + k * sx]


@njit(cache=True, inline="always")
def first_row(row, dims):
    """The index (i0, ..., i4) of row number `row` (C order) over the outer five axes of a 6-axis layout."""
    i4 = row % dims[4]
    row //= dims[4]
    i3 = row % dims[3]
    row //= dims[3]
    i2 = row % dims[2]
    row //= dims[2]
    return row // dims[1], row % dims[1], i2, i3, i4


@njit(cache=True, inline="always")
def next_row(i0, i1, i2, i3, i4, dims):
    """The index of the row after (i0, ..., i4): an odometer, no division per row."""
    i4 += 1
    if i4 == dims[4]:
        i4 = 0
        i3 += 1
        if i3 == dims[3]:
            i3 = 0
            i2 += 1
            if i2 == dims[2]:
                i2 = 0
                i1 += 1
                if i1 == dims[1]:
                    i1 = 0
                    i0 += 1
    return i0, i1, i2, i3, i4


@njit(cache=True, inline="always")
def row_start(start, strides, i0, i1, i2, i3, i4):
    """The element offset of row (i0, ..., i4) through `strides`."""
    return start + i0 * strides[0] + i1 * strides[1] + i2 * strides[2] + i3 * strides[3] + i4 * strides[4]


@njit(cache=True, error_model="numpy")
def _copy_strided(x, x_start, sx, out, out_start, so, dims, accumulate, first, last):
    """out[out_start + Σ i·so] (+)= x[x_start + Σ i·sx] for every index i < dims (6 axes) whose outer five
    axes, read as one row number in C order, lie in [first, last): each row is one run of dims[5]."""
    if last <= first:
        return
    i0, i1, i2, i3, i4 = first_row(first, dims)
    for _ in range(first, last):
        ix, io = row_start(x_start, sx, i0, i1, i2, i3, i4), row_start(out_start, so, i0, i1, i2, i3, i4)
        _copy_run(x, ix, sx[5], out, io, so[5], dims[5], accumulate)
        i4 += 1  # next_row written out: through its returned tuple, short rows (a head transpose's) ran slower
        if i4 == dims[4]:
            i4 = 0
            i3 += 1
            if i3 == dims[3]:
                i3 = 0
                i2 += 1
                if i2 == dims[2]:
                    i2 = 0
                    i1 += 1
                    if i1 == dims[1]:
                        i1 = 0
                        i0 += 1


_copy_strided_parts = parallel_twin(_copy_strided, range=("first", "last"))


def layout6(dims, x_strides, out_strides):
    """Drop size-1 axes, merge axes both operands walk contiguously, pad at the front to 6 axes."""
    merged: list = []
    for d, a, b in zip(dims, x_strides, out_strides):
        if d == 1:
            continue
        if merged and merged[-1][1] == a * d and merged[-1][2] == b * d:
            merged[-1] = (merged[-1][0] * d, a, b)
        else:
            merged.append((d, a, b))
    if len(merged) > COPY_DIMS:
        raise ValueError(f"a strided copy over {len(merged)} axes {tuple(dims)} exceeds {COPY_DIMS}")
    pad = [(1, 0, 0)] * (COPY_DIMS - len(merged))
    rows = pad + merged
    return (np.array([r[0] for r in rows], np.int64), np.array([r[1] for r in rows], np.int64),
            np.array([r[2] for r in rows], np.int64))


def copy_call(x, x_start, x_strides, out, out_start, out_strides, dims, accumulate=False, threads=1):
    """The strided copy's call; with threads, split into parts of its rows unless it accumulates (rows of an
    accumulation may add into the same elements)."""
    d, sx, so = layout6(dims, x_strides, out_strides)
    rows = int(np.prod(d[:5]))
    call = (_copy_strided, (flat(x), int(x_start), sx, flat(out), int(out_start), so, d, bool(accumulate), 0, rows))
    return call if accumulate else split(call, rows, int(np.prod(d)), threads)


# ---- gathers and sums ------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def _gather_strided(x, out, dims, sx, scale):
    """out (flat, C order over dims) = x[strided] · scale: transpose, expand."""
    k = 0
    inner = dims[3]
    for i0 in range(dims[0]):
        for i1 in range(dims[1]):
            for i2 in range(dims[2]):
                ix = i0 * sx[0] + i1 * sx[1] + i2 * sx[2]
                target = out[k:k + inner]
                if sx[3] == 1:  # a contiguous run (a bias row, an expand's rows): slices, so it vectorises
                    source = x[ix:ix + inner]
                    for i3 in range(inner):
                        target[i3] = source[i3] * scale
                else:
                    for i3 in range(inner):
                        target[i3] = x[ix + i3 * sx[3]] * scale
                k += inner


def gather_call(x: np.ndarray, out: np.ndarray, dims, strides, scale: float = 1.0):
    return (_gather_strided, (flat(x), flat(out), dims, strides, out.dtype.type(scale)))


@njit(cache=True, error_model="numpy", fastmath={"reassoc"})
def _sum_strided(x, out, dims, sx, so, scale):
    """out[strided] = scale · Σ x[strided] over the axes where out's stride is 0 (a 4-D layout).

    The innermost axis is a run: added into a run of out (a summed outer axis: a bias gradient, the
    repeated heads of grouped-query attention) or summed into one value (a summed last axis). Unit-stride
    runs go through slices, whose indices LLVM knows are in range, so they vectorise."""
    for i in range(out.size):
        out[i] = 0
    n = dims[3]
    for i0 in range(dims[0]):
        for i1 in range(dims[1]):
            for i2 in range(dims[2]):
                ix = i0 * sx[0] + i1 * sx[1] + i2 * sx[2]
                io = i0 * so[0] + i1 * so[1] + i2 * so[2]
                if so[3] == 0:
                    total = x[ix] * 0
                    if sx[3] == 1:
                        source = x[ix:ix + n]
                        for k in range(n):
                            total += source[k]
                    else:
                        for k in range(n):
                            total += x[ix + k * sx[3]]
                    out[io] += total
                elif sx[3] == 1 and so[3] == 1:
                    target, source = out[io:io + n], x[ix:ix + n]
                    for k in range(n):
                        target[k] += source[k]
                else:
                    for k in range(n):
                        out[io + k * so[3]] += x[ix + k * sx[3]]
    if scale != 1.0:
        for i in range(out.size):
            out[i] *= scale


def sum_call(x: np.ndarray, out: np.ndarray, kept_shape: tuple, scale: float):
    """Sum x over the axes where `kept_shape` (out's shape with reduced axes as 1) is 1."""
    if x.size == out.size:
        return [copy_call(x, 0, [1], out, 0, [1], [x.size])] if scale == 1.0 else \
            [gather_call(x, out, *coalesce(x.shape, element_strides(x.shape, x.shape)), scale)]
    dims, sx, so = coalesce(x.shape, element_strides(x.shape, x.shape), element_strides(kept_shape, x.shape))
    return [(_sum_strided, (flat(x), flat(out), dims, sx, so, out.dtype.type(scale)))]


def same_buffer(x: np.ndarray, y: np.ndarray) -> bool:
    """Whether two arena views are one buffer (the planner put an output over its input)."""
    return x.size == y.size and x.size > 0 and x.ctypes.data == y.ctypes.data
