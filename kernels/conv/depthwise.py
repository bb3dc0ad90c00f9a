"""Kernels: depthwise convolution (one input channel per group), the path Conv and ConvTranspose
take when C/G = 1 (kernels/conv/__init__.py chooses it; `DepthwisePlan` here lays it out, sizes its scratch
and makes its calls).

Views: x [N, G, D, H, W], w [G, M/G, K], y [N, G, M/G, oD, oH, oW]. Two ways, chosen by output width:
- planes (wide outputs): each input plane is copied into a frame split into stride phases along every
  axis, phase (c % S) at c // S, with a zero border (`_to_frame`; `_frames` states
  the geometry). Flattened at the frame's pitch, every tap of every output cell reads one contiguous
  run, so a whole plane is one vectorised pass of nine taps (`_multiply_add`; the cells between rows
  are computed and dropped). The weight gradient sums nine dot products in one pass over dY framed at
  that pitch; the input gradient gathers each phase of dX from dY framed with zeros in front.
- channels-last (narrow outputs, where planes are too small to vectorise): each image is transposed
  into scratch as [D, H, W, G], so three taps are one vectorised multiply-add over the channels; with
  unit strides the input gradient gathers from dY framed the same way, else it scatters.

Borders are zeroed once per call, not per plane: every plane of a call writes the same cells. The
kernels run over a range of units [begin, end): (image, channel) pairs n·G + g in the planes layout,
images channels-last. The `_parts` kernels split the units among threads, each part with its own
scratch (its frames or image, its output or gradient plane, its taps or weight-gradient sums).
"""
from __future__ import annotations

import numpy as np

from ..jit import njit, prange

from ..parallel_split import on_parts, part_count, twin_of
from ..windows import FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT, valid_range

# Sums may be reassociated (fastmath "reassoc"): they vectorise, and partial sums are no less accurate.
REDUCTION = {"reassoc", "contract"}
# outputs at least this wide work in planes, others channels-last: on MobileNetV2's layers each order wins on
# its side of this width (bench_ops.ConvOps, depthwise; the runs: benchmarks/README.md, "Figures behind kernel
# choices")
PLANE_WIDTH = 24


