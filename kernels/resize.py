"""Kernels: Resize, Upsample and ResizeGrad; GridSample and AffineGrid and their gradients.

Resize builds per-axis tables of source cells and weights at bind time; a step gathers (nearest),
resamples each plane separably through a scratch of rows (linear, cubic), or sums the tap products
directly (other layouts, tf_crop_and_resize). Gradients are the exact adjoints.

Interpolation is separable: along each axis, output cell o reads taps source[o, t] with weights
weight[o, t]; an output is the sum over all tap combinations of the product of their weights. The
tables are built at bind time as ONNX's reference does (coordinate transform, neighbours, clamping
at the edges, antialiasing, exclude_outside); runs of unchanged axes merge, so a step sees at most
4 axes ([N·C, H, W] for an image). Nearest has one tap per axis: a gather, and its gradient sums
into each source cell the gradients of all its copies.
"""
from __future__ import annotations

import numpy as np

from .jit import njit

from .registry import ODTRAIN_DOMAIN, binding
from .windows import text

RESIZE_AXES = 4


def _source_coordinates(transform, out_size, in_size, scale, roi_begin, roi_end):
    """(x_ori float64[out], outside bool[out]): the input coordinate each output cell maps to."""
    y = np.arange(out_size, dtype=np.float64)
    outside = np.zeros(out_size, dtype=np.bool_)
    length = scale * in_size
    if transform == "align_corners":
        x = np.zeros(out_size) if length == 1 else y * (in_size - 1) / (length - 1)
    elif transform == "asymmetric":
        x = y / scale
    elif transform == "pytorch_half_pixel":
        x = np.full(out_size, -0.5) if length == 1 else (y + 0.5) / scale - 0.5
    elif transform == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif transform == "half_pixel_symmetric":
        x = in_size / 2 * (1 - out_size / length) + (y + 0.5) / scale - 0.5
    elif transform == "tf_crop_and_resize":
        span = (roi_end - roi_begin) * (in_size - 1)
        x = np.full(out_size, span / 2) if length == 1 else y * span / (length - 1)
        x = x + roi_begin * (in_size - 1)
        outside = (x < 0) | (x > in_size - 1)
    else:
        raise ValueError(f"coordinate_transformation_mode={transform!r} is not an ONNX value")
    return x, outside


