"""Convolution, pooling, batch normalization, image activations (Clip, LeakyRelu, HardSigmoid, HardSwish), Dropout, Pad,
and upsampling (ConvTranspose, Resize, Upsample).

Windowed ops (Conv, MaxPool, AveragePool) share one geometry: for each spatial
axis, out = floor((in + pad_begin + pad_end - ((k - 1)·dilation + 1)) / stride) + 1
(ceil for pools with ceil_mode, dropping a last window that would start in the end
padding); auto_pad SAME_* gives out = ceil(in / stride) and splits the needed
padding with the extra cell at the end (UPPER) or the beginning (LOWER).

Gradients:
- Conv: three odtrain ops, each emitted only when its input's gradient is wanted:
  ConvInputGrad(dY, W, X) (X for its shape only), ConvWeightGrad(dY, X, W) (W for
  its shape only) and ConvBiasGrad(dY). A frozen backbone computes no weight
  gradients; the first convolution computes no input gradient.
- ConvTranspose is the input gradient of the convolution of Y by W (Y [N, M, ...] as that
  convolution's input, X [N, C, ...] as its output, W [C, M/G, ...] as its weight), so its
  gradients are that convolution's other computations: ConvTransposeInputGrad(dY, W, X) is
  Conv(dY, W), ConvTransposeWeightGrad(dY, X, W) is its weight gradient with X as the output
  gradient, and dB is ConvBiasGrad(dY); each emitted only when wanted.
- Resize and Upsample: ResizeGrad(dY, X, roi, scales, sizes) scatters each output's gradient
  back to the cells it read, times their interpolation weights (X for its shape only); for
  nearest that sums the gradients of every copy of a cell.
- BatchNormalization: BatchNormalizationGrad(dY, X, scale[, mean, var]) recomputes
  the batch statistics from X in training mode (no saved-statistics outputs needed).
  Its running statistics are `updates`: written over the checkpoint's parameters in
  place, running = momentum·running + (1 - momentum)·batch, with the unbiased batch
  variance for running_var (PyTorch's convention; ONNX's reference uses the
  population variance). The eval form runs it with training_mode=0 and output Y only.
- Pools: MaxPoolGrad recomputes each window's argmax from X (first maximum wins);
  AveragePoolGrad spreads dY over each window's counted cells.
- Activations read their output when it determines the derivative (Clip,
  HardSigmoid, LeakyRelu with alpha > 0), so the forward op may work in place;
  HardSwish reads its input.
- Dropout: the gradient multiplies by the forward's mask, which the gradient rule
  adds as the forward node's second output when the model did not ask for it.

Fusion (training model only, `fuse_normalization_activations`): BatchNormalization
followed by Relu or Clip becomes ai.odtrain BatchNormalizationActivation, one pass
that writes the activation's output; its gradient is the activation's (through
that output), then BatchNormalizationGrad.
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError, UnsupportedOpError
from ..ir import ODTRAIN_DOMAIN, Node, TensorType
from . import eval_form, grad, op, same_as_input

FLOAT32 = np.dtype(np.float32)


def _require_float32(node, t: TensorType, what: str = "input") -> None:
    if t.dtype != FLOAT32:
        raise UnsupportedOpError(f"{node.describe()}: its {what} is {t}; odtrain runs {node.op_type} on float32 only")


def _ints(node, name: str, count: int, default: int) -> list[int]:
    values = node.attrs.get(name)
    if values is None or len(values) == 0:
        return [default] * count
    if len(values) != count:
        raise ModelError(f"{node.describe()}: attribute {name}={list(values)} needs {count} values")
    return [int(v) for v in values]


def _auto_pad(node) -> str:
    value = node.attrs.get("auto_pad", "NOTSET")
    value = value.decode() if isinstance(value, bytes) else value
    if value not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise ModelError(f"{node.describe()}: auto_pad={value!r} is not an ONNX value")
    return value


def window_output_shape(node, spatial: tuple, kernel: list[int], ceil_mode: bool = False) -> tuple:
    """Output spatial dims of a sliding window op (Conv, MaxPool, AveragePool); symbolic dims stay symbolic."""
    rank = len(spatial)
    strides = _ints(node, "strides", rank, 1)
    dilations = _ints(node, "dilations", rank, 1)
    pads = _ints(node, "pads", 2 * rank, 0)
    auto_pad = _auto_pad(node)
    out = []
    for axis, size in enumerate(spatial):
        if not isinstance(size, int):
            out.append(f"{node.name or node.op_type}_out{axis}")
            continue
        span = (kernel[axis] - 1) * dilations[axis] + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out.append(-(-size // strides[axis]))
            continue
        begin, end = (0, 0) if auto_pad == "VALID" else (pads[axis], pads[rank + axis])
        if begin >= span or end >= span:
            raise ModelError(f"{node.describe()}: pads {pads} must be smaller than the window ({span}) on axis {axis}")
        extent = size + begin + end - span
        if extent < 0:
            raise ModelError(f"{node.describe()}: the window ({span}) is larger than the padded input "
                             f"({size + begin + end})")
        count = (-(-extent // strides[axis]) if ceil_mode else extent // strides[axis]) + 1
        if ceil_mode and (count - 1) * strides[axis] >= size + begin:
            count -= 1  # the last window would start inside the end padding
        out.append(count)
    return tuple(out)


def _spatial_rank(node, x: TensorType) -> int:
    rank = len(x.shape) - 2
    if not 1 <= rank <= 3:
        raise UnsupportedOpError(f"{node.describe()}: input {x} has {rank} spatial dims; odtrain supports 1 to 3")
    return rank


# ---- Conv ----------------------------------------------------------------------------------------


@op("Conv")
def _conv_rule(node, types, consts):
    x, w = types[0], types[1]
    if x.shape is None or w.shape is None:
        return [TensorType(x.dtype, None)]
    _require_float32(node, x)
    rank = _spatial_rank(node, x)
    if len(w.shape) != rank + 2:
        raise ModelError(f"{node.describe()}: weight {w} does not match input {x}")
    group = int(node.attrs.get("group", 1))
    channels, per_group = x.shape[1], w.shape[1]
    if isinstance(channels, int) and channels != per_group * group:
        raise ModelError(f"{node.describe()}: input has {channels} channels, weight {w} with group={group} "
                         f"expects {per_group * group}")
    if isinstance(w.shape[0], int) and w.shape[0] % group:
        raise ModelError(f"{node.describe()}: {w.shape[0]} output channels do not split into group={group}")
    kernel = node.attrs.get("kernel_shape") or list(w.shape[2:])
    if list(kernel) != list(w.shape[2:]):
        raise ModelError(f"{node.describe()}: kernel_shape {list(kernel)} differs from the weight's {w}")
    return [TensorType(x.dtype, (x.shape[0], w.shape[0]) + window_output_shape(node, x.shape[2:], list(kernel)))]


CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def _convolution_grad(ctx, attribute_names, input_grad_op: str, weight_grad_op: str) -> None:
    """Gradients of a convolution-like node (X, W, B?), each emitted only when it is needed.

    The input- and weight-gradient ops read (dY, the other operand, the operand itself for its
    shape only); the bias gradient is Σ over batch and space of dY."""
    attrs = {k: ctx.attr(k) for k in attribute_names if ctx.attr(k) is not None}
    dy = ctx.GO(0)
    if ctx.needs(0):
        ctx.set_grad(0, ctx.odtrain(input_grad_op, [dy, ctx.I(1), ctx.I(0)], attrs))
    if ctx.needs(1):
        ctx.set_grad(1, ctx.odtrain(weight_grad_op, [dy, ctx.I(0), ctx.I(1)], attrs))
    if ctx.needs(2):
        ctx.set_grad(2, ctx.odtrain("ConvBiasGrad", [dy]))


@grad("Conv")
def _conv_grad(ctx):  # dX = col2im(Wᵀ · dY), dW = dY · im2col(X)ᵀ
    _convolution_grad(ctx, CONV_ATTRS, "ConvInputGrad", "ConvWeightGrad")


for _name in ("ConvInputGrad", "ConvWeightGrad", "ConvTransposeInputGrad", "ConvTransposeWeightGrad"):
    op(_name, ODTRAIN_DOMAIN, shape_only=(2,))(same_as_input(2))  # the gradient has its operand's type


@op("ConvBiasGrad", ODTRAIN_DOMAIN)
def _conv_bias_grad_rule(node, types, consts):
    dy = types[0]
    return [TensorType(dy.dtype, (dy.shape[1],))]


# ---- ConvTranspose -------------------------------------------------------------------------------


def conv_transpose_geometry(node, spatial: tuple, kernel: list[int]) -> tuple[list[int], tuple]:
    """(begin pads, output spatial dims) of a ConvTranspose, with ONNX's and ONNX Runtime's rules.

    Per axis, natural = stride·(in - 1) + output_padding + (k - 1)·dilation + 1. With output_shape,
    total padding = natural - out: split as the spec says when it is positive (SAME_UPPER puts the
    extra cell at the end), and extra output cells go at the end when it is negative. SAME_* give
    out = in·stride the same way. Otherwise out = natural - pads."""
    rank = len(spatial)
    strides = _ints(node, "strides", rank, 1)
    dilations = _ints(node, "dilations", rank, 1)
    output_padding = _ints(node, "output_padding", rank, 0)
    pads = _ints(node, "pads", 2 * rank, 0)
    auto_pad = _auto_pad(node)
    shape = [int(d) for d in node.attrs.get("output_shape") or []]
    if shape and len(shape) not in (rank, rank + 2):
        raise ModelError(f"{node.describe()}: output_shape {shape} needs {rank} spatial dims")
    shape = shape[-rank:]
    if any(p < 0 for p in pads) or any(p < 0 for p in output_padding):
        raise UnsupportedOpError(f"{node.describe()}: negative pads {pads} or output_padding {output_padding} "
                                 "are not supported")
    begin, out = [], []
    for axis, size in enumerate(spatial):
        span = (kernel[axis] - 1) * dilations[axis] + 1
        if not isinstance(size, int):
            begin.append(0 if shape or auto_pad != "NOTSET" else pads[axis])
            out.append(shape[axis] if shape else f"{node.name or node.op_type}_out{axis}")
            continue
        natural = strides[axis] * (size - 1) + output_padding[axis] + span
        if shape or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            target = shape[axis] if shape else size * strides[axis]
            total = natural - target
            if total < 0 and not shape:
                raise UnsupportedOpError(
                    f"{node.describe()}: auto_pad={auto_pad} with a window ({span}) smaller than the stride "
                    f"({strides[axis]}) asks for negative padding, where ONNX's reference and ONNX Runtime "
                    "disagree; give explicit pads and output_padding instead")
            if total < 0 and -total >= strides[axis]:
                raise ModelError(f"{node.describe()}: output_shape {shape} is too large for input {tuple(spatial)}: "
                                 f"axis {axis} holds at most {natural + strides[axis] - 1} cells")
            begin.append(0 if total < 0 else total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
            out.append(target)
        elif auto_pad == "VALID":
            begin.append(0)
            out.append(natural)
        else:
            begin.append(pads[axis])
            out.append(natural - pads[axis] - pads[rank + axis])
        if isinstance(out[-1], int) and out[-1] <= 0:
            raise ModelError(f"{node.describe()}: pads {pads} leave no output cells on axis {axis}")
    return begin, tuple(out)


@op("ConvTranspose")
def _conv_transpose_rule(node, types, consts):
    x, w = types[0], types[1]
    if x.shape is None or w.shape is None:
        return [TensorType(x.dtype, None)]
    _require_float32(node, x)
    rank = _spatial_rank(node, x)
    if len(w.shape) != rank + 2:
        raise ModelError(f"{node.describe()}: weight {w} does not match input {x}")
    group = int(node.attrs.get("group", 1))
    channels = x.shape[1]
    if isinstance(channels, int) and isinstance(w.shape[0], int) and channels != w.shape[0]:
        raise ModelError(f"{node.describe()}: input has {channels} channels, weight {w} ([C, M/group, ...]) "
                         f"expects {w.shape[0]}")
    if isinstance(channels, int) and channels % group:
        raise ModelError(f"{node.describe()}: {channels} input channels do not split into group={group}")
    kernel = node.attrs.get("kernel_shape") or list(w.shape[2:])
    if list(kernel) != list(w.shape[2:]):
        raise ModelError(f"{node.describe()}: kernel_shape {list(kernel)} differs from the weight's {w}")
    _, spatial = conv_transpose_geometry(node, x.shape[2:], [int(k) for k in kernel])
    out_channels = w.shape[1] * group if isinstance(w.shape[1], int) else f"{node.name}_channels"
    return [TensorType(x.dtype, (x.shape[0], out_channels) + spatial)]


CONV_TRANSPOSE_ATTRS = CONV_ATTRS + ("output_padding", "output_shape")


@grad("ConvTranspose")
def _conv_transpose_grad(ctx):
    # ConvTranspose is the input gradient of a convolution by W; its gradients are that convolution's
    # forward and weight gradient, with the roles of X and Y exchanged.
    # dX = Conv(dY, W) (im2col of dY against W); dW_g = X_g · im2col(dY_g)ᵀ.
    _convolution_grad(ctx, CONV_TRANSPOSE_ATTRS, "ConvTransposeInputGrad", "ConvTransposeWeightGrad")


# ---- BatchNormalization --------------------------------------------------------------------------


def _training_mode(node) -> bool:
    return bool(node.attrs.get("training_mode", 0))


@op("BatchNormalization", inplace=((0, 0),), updates=((1, 3), (2, 4)))
def _batch_norm_rule(node, types, consts):
    x = types[0]
    _require_float32(node, x)
    if len(node.outputs) > 3:
        raise UnsupportedOpError(f"{node.describe()}: the saved mean/variance outputs of opsets before 14 are not "
                                 "supported; export with opset 14 or newer (training_mode attribute)")
    if not _training_mode(node) and any(node.outputs[1:]):
        raise ModelError(f"{node.describe()}: running statistics outputs need training_mode=1")
    if x.shape is not None and len(x.shape) < 2:
        raise ModelError(f"{node.describe()}: input {x} needs a channel axis ([N, C, ...])")
    return [x] + [types[3], types[4]][:len(node.outputs) - 1]


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
    inputs = [incoming(), ctx.I(0), ctx.I(1)] + ([] if training else [ctx.I(3), ctx.I(4)])
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
# and Clip's min/max attributes of opsets before 11.


@op("BatchNormalizationActivation", ODTRAIN_DOMAIN, inplace=((0, 0),), updates=((1, 3), (2, 4)))
def _fused_batch_norm_rule(node, types, consts):
    return _batch_norm_rule(node, types[:5], consts[:5])


@grad("BatchNormalizationActivation", ODTRAIN_DOMAIN)
def _fused_batch_norm_grad(ctx):  # the activation's gradient (through its output), then the normalization's
    def activation_grad():  # a Relu is a Clip at 0 (one kernel, fast in place)
        if ctx.attr("activation") == "Relu":
            return ctx.odtrain("ClipGrad", [ctx.GO(0), ctx.O(0)], {"min": 0.0})
        attrs = {k: float(ctx.attr(k)) for k in ("min", "max") if ctx.attr(k) is not None}
        return ctx.odtrain("ClipGrad", [ctx.GO(0), ctx.O(0), ctx.I(5), ctx.I(6)], attrs)

    _emit_batch_norm_grad(ctx, activation_grad)


def fuse_normalization_activations(graph) -> None:
    """Fuse BatchNormalization → Relu/Clip pairs of `graph` in place, where nothing else reads the
    normalized value."""
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


# ---- pooling -------------------------------------------------------------------------------------


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


op("MaxPool")(_pool_rule)
op("AveragePool")(_pool_rule)

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


@grad("GlobalMaxPool")
def _global_max_pool_grad(ctx):
    ctx.set_grad(0, ctx.odtrain("GlobalMaxPoolGrad", [ctx.GO(0), ctx.I(0)]))


@grad("GlobalAveragePool")
def _global_average_pool_grad(ctx):  # dX = dY / (spatial size), broadcast
    ctx.set_grad(0, ctx.odtrain("GlobalAveragePoolGrad", [ctx.GO(0), ctx.I(0)]))


def _input_shaped(node, types, consts):
    return [types[1]]


op("MaxPoolGrad", ODTRAIN_DOMAIN)(_input_shaped)
op("AveragePoolGrad", ODTRAIN_DOMAIN, shape_only=(1,))(_input_shaped)
op("GlobalMaxPoolGrad", ODTRAIN_DOMAIN)(_input_shaped)
op("GlobalAveragePoolGrad", ODTRAIN_DOMAIN, shape_only=(1,))(_input_shaped)


# ---- activations ---------------------------------------------------------------------------------


def _activation_rule(node, types, consts):
    x = types[0]
    _require_float32(node, x)
    for i, t in enumerate(types[1:], start=1):
        if t is not None and (t.dtype != x.dtype or (t.shape is not None and int(np.prod(t.shape)) != 1)):
            raise ModelError(f"{node.describe()}: input {i} must be a {x.dtype} scalar, got {t}")
    return [x]


for _name in ("Clip", "LeakyRelu", "HardSigmoid", "HardSwish"):
    op(_name, inplace=((0, 0),))(_activation_rule)


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


for _name in ("ClipGrad", "LeakyReluGrad", "HardSigmoidGrad", "HardSwishGrad"):
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


@op("Pad")
def _pad_rule(node, types, consts):
    x = types[0]
    _require_float32(node, x)
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


@op("Dropout", inplace=((0, 0),))
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


# ---- Resize, Upsample ----------------------------------------------------------------------------

RESIZE_MODES = ("nearest", "linear", "cubic")
COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
                    "tf_crop_and_resize")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
ASPECT_POLICIES = ("stretch", "not_larger", "not_smaller")


def _text_attr(node, name: str, default: str, allowed: tuple) -> str:
    value = node.attrs.get(name, default)
    value = value.decode() if isinstance(value, bytes) else str(value)
    if value not in allowed:
        raise ModelError(f"{node.describe()}: {name}={value!r}; ONNX allows {', '.join(allowed)}")
    return value


def resize_settings(node) -> dict:
    """Resize's attributes with their defaults made explicit: what ResizeGrad and the kernels read.

    Resize of opset 10 (inputs X, scales) and Upsample map source cells with `asymmetric` coordinates
    and pick the nearest cell as ONNX Runtime does for them: floor when enlarging, ceil when shrinking
    (nearest_mode "legacy")."""
    legacy = node.op_type == "Upsample" or len(node.inputs) == 2
    mode = _text_attr(node, "mode", "nearest", RESIZE_MODES if not legacy else ("nearest", "linear"))
    settings = {
        "mode": mode,
        "coordinate_transformation_mode": "asymmetric" if legacy else
        _text_attr(node, "coordinate_transformation_mode", "half_pixel", COORDINATE_MODES),
        "nearest_mode": "legacy" if legacy else _text_attr(node, "nearest_mode", "round_prefer_floor", NEAREST_MODES),
        "cubic_coeff_a": float(node.attrs.get("cubic_coeff_a", -0.75)),
        "exclude_outside": int(node.attrs.get("exclude_outside", 0)),
        "extrapolation_value": float(node.attrs.get("extrapolation_value", 0.0)),
        "antialias": int(node.attrs.get("antialias", 0)),
        "keep_aspect_ratio_policy": _text_attr(node, "keep_aspect_ratio_policy", "stretch", ASPECT_POLICIES),
    }
    if node.attrs.get("axes") is not None:
        settings["axes"] = [int(a) for a in node.attrs["axes"]]
    return settings


def resize_input_names(node) -> tuple[str, str, str]:
    """(roi, scales, sizes) input names of a Resize or Upsample node, '' where absent."""
    inputs = list(node.inputs) + [""] * 4
    if node.op_type == "Upsample" or len(node.inputs) == 2:
        return "", inputs[1], ""
    return inputs[1], inputs[2], inputs[3]


def _resize_constants(node, consts) -> tuple:
    """(roi, scales, sizes) as numpy arrays (None where absent or empty); they must be constants."""
    names = resize_input_names(node)
    index = {name: i for i, name in enumerate(node.inputs) if name}
    values = []
    for role, name in zip(("roi", "scales", "sizes"), names):
        value = consts[index[name]] if name else None
        if name and value is None and (role != "roi" or node.attrs.get("coordinate_transformation_mode") in
                                       ("tf_crop_and_resize", b"tf_crop_and_resize")):
            raise UnsupportedOpError(f"{node.describe()}: its {role} input '{name}' must be a constant (a Constant, or "
                                     "an initializer that is neither trained nor frozen) so that the output shape is "
                                     "known before running")
        values.append(None if value is None or np.asarray(value).size == 0 else np.asarray(value))
    return tuple(values)


def resize_output_shape(node, shape: tuple, scales, sizes) -> tuple:
    """Output dims of Resize: floor(scale · in) per resized axis (as ONNX's reference, in float64), or `sizes`
    (kept within the aspect ratio by keep_aspect_ratio_policy, rounding half up)."""
    rank = len(shape)
    settings = resize_settings(node)
    axes = [a % rank for a in settings.get("axes", range(rank))] if rank else []
    if (scales is None) == (sizes is None):
        raise ModelError(f"{node.describe()}: give exactly one of scales and sizes (an empty tensor counts as absent)")
    given = scales if scales is not None else sizes
    if given.size != len(axes):
        raise ModelError(f"{node.describe()}: {given.size} scales or sizes for {len(axes)} axes of a rank-{rank} input")
    out = list(shape)
    if scales is not None:
        if (scales <= 0).any():
            raise ModelError(f"{node.describe()}: scales {scales.tolist()} must be positive")
        for k, axis in enumerate(axes):
            scale = float(scales.reshape(-1)[k])
            if isinstance(shape[axis], int):
                out[axis] = int(np.floor(scale * shape[axis]))
            elif scale != 1.0:
                out[axis] = f"{node.name or 'resize'}_dim{axis}"
        return tuple(out)
    sizes = [int(s) for s in sizes.reshape(-1)]
    if any(s <= 0 for s in sizes):
        raise ModelError(f"{node.describe()}: sizes {sizes} must be positive")
    policy = settings["keep_aspect_ratio_policy"]
    if policy == "stretch":
        for k, axis in enumerate(axes):
            out[axis] = sizes[k]
        return tuple(out)
    if not all(isinstance(shape[a], int) for a in axes):
        raise UnsupportedOpError(f"{node.describe()}: keep_aspect_ratio_policy={policy} needs static input dims")
    ratios = [sizes[k] / shape[a] for k, a in enumerate(axes)]
    scale = min(ratios) if policy == "not_larger" else max(ratios)
    for axis in axes:
        out[axis] = int(scale * shape[axis] + 0.5)
    return tuple(out)


def _resize_rule(node, types, consts):
    x = types[0]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    _require_float32(node, x)
    _, scales, sizes = _resize_constants(node, consts)
    settings = resize_settings(node)
    if settings["coordinate_transformation_mode"] == "tf_crop_and_resize":
        roi = _resize_constants(node, consts)[0]
        axes = settings.get("axes", range(len(x.shape)))
        if roi is None or roi.size != 2 * len(axes):
            raise ModelError(f"{node.describe()}: tf_crop_and_resize needs a roi of {2 * len(axes)} values")
    return [TensorType(x.dtype, resize_output_shape(node, x.shape, scales, sizes))]


op("Resize")(_resize_rule)
op("Upsample")(_resize_rule)


def _resize_grad(ctx):  # dX[each tap's source cell] += weight · dY: the adjoint of the interpolation
    roi, scales, sizes = resize_input_names(ctx.node)
    for index in range(1, len(ctx.node.inputs)):
        if ctx.needs(index):
            raise UnsupportedOpError(f"{ctx.node.describe()}: its input '{ctx.I(index)}' (roi, scales or sizes) has no "
                                     "gradient and must stay a constant of the model: leave it out of requires_grad "
                                     "and frozen_params")
    if ctx.needs(0):
        ctx.set_grad(0, ctx.odtrain("ResizeGrad", [ctx.GO(0), ctx.I(0), roi, scales, sizes],
                                    resize_settings(ctx.node)))


grad("Resize")(_resize_grad)
grad("Upsample")(_resize_grad)
op("ResizeGrad", ODTRAIN_DOMAIN, shape_only=(1,))(_input_shaped)
