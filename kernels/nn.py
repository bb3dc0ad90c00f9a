"""Kernels: convolution, pooling, batch normalization, image activations (Clip, LeakyRelu, HardSigmoid, HardSwish), Dropout, Pad,
upsampling (ConvTranspose, Resize, Upsample).

Layouts: every windowed op sees 3 spatial axes (1-D and 2-D ops get leading
axes of size 1), so one compiled kernel serves every rank. A convolution
with G groups sees X as [N, G, C/G, D, H, W], W as [G, M/G, K] (K = C/G·kd·kh·kw)
and Y as [N, G, M/G, P] (P = output cells). `geom` holds, as int64:
kernel (3), strides (3), dilations (3), begin pads (3), output dims (3).

Convolution:
- general: im2col + one BLAS product per group: Y_g = W_g · col(X_g). When
  an image has few output cells (P < COLUMNS), `chunk` images share one
  product (their columns side by side), so BLAS sees a wide matrix.
  Pointwise convolutions (1x1, stride 1, no padding) skip im2col; for
  stride 1 with the output as wide as the input, each im2col row is one
  shifted contiguous copy of the image (edge columns zeroed after).
  Backward: dcol = W_gᵀ · dY_g then col2im (input); dW_gᵀ = Σ col · dY_gᵀ
  (weight; BLAS's faster order for these shapes).
- depthwise (C/G = 1): a direct loop, along rows for wide outputs (each tap
  a contiguous multiply-add, the padded plane split into stride phases),
  channels-last for narrow ones (each tap a multiply-add over the channels).
- work memory is the node's arena scratch (declared by `_conv_scratch`,
  placed by the planner for that one step): im2col columns K·chunk·P, rows
  gathered from several images M/G·chunk·P, and dW's sums (G + 1)·K·M/G
  floats; e.g. 1.35 MB for MobileNetV2's first layer at 224x224. Depthwise:
  one padded plane (rows) or one padded image, channels-last.

ConvTranspose runs the convolution kernels with X and Y exchanged: its forward is a convolution's
input gradient (col2im), its input gradient a convolution forward, its weight gradient a
convolution's weight gradient with X in dY's place.

Resize builds per-axis tables of source cells and weights at bind time; a step gathers (nearest),
resamples each plane separably through a scratch of rows (linear, cubic), or sums the tap products
directly (other layouts, tf_crop_and_resize). Gradients are the exact adjoints.

BatchNormalization sums in float64 per channel (Σx, Σx²; backward Σdy,
Σdy·x), so one pass gives statistics accurate for float32 data. Its output
pass clamps to [low, high], which is how a fused Relu/Clip costs nothing.

Loops index with range variables into slices (never `i + offset`), so Numba's
negative-index wraparound does not block vectorisation; kernels that may run
in place loop over one array when they do (an aliasing check would otherwise
send them to a scalar path).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import ODTRAIN_DOMAIN, binding

COLUMNS = 512  # convolutions batch images into one product until it has this many columns
ROW_WIDTH = 24  # depthwise convolutions with outputs at least this wide work along rows, others channels-last
# Sums may be reassociated (fastmath "reassoc"): they vectorise, and partial sums are no less accurate.
REDUCTION = {"reassoc", "contract"}
FLOAT_MAX = float(np.finfo(np.float32).max)

# ---- geometry (bind time) ------------------------------------------------------------------------


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def window_geometry(x_spatial, out_spatial, kernel, auto_pad, pads, strides, dilations):
    """(geom int64[15], end pads) with everything padded to 3 spatial axes in front."""
    rank = len(x_spatial)
    strides = list(strides) if strides else [1] * rank
    dilations = list(dilations) if dilations else [1] * rank
    pads = list(pads) if pads else [0] * (2 * rank)
    auto_pad = _text(auto_pad)
    begin, end = [], []
    for axis in range(rank):
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            total = max(0, (out_spatial[axis] - 1) * strides[axis] + (kernel[axis] - 1) * dilations[axis] + 1
                        - x_spatial[axis])
            low = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            begin.append(low)
            end.append(total - low)
        elif auto_pad == "VALID":
            begin.append(0)
            end.append(0)
        else:
            begin.append(int(pads[axis]))
            end.append(int(pads[rank + axis]))
    fill = 3 - rank
    geom = ([1] * fill + [int(k) for k in kernel] + [1] * fill + [int(s) for s in strides]
            + [1] * fill + [int(d) for d in dilations] + [0] * fill + begin
            + [1] * fill + [int(o) for o in out_spatial])
    return np.array(geom, dtype=np.int64), [0] * fill + end


def _as_3d(shape) -> tuple:
    """Spatial dims padded to 3 in front."""
    spatial = tuple(shape)
    return (1,) * (3 - len(spatial)) + spatial


@njit(cache=True, inline="always")
def _valid_range(offset, stride, size, count):
    """Output positions o in [lo, hi) with 0 <= o·stride + offset < size."""
    lo = -(offset // stride)
    hi = (size - 1 - offset) // stride + 1
    lo = min(max(lo, 0), count)
    hi = min(max(hi, lo), count)
    return lo, hi


# ---- convolution: im2col + BLAS ------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def _im2col(x, n0, nb, g, geom, col):
    """col[(c, kd, kh, kw), b·P + (od, oh, ow)] = x[n0 + b, g, c, od·sd + kd·dd - pd, ...], 0 outside."""
    depth, height, width = x.shape[3], x.shape[4], x.shape[5]
    out_d, out_h, out_w = geom[12], geom[13], geom[14]
    stride_w = geom[5]
    # stride 1 with the output as wide as the input: a row's valid cells are one contiguous run of x
    shifted_block = stride_w == 1 and geom[4] == 1 and out_w == width
    cells = out_d * out_h * out_w
    plane_cells = out_h * out_w
    row = 0
    for c in range(x.shape[2]):
        for kd in range(geom[0]):
            for kh in range(geom[1]):
                for kw in range(geom[2]):
                    offset = kw * geom[8] - geom[11]
                    lo, hi = _valid_range(offset, stride_w, width, out_w)
                    dest = col[row]
                    for b in range(nb):
                        for od in range(out_d):
                            i_d = od * geom[3] + kd * geom[6] - geom[9]
                            start = b * cells + od * plane_cells
                            block = dest[start:start + plane_cells]
                            if i_d < 0 or i_d >= depth:
                                block[:] = 0
                                continue
                            plane = x[n0 + b, g, c, i_d]
                            if shifted_block:
                                _shifted_copy(plane.reshape(-1), block, kh * geom[7] - geom[10], offset, lo, hi,
                                              out_h, width)
                                continue
                            for oh in range(out_h):
                                i_h = oh * geom[4] + kh * geom[7] - geom[10]
                                target = block[oh * out_w:(oh + 1) * out_w]
                                if i_h < 0 or i_h >= height:
                                    target[:] = 0
                                    continue
                                target[:lo] = 0
                                target[hi:] = 0
                                # slices keep every index below non-negative, so the copies vectorise
                                inner, source = target[lo:hi], plane[i_h][lo * stride_w + offset:]
                                if stride_w == 1:
                                    for t in range(inner.size):
                                        inner[t] = source[t]
                                else:
                                    for t in range(inner.size):
                                        inner[t] = source[t * stride_w]
                    row += 1


@njit(cache=True, error_model="numpy", inline="always")
def _block_rows(row_offset, out_h, height):
    """Output rows oh in [a, b) whose input row oh + row_offset lies in [0, height)."""
    return min(max(-row_offset, 0), out_h), min(max(height - row_offset, 0), out_h)


@njit(cache=True, error_model="numpy", inline="always")
def _shifted_copy(flat, block, row_offset, offset, lo, hi, out_h, width):
    """block[oh·W + ow] = flat[(oh + row_offset)·W + ow + offset] where that cell is inside the plane, else 0:
    one contiguous copy, then the edge columns [0, lo) and [hi, W) of each row set to zero."""
    a, b = _block_rows(row_offset, out_h, flat.size // width)
    block[:a * width] = 0
    block[b * width:] = 0
    begin = (a + row_offset) * width + offset  # flat index of block cell a·W
    first, last = max(0, -begin), min((b - a) * width, flat.size - begin)
    target, source = block[a * width + first:a * width + last], flat[begin + first:]
    for t in range(target.size):
        target[t] = source[t]
    _zero_edges(block, a, b, lo, hi, width)


@njit(cache=True, error_model="numpy", inline="always")
def _zero_edges(block, a, b, lo, hi, width):
    """block[oh·W + ow] = 0 for rows [a, b) and columns outside [lo, hi) (a few cells per row)."""
    for oh in range(a, b):
        base = oh * width
        for ow in range(lo):
            block[base + ow] = 0
        for ow in range(hi, width):
            block[base + ow] = 0


@njit(cache=True, error_model="numpy", inline="always")
def _shifted_add(flat, block, row_offset, offset, lo, hi, out_h, width):
    """The adjoint of _shifted_copy: flat[(oh + row_offset)·W + ow + offset] += block[oh·W + ow] over the
    cells inside the plane (the edge columns of block are zeroed first, so one contiguous add does it)."""
    a, b = _block_rows(row_offset, out_h, flat.size // width)
    _zero_edges(block, a, b, lo, hi, width)
    begin = (a + row_offset) * width + offset
    first, last = max(0, -begin), min((b - a) * width, flat.size - begin)
    source, target = block[a * width + first:a * width + last], flat[begin + first:]
    for t in range(source.size):
        target[t] += source[t]


@njit(cache=True, error_model="numpy")
def _col2im(col, n0, nb, g, geom, dx):
    """dx[n0 + b, g, c, ...] += col[(c, kd, kh, kw), b·P + ...]: the adjoint of _im2col (dx zeroed before;
    col is used as scratch)."""
    depth, height, width = dx.shape[3], dx.shape[4], dx.shape[5]
    out_d, out_h, out_w = geom[12], geom[13], geom[14]
    stride_w = geom[5]
    shifted_block = stride_w == 1 and geom[4] == 1 and out_w == width
    cells = out_d * out_h * out_w
    plane_cells = out_h * out_w
    row = 0
    for c in range(dx.shape[2]):
        for kd in range(geom[0]):
            for kh in range(geom[1]):
                for kw in range(geom[2]):
                    offset = kw * geom[8] - geom[11]
                    lo, hi = _valid_range(offset, stride_w, width, out_w)
                    source_row = col[row]
                    for b in range(nb):
                        for od in range(out_d):
                            i_d = od * geom[3] + kd * geom[6] - geom[9]
                            if i_d < 0 or i_d >= depth:
                                continue
                            start = b * cells + od * plane_cells
                            block = source_row[start:start + plane_cells]
                            plane = dx[n0 + b, g, c, i_d]
                            if shifted_block:
                                _shifted_add(plane.reshape(-1), block, kh * geom[7] - geom[10], offset, lo, hi,
                                             out_h, width)
                                continue
                            for oh in range(out_h):
                                i_h = oh * geom[4] + kh * geom[7] - geom[10]
                                if i_h < 0 or i_h >= height:
                                    continue
                                source = block[oh * out_w + lo:oh * out_w + hi]
                                target = plane[i_h][lo * stride_w + offset:]
                                if stride_w == 1:
                                    for t in range(source.size):
                                        target[t] += source[t]
                                else:
                                    for t in range(source.size):
                                        target[t * stride_w] += source[t]
                    row += 1


@njit(cache=True, error_model="numpy")
def _gather_dy(dy, n0, nb, g, out):
    """out[m, b·P + p] = dy[n0 + b, g, m, p]."""
    cells = dy.shape[3]
    for m in range(dy.shape[2]):
        for b in range(nb):
            for p in range(cells):
                out[m, b * cells + p] = dy[n0 + b, g, m, p]


@njit(cache=True, error_model="numpy")
def _conv_forward(x, w, bias, has_bias, y, col_work, row_work, geom, chunk, pointwise):
    """y[n, g] = w[g] · im2col(x[n, g]) (+ bias), `chunk` images per product."""
    batch, groups, per_group, cells = y.shape[0], y.shape[1], y.shape[2], y.shape[3]
    k = w.shape[2]
    for n0 in range(0, batch, chunk):
        nb = min(chunk, batch - n0)
        width = nb * cells
        for g in range(groups):
            if nb == 1 and pointwise:
                np.dot(w[g], x[n0, g].reshape(k, cells), y[n0, g])
                continue
            col = col_work[:k * width].reshape(k, width)
            _im2col(x, n0, nb, g, geom, col)
            if nb == 1:
                np.dot(w[g], col, y[n0, g])
                continue
            product = row_work[:per_group * width].reshape(per_group, width)
            np.dot(w[g], col, product)
            for b in range(nb):
                for m in range(per_group):
                    target = y[n0 + b, g, m]
                    for p in range(cells):
                        target[p] = product[m, b * cells + p]
    if has_bias:
        for n in range(batch):
            for g in range(groups):
                for m in range(per_group):
                    value = bias[g, m]
                    target = y[n, g, m]
                    for p in range(cells):
                        target[p] += value


@njit(cache=True, error_model="numpy")
def _conv_input_grad(dy, w, dx, col_work, row_work, geom, chunk, pointwise):
    """dx = col2im(w[g]ᵀ · dy[n, g]) for every image and group."""
    batch, groups, per_group, cells = dy.shape[0], dy.shape[1], dy.shape[2], dy.shape[3]
    k = w.shape[2]
    for n0 in range(0, batch, chunk):
        nb = min(chunk, batch - n0)
        width = nb * cells
        for g in range(groups):
            if nb == 1 and pointwise:
                np.dot(w[g].T, dy[n0, g], dx[n0, g].reshape(k, cells))
                continue
            col = col_work[:k * width].reshape(k, width)
            if nb == 1:
                np.dot(w[g].T, dy[n0, g], col)
            else:
                gathered = row_work[:per_group * width].reshape(per_group, width)
                _gather_dy(dy, n0, nb, g, gathered)
                np.dot(w[g].T, gathered, col)
            for b in range(nb):
                dx[n0 + b, g].reshape(-1)[:] = 0
            _col2im(col, n0, nb, g, geom, dx)


@njit(cache=True, error_model="numpy")
def _conv_weight_grad(dy, x, dw, col_work, row_work, sums, product, geom, chunk, pointwise):
    """dw[g] = Σ over images of dy[n, g] · im2col(x[n, g])ᵀ, summed transposed in sums[g] = Σ col · dyᵀ
    (BLAS's faster order for these shapes), then transposed into dw."""
    batch, groups, per_group, cells = dy.shape[0], dy.shape[1], dy.shape[2], dy.shape[3]
    k = dw.shape[2]
    for n0 in range(0, batch, chunk):
        nb = min(chunk, batch - n0)
        width = nb * cells
        for g in range(groups):
            if nb == 1 and pointwise:
                col = x[n0, g].reshape(k, cells)
            else:
                col = col_work[:k * width].reshape(k, width)
                _im2col(x, n0, nb, g, geom, col)
            if nb == 1:
                grad_rows = dy[n0, g]
            else:
                grad_rows = row_work[:per_group * width].reshape(per_group, width)
                _gather_dy(dy, n0, nb, g, grad_rows)
            if n0 == 0:
                np.dot(col, grad_rows.T, sums[g])
            else:
                np.dot(col, grad_rows.T, product)
                target = sums[g].reshape(-1)
                source = product.reshape(-1)
                for i in range(target.size):
                    target[i] += source[i]
    for g in range(groups):
        for m in range(per_group):
            for j in range(k):
                dw[g, m, j] = sums[g, j, m]


@njit(cache=True, error_model="numpy")
def _conv_bias_grad(dy, db):
    """db[m] = Σ_n Σ_p dy[n, m, p], summed in float64."""
    for m in range(dy.shape[1]):
        total = 0.0
        for n in range(dy.shape[0]):
            row = dy[n, m]
            partial = np.float32(0.0)
            for p in range(row.size):
                partial += row[p]
            total += partial
        db[m] = total


# ---- convolution: depthwise (one input channel per group) -----------------------------------------
# Views: x [N, G, D, H, W], w [G, M/G, K], y [N, G, M/G, oD, oH, oW]. Two ways, chosen by output width:
# - rows (wide outputs): each input plane is zero-padded into scratch and split into `stride` phases
#   along the width, phases[p, d, h, j] = padded[d, h, j·stride + p], so every tap of the window reads a
#   contiguous run: a vectorised multiply-add along an output row. Three taps of a row go in one pass.
# - channels-last (narrow outputs, where rows are too short to vectorise): each image is transposed
#   into scratch as [D, H, W, G], so every tap is one vectorised multiply-add over the channels.


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
def _depthwise_forward(x, w, bias, has_bias, y, geom, columns, padded, out_rows, taps, channels_last):
    """y[n, g, m, o] = Σ_k w[g, m, k] · x[n, g, o·s + k·d - p] (+ bias); columns[:, kw] is the (phase,
    offset) of tap kw in the row layout."""
    kd_count, kh_count, kw_count = geom[0], geom[1], geom[2]
    groups, per_group, out_w = x.shape[1], w.shape[1], y.shape[5]
    if not channels_last:
        for n in range(x.shape[0]):
            for g in range(groups):
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
    for n in range(x.shape[0]):
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
def _depthwise_input_grad(dy, w, dx, geom, columns, padded, grad_rows, taps, channels_last):
    """dx[n, g, o·s + k·d - p] += w[g, m, k] · dy[n, g, m, o]."""
    kd_count, kh_count, kw_count = geom[0], geom[1], geom[2]
    groups, per_group, out_w = dx.shape[1], w.shape[1], dy.shape[5]
    if not channels_last:
        for n in range(dx.shape[0]):
            for g in range(groups):
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
    for n in range(dx.shape[0]):
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
def _depthwise_weight_grad(dy, x, dw, geom, columns, padded, grad_rows, sums, channels_last):
    """dw[g, m, k] = Σ_n Σ_o dy[n, g, m, o] · x[n, g, o·s + k·d - p]; sums is [M/G, K, G] (channels-last)."""
    kd_count, kh_count, kw_count = geom[0], geom[1], geom[2]
    groups, per_group, out_w = x.shape[1], dw.shape[1], dy.shape[5]
    if not channels_last:
        dw.reshape(-1)[:] = 0
        for n in range(x.shape[0]):
            for g in range(groups):
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
                                        dw[g, m, k] += total
                                        k += 1
        return
    sums.reshape(-1)[:] = 0
    for n in range(x.shape[0]):
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
    for g in range(groups):
        for m in range(per_group):
            for k in range(dw.shape[2]):
                dw[g, m, k] = sums[m, k, g]


class _ConvLayout:
    """How a convolution runs, from the shapes of X, W and Y: views, geometry, kernel choice, work sizes."""

    def __init__(self, x_shape, w_shape, y_shape, group=1, auto_pad="NOTSET", dilations=None, kernel_shape=None,
                 pads=None, strides=None):
        group = int(group)
        batch, channels = int(x_shape[0]), int(x_shape[1])
        self.groups = group
        self.in_per_group, self.out_per_group = channels // group, int(w_shape[0]) // group
        kernel = [int(k) for k in w_shape[2:]]
        self.geom, _ = window_geometry(x_shape[2:], y_shape[2:], kernel, auto_pad, pads, strides, dilations)
        self.cells = int(np.prod(y_shape[2:], dtype=np.int64))
        self.k = self.in_per_group * int(np.prod(kernel, dtype=np.int64))
        self.x6 = (batch, group, self.in_per_group) + _as_3d(x_shape[2:])
        self.y6 = (batch, group, self.out_per_group) + _as_3d(y_shape[2:])
        self.y4 = (batch, group, self.out_per_group, self.cells)
        self.w3 = (group, self.out_per_group, self.k)
        self.depthwise = self.in_per_group == 1 and self.k > 1
        geom = self.geom
        self.pointwise = bool((geom[0:6] == 1).all() and (geom[9:12] == 0).all()
                              and tuple(x_shape[2:]) == tuple(y_shape[2:]))
        self.chunk = int(max(1, min(batch, -(-COLUMNS // max(self.cells, 1)))))
        width = self.chunk * self.cells
        # float32 elements of work memory: im2col columns, gathered rows (several images), a partial dW
        self.columns = 0 if self.depthwise or (self.pointwise and self.chunk == 1) else self.k * width
        self.rows = 0 if self.depthwise or self.chunk == 1 else self.out_per_group * width
        # the weight gradient's transposed sums [G, K, M/G], and one product [K, M/G] to add from later chunks
        self.partial = 0 if self.depthwise else (group + (batch > self.chunk)) * self.k * self.out_per_group
        if self.depthwise:
            x3, y3 = _as_3d(x_shape[2:]), _as_3d(y_shape[2:])
            self.x5 = (batch, group) + x3
            padded = tuple(max(x3[a] + geom[9 + a], (y3[a] - 1) * geom[3 + a] + (geom[a] - 1) * geom[6 + a] + 1)
                           for a in range(3))
            self.channels_last = y3[2] < ROW_WIDTH
            self.columns_of_taps = np.zeros((2, 1), np.int64)
            if self.channels_last:  # the padded image, one output plane, the taps: all [..., G]
                self.padded_shape = padded + (group,)
                self.rows_shape = y3 + (group,)
                self.partial = self.out_per_group * self.k * group
            else:  # one padded plane in stride phases; unused 1-element stand-ins for the rest
                stride = int(geom[5])
                self.padded_shape = (stride,) + padded[:2] + (-(-padded[2] // stride),)
                taps = np.arange(int(geom[2])) * int(geom[8])
                self.columns_of_taps = np.stack([taps % stride, taps // stride]).astype(np.int64)
                self.rows_shape = (1, 1, 1, 1)
                self.partial = self.out_per_group * self.k
            self.columns = int(np.prod(self.padded_shape))
            self.rows = int(np.prod(self.rows_shape))

    def depthwise_work(self, scratch):
        """(padded input plane, one output/gradient plane, taps [M/G, K, G]) for the depthwise kernels."""
        memory = scratch.view(np.float32)
        padded = memory[:self.columns].reshape(self.padded_shape)
        rows = memory[self.columns:self.columns + self.rows].reshape(self.rows_shape)
        start = self.columns + self.rows
        groups = self.groups if self.channels_last else 1
        taps = memory[start:start + self.partial].reshape(self.out_per_group, self.k, groups)
        return padded, rows, taps

    def work(self, scratch, sums: bool = False):
        """(columns, rows[, dW sums [G, K, M/G], product [K, M/G]]) as float32 views of the node's scratch."""
        memory = scratch.view(np.float32) if scratch is not None else np.zeros(0, np.float32)
        columns = memory[:self.columns]
        rows = memory[self.columns:self.columns + self.rows]
        if not sums:
            return columns, rows
        start = self.columns + self.rows
        size = self.groups * self.k * self.out_per_group
        totals = memory[start:start + size].reshape(self.groups, self.k, self.out_per_group)
        rest = memory[start + size:start + self.partial]
        product = rest.reshape(self.k, self.out_per_group) if rest.size else np.zeros((1, 1), np.float32)
        return columns, rows, totals, product


def _conv_scratch(op_type: str):
    """The scratch-size rule of Conv, ConvInputGrad or ConvWeightGrad: bytes of im2col work memory."""

    def size(specs_in, specs_out, **attrs):
        shapes_in = [spec[0] if spec else None for spec in specs_in]
        shape_out = specs_out[0][0]
        if op_type == "Conv":
            layout = _ConvLayout(shapes_in[0], shapes_in[1], shape_out, **attrs)
        elif op_type == "ConvInputGrad":
            layout = _ConvLayout(shape_out, shapes_in[1], shapes_in[0], **attrs)
        else:
            layout = _ConvLayout(shapes_in[1], shape_out, shapes_in[0], **attrs)
        extra = layout.partial if op_type == "ConvWeightGrad" or layout.depthwise else 0
        return 4 * (layout.columns + layout.rows + extra)

    return size


@binding("Conv", scratch=_conv_scratch("Conv"))
def Conv(inputs, outputs, scratch=None, **attrs):
    x, w, y = inputs[0], inputs[1], outputs[0]
    bias = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    layout = _ConvLayout(x.shape, w.shape, y.shape, **attrs)
    b = bias.reshape(layout.groups, layout.out_per_group) if bias is not None else np.zeros((1, 1), np.float32)
    xv, wv = x.reshape(layout.x6), w.reshape(layout.w3)
    if layout.depthwise:
        padded, rows, taps = layout.depthwise_work(scratch)
        return [(_depthwise_forward, (x.reshape(layout.x5), wv, b, bias is not None, y.reshape(layout.y6), layout.geom,
                                      layout.columns_of_taps, padded, rows, taps[0], layout.channels_last))]
    columns, rows = layout.work(scratch)
    return [(_conv_forward, (xv, wv, b, bias is not None, y.reshape(layout.y4), columns, rows, layout.geom,
                             layout.chunk, layout.pointwise))]


@binding("ConvInputGrad", ODTRAIN_DOMAIN, scratch=_conv_scratch("ConvInputGrad"))
def ConvInputGrad(inputs, outputs, scratch=None, **attrs):
    dy, w, dx = inputs[0], inputs[1], outputs[0]
    layout = _ConvLayout(dx.shape, w.shape, dy.shape, **attrs)
    dxv, wv = dx.reshape(layout.x6), w.reshape(layout.w3)
    if layout.depthwise:
        padded, rows, taps = layout.depthwise_work(scratch)
        return [(_depthwise_input_grad, (dy.reshape(layout.y6), wv, dx.reshape(layout.x5), layout.geom,
                                         layout.columns_of_taps, padded, rows, taps[0], layout.channels_last))]
    columns, rows = layout.work(scratch)
    return [(_conv_input_grad, (dy.reshape(layout.y4), wv, dxv, columns, rows, layout.geom, layout.chunk,
                                layout.pointwise))]


@binding("ConvWeightGrad", ODTRAIN_DOMAIN, scratch=_conv_scratch("ConvWeightGrad"))
def ConvWeightGrad(inputs, outputs, scratch=None, **attrs):
    dy, x, dw = inputs[0], inputs[1], outputs[0]
    layout = _ConvLayout(x.shape, dw.shape, dy.shape, **attrs)
    xv, dwv = x.reshape(layout.x6), dw.reshape(layout.w3)
    if layout.depthwise:
        padded, rows, sums = layout.depthwise_work(scratch)
        return [(_depthwise_weight_grad, (dy.reshape(layout.y6), x.reshape(layout.x5), dwv, layout.geom,
                                          layout.columns_of_taps, padded, rows, sums, layout.channels_last))]
    columns, rows, sums, product = layout.work(scratch, sums=True)
    return [(_conv_weight_grad, (dy.reshape(layout.y4), xv, dwv, columns, rows, sums, product, layout.geom,
                                 layout.chunk, layout.pointwise))]


@binding("ConvBiasGrad", ODTRAIN_DOMAIN)
def ConvBiasGrad(inputs, outputs):
    dy = inputs[0]
    return [(_conv_bias_grad, (dy.reshape(dy.shape[0], dy.shape[1], -1), outputs[0]))]


# ---- ConvTranspose: the convolution kernels with X and Y exchanged --------------------------------
# ConvTranspose(X, W) is the input gradient of the convolution of Y by W, so a _ConvLayout over
# (Y, W, X) runs it: forward with _conv_input_grad, dX with _conv_forward, dW with _conv_weight_grad.


def _transpose_begin_pads(x_spatial, y_spatial, kernel, auto_pad="NOTSET", dilations=None, output_padding=None,
                          output_shape=None, pads=None, strides=None):
    """Begin pads of a ConvTranspose whose output dims are known (the type rule chose them)."""
    rank = len(x_spatial)
    strides = list(strides) if strides else [1] * rank
    dilations = list(dilations) if dilations else [1] * rank
    output_padding = list(output_padding) if output_padding else [0] * rank
    pads = list(pads) if pads else [0] * (2 * rank)
    auto_pad = _text(auto_pad)
    begin = []
    for axis in range(rank):
        natural = (strides[axis] * (x_spatial[axis] - 1) + output_padding[axis]
                   + (kernel[axis] - 1) * dilations[axis] + 1)
        total = natural - y_spatial[axis]
        if output_shape or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            begin.append(0 if total < 0 else total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
        elif auto_pad == "VALID":
            begin.append(0)
        else:
            begin.append(int(pads[axis]))
    if min(begin) < 0:
        raise ValueError(f"negative begin pads {begin} are not supported")
    return begin


def _transpose_layout(x_shape, w_shape, y_shape, group=1, auto_pad="NOTSET", dilations=None, kernel_shape=None,
                      output_padding=None, output_shape=None, pads=None, strides=None) -> _ConvLayout:
    """The layout of the convolution whose input is Y and output X (ConvTranspose's shapes)."""
    rank = len(x_shape) - 2
    begin = _transpose_begin_pads(x_shape[2:], y_shape[2:], [int(k) for k in w_shape[2:]], auto_pad, dilations,
                                  output_padding, output_shape, pads, strides)
    return _ConvLayout(y_shape, w_shape, x_shape, group, "NOTSET", dilations, None, begin + [0] * rank, strides)


def _conv_transpose_scratch(op_type: str):
    """The scratch-size rule of ConvTranspose and its gradient ops: bytes of im2col work memory."""

    def size(specs_in, specs_out, **attrs):
        first, second, out = specs_in[0][0], specs_in[1][0], specs_out[0][0]
        if op_type == "ConvTranspose":  # X, W -> Y
            layout = _transpose_layout(first, second, out, **attrs)
        elif op_type == "ConvTransposeInputGrad":  # dY, W -> dX
            layout = _transpose_layout(out, second, first, **attrs)
        else:  # dY, X -> dW
            layout = _transpose_layout(second, out, first, **attrs)
        extra = layout.partial if op_type == "ConvTransposeWeightGrad" or layout.depthwise else 0
        return 4 * (layout.columns + layout.rows + extra)

    return size


@njit(cache=True, error_model="numpy")
def _add_channel_bias(y, bias):
    """y[n, m, p] += bias[m]."""
    for n in range(y.shape[0]):
        for m in range(y.shape[1]):
            value = bias[m]
            row = y[n, m]
            for p in range(row.size):
                row[p] += value


@binding("ConvTranspose", scratch=_conv_transpose_scratch("ConvTranspose"))
def ConvTranspose(inputs, outputs, scratch=None, **attrs):
    x, w, y = inputs[0], inputs[1], outputs[0]
    layout = _transpose_layout(x.shape, w.shape, y.shape, **attrs)
    wv = w.reshape(layout.w3)
    if layout.depthwise:
        padded, rows, taps = layout.depthwise_work(scratch)
        calls = [(_depthwise_input_grad, (x.reshape(layout.y6), wv, y.reshape(layout.x5), layout.geom,
                                          layout.columns_of_taps, padded, rows, taps[0], layout.channels_last))]
    else:
        columns, rows = layout.work(scratch)
        calls = [(_conv_input_grad, (x.reshape(layout.y4), wv, y.reshape(layout.x6), columns, rows, layout.geom,
                                     layout.chunk, layout.pointwise))]
    if len(inputs) > 2 and inputs[2] is not None:
        calls.append((_add_channel_bias, (y.reshape(y.shape[0], y.shape[1], -1), inputs[2])))
    return calls


@binding("ConvTransposeInputGrad", ODTRAIN_DOMAIN, scratch=_conv_transpose_scratch("ConvTransposeInputGrad"))
def ConvTransposeInputGrad(inputs, outputs, scratch=None, **attrs):
    dy, w, dx = inputs[0], inputs[1], outputs[0]
    layout = _transpose_layout(dx.shape, w.shape, dy.shape, **attrs)
    wv, no_bias = w.reshape(layout.w3), np.zeros((1, 1), np.float32)
    if layout.depthwise:
        padded, rows, taps = layout.depthwise_work(scratch)
        return [(_depthwise_forward, (dy.reshape(layout.x5), wv, no_bias, False, dx.reshape(layout.y6), layout.geom,
                                      layout.columns_of_taps, padded, rows, taps[0], layout.channels_last))]
    columns, rows = layout.work(scratch)
    return [(_conv_forward, (dy.reshape(layout.x6), wv, no_bias, False, dx.reshape(layout.y4), columns, rows,
                             layout.geom, layout.chunk, layout.pointwise))]


@binding("ConvTransposeWeightGrad", ODTRAIN_DOMAIN, scratch=_conv_transpose_scratch("ConvTransposeWeightGrad"))
def ConvTransposeWeightGrad(inputs, outputs, scratch=None, **attrs):
    dy, x, dw = inputs[0], inputs[1], outputs[0]
    layout = _transpose_layout(x.shape, dw.shape, dy.shape, **attrs)
    dwv = dw.reshape(layout.w3)
    if layout.depthwise:
        padded, rows, sums = layout.depthwise_work(scratch)
        return [(_depthwise_weight_grad, (x.reshape(layout.y6), dy.reshape(layout.x5), dwv, layout.geom,
                                          layout.columns_of_taps, padded, rows, sums, layout.channels_last))]
    columns, rows, sums, product = layout.work(scratch, sums=True)
    return [(_conv_weight_grad, (x.reshape(layout.y4), dy.reshape(layout.x6), dwv, columns, rows, sums, product,
                                 layout.geom, layout.chunk, layout.pointwise))]


# ---- batch normalization -------------------------------------------------------------------------


@njit(cache=True, error_model="numpy", fastmath=REDUCTION)
def _row_sums(row):
    """(Σ row, Σ row²) in float64."""
    s, q = 0.0, 0.0
    for i in range(row.size):
        v = np.float64(row[i])
        s += v
        q += v * v
    return s, q


@njit(cache=True, error_model="numpy", fastmath=REDUCTION)
def _row_grad_sums(x, dy):
    """(Σ x, Σ x², Σ dy, Σ dy·x) in float64."""
    s, q, g, gx = 0.0, 0.0, 0.0, 0.0
    for i in range(x.size):
        v, d = np.float64(x[i]), np.float64(dy[i])
        s += v
        q += v * v
        g += d
        gx += d * v
    return s, q, g, gx


@njit(cache=True, error_model="numpy", inline="always")
def _affine_rows(x, center, factor, shift, low, high, y):
    """y[n, c] = clip((x[n, c] - center[c]) · factor[c] + shift[c], low, high): the clip is a fused
    Relu/Clip (±inf when there is none)."""
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            mean, scale, offset = np.float32(center[c]), np.float32(factor[c]), np.float32(shift[c])
            source, target = x[n, c], y[n, c]
            for i in range(source.size):
                target[i] = min(max((source[i] - mean) * scale + offset, low), high)


@njit(cache=True, error_model="numpy")
def _batch_norm_train(x, scale, bias, mean_in, var_in, y, mean_out, var_out, has_running, momentum, epsilon, stats,
                      low, high, in_place):
    """y = (x - μ_batch) · γ/√(σ²_batch + ε) + β; running = momentum·running + (1 - momentum)·batch
    (unbiased variance). The running outputs may alias their inputs: each reads then writes one channel.
    stats is [3, C] float64 scratch."""
    stats[:] = 0.0
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            s, q = _row_sums(x[n, c])
            stats[0, c] += s
            stats[1, c] += q
    count = x.shape[0] * x.shape[2]
    for c in range(x.shape[1]):
        mean = stats[0, c] / count
        var = max(stats[1, c] / count - mean * mean, 0.0)
        if has_running:
            unbiased = var * count / (count - 1) if count > 1 else var
            mean_out[c] = momentum * mean_in[c] + (1.0 - momentum) * mean
            var_out[c] = momentum * var_in[c] + (1.0 - momentum) * unbiased
        stats[0, c] = mean
        stats[1, c] = scale[c] / np.sqrt(var + epsilon)
        stats[2, c] = bias[c]
    if in_place:  # one array in the loop: no aliasing check sends it to a scalar path
        _affine_rows(y, stats[0], stats[1], stats[2], low[0], high[0], y)
    else:
        _affine_rows(x, stats[0], stats[1], stats[2], low[0], high[0], y)


@njit(cache=True, error_model="numpy")
def _batch_norm_infer(x, scale, bias, mean, var, y, epsilon, stats, low, high, in_place):
    """y = (x - mean) · γ/√(var + ε) + β with the running statistics (clipped to [low, high])."""
    for c in range(x.shape[1]):
        stats[0, c] = mean[c]
        stats[1, c] = scale[c] / np.sqrt(np.float64(var[c]) + epsilon)
        stats[2, c] = bias[c]
    if in_place:
        _affine_rows(y, stats[0], stats[1], stats[2], low[0], high[0], y)
    else:
        _affine_rows(x, stats[0], stats[1], stats[2], low[0], high[0], y)


@njit(cache=True, error_model="numpy", inline="always")
def _batch_norm_grad_rows(dy, x, coefficients, dx):
    """dx = a·dy + b·(x - μ) + e per channel, coefficients rows (a, b, e, μ)."""
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            a, b = np.float32(coefficients[0, c]), np.float32(coefficients[1, c])
            e, mean = np.float32(coefficients[2, c]), np.float32(coefficients[3, c])
            xs, gs, target = x[n, c], dy[n, c], dx[n, c]
            for i in range(xs.size):
                target[i] = a * gs[i] + b * (xs[i] - mean) + e


@njit(cache=True, error_model="numpy")
def _batch_norm_grad(dy, x, scale, mean_in, var_in, dx, dscale, dbias, dmean, dvar, wants, training, epsilon, sums,
                     in_place):
    """Gradients of batch normalization (see graph/ops/nn.py); outputs with wants[i] == 0 are skipped.
    dx may be dy (in_place): each element is read before it is written. sums is [4, C] float64 scratch."""
    channels = x.shape[1]
    count = x.shape[0] * x.shape[2]
    sums[:] = 0.0  # rows: Σx, Σx², Σdy, Σdy·x
    for n in range(x.shape[0]):
        for c in range(channels):
            s, q, g, gx = _row_grad_sums(x[n, c], dy[n, c])
            sums[0, c] += s
            sums[1, c] += q
            sums[2, c] += g
            sums[3, c] += gx
    for c in range(channels):
        if training:
            mean = sums[0, c] / count
            var = max(sums[1, c] / count - mean * mean, 0.0)
        else:
            mean, var = np.float64(mean_in[c]), np.float64(var_in[c])
        inv_std = 1.0 / np.sqrt(var + epsilon)
        sum_dy = sums[2, c]
        sum_dy_centered = sums[3, c] - mean * sum_dy  # Σ dy·(x - μ)
        gamma = np.float64(scale[c])
        if wants[1]:
            dscale[c] = sum_dy_centered * inv_std
        if wants[2]:
            dbias[c] = sum_dy
        if wants[3]:
            dmean[c] = -gamma * inv_std * sum_dy
        if wants[4]:
            dvar[c] = -0.5 * gamma * inv_std ** 3 * sum_dy_centered
        a = gamma * inv_std  # dx = a·dy + b·(x - μ) + e
        sums[0, c] = a
        sums[1, c] = -a * inv_std * inv_std * sum_dy_centered / count if training else 0.0
        sums[2, c] = -a * sum_dy / count if training else 0.0
        sums[3, c] = mean
    if not wants[0]:
        return
    if in_place:
        _batch_norm_grad_rows(dx, x, sums, dx)
    else:
        _batch_norm_grad_rows(dy, x, sums, dx)


def _ncs(array: np.ndarray) -> np.ndarray:
    return array.reshape(array.shape[0], array.shape[1], -1)


def _batch_norm_calls(inputs, outputs, low, high, epsilon=1e-5, momentum=0.9, training_mode=0, spatial=1):
    x, scale, bias, mean, var = inputs[:5]
    y = outputs[0]
    in_place = bool(np.shares_memory(x, y))
    if not training_mode:
        return [(_batch_norm_infer, (_ncs(x), scale, bias, mean, var, _ncs(y), float(epsilon),
                                     np.zeros((3, x.shape[1])), low, high, in_place))]
    mean_out = outputs[1] if len(outputs) > 1 and outputs[1] is not None else None
    var_out = outputs[2] if len(outputs) > 2 and outputs[2] is not None else None
    has_running = mean_out is not None and var_out is not None
    if not has_running:
        mean_out, var_out = np.zeros_like(mean), np.zeros_like(var)
    stats = np.zeros((3, x.shape[1]), dtype=np.float64)
    return [(_batch_norm_train, (_ncs(x), scale, bias, mean, var, _ncs(y), mean_out, var_out, has_running,
                                 float(momentum), float(epsilon), stats, low, high, in_place))]


@binding("BatchNormalization")
def BatchNormalization(inputs, outputs, **attrs):
    return _batch_norm_calls(inputs, outputs, _scalar(-np.inf), _scalar(np.inf), **attrs)


@binding("BatchNormalizationActivation", ODTRAIN_DOMAIN)
def BatchNormalizationActivation(inputs, outputs, activation, **attrs):
    """BatchNormalization, then Relu (clip at 0) or Clip (bounds from inputs 5, 6 or min/max attributes)."""
    bounds = {k: attrs.pop(k) for k in ("min", "max") if k in attrs}
    if activation == "Relu":
        low, high = _scalar(0.0), _scalar(np.inf)
    else:
        low, high = _activation_params("Clip", [None] + list(inputs[5:7]), bounds)
    return _batch_norm_calls(inputs[:5], outputs, low, high, **attrs)


@binding("BatchNormalizationGrad", ODTRAIN_DOMAIN)
def BatchNormalizationGrad(inputs, outputs, epsilon=1e-5, training_mode=1):
    dy, x, scale = inputs[:3]
    channels = scale.shape[0]
    mean = inputs[3] if len(inputs) > 3 and inputs[3] is not None else np.zeros(channels, np.float32)
    var = inputs[4] if len(inputs) > 4 and inputs[4] is not None else np.ones(channels, np.float32)
    outs = list(outputs) + [None] * (5 - len(outputs))
    wants = np.array([o is not None for o in outs], dtype=np.int64)
    dx = _ncs(outs[0]) if outs[0] is not None else np.zeros((1, 1, 1), np.float32)
    small = [o if o is not None else np.zeros(channels, np.float32) for o in outs[1:]]
    sums = np.zeros((4, channels), dtype=np.float64)
    in_place = outs[0] is not None and bool(np.shares_memory(dy, outs[0]))
    return [(_batch_norm_grad, (_ncs(dy), _ncs(x), scale, mean, var, dx, *small, wants, bool(training_mode),
                                float(epsilon), sums, in_place))]


# ---- pooling -------------------------------------------------------------------------------------


@njit(cache=True, error_model="numpy", inline="always")
def _window_argmax(plane, od, oh, ow, geom):
    """(max, flat index in the plane) over one window; index -1 when the window holds no input cell."""
    depth, height, width = plane.shape[0], plane.shape[1], plane.shape[2]
    best = -np.inf
    where = -1
    for kd in range(geom[0]):
        i_d = od * geom[3] + kd * geom[6] - geom[9]
        if i_d < 0 or i_d >= depth:
            continue
        for kh in range(geom[1]):
            i_h = oh * geom[4] + kh * geom[7] - geom[10]
            if i_h < 0 or i_h >= height:
                continue
            for kw in range(geom[2]):
                i_w = ow * geom[5] + kw * geom[8] - geom[11]
                if i_w < 0 or i_w >= width:
                    continue
                value = plane[i_d, i_h, i_w]
                if where < 0 or value > best:
                    best = value
                    where = (i_d * height + i_h) * width + i_w
    return best, where


@njit(cache=True, error_model="numpy", inline="always")
def _tile_argmax(plane, od, oh, ow, geom):
    """_window_argmax for windows that tile the input (stride = kernel, no padding or dilation):
    every cell is inside, so no bounds checks."""
    height, width = plane.shape[1], plane.shape[2]
    best = -np.inf
    where = -1
    for kd in range(geom[0]):
        for kh in range(geom[1]):
            row_start = ((od * geom[0] + kd) * height + oh * geom[1] + kh) * width + ow * geom[2]
            row = plane[od * geom[0] + kd, oh * geom[1] + kh]
            for kw in range(geom[2]):
                value = row[ow * geom[2] + kw]
                if where < 0 or value > best:
                    best = value
                    where = row_start + kw
    return best, where


@njit(cache=True, error_model="numpy")
def _max_pool(x, y, indices, want_indices, column_major, geom, tiled):
    """y = max over each window (first maximum wins); indices = flat position in x, its spatial part
    row-major or (storage_order=1) column-major."""
    depth, height, width = x.shape[1], x.shape[2], x.shape[3]
    plane_size = depth * height * width
    for nc in range(x.shape[0]):
        plane = x[nc]
        for od in range(y.shape[1]):
            for oh in range(y.shape[2]):
                for ow in range(y.shape[3]):
                    if tiled:
                        best, where = _tile_argmax(plane, od, oh, ow, geom)
                    else:
                        best, where = _window_argmax(plane, od, oh, ow, geom)
                    y[nc, od, oh, ow] = best
                    if want_indices:
                        if column_major:
                            i_d, i_h, i_w = where // (height * width), (where // width) % height, where % width
                            where = (i_w * height + i_h) * depth + i_d
                        indices[nc, od, oh, ow] = nc * plane_size + where


@njit(cache=True, error_model="numpy")
def _max_pool_grad(dy, x, dx, geom, tiled):
    """dx[argmax of each window] += dy (argmax recomputed from x)."""
    if not tiled or dy.shape[1] * geom[0] != x.shape[1] or dy.shape[2] * geom[1] != x.shape[2] \
            or dy.shape[3] * geom[2] != x.shape[3]:
        dx.reshape(-1)[:] = 0  # tiles that leave no cell uncovered write every cell below
    for nc in range(x.shape[0]):
        plane, target = x[nc], dx[nc].reshape(-1)
        for od in range(dy.shape[1]):
            for oh in range(dy.shape[2]):
                for ow in range(dy.shape[3]):
                    grad = dy[nc, od, oh, ow]
                    if tiled:
                        _, where = _tile_argmax(plane, od, oh, ow, geom)
                        for kd in range(geom[0]):  # each cell of a tile belongs to it alone: write, not add
                            for kh in range(geom[1]):
                                row = dx[nc, od * geom[0] + kd, oh * geom[1] + kh]
                                for kw in range(geom[2]):
                                    row[ow * geom[2] + kw] = 0
                        target[where] = grad
                    else:
                        _, where = _window_argmax(plane, od, oh, ow, geom)
                        if where >= 0:
                            target[where] += grad


@njit(cache=True, error_model="numpy")
def _average_pool(x, y, inverse_count, geom):
    """y = Σ of each window's input cells · inverse_count[window position]."""
    depth, height, width = x.shape[1], x.shape[2], x.shape[3]
    for nc in range(x.shape[0]):
        plane = x[nc]
        position = 0
        for od in range(y.shape[1]):
            for oh in range(y.shape[2]):
                for ow in range(y.shape[3]):
                    total = np.float32(0.0)
                    for kd in range(geom[0]):
                        i_d = od * geom[3] + kd * geom[6] - geom[9]
                        if i_d < 0 or i_d >= depth:
                            continue
                        for kh in range(geom[1]):
                            i_h = oh * geom[4] + kh * geom[7] - geom[10]
                            if i_h < 0 or i_h >= height:
                                continue
                            row = plane[i_d, i_h]
                            for kw in range(geom[2]):
                                i_w = ow * geom[5] + kw * geom[8] - geom[11]
                                if 0 <= i_w < width:
                                    total += row[i_w]
                    y[nc, od, oh, ow] = total * inverse_count[position]
                    position += 1


@njit(cache=True, error_model="numpy")
def _average_pool_grad(dy, dx, inverse_count, geom):
    """dx[each input cell of a window] += dy · inverse_count[window position]."""
    depth, height, width = dx.shape[1], dx.shape[2], dx.shape[3]
    dx.reshape(-1)[:] = 0
    for nc in range(dx.shape[0]):
        plane = dx[nc]
        position = 0
        for od in range(dy.shape[1]):
            for oh in range(dy.shape[2]):
                for ow in range(dy.shape[3]):
                    share = dy[nc, od, oh, ow] * inverse_count[position]
                    position += 1
                    for kd in range(geom[0]):
                        i_d = od * geom[3] + kd * geom[6] - geom[9]
                        if i_d < 0 or i_d >= depth:
                            continue
                        for kh in range(geom[1]):
                            i_h = oh * geom[4] + kh * geom[7] - geom[10]
                            if i_h < 0 or i_h >= height:
                                continue
                            row = plane[i_d, i_h]
                            for kw in range(geom[2]):
                                i_w = ow * geom[5] + kw * geom[8] - geom[11]
                                if 0 <= i_w < width:
                                    row[i_w] += share


def _pool_views(x_shape, y_shape):
    planes = int(x_shape[0]) * int(x_shape[1])
    return (planes,) + _as_3d(x_shape[2:]), (planes,) + _as_3d(y_shape[2:])


def _pool_geometry(x_shape, y_shape, kernel_shape=None, auto_pad="NOTSET", pads=None, strides=None,
                   dilations=None, **_):
    return window_geometry(x_shape[2:], y_shape[2:], kernel_shape, auto_pad, pads, strides, dilations)


def _inverse_counts(x_shape, geom, end_pads, count_include_pad) -> np.ndarray:
    """1 / (cells counted in each window): input cells, or with count_include_pad also the declared padding."""
    x3 = _as_3d(x_shape[2:])
    per_axis = []
    for axis in range(3):
        k, s, d, begin, out = geom[axis], geom[3 + axis], geom[6 + axis], geom[9 + axis], geom[12 + axis]
        low, high = (-begin, x3[axis] + end_pads[axis]) if count_include_pad else (0, x3[axis])
        cells = np.arange(out)[:, None] * s + np.arange(k)[None, :] * d - begin
        per_axis.append(((cells >= low) & (cells < high)).sum(axis=1))
    counts = per_axis[0][:, None, None] * per_axis[1][None, :, None] * per_axis[2][None, None, :]
    return (1.0 / np.maximum(counts, 1)).astype(np.float32).reshape(-1)


def _global_geometry(x_shape):
    spatial = list(x_shape[2:])
    return window_geometry(spatial, [1] * len(spatial), spatial, "NOTSET", None, None, None)


def _tiles(geom, x_view, y_view) -> bool:
    """Whether the windows tile the input: stride = kernel, no padding or dilation, all inside."""
    return bool((geom[3:6] == geom[0:3]).all() and (geom[6:9] == 1).all() and (geom[9:12] == 0).all()
                and all(y_view[1 + a] * geom[a] <= x_view[1 + a] for a in range(3)))


@binding("MaxPool")
def MaxPool(inputs, outputs, storage_order=0, **attrs):
    x, y = inputs[0], outputs[0]
    geom, _ = _pool_geometry(x.shape, y.shape, **attrs)
    xv, yv = _pool_views(x.shape, y.shape)
    want = len(outputs) > 1 and outputs[1] is not None
    indices = outputs[1].reshape(yv) if want else np.zeros((1, 1, 1, 1), np.int64)
    return [(_max_pool, (x.reshape(xv), y.reshape(yv), indices, want, bool(storage_order), geom,
                         _tiles(geom, xv, yv)))]


@binding("MaxPoolGrad", ODTRAIN_DOMAIN)
def MaxPoolGrad(inputs, outputs, **attrs):
    dy, x, dx = inputs[0], inputs[1], outputs[0]
    geom, _ = _pool_geometry(x.shape, dy.shape, **attrs)
    xv, yv = _pool_views(x.shape, dy.shape)
    return [(_max_pool_grad, (dy.reshape(yv), x.reshape(xv), dx.reshape(xv), geom, _tiles(geom, xv, yv)))]


@binding("AveragePool")
def AveragePool(inputs, outputs, count_include_pad=0, **attrs):
    x, y = inputs[0], outputs[0]
    geom, end = _pool_geometry(x.shape, y.shape, **attrs)
    xv, yv = _pool_views(x.shape, y.shape)
    inverse = _inverse_counts(x.shape, geom, end, count_include_pad)
    return [(_average_pool, (x.reshape(xv), y.reshape(yv), inverse, geom))]


@binding("AveragePoolGrad", ODTRAIN_DOMAIN)
def AveragePoolGrad(inputs, outputs, count_include_pad=0, **attrs):
    dy, dx = inputs[0], outputs[0]
    geom, end = _pool_geometry(dx.shape, dy.shape, **attrs)
    xv, yv = _pool_views(dx.shape, dy.shape)
    inverse = _inverse_counts(dx.shape, geom, end, count_include_pad)
    return [(_average_pool_grad, (dy.reshape(yv), dx.reshape(xv), inverse, geom))]


@binding("GlobalMaxPool")
def GlobalMaxPool(inputs, outputs):
    x, y = inputs[0], outputs[0]
    geom, _ = _global_geometry(x.shape)
    xv, yv = _pool_views(x.shape, y.shape)
    return [(_max_pool, (x.reshape(xv), y.reshape(yv), np.zeros((1, 1, 1, 1), np.int64), False, False, geom,
                         True))]


@binding("GlobalMaxPoolGrad", ODTRAIN_DOMAIN)
def GlobalMaxPoolGrad(inputs, outputs):
    dy, x, dx = inputs[0], inputs[1], outputs[0]
    geom, _ = _global_geometry(x.shape)
    xv, yv = _pool_views(x.shape, dy.shape)
    return [(_max_pool_grad, (dy.reshape(yv), x.reshape(xv), dx.reshape(xv), geom, True))]


@binding("GlobalAveragePool")
def GlobalAveragePool(inputs, outputs):
    x, y = inputs[0], outputs[0]
    geom, _ = _global_geometry(x.shape)
    xv, yv = _pool_views(x.shape, y.shape)
    inverse = np.array([1.0 / max(1, int(np.prod(x.shape[2:])))], np.float32)
    return [(_average_pool, (x.reshape(xv), y.reshape(yv), inverse, geom))]


@binding("GlobalAveragePoolGrad", ODTRAIN_DOMAIN)
def GlobalAveragePoolGrad(inputs, outputs):
    dy, dx = inputs[0], outputs[0]
    geom, _ = _global_geometry(dx.shape)
    xv, yv = _pool_views(dx.shape, dy.shape)
    inverse = np.array([1.0 / max(1, int(np.prod(dx.shape[2:])))], np.float32)
    return [(_average_pool_grad, (dy.reshape(yv), dx.reshape(xv), inverse, geom))]


# ---- activations ---------------------------------------------------------------------------------
# Codes (arguments, so one compiled kernel serves the family), parameters a and b as 1-element arrays:
#   0 Clip(a = min, b = max), 1 LeakyRelu(a = alpha), 2 HardSigmoid(a = alpha, b = beta), 3 HardSwish

ACTIVATIONS = {"Clip": 0, "LeakyRelu": 1, "HardSigmoid": 2, "HardSwish": 3}


@njit(cache=True, error_model="numpy")
def _activation(code, x, a_in, b_in, out):
    """out = f(x) elementwise; one loop per op, so each vectorises."""
    a, b = a_in[0], b_in[0]
    one, zero = np.float32(1.0), np.float32(0.0)
    if code == 0:
        for i in range(out.size):
            out[i] = min(max(x[i], a), b)
    elif code == 1:
        for i in range(out.size):
            v = x[i]
            out[i] = v if v >= 0 else a * v
    elif code == 2:
        for i in range(out.size):
            out[i] = max(zero, min(one, a * x[i] + b))
    else:
        sixth, half = np.float32(1.0 / 6.0), np.float32(0.5)
        for i in range(out.size):
            v = x[i]
            out[i] = v * max(zero, min(one, v * sixth + half))


@njit(cache=True, error_model="numpy", inline="always")
def _activation_grad_loops(code, dy, v, a, b, out):
    # Branch-free factors (a comparison as 0/1): loops vectorise, and stay fast where they cannot.
    one = np.float32(1.0)
    if code == 0:  # min < y < max
        for i in range(out.size):
            out[i] = dy[i] * np.float32((v[i] > a) & (v[i] < b))
    elif code == 1:  # v > 0 ? 1 : alpha
        for i in range(out.size):
            out[i] = dy[i] * (a + (one - a) * np.float32(v[i] > 0))
    elif code == 2:  # alpha where 0 < y < 1
        for i in range(out.size):
            out[i] = dy[i] * (a * np.float32((v[i] > 0) & (v[i] < 1)))
    else:  # PyTorch's hardswish_backward: 0 below -3, x/3 + 1/2 up to 3, then 1
        third, half = np.float32(1.0 / 3.0), np.float32(0.5)
        for i in range(out.size):
            x = v[i]
            above = np.float32(x > 3)
            out[i] = dy[i] * (np.float32(x >= -3) * ((one - above) * (x * third + half) + above))


@njit(cache=True, error_model="numpy")
def _activation_grad(code, dy, v, a_in, b_in, out, in_place):
    """out = dy · f'(.) where v is the forward output (Clip, HardSigmoid, LeakyRelu) or input (HardSwish).
    In place (out is dy) the loops see one array, so no aliasing check sends them to a scalar path."""
    if in_place:
        _activation_grad_loops(code, out, v, a_in[0], b_in[0], out)
    else:
        _activation_grad_loops(code, dy, v, a_in[0], b_in[0], out)


def _scalar(value: float) -> np.ndarray:
    return np.array([value], dtype=np.float32)


def _activation_params(op_type, inputs, attrs):
    """(a, b) as 1-element arrays: Clip's bounds read at run time when they are inputs."""
    if op_type == "Clip":
        bounds = []
        for index, name, default in ((1, "min", -FLOAT_MAX), (2, "max", FLOAT_MAX)):
            given = inputs[index] if len(inputs) > index else None
            bounds.append(given.reshape(1) if given is not None else _scalar(attrs.get(name, default)))
        return bounds
    if op_type == "LeakyRelu":
        return _scalar(attrs.get("alpha", 0.01)), _scalar(0.0)
    if op_type == "HardSigmoid":
        return _scalar(attrs.get("alpha", 0.2)), _scalar(attrs.get("beta", 0.5))
    return _scalar(0.0), _scalar(0.0)


def _flat(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1)


def _make_activation(op_type):
    def bind(inputs, outputs, **attrs):
        a, b = _activation_params(op_type, inputs, attrs)
        return [(_activation, (ACTIVATIONS[op_type], _flat(inputs[0]), a, b, _flat(outputs[0])))]

    return bind


def _make_activation_grad(op_type):
    def bind(inputs, outputs, **attrs):
        a, b = _activation_params(op_type, inputs[1:], attrs)
        dy, out = _flat(inputs[0]), _flat(outputs[0])
        in_place = bool(np.shares_memory(dy, out))
        return [(_activation_grad, (ACTIVATIONS[op_type], dy, _flat(inputs[1]), a, b, out, in_place))]

    return bind


for _op in ACTIVATIONS:
    binding(_op)(_make_activation(_op))
    binding(f"{_op}Grad", ODTRAIN_DOMAIN)(_make_activation_grad(_op))


# ---- Pad -----------------------------------------------------------------------------------------

PAD_RANK = 6


@njit(cache=True, error_model="numpy")
def _pad(x, y, source, value):
    """y[i] = x[source[0, i0], ..., source[5, i5]], or value where any source index is -1."""
    fill = value[0]
    for i0 in range(y.shape[0]):
        s0 = source[0, i0]
        for i1 in range(y.shape[1]):
            s1 = source[1, i1]
            for i2 in range(y.shape[2]):
                s2 = source[2, i2]
                for i3 in range(y.shape[3]):
                    s3 = source[3, i3]
                    for i4 in range(y.shape[4]):
                        s4 = source[4, i4]
                        outer = s0 >= 0 and s1 >= 0 and s2 >= 0 and s3 >= 0 and s4 >= 0
                        for i5 in range(y.shape[5]):
                            s5 = source[5, i5]
                            y[i0, i1, i2, i3, i4, i5] = x[s0, s1, s2, s3, s4, s5] if outer and s5 >= 0 else fill


@njit(cache=True, error_model="numpy")
def _pad_grad(dy, dx, source):
    """dx[source of each cell] += dy[cell]: the adjoint of _pad."""
    dx.reshape(-1)[:] = 0
    for i0 in range(dy.shape[0]):
        s0 = source[0, i0]
        for i1 in range(dy.shape[1]):
            s1 = source[1, i1]
            for i2 in range(dy.shape[2]):
                s2 = source[2, i2]
                for i3 in range(dy.shape[3]):
                    s3 = source[3, i3]
                    for i4 in range(dy.shape[4]):
                        s4 = source[4, i4]
                        if s0 < 0 or s1 < 0 or s2 < 0 or s3 < 0 or s4 < 0:
                            continue
                        for i5 in range(dy.shape[5]):
                            s5 = source[5, i5]
                            if s5 >= 0:
                                dx[s0, s1, s2, s3, s4, s5] += dy[i0, i1, i2, i3, i4, i5]


def _source_index(i: int, size: int, mode: str) -> int:
    if 0 <= i < size:
        return i
    if mode == "constant":
        return -1
    if mode == "edge":
        return min(max(i, 0), size - 1)
    if mode == "wrap":
        return i % size
    if size == 1:  # reflect
        return 0
    period = 2 * (size - 1)
    i %= period
    return i if i < size else period - i


def _pad_tables(x_shape, y_shape, pads, mode):
    rank = len(x_shape)
    if rank > PAD_RANK:
        raise ValueError(f"Pad supports up to {PAD_RANK} axes, got {rank}")
    if mode != "constant" and any(d == 0 for d in x_shape):
        raise ValueError(f"mode={mode!r} cannot pad an empty axis")
    fill = PAD_RANK - rank
    longest = max([1] + list(y_shape))
    table = np.zeros((PAD_RANK, longest), dtype=np.int64)
    for axis in range(rank):
        begin = int(pads[axis])
        for o in range(y_shape[axis]):
            table[fill + axis, o] = _source_index(o - begin, x_shape[axis], mode)
    shape6 = lambda shape: (1,) * fill + tuple(shape)  # noqa: E731
    return table, shape6(x_shape), shape6(y_shape)


@binding("Pad")
def Pad(inputs, outputs, mode="constant", pads=None, value=0.0):
    x, y = inputs[0], outputs[0]
    rank = x.ndim
    if len(inputs) > 1 and inputs[1] is not None:
        given = [int(p) for p in inputs[1].reshape(-1)]
        axes = ([int(a) % rank for a in inputs[3].reshape(-1)] if len(inputs) > 3 and inputs[3] is not None
                else list(range(rank)))
        pads = [0] * (2 * rank)
        for k, axis in enumerate(axes):
            pads[axis], pads[rank + axis] = given[k], given[len(axes) + k]
    fill_value = inputs[2].reshape(1) if len(inputs) > 2 and inputs[2] is not None else _scalar(value)
    table, x6, y6 = _pad_tables(x.shape, y.shape, pads, _text(mode))
    return [(_pad, (x.reshape(x6), y.reshape(y6), table, fill_value))]


@binding("PadGrad", ODTRAIN_DOMAIN)
def PadGrad(inputs, outputs, pads, mode="constant"):
    dy, dx = inputs[0], outputs[0]
    table, x6, y6 = _pad_tables(dx.shape, dy.shape, pads, _text(mode))
    return [(_pad_grad, (dy.reshape(y6), dx.reshape(x6), table))]


# ---- Dropout -------------------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def _dropout(x, ratio, training, state, y, mask, want_mask):
    """Training: keep = uniform[0, 1) >= ratio (MT19937 reseeded from state each call, as numpy's legacy
    generator), y = x · keep / (1 - ratio). Otherwise y = x and keep = True."""
    r = ratio[0]
    if not training[0] or r == 0:
        for i in range(y.size):
            y[i] = x[i]
        if want_mask:
            mask[:] = True
        return
    np.random.seed(state[0] & 0xFFFFFFFF)
    state[0] += 1
    scale = np.float32(1.0 / (1.0 - r)) if r < 1 else np.float32(0.0)
    for i in range(y.size):
        keep = np.random.random() >= r
        y[i] = x[i] * scale if keep else 0
        if want_mask:
            mask[i] = keep


@njit(cache=True, error_model="numpy")
def _dropout_grad(dy, mask, ratio, training, dx):
    """dx = dy · mask / (1 - ratio) in training, dy otherwise."""
    r = ratio[0]
    if not training[0] or r == 0:
        for i in range(dx.size):
            dx[i] = dy[i]
        return
    scale = np.float32(1.0 / (1.0 - r)) if r < 1 else np.float32(0.0)
    for i in range(dx.size):
        dx[i] = dy[i] * scale if mask[i] else 0


def _dropout_controls(inputs, ratio):
    given = inputs[1] if len(inputs) > 1 and inputs[1] is not None else None
    ratio_array = given.reshape(1).astype(np.float32, copy=False) if given is not None else _scalar(ratio)
    flag = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    training = flag.reshape(1) if flag is not None else np.zeros(1, dtype=np.bool_)
    return ratio_array, training


@binding("Dropout")
def Dropout(inputs, outputs, ratio=0.5, seed=0, is_test=0):
    x, y = inputs[0], outputs[0]
    ratio_array, training = _dropout_controls(inputs, ratio)
    want = len(outputs) > 1 and outputs[1] is not None
    mask = _flat(outputs[1]) if want else np.zeros(1, dtype=np.bool_)
    state = np.array([int(seed)], dtype=np.int64)
    return [(_dropout, (_flat(x), ratio_array, training, state, _flat(y), mask, want))]


@binding("DropoutGrad", ODTRAIN_DOMAIN)
def DropoutGrad(inputs, outputs, ratio=0.5):
    dy, mask = inputs[0], inputs[1]
    ratio_array, training = _dropout_controls([None] + list(inputs[2:]), ratio)
    return [(_dropout_grad, (_flat(dy), _flat(mask), ratio_array, training, _flat(outputs[0])))]


# ---- Resize, Upsample ----------------------------------------------------------------------------
# Interpolation is separable: along each axis, output cell o reads taps source[o, t] with weights
# weight[o, t]; an output is the sum over all tap combinations of the product of their weights. The
# tables are built at bind time as ONNX's reference does (coordinate transform, neighbours, clamping
# at the edges, antialiasing, exclude_outside); runs of unchanged axes merge, so a step sees at most
# 4 axes ([N·C, H, W] for an image). Nearest has one tap per axis: a gather, and its gradient sums
# into each source cell the gradients of all its copies.

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
        mode, transform = _text(mode), _text(coordinate_transformation_mode)
        axes = [int(a) % rank for a in axes] if axes is not None and len(axes) else list(range(rank))
        scale = [1.0] * rank
        if scales is not None and scales.size:
            for k, axis in enumerate(axes):
                scale[axis] = float(scales.reshape(-1)[k])
        else:
            wanted = [int(s) for s in sizes.reshape(-1)]
            ratios = {axis: wanted[k] / x_shape[axis] for k, axis in enumerate(axes)}
            policy = _text(keep_aspect_ratio_policy)
            common = min(ratios.values()) if policy == "not_larger" else max(ratios.values())
            for axis in axes:
                scale[axis] = ratios[axis] if policy == "stretch" else common
        roi_full = [0.0] * rank + [1.0] * rank
        if transform == "tf_crop_and_resize":
            values = [float(v) for v in roi.reshape(-1)]
            for k, axis in enumerate(axes):
                roi_full[axis], roi_full[rank + axis] = values[k], values[len(axes) + k]
        settings = (mode, transform, _text(nearest_mode), float(cubic_coeff_a), bool(exclude_outside), bool(antialias))
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
        if len(x_shape) < 2 or _text(attrs.get("mode", "nearest")) == "nearest":
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
