"""Batch normalization, activations with parameters (Clip, LeakyRelu, HardSigmoid, HardSwish, Elu, Selu, Celu,
ThresholdedRelu, Shrink, Swish), Pad and Dropout.

Gradients:
- BatchNormalization: BatchNormalizationGrad(dY, X, scale[, mean, var]). In training
  mode, mean and var are the batch mean and 1/√(σ² + ε) the forward saved (float64
  outputs 3 and 4 of the training model's BatchNormalizationActivation, which every
  training-mode BatchNormalization becomes there), so the gradient sums Σ dY and
  Σ dY·X in one pass and nothing else; given none (artifacts written before they
  were saved), it sums the batch statistics again from X in the same pass. Out of
  training they are the running statistics. Its running statistics are `updates`:
  written over the checkpoint's parameters in place,
  running = momentum·running + (1 - momentum)·batch, with the unbiased batch
  variance for running_var (PyTorch's convention; ONNX's reference uses the
  population variance). The eval form runs it with training_mode=0 and output Y only.
- Activations read their output when it determines the derivative (Clip,
  HardSigmoid, Elu, Selu and Celu with positive parameters, LeakyRelu with
  alpha > 0), so the forward op may work in place; HardSwish, ThresholdedRelu,
  Shrink and Swish read their input.
- Dropout: the gradient multiplies by the forward's mask, which the gradient rule
  adds as the forward node's second output when the model did not ask for it.

Fusion (training model only, `fuse_normalization_activations`): BatchNormalization
followed by Relu or Clip becomes ai.odtrain BatchNormalizationActivation, one pass
that writes the activation's output (a training-mode BatchNormalization that no
activation follows becomes one without `activation`, for its saved statistics);
its gradient is the activation's (through that output), then
BatchNormalizationGrad, which graph/gradient_fusion.py folds
into one BatchNormalizationGrad applying the activation's mask as it reads dY
(inputs 5-7: Y and Clip's bounds; attributes `activation` and Clip's min/max).
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError, UnsupportedOpError
from ..ir import ODTRAIN_DOMAIN, Node, TensorType
from .registry import eval_form, grad, op
from .windows import _input_shaped, _require_float32


# ---- BatchNormalization --------------------------------------------------------------------------


def _training_mode(node) -> bool:
    return bool(node.attrs.get("training_mode", 0))


@op("BatchNormalization", inplace=((0, 0),), updates=((1, 3), (2, 4)), passes=3.0)  # mean, variance, normalize
def _batch_norm_rule(node, types, consts):
    return _batch_norm_types(node, types, saved=False)


def _batch_norm_types(node, types, saved: bool):
    x = types[0]
    _require_float32(node, x)
    if len(node.outputs) > (5 if saved else 3):
        raise UnsupportedOpError(f"{node.describe()}: the saved mean/variance outputs of opsets before 14 are not "
                                 "supported; export with opset 14 or newer (training_mode attribute)")
    if not _training_mode(node) and any(node.outputs[1:]):
        raise ModelError(f"{node.describe()}: running statistics outputs need training_mode=1")
    if x.shape is not None and len(x.shape) < 2:
        raise ModelError(f"{node.describe()}: input {x} needs a channel axis ([N, C, ...])")
    # the saved batch statistics in float64, as the kernels sum them: a mean rounded to float32 would cost the
    # gradient's Σ dY·(X - μ) its accuracy where |μ| is large beside σ
    batch = TensorType(np.dtype(np.float64), types[1].shape)
    return [x] + [types[3], types[4], batch, batch][:len(node.outputs) - 1]


@eval_form("BatchNormalization")
def _batch_norm_eval(node):
    if not _training_mode(node):
        return node
    attrs = {k: v for k, v in node.attrs.items() if k != "momentum"}
    attrs["training_mode"] = 0
    return Node(node.op_type, list(node.inputs), node.outputs[:1], attrs, node.name, node.domain)


@grad("BatchNormalization")
def _batch_norm_grad(ctx):
    _emit_batch_norm_grad(ctx, lambda: ctx.GO(0))


def _emit_batch_norm_grad(ctx, incoming) -> None:
    # training: x̂ = (x - μ)/σ, dX = γ/σ · (dY - mean(dY) - x̂ · mean(dY · x̂)), dγ = Σ dY·x̂, dβ = Σ dY
    # inference: dX = γ/σ · dY, dμ = -γ/σ · Σ dY, dσ² = -γ/(2σ³) · Σ dY·(x - μ)
    training = _training_mode(ctx.node)
    wanted = [ctx.needs(0), ctx.needs(1), ctx.needs(2)] + ([False, False] if training else [ctx.needs(3), ctx.needs(4)])
    if not any(wanted):
        return
    if not training:
        statistics = [ctx.I(3), ctx.I(4)]
    elif ctx.node.domain == ODTRAIN_DOMAIN:  # the batch mean and 1/√(σ² + ε) the forward used
        statistics = [ctx.forward_output(3, "saved_mean"), ctx.forward_output(4, "saved_inv_std")]
    else:
        statistics = []
    inputs = [incoming(), ctx.I(0), ctx.I(1)] + statistics
    attrs = {"epsilon": float(ctx.attr("epsilon", 1e-5)), "training_mode": int(training)}
    names = ctx.odtrain("BatchNormalizationGrad", inputs, attrs, outputs=wanted)
    for index, name in enumerate(names):
        if name:
            ctx.set_grad(index, name)


@op("BatchNormalizationGrad", ODTRAIN_DOMAIN, inplace=((0, 0),))
def _batch_norm_grad_rule(node, types, consts):
    return [types[1]] + [types[2]] * 4


# BatchNormalization followed by Relu or Clip, fused in the training model: one pass writes the
# activation's output (the normalized value is never stored). Inputs: BatchNormalization's five, then
# Clip's bounds ('' when absent; a Relu clips at 0). Attributes: BatchNormalization's, `activation`,
# and Clip's min/max attributes of opsets before 11. Without `activation`, a training-mode
# BatchNormalization alone. Outputs: BatchNormalization's three, then (added by the gradient rule, in
# training) the batch mean and 1/√(σ² + ε) its gradient reads.


@op("BatchNormalizationActivation", ODTRAIN_DOMAIN, inplace=((0, 0),), updates=((1, 3), (2, 4)), passes=3.0)
def _fused_batch_norm_rule(node, types, consts):
    return _batch_norm_types(node, types[:5], saved=_training_mode(node))


@grad("BatchNormalizationActivation", ODTRAIN_DOMAIN)
def _fused_batch_norm_grad(ctx):  # the activation's gradient (through its output), then the normalization's
    def activation_grad():  # a Relu is a Clip at 0 (one kernel, fast in place)
        if ctx.attr("activation") is None:
            return ctx.GO(0)
        if ctx.attr("activation") == "Relu":
            return ctx.odtrain("ClipGrad", [ctx.GO(0), ctx.O(0)], {"min": 0.0})
        attrs = {k: float(ctx.attr(k)) for k in ("min", "max") if ctx.attr(k) is not None}
        return ctx.odtrain("ClipGrad", [ctx.GO(0), ctx.O(0), ctx.I(5), ctx.I(6)], attrs)

    _emit_batch_norm_grad(ctx, activation_grad)


def fuse_normalization_activations(graph) -> None:
    """Fuse BatchNormalization → Relu/Clip pairs of `graph` in place, where nothing else reads the
    normalized value; then make each training-mode BatchNormalization left a BatchNormalizationActivation
    without activation (its gradient reads the statistics it saves)."""
    consumers = graph.consumers()
    producers = graph.producers()
    for act in list(graph.nodes):
        if act.key not in (("", "Relu"), ("", "Clip")) or not act.inputs[0]:
            continue
        norm = producers.get(act.inputs[0])
        if norm is None or norm.key != ("", "BatchNormalization") or norm.outputs[0] != act.inputs[0] \
                or len(consumers.get(act.inputs[0], [])) != 1 or act.inputs[0] in graph.outputs:
            continue
        inputs = list(norm.inputs) + [""] * (5 - len(norm.inputs))
        attrs = dict(norm.attrs, activation=act.op_type)
        if act.op_type == "Clip":
            inputs += [act.inputs[1] if len(act.inputs) > 1 else "", act.inputs[2] if len(act.inputs) > 2 else ""]
            attrs.update({k: float(act.attrs[k]) for k in ("min", "max") if k in act.attrs})
        fused = Node("BatchNormalizationActivation", inputs, [act.outputs[0]] + list(norm.outputs[1:]), attrs,
                     norm.name, ODTRAIN_DOMAIN)
        # at the activation's place: Clip's bounds (Constants) may be computed after the normalization
        graph.nodes = [fused if n is act else n for n in graph.nodes if n is not norm]
    graph.nodes = [Node("BatchNormalizationActivation", list(n.inputs), list(n.outputs), dict(n.attrs), n.name,
                        ODTRAIN_DOMAIN) if n.key == ("", "BatchNormalization") and _training_mode(n) else n
                   for n in graph.nodes]


# ---- activations ---------------------------------------------------------------------------------


def _activation_rule(node, types, consts):
    x = types[0]
    if not (node.op_type == "Clip" and x.dtype.kind in "iu"):  # Clip also bounds integers
        _require_float32(node, x)
    for i, t in enumerate(types[1:], start=1):
        if t is not None and (t.dtype != x.dtype or (t.shape is not None and int(np.prod(t.shape)) != 1)):
            raise ModelError(f"{node.describe()}: input {i} must be a {x.dtype} scalar, got {t}")
    return [x]


# Activations whose gradient kernel reads the forward output Y (each determines where X > 0 or X is inside its
# bounds) or the input X: <Op>Grad(dY, Y or X).
READS_OUTPUT = ("Clip", "HardSigmoid", "Elu", "Selu", "Celu")
READS_INPUT = ("HardSwish", "ThresholdedRelu", "Shrink", "Swish")
for _name in ("LeakyRelu",) + READS_OUTPUT + READS_INPUT:
    op(_name, inplace=((0, 0),), passes=2.0 if _name == "Swish" else 1.0)(_activation_rule)  # Swish: an exp each
# The same Swish in odtrain's domain: what graph fusion makes of an exported SiLU, Mul(x, Sigmoid(x)), at the
# opsets before 24, which lack ONNX's (graph/fusion.py).
op("Swish", ODTRAIN_DOMAIN, inplace=((0, 0),), passes=2.0)(_activation_rule)


@grad("Clip")
def _clip_grad(ctx):  # dX = dY · (min < Y < max): Y is strictly inside exactly where X is
    bounds = [ctx.I(1), ctx.I(2)]
    attrs = {k: float(ctx.attr(k)) for k in ("min", "max") if ctx.attr(k) is not None}
    ctx.set_grad(0, ctx.odtrain("ClipGrad", [ctx.GO(0), ctx.O(0)] + bounds, attrs))


@grad("LeakyRelu")
def _leaky_relu_grad(ctx):  # dX = dY · (X > 0 ? 1 : alpha); with alpha > 0, Y > 0 exactly where X > 0
    alpha = float(ctx.attr("alpha", 0.01))
    source = ctx.O(0) if alpha > 0 else ctx.I(0)
    ctx.set_grad(0, ctx.odtrain("LeakyReluGrad", [ctx.GO(0), source], {"alpha": alpha}))


@grad("HardSigmoid")
def _hard_sigmoid_grad(ctx):  # dX = dY · alpha · (0 < Y < 1)
    ctx.set_grad(0, ctx.odtrain("HardSigmoidGrad", [ctx.GO(0), ctx.O(0)], {"alpha": float(ctx.attr("alpha", 0.2))}))


@grad("HardSwish")
def _hard_swish_grad(ctx):  # dX = dY · (X < -3 ? 0 : X <= 3 ? X/3 + 1/2 : 1), as PyTorch
    ctx.set_grad(0, ctx.odtrain("HardSwishGrad", [ctx.GO(0), ctx.I(0)]))


def _parameter_activation_grad(ctx, reads_output: bool):
    # Elu: dX = dY · (X > 0 ? 1 : Y + alpha); Selu: dY · (X > 0 ? gamma : Y + gamma·alpha);
    # Celu: dY · (X > 0 ? 1 : Y / alpha + 1); ThresholdedRelu: dY · (X > alpha); Shrink: dY · (|X| > lambd);
    # Swish: dY · (s + alpha · X · s · (1 - s)), s = sigmoid(alpha · X)
    attrs = {k: float(v) for k, v in ctx.node.attrs.items() if k in ("alpha", "gamma", "lambd", "bias")}
    ctx.set_grad(0, ctx.odtrain(f"{ctx.node.op_type}Grad", [ctx.GO(0), ctx.O(0) if reads_output else ctx.I(0)], attrs))


for _name in ("Elu", "Selu", "Celu", "ThresholdedRelu", "Shrink", "Swish"):
    grad(_name)(lambda ctx: _parameter_activation_grad(ctx, ctx.node.op_type in READS_OUTPUT))
grad("Swish", ODTRAIN_DOMAIN)(lambda ctx: _parameter_activation_grad(ctx, False))

for _name in ("ClipGrad", "LeakyReluGrad", "HardSigmoidGrad", "HardSwishGrad", "EluGrad", "SeluGrad", "CeluGrad",
              "ThresholdedReluGrad", "ShrinkGrad", "SwishGrad"):
    op(_name, ODTRAIN_DOMAIN, inplace=((0, 0),))(lambda node, types, consts: [types[0]])


# ---- Pad -----------------------------------------------------------------------------------------

PAD_MODES = ("constant", "reflect", "edge", "wrap")


def resolved_pads(node, rank: int, consts) -> list[int]:
    """Pad's [begin..., end...] over all axes, from the attribute (opset < 11) or the constant pads/axes inputs."""
    if len(node.inputs) > 1 and node.inputs[1]:
        if consts[1] is None:
            raise UnsupportedOpError(f"{node.describe()}: its pads input must be a constant (initializer or Constant) "
                                     "so that the output shape is known before running")
        pads = [int(p) for p in np.asarray(consts[1]).reshape(-1)]
    else:
        pads = [int(p) for p in node.attrs.get("pads", [])]
    axes = list(range(rank))
    if len(node.inputs) > 3 and node.inputs[3]:
        if consts[3] is None:
            raise UnsupportedOpError(f"{node.describe()}: its axes input must be a constant")
        axes = [int(a) % rank for a in np.asarray(consts[3]).reshape(-1)]
    if len(pads) != 2 * len(axes):
        raise ModelError(f"{node.describe()}: pads {pads} needs 2 values per padded axis ({len(axes)})")
    full = [0] * (2 * rank)
    for k, axis in enumerate(axes):
        full[axis], full[rank + axis] = pads[k], pads[len(axes) + k]
    return full


