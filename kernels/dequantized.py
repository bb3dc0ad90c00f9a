"""Products and gathers on a frozen weight stored as int8 (with float32 scales along one axis), int4 (packed
two a byte, with a float32 scale per block of `group` values along one axis) or bfloat16, dequantized a panel at
a time (graph/ops/dequantized.py).

DequantizedMatMul: the stored weight W [R, C] is cut into panels of rows x columns (_tile: 128 rows or
more, at most PANEL_ELEMENTS floats) of the part it owns; each panel is dequantized into scratch and multiplied
by BLAS (blas.gemm_blocks), so the float32 weight exists one panel at a time:
- transB=0, Y [m, C] = A [m, R] · dequant(W): for each block of columns [c, c'), the panels of rows
  [r, r + rows) add A[:, r:r + rows] · panel into Y[:, c:c'] (beta 0 for the first, then 1); parts own
  blocks of columns;
- transB=1, Y [m, R] = A [m, C] · dequant(W)ᵀ: for each block of rows [r, r + rows), the panels of columns
  [c, c') add A[:, c:c'] · panelᵀ into Y[:, r:r + rows] (beta 0 for the first); parts own blocks of rows.
Each part's panel is its own slice of the scratch. A panel of 2^16 floats (256 KiB) stays in a core's L2
cache between its dequantization and its product.

DequantizedGather: out[j, :] = dequant(W[indices[j], :]): only the gathered rows are read.

bfloat16 values are the upper 16 bits of a float32: the panel is written through a uint32 view of itself.
int4 values are ONNX's packed bytes (graph/int4.py: element e of the flattened weight in byte e // 2, the low
nibble first); a row's run of them is unpacked a byte (two values) at a time into the panel, then scaled a
block at a time (blocks along the row, axis 1) or by the row's block's scales (axis 0).
Kernels read no globals: the stored type is an argument (INT8, BFLOAT16 or INT4).
"""
from __future__ import annotations

import numpy as np

from .jit import njit, prange

from .registry import ODTRAIN_DOMAIN, binding
from .blas import gemm_blocks
from .layout import flat
from .parallel_split import on_parts, part_count, twin_of

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
def _dequantize_panel(w, scale, axis, stored, group, first, count, c0, c1, columns, panel, bits):
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
def _product_part(a, w, scale, axis, stored, group, out, m, rows, columns, trans_b, panel, bits, r0, r1, c0, c1):
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
                _dequantize_panel(w, scale, axis, stored, group, first, count, lo, hi, columns, panel, bits)
                gemm_blocks(0, 1, m, count, hi - lo, 1.0, a, lo, columns, panel, 0, hi - lo,
                            0.0 if lo == c0 else 1.0, out, first, rows)
    else:
        for lo in range(c0, c1, tile_columns):
            hi = min(c1, lo + tile_columns)
            for first in range(r0, r1, tile_rows):
                count = min(tile_rows, r1 - first)
                _dequantize_panel(w, scale, axis, stored, group, first, count, lo, hi, columns, panel, bits)
                gemm_blocks(0, 0, m, hi - lo, count, 1.0, a, first, rows, panel, 0, hi - lo,
                            0.0 if first == r0 else 1.0, out, lo, columns)


@twin_of(_product_part, range=("r0", "r1", "c0", "c1"), replaces=("panel", "bits"), takes=("panels", "bits"))
@njit(cache=True, error_model="numpy", parallel=True)
def _product_parts(a, w, scale, axis, stored, group, out, m, rows, columns, trans_b, panels, bits, bounds):
    """_product_part on parts (bounds: of rows with transB, else of columns), each with its own panel."""
    size = panels.size // (bounds.size - 1)
    for p in prange(bounds.size - 1):
        panel, own = panels[p * size:(p + 1) * size], bits[p * size:(p + 1) * size]
        if trans_b:
            _product_part(a, w, scale, axis, stored, group, out, m, rows, columns, trans_b, panel, own,
                          bounds[p], bounds[p + 1], 0, columns)
        else:
            _product_part(a, w, scale, axis, stored, group, out, m, rows, columns, trans_b, panel, own, 0,
                          rows, bounds[p], bounds[p + 1])


def _panels(rows: int, columns: int, trans_b: int, m: int, threads: int):
    """(parts, floats per part's panel): parts of the rows with transB, else of the columns."""
    units = rows if trans_b else columns
    parts = part_count(threads, units // 16, m * rows * columns)
    return parts, max(1, min(PANEL_ELEMENTS, rows * columns))


def _product_scratch(input_specs, output_specs, transB=0, axis=0, threads=1, block_size=0):
    (a_shape, _), (w_shape, _) = input_specs[0], input_specs[1]
    m = int(np.prod(a_shape[:-1], dtype=np.int64))
    parts, size = _panels(int(w_shape[0]), int(w_shape[1]), int(transB), m, threads)
    return 4 * size * parts


def _stored(w):
    """(the weight's elements as numbers Numba reads, the stored type); a 4-bit weight (graph/int4.py's
    PackedInt4) gives its packed bytes."""
    packed = getattr(w, "packed", None)
    if packed is not None:
        return packed, INT4
    if w.dtype == np.int8:
        return flat(w), INT8
    return flat(w).view(np.uint16), BFLOAT16


def _scale(inputs) -> np.ndarray:
    return flat(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else np.ones(1, np.float32)


@binding("DequantizedMatMul", ODTRAIN_DOMAIN, scratch=_product_scratch, parallel=True)
def DequantizedMatMul(inputs, outputs, transB=0, axis=0, threads=1, scratch=None, block_size=0):
    a, w, out = inputs[0], inputs[1], outputs[0]
    rows, columns = (int(d) for d in w.shape)
    m = int(out.size // (rows if transB else columns)) if out.size else 0
    if m == 0:
        return []
    values, stored = _stored(w)
    parts, size = _panels(rows, columns, int(transB), m, threads)
    panels = scratch.view(np.float32)
    bits = scratch.view(np.uint32)
    args = (flat(a), values, _scale(inputs), int(axis), stored, int(block_size), flat(out), m, rows, columns,
            int(transB))
    serial = (_product_part, args + (panels[:size], bits[:size], 0, rows, 0, columns))
    return [on_parts(serial, rows if transB else columns, parts, (panels[:size * parts], bits[:size * parts]))]


@njit(cache=True, error_model="numpy")
def _gather_rows(w, scale, axis, stored, group, indices, out, rows, columns, bits):
    """out[j, :] = dequant(w[indices[j], :]) (out written through `bits`, its uint32 view, for bfloat16)."""
    for j in range(indices.size):
        k = indices[j]
        if k < 0:
            k += rows
        if k < 0 or k >= rows:
            raise ValueError("an index is outside the gathered axis")
        _dequantize_panel(w, scale, axis, stored, group, k, 1, 0, columns, columns,
                          out[j * columns:(j + 1) * columns], bits[j * columns:(j + 1) * columns])


@binding("DequantizedGather", ODTRAIN_DOMAIN)
def DequantizedGather(inputs, outputs, axis=0, block_size=0):
    w, indices, out = inputs[0], inputs[1], outputs[0]
    values, stored = _stored(w)
    rows, columns = (int(d) for d in w.shape)
    target = flat(out)
    return [(_gather_rows, (values, _scale(inputs), int(axis), stored, int(block_size), flat(indices), target, rows,
                            columns, target.view(np.uint32)))]
