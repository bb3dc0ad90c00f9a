"""Frozen weights stored as int8 (float32 scales along one axis), int4 (packed two a byte, a float32 scale per
block of `group` values along one axis) or bfloat16, read a panel at a time: the dequantization and the
panel-by-panel product that kernels/dequantized.py's DequantizedMatMul and DequantizedGather and
kernels/training.py's vocabulary product with its loss share.

- `stored_values(w)`: the weight's elements as numbers Numba reads, and the stored type (INT8, BFLOAT16, INT4);
- `dequantize_panel`: rows x columns of the stored weight into a float32 panel (rows as slices, so LLVM
  vectorises them; bfloat16 through the panel's uint32 view, int4 a byte, two values, at a time);
- `panel_product`: a product with the stored weight over a range of its rows and columns, a panel of at most
  PANEL_ELEMENTS floats at a time (`_tile`), each panel dequantized into scratch and multiplied by BLAS
  (blas.gemm_blocks), so the float32 weight exists one panel at a time.

Kernels read no globals: the stored type is an argument. Imports numpy and the base modules jit, blas, layout.
"""
from __future__ import annotations

import numpy as np

from .jit import njit

from .blas import gemm_blocks
from .layout import flat

INT8, BFLOAT16, INT4 = 0, 1, 2
PANEL_ELEMENTS = 1 << 16


@njit(cache=True, error_model="numpy", inline="always")
def _int4_run(w, start, target):
    """target[k] = the signed 4-bit value of element start + k of the packed bytes w, as float32."""
    n = target.size
    k = 0
    if start % 2 == 1 and n > 0:  # the run starts in a byte's high nibble
        target[0] = np.float32(((np.int32(w[start >> 1]) >> 4) ^ 8) - 8)
        k = 1
    pairs = (n - k) // 2
    source = w[(start + k) >> 1:((start + k) >> 1) + pairs]
    out = target[k:k + 2 * pairs]
    for p in range(pairs):
        b = np.int32(source[p])
        out[2 * p] = np.float32(((b & 15) ^ 8) - 8)
        out[2 * p + 1] = np.float32(((b >> 4) ^ 8) - 8)
    if k + 2 * pairs < n:  # the run ends in a byte's low nibble
        target[n - 1] = np.float32(((np.int32(w[(start + n - 1) >> 1]) & 15) ^ 8) - 8)


