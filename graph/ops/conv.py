"""Convolution (Conv) and ConvTranspose: type rules and gradients.

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
"""
from __future__ import annotations

import math

from ..errors import ModelError, UnsupportedOpError
from ..ir import ODTRAIN_DOMAIN, TensorType
from .registry import grad, op, same_as_input
from .windows import _auto_pad, _ints, _require_float32, _spatial_rank, window_output_shape


# ---- Conv ----------------------------------------------------------------------------------------


def _rank_and_group(node, x: TensorType, w: TensorType) -> tuple[int, int]:
    """The spatial rank and group count of a convolution whose input and weight shapes are known."""
    rank = _spatial_rank(node, x)
    if len(w.shape) != rank + 2:
        raise ModelError(f"{node.describe()}: weight {w} does not match input {x}")
    return rank, int(node.attrs.get("group", 1))


def _conv_flops(node, types, out) -> float:  # weight [M, C/group, k...]: each output reads C/group · k... inputs
    return 2.0 * out.size * math.prod(types[1].shape[1:])


def _conv_window_reads(node, types, out) -> float:  # its im2col: each output position reads its window of each channel
    weight = types[1].shape
    return out.size / max(weight[0], 1) * types[0].shape[1] * math.prod(weight[2:])


@op("Conv", flops=_conv_flops, window_reads=_conv_window_reads)
def _conv_rule(node, types, consts):
    x, w = types[0], types[1]
    _require_float32(node, x)
    return [TensorType(x.dtype, conv_output_shape(node, x, w))]


def conv_output_shape(node, x: TensorType, w: TensorType) -> tuple | None:
    """The output shape of a convolution (Conv, ConvInteger, QLinearConv) of x by w, after checking that they fit."""
    if x.shape is None or w.shape is None:
        return None
    rank, group = _rank_and_group(node, x, w)
    channels, per_group = x.shape[1], w.shape[1]
    if isinstance(channels, int) and channels != per_group * group:
        raise ModelError(f"{node.describe()}: input has {channels} channels, weight {w} with group={group} "
                         f"expects {per_group * group}")
    if isinstance(w.shape[0], int) and w.shape[0] % group:
        raise ModelError(f"{node.describe()}: {w.shape[0]} output channels do not split into group={group}")
    kernel = node.attrs.get("kernel_shape") or list(w.shape[2:])
    if list(kernel) != list(w.shape[2:]):
        raise ModelError(f"{node.describe()}: kernel_shape {list(kernel)} differs from the weight's {w}")
    return (x.shape[0], w.shape[0]) + window_output_shape(node, x.shape[2:], list(kernel))


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


# Each gradient is a product again, of as many operations as its forward product on two of its inputs:
# name -> (forward op, positions of the two operands, position of dY); (dY, W, X) and (dY, X, W).
PRODUCT_GRADIENTS = {"ConvInputGrad": ("Conv", 2, 1, 0), "ConvWeightGrad": ("Conv", 1, 2, 0),
                     "ConvTransposeInputGrad": ("ConvTranspose", 2, 1, 0),
                     "ConvTransposeWeightGrad": ("ConvTranspose", 1, 2, 0)}
for _name, _product in PRODUCT_GRADIENTS.items():
    # the gradient has its operand's type
    op(_name, ODTRAIN_DOMAIN, shape_only=(2,), gradient_product=_product)(same_as_input(2))


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


def _conv_transpose_flops(node, types, out) -> float:  # weight [C, M/group, k...]: each input writes M/group · k...
    return 2.0 * types[0].size * math.prod(types[1].shape[1:])


@op("ConvTranspose", flops=_conv_transpose_flops)
def _conv_transpose_rule(node, types, consts):
    x, w = types[0], types[1]
    _require_float32(node, x)
    if x.shape is None or w.shape is None:
        return [TensorType(x.dtype, None)]
    rank, group = _rank_and_group(node, x, w)
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
