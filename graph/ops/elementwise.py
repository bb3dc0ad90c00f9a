"""Elementwise ops: numpy-broadcasting binaries, unaries, comparisons, and their gradients.

Binary ops follow ONNX multidirectional broadcasting; the gradient of a
broadcast input is reduced back to its shape by `SumToShape`.

Unary ops are registered from one table, `UNARY`: a row per op carries its
constant fold, its cost in passes, and its gradient, either built from graph
ops or a kernel of its own reading the forward output Y (ReluGrad) or input X
(ErfGrad). Every unary may overwrite its input in place (Identity is a view).
The kernels keep their own row per op (kernels/elementwise.py); this layer
never sees kernel codes. GELU, which has an attribute, is registered apart.

Every op here folds to a constant when its inputs are constants (shape
arithmetic such as Gather(Shape(x)) / 2, Sqrt(Cast(...)) in exported
attention). Comparisons, logic ops and the float classes (IsNaN, IsInf) give
booleans and have no gradient;
BitShift and the bitwise ops (BitwiseNot too) take integers only and have none either. Mod
follows its divisor's sign (Python's %), or its dividend's with fmod=1 (C's
fmod); Mean is a Sum divided by the number of inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import ModelError
from ..ir import ODTRAIN_DOMAIN, TensorType
from .registry import broadcast_shapes, grad, no_grad, op, same_as_input


def _int_div(a, b):
    """ONNX integer Div truncates toward zero (numpy's // floors)."""
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q).astype(np.result_type(a, b))


def _pow(a, b):
    return np.power(a, b.astype(np.float64) if np.issubdtype(b.dtype, np.integer) else b).astype(a.dtype)


BINARY_FOLDS = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply,
    "Div": lambda a, b: _int_div(a, b) if np.issubdtype(a.dtype, np.integer) else np.divide(a, b),
    "Pow": _pow, "PRelu": lambda x, slope: np.where(x < 0, x * slope, x),
    "Equal": np.equal, "Less": np.less, "Greater": np.greater, "LessOrEqual": np.less_equal,
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
op("Pow", inplace=((0, 0),), passes=2.0)(_broadcast_rule)
for _name in ("Max", "Min", "Mean"):
    op(_name, inplace=((0, 0),))(_broadcast_rule)
op("PRelu", inplace=((0, 0),))(_broadcast_rule)
op("Mod", inplace=((0, 0), (0, 1)))(_broadcast_rule)
for _name in sorted(INTEGER_BINARIES):
    op(_name, inplace=((0, 0), (0, 1)))(_broadcast_rule)
for _name in COMPARISONS:
    op(_name)(_broadcast_rule)
    no_grad(_name, "its output is boolean")


def _erf(x):
    return np.vectorize(math.erf, otypes=[x.dtype])(x) if x.size else x


@dataclass(frozen=True)
class Unary:
    """What the graph layer knows of a unary op; `UNARY` registers each op from its row.

    fold: the numpy function computing the op on a constant input (constant folding).
    passes: its cost in passes over the data (graph/cost.py): 2 for a transcendental function.
    gradient: dX as a function of the GradContext, built from graph ops; or "Y" / "X": a gradient
        kernel of its own, `<Op>Grad(dY, Y)` reading the forward output or `<Op>Grad(dY, X)` reading
        the input, registered here in odtrain's domain. Either way the forward op may overwrite
        its input in place: when the gradient reads X, X stays live and the planner keeps it.
    no_grad: why the op has no gradient, for those that have none.
    view: the output is the input's bytes (Identity), instead of running in place.
    """

    fold: Callable
    passes: float = 1.0
    gradient: Callable | str | None = None
    no_grad: str | None = None
    view: bool = False


PIECEWISE_CONSTANT = "it is piecewise constant: its derivative is zero wherever it exists"


def _one(g):
    return g.constant(1.0, "one")


def _square(g, value=None):
    value = g.I(0) if value is None else value
    return g.emit("Mul", [value, value])


def _one_plus_abs(g):  # 1 + |X|
    return g.emit("Add", [_one(g), g.emit("Abs", [g.I(0)])])


