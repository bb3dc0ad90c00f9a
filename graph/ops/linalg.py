"""Matrix products: Gemm, MatMul and Einsum, with their gradients as products again.

Gemm: Y = alpha · A' · B' + beta · C, where A' = Aᵀ if transA, B' = Bᵀ if transB.
MatMul: numpy matmul semantics, batch dimensions broadcast, 1-D operands promoted.
Its gradients are `MatMulGradA`/`MatMulGradB`: BLAS products with transpose flags
(no transposed copies), the broadcast batch axes summed by accumulating products.
Einsum: one or two operands (a transpose, a sum, a diagonal, or a contraction that
BLAS runs as a batched product); its gradient is an Einsum of dY with the other
operand onto the operand's labels (dA of "ij,jk->ik" is "ik,jk->ij"), broadcast
over the labels neither has (the summed axes of "ij->i").
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ModelError, UnsupportedOpError
from ..ir import ODTRAIN_DOMAIN, TensorType
from .registry import broadcast_shapes, grad, op


def _gemm_flops(node, types, out) -> float:
    a = types[0].shape
    return 2.0 * out.size * (a[0] if node.attrs.get("transA", 0) else a[-1])


@op("Gemm", flops=_gemm_flops)
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


def matmul_shape(node, sa: tuple, sb: tuple) -> tuple:
    """numpy.matmul's output shape: 1-D operands are promoted to matrices, then their added axis dropped."""
    if not sa or not sb:
        raise ModelError(f"{node.describe()}: MatMul of a scalar")
    pa = (1,) + tuple(sa) if len(sa) == 1 else tuple(sa)
    pb = tuple(sb) + (1,) if len(sb) == 1 else tuple(sb)
    if isinstance(pa[-1], int) and isinstance(pb[-2], int) and pa[-1] != pb[-2]:
        raise ModelError(f"{node.describe()}: inner dimensions differ ({list(sa)} · {list(sb)})")
    try:
        batch = broadcast_shapes(pa[:-2], pb[:-2])
    except ValueError as error:
        raise ModelError(f"{node.describe()}: batch dimensions of {list(sa)} and {list(sb)} do not broadcast ({error})") from None
    return batch + ((pa[-2],) if len(sa) > 1 else ()) + ((pb[-1],) if len(sb) > 1 else ())


def _matmul_flops(node, types, out) -> float:
    a, b = types[0].shape, types[1].shape
    return 2.0 * math.prod(matmul_shape(node, a, b)) * (a[-1] if a else 1)


@op("MatMul", flops=_matmul_flops)
def _matmul_rule(node, types, consts):
    a, b = types[0], types[1]
    if a.shape is None or b.shape is None:
        return [TensorType(a.dtype, None)]
    if consts[0] is not None and consts[1] is not None:
        value = np.asarray(np.matmul(consts[0], consts[1]), order="C")
        return [TensorType(value.dtype, value.shape)], [value]
    return [TensorType(a.dtype, matmul_shape(node, a.shape, b.shape))]


@grad("MatMul")
def _matmul_grad(ctx):  # dA = dY · Bᵀ, dB = Aᵀ · dY, each summed over the batch axes its input broadcast along
    dy, a, b = ctx.GO(0), ctx.I(0), ctx.I(1)
    if ctx.needs(0):
        ctx.set_grad(0, ctx.odtrain("MatMulGradA", [dy, b, a]))
    if ctx.needs(1):
        ctx.set_grad(1, ctx.odtrain("MatMulGradB", [a, dy, b]))


# MatMulGradA(dY, B, A) -> dA and MatMulGradB(A, dY, B) -> dB: products with a transposed operand, batch
# axes summed where the input was broadcast; the last input is read for its shape only. Each does as many
# operations as the forward MatMul(A, B) (`gradient_product`: the positions of A and B among its inputs, then dY's).
@op("MatMulGradA", ODTRAIN_DOMAIN, shape_only=(2,), gradient_product=("MatMul", 2, 1, 0))
def _matmul_grad_a_rule(node, types, consts):
    return [types[2]]


@op("MatMulGradB", ODTRAIN_DOMAIN, shape_only=(2,), gradient_product=("MatMul", 0, 2, 1))
def _matmul_grad_b_rule(node, types, consts):
    return [types[2]]