def _pad_mode(node) -> str:
    mode = node.attrs.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in PAD_MODES:
        raise ModelError(f"{node.describe()}: mode={mode!r}; ONNX Pad modes are {PAD_MODES}")
    return mode


@op("Pad", constant_inputs=(1, 2, 3))
def _pad_rule(node, types, consts):
    x = types[0]
    if x.dtype.kind not in "fiub":  # a copy with a fill: any numeric type
        raise UnsupportedOpError(f"{node.describe()}: its input is {x}; odtrain pads float, integer and bool tensors")
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    rank = len(x.shape)
    pads = resolved_pads(node, rank, consts)
    _pad_mode(node)
    shape = []
    for axis, size in enumerate(x.shape):
        if not isinstance(size, int):
            if pads[axis] or pads[rank + axis]:
                shape.append(f"{node.name or 'pad'}_dim{axis}")
            else:
                shape.append(size)
            continue
        shape.append(size + pads[axis] + pads[rank + axis])
        if shape[-1] < 0:
            raise ModelError(f"{node.describe()}: pads {pads} crop axis {axis} of {x} below zero")
    return [TensorType(x.dtype, tuple(shape))]


@grad("Pad")
def _pad_grad(ctx):  # dX[source of each output cell] += dY (cells of the constant border have none)
    rank = ctx.rank(ctx.I(0))
    consts = [None, ctx.const_axes(1) if ctx.I(1) else None, None, ctx.const_axes(3) if ctx.I(3) else None]
    pads = resolved_pads(ctx.node, rank, consts)
    ctx.set_grad(0, ctx.odtrain("PadGrad", [ctx.GO(0), ctx.I(0)], {"pads": pads, "mode": _pad_mode(ctx.node)}))


