"""Shape and layout ops: Reshape, Flatten, Transpose, Shape, Constant.

Reshape and Flatten are views: their output shares the input's bytes.
Shape and Constant fold to constants when shapes are bound, so they cost
nothing per step; Reshape's shape input must be such a constant.
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError
from ..ir import TensorType
from . import grad, no_grad, op


def _static_size(dims) -> int | None:
    return int(np.prod(dims)) if all(isinstance(d, int) for d in dims) else None


def reshape_target(node, in_shape: tuple, target) -> tuple:
    """ONNX Reshape's output shape: 0 copies the input dim (unless allowzero), -1 is inferred."""
    target = [int(d) for d in np.asarray(target).reshape(-1)]
    allowzero = node.attrs.get("allowzero", 0)
    out = [in_shape[i] if d == 0 and not allowzero else d for i, d in enumerate(target)]
    if out.count(-1) > 1:
        raise ModelError(f"{node.describe()}: more than one -1 in the target shape {target}")
    if -1 in out:
        known = _static_size([d for d in out if d != -1])
        total = _static_size(in_shape)
        if known is None or total is None:
            out[out.index(-1)] = f"{node.name or 'reshape'}_dim"
        else:
            if known == 0 or total % known:
                raise ModelError(f"{node.describe()}: cannot reshape {in_shape} into {target}")
            out[out.index(-1)] = total // known
    total, new_total = _static_size(in_shape), _static_size(out)
    if total is not None and new_total is not None and total != new_total:
        raise ModelError(f"{node.describe()}: cannot reshape {in_shape} ({total} elements) into {tuple(out)}")
    return tuple(out)


@op("Reshape", view=True)
def _reshape_rule(node, types, consts):
    x = types[0]
    if consts[1] is None:
        if types[1].shape is not None and all(isinstance(d, int) for d in types[1].shape):
            return [TensorType(x.dtype, tuple(f"{node.name}_{i}" for i in range(types[1].shape[0])))]
        return [TensorType(x.dtype, None)]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    return [TensorType(x.dtype, reshape_target(node, x.shape, consts[1]))]


@grad("Reshape")
def _reshape_grad(ctx):  # dX = reshape(dY, shape(X))
    ctx.set_grad(0, ctx.emit("Reshape", [ctx.GO(0), ctx.emit("Shape", [ctx.I(0)])]))


@op("Flatten", view=True)
def _flatten_rule(node, types, consts):
    x = types[0]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    axis = node.attrs.get("axis", 1) % (len(x.shape) or 1)
    outer, inner = _static_size(x.shape[:axis]), _static_size(x.shape[axis:])
    return [TensorType(x.dtype, (outer if outer is not None else f"{node.name}_outer",
                                 inner if inner is not None else f"{node.name}_inner"))]


@grad("Flatten")
def _flatten_grad(ctx):  # dX = reshape(dY, shape(X))
    ctx.set_grad(0, ctx.emit("Reshape", [ctx.GO(0), ctx.emit("Shape", [ctx.I(0)])]))


@op("Transpose")
def _transpose_rule(node, types, consts):
    x = types[0]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    perm = node.attrs.get("perm", list(range(len(x.shape)))[::-1])
    return [TensorType(x.dtype, tuple(x.shape[p] for p in perm))]


@grad("Transpose")
def _transpose_grad(ctx):  # dX = transpose(dY, inverse(perm))
    rank = ctx.rank(ctx.I(0))
    perm = ctx.attr("perm", list(range(rank))[::-1])
    ctx.set_grad(0, ctx.emit("Transpose", [ctx.GO(0)], {"perm": [int(p) for p in np.argsort(perm)]}))


@op("Shape", shape_only=(0,))
def _shape_rule(node, types, consts):
    x = types[0]
    rank = None if x.shape is None else len(x.shape)
    out = TensorType(np.dtype(np.int64), None if rank is None else (rank,))
    if x.is_static:
        start, end = node.attrs.get("start", 0), node.attrs.get("end", rank)
        dims = np.array(x.shape[start:end], dtype=np.int64)
        return [TensorType(np.dtype(np.int64), dims.shape)], [dims]
    return [out]


@op("Constant")
def _constant_rule(node, types, consts):
    value = constant_value(node)
    return [TensorType(value.dtype, value.shape)], [value]


def constant_value(node) -> np.ndarray:
    """The tensor a Constant node holds, from whichever value_* attribute it uses."""
    attrs = node.attrs
    if "value" in attrs:
        return np.asarray(attrs["value"])
    for key, dtype in (("value_float", np.float32), ("value_int", np.int64),
                       ("value_floats", np.float32), ("value_ints", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    raise ModelError(f"{node.describe()}: Constant without a supported value attribute ({sorted(attrs)})")


no_grad("Shape", "its output is an integer shape")
no_grad("Constant", "it has no inputs")
