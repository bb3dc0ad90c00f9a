"""Elementwise ops: numpy-broadcasting binaries, unaries, comparisons, and their gradients.

Binary ops follow ONNX multidirectional broadcasting; the gradient of a
broadcast input is reduced back to its shape by `SumToShape`. Unary
activations express their gradients through their output (ReluGrad reads
Y, not X), so the forward op may overwrite its input in place; Erf, Atan and
Gelu read X instead (ErfGrad, AtanGrad, GeluGrad).

Every op here folds to a constant when its inputs are constants (shape
arithmetic such as Gather(Shape(x)) / 2, Sqrt(Cast(...)) in exported
attention). Comparisons and logic ops give booleans and have no gradient;
BitShift and the bitwise ops take integers only and have none either. Mod
follows its divisor's sign (Python's %), or its dividend's with fmod=1 (C's
fmod); Mean is a Sum divided by the number of inputs.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ModelError
from ..ir import ODTRAIN_DOMAIN, TensorType
from . import broadcast_shapes, grad, no_grad, op, same_as_input


def _int_div(a, b):
    """ONNX integer Div truncates toward zero (numpy's // floors)."""
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q).astype(np.result_type(a, b))


def _pow(a, b):
    return np.power(a, b.astype(np.float64) if np.issubdtype(b.dtype, np.integer) else b).astype(a.dtype)


BINARY_FOLDS = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply,
    "Div": lambda a, b: _int_div(a, b) if np.issubdtype(a.dtype, np.integer) else np.divide(a, b),
    "Pow": _pow, "Equal": np.equal, "Less": np.less, "Greater": np.greater, "LessOrEqual": np.less_equal,
    "GreaterOrEqual": np.greater_equal, "And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor,
}
# Binaries whose function an attribute chooses: Mod's fmod (C's sign of the dividend, or the divisor's),
# BitShift's direction.
ATTRIBUTE_FOLDS = {
    "Mod": lambda attrs: np.fmod if attrs.get("fmod", 0) else np.mod,
    "BitShift": lambda attrs: np.left_shift if _direction(attrs) == "LEFT" else np.right_shift,
}
INTEGER_BINARIES = {"BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor"}
BINARY_FOLDS.update({"BitwiseAnd": np.bitwise_and, "BitwiseOr": np.bitwise_or, "BitwiseXor": np.bitwise_xor})
VARIADIC_FOLDS = {"Sum": np.add, "Max": np.maximum, "Min": np.minimum, "Mean": np.add}
COMPARISONS = ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor")


def _direction(attrs) -> str:
    direction = attrs.get("direction", "")
    return direction.decode() if isinstance(direction, bytes) else direction


def _broadcast_rule(node, types, consts):
    present = [t for t in types if t is not None]
    dtype = np.dtype(np.bool_) if node.op_type in COMPARISONS else present[0].dtype
    if node.op_type in INTEGER_BINARIES and dtype.kind not in "iu":
        raise ModelError(f"{node.describe()}: {node.op_type} takes integer tensors, got {present[0]}")
    if node.op_type == "BitShift" and _direction(node.attrs) not in ("LEFT", "RIGHT"):
        raise ModelError(f"{node.describe()}: direction must be 'LEFT' or 'RIGHT', got {_direction(node.attrs)!r}")
    if all(c is not None for c in consts) and consts:
        fold = BINARY_FOLDS.get(node.op_type)
        if node.op_type in ATTRIBUTE_FOLDS:
            fold = ATTRIBUTE_FOLDS[node.op_type](node.attrs)
        if fold is not None:
            value = np.asarray(fold(np.asarray(consts[0]), np.asarray(consts[1])))
        else:
            value = np.asarray(consts[0])
            for other in consts[1:]:
                value = VARIADIC_FOLDS[node.op_type](value, other)
            if node.op_type == "Mean":
                value = value / len(consts)
        value = np.asarray(value.astype(dtype), order="C")
        return [TensorType(value.dtype, value.shape)], [value]
    if any(t.shape is None for t in present):
        return [TensorType(dtype, None)]
    try:
        shape = broadcast_shapes(*(t.shape for t in present))
    except ValueError as error:
        raise ModelError(f"{node.describe()}: inputs {[str(t) for t in present]} cannot broadcast ({error})") from None
    return [TensorType(dtype, shape)]


for _name in ("Add", "Sub", "Mul", "Div"):
    op(_name, inplace=((0, 0), (0, 1)))(_broadcast_rule)
op("Sum", inplace=((0, 0),))(_broadcast_rule)
op("Pow", inplace=((0, 0),))(_broadcast_rule)
for _name in ("Max", "Min", "Mean"):
    op(_name, inplace=((0, 0),))(_broadcast_rule)
op("Mod", inplace=((0, 0), (0, 1)))(_broadcast_rule)
for _name in sorted(INTEGER_BINARIES):
    op(_name, inplace=((0, 0), (0, 1)))(_broadcast_rule)
for _name in COMPARISONS:
    op(_name)(_broadcast_rule)


def _erf(x):
    return np.vectorize(math.erf, otypes=[x.dtype])(x) if x.size else x


