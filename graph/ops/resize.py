"""Resize, Upsample, GridSample and AffineGrid: type rules and gradients.

Gradients: ResizeGrad(dY, X, roi, scales, sizes) scatters each output's gradient back to the
cells it read, times their interpolation weights (X for its shape only); for nearest that sums
the gradients of every copy of a cell. GridSampleGrad(dY, X, grid) does the same for the taps of each
grid point; GridSample has no gradient with respect to its grid.
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError, UnsupportedOpError
from ..ir import ODTRAIN_DOMAIN, TensorType
from .registry import grad, op
from .windows import _input_shaped, _require_float32

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


op("Resize", constant_inputs=(1, 2, 3))(_resize_rule)
op("Upsample", constant_inputs=(1,))(_resize_rule)


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


# ---- GridSample -------------------------------------------------------------------------------------------


@op("GridSample")
def _grid_sample_rule(node, types, consts):
    """X [N, C, (D,) H, W] sampled at grid [N, (D_out,) H_out, W_out, 2 or 3] (x, y[, z] in [-1, 1]): nearest,
    linear or cubic (2-D), each tap outside X reading zero, the border or its reflection."""
    x, grid = types
    _require_float32(node, x)
    rank = len(x.shape) - 2
    if rank not in (2, 3) or grid.shape is None or len(grid.shape) != rank + 2 or grid.shape[-1] != rank \
            or grid.shape[0] != x.shape[0]:
        raise ModelError(f"{node.describe()}: X {x} needs a grid [N, ..., {rank}] of spatial rank {rank}, got {grid}")
    mode = _text_attr(node, "mode", "linear", ("nearest", "linear", "cubic", "bilinear", "bicubic"))
    _text_attr(node, "padding_mode", "zeros", ("zeros", "border", "reflection"))
    if rank == 3 and mode in ("cubic", "bicubic"):
        raise UnsupportedOpError(f"{node.describe()}: cubic sampling of a volume is not supported (ONNX does not "
                                 "define it either)")
    return [TensorType(x.dtype, tuple(x.shape[:2]) + tuple(grid.shape[1:-1]))]


@grad("GridSample")
def _grid_sample_grad(ctx):  # dX[each tap] += dY · its weight; the grid's gradient is not implemented
    if ctx.needs(1):
        raise UnsupportedOpError(f"{ctx.node.describe()}: no gradient with respect to the grid (only X's): freeze "
                                 "what computes the grid")
    attrs = {k: ctx.attr(k) for k in ("mode", "padding_mode", "align_corners") if ctx.attr(k) is not None}
    ctx.set_grad(0, ctx.odtrain("GridSampleGrad", [ctx.GO(0), ctx.I(0), ctx.I(1)], attrs))


op("GridSampleGrad", ODTRAIN_DOMAIN, shape_only=(1,))(_input_shaped)


# ---- AffineGrid -------------------------------------------------------------------------------------------


@op("AffineGrid", constant_inputs=(1,))
def _affine_grid_rule(node, types, consts):
    """The grid GridSample reads for affine maps theta [N, 2, 3] (or [N, 3, 4]) over an output of `size`
    [N, C, H, W] (or [N, C, D, H, W]): [N, H, W, 2] (or [N, D, H, W, 3])."""
    theta = types[0]
    _require_float32(node, theta)
    if consts[1] is None:
        raise UnsupportedOpError(f"{node.describe()}: its size input '{node.inputs[1]}' must be a constant")
    size = [int(s) for s in np.asarray(consts[1]).reshape(-1)]
    k = len(size) - 2
    if k not in (2, 3) or theta.shape != (size[0], k, k + 1):
        raise ModelError(f"{node.describe()}: theta {theta} must be [N, {k}, {k + 1}] for size {size}")
    return [TensorType(theta.dtype, tuple(size[:1] + size[2:] + [k]))]


@grad("AffineGrid")
def _affine_grid_grad(ctx):  # dθ[n] = dYᵀ · base grid, summed over the points
    ctx.set_grad(0, ctx.odtrain("AffineGridGrad", [ctx.GO(0), ctx.I(1), ctx.I(0)],
                                {"align_corners": ctx.attr("align_corners", 0)}))


@op("AffineGridGrad", ODTRAIN_DOMAIN, shape_only=(2,), constant_inputs=(1,))
def _affine_grid_grad_rule(node, types, consts):
    return [types[2]]
