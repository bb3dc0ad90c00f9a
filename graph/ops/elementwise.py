"""Elementwise ops: numpy-broadcasting binaries, unaries, and their gradients.

Binary ops follow ONNX multidirectional broadcasting; the gradient of a
broadcast input is reduced back to its shape by `SumToShape`. Unary
activations express their gradients through their output (ReluGrad reads
Y, not X), so the forward op may overwrite its input in place.
"""
from __future__ import annotations

from ..ir import ODTRAIN_DOMAIN, TensorType
from . import broadcast_shapes, grad, no_grad, op, same_as_input


def _broadcast_rule(node, types, consts):
    present = [t for t in types if t is not None]
    if any(t.shape is None for t in present):
        return [TensorType(present[0].dtype, None)]
    try:
        shape = broadcast_shapes(*(t.shape for t in present))
    except ValueError as error:
        from ..errors import ModelError

        raise ModelError(f"{node.describe()}: inputs {[str(t) for t in present]} cannot broadcast ({error})") from None
    return [TensorType(present[0].dtype, shape)]


for _name in ("Add", "Sub", "Mul", "Div"):
    op(_name, inplace=((0, 0), (0, 1)))(_broadcast_rule)
op("Sum", inplace=((0, 0),))(_broadcast_rule)

for _name in ("Neg", "Abs", "Exp", "Log", "Relu", "Sigmoid", "Tanh", "Sign", "Sqrt", "Reciprocal"):
    op(_name, inplace=((0, 0),))(same_as_input(0))
op("Identity", view=True)(same_as_input(0))

# Gradients of activations, read through the forward output Y: dX = f(dY, Y).
for _name in ("ReluGrad", "SigmoidGrad", "TanhGrad"):
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
