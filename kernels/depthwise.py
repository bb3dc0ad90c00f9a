"""Kernels: depthwise convolution (one input channel per group), the path Conv and ConvTranspose
take when C/G = 1 (their bindings and `_ConvLayout` in conv.py choose it and size its scratch).

Views: x [N, G, D, H, W], w [G, M/G, K], y [N, G, M/G, oD, oH, oW]. Two ways, chosen by output width:
- rows (wide outputs): each input plane is zero-padded into scratch and split into `stride` phases
  along the width, phases[p, d, h, j] = padded[d, h, j·stride + p], so every tap of the window reads a
  contiguous run: a vectorised multiply-add along an output row. Three taps of a row go in one pass.
- channels-last (narrow outputs, where rows are too short to vectorise): each image is transposed
  into scratch as [D, H, W, G], so every tap is one vectorised multiply-add over the channels.

The kernels run over a range of units [begin, end): (image, channel) pairs n·G + g in the row layout,
images channels-last. The `_parts` kernels split the units among threads, each part with its own
scratch (its padded plane or image, its output plane, its taps or weight-gradient sums).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .windows import _valid_range

# Sums may be reassociated (fastmath "reassoc"): they vectorise, and partial sums are no less accurate.
REDUCTION = {"reassoc", "contract"}


@njit(cache=True, error_model="numpy")
def _fill_phases(plane, phases, pad_d, pad_h, pad_w):
    """phases[p, d + pad_d, h + pad_h, j] = plane[d, h, j·S + p - pad_w] (S = phases.shape[0]), else 0."""
    stride = phases.shape[0]
    phases.reshape(-1)[:] = 0
    if stride == 2:  # source pairs (w, w + 1) go to one index of each phase: an interleaved, vectorised copy
        width, half = plane.shape[2], plane.shape[2] // 2
        for d in range(plane.shape[0]):
            for h in range(plane.shape[1]):
                source = plane[d, h]
                # column w + pad_w lands in phase (w + pad_w) % 2 at index (w + pad_w) // 2
                evens = phases[pad_w % 2, d + pad_d, h + pad_h][pad_w // 2:]
                odds = phases[(pad_w + 1) % 2, d + pad_d, h + pad_h][(pad_w + 1) // 2:]
                for t in range(half):
                    evens[t] = source[2 * t]
                    odds[t] = source[2 * t + 1]
                if width % 2:
                    evens[half] = source[width - 1]
        return
    for p in range(stride):
        lo, hi = _valid_range(p - pad_w, stride, plane.shape[2], phases.shape[3])
        for d in range(plane.shape[0]):
            for h in range(plane.shape[1]):
                target, source = phases[p, d + pad_d, h + pad_h][lo:hi], plane[d, h][lo * stride + p - pad_w:]
                if stride == 1:
                    for t in range(target.size):
                        target[t] = source[t]
                else:
                    for t in range(target.size):
                        target[t] = source[t * stride]


@njit(cache=True, error_model="numpy")
def _crop_phases(phases, plane, pad_d, pad_h, pad_w):
    """plane[d, h, w] = phases[(w + pad_w) % S, d + pad_d, h + pad_h, (w + pad_w) // S]: the adjoint's crop."""
    stride = phases.shape[0]
    if stride == 2:  # the interleaved copy of _fill_phases, reversed
        width, half = plane.shape[2], plane.shape[2] // 2
        for d in range(plane.shape[0]):
            for h in range(plane.shape[1]):
                target = plane[d, h]
                evens = phases[pad_w % 2, d + pad_d, h + pad_h][pad_w // 2:]
                odds = phases[(pad_w + 1) % 2, d + pad_d, h + pad_h][(pad_w + 1) // 2:]
                for t in range(half):
                    target[2 * t] = evens[t]
                    target[2 * t + 1] = odds[t]
                if width % 2:
                    target[width - 1] = evens[half]
        return
    for p in range(stride):
        lo, hi = _valid_range(p - pad_w, stride, plane.shape[2], phases.shape[3])
        for d in range(plane.shape[0]):
            for h in range(plane.shape[1]):
                source, target = phases[p, d + pad_d, h + pad_h][lo:hi], plane[d, h][lo * stride + p - pad_w:]
                if stride == 1:
                    for t in range(source.size):
                        target[t] = source[t]
                else:
                    for t in range(source.size):
                        target[t * stride] = source[t]


@njit(cache=True, error_model="numpy")
def _to_channels_last(source, target, pad_d, pad_h, pad_w):
    """target[d + pad_d, h + pad_h, w + pad_w, g] = source[g, d, h, w]; the rest of target is zero."""
    target.reshape(-1)[:] = 0
    for d in range(source.shape[1]):
        for h in range(source.shape[2]):
            rows = target[d + pad_d, h + pad_h, pad_w:]
            for g in range(source.shape[0]):
                line = source[g, d, h]
                for w in range(line.size):
                    rows[w, g] = line[w]


@njit(cache=True, error_model="numpy")
def _from_channels_last(source, target, pad_d, pad_h, pad_w):
    """target[g, d, h, w] = source[d + pad_d, h + pad_h, w + pad_w, g]."""
    for d in range(target.shape[1]):
        for h in range(target.shape[2]):
            rows = source[d + pad_d, h + pad_h, pad_w:]
            for g in range(target.shape[0]):
                line = target[g, d, h]
                for w in range(line.size):
                    line[w] = rows[w, g]


@njit(cache=True, error_model="numpy")
def _depthwise_forward(x, w, bias, has_bias, y, geom, columns, padded, out_rows, taps, channels_last, begin, end):
    """y[n, g, m, o] = Σ_k w[g, m, k] · x[n, g, o·s + k·d - p] (+ bias) over the units [begin, end);
    columns[:, kw] is the (phase, offset) of tap kw in the row layout."""
    kd_count, kh_count, kw_count = geom[0], geom[1], geom[2]
    groups, per_group, out_w = x.shape[1], w.shape[1], y.shape[5]
    if not channels_last:
        for unit in range(begin, end):  # units are (image, channel) pairs
            n, g = unit // groups, unit % groups
            _fill_phases(x[n, g], padded, geom[9], geom[10], geom[11])
            for m in range(per_group):
                weights = w[g, m]
                for od in range(y.shape[3]):
                    for oh in range(y.shape[4]):
                        target = y[n, g, m, od, oh]
                        target[:] = bias[g, m] if has_bias else np.float32(0.0)
                        k = 0
                        for kd in range(kd_count):
                            for kh in range(kh_count):
                                i_d, i_h = od * geom[3] + kd * geom[6], oh * geom[4] + kh * geom[7]
                                if kw_count == 3:
                                    s0 = padded[columns[0, 0], i_d, i_h][columns[1, 0]:]
                                    s1 = padded[columns[0, 1], i_d, i_h][columns[1, 1]:]
                                    s2 = padded[columns[0, 2], i_d, i_h][columns[1, 2]:]
                                    w0, w1, w2 = weights[k], weights[k + 1], weights[k + 2]
                                    for ow in range(out_w):
                                        target[ow] += w0 * s0[ow] + w1 * s1[ow] + w2 * s2[ow]
                                else:
                                    for kw in range(kw_count):
                                        source = padded[columns[0, kw], i_d, i_h][columns[1, kw]:]
                                        weight = weights[k + kw]
                                        for ow in range(out_w):
                                            target[ow] += weight * source[ow]
                                k += kw_count
        return
    for n in range(begin, end):
        _to_channels_last(x[n], padded, geom[9], geom[10], geom[11])
        for m in range(per_group):
            for k in range(w.shape[2]):
                for g in range(groups):
                    taps[k, g] = w[g, m, k]
            for od in range(y.shape[3]):
                for oh in range(y.shape[4]):
                    for ow in range(out_w):
                        total = out_rows[od, oh, ow]
                        for g in range(groups):
                            total[g] = bias[g, m] if has_bias else 0
                        k = 0
                        for kd in range(kd_count):
                            for kh in range(kh_count):
                                for kw in range(kw_count):
                                    source = padded[od * geom[3] + kd * geom[6], oh * geom[4] + kh * geom[7],
                                                    ow * geom[5] + kw * geom[8]]
                                    weight = taps[k]
                                    for g in range(groups):
                                        total[g] += weight[g] * source[g]
                                    k += 1
            _from_channels_last(out_rows, y[n, :, m], 0, 0, 0)


@njit(cache=True, error_model="numpy")
def _depthwise_input_grad(dy, w, dx, geom, columns, padded, grad_rows, taps, channels_last, begin, end):
    """dx[n, g, o·s + k·d - p] += w[g, m, k] · dy[n, g, m, o] over the units [begin, end)."""
    kd_count, kh_count, kw_count = geom[0], geom[1], geom[2]
    groups, per_group, out_w = dx.shape[1], w.shape[1], dy.shape[5]
    if not channels_last:
        for unit in range(begin, end):  # units are (image, channel) pairs
            n, g = unit // groups, unit % groups
            padded.reshape(-1)[:] = 0
            for m in range(per_group):
                weights = w[g, m]
                for od in range(dy.shape[3]):
                    for oh in range(dy.shape[4]):
                        grad = dy[n, g, m, od, oh]
                        k = 0
                        for kd in range(kd_count):
                            for kh in range(kh_count):
                                i_d, i_h = od * geom[3] + kd * geom[6], oh * geom[4] + kh * geom[7]
                                for kw in range(kw_count):  # one tap per pass: the targets overlap
                                    target = padded[columns[0, kw], i_d, i_h][columns[1, kw]:]
                                    weight = weights[k]
                                    for ow in range(out_w):
                                        target[ow] += weight * grad[ow]
                                    k += 1
            _crop_phases(padded, dx[n, g], geom[9], geom[10], geom[11])
        return
    for n in range(begin, end):
        padded.reshape(-1)[:] = 0
        for m in range(per_group):
            for k in range(w.shape[2]):
                for g in range(groups):
                    taps[k, g] = w[g, m, k]
            _to_channels_last(dy[n, :, m], grad_rows, 0, 0, 0)
            for od in range(dy.shape[3]):
                for oh in range(dy.shape[4]):
                    for ow in range(out_w):
                        grad = grad_rows[od, oh, ow]
                        k = 0
                        for kd in range(kd_count):
                            for kh in range(kh_count):
                                for kw in range(kw_count):
                                    target = padded[od * geom[3] + kd * geom[6], oh * geom[4] + kh * geom[7],
                                                    ow * geom[5] + kw * geom[8]]
                                    weight = taps[k]
                                    for g in range(groups):
                                        target[g] += weight[g] * grad[g]
                                    k += 1
        _from_channels_last(padded, dx[n], geom[9], geom[10], geom[11])


@njit(cache=True, error_model="numpy", fastmath=REDUCTION)
def _depthwise_weight_sums(dy, x, sums, geom, columns, padded, grad_rows, channels_last, begin, end):
    """Σ over the units [begin, end) of Σ_o dy[n, g, m, o] · x[n, g, o·s + k·d - p], into sums (zeroed
    first): sums[g, m, k] in the row layout, sums[m, k, g] channels-last."""
    kd_count, kh_count, kw_count = geom[0], geom[1], geom[2]
    groups, out_w = x.shape[1], dy.shape[5]
    per_group = dy.shape[2]
    sums.reshape(-1)[:] = 0
    if not channels_last:
        for unit in range(begin, end):  # units are (image, channel) pairs
            n, g = unit // groups, unit % groups
            _fill_phases(x[n, g], padded, geom[9], geom[10], geom[11])
            for m in range(per_group):
                for od in range(dy.shape[3]):
                    for oh in range(dy.shape[4]):
                        grad = dy[n, g, m, od, oh]
                        k = 0
                        for kd in range(kd_count):
                            for kh in range(kh_count):
                                i_d, i_h = od * geom[3] + kd * geom[6], oh * geom[4] + kh * geom[7]
                                for kw in range(kw_count):
                                    source = padded[columns[0, kw], i_d, i_h][columns[1, kw]:]
                                    total = np.float32(0.0)
                                    for ow in range(out_w):
                                        total += grad[ow] * source[ow]
                                    sums[g, m, k] += total
                                    k += 1
        return
    for n in range(begin, end):
        _to_channels_last(x[n], padded, geom[9], geom[10], geom[11])
        for m in range(per_group):
            _to_channels_last(dy[n, :, m], grad_rows, 0, 0, 0)
            for od in range(dy.shape[3]):
                for oh in range(dy.shape[4]):
                    for ow in range(out_w):
                        grad = grad_rows[od, oh, ow]
                        k = 0
                        for kd in range(kd_count):
                            for kh in range(kh_count):
                                for kw in range(kw_count):
                                    source = padded[od * geom[3] + kd * geom[6], oh * geom[4] + kh * geom[7],
                                                    ow * geom[5] + kw * geom[8]]
                                    total = sums[m, k]
                                    for g in range(groups):
                                        total[g] += grad[g] * source[g]
                                    k += 1


@njit(cache=True, error_model="numpy", fastmath=REDUCTION)
def _depthwise_weight_grad(dy, x, dw, geom, columns, padded, grad_rows, sums, channels_last):
    """dw[g, m, k] = Σ_n Σ_o dy[n, g, m, o] · x[n, g, o·s + k·d - p]: summed straight into dw in the row
    layout; channels-last into sums [M/G, K, G], then transposed into dw."""
    if not channels_last:
        _depthwise_weight_sums(dy, x, dw, geom, columns, padded, grad_rows, False, 0, x.shape[0] * x.shape[1])
        return
    _depthwise_weight_sums(dy, x, sums, geom, columns, padded, grad_rows, True, 0, x.shape[0])
    for g in range(dw.shape[0]):
        for m in range(dw.shape[1]):
            for k in range(dw.shape[2]):
                dw[g, m, k] = sums[m, k, g]


# ---- the same on parts of the units, in parallel (kernels/parts.py) ---------------------------------
# work[p] is part p's scratch: its padded plane or image (padded_shape), its output or gradient plane
# (rows_shape), then its taps or weight-gradient sums (sums_shape).


@njit(cache=True, error_model="numpy", inline="always")
def _part_work(work, part, padded_shape, rows_shape, sums_shape):
    """(padded, rows, sums) views of part `part`'s scratch."""
    mine = work[part]
    padded_size = padded_shape[0] * padded_shape[1] * padded_shape[2] * padded_shape[3]
    rows_size = rows_shape[0] * rows_shape[1] * rows_shape[2] * rows_shape[3]
    sums_size = sums_shape[0] * sums_shape[1] * sums_shape[2]
    padded = mine[:padded_size].reshape(padded_shape)
    rows = mine[padded_size:padded_size + rows_size].reshape(rows_shape)
    sums = mine[padded_size + rows_size:padded_size + rows_size + sums_size].reshape(sums_shape)
    return padded, rows, sums


@njit(cache=True, error_model="numpy", parallel=True)
def _depthwise_forward_parts(x, w, bias, has_bias, y, geom, columns, work, padded_shape, rows_shape, sums_shape,
                             channels_last, bounds):
    """_depthwise_forward on the units of each part (bounds), in parallel."""
    for part in prange(bounds.size - 1):
        padded, rows, taps = _part_work(work, part, padded_shape, rows_shape, sums_shape)
        _depthwise_forward(x, w, bias, has_bias, y, geom, columns, padded, rows, taps[0], channels_last,
                           bounds[part], bounds[part + 1])


@njit(cache=True, error_model="numpy", parallel=True)
def _depthwise_input_grad_parts(dy, w, dx, geom, columns, work, padded_shape, rows_shape, sums_shape,
                                channels_last, bounds):
    """_depthwise_input_grad on the units of each part (bounds), in parallel."""
    for part in prange(bounds.size - 1):
        padded, rows, taps = _part_work(work, part, padded_shape, rows_shape, sums_shape)
        _depthwise_input_grad(dy, w, dx, geom, columns, padded, rows, taps[0], channels_last, bounds[part],
                              bounds[part + 1])


@njit(cache=True, error_model="numpy", parallel=True, fastmath=REDUCTION)
def _depthwise_weight_grad_parts(dy, x, dw, geom, columns, work, padded_shape, rows_shape, sums_shape,
                                 channels_last, bounds):
    """dw as _depthwise_weight_grad, each part (bounds) summing its units into its own sums ([G, M/G, K] in
    the row layout, [M/G, K, G] channels-last), in parallel; the parts' sums are added in part order."""
    parts = bounds.size - 1
    for part in prange(parts):
        padded, rows, sums = _part_work(work, part, padded_shape, rows_shape, sums_shape)
        _depthwise_weight_sums(dy, x, sums, geom, columns, padded, rows, channels_last, bounds[part],
                               bounds[part + 1])
    for part in range(parts):
        sums = _part_work(work, part, padded_shape, rows_shape, sums_shape)[2]
        for g in range(dw.shape[0]):
            for m in range(dw.shape[1]):
                for k in range(dw.shape[2]):
                    value = sums[m, k, g] if channels_last else sums[g, m, k]
                    dw[g, m, k] = value if part == 0 else dw[g, m, k] + value
