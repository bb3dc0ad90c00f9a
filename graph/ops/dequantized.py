"""Products and gathers that read a frozen weight stored in fewer bytes (graph/frozen.py), dequantizing it a
panel at a time: the float32 weight never exists whole.

The weight W [R, C] is int8 with one float32 scale per index of `axis` (0: per row, 1: per column), int4
with one float32 scale per block of `block_size` values along `axis` (the scale [R, ⌈C / block_size⌉] for
axis 1, [⌈R / block_size⌉, C] for axis 0; graph/int4.py), or bfloat16 (no scale input); dequant(W) =
W · scale, or W's bfloat16 values.

- DequantizedMatMul(A, W[, scale]) = A · dequant(W) (transB=0: A [..., R], Y [..., C]) or
  A · dequant(W)ᵀ (transB=1: A [..., C], Y [..., R]). Its gradient to A is the same op with transB
  flipped: dA = dY · dequant(W)ᵀ, or dY · dequant(W). W and its scale are frozen: no gradient.
- DequantizedGather(W, indices[, scale]) = dequant(W)[indices] along axis 0 (an embedding): only the
  gathered rows are dequantized. No gradient reaches W; indices have none.

graph/fusion.py's `dequantized_pass` makes them from DequantizeLinear → MatMul/Gemm/Gather and
Cast(bfloat16 → float) → MatMul/Gemm/Gather in the training model.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ModelError
from ..ir import ODTRAIN_DOMAIN, TensorType
from .registry import grad, no_grad, op

FLOAT32 = np.dtype(np.float32)
STORED_TYPES = ("int8", "int4", "bfloat16")  # the element types the weight is read in
STORED_WEIGHT_READERS = {(ODTRAIN_DOMAIN, "DequantizedMatMul"), (ODTRAIN_DOMAIN, "DequantizedGather"),
                         (ODTRAIN_DOMAIN, "LinearCrossEntropy")}  # read bfloat16
FROZEN_WEIGHT = "the weight is frozen (stored int8, int4 or bfloat16); only the product's activation input trains"


def check_stored_weight(node, types, weight: int | None = None, scale: int = 2) -> tuple:
    """(rows, columns) of the stored weight (input `weight`: by default 1 of a product, 0 of a gather), after
    checking its type and its scale's (input `scale`)."""
    w = types[weight if weight is not None else (1 if node.op_type == "DequantizedMatMul" else 0)]
    scale = types[scale] if len(types) > scale else None
    if w.dtype.name not in STORED_TYPES or w.shape is None or len(w.shape) != 2:
        raise ModelError(f"{node.describe()}: its weight is {w}; it reads a 2-D int8, int4 or bfloat16 weight")
    if (w.dtype.name != "bfloat16") != (scale is not None):
        raise ModelError(f"{node.describe()}: an int8 or int4 weight takes a scale input, a bfloat16 weight none")
    block = int(node.attrs.get("block_size", 0))
    if (w.dtype.name == "int4") != (block > 0):
        raise ModelError(f"{node.describe()}: block_size={block}; an int4 weight is read in blocks "
                         "(block_size > 0), others are not")
    if block:
        axis = int(node.attrs.get("axis", 0))
        expected = tuple(-(-d // block) if a == axis else d for a, d in enumerate(w.shape))
        if axis not in (0, 1) or scale.dtype != FLOAT32 or tuple(scale.shape or ()) != expected:
            raise ModelError(f"{node.describe()}: scale {scale} is not one float32 value per block of {block} "
                             f"along axis {axis} of the weight {list(w.shape)} (expected {list(expected)})")
    elif scale is not None:
        axis = int(node.attrs.get("axis", 0))
        if axis not in (0, 1) or scale.dtype != FLOAT32 or scale.shape not in ((w.shape[axis],), (1,), ()):
            raise ModelError(f"{node.describe()}: scale {scale} is neither one float32 value nor one per index of "
                             f"the weight's axis {axis} ({w.shape[axis]})")
    return w.shape


def _matmul_flops(node, types, out) -> float:
    return 2.0 * math.prod(out.shape) * types[0].shape[-1]


@op("DequantizedMatMul", ODTRAIN_DOMAIN, flops=_matmul_flops, passes=1.25)
def _dequantized_matmul_rule(node, types, consts):
    a = types[0]
    rows, columns = check_stored_weight(node, types)
    inner, outer = (columns, rows) if node.attrs.get("transB", 0) else (rows, columns)
    if a.dtype != FLOAT32 or a.shape is None or len(a.shape) < 1:
        raise ModelError(f"{node.describe()}: its activation input is {a}; it takes float32 of rank 1 or more")
    if isinstance(a.shape[-1], int) and a.shape[-1] != inner:
        raise ModelError(f"{node.describe()}: inner dimensions differ ({a} · weight [{rows}, {columns}]"
                         f"{'ᵀ' if node.attrs.get('transB', 0) else ''})")
    return [TensorType(FLOAT32, tuple(a.shape[:-1]) + (outer,))]


@grad("DequantizedMatMul", ODTRAIN_DOMAIN)
def _dequantized_matmul_grad(ctx):
    # Y = A · op(dequant(W)):  dA = dY · op(dequant(W))ᵀ, the same product with transB flipped
    if ctx.needs(0):
        attrs = {"transB": 1 - int(ctx.attr("transB", 0)), "axis": int(ctx.attr("axis", 0))}
        if ctx.attr("block_size", 0):
            attrs["block_size"] = int(ctx.attr("block_size"))
        ctx.set_grad(0, ctx.odtrain("DequantizedMatMul", [ctx.GO(0)] + list(ctx.node.inputs[1:]), attrs))


@op("DequantizedGather", ODTRAIN_DOMAIN)
def _dequantized_gather_rule(node, types, consts):
    rows, columns = check_stored_weight(node, types)
    indices = types[1]
    if indices.dtype.kind not in "iu" or indices.shape is None:
        raise ModelError(f"{node.describe()}: its indices are {indices}; it takes integer indices")
    return [TensorType(FLOAT32, tuple(indices.shape) + (columns,))]


no_grad("DequantizedGather", FROZEN_WEIGHT + " (and indices have no gradient)", ODTRAIN_DOMAIN)