def _one_minus_square(g):  # 1 - X²
    return g.emit("Sub", [_one(g), _square(g)])


def _mish_grad(g):  # dX = dY · (t + X · sigmoid(X) · (1 - t²)), t = tanh(softplus(X))
    t = g.emit("Tanh", [g.emit("Softplus", [g.I(0)])])
    x_sigmoid = g.emit("Mul", [g.I(0), g.emit("Sigmoid", [g.I(0)])])
    slope = g.emit("Mul", [x_sigmoid, g.emit("Sub", [_one(g), _square(g, t)])])
    return g.emit("Mul", [g.GO(0), g.emit("Add", [t, slope])])

# One row per unary op, with its gradient's math. The kernel side keeps a row of its own for each op
# (kernels/elementwise.py: the scalar function, whose position is its code): the layers never import
# each other, and tests/test_registry.py checks that every op registered here has a kernel.
UNARY = {
    "Neg": Unary(np.negative, gradient=lambda g: g.emit("Neg", [g.GO(0)])),  # dX = -dY
    "Abs": Unary(np.abs, gradient=lambda g: g.emit("Mul", [g.GO(0), g.emit("Sign", [g.I(0)])])),  # dX = dY · sign(X)
    "Exp": Unary(np.exp, passes=2.0, gradient=lambda g: g.emit("Mul", [g.GO(0), g.O(0)])),  # dX = dY · Y
    "Log": Unary(np.log, passes=2.0, gradient=lambda g: g.emit("Div", [g.GO(0), g.I(0)])),  # dX = dY / X
    "Sqrt": Unary(np.sqrt, passes=2.0,  # dX = dY / (2 Y) = (dY · 0.5) / Y
                  gradient=lambda g: g.emit("Div", [g.emit("Mul", [g.GO(0), g.constant(0.5, "half")]), g.O(0)])),
    "Reciprocal": Unary(lambda x: 1 / x,  # dX = -dY · Y · Y
                        gradient=lambda g: g.emit("Neg", [g.emit("Mul", [g.emit("Mul", [g.GO(0), g.O(0)]), g.O(0)])])),
    "Relu": Unary(lambda x: np.maximum(x, 0), gradient="Y"),  # ReluGrad: dX = dY · (Y > 0)
    "Sigmoid": Unary(lambda x: 1 / (1 + np.exp(-x)), passes=2.0, gradient="Y"),  # SigmoidGrad: dX = dY · Y · (1 - Y)
    "Tanh": Unary(np.tanh, passes=2.0, gradient="Y"),  # TanhGrad: dX = dY · (1 - Y²)
    "Erf": Unary(_erf, passes=2.0, gradient="X"),  # ErfGrad: dX = dY · 2/√π · exp(-X²)
    "Atan": Unary(np.arctan, gradient="X"),  # AtanGrad: dX = dY / (1 + X²)
    "Sin": Unary(np.sin, passes=2.0,  # dX = dY · cos(X)
                 gradient=lambda g: g.emit("Mul", [g.GO(0), g.emit("Cos", [g.I(0)])])),
    "Cos": Unary(np.cos, passes=2.0,  # dX = -dY · sin(X)
                 gradient=lambda g: g.emit("Neg", [g.emit("Mul", [g.GO(0), g.emit("Sin", [g.I(0)])])])),
    "Identity": Unary(lambda x: x, view=True, gradient=lambda g: g.GO(0)),  # dX = dY
    "Tan": Unary(np.tan, passes=2.0,  # dX = dY · (1 + Y²)
                 gradient=lambda g: g.emit("Mul", [g.GO(0), g.emit("Add", [_one(g), _square(g, g.O(0))])])),
    "Sinh": Unary(np.sinh, passes=2.0,  # dX = dY · cosh(X)
                  gradient=lambda g: g.emit("Mul", [g.GO(0), g.emit("Cosh", [g.I(0)])])),
    "Cosh": Unary(np.cosh, passes=2.0,  # dX = dY · sinh(X)
                  gradient=lambda g: g.emit("Mul", [g.GO(0), g.emit("Sinh", [g.I(0)])])),
    "Asin": Unary(np.arcsin, passes=2.0,  # dX = dY / √(1 - X²)
                  gradient=lambda g: g.emit("Div", [g.GO(0), g.emit("Sqrt", [_one_minus_square(g)])])),
    "Acos": Unary(np.arccos, passes=2.0,  # dX = -dY / √(1 - X²)
                  gradient=lambda g: g.emit("Neg", [g.emit("Div", [g.GO(0), g.emit("Sqrt", [_one_minus_square(g)])])])),
    "Atanh": Unary(np.arctanh, passes=2.0,  # dX = dY / (1 - X²)
                   gradient=lambda g: g.emit("Div", [g.GO(0), _one_minus_square(g)])),
    "Asinh": Unary(np.arcsinh, passes=2.0,  # dX = dY / √(X² + 1)
                   gradient=lambda g: g.emit("Div", [g.GO(0), g.emit("Sqrt", [g.emit("Add", [_square(g), _one(g)])])])),
    "Acosh": Unary(np.arccosh, passes=2.0,  # dX = dY / √(X² - 1)
                   gradient=lambda g: g.emit("Div", [g.GO(0), g.emit("Sqrt", [g.emit("Sub", [_square(g), _one(g)])])])),
    "Softplus": Unary(lambda x: np.logaddexp(0, x), passes=2.0,  # dX = dY · sigmoid(X)
                      gradient=lambda g: g.emit("Mul", [g.GO(0), g.emit("Sigmoid", [g.I(0)])])),
    "Softsign": Unary(lambda x: x / (1 + np.abs(x)),  # dX = dY / (1 + |X|)²
                      gradient=lambda g: g.emit("Div", [g.GO(0), _square(g, _one_plus_abs(g))])),
    "Mish": Unary(lambda x: x * np.tanh(np.logaddexp(0, x)), passes=2.0, gradient=lambda g: _mish_grad(g)),
    "Round": Unary(np.round, no_grad=PIECEWISE_CONSTANT),  # halves to even, as ONNX
    "Sign": Unary(np.sign, no_grad=PIECEWISE_CONSTANT),
    "Floor": Unary(np.floor, no_grad=PIECEWISE_CONSTANT),
    "Ceil": Unary(np.ceil, no_grad=PIECEWISE_CONSTANT),
    "Not": Unary(np.logical_not, no_grad="its output is boolean"),
}