UNARY_FOLDS = {
    "Neg": np.negative, "Abs": np.abs, "Exp": np.exp, "Log": np.log, "Relu": lambda x: np.maximum(x, 0),
    "Sigmoid": lambda x: 1 / (1 + np.exp(-x)), "Tanh": np.tanh, "Sign": np.sign, "Sqrt": np.sqrt,
    "Reciprocal": lambda x: 1 / x, "Erf": _erf, "Atan": np.arctan, "Not": np.logical_not, "Identity": lambda x: x,
    "Floor": np.floor, "Ceil": np.ceil,
}


def _unary_rule(node, types, consts):
    if consts and consts[0] is not None:
        value = np.asarray(np.asarray(UNARY_FOLDS[node.op_type](np.asarray(consts[0]))).astype(
            np.bool_ if node.op_type == "Not" else consts[0].dtype), order="C")
        return [TensorType(value.dtype, value.shape)], [value]
    return [types[0]]


for _name in ("Neg", "Abs", "Exp", "Log", "Relu", "Sigmoid", "Tanh", "Sign", "Sqrt", "Reciprocal", "Erf", "Atan",
              "Not", "Floor", "Ceil"):
    op(_name, inplace=((0, 0),))(_unary_rule)
op("Identity", view=True)(_unary_rule)


@op("Gelu", inplace=((0, 0),))
def _gelu_rule(node, types, consts):
    if node.attrs.get("approximate", "none") not in ("none", "tanh"):
        raise ModelError(f"{node.describe()}: approximate must be 'none' or 'tanh', got {node.attrs['approximate']!r}")
    return [types[0]]


# The same GELU in odtrain's domain: what graph fusion makes of PyTorch's exported Erf form in opsets < 20.
op("Gelu", ODTRAIN_DOMAIN, inplace=((0, 0),))(_gelu_rule)


# Gradients of activations, read through the forward output Y: dX = f(dY, Y).
for _name in ("ReluGrad", "SigmoidGrad", "TanhGrad"):
    op(_name, ODTRAIN_DOMAIN, inplace=((0, 0),))(same_as_input(0))
# ... or through the forward input X: dX = f(dY, X).
for _name in ("ErfGrad", "AtanGrad", "GeluGrad"):
    op(_name, ODTRAIN_DOMAIN, inplace=((0, 0),))(same_as_input(0))


@grad("Add")
def _add_grad(ctx):  # dA = dY, dB = dY (each reduced to its input's shape)
    for i in (0, 1):
        if ctx.needs(i):
            ctx.set_grad(i, ctx.sum_to_input(ctx.GO(0), i))


@grad("Sum")
def _sum_grad(ctx):
    for i in range(len(ctx.node.inputs)):
        if ctx.needs(i):
            ctx.set_grad(i, ctx.sum_to_input(ctx.GO(0), i))


@grad("Mean")
def _mean_grad(ctx):  # dX_i = dY / n
    count = len(ctx.node.inputs)
    from .tensor import dtype_of

    share = ctx.emit("Div", [ctx.GO(0), ctx.constant(np.array(count, dtype_of(ctx, ctx.O(0)) or np.float32), "count")])
    for i in range(count):
        if ctx.needs(i):
            ctx.set_grad(i, ctx.sum_to_input(share, i))


@grad("Mod")
def _mod_grad(ctx):  # dA = dY, dB = -dY · q with q = (A - Y) / B: floor(A / B), or trunc(A / B) for fmod
    if ctx.needs(0):
        ctx.set_grad(0, ctx.sum_to_input(ctx.GO(0), 0))
    if ctx.needs(1):
        quotient = ctx.emit("Div", [ctx.emit("Sub", [ctx.I(0), ctx.O(0)]), ctx.I(1)])
        ctx.set_grad(1, ctx.sum_to_input(ctx.emit("Neg", [ctx.emit("Mul", [ctx.GO(0), quotient])]), 1))


@grad("Sub")
def _sub_grad(ctx):  # dA = dY, dB = -dY
    if ctx.needs(0):
        ctx.set_grad(0, ctx.sum_to_input(ctx.GO(0), 0))
    if ctx.needs(1):
        ctx.set_grad(1, ctx.sum_to_input(ctx.emit("Neg", [ctx.GO(0)]), 1))


@grad("Mul")
def _mul_grad(ctx):  # dA = dY * B, dB = dY * A
    for i, other in ((0, 1), (1, 0)):
        if ctx.needs(i):
            ctx.set_grad(i, ctx.sum_to_input(ctx.emit("Mul", [ctx.GO(0), ctx.I(other)]), i))


@grad("Div")
def _div_grad(ctx):  # dA = dY / B, dB = -dY * Y / B
    if ctx.needs(0):
        ctx.set_grad(0, ctx.sum_to_input(ctx.emit("Div", [ctx.GO(0), ctx.I(1)]), 0))
    if ctx.needs(1):
        scaled = ctx.emit("Div", [ctx.emit("Mul", [ctx.GO(0), ctx.O(0)]), ctx.I(1)])
        ctx.set_grad(1, ctx.sum_to_input(ctx.emit("Neg", [scaled]), 1))


