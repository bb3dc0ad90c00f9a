"""Pooling (MaxPool, AveragePool, LpPool, GlobalMaxPool, GlobalAveragePool): type rules and gradients.

Gradients: MaxPoolGrad recomputes each window's argmax from X (first maximum wins);
AveragePoolGrad spreads dY over each window's counted cells; LpPoolGrad(dY, X, Y) gives each
cell dY · sign(X) · (|X| / Y)^(p-1). The global pools' gradients do
the same over one window that covers the input.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ModelError
from ..ir import ODTRAIN_DOMAIN, TensorType
from .registry import grad, op
from .windows import _auto_pad, _input_shaped, _require_float32, _spatial_rank, window_output_shape


def _pool_rule(node, types, consts):
    x = types[0]
    if x.shape is None:
        return [TensorType(x.dtype, None)] * len(node.outputs)
    _require_float32(node, x)
    rank = _spatial_rank(node, x)
    kernel = node.attrs.get("kernel_shape")
    if kernel is None or len(kernel) != rank:
        raise ModelError(f"{node.describe()}: kernel_shape {kernel} must give {rank} spatial dims for input {x}")
    if node.attrs.get("ceil_mode", 0) and _auto_pad(node) != "NOTSET":
        raise ModelError(f"{node.describe()}: ceil_mode with auto_pad={_auto_pad(node)} is not defined by ONNX")
    shape = x.shape[:2] + window_output_shape(node, x.shape[2:], [int(k) for k in kernel],
                                              bool(node.attrs.get("ceil_mode", 0)))
    out = [TensorType(x.dtype, shape)]
    if len(node.outputs) > 1:
        out.append(TensorType(np.dtype(np.int64), shape))
    return out


def _pool_window_reads(node, types, out) -> float:  # each output element reads its window
    return out.size * math.prod(node.attrs.get("kernel_shape") or [1])


op("MaxPool", window_reads=_pool_window_reads)(_pool_rule)
op("AveragePool", window_reads=_pool_window_reads)(_pool_rule)
op("LpPool", window_reads=_pool_window_reads)(_pool_rule)

POOL_ATTRS = ("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides", "count_include_pad")


def _global_pool_rule(node, types, consts):
    x = types[0]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    _require_float32(node, x)
    _spatial_rank(node, x)
    return [TensorType(x.dtype, x.shape[:2] + (1,) * (len(x.shape) - 2))]


op("GlobalAveragePool")(_global_pool_rule)
op("GlobalMaxPool")(_global_pool_rule)


@grad("MaxPool")
def _max_pool_grad(ctx):  # dX[argmax of each window] += dY
    attrs = {k: ctx.attr(k) for k in POOL_ATTRS if ctx.attr(k) is not None}
    ctx.set_grad(0, ctx.odtrain("MaxPoolGrad", [ctx.GO(0), ctx.I(0)], attrs))


@grad("AveragePool")
def _average_pool_grad(ctx):  # dX[each counted cell of a window] += dY / count
    attrs = {k: ctx.attr(k) for k in POOL_ATTRS if ctx.attr(k) is not None}
    ctx.set_grad(0, ctx.odtrain("AveragePoolGrad", [ctx.GO(0), ctx.I(0)], attrs))


@grad("LpPool")
def _lp_pool_grad(ctx):  # dX[each cell of a window] += dY · sign(X) · (|X| / Y)^(p-1)
    attrs = {k: v for k, v in ctx.node.attrs.items() if k in POOL_ATTRS or k == "p"}
    ctx.set_grad(0, ctx.odtrain("LpPoolGrad", [ctx.GO(0), ctx.I(0), ctx.O(0)], attrs))


@grad("GlobalMaxPool")
def _global_max_pool_grad(ctx):
    ctx.set_grad(0, ctx.odtrain("GlobalMaxPoolGrad", [ctx.GO(0), ctx.I(0)]))


@grad("GlobalAveragePool")
def _global_average_pool_grad(ctx):  # dX = dY / (spatial size), broadcast
    ctx.set_grad(0, ctx.odtrain("GlobalAveragePoolGrad", [ctx.GO(0), ctx.I(0)]))



op("MaxPoolGrad", ODTRAIN_DOMAIN)(_input_shaped)
op("AveragePoolGrad", ODTRAIN_DOMAIN, shape_only=(1,))(_input_shaped)
op("LpPoolGrad", ODTRAIN_DOMAIN)(_input_shaped)
op("GlobalMaxPoolGrad", ODTRAIN_DOMAIN)(_input_shaped)
op("GlobalAveragePoolGrad", ODTRAIN_DOMAIN, shape_only=(1,))(_input_shaped)