op("PadGrad", ODTRAIN_DOMAIN, shape_only=(1,))(_input_shaped)


# ---- Dropout -------------------------------------------------------------------------------------


@op("Dropout", inplace=((0, 0),), constant_inputs=(1, 2), random=True)
def _dropout_rule(node, types, consts):
    x = types[0]
    _require_float32(node, x)
    out = [x]
    if len(node.outputs) > 1:
        out.append(TensorType(np.dtype(bool), x.shape))
    return out


@eval_form("Dropout")
def _dropout_eval(node):
    return Node("Identity", node.inputs[:1], node.outputs[:1], {}, node.name)


@grad("Dropout")
def _dropout_grad(ctx):  # dX = dY · mask / (1 - ratio) in training mode, dY otherwise
    mask = ctx.forward_output(1, "mask")  # the model may not output the mask; the training graph does
    attrs = {"ratio": float(ctx.attr("ratio"))} if ctx.attr("ratio") is not None else {}
    ctx.set_grad(0, ctx.odtrain("DropoutGrad", [ctx.GO(0), mask, ctx.I(1), ctx.I(2)], attrs))


op("DropoutGrad", ODTRAIN_DOMAIN, inplace=((0, 0),))(lambda node, types, consts: [types[0]])


def inert_dropouts(order: list[Node], folded: dict, outputs: set[str]) -> list[Node]:
    """The order with each Dropout known before the first step to pass its input through (ratio 0, or
    not training: the kernel copies and its mask is all true) as an Identity (a view), and each
    DropoutGrad of its mask as an Identity of dY. A Dropout whose mask is a graph output or is read
    by other nodes stays. Exact: in that case both kernels copy."""
    readers: dict[str, set] = {}
    for node in order:
        for name in node.inputs:
            readers.setdefault(name, set()).add(node.key)
    inert, masks = set(), set()
    for node in order:
        if node.key != ("", "Dropout"):
            continue
        ratio = folded.get(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else node.attrs.get("ratio", 0.5)
        training = folded.get(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else False
        if ratio is None or training is None or (bool(np.asarray(training)) and float(np.asarray(ratio)) != 0.0):
            continue
        mask = node.outputs[1] if len(node.outputs) > 1 else ""
        if mask and (mask in outputs or not readers.get(mask, set()) <= {(ODTRAIN_DOMAIN, "DropoutGrad")}):
            continue
        inert.add(id(node))
        masks.add(mask)
    result = []
    for node in order:
        if id(node) in inert or (node.key == (ODTRAIN_DOMAIN, "DropoutGrad") and node.inputs[1] in masks):
            node = Node("Identity", node.inputs[:1], node.outputs[:1], {}, node.name)
        result.append(node)
    return result