def _permuted(shape: tuple, perm) -> tuple:
    return tuple(shape) if perm is None else tuple(shape[p] for p in perm)


def _inverse(perm) -> list[int] | None:
    return None if perm is None else [int(p) for p in np.argsort(perm)]


def fused_matmul_shape(node, sa: tuple, sb: tuple) -> tuple:
    """The product's shape (before permY), from the operands' shapes (before permA/permB)."""
    sa, sb = _permuted(sa, node.attrs.get("permA")), _permuted(sb, node.attrs.get("permB"))
    if len(sa) < 2 or len(sb) < 2:
        raise ModelError(f"{node.describe()}: FusedMatMul needs operands of rank 2 or more ({list(sa)}, {list(sb)})")
    m, k = (sa[-1], sa[-2]) if node.attrs.get("transA", 0) else (sa[-2], sa[-1])
    k2, n = (sb[-1], sb[-2]) if node.attrs.get("transB", 0) else (sb[-2], sb[-1])
    if isinstance(k, int) and isinstance(k2, int) and k != k2:
        raise ModelError(f"{node.describe()}: inner dimensions differ ({list(sa)} · {list(sb)}, transposes applied)")
    return broadcast_shapes(sa[:-2], sb[:-2]) + (m, n)


# FusedMatMul(A, B[, like[, bias]]) = alpha · op(A') · op(B') (+ bias), batch axes broadcast, where op
# transposes the last two axes (transA/transB) and A' = transpose(A, permA), B' = transpose(B, permB)
# (identity when absent); the output is stored as transpose(product, permY). BLAS reads and writes those
# layouts through strides: no transposed copy is made. With `like` (read for its shape only) the product
# is summed over the batch axes that `like` does not have (the gradient of a broadcast operand) and the
# output has like's shape. `bias` (numpy-broadcast to the output, never past it) starts the output, and
# BLAS adds the product to it (beta = 1): no pass of its own. ONNX Runtime's com.microsoft op of the same
# name is the case without perms, `like` or bias. Graph fusion (graph/fusion.py) makes it from
# MatMul(A, Transpose(W)), MatMul · scalar, Add(product, bias), and the head transposes of attention.
def _fused_matmul_flops(node, types, out) -> float:  # the product before any sum over broadcast axes, A through permA
    a, b = types[0].shape, types[1].shape
    perm = node.attrs.get("permA")
    a_seen = tuple(a[p] for p in perm) if perm is not None else tuple(a)
    inner = a_seen[-2] if node.attrs.get("transA", 0) else a_seen[-1]
    return 2.0 * math.prod(fused_matmul_shape(node, a, b)) * inner


@op("FusedMatMul", ODTRAIN_DOMAIN, shape_only=(2,), flops=_fused_matmul_flops)
def _fused_matmul_rule(node, types, consts):
    a, b = types[0], types[1]
    if len(types) > 2 and types[2] is not None:
        return [TensorType(a.dtype, types[2].shape)]
    if a.shape is None or b.shape is None:
        return [TensorType(a.dtype, None)]
    shape = _permuted(fused_matmul_shape(node, a.shape, b.shape), node.attrs.get("permY"))
    bias = types[3] if len(types) > 3 else None
    if bias is not None and bias.shape is not None and not adds_into(bias.shape, shape):
        raise ModelError(f"{node.describe()}: bias {bias} does not broadcast to the product's shape {list(shape)}")
    activation = node.attrs.get("activation")
    if activation is not None and activation not in EPILOGUES:
        raise ModelError(f"{node.describe()}: activation '{activation}' is not one of {sorted(EPILOGUES)}")
    # an epilogue whose gradient reads the product P outputs it too: [Y, P]
    return [TensorType(a.dtype, shape)] * (2 if EPILOGUES.get(activation) == "P" else 1)


def adds_into(bias: tuple, shape: tuple) -> bool:
    """Whether a tensor of shape `bias` broadcasts to `shape` without making it larger."""
    return len(bias) <= len(shape) and all(
        d == 1 or d == s for d, s in zip(bias[::-1], shape[::-1]))


