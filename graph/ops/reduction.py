"""Reductions over axes, and the broadcast-undoing `SumToShape`.

ReduceSum/ReduceMean take `axes` as an attribute (older opsets) or as a
constant second input (ReduceSum from opset 13, ReduceMean from 18).
No axes means all axes, unless `noop_with_empty_axes` is set.

Their gradient `ReduceGrad(dY, X)` broadcasts dY back over the reduced
axes (divided by the count for a mean); X is read for its shape only.
`SumToShape(G, X)` sums G over the axes that broadcasting added to X.
"""
from __future__ import annotations

from ..ir import ODTRAIN_DOMAIN, TensorType
from . import attr_axes, grad, op


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
    shape = tuple((1 if keep else None) if axis in axes else d for axis, d in enumerate(x.shape))
    return [TensorType(x.dtype, tuple(d for d in shape if d is not None))]


op("ReduceSum")(_reduce_rule)
op("ReduceMean")(_reduce_rule)


def _reduce_grad(ctx, mean: int):
    axes = ctx.attr("axes")
    if axes is None and len(ctx.node.inputs) > 1 and ctx.I(1):
        # Axes given as an input: they are a constant of the forward graph.
        axes = ctx.const_axes(1)
    attrs = {"keepdims": ctx.attr("keepdims", 1), "mean": mean,
             "noop_with_empty_axes": ctx.attr("noop_with_empty_axes", 0)}
    if axes is not None:
        attrs["axes"] = [int(a) for a in axes]
    ctx.set_grad(0, ctx.odtrain("ReduceGrad", [ctx.GO(0), ctx.I(0)], attrs))


@grad("ReduceSum")
def _reduce_sum_grad(ctx):  # dX = broadcast(dY)
    _reduce_grad(ctx, mean=0)


@grad("ReduceMean")
def _reduce_mean_grad(ctx):  # dX = broadcast(dY) / count
    _reduce_grad(ctx, mean=1)


@op("ReduceGrad", ODTRAIN_DOMAIN, shape_only=(1,))
def _reduce_grad_rule(node, types, consts):
    return [TensorType(types[0].dtype, types[1].shape)]


def _same_shape(input_types, output_types) -> bool:
    return input_types[0].shape == output_types[0].shape


@op("SumToShape", ODTRAIN_DOMAIN, shape_only=(1,), view=_same_shape)
def _sum_to_shape_rule(node, types, consts):
    return [TensorType(types[0].dtype, types[1].shape)]
