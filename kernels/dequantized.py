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
from .layout import flat
from .parallel_split import on_parts, part_count, twin_of
from .stored_weights import PANEL_ELEMENTS, dequantize_panel, panel_product, stored_values

@twin_of(panel_product, range=("r0", "r1", "c0", "c1"), replaces=("panel", "bits"), takes=("panels", "bits"),
         because="each part dequantizes into its own panel, over rows with transB, else columns")
@njit(cache=True, error_model="numpy", parallel=True)
def _product_parts(a, w, scale, axis, stored, group, out, m, rows, columns, trans_b, panels, bits, bounds):
    """panel_product on parts (bounds: of rows with transB, else of columns), each with its own panel."""
    size = panels.size // (bounds.size - 1)
    for p in prange(bounds.size - 1):
        panel, own = panels[p * size:(p + 1) * size], bits[p * size:(p + 1) * size]
        if trans_b:
            panel_product(a, w, scale, axis, stored, group, out, m, rows, columns, trans_b, panel, own,
                          bounds[p], bounds[p + 1], 0, columns)
        else:
            panel_product(a, w, scale, axis, stored, group, out, m, rows, columns, trans_b, panel, own, 0,
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


def _scale(inputs) -> np.ndarray:
    return flat(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else np.ones(1, np.float32)


@binding("DequantizedMatMul", ODTRAIN_DOMAIN, scratch=_product_scratch, parallel=True)
def DequantizedMatMul(inputs, outputs, transB=0, axis=0, threads=1, scratch=None, block_size=0):
    a, w, out = inputs[0], inputs[1], outputs[0]
    rows, columns = (int(d) for d in w.shape)
    m = int(out.size // (rows if transB else columns)) if out.size else 0
    if m == 0:
        return []
    values, stored = stored_values(w)
    parts, size = _panels(rows, columns, int(transB), m, threads)
    panels = scratch.view(np.float32)
    bits = scratch.view(np.uint32)
    args = (flat(a), values, _scale(inputs), int(axis), stored, int(block_size), flat(out), m, rows, columns,
            int(transB))
    serial = (panel_product, args + (panels[:size], bits[:size], 0, rows, 0, columns))
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
        dequantize_panel(w, scale, axis, stored, group, k, 1, 0, columns, columns,
                          out[j * columns:(j + 1) * columns], bits[j * columns:(j + 1) * columns])


@binding("DequantizedGather", ODTRAIN_DOMAIN)
def DequantizedGather(inputs, outputs, axis=0, block_size=0):
    w, indices, out = inputs[0], inputs[1], outputs[0]
    values, stored = stored_values(w)
    rows, columns = (int(d) for d in w.shape)
    target = flat(out)
    return [(_gather_rows, (values, _scale(inputs), int(axis), stored, int(block_size), flat(indices), target, rows,
                            columns, target.view(np.uint32)))]