# FusedMatMul's `activation` epilogue (graph/product_epilogues.py folds it): Y = f(product + bias), applied to
# each panel of rows while it is in the cache. The value f's gradient reads: "Y" (Relu: 0 < Y) or "P", the
# product before f (GELU), then the node's second output.
EPILOGUES = {"Relu": "Y", "Gelu": "P"}


@op("ActivationBiasGrad", ODTRAIN_DOMAIN, inplace=((0, 0),), shape_only=(2,))
def _activation_bias_grad_rule(node, types, consts):
    """ActivationBiasGrad(dY, Y or P[, bias]) -> (dP = dY·f'(P), dBias = dP summed to bias's shape)."""
    bias = types[2] if len(types) > 2 and types[2] is not None else types[0]
    return [TensorType(types[0].dtype, types[0].shape), TensorType(types[0].dtype, bias.shape)]


# Epilogues whose gradient runs as ActivationBiasGrad, one pass that also sums the bias gradient. GELU's stays
# GeluGrad and a SumToShape: its derivative (erf and exp) outweighs the pass saved, and the fused pass, split by
# columns, ran slower than the two (transformer backward, odtrain profile --clock cpu: 2.06 against 1.66 ms).
ONE_PASS_GRADIENTS = {"Relu"}


def _epilogue_gradient(ctx, activation: str) -> str:
    """The product's gradient dP from dY through the activation (and the bias gradient, when wanted)."""
    read = ctx.O(1) if EPILOGUES[activation] == "P" else ctx.O(0)
    bias = ctx.I(3) if len(ctx.node.inputs) > 3 else ""
    wants_bias = bool(bias) and ctx.needs(3)
    if activation not in ONE_PASS_GRADIENTS:  # GELU
        d_product = ctx.odtrain("GeluGrad", [ctx.GO(0), read], {"approximate": "none"})
        if wants_bias:
            ctx.set_grad(3, ctx.sum_to_input(d_product, 3))
        return d_product
    d_product, d_bias = ctx.odtrain("ActivationBiasGrad", [ctx.GO(0), read] + ([bias] if wants_bias else []),
                                    {"activation": activation}, outputs=[True, wants_bias])
    if wants_bias:
        ctx.set_grad(3, d_bias)
    return d_product


@grad("FusedMatMul", ODTRAIN_DOMAIN)
def _fused_matmul_grad(ctx):
    # P = α·op(A')·op(B'), Y = P stored through permY:  dP = dY read through permY⁻¹, then
    # dA' = α·dP·op(B')ᵀ (its transpose if transA), dB' = α·op(A')ᵀ·dP (or transposed),
    # each written back through the inverse of its operand's perm.
    activation = ctx.attr("activation")
    dy = _epilogue_gradient(ctx, activation) if activation is not None else ctx.GO(0)
    a, b = ctx.I(0), ctx.I(1)
    ta, tb, alpha = ctx.attr("transA", 0), ctx.attr("transB", 0), float(ctx.attr("alpha", 1.0))
    perm_a, perm_b, perm_y = ctx.attr("permA"), ctx.attr("permB"), ctx.attr("permY")
    perm_dy = _inverse(perm_y)

    def product(x, y, like, trans_x, trans_y, perm_x, perm_y_in, perm_out):
        attrs = {"transA": trans_x, "transB": trans_y, "alpha": alpha}
        for key, value in (("permA", perm_x), ("permB", perm_y_in), ("permY", perm_out)):
            if value is not None:
                attrs[key] = [int(p) for p in value]
        return ctx.odtrain("FusedMatMul", [x, y, like], attrs)

    if ctx.needs(0):
        out = _inverse(perm_a)
        ctx.set_grad(0, product(dy, b, a, 0, 1 - tb, perm_dy, perm_b, out) if not ta else
                     product(b, dy, a, tb, 1, perm_b, perm_dy, out))
    if ctx.needs(1):
        out = _inverse(perm_b)
        ctx.set_grad(1, product(a, dy, b, 1 - ta, 0, perm_a, perm_dy, out) if not tb else
                     product(dy, a, b, 1, ta, perm_dy, perm_a, out))
    if ctx.needs(3) and activation is None:  # dBias = dY, summed over the axes the bias was broadcast along
        ctx.set_grad(3, ctx.sum_to_input(dy, 3))


