"""Reductions over axes, arg-extrema, cumulative sums, and the broadcast-undoing `SumToShape`.

ReduceSum/ReduceMean/ReduceMax/ReduceMin/ReduceL1/ReduceL2/ReduceSumSquare/ReduceLogSum/
ReduceLogSumExp/ReduceProd take `axes` as an attribute (older opsets) or as a constant second
input (ReduceSum from opset 13, the others from 18). No axes means all axes, unless
`noop_with_empty_axes` is set. Constant inputs fold.

ReduceMax/ReduceMin's gradient `ReduceExtremumGrad(dY, X, Y)` hands dY to the
elements equal to the extremum, shared evenly among ties (as PyTorch's amax).
ReduceL2's is X · broadcast(dY / Y); the others are written the same way from
ONNX ops (ReduceProd has none: it would divide by elements that may be zero).

ArgMax/ArgMin give int64 positions and have no gradient; Hardmax (1 at the first
largest element) has none either. TopK's gradient puts dY back at the positions it
took (GatherElementsGrad). CumSum(X, axis) sums
along one axis (`exclusive` leaves each element out, `reverse` runs from the
end); its gradient is the CumSum of dY in the other direction. CumProd
multiplies alike and has no gradient (as ReduceProd).

Their gradient `ReduceGrad(dY, X)` broadcasts dY back over the reduced
axes (divided by the count for a mean); X is read for its shape only.
`SumToShape(G, X)` sums G over the axes that broadcasting added to X.
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError, UnsupportedOpError
from ..ir import ODTRAIN_DOMAIN, TensorType
from .registry import attr_axes, grad, no_grad, op

def _extreme(dtype: np.dtype, largest: bool):
    """The largest (or smallest) value of a dtype: what a maximum (minimum) over no elements is."""
    if dtype == np.bool_:
        return largest
    if np.issubdtype(dtype, np.floating):
        return np.inf if largest else -np.inf
    return np.iinfo(dtype).max if largest else np.iinfo(dtype).min


FOLDS = {"ReduceSum": np.sum, "ReduceMean": np.mean,
         "ReduceMax": lambda x, axis, keepdims: np.max(x, axis, keepdims=keepdims, initial=_extreme(x.dtype, False)),
         "ReduceMin": lambda x, axis, keepdims: np.min(x, axis, keepdims=keepdims, initial=_extreme(x.dtype, True)),
         "ReduceL2": lambda x, axis, keepdims: np.sqrt(np.sum(np.square(x), axis=axis, keepdims=keepdims)),
         "ReduceL1": lambda x, axis, keepdims: np.sum(np.abs(x), axis=axis, keepdims=keepdims),
         "ReduceSumSquare": lambda x, axis, keepdims: np.sum(np.square(x), axis=axis, keepdims=keepdims),
         "ReduceLogSum": lambda x, axis, keepdims: np.log(np.sum(x, axis=axis, keepdims=keepdims)),
         "ReduceLogSumExp": lambda x, axis, keepdims: np.log(np.sum(np.exp(x), axis=axis, keepdims=keepdims)),
         "ReduceProd": np.prod}


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


def _spread(ctx, name: str) -> str:
    """A reduced value broadcast back over the input's shape."""
    return ctx.odtrain("ReduceGrad", [name, ctx.I(0)], {**_reduce_attrs(ctx), "mean": 0})


@grad("ReduceL2")
def _reduce_l2_grad(ctx):  # dX = X · broadcast(dY / Y)
    ctx.set_grad(0, ctx.emit("Mul", [_spread(ctx, ctx.emit("Div", [ctx.GO(0), ctx.O(0)])), ctx.I(0)]))


@grad("ReduceL1")
def _reduce_l1_grad(ctx):  # dX = sign(X) · broadcast(dY)
    ctx.set_grad(0, ctx.emit("Mul", [_spread(ctx, ctx.GO(0)), ctx.emit("Sign", [ctx.I(0)])]))


@grad("ReduceSumSquare")
def _reduce_sum_square_grad(ctx):  # dX = 2 X · broadcast(dY)
    twice = ctx.emit("Add", [ctx.I(0), ctx.I(0)])
    ctx.set_grad(0, ctx.emit("Mul", [_spread(ctx, ctx.GO(0)), twice]))


@grad("ReduceLogSum")
def _reduce_log_sum_grad(ctx):  # dX = broadcast(dY / exp(Y)): dY over the sum
    ctx.set_grad(0, _spread(ctx, ctx.emit("Div", [ctx.GO(0), ctx.emit("Exp", [ctx.O(0)])])))


@grad("ReduceLogSumExp")
def _reduce_log_sum_exp_grad(ctx):  # dX = broadcast(dY) · exp(X - broadcast(Y)): dY times the softmax
    weights = ctx.emit("Exp", [ctx.emit("Sub", [ctx.I(0), _spread(ctx, ctx.O(0))])])
    ctx.set_grad(0, ctx.emit("Mul", [_spread(ctx, ctx.GO(0)), weights]))


PRODUCT_HAS_NO_GRADIENT = ("its gradient, the products of the other elements, is not implemented (dividing Y by X "
                           "fails where X is zero)")