def _unary_rule(node, types, consts):
    if consts and consts[0] is not None:
        value = np.asarray(np.asarray(UNARY[node.op_type].fold(np.asarray(consts[0]))).astype(consts[0].dtype),
                           order="C")
        return [TensorType(value.dtype, value.shape)], [value]
    return [types[0]]


def _register_unary(name: str, row: Unary) -> None:
    op(name, inplace=() if row.view else ((0, 0),), view=row.view, passes=row.passes)(_unary_rule)
    if row.no_grad is not None:
        no_grad(name, row.no_grad)
    elif row.gradient in ("Y", "X"):  # dX = <Op>Grad(dY, Y or X), a kernel of its own
        op(f"{name}Grad", ODTRAIN_DOMAIN, inplace=((0, 0),))(same_as_input(0))
        reads = (lambda g: g.O(0)) if row.gradient == "Y" else (lambda g: g.I(0))
        grad(name)(lambda g: g.set_grad(0, g.odtrain(f"{name}Grad", [g.GO(0), reads(g)])))
    else:
        grad(name)(lambda g: g.set_grad(0, row.gradient(g)))


for _name, _row in UNARY.items():
    _register_unary(_name, _row)


def float_classes(op_type: str, attrs) -> tuple[bool, bool, bool]:
    """Which of (NaN, +inf, -inf) IsNaN or IsInf (with its detect_positive/detect_negative) reports."""
    if op_type == "IsNaN":
        return True, False, False
    return False, bool(attrs.get("detect_positive", 1)), bool(attrs.get("detect_negative", 1))