def einsum_terms(node, ranks: list[int]) -> tuple[list[str], str]:
    """Einsum's operand terms and output term, with '...' spelled out as letters the equation does not
    use (the same letters for the same broadcast axes, aligned at the right) and an implicit output
    made explicit (the broadcast axes, then the letters used once, in alphabetical order)."""
    equation = node.attrs.get("equation", "")
    equation = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "")
    left, arrow, right = equation.partition("->")
    terms = left.split(",")
    if len(terms) != len(ranks):
        raise ModelError(f"{node.describe()}: equation '{equation}' names {len(terms)} operands, it has {len(ranks)}")
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in equation]
    width = max([rank - len(t.replace("...", "")) for t, rank in zip(terms, ranks) if "..." in t], default=0)
    broadcast = "".join(spare[:width])
    spelled = [t.replace("...", broadcast[width - (rank - len(t.replace("...", ""))):])
               for t, rank in zip(terms, ranks)]
    for term, rank in zip(spelled, ranks):
        if len(term) != rank or not term.isalpha() and term:
            raise ModelError(f"{node.describe()}: equation '{equation}' does not fit operands of ranks {ranks}")
    if arrow:
        output = right.replace("...", broadcast)
    else:
        output = broadcast + "".join(sorted(c for c in set(left) if c.isalpha() and left.count(c) == 1))
    if len(set(output)) != len(output) or not set(output) <= set("".join(spelled)):
        raise ModelError(f"{node.describe()}: the output of '{equation}' repeats a label or names one no operand has")
    return spelled, output


@op("Einsum")
def _einsum_rule(node, types, consts):
    if len(types) > 2:
        raise UnsupportedOpError(f"{node.describe()}: Einsum of {len(types)} operands; odtrain runs one or two "
                                 "(split the equation into pairwise Einsums)")
    if any(t.shape is None for t in types):
        return [TensorType(types[0].dtype, None)]
    terms, output = einsum_terms(node, [len(t.shape) for t in types])
    sizes: dict[str, int | str] = {}
    for term, t in zip(terms, types):
        for label, d in zip(term, t.shape):
            known = sizes.setdefault(label, d)
            if known == 1:
                sizes[label] = d
            elif d != 1 and d != known and isinstance(d, int) and isinstance(known, int):
                raise ModelError(f"{node.describe()}: label '{label}' stands for axes of sizes {known} and {d}")
    return [TensorType(types[0].dtype, tuple(sizes[label] for label in output))]


@grad("Einsum")
def _einsum_grad(ctx):  # dX_i = einsum(dY, the other operand -> X_i's labels), broadcast over labels they lack
    terms, output = einsum_terms(ctx.node, [ctx.rank(name) for name in ctx.node.inputs])
    for i, term in enumerate(terms):
        if not ctx.needs(i):
            continue
        if len(set(term)) != len(term):
            raise UnsupportedOpError(f"{ctx.node.describe()}: no gradient through a diagonal (a label repeated in "
                                     f"operand {i})")
        sources = [(output, ctx.GO(0))] + [(t, ctx.I(j)) for j, t in enumerate(terms) if j != i]
        known = set("".join(t for t, _ in sources))
        kept = "".join(label for label in term if label in known)
        equation = ",".join(t for t, _ in sources) + "->" + kept
        grad_name = ctx.emit("Einsum", [name for _, name in sources], {"equation": equation})
        if kept != term:  # labels only X_i has: dY does not depend on where along them, so dX repeats along them
            axes = [axis for axis, label in enumerate(term) if label not in known]
            sizes = ctx.emit("Gather", [ctx.emit("Shape", [ctx.I(i)]), ctx.constant(np.array(axes, np.int64), "axes")])
            ones = ctx.emit("Expand", [ctx.constant(np.ones((), np.float32), "one"), sizes])
            missing = "".join(term[axis] for axis in axes)
            grad_name = ctx.emit("Einsum", [grad_name, ones], {"equation": f"{kept},{missing}->{term}"})
        ctx.set_grad(i, ctx.sum_to_input(grad_name, i))