@njit(cache=True, error_model="numpy", inline="always")
def _dequantize_int4_row(w, scale, axis, group, row, c0, c1, columns, target):
    """target[j - c0] = dequant(w[row, j]) for columns [c0, c1) of a 4-bit weight in blocks of `group` values
    along `axis`."""
    _int4_run(w, row * columns + c0, target)
    if axis == 1:  # scale [rows, blocks]: one value for each run of `group` columns
        blocks = (columns + group - 1) // group
        j = c0
        while j < c1:
            end = min(c1, (j // group + 1) * group)
            s = scale[row * blocks + j // group]
            run = target[j - c0:end - c0]
            for t in range(end - j):
                run[t] *= s
            j = end
    else:  # scale [⌈rows / group⌉, columns]: the row's block's scales, one a column
        scales = scale[(row // group) * columns + c0:(row // group) * columns + c1]
        for j in range(c1 - c0):
            target[j] *= scales[j]


@njit(cache=True, error_model="numpy", inline="always")
def dequantize_panel(w, scale, axis, stored, group, first, count, c0, c1, columns, panel, bits):
    """panel[i, j - c0] = dequant(w[first + i, j]) for rows [first, first + count), columns [c0, c1). Rows are
    read and written as slices indexed from 0, which LLVM vectorises (an indexed loop stays scalar)."""
    width = c1 - c0
    per_index = scale.size > 1
    for i in range(count):
        if stored == INT4:
            _dequantize_int4_row(w, scale, axis, group, first + i, c0, c1, columns, panel[i * width:(i + 1) * width])
            continue
        source = w[(first + i) * columns + c0:(first + i) * columns + c1]
        if stored == BFLOAT16:
            target_bits = bits[i * width:(i + 1) * width]
            for j in range(width):
                target_bits[j] = np.uint32(source[j]) << np.uint32(16)
            continue
        target = panel[i * width:(i + 1) * width]
        if axis == 0 or not per_index:
            s = scale[first + i] if per_index else scale[0]
            for j in range(width):
                target[j] = np.float32(source[j]) * s
        else:
            scales = scale[c0:c1]
            for j in range(width):
                target[j] = np.float32(source[j]) * scales[j]


@njit(cache=True, error_model="numpy", inline="always")
def _tile(rows, columns, group, size):
    """(rows, columns) of a panel of at most `size` floats over `rows` x `columns` stored values: 128 rows, or
    more when the columns are fewer than size / 128; the columns the rest of the panel, in whole blocks of
    `group` (int4) and whole vectors of 16 floats when the panel cuts the row.

    Panels of many rows keep BLAS near its peak in both orientations: with transB the panel's rows are the
    product's output columns (a panel of a few wide rows makes a thin product that repacks A for little
    work), without it they are the product's depth (a shallow product reads and writes its output block for
    little work). Whole rows of a wide weight (a few rows a panel) were the slow case
    (benchmarks/decoders/int4_product.py times both against sgemm on the float32 weight)."""
    tile_rows = min(rows, max(min(128, size), size // max(columns, 1)))
    tile_columns = min(columns, max(1, size // max(tile_rows, 1)))
    unit = 16
    while group > 0 and unit % group != 0:  # the least multiple of 16 made of whole blocks
        unit += 16
    if tile_columns < columns and tile_columns >= unit:
        tile_columns -= tile_columns % unit
    return tile_rows, tile_columns


@njit(cache=True, error_model="numpy")
def panel_product(a, w, scale, axis, stored, group, out, m, rows, columns, trans_b, panel, bits, r0, r1, c0, c1):
    """The product over stored rows [r0, r1) and columns [c0, c1), a panel of rows x columns at a time (_tile):
    - transB: out[:, rows] = sum over the column tiles of a[:, columns] · panelᵀ (beta 0 for the first);
    - else: out[:, columns] = sum over the row tiles of a[:, rows] · panel (beta 0 for the first)."""
    if trans_b == 0 and r1 == r0:  # an empty sum
        for i in range(m):
            out[i * columns + c0:i * columns + c1] = 0
    if trans_b and c1 == c0:
        for i in range(m):
            out[i * rows + r0:i * rows + r1] = 0
    if r1 == r0 or c1 == c0:
        return
    tile_rows, tile_columns = _tile(r1 - r0, c1 - c0, group, panel.size)
    if trans_b:
        for first in range(r0, r1, tile_rows):
            count = min(tile_rows, r1 - first)
            for lo in range(c0, c1, tile_columns):
                hi = min(c1, lo + tile_columns)
                dequantize_panel(w, scale, axis, stored, group, first, count, lo, hi, columns, panel, bits)
                gemm_blocks(0, 1, m, count, hi - lo, 1.0, a, lo, columns, panel, 0, hi - lo,
                            0.0 if lo == c0 else 1.0, out, first, rows)
    else:
        for lo in range(c0, c1, tile_columns):
            hi = min(c1, lo + tile_columns)
            for first in range(r0, r1, tile_rows):
                count = min(tile_rows, r1 - first)
                dequantize_panel(w, scale, axis, stored, group, first, count, lo, hi, columns, panel, bits)
                gemm_blocks(0, 0, m, hi - lo, count, 1.0, a, first, rows, panel, 0, hi - lo,
                            0.0 if first == r0 else 1.0, out, lo, columns)


def stored_values(w):
    """(the weight's elements as numbers Numba reads, the stored type); a 4-bit weight (graph/int4.py's
    PackedInt4) gives its packed bytes."""
    packed = getattr(w, "packed", None)
    if packed is not None:
        return packed, INT4
    if w.dtype == np.int8:
        return flat(w), INT8
    return flat(w).view(np.uint16), BFLOAT16
