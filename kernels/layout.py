"""Strided layouts for broadcasting, transposing and reducing, computed in Python.

A layout describes an iteration over a (coalesced) 4-D index space `dims`,
with one element-stride vector per operand (0 where the operand is
broadcast). Adjacent axes merge when every operand's strides allow it, so
most real cases become 1 or 2 loops.
"""
from __future__ import annotations

import numpy as np

MAX_DIMS = 4


def element_strides(shape: tuple, full_shape: tuple) -> list[int]:
    """C-order element strides of `shape` seen in `full_shape` (0 on broadcast axes)."""
    rank = len(full_shape)
    padded = (1,) * (rank - len(shape)) + tuple(shape)
    strides, step = [0] * rank, 1
    for axis in range(rank - 1, -1, -1):
        strides[axis] = 0 if padded[axis] == 1 and full_shape[axis] != 1 else step
        step *= padded[axis]
    return strides


def coalesce(dims, *stride_lists):
    """Merge axes and drop size-1 ones; returns int64 arrays padded at the front to MAX_DIMS."""
    kept = [(d, [s[a] for s in stride_lists]) for a, d in enumerate(dims) if d != 1]
    merged: list = []
    for d, strides in kept:
        if merged:
            prev_d, prev_strides = merged[-1]
            if all(ps == s * d for ps, s in zip(prev_strides, strides)):
                merged[-1] = (prev_d * d, strides)
                continue
        merged.append((d, strides))
    if len(merged) > MAX_DIMS:
        raise ValueError(f"a broadcast over {len(merged)} non-mergeable axes {dims} exceeds {MAX_DIMS}")
    pad = MAX_DIMS - len(merged)
    out_dims = np.array([1] * pad + [d for d, _ in merged], dtype=np.int64)
    outs = [np.array([0] * pad + [s[k] for _, s in merged], dtype=np.int64) for k in range(len(stride_lists))]
    return (out_dims, *outs)


def broadcast_layout(out_shape: tuple, *operand_shapes: tuple):
    """(dims, strides of out, strides of each operand) for out = f(operands...)."""
    out_strides = element_strides(out_shape, out_shape)
    return coalesce(tuple(out_shape), out_strides, *(element_strides(s, out_shape) for s in operand_shapes))


def flat(array: np.ndarray) -> np.ndarray:
    """A 1-D view of a C-contiguous array (never a copy)."""
    view = array.reshape(-1)
    assert np.shares_memory(view, array) or array.size == 0
    return view


def float_buffers(scratch: np.ndarray, *sizes: int) -> list:
    """Consecutive float32 buffers of the given sizes, carved out of a node's arena scratch."""
    memory = scratch.view(np.float32)
    buffers, start = [], 0
    for size in sizes:
        buffers.append(memory[start:start + size])
        start += size
    return buffers


def promoted_shapes(a_shape: tuple, b_shape: tuple, y_shape: tuple):
    """MatMul's operands as matrices (1-D promoted) and the output shape that goes with them."""
    a2 = (1,) + tuple(a_shape) if len(a_shape) == 1 else tuple(a_shape)
    b2 = tuple(b_shape) + (1,) if len(b_shape) == 1 else tuple(b_shape)
    y2 = tuple(y_shape)
    if len(a_shape) == 1:
        y2 = y2[:len(y2) - (0 if len(b_shape) == 1 else 1)] + (1,) + y2[len(y2) - (0 if len(b_shape) == 1 else 1):]
    if len(b_shape) == 1:
        y2 = y2 + (1,)
    return a2, b2, y2