@njit(cache=True, error_model="numpy")
def _frame_copy(plane, frame, strides, pads, pitch, into_frame):
    """frame[phase(c), flat(c // S)] = plane[c - pads] (into_frame) or the reverse, for every cell c of the
    plane shifted by `pads`, where phase(c) = ((c0 % S0)·S1 + c1 % S1)·S2 + c2 % S2 and
    flat(q) = (q0·pitch0 + q1)·pitch1 + q2. Other cells of frame are left as they are: zeroed once, the
    border stays zero for every plane of a call."""
    s0, s1, s2 = strides[0], strides[1], strides[2]
    width, half = plane.shape[2], plane.shape[2] // 2
    for d in range(plane.shape[0]):
        r0, q0 = (d + pads[0]) % s0, (d + pads[0]) // s0
        for h in range(plane.shape[1]):
            r1, q1 = (h + pads[1]) % s1, (h + pads[1]) // s1
            line, phase, start = plane[d, h], (r0 * s1 + r1) * s2, (q0 * pitch[0] + q1) * pitch[1]
            if s2 == 1:
                cells = frame[phase, start + pads[2]:start + pads[2] + width]
                if into_frame:
                    for t in range(width):
                        cells[t] = line[t]
                else:
                    for t in range(width):
                        line[t] = cells[t]
            elif s2 == 2:  # pairs (w, w + 1) of the line go to one index of each phase: an interleaved copy
                evens = frame[phase + pads[2] % 2, start + pads[2] // 2:start + pitch[1]]
                odds = frame[phase + (pads[2] + 1) % 2, start + (pads[2] + 1) // 2:start + pitch[1]]
                if into_frame:
                    for t in range(half):
                        evens[t] = line[2 * t]
                        odds[t] = line[2 * t + 1]
                    if width % 2:
                        evens[half] = line[width - 1]
                else:
                    for t in range(half):
                        line[2 * t] = evens[t]
                        line[2 * t + 1] = odds[t]
                    if width % 2:
                        line[width - 1] = evens[half]
            else:
                for r2 in range(s2):
                    lo, hi = valid_range(r2 - pads[2], s2, width, pitch[1])
                    cells, first = frame[phase + r2, start + lo:start + hi], lo * s2 + r2 - pads[2]
                    for t in range(hi - lo):
                        if into_frame:
                            cells[t] = line[first + t * s2]
                        else:
                            line[first + t * s2] = cells[t]


@njit(cache=True, error_model="numpy")
def _to_frame(plane, frame, strides, pads, pitch):
    """Copies plane into frame (see _frame_copy)."""
    _frame_copy(plane, frame, strides, pads, pitch, True)


@njit(cache=True, error_model="numpy")
def _from_frame(frame, plane, strides, pads, pitch):
    """Copies frame back into plane: the inverse of _to_frame."""
    _frame_copy(plane, frame, strides, pads, pitch, False)


@njit(cache=True, error_model="numpy")
def _to_channels_last(source, target, pad_d, pad_h, pad_w):
    """target[d + pad_d, h + pad_h, w + pad_w, g] = source[g, d, h, w]; the rest of target is left as it is
    (zeroed once, the border stays zero for every image of a call)."""
    for d in range(source.shape[1]):  # channels innermost: contiguous stores, which vectorise (rows innermost do not)
        for h in range(source.shape[2]):
            for w in range(source.shape[3]):
                cell = target[d + pad_d, h + pad_h, w + pad_w]
                for g in range(source.shape[0]):
                    cell[g] = source[g, d, h, w]


@njit(cache=True, error_model="numpy")
def _from_channels_last(source, target, pad_d, pad_h, pad_w):
    """target[g, d, h, w] = source[d + pad_d, h + pad_h, w + pad_w, g]."""
    for d in range(target.shape[1]):  # channels innermost: contiguous loads
        for h in range(target.shape[2]):
            for w in range(target.shape[3]):
                cell = source[d + pad_d, h + pad_h, w + pad_w]
                for g in range(target.shape[0]):
                    target[g, d, h, w] = cell[g]


@njit(cache=True, error_model="numpy")
def _multiply_add(target, sources, phases, offsets, weights, order, first, count, bias, assign):
    """target[j] = (bias if assign else target[j]) + Σ_t weights[t]·sources[phases[t], offsets[t] + j] over the
    taps t = order[first:first + count], in that order, nine or three taps a pass (one store per pass)."""
    length = target.size
    if count == 0 and assign:
        target[:] = bias
    i, end = first, first + count
    while i < end:
        if end - i >= 9:
            k0, k1, k2, k3, k4 = order[i], order[i + 1], order[i + 2], order[i + 3], order[i + 4]
            k5, k6, k7, k8 = order[i + 5], order[i + 6], order[i + 7], order[i + 8]
            s0 = sources[phases[k0], offsets[k0]:offsets[k0] + length]
            s1 = sources[phases[k1], offsets[k1]:offsets[k1] + length]
            s2 = sources[phases[k2], offsets[k2]:offsets[k2] + length]
            s3 = sources[phases[k3], offsets[k3]:offsets[k3] + length]
            s4 = sources[phases[k4], offsets[k4]:offsets[k4] + length]
            s5 = sources[phases[k5], offsets[k5]:offsets[k5] + length]
            s6 = sources[phases[k6], offsets[k6]:offsets[k6] + length]
            s7 = sources[phases[k7], offsets[k7]:offsets[k7] + length]
            s8 = sources[phases[k8], offsets[k8]:offsets[k8] + length]
            w0, w1, w2, w3, w4 = weights[k0], weights[k1], weights[k2], weights[k3], weights[k4]
            w5, w6, w7, w8 = weights[k5], weights[k6], weights[k7], weights[k8]
            if assign:
                for j in range(length):
                    target[j] = (bias + w0 * s0[j] + w1 * s1[j] + w2 * s2[j] + w3 * s3[j] + w4 * s4[j] + w5 * s5[j]
                                 + w6 * s6[j] + w7 * s7[j] + w8 * s8[j])
            else:
                for j in range(length):
                    target[j] += (w0 * s0[j] + w1 * s1[j] + w2 * s2[j] + w3 * s3[j] + w4 * s4[j] + w5 * s5[j]
                                  + w6 * s6[j] + w7 * s7[j] + w8 * s8[j])
            i += 9
        elif end - i >= 3:
            k0, k1, k2 = order[i], order[i + 1], order[i + 2]
            s0 = sources[phases[k0], offsets[k0]:offsets[k0] + length]
            s1 = sources[phases[k1], offsets[k1]:offsets[k1] + length]
            s2 = sources[phases[k2], offsets[k2]:offsets[k2] + length]
            w0, w1, w2 = weights[k0], weights[k1], weights[k2]
            if assign:
                for j in range(length):
                    target[j] = bias + w0 * s0[j] + w1 * s1[j] + w2 * s2[j]
            else:
                for j in range(length):
                    target[j] += w0 * s0[j] + w1 * s1[j] + w2 * s2[j]
            i += 3
        else:
            k0 = order[i]
            s0 = sources[phases[k0], offsets[k0]:offsets[k0] + length]
            w0 = weights[k0]
            if assign:
                for j in range(length):
                    target[j] = bias + w0 * s0[j]
            else:
                for j in range(length):
                    target[j] += w0 * s0[j]
            i += 1
        assign = False


@njit(cache=True, error_model="numpy", fastmath=REDUCTION)
def _tap_sums(grad, sources, phases, offsets, sums):
    """sums[k] += Σ_j grad[j]·sources[phases[k], offsets[k] + j] for every tap k: nine taps in one pass (faster than one
    pass each: grad is read once; bench_ops.ConvOps, depthwise ConvWeightGrad), other counts one pass each."""
    length = grad.size
    if offsets.size == 9:
        s0 = sources[phases[0], offsets[0]:offsets[0] + length]
        s1 = sources[phases[1], offsets[1]:offsets[1] + length]
        s2 = sources[phases[2], offsets[2]:offsets[2] + length]
        s3 = sources[phases[3], offsets[3]:offsets[3] + length]
        s4 = sources[phases[4], offsets[4]:offsets[4] + length]
        s5 = sources[phases[5], offsets[5]:offsets[5] + length]
        s6 = sources[phases[6], offsets[6]:offsets[6] + length]
        s7 = sources[phases[7], offsets[7]:offsets[7] + length]
        s8 = sources[phases[8], offsets[8]:offsets[8] + length]
        t0 = t1 = t2 = t3 = t4 = t5 = t6 = t7 = t8 = np.float32(0.0)
        for j in range(length):
            value = grad[j]
            t0 += value * s0[j]
            t1 += value * s1[j]
            t2 += value * s2[j]
            t3 += value * s3[j]
            t4 += value * s4[j]
            t5 += value * s5[j]
            t6 += value * s6[j]
            t7 += value * s7[j]
            t8 += value * s8[j]
        sums[0] += t0
        sums[1] += t1
        sums[2] += t2
        sums[3] += t3
        sums[4] += t4
        sums[5] += t5
        sums[6] += t6
        sums[7] += t7
        sums[8] += t8
        return
    for k in range(offsets.size):
        source = sources[phases[k], offsets[k]:offsets[k] + length]
        total = np.float32(0.0)
        for j in range(length):
            total += grad[j] * source[j]
        sums[k] += total


@njit(cache=True, error_model="numpy")
def _channel_multiply_add(target, sources, base, offsets, weights):
    """target[g] += Σ_k weights[k, g]·sources[base + offsets[k] + g] over the taps k in order, three taps a
    pass: the channels-last twin of _multiply_add (nine taps a pass are no faster here)."""
    groups, count = target.size, offsets.size
    i = 0
    while i < count:
        if count - i >= 3:
            s0 = sources[base + offsets[i]:base + offsets[i] + groups]
            s1 = sources[base + offsets[i + 1]:base + offsets[i + 1] + groups]
            s2 = sources[base + offsets[i + 2]:base + offsets[i + 2] + groups]
            w0, w1, w2 = weights[i], weights[i + 1], weights[i + 2]
            for g in range(groups):
                target[g] += w0[g] * s0[g] + w1[g] * s1[g] + w2[g] * s2[g]
            i += 3
        else:
            s0, w0 = sources[base + offsets[i]:base + offsets[i] + groups], weights[i]
            for g in range(groups):
                target[g] += w0[g] * s0[g]
            i += 1


@njit(cache=True, error_model="numpy")
def _depthwise_forward(x, w, bias, has_bias, y, geom, taps, frame, padded, rows, weights, padded_shape, rows_shape,
                       channels_last, begin, end):
    """y[n, g, m, o] = Σ_k w[g, m, k] · x[n, g, o·s + k·d - p] (+ bias) over the units [begin, end)."""
    groups, per_group = x.shape[1], w.shape[1]
    strides, pads = (geom[3], geom[4], geom[5]), (geom[9], geom[10], geom[11])
    if not channels_last:
        planes = padded[:padded_shape[0] * padded_shape[1]].reshape((padded_shape[0], padded_shape[1]))
        out = rows[:rows_shape[1]].reshape((1, rows_shape[1]))
        planes[:, :] = 0
        pitch, length = (frame[1], frame[2]), frame[9]
        for unit in range(begin, end):  # units are (image, channel) pairs
            n, g = unit // groups, unit % groups
            _to_frame(x[n, g], planes, strides, pads, pitch)
            for m in range(per_group):
                base = bias[g, m] if has_bias else np.float32(0.0)
                _multiply_add(out[0, :length], planes, taps[0], taps[1], w[g, m], taps[3], 0, taps.shape[1], base,
                              True)
                _from_frame(out, y[n, g, m], (1, 1, 1), (0, 0, 0), pitch)
        return
    image = padded.reshape(padded_shape)
    out_rows = rows[:y.shape[3] * y.shape[4] * y.shape[5] * groups].reshape((y.shape[3], y.shape[4], y.shape[5],
                                                                             groups))
    padded[:] = 0
    for n in range(begin, end):
        _to_channels_last(x[n], image, pads[0], pads[1], pads[2])
        for m in range(per_group):
            if per_group > 1 or n == begin:  # the taps of one multiplier, channels last: once per call if M/G = 1
                for k in range(w.shape[2]):
                    for g in range(groups):
                        weights[k, g] = w[g, m, k]
            for od in range(y.shape[3]):
                for oh in range(y.shape[4]):
                    for ow in range(y.shape[5]):
                        total = out_rows[od, oh, ow]
                        for g in range(groups):
                            total[g] = bias[g, m] if has_bias else 0
                        corner = ((od * strides[0] * padded_shape[1] + oh * strides[1]) * padded_shape[2]
                                  + ow * strides[2]) * groups
                        _channel_multiply_add(total, padded, corner, taps[1], weights)
            _from_channels_last(out_rows, y[n, :, m], 0, 0, 0)


@njit(cache=True, error_model="numpy")
def _depthwise_input_grad(dy, w, dx, geom, taps, frame, padded, rows, weights, padded_shape, rows_shape,
                          channels_last, begin, end):
    """dx[n, g, o·s + k·d - p] += w[g, m, k] · dy[n, g, m, o] over the units [begin, end)."""
    groups, per_group = dx.shape[1], w.shape[1]
    if not channels_last:  # each phase of dx gathers its taps from dy framed with zeros
        results = padded[:padded_shape[0] * padded_shape[1]].reshape((padded_shape[0], padded_shape[1]))
        grad = rows[:rows_shape[1]].reshape((1, rows_shape[1]))
        grad[:, :] = 0
        pitch, length, starts = (frame[4], frame[5]), frame[10], frame[11:]
        for unit in range(begin, end):  # units are (image, channel) pairs
            n, g = unit // groups, unit % groups
            for m in range(per_group):
                _to_frame(dy[n, g, m], grad, (1, 1, 1), (frame[6], frame[7], frame[8]), pitch)
                for phase in range(results.shape[0]):
                    _multiply_add(results[phase, :length], grad, taps[5], taps[2], w[g, m], taps[4], starts[phase],
                                  starts[phase + 1] - starts[phase], np.float32(0.0), m == 0)
            _from_frame(results, dx[n, g], (geom[3], geom[4], geom[5]), (geom[9], geom[10], geom[11]), pitch)
        return
    image = padded.reshape(padded_shape)
    if geom[3] == 1 and geom[4] == 1 and geom[5] == 1:  # gather from dY framed with zeros, nine taps a pass
        pitch = (frame[3], frame[4], frame[5])
        grad = rows[:pitch[0] * pitch[1] * pitch[2] * groups]
        grad[:] = 0
        framed = grad.reshape((pitch[0], pitch[1], pitch[2], groups))
        for n in range(begin, end):
            for m in range(per_group):
                if per_group > 1 or n == begin:
                    for k in range(w.shape[2]):
                        for g in range(groups):
                            weights[k, g] = w[g, m, k]
                _to_channels_last(dy[n, :, m], framed, frame[6], frame[7], frame[8])
                for d in range(geom[9], geom[9] + dx.shape[2]):
                    for h in range(geom[10], geom[10] + dx.shape[3]):
                        for c in range(geom[11], geom[11] + dx.shape[4]):
                            target = image[d, h, c]
                            if m == 0:
                                target[:] = 0
                            _channel_multiply_add(target, grad, ((d * pitch[1] + h) * pitch[2] + c) * groups,
                                                  taps[2], weights)
            _from_channels_last(image, dx[n], geom[9], geom[10], geom[11])
        return
    kd_count, kh_count, kw_count = geom[0], geom[1], geom[2]
    grad_rows = rows[:dy.shape[3] * dy.shape[4] * dy.shape[5] * groups].reshape((dy.shape[3], dy.shape[4],
                                                                                 dy.shape[5], groups))
    out_w = dy.shape[5]
    for n in range(begin, end):
        padded[:] = 0
        for m in range(per_group):
            if per_group > 1 or n == begin:
                for k in range(w.shape[2]):
                    for g in range(groups):
                        weights[k, g] = w[g, m, k]
            _to_channels_last(dy[n, :, m], grad_rows, 0, 0, 0)
            for od in range(dy.shape[3]):
                for oh in range(dy.shape[4]):
                    for ow in range(out_w):
                        grad = grad_rows[od, oh, ow]
                        k = 0
                        for kd in range(kd_count):
                            for kh in range(kh_count):
                                for kw in range(kw_count):
                                    target = image[od * geom[3] + kd * geom[6], oh * geom[4] + kh * geom[7],
                                                   ow * geom[5] + kw * geom[8]]
                                    weight = weights[k]
                                    for g in range(groups):
                                        target[g] += weight[g] * grad[g]
                                    k += 1
        _from_channels_last(image, dx[n], geom[9], geom[10], geom[11])


@njit(cache=True, error_model="numpy", fastmath=REDUCTION)
def _depthwise_weight_sums(dy, x, sums, geom, taps, frame, padded, rows, padded_shape, rows_shape, channels_last,
                           begin, end):
    """Σ over the units [begin, end) of Σ_o dy[n, g, m, o] · x[n, g, o·s + k·d - p], into sums (zeroed
    first): sums[g, m, k] in the planes layout, sums[m, k, g] channels-last."""
    groups, per_group = x.shape[1], dy.shape[2]
    sums.reshape(-1)[:] = 0
    if not channels_last:
        planes = padded[:padded_shape[0] * padded_shape[1]].reshape((padded_shape[0], padded_shape[1]))
        grad = rows[:rows_shape[1]].reshape((1, rows_shape[1]))
        planes[:, :] = 0
        grad[:, :] = 0
        strides, pads = (geom[3], geom[4], geom[5]), (geom[9], geom[10], geom[11])
        pitch, length = (frame[1], frame[2]), frame[9]
        for unit in range(begin, end):  # units are (image, channel) pairs
            n, g = unit // groups, unit % groups
            _to_frame(x[n, g], planes, strides, pads, pitch)
            for m in range(per_group):
                _to_frame(dy[n, g, m], grad, (1, 1, 1), (0, 0, 0), pitch)
                _tap_sums(grad[0, :length], planes, taps[0], taps[1], sums[g, m])
        return
    image = padded.reshape(padded_shape)
    grad_rows = rows[:dy.shape[3] * dy.shape[4] * dy.shape[5] * groups].reshape((dy.shape[3], dy.shape[4],
                                                                                 dy.shape[5], groups))
    padded[:] = 0
    pixels = frame[frame.size - dy.shape[5]:]  # each output cell of a row: its offset in the image, times G
    for n in range(begin, end):
        _to_channels_last(x[n], image, geom[9], geom[10], geom[11])
        for m in range(per_group):
            _to_channels_last(dy[n, :, m], grad_rows, 0, 0, 0)
            for od in range(dy.shape[3]):
                for oh in range(dy.shape[4]):
                    corner = (od * geom[3] * padded_shape[1] + oh * geom[4]) * padded_shape[2] * groups
                    for k in range(taps.shape[1]):  # a row of output cells, three a pass, into the tap's sums
                        _channel_multiply_add(sums[m, k], padded, corner + taps[1, k], pixels, grad_rows[od, oh])


@njit(cache=True, error_model="numpy", fastmath=REDUCTION)
def _depthwise_weight_grad(dy, x, dw, geom, taps, frame, padded, rows, sums, padded_shape, rows_shape,
                           channels_last):
    """dw[g, m, k] = Σ_n Σ_o dy[n, g, m, o] · x[n, g, o·s + k·d - p]: summed straight into dw in the planes
    layout; channels-last into sums [M/G, K, G], then transposed into dw."""
    if not channels_last:
        _depthwise_weight_sums(dy, x, dw, geom, taps, frame, padded, rows, padded_shape, rows_shape, False, 0,
                               x.shape[0] * x.shape[1])
        return
    _depthwise_weight_sums(dy, x, sums, geom, taps, frame, padded, rows, padded_shape, rows_shape, True, 0,
                           x.shape[0])
    for g in range(dw.shape[0]):
        for m in range(dw.shape[1]):
            for k in range(dw.shape[2]):
                dw[g, m, k] = sums[m, k, g]


# ---- the same on parts of the units, in parallel (kernels/parallel_split.py) ---------------------------------
# work[p] is part p's scratch: its padded planes or image (padded_shape), its output or gradient plane
# (rows_shape), then its taps or weight-gradient sums (sums_shape): work and sums_shape stand in the twin's
# arguments where the serial kernel's three pieces of scratch stand.


@njit(cache=True, error_model="numpy", inline="always")
def _part_work(work, part, padded_shape, rows_shape, sums_shape):
    """(padded, rows, sums) of part `part`'s scratch: the first two flat, sums [sums_shape]."""
    mine = work[part]
    padded_size = padded_shape[0] * padded_shape[1] * padded_shape[2] * padded_shape[3]
    rows_size = rows_shape[0] * rows_shape[1] * rows_shape[2] * rows_shape[3]
    sums_size = sums_shape[0] * sums_shape[1] * sums_shape[2]
    sums = mine[padded_size + rows_size:padded_size + rows_size + sums_size].reshape(sums_shape)
    return mine[:padded_size], mine[padded_size:padded_size + rows_size], sums


@twin_of(_depthwise_forward, range=("begin", "end"), replaces=("padded", "rows", "weights"),
         takes=("work", "sums_shape"), because="each part runs on its own work memory")
@njit(cache=True, error_model="numpy", parallel=True)
def _depthwise_forward_parts(x, w, bias, has_bias, y, geom, taps, frame, work, sums_shape, padded_shape, rows_shape,
                             channels_last, bounds):
    """_depthwise_forward on the units of each part (bounds), in parallel."""
    for part in prange(bounds.size - 1):
        padded, rows, weights = _part_work(work, part, padded_shape, rows_shape, sums_shape)
        _depthwise_forward(x, w, bias, has_bias, y, geom, taps, frame, padded, rows, weights[0], padded_shape,
                           rows_shape, channels_last, bounds[part], bounds[part + 1])


@twin_of(_depthwise_input_grad, range=("begin", "end"), replaces=("padded", "rows", "weights"),
         takes=("work", "sums_shape"), because="each part runs on its own work memory")
@njit(cache=True, error_model="numpy", parallel=True)
def _depthwise_input_grad_parts(dy, w, dx, geom, taps, frame, work, sums_shape, padded_shape, rows_shape,
                                channels_last, bounds):
    """_depthwise_input_grad on the units of each part (bounds), in parallel."""
    for part in prange(bounds.size - 1):
        padded, rows, weights = _part_work(work, part, padded_shape, rows_shape, sums_shape)
        _depthwise_input_grad(dy, w, dx, geom, taps, frame, padded, rows, weights[0], padded_shape, rows_shape,
                              channels_last, bounds[part], bounds[part + 1])


@twin_of(_depthwise_weight_grad, replaces=("padded", "rows", "sums"), takes=("work", "sums_shape"),
         because="each part sums its units' dW into its own sums, added in part order after")
@njit(cache=True, error_model="numpy", parallel=True, fastmath=REDUCTION)
def _depthwise_weight_grad_parts(dy, x, dw, geom, taps, frame, work, sums_shape, padded_shape, rows_shape,
                                 channels_last, bounds):
    """dw as _depthwise_weight_grad, each part (bounds) summing its units into its own sums ([G, M/G, K] in
    the planes layout, [M/G, K, G] channels-last), in parallel; the parts' sums are added in part order."""
    parts = bounds.size - 1
    for part in prange(parts):
        padded, rows, sums = _part_work(work, part, padded_shape, rows_shape, sums_shape)
        _depthwise_weight_sums(dy, x, sums, geom, taps, frame, padded, rows, padded_shape, rows_shape,
                               channels_last, bounds[part], bounds[part + 1])
    for part in range(parts):
        sums = _part_work(work, part, padded_shape, rows_shape, sums_shape)[2]
        for g in range(dw.shape[0]):
            for m in range(dw.shape[1]):
                for k in range(dw.shape[2]):
                    value = sums[m, k, g] if channels_last else sums[g, m, k]
                    dw[g, m, k] = value if part == 0 else dw[g, m, k] + value


# ---- the plan: layout, work memory and calls of one depthwise convolution -------------------------------------


KERNELS = {FORWARD: _depthwise_forward, INPUT_GRADIENT: _depthwise_input_grad, WEIGHT_GRADIENT: _depthwise_weight_grad}


def _frames(geom, padded, out_spatial, channels=0):
    """(taps int64 [6, K], frame int64) of the depthwise planes layout (_to_frame), or
    channels-last (`channels` > 0) with offsets in elements of the padded image [..., channels] (taps[1])
    and of dY framed (taps[2], for unit strides, where the phases are the planes themselves).

    The padded input plane is split into S0·S1·S2 stride phases of Q = ceil(padded / S) cells a side; tap k
    at padded cell o·S + k·d reads phase (k·d) % S at q = o + (k·d) // S, so over the output cells
    flattened at the phases' pitch every tap reads one contiguous run. The input gradient gathers: phase r
    of dX at q is Σ over the taps of phase r of w · dY[q - (k·d) // S], from dY framed with R = max (k·d) // S
    zeros in front (extents T = Q + R; every Q is at least the output's extent).
    taps: 0 the tap's phase, 1 its forward offset (pitch Q), 2 its backward offset (pitch T), 3 the taps in
    order, 4 the taps ordered by phase, 5 zeros (dY's single frame). frame: Q[3], T[3], R[3], the forward
    and backward lengths, then each phase's first index into taps[4] (S0·S1·S2 + 1 values); channels-last,
    then the offset of each output cell of a row in the padded image (its last oW values)."""
    kernel, strides, dilations = geom[0:3], geom[3:6], geom[6:9]
    phases_of = [int(s) for s in strides]
    q = [-(-int(padded[a]) // phases_of[a]) for a in range(3)]
    cells = np.stack(np.meshgrid(*[np.arange(int(k)) for k in kernel], indexing="ij"), -1).reshape(-1, 3)
    cells = cells * dilations
    phase_of, shift = cells % strides, cells // strides
    phase = (phase_of[:, 0] * strides[1] + phase_of[:, 1]) * strides[2] + phase_of[:, 2]
    reach = shift.max(axis=0)
    t = [q[a] + int(reach[a]) for a in range(3)]
    forward = (shift[:, 0] * q[1] + shift[:, 1]) * q[2] + shift[:, 2]
    back = reach - shift
    backward = (back[:, 0] * t[1] + back[:, 1]) * t[2] + back[:, 2]
    order = np.arange(cells.shape[0])
    by_phase = np.argsort(phase, kind="stable")
    pixels = []
    if channels:
        forward = ((cells[:, 0] * int(padded[1]) + cells[:, 1]) * int(padded[2]) + cells[:, 2]) * channels
        backward = backward * channels
        pixels = list(np.arange(int(out_spatial[2])) * int(strides[2]) * channels)
    taps = np.stack([phase, forward, backward, order, by_phase, np.zeros_like(order)]).astype(np.int64)
    o = [int(v) for v in out_spatial]
    forward_length = (o[0] - 1) * q[1] * q[2] + (o[1] - 1) * q[2] + o[2]
    backward_length = (q[0] - 1) * t[1] * t[2] + (q[1] - 1) * t[2] + q[2]
    starts = np.searchsorted(phase[by_phase], np.arange(int(np.prod(strides)) + 1))
    frame = np.array(q + t + [int(r) for r in reach] + [forward_length, backward_length] + list(starts) + pixels,
                     np.int64)
    return taps, frame


class DepthwisePlan:
    """How one depthwise convolution runs (one input channel per group, `takes`), from its Convolution
    (kernels/windows.py) and the step's threads: the layout (planes or channels-last), the units its parts
    split ((image, channel) pairs in planes, images channels-last), and each part's work memory: the padded
    planes or image (padded_shape), an output or gradient plane (rows_shape), the taps or dW sums (sums_shape)."""

    @staticmethod
    def takes(conv, op: int) -> bool:
        return conv.depthwise

    def __init__(self, conv, threads: int):
        batch, group, geom = conv.batch, conv.groups, conv.geom
        x3, y3 = conv.x3, conv.y3
        per_group, k = conv.out_per_group, int(np.prod(geom[0:3]))
        planes_layout = y3[2] >= PLANE_WIDTH
        self.units = batch * group if planes_layout else batch
        self.parts = part_count(threads, self.units, conv.multiply_adds)
        self.geom, self.x5, self.y6 = geom, (batch, group) + x3, (batch, group, per_group) + y3
        padded = tuple(max(x3[a] + geom[9 + a], (y3[a] - 1) * geom[3 + a] + (geom[a] - 1) * geom[6 + a] + 1)
                       for a in range(3))
        self.channels_last = not planes_layout
        self.taps, self.frame = _frames(geom, padded, y3, group if self.channels_last else 0)
        if self.channels_last:  # the padded image, one output plane (or dY framed), the taps or dW sums: [..., G]
            self.padded_shape = padded + (group,)
            unit_strides = bool((geom[3:6] == 1).all())
            self.rows_shape = tuple(int(t) for t in self.frame[3:6]) + (group,) if unit_strides else y3 + (group,)
            self.sums_shape = (per_group, k, group)
        else:  # the planes of one image channel in stride phases, and one framed plane of dY or Y
            frame_size = int(np.prod(self.frame[3:6]))
            self.padded_shape = (int(np.prod(geom[3:6])), frame_size, 1, 1)
            self.rows_shape = (1, frame_size, 1, 1)
            # serial: taps stand-in [1, 1, 1] (dW sums go straight to dW); parts: dW sums [G, M/G, K]
            self.sums_shape = (group, per_group, k) if self.parts > 1 else (1, 1, 1)
        self.padded_size = int(np.prod(self.padded_shape))
        self.rows_size = int(np.prod(self.rows_shape))
        self.sums_size = int(np.prod(self.sums_shape))

    def scratch_bytes(self, op: int, itemsize: int = 4) -> int:
        """Bytes of work memory for all parts (the same for every op), in elements of `itemsize` bytes."""
        return itemsize * self.parts * (self.padded_size + self.rows_size + self.sums_size)

    def calls(self, op: int, arrays: tuple, scratch) -> list:
        """The call of `op`'s kernel (FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT) on `arrays` (X as [N, G, 1, D, H,
        W], W as [G, M/G, K], Y as [N, G, M/G, P]; run as X [N, G, D, H, W] and Y [N, G, M/G, oD, oH, oW]) over
        all units (a weight gradient gets the whole dW sums, the others the taps of one multiplier), or its
        parallel twin on the plan's parts of the units."""
        shapes = {6: self.x5, 4: self.y6}  # X's arrays and Y's, as the depthwise kernels read them
        arrays = tuple(a.reshape(shapes[a.ndim]) if np.ndim(a) in shapes else a for a in arrays)
        memory = scratch.view(arrays[0].dtype)
        start = self.padded_size + self.rows_size
        padded, rows = memory[:self.padded_size], memory[self.padded_size:start]
        taps = memory[start:start + self.sums_size].reshape(self.sums_shape)
        if op == WEIGHT_GRADIENT:
            pieces, tail = (padded, rows, taps), ()
        else:
            pieces, tail = (padded, rows, taps[0]), (0, self.units)
        call = (KERNELS[op], arrays + (self.geom, self.taps, self.frame) + pieces
                + (self.padded_shape, self.rows_shape, self.channels_last) + tail)
        per_part = scratch.view(np.float32) if scratch is not None else np.zeros(0, np.float32)
        per_part = per_part.reshape(self.parts, -1) if per_part.size else np.zeros((self.parts, 0), np.float32)
        return [on_parts(call, self.units, self.parts, (per_part, self.sums_shape))]
