"""Softmax, LogSoftmax, LayerNormalization, RMSNormalization and LpNormalization, with fused gradient ops.

Softmax/LogSoftmax normalise along one axis (opset 13 semantics; default -1):
    softmax:  dX = Y · (dY - Σ dY·Y)          (SoftmaxGrad reads Y)
    log:      dX = dY - exp(Y) · Σ dY          (LogSoftmaxGrad reads Y)
so the forward op may overwrite its input in place.

LayerNormalization normalises over the axes from `axis` on, then scales and
shifts: Y = (X - μ) · σ⁻¹ · scale + bias, σ = √(var + ε). Its optional Mean and
InvStdDev outputs have X's shape with the normalised axes set to 1; the gradient
rule adds them to the forward node when the model left them out (a value per row,
small beside X, which the gradient reads anyway).
LayerNormalizationGrad(dY, X, scale, Mean, InvStdDev) reads μ and σ⁻¹ from them
(without them, in artifacts written before, it computes them again from X), then
per row sums g and g·x̂ and writes dX while the row is in the cache; it gives dX,
dScale and dBias:
    x̂ = (X - μ)·σ⁻¹, g = dY·scale
    dX = σ⁻¹ · (g - mean(g) - x̂ · mean(g·x̂)),  dScale = Σ dY·x̂,  dBias = Σ dY

RMSNormalization (opset 23) scales without centring: Y = X · r · scale, r = 1/√(mean(X²) + ε)
over the axes from `axis` on. RMSNormalizationGrad(dY, X, scale) recomputes r:
    g = dY·scale,  dX = r · (g - X · r² · mean(g·X)),  dScale = Σ dY·X·r
LpNormalization divides by the L1 or L2 norm along one axis, Y = X / N; its gradient
LpNormalizationGrad(dY, X) recomputes N:  dX = (dY - g · Σ dY·Y) / N, g = Y (L2) or sign(X) (L1).
The training model's fusion (graph/fusion.py) writes the exporters' decomposed RMSNorm as
ai.odtrain RMSNormalization, the same op in odtrain's domain, so that a model of an older
opset stays valid ONNX.
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError
from ..ir import ODTRAIN_DOMAIN, TensorType
from .registry import grad, op, same_as_input, upgrade


def _check_axis(node, rank: int, default: int) -> int:
    axis = int(node.attrs.get("axis", default))
    if not -rank <= axis < rank:
        raise ModelError(f"{node.describe()}: axis {axis} is out of range for rank {rank}")
    return axis % rank


def _softmax_rule(node, types, consts):
    x = types[0]
    if x.shape is not None:
        _check_axis(node, len(x.shape), -1)
    return [x]


# maximum, sum of exponentials, normalize: three passes
op("Softmax", inplace=((0, 0),), passes=3.0)(_softmax_rule)
op("LogSoftmax", inplace=((0, 0),), passes=3.0)(_softmax_rule)
op("SoftmaxGrad", ODTRAIN_DOMAIN, inplace=((0, 0),))(same_as_input(0))
op("LogSoftmaxGrad", ODTRAIN_DOMAIN, inplace=((0, 0),))(same_as_input(0))


@upgrade("Softmax", before=13)
@upgrade("LogSoftmax", before=13)
def _flattening_softmax(node, opset, value_types, source):
    """Before opset 13, Softmax/LogSoftmax flattened the input to 2-D at `axis` (default 1) and
    normalised over everything after it. Where that is the last axis alone, pin `axis=-1` (the
    meaning odtrain's kernels implement); otherwise refuse rather than compute something else."""
    t = value_types.get(node.inputs[0])
    axis = int(node.attrs.get("axis", 1))
    rank = None if t is None or t.shape is None else len(t.shape)
    if rank is not None and axis % rank == rank - 1:
        node.attrs["axis"] = -1
    else:
        raise ModelError(f"{source}: {node.describe()} (opset {opset}) normalises over the axes from "
                         f"{axis} on, flattened{'' if rank else ', for an input of unknown rank'}; odtrain "
                         "implements opset 13's single-axis Softmax: re-export with opset 13 or newer")


@op("LpNormalization", inplace=((0, 0),), passes=2.0)
def _lp_normalization_rule(node, types, consts):
    x = types[0]
    if x.dtype.kind != "f" or x.shape is None:
        raise ModelError(f"{node.describe()}: LpNormalization takes a float tensor of known rank, got {x}")
    if int(node.attrs.get("p", 2)) not in (1, 2):
        raise ModelError(f"{node.describe()}: p must be 1 or 2, got {node.attrs['p']}")
    _check_axis(node, len(x.shape), -1)
    return [x]


op("LpNormalizationGrad", ODTRAIN_DOMAIN, inplace=((0, 0),))(same_as_input(0))


@grad("LpNormalization")
def _lp_normalization_grad(ctx):  # dX = (dY - g · Σ_axis dY·Y) / N, g = Y (p = 2) or sign(X) (p = 1)
    attrs = {"axis": ctx.attr("axis", -1), "p": ctx.attr("p", 2)}
    ctx.set_grad(0, ctx.odtrain("LpNormalizationGrad", [ctx.GO(0), ctx.I(0)], attrs))


@grad("Softmax")
def _softmax_grad(ctx):  # dX = Y · (dY - Σ_axis dY·Y)
    ctx.set_grad(0, ctx.odtrain("SoftmaxGrad", [ctx.GO(0), ctx.O(0)], {"axis": ctx.attr("axis", -1)}))


@grad("LogSoftmax")
def _log_softmax_grad(ctx):  # dX = dY - exp(Y) · Σ_axis dY
    ctx.set_grad(0, ctx.odtrain("LogSoftmaxGrad", [ctx.GO(0), ctx.O(0)], {"axis": ctx.attr("axis", -1)}))


def statistics_shape(x_shape: tuple, axis: int) -> tuple:
    return tuple(x_shape[:axis]) + (1,) * (len(x_shape) - axis)


@op("LayerNormalization", passes=3.0)  # mean, variance, normalize
def _layer_norm_rule(node, types, consts):
    x = types[0]
    if x.shape is None:
        return [TensorType(x.dtype, None)] * len(node.outputs)
    axis = _check_axis(node, len(x.shape), -1)
    if node.attrs.get("stash_type", 1) != 1:
        raise ModelError(f"{node.describe()}: only stash_type=1 (float32 statistics) is supported")
    for t, what in ((types[1], "scale"), (types[2] if len(types) > 2 else None, "bias")):
        if t is not None and t.shape is not None and len(t.shape) > len(x.shape) - axis:
            raise ModelError(f"{node.describe()}: {what} {t} does not broadcast to the normalised axes of {x}")
    stats = TensorType(np.dtype(np.float32), statistics_shape(x.shape, axis))
    return [x, stats, stats][:len(node.outputs)]


@grad("LayerNormalization")
def _layer_norm_grad(ctx):
    if ctx.GO(1) or ctx.GO(2):
        from ..errors import UnsupportedOpError

        raise UnsupportedOpError(f"{ctx.node.describe()}: the loss depends on its Mean or InvStdDev output, "
                                 "whose gradient is not implemented")
    attrs = {"axis": ctx.attr("axis", -1), "epsilon": float(ctx.attr("epsilon", 1e-5))}
    statistics = [ctx.forward_output(1, "mean"), ctx.forward_output(2, "inv_std_dev")]  # μ, σ⁻¹ of each row
    dx, dscale, dbias = ctx.odtrain("LayerNormalizationGrad", [ctx.GO(0), ctx.I(0), ctx.I(1)] + statistics, attrs,
                                    outputs=3)
    ctx.set_grad(0, dx)
    if ctx.needs(1):
        ctx.set_grad(1, ctx.sum_to_input(dscale, 1))
    if ctx.needs(2):
        ctx.set_grad(2, ctx.sum_to_input(dbias, 2))


@op("LayerNormalizationGrad", ODTRAIN_DOMAIN)
def _layer_norm_grad_rule(node, types, consts):
    x = types[1]
    axis = _check_axis(node, len(x.shape), -1)
    params = TensorType(x.dtype, tuple(x.shape[axis:]))
    return [x, params, params]


def _rms_norm_rule(node, types, consts):
    x, scale = types[0], types[1]
    if x.shape is None:
        return [x]
    axis = _check_axis(node, len(x.shape), -1)
    if node.attrs.get("stash_type", 1) != 1:
        raise ModelError(f"{node.describe()}: only stash_type=1 (float32 statistics) is supported")
    if scale.shape is not None and len(scale.shape) > len(x.shape) - axis:
        raise ModelError(f"{node.describe()}: scale {scale} does not broadcast to the normalised axes of {x}")
    return [x]


def _rms_norm_grad(ctx):  # g = dY·scale;  dX = r·(g - X·r²·mean(g·X));  dScale = Σ dY·X·r
    attrs = {"axis": ctx.attr("axis", -1), "epsilon": float(ctx.attr("epsilon", 1e-5))}
    dx, dscale = ctx.odtrain("RMSNormalizationGrad", [ctx.GO(0), ctx.I(0), ctx.I(1)], attrs,
                             outputs=[ctx.needs(0), ctx.needs(1)])
    if ctx.needs(0):
        ctx.set_grad(0, dx)
    if ctx.needs(1):
        ctx.set_grad(1, ctx.sum_to_input(dscale, 1))


for _domain in ("", ODTRAIN_DOMAIN):
    op("RMSNormalization", _domain)(_rms_norm_rule)
    grad("RMSNormalization", _domain)(_rms_norm_grad)


@op("RMSNormalizationGrad", ODTRAIN_DOMAIN)
def _rms_norm_grad_rule(node, types, consts):
    x = types[1]
    axis = _check_axis(node, len(x.shape), -1)
    return [x, TensorType(x.dtype, tuple(x.shape[axis:]))]
