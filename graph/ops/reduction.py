"""Reductions over axes, and the broadcast-undoing `SumToShape`.

ReduceSum/ReduceMean/ReduceMax/ReduceMin/ReduceL2 take `axes` as an attribute
(older opsets) or as a constant second input (ReduceSum from opset 13, the
others from 18). No axes means all axes, unless `noop_with_empty_axes` is set.
Constant inputs fold.

ReduceMax/ReduceMin's gradient `ReduceExtremumGrad(dY, X, Y)` hands dY to the
elements equal to the extremum, shared evenly among ties (as PyTorch's amax).
ReduceL2's is X · broadcast(dY / Y).

Their gradient `ReduceGrad(dY, X)` broadcasts dY back over the reduced
axes (divided by the count for a mean); X is read for its shape only.
`SumToShape(G, X)` sums G over the axes that broadcasting added to X.
"""
from __future__ import annotations

import numpy as np

from ..ir import ODTRAIN_DOMAIN, TensorType
from . import attr_axes, grad, op

FOLDS = {"ReduceSum": np.sum, "ReduceMean": np.mean, "ReduceMax": np.max, "ReduceMin": np.min,
         "ReduceL2": lambda x, axis, keepdims: np.sqrt(np.sum(np.square(x), axis=axis, keepdims=keepdims))}


def reduced_axes(node, consts, rank: int) -> tuple[int, ...]:
    """The axes a ReduceSum/ReduceMean node reduces, as non-negative ints."""
    axes = attr_axes(node, consts, 1, rank)
    if axes is None or (not axes and not node.attrs.get("noop_with_empty_axes", 0)):
        return tuple(range(rank))
    return axes


def _reduce_rule(node, types, consts):
    x = types[0]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    axes = reduced_axes(node, consts, len(x.shape))
    keep = node.attrs.get("keepdims", 1)
    if consts[0] is not None:
        value = np.asarray(np.asarray(FOLDS[node.op_type](consts[0], axis=axes, keepdims=bool(keep)),
                                                dtype=consts[0].dtype), order="C")
        return [TensorType(value.dtype, value.shape)], [value]
    shape = tuple((1 if keep else None) if axis in axes else d for axis, d in enumerate(x.shape))
    return [TensorType(x.dtype, tuple(d for d in shape if d is not None))]


for _name in FOLDS:
    op(_name, constant_inputs=(1,))(_reduce_rule)  # axes


def _reduce_attrs(ctx) -> dict:
    axes = ctx.attr("axes")
    if axes is None and len(ctx.node.inputs) > 1 and ctx.I(1):
        # Axes given as an input: they are a constant of the forward graph.
        axes = ctx.const_axes(1)
    attrs = {"keepdims": ctx.attr("keepdims", 1), "noop_with_empty_axes": ctx.attr("noop_with_empty_axes", 0)}
    if axes is not None:
        attrs["axes"] = [int(a) for a in axes]
    return attrs


def _reduce_grad(ctx, mean: int):
    ctx.set_grad(0, ctx.odtrain("ReduceGrad", [ctx.GO(0), ctx.I(0)], {**_reduce_attrs(ctx), "mean": mean}))


@grad("ReduceSum")
def _reduce_sum_grad(ctx):  # dX = broadcast(dY)
    _reduce_grad(ctx, mean=0)


@grad("ReduceMean")
def _reduce_mean_grad(ctx):  # dX = broadcast(dY) / count
    _reduce_grad(ctx, mean=1)


def _extremum_grad(ctx):  # dX = dY / ties where X equals the extremum Y, else 0
    ctx.set_grad(0, ctx.odtrain("ReduceExtremumGrad", [ctx.GO(0), ctx.I(0), ctx.O(0)], _reduce_attrs(ctx)))


grad("ReduceMax")(_extremum_grad)
grad("ReduceMin")(_extremum_grad)


@grad("ReduceL2")
def _reduce_l2_grad(ctx):  # dX = X · broadcast(dY / Y)
    ratio = ctx.emit("Div", [ctx.GO(0), ctx.O(0)])
    spread = ctx.odtrain("ReduceGrad", [ratio, ctx.I(0)], {**_reduce_attrs(ctx), "mean": 0})
    ctx.set_grad(0, ctx.emit("Mul", [spread, ctx.I(0)]))


@op("ReduceExtremumGrad", ODTRAIN_DOMAIN)
def _reduce_extremum_grad_rule(node, types, consts):
    return [TensorType(types[0].dtype, types[1].shape)]


@op("ReduceGrad", ODTRAIN_DOMAIN, shape_only=(1,))
def _reduce_grad_rule(node, types, consts):
    return [TensorType(types[0].dtype, types[1].shape)]


def _same_shape(input_types, output_types) -> bool:
    return input_types[0].shape == output_types[0].shape


@op("SumToShape", ODTRAIN_DOMAIN, shape_only=(1,), view=_same_shape)
def _sum_to_shape_rule(node, types, consts):
    return [TensorType(types[0].dtype, types[1].shape)]