@grad("Neg")
def _neg_grad(ctx):  # dX = -dY
    ctx.set_grad(0, ctx.emit("Neg", [ctx.GO(0)]))


@grad("Identity")
def _identity_grad(ctx):  # dX = dY
    ctx.set_grad(0, ctx.GO(0))


@grad("Abs")
def _abs_grad(ctx):  # dX = dY * sign(X)
    ctx.set_grad(0, ctx.emit("Mul", [ctx.GO(0), ctx.emit("Sign", [ctx.I(0)])]))


@grad("Exp")
def _exp_grad(ctx):  # dX = dY * Y
    ctx.set_grad(0, ctx.emit("Mul", [ctx.GO(0), ctx.O(0)]))


@grad("Log")
def _log_grad(ctx):  # dX = dY / X
    ctx.set_grad(0, ctx.emit("Div", [ctx.GO(0), ctx.I(0)]))


@grad("Sqrt")
def _sqrt_grad(ctx):  # dX = dY / (2 Y) = (dY * 0.5) / Y
    half = ctx.constant(0.5, "half")
    ctx.set_grad(0, ctx.emit("Div", [ctx.emit("Mul", [ctx.GO(0), half]), ctx.O(0)]))


@grad("Reciprocal")
def _reciprocal_grad(ctx):  # dX = -dY * Y * Y
    ctx.set_grad(0, ctx.emit("Neg", [ctx.emit("Mul", [ctx.emit("Mul", [ctx.GO(0), ctx.O(0)]), ctx.O(0)])]))


@grad("Relu")
def _relu_grad(ctx):  # dX = dY * (Y > 0)
    ctx.set_grad(0, ctx.odtrain("ReluGrad", [ctx.GO(0), ctx.O(0)]))


@grad("Sigmoid")
def _sigmoid_grad(ctx):  # dX = dY * Y * (1 - Y)
    ctx.set_grad(0, ctx.odtrain("SigmoidGrad", [ctx.GO(0), ctx.O(0)]))


@grad("Tanh")
def _tanh_grad(ctx):  # dX = dY * (1 - Y²)
    ctx.set_grad(0, ctx.odtrain("TanhGrad", [ctx.GO(0), ctx.O(0)]))


no_grad("Sign", "it is piecewise constant: its derivative is zero wherever it exists")
no_grad("Floor", "it is piecewise constant: its derivative is zero wherever it exists")
no_grad("Ceil", "it is piecewise constant: its derivative is zero wherever it exists")
for _name in COMPARISONS:
    no_grad(_name, "its output is boolean")
for _name in INTEGER_BINARIES:
    no_grad(_name, "it works on the bits of integers")
no_grad("Not", "its output is boolean")


@grad("Erf")
def _erf_grad(ctx):  # dX = dY · 2/√π · exp(-X²)
    ctx.set_grad(0, ctx.odtrain("ErfGrad", [ctx.GO(0), ctx.I(0)]))


@grad("Atan")
def _atan_grad(ctx):  # dX = dY / (1 + X²)
    ctx.set_grad(0, ctx.odtrain("AtanGrad", [ctx.GO(0), ctx.I(0)]))


@grad("Gelu")
def _gelu_grad(ctx):  # dX = dY · d/dx [x·Φ(x)] (or its tanh approximation)
    ctx.set_grad(0, ctx.odtrain("GeluGrad", [ctx.GO(0), ctx.I(0)], {"approximate": ctx.attr("approximate", "none")}))


grad("Gelu", ODTRAIN_DOMAIN)(_gelu_grad)


@grad("Pow")
def _pow_grad(ctx):  # dA = dY · B · A^(B-1), dB = dY · Y · ln(A)
    a, b, dy = ctx.I(0), ctx.I(1), ctx.GO(0)
    if ctx.needs(0):
        from .tensor import dtype_of

        one = ctx.constant(np.ones((), dtype_of(ctx, b) or np.float32), "one")
        power = ctx.emit("Pow", [a, ctx.emit("Sub", [b, one])])
        ctx.set_grad(0, ctx.sum_to_input(ctx.emit("Mul", [ctx.emit("Mul", [dy, b]), power]), 0))
    if ctx.needs(1):
        scaled = ctx.emit("Mul", [ctx.emit("Mul", [dy, ctx.O(0)]), ctx.emit("Log", [a])])
        ctx.set_grad(1, ctx.sum_to_input(scaled, 1))


def _extremum_grad(ctx):  # dX_i = dY where X_i is the extremum (every tied input receives it), else 0
    zero = ctx.constant(np.zeros((), np.float32), "zero")
    for i in range(len(ctx.node.inputs)):
        if ctx.needs(i):
            chosen = ctx.emit("Equal", [ctx.I(i), ctx.O(0)])
            ctx.set_grad(i, ctx.sum_to_input(ctx.emit("Where", [chosen, ctx.GO(0), zero]), i))


grad("Max")(_extremum_grad)
grad("Min")(_extremum_grad)