def _interpolation_coefficients(mode, ratio, scale, cubic_coeff_a, antialias):
    """Weights of the taps around a coordinate whose distance past its left neighbour is `ratio` in (0, 1]."""
    if antialias and scale < 1:  # a wider filter, stretched by 1/scale, normalised
        reach = 1 if mode == "linear" else 2
        start = int(np.floor(-reach / scale) + 1)
        distance = np.abs((np.arange(start, 2 - start) - ratio) * scale)
        if mode == "linear":
            weights = np.clip(1 - distance, 0, 1)
        else:
            a = cubic_coeff_a
            weights = np.where(distance <= 1, (a + 2) * distance ** 3 - (a + 3) * distance ** 2 + 1,
                               np.where(distance < 2, a * distance ** 3 - 5 * a * distance ** 2 + 8 * a * distance
                                        - 4 * a, 0.0))
        return weights / weights.sum()
    if mode == "linear":
        return np.array([1 - ratio, ratio])
    a, r = cubic_coeff_a, ratio
    return np.array([((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
                     ((a + 2) * r - (a + 3)) * r * r + 1,
                     ((a + 2) * (1 - r) - (a + 3)) * (1 - r) * (1 - r) + 1,
                     ((a * (2 - r) - 5 * a) * (2 - r) + 8 * a) * (2 - r) - 4 * a])


def _axis_table(in_size, out_size, scale, roi_begin, roi_end, mode, coordinate_transformation_mode, nearest_mode,
                cubic_coeff_a, exclude_outside, antialias):
    """(source int64[out, taps], weight float64[out, taps], outside bool[out]) of one resized axis."""
    x, outside = _source_coordinates(coordinate_transformation_mode, out_size, in_size, scale, roi_begin, roi_end)
    left = np.floor(x)
    exact = x == left
    ratio = np.where(exact, 1.0, x - left)
    if mode == "nearest":  # the left or right neighbour; an exact coordinate is its own cell
        if nearest_mode == "legacy":
            nearest_mode = "floor" if scale >= 1 else "ceil"
        right = {"floor": np.zeros_like(exact), "ceil": np.ones_like(exact), "round_prefer_floor": ratio > 0.5,
                 "round_prefer_ceil": ratio >= 0.5}[nearest_mode]
        source = np.where(exact, x, left + right).astype(np.int64)
        return np.clip(source, 0, in_size - 1)[:, None], np.ones((out_size, 1)), outside
    weights = np.array([_interpolation_coefficients(mode, r, scale, cubic_coeff_a, antialias) for r in ratio])
    taps = weights.shape[1]
    half = -(-taps // 2)
    shifted = x + half
    base = np.floor(shifted)
    fraction = shifted - base
    if taps % 2 == 0:  # an even window starts half of it to the left of the coordinate
        offset = np.where(fraction == 0, -(taps // 2), -(taps // 2) + 1)
    else:
        offset = np.where(fraction <= 0.5, -((taps - 1) // 2), -((taps - 1) // 2) + 1)
    neighbours = (base.astype(np.int64) + offset)[:, None] + np.arange(taps)[None, :] - half
    if exclude_outside:
        weights = np.where((neighbours < 0) | (neighbours >= in_size), 0.0, weights)
        totals = weights.sum(axis=1, keepdims=True)
        weights = weights / np.where(totals == 0, 1.0, totals)
    return np.clip(neighbours, 0, in_size - 1), weights, outside


class _ResizePlan:
    """The tables of one Resize between shapes `x_shape` and `y_shape`, over at most 4 merged axes."""

    def __init__(self, x_shape, y_shape, roi, scales, sizes, mode="nearest",
                 coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_floor", cubic_coeff_a=-0.75,
                 exclude_outside=0, extrapolation_value=0.0, antialias=0, axes=None,
                 keep_aspect_ratio_policy="stretch"):
        rank = len(x_shape)
        mode, transform = text(mode), text(coordinate_transformation_mode)
        axes = [int(a) % rank for a in axes] if axes is not None and len(axes) else list(range(rank))
        scale = [1.0] * rank
        if scales is not None and scales.size:
            for k, axis in enumerate(axes):
                scale[axis] = float(scales.reshape(-1)[k])
        else:
            wanted = [int(s) for s in sizes.reshape(-1)]
            ratios = {axis: wanted[k] / x_shape[axis] for k, axis in enumerate(axes)}
            policy = text(keep_aspect_ratio_policy)
            common = min(ratios.values()) if policy == "not_larger" else max(ratios.values())
            for axis in axes:
                scale[axis] = ratios[axis] if policy == "stretch" else common
        roi_full = [0.0] * rank + [1.0] * rank
        if transform == "tf_crop_and_resize":
            values = [float(v) for v in roi.reshape(-1)]
            for k, axis in enumerate(axes):
                roi_full[axis], roi_full[rank + axis] = values[k], values[len(axes) + k]
        settings = (mode, transform, text(nearest_mode), float(cubic_coeff_a), bool(exclude_outside), bool(antialias))
        # merged axes: (in size, out size, table or None for an unchanged run)
        merged = []
        for axis in range(rank):
            unchanged = (x_shape[axis] == y_shape[axis] and abs(scale[axis] - 1.0) <= 1e-9
                         and roi_full[axis] == 0.0 and roi_full[rank + axis] == 1.0)
            if unchanged and merged and merged[-1][2] is None:
                merged[-1] = (merged[-1][0] * x_shape[axis], merged[-1][1] * y_shape[axis], None)
            elif unchanged:
                merged.append((x_shape[axis], y_shape[axis], None))
            else:
                merged.append((x_shape[axis], y_shape[axis],
                               _axis_table(x_shape[axis], y_shape[axis], scale[axis], roi_full[axis],
                                           roi_full[rank + axis], *settings)))
        if len(merged) > RESIZE_AXES:
            raise ValueError(f"resizing {x_shape} to {y_shape} changes axes that do not merge into {RESIZE_AXES}")
        merged = [(1, 1, None)] * (RESIZE_AXES - len(merged)) + merged
        self.x4 = tuple(m[0] for m in merged)
        self.y4 = tuple(m[1] for m in merged)
        tables = [m[2] if m[2] is not None else (np.arange(m[1], dtype=np.int64)[:, None], np.ones((m[1], 1)),
                                                 np.zeros(m[1], dtype=np.bool_)) for m in merged]
        longest, taps = max(self.y4), max(t[0].shape[1] for t in tables)
        self.nearest = taps == 1
        self.source = np.zeros((RESIZE_AXES, longest, taps), dtype=np.int64)
        self.weight = np.zeros((RESIZE_AXES, longest, taps), dtype=np.float64)
        self.outside = np.zeros((RESIZE_AXES, longest), dtype=np.bool_)
        self.taps = np.array([t[0].shape[1] for t in tables], dtype=np.int64)
        for a, (source, weight, outside) in enumerate(tables):
            self.source[a, :source.shape[0], :source.shape[1]] = source
            self.weight[a, :weight.shape[0], :weight.shape[1]] = weight
            self.outside[a, :outside.size] = outside
        self.cropping = bool(self.outside.any())
        self.fill = float(extrapolation_value)


@njit(cache=True, error_model="numpy")
def _resize_nearest(x, y, source):
    """y[o0, o1, o2, o3] = x[source[0, o0], source[1, o1], source[2, o2], source[3, o3]]."""
    columns = source[3]
    for o0 in range(y.shape[0]):
        for o1 in range(y.shape[1]):
            for o2 in range(y.shape[2]):
                row = x[source[0, o0], source[1, o1], source[2, o2]]
                target = y[o0, o1, o2]
                for o3 in range(target.size):
                    target[o3] = row[columns[o3]]


@njit(cache=True, error_model="numpy")
def _resize_nearest_grad(dy, dx, source):
    """dx[source of each output cell] += dy[cell] (dx zeroed first): the adjoint of _resize_nearest."""
    dx.reshape(-1)[:] = 0
    columns = source[3]
    for o0 in range(dy.shape[0]):
        for o1 in range(dy.shape[1]):
            for o2 in range(dy.shape[2]):
                row = dx[source[0, o0], source[1, o1], source[2, o2]]
                grad = dy[o0, o1, o2]
                for o3 in range(grad.size):
                    row[columns[o3]] += grad[o3]


@njit(cache=True, error_model="numpy")
def _resize_interpolate(x, y, source, weight, taps, outside, fill):
    """y[o] = Σ_t Π_a weight[a, o_a, t_a] · x[source[0, o0, t0], ..., source[3, o3, t3]], summed in float64;
    `fill` where any axis maps o outside the input (tf_crop_and_resize)."""
    for o0 in range(y.shape[0]):
        for o1 in range(y.shape[1]):
            for o2 in range(y.shape[2]):
                cropped = outside[0, o0] or outside[1, o1] or outside[2, o2]
                target = y[o0, o1, o2]
                for o3 in range(target.size):
                    if cropped or outside[3, o3]:
                        target[o3] = fill
                        continue
                    total = 0.0
                    for t0 in range(taps[0]):
                        w0 = weight[0, o0, t0]
                        for t1 in range(taps[1]):
                            w1 = w0 * weight[1, o1, t1]
                            for t2 in range(taps[2]):
                                w2 = w1 * weight[2, o2, t2]
                                row = x[source[0, o0, t0], source[1, o1, t1], source[2, o2, t2]]
                                for t3 in range(taps[3]):
                                    total += w2 * weight[3, o3, t3] * row[source[3, o3, t3]]
                    target[o3] = total


@njit(cache=True, error_model="numpy")
def _resize_interpolate_grad(dy, dx, source, weight, taps, outside):
    """dx[source of each tap] += Π weights · dy[o] (dx zeroed first): the adjoint of _resize_interpolate."""
    dx.reshape(-1)[:] = 0
    for o0 in range(dy.shape[0]):
        for o1 in range(dy.shape[1]):
            for o2 in range(dy.shape[2]):
                cropped = outside[0, o0] or outside[1, o1] or outside[2, o2]
                grad = dy[o0, o1, o2]
                for o3 in range(grad.size):
                    if cropped or outside[3, o3]:
                        continue
                    g = np.float64(grad[o3])
                    for t0 in range(taps[0]):
                        w0 = weight[0, o0, t0] * g
                        for t1 in range(taps[1]):
                            w1 = w0 * weight[1, o1, t1]
                            for t2 in range(taps[2]):
                                w2 = w1 * weight[2, o2, t2]
                                row = dx[source[0, o0, t0], source[1, o1, t1], source[2, o2, t2]]
                                for t3 in range(taps[3]):
                                    row[source[3, o3, t3]] += w2 * weight[3, o3, t3]


@njit(cache=True, error_model="numpy")
def _resize_planes(x, y, source, weight, taps, rows):
    """Separable interpolation of each plane y[o0, o1] (axes 0 and 1 unchanged): every input row resampled
    along the last axis, rows[h, o3] = Σ_t weight[3, o3, t] · x[o0, o1, h, source[3, o3, t]], then each output
    row a contiguous blend of those, y[o0, o1, o2] = Σ_t weight[2, o2, t] · rows[source[2, o2, t]]."""
    for o0 in range(y.shape[0]):
        for o1 in range(y.shape[1]):
            plane = x[source[0, o0, 0], source[1, o1, 0]]
            for h in range(plane.shape[0]):
                line, target = plane[h], rows[h]
                for o3 in range(target.size):
                    total = 0.0
                    for t in range(taps[3]):
                        total += weight[3, o3, t] * line[source[3, o3, t]]
                    target[o3] = total
            for o2 in range(y.shape[2]):
                target = y[o0, o1, o2]
                line, scale = rows[source[2, o2, 0]], np.float32(weight[2, o2, 0])
                for o3 in range(target.size):
                    target[o3] = scale * line[o3]
                for t in range(1, taps[2]):
                    line, scale = rows[source[2, o2, t]], np.float32(weight[2, o2, t])
                    for o3 in range(target.size):
                        target[o3] += scale * line[o3]


@njit(cache=True, error_model="numpy")
def _resize_planes_grad(dy, dx, source, weight, taps, rows):
    """The adjoint of _resize_planes: output rows spread over rows[h], then each row scattered along the last
    axis into dx (zeroed first)."""
    dx.reshape(-1)[:] = 0
    for o0 in range(dy.shape[0]):
        for o1 in range(dy.shape[1]):
            plane = dx[source[0, o0, 0], source[1, o1, 0]]
            rows.reshape(-1)[:] = 0
            for o2 in range(dy.shape[2]):
                grad = dy[o0, o1, o2]
                for t in range(taps[2]):
                    line, scale = rows[source[2, o2, t]], np.float32(weight[2, o2, t])
                    for o3 in range(grad.size):
                        line[o3] += scale * grad[o3]
            for h in range(plane.shape[0]):
                line, target = rows[h], plane[h]
                for o3 in range(line.size):
                    value = np.float64(line[o3])
                    for t in range(taps[3]):
                        target[source[3, o3, t]] += weight[3, o3, t] * value


def _resize_scratch(gradient: bool):
    """Bytes of the separable path's rows (input rows x output width), from the shapes alone."""

    def size(specs_in, specs_out, **attrs):
        x_shape, y_shape = (specs_out[0][0], specs_in[0][0]) if gradient else (specs_in[0][0], specs_out[0][0])
        if len(x_shape) < 2 or text(attrs.get("mode", "nearest")) == "nearest":
            return 0
        return 4 * int(x_shape[-2]) * int(y_shape[-1])

    return size


def _resize_calls(x, y, roi, scales, sizes, attrs, scratch=None, gradient=False):
    """Kernel calls of Resize (x -> y) or of its gradient (x = dY, y = dX), from the forward's shapes."""
    forward_x, forward_y = (y, x) if gradient else (x, y)
    plan = _ResizePlan(forward_x.shape, forward_y.shape, roi, scales, sizes, **attrs)
    a, b = x.reshape(plan.y4 if gradient else plan.x4), y.reshape(plan.x4 if gradient else plan.y4)
    if plan.nearest and not plan.cropping:
        return [(_resize_nearest_grad if gradient else _resize_nearest, (a, b, plan.source[:, :, 0].copy()))]
    rows = plan.x4[2] * plan.y4[3]
    if plan.taps[0] == 1 and plan.taps[1] == 1 and not plan.cropping and scratch is not None \
            and 4 * rows <= scratch.size:
        work = scratch.view(np.float32)[:rows].reshape(plan.x4[2], plan.y4[3])
        kernel = _resize_planes_grad if gradient else _resize_planes
        return [(kernel, (a, b, plan.source, plan.weight, plan.taps, work))]
    if gradient:
        return [(_resize_interpolate_grad, (a, b, plan.source, plan.weight, plan.taps, plan.outside))]
    return [(_resize_interpolate, (a, b, plan.source, plan.weight, plan.taps, plan.outside, plan.fill))]


def _optional(inputs, index):
    return inputs[index] if len(inputs) > index and inputs[index] is not None else None


@binding("Resize", scratch=_resize_scratch(gradient=False))
def Resize(inputs, outputs, scratch=None, **attrs):
    if len(inputs) == 2:  # opset 10: Resize(X, scales), Upsample's coordinates and nearest cell
        attrs.update(coordinate_transformation_mode="asymmetric", nearest_mode="legacy")
        return _resize_calls(inputs[0], outputs[0], None, inputs[1], None, attrs, scratch)
    return _resize_calls(inputs[0], outputs[0], _optional(inputs, 1), _optional(inputs, 2), _optional(inputs, 3),
                         attrs, scratch)


@binding("Upsample", scratch=_resize_scratch(gradient=False))
def Upsample(inputs, outputs, mode="nearest", scratch=None):  # opset 9: Upsample(X, scales)
    attrs = {"mode": mode, "coordinate_transformation_mode": "asymmetric", "nearest_mode": "legacy"}
    return _resize_calls(inputs[0], outputs[0], None, inputs[1], None, attrs, scratch)


@binding("ResizeGrad", ODTRAIN_DOMAIN, scratch=_resize_scratch(gradient=True))
def ResizeGrad(inputs, outputs, scratch=None, **attrs):
    return _resize_calls(inputs[0], outputs[0], _optional(inputs, 2), _optional(inputs, 3), _optional(inputs, 4),
                         attrs, scratch, gradient=True)


# ---- GridSample --------------------------------------------------------------------------------------------
# Modes and padding modes as codes (arguments of one kernel): 0 nearest, 1 linear, 2 cubic; 0 zeros, 1 border,
# 2 reflection.
GRID_MODES = {"nearest": 0, "linear": 1, "bilinear": 1, "cubic": 2, "bicubic": 2}
GRID_PADDINGS = {"zeros": 0, "border": 1, "reflection": 2}


@njit(cache=True, error_model="numpy", inline="always")
def _reflect(v, low, high):
    """v reflected by the near border until it lies in [low, high]."""
    span = high - low
    if span <= 0:
        return low
    if v < low:
        distance = low - v
        n = int(distance / span)
        rest = distance - n * span
        return low + rest if n % 2 == 0 else high - rest
    if v > high:
        distance = v - high
        n = int(distance / span)
        rest = distance - n * span
        return high - rest if n % 2 == 0 else low + rest
    return v


@njit(cache=True, error_model="numpy", inline="always")
def _grid_taps(g, size, mode, padding, align, index, weight):
    """The cells one normalised coordinate g reads along an axis of `size` cells and their weights, written into
    index and weight (up to 4); returns their count. A cell outside the input reads zero (zeros padding: weight
    0), the nearest border cell (border) or its reflection (reflection)."""
    pos = (g + 1) / 2 * (size - 1) if align else ((g + 1) * size - 1) / 2
    low, high = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
    if mode == 0:
        pos = np.rint(pos)
    if pos < low or pos > high:
        if padding == 1:
            pos = min(max(pos, 0.0), size - 1.0)
        elif padding == 2:
            pos = _reflect(pos, low, high)
    if mode == 0:
        count, first = 1, int(pos)
        weight[0] = 1.0
    else:
        base = np.floor(pos)
        f = pos - base
        if mode == 1:
            count, first = 2, int(base)
            weight[0], weight[1] = 1 - f, f
        else:  # Keys' cubic convolution, A = -0.75
            count, first = 4, int(base) - 1
            a = -0.75
            for t in range(4):
                x = abs(f - (t - 1))
                weight[t] = ((a + 2) * x - (a + 3)) * x * x + 1 if x <= 1 else ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    for t in range(count):
        i = first + t
        if i < 0 or i >= size:
            if padding == 0:
                i, weight[t] = 0, 0.0
            elif padding == 1:
                i = min(max(i, 0), size - 1)
            else:
                i = int(_reflect(float(i), low, high))
        index[t] = i
    return count


@njit(cache=True, error_model="numpy")
def _grid_sample(x, grid, y, dy, dx, mode, padding, align, volumetric, backward, index, weight):
    """Forward: y[n, c, p] = Σ over the taps of grid point p of weight · x[n, c, tap]. Backward: dx = Σ over the
    points of dy · weight at each tap. x, dx: [N, C, D, H, W]; grid: [N, P, 3 or 2] (x, y[, z]); y, dy: [N, C, P]."""
    depth, height, width = x.shape[2], x.shape[3], x.shape[4]
    index = np.zeros((3, 4), np.int64)  # small, fixed: LLVM keeps it on the stack
    weight = np.zeros((3, 4), np.float64)
    if backward:
        dx.reshape(-1)[:] = 0
    for n in range(x.shape[0]):
        for p in range(grid.shape[1]):
            if volumetric:
                taps_d = _grid_taps(grid[n, p, 2], depth, mode, padding, align, index[0], weight[0])
            else:
                taps_d, index[0, 0], weight[0, 0] = 1, 0, 1.0
            taps_h = _grid_taps(grid[n, p, 1], height, mode, padding, align, index[1], weight[1])
            taps_w = _grid_taps(grid[n, p, 0], width, mode, padding, align, index[2], weight[2])
            for c in range(x.shape[1]):
                total = 0.0
                for a in range(taps_d):
                    for b in range(taps_h):
                        for e in range(taps_w):
                            w = weight[0, a] * weight[1, b] * weight[2, e]
                            if backward:
                                dx[n, c, index[0, a], index[1, b], index[2, e]] += dy[n, c, p] * w
                            else:
                                total += w * x[n, c, index[0, a], index[1, b], index[2, e]]
                if not backward:
                    y[n, c, p] = total


def _tap_buffers():
    """Each axis's taps (up to 4) and weights of one grid point: made when the step is bound, reused by every call."""
    return np.zeros((3, 4), np.int64), np.zeros((3, 4), np.float64)


def _grid_views(x_shape, grid, y_shape):
    volumetric = len(x_shape) == 5
    x5 = tuple(x_shape) if volumetric else (x_shape[0], x_shape[1], 1) + tuple(x_shape[2:])
    points = int(np.prod(grid.shape[1:-1], dtype=np.int64))
    return volumetric, x5, grid.reshape(grid.shape[0], points, grid.shape[-1]), (y_shape[0], y_shape[1], points)


@binding("GridSample")
def GridSample(inputs, outputs, mode="linear", padding_mode="zeros", align_corners=0):
    x, grid = inputs
    y = outputs[0]
    volumetric, x5, grid3, y3 = _grid_views(x.shape, grid, y.shape)
    x5v, y3v = x.reshape(x5), y.reshape(y3)
    return [(_grid_sample, (x5v, grid3, y3v, y3v, x5v, GRID_MODES[text(mode)], GRID_PADDINGS[text(padding_mode)],
                            bool(align_corners), volumetric, False) + _tap_buffers())]


@binding("GridSampleGrad", ODTRAIN_DOMAIN)
def GridSampleGrad(inputs, outputs, mode="linear", padding_mode="zeros", align_corners=0):
    dy, x, grid = inputs
    dx = outputs[0]
    volumetric, x5, grid3, y3 = _grid_views(x.shape, grid, dy.shape)
    dx5, dy3 = dx.reshape(x5), dy.reshape(y3)
    return [(_grid_sample, (x.reshape(x5), grid3, dy3, dy3, dx5, GRID_MODES[text(mode)],
                            GRID_PADDINGS[text(padding_mode)], bool(align_corners), volumetric, True)
             + _tap_buffers())]


# ---- AffineGrid ---------------------------------------------------------------------------------------------


def _base_grid(size, align_corners) -> np.ndarray:
    """[P, k + 1]: each output point's normalised (x, y[, z], 1), the x of the last axis first."""
    spatial = [int(s) for s in size[2:]]
    axes = [np.linspace(-1, 1, n) if align_corners else (2 * np.arange(n) + 1) / n - 1 for n in spatial]
    mesh = np.meshgrid(*axes, indexing="ij")
    points = [m.reshape(-1) for m in reversed(mesh)] + [np.ones(mesh[0].size)]
    return np.ascontiguousarray(np.stack(points, axis=1), dtype=np.float32)


@njit(cache=True, error_model="numpy")
def _affine_grid(theta, base, grid, backward):
    """Forward: grid[n, p, i] = Σ_j theta[n, i, j] · base[p, j]. Backward (theta is dθ, grid is dY):
    dθ[n, i, j] = Σ_p dY[n, p, i] · base[p, j]."""
    for n in range(theta.shape[0]):
        for i in range(theta.shape[1]):
            if backward:
                for j in range(theta.shape[2]):
                    total = np.float32(0.0)
                    for p in range(base.shape[0]):
                        total += grid[n, p, i] * base[p, j]
                    theta[n, i, j] = total
            else:
                for p in range(base.shape[0]):
                    total = np.float32(0.0)
                    for j in range(theta.shape[2]):
                        total += theta[n, i, j] * base[p, j]
                    grid[n, p, i] = total


def _affine_grid_call(theta, size, grid, align_corners, backward):
    base = _base_grid(size.reshape(-1), align_corners)
    k = theta.shape[1]
    return [(_affine_grid, (theta, base, grid.reshape(theta.shape[0], base.shape[0], k), backward))]


binding("AffineGrid")(lambda inputs, outputs, align_corners=0: _affine_grid_call(
    inputs[0], inputs[1], outputs[0], align_corners, False))
binding("AffineGridGrad", ODTRAIN_DOMAIN)(lambda inputs, outputs, align_corners=0: _affine_grid_call(
    outputs[0], inputs[1], inputs[0], align_corners, True))