no_grad("ReduceProd", PRODUCT_HAS_NO_GRADIENT)


def _arg_rule(node, types, consts):
    x = types[0]
    if x.shape is None:
        return [TensorType(np.dtype(np.int64), None)]
    rank = len(x.shape)
    axis = int(node.attrs.get("axis", 0))
    if not -rank <= axis < max(rank, 1):
        raise ModelError(f"{node.describe()}: axis {axis} is out of range for {x}")
    axis %= max(rank, 1)
    keep = node.attrs.get("keepdims", 1)
    if consts[0] is not None:
        value = consts[0]
        if node.attrs.get("select_last_index", 0):
            value = np.flip(value, axis)
        found = (np.argmax if node.op_type == "ArgMax" else np.argmin)(value, axis=axis)
        if node.attrs.get("select_last_index", 0):
            found = value.shape[axis] - 1 - found
        found = np.asarray(np.expand_dims(found, axis) if keep else found, np.int64)
        return [TensorType(found.dtype, found.shape)], [found]
    shape = tuple(1 if a == axis else d for a, d in enumerate(x.shape) if a != axis or keep)
    return [TensorType(np.dtype(np.int64), shape)]


for _name in ("ArgMax", "ArgMin"):
    op(_name)(_arg_rule)
    no_grad(_name, "its output is an integer position")


def _one_axis(node, x, default: int) -> int:
    rank = len(x.shape)
    axis = int(node.attrs.get("axis", default))
    if not -rank <= axis < max(rank, 1):
        raise ModelError(f"{node.describe()}: axis {axis} is out of range for {x}")
    return axis % max(rank, 1)


@op("Hardmax")
def _hardmax_rule(node, types, consts):
    """1 at the first largest element along the axis, 0 elsewhere."""
    x = types[0]
    if x.dtype.kind != "f":
        raise ModelError(f"{node.describe()}: Hardmax takes a float tensor, got {x}")
    _one_axis(node, x, -1)
    return [x]


no_grad("Hardmax", "it is piecewise constant: its derivative is zero wherever it exists")


@op("TopK", shape_only=(1,), constant_inputs=(1,))
def _top_k_rule(node, types, consts):
    """The k largest (or smallest) elements along the axis, sorted, the first of equal values first, and their
    int64 positions."""
    x = types[0]
    axis = _one_axis(node, x, -1)
    if consts[1] is None:
        raise UnsupportedOpError(f"{node.describe()}: its k input '{node.inputs[1]}' must be a constant")
    k = int(np.asarray(consts[1]).reshape(-1)[0])
    if not 0 <= k <= x.shape[axis]:
        raise ModelError(f"{node.describe()}: k={k} is outside [0, {x.shape[axis]}] for {x}")
    shape = tuple(k if a == axis else d for a, d in enumerate(x.shape))
    return [TensorType(x.dtype, shape), TensorType(np.dtype(np.int64), shape)]


@grad("TopK")
def _top_k_grad(ctx):  # dX = zeros; dX[index with axis → indices[p]] = dY[p]
    ctx.set_grad(0, ctx.odtrain("GatherElementsGrad", [ctx.GO(0), ctx.O(1), ctx.I(0)], {"axis": ctx.attr("axis", -1)}))


def cumulative_axis(node, axis_value, rank: int | None) -> int:
    if axis_value is None:
        raise UnsupportedOpError(f"{node.describe()}: its axis input '{node.inputs[1]}' must be a constant")
    axis = int(np.asarray(axis_value).reshape(()))
    if rank is not None:
        if not -rank <= axis < rank:
            raise ModelError(f"{node.describe()}: axis {axis} is out of range for rank {rank}")
        axis %= rank
    return axis


@op("CumSum", shape_only=(1,), constant_inputs=(1,))
@op("CumProd", shape_only=(1,), constant_inputs=(1,))
def _cumulative_rule(node, types, consts):
    x = types[0]
    axis = cumulative_axis(node, consts[1], None if x.shape is None else len(x.shape))
    if consts[0] is not None:
        value = consts[0]
        if node.attrs.get("reverse", 0):
            value = np.flip(value, axis)
        product = node.op_type == "CumProd"
        total = (np.cumprod if product else np.cumsum)(value, axis=axis, dtype=value.dtype)
        if node.attrs.get("exclusive", 0):  # shift by one along the axis, the identity first
            total = np.concatenate([np.full_like(np.take(value, [0], axis), 1 if product else 0),
                                    np.delete(total, -1, axis)], axis=axis)
        if node.attrs.get("reverse", 0):
            total = np.flip(total, axis)
        return [x], [np.ascontiguousarray(total)]
    return [x]


no_grad("CumProd", PRODUCT_HAS_NO_GRADIENT)


@grad("CumSum")
def _cumsum_grad(ctx):  # dX = CumSum(dY) in the other direction, as exclusive as the forward one
    attrs = {"exclusive": ctx.attr("exclusive", 0), "reverse": 1 - ctx.attr("reverse", 0)}
    ctx.set_grad(0, ctx.emit("CumSum", [ctx.GO(0), ctx.I(1)], attrs))


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