@op("IsNaN")
@op("IsInf")
def _classify_rule(node, types, consts):
    """IsNaN and IsInf: a float tensor in, a boolean tensor of its shape out (folded by numpy)."""
    if types[0].dtype.kind != "f":
        raise ModelError(f"{node.describe()}: {node.op_type} takes a float tensor, got {types[0]}; cast it first")
    if consts and consts[0] is not None:
        nan, positive, negative = float_classes(node.op_type, node.attrs)
        x = np.asarray(consts[0])
        value = (nan & np.isnan(x)) | (positive & np.isposinf(x)) | (negative & np.isneginf(x))
        return [TensorType(value.dtype, value.shape)], [np.ascontiguousarray(value)]
    return [TensorType(np.dtype(np.bool_), types[0].shape)]


@op("BitwiseNot", inplace=((0, 0),))
def _bitwise_not_rule(node, types, consts):
    if types[0].dtype.kind not in "iu":
        raise ModelError(f"{node.describe()}: BitwiseNot takes integer tensors, got {types[0]}")
    if consts and consts[0] is not None:
        value = np.ascontiguousarray(np.invert(consts[0]))
        return [TensorType(value.dtype, value.shape)], [value]
    return [types[0]]


no_grad("BitwiseNot", "it works on the bits of integers")
no_grad("IsNaN", "its output is boolean")
no_grad("IsInf", "its output is boolean")


# GELU has an attribute (approximate), so it is registered on its own, with its gradient kernel
# GeluGrad(dY, X).
@op("Gelu", inplace=((0, 0),), passes=2.0)
def _gelu_rule(node, types, consts):
    if node.attrs.get("approximate", "none") not in ("none", "tanh"):
        raise ModelError(f"{node.describe()}: approximate must be 'none' or 'tanh', got {node.attrs['approximate']!r}")
    return [types[0]]


# The same GELU in odtrain's domain: what graph fusion makes of PyTorch's exported Erf form in opsets < 20.
op("Gelu", ODTRAIN_DOMAIN, inplace=((0, 0),), passes=2.0)(_gelu_rule)
op("GeluGrad", ODTRAIN_DOMAIN, inplace=((0, 0),))(same_as_input(0))


@grad("Gelu")
def _gelu_grad(ctx):  # dX = dY · d/dx [x·Φ(x)] (or its tanh approximation)
    ctx.set_grad(0, ctx.odtrain("GeluGrad", [ctx.GO(0), ctx.I(0)], {"approximate": ctx.attr("approximate", "none")}))


grad("Gelu", ODTRAIN_DOMAIN)(_gelu_grad)


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


for _name in INTEGER_BINARIES:
    no_grad(_name, "it works on the bits of integers")


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


@grad("PRelu")
def _prelu_grad(ctx):  # dX = dY · (X < 0 ? slope : 1), dSlope = dY · (X < 0 ? X : 0), each summed to its shape
    below = ctx.emit("Less", [ctx.I(0), ctx.constant(np.zeros((), np.float32), "zero")])
    if ctx.needs(0):
        scaled = ctx.emit("Mul", [ctx.GO(0), ctx.I(1)])
        ctx.set_grad(0, ctx.sum_to_input(ctx.emit("Where", [below, scaled, ctx.GO(0)]), 0))
    if ctx.needs(1):
        product = ctx.emit("Mul", [ctx.GO(0), ctx.I(0)])
        zero = ctx.constant(np.zeros((), np.float32), "zero")
        ctx.set_grad(1, ctx.sum_to_input(ctx.emit("Where", [below, product, zero]), 1))


def _extremum_grad(ctx):  # dX_i = dY where X_i is the extremum (every tied input receives it), else 0
    zero = ctx.constant(np.zeros((), np.float32), "zero")
    for i in range(len(ctx.node.inputs)):
        if ctx.needs(i):
            chosen = ctx.emit("Equal", [ctx.I(i), ctx.O(0)])
            ctx.set_grad(i, ctx.sum_to_input(ctx.emit("Where", [chosen, ctx.GO(0), zero]), i))


grad("Max")(_extremum_grad)
grad("Min")(_extremum_grad)
