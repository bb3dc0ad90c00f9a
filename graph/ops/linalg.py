"""Matrix products: Gemm and MatMul, with their gradients as products again.

Gemm: Y = alpha · A' · B' + beta · C, where A' = Aᵀ if transA, B' = Bᵀ if transB.
MatMul: numpy matmul semantics, batch dimensions broadcast.
"""
from __future__ import annotations

from ..errors import ModelError
from ..ir import TensorType
from . import broadcast_shapes, grad, op


@op("Gemm")
def _gemm_rule(node, types, consts):
    a, b = types[0], types[1]
    if a.shape is None or b.shape is None:
        return [TensorType(a.dtype, None)]
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise ModelError(f"{node.describe()}: Gemm needs 2-D inputs, got {a} and {b}")
    m, k = a.shape[::-1] if node.attrs.get("transA", 0) else a.shape
    k2, n = b.shape[::-1] if node.attrs.get("transB", 0) else b.shape
    if isinstance(k, int) and isinstance(k2, int) and k != k2:
        raise ModelError(f"{node.describe()}: inner dimensions differ ({a} · {b}, transA/transB applied)")
    return [TensorType(a.dtype, (m, n))]


@grad("Gemm")
def _gemm_grad(ctx):
    trans_a, trans_b = ctx.attr("transA", 0), ctx.attr("transB", 0)
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    dy, a, b = ctx.GO(0), ctx.I(0), ctx.I(1)
    if ctx.needs(0):
        if not trans_a:  # dA = alpha · dY · B'ᵀ
            ctx.set_grad(0, ctx.emit("Gemm", [dy, b], {"alpha": alpha, "transB": 0 if trans_b else 1}))
        else:  # dA = alpha · B' · dYᵀ
            ctx.set_grad(0, ctx.emit("Gemm", [b, dy], {"alpha": alpha, "transA": trans_b, "transB": 1}))
    if ctx.needs(1):
        if not trans_b:  # dB = alpha · A'ᵀ · dY
            ctx.set_grad(1, ctx.emit("Gemm", [a, dy], {"alpha": alpha, "transA": 0 if trans_a else 1}))
        else:  # dB = alpha · dYᵀ · A'
            ctx.set_grad(1, ctx.emit("Gemm", [dy, a], {"alpha": alpha, "transA": 1, "transB": trans_a}))
    if ctx.needs(2):  # dC = beta · dY, summed to C's shape
        scaled = dy if beta == 1.0 else ctx.emit("Mul", [dy, ctx.constant(beta, "beta")])
        ctx.set_grad(2, ctx.sum_to_input(scaled, 2))


@op("MatMul")
def _matmul_rule(node, types, consts):
    a, b = types[0], types[1]
    if a.shape is None or b.shape is None:
        return [TensorType(a.dtype, None)]
    sa, sb = a.shape, b.shape
    if len(sa) < 2 or len(sb) < 2:
        raise ModelError(f"{node.describe()}: MatMul of 1-D inputs is not supported yet ({a}, {b})")
    if isinstance(sa[-1], int) and isinstance(sb[-2], int) and sa[-1] != sb[-2]:
        raise ModelError(f"{node.describe()}: inner dimensions differ ({a} · {b})")
    batch = broadcast_shapes(sa[:-2], sb[:-2])
    return [TensorType(a.dtype, batch + (sa[-2], sb[-1]))]


@grad("MatMul")
def _matmul_grad(ctx):  # dA = dY · Bᵀ, dB = Aᵀ · dY, each summed over broadcast batch dims
    dy, a, b = ctx.GO(0), ctx.I(0), ctx.I(1)

    def transposed(name):
        rank = ctx.rank(name)
        perm = list(range(rank - 2)) + [rank - 1, rank - 2]
        return ctx.emit("Transpose", [name], {"perm": perm})

    if ctx.needs(0):
        ctx.set_grad(0, ctx.sum_to_input(ctx.emit("MatMul", [dy, transposed(b)]), 0))
    if ctx.needs(1):
        ctx.set_grad(1, ctx.sum_to_input(ctx.emit("MatMul", [transposed(a), dy]), 1))
