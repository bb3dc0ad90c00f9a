"""Kernels: stride-1 2-D convolutions as one product per kernel tap over shifted views of the padded image.

An image of one group, padded into planes of Hp × Wp cells (Hp = oH + (kh - 1)·dh, Wp = oW + (kw - 1)·dw)
and flattened, holds the input of tap t = (i, j) under every output cell at one offset, s_t = i·dh·Wp + j·dw,
when the output is laid out on the padded width (cell q = oh·Wp + ow, the last (kw - 1)·dw cells of each row
unused, Q = oH·Wp - (kw - 1)·dw cells in all):

    Y[m, q]  = Σ_t W_t[m, :] · Xpad[:, q + s_t]               one product per tap, K = C/G, beta = 1
    dXpad[c, r] = Σ_t W_tᵀ[c, :] · dYframe[:, r + S - s_t]     over the image's own rows r
    dW_t    += dYwide · Xpad[:, s_t:s_t + Q]ᵀ                  per image

W_t is the tap's [M/G, C/G] slice of W (gathered tap-major first); dYwide is dY on the padded width with
zeros in the unused cells, and dYframe the same after S = max s_t zeros, so every shifted read stays inside
it and reads zeros where the tap falls outside the output. No im2col: each image is written once padded
(C/G·Hp·Wp floats against im2col's K·oH·oW, a ninth for 3x3 kernels) and the products read it in place.

For few channels the per-tap products are thin (K = C/G), so the layout takes this path only for at least
TAP_MIN_CHANNELS input channels per group and outputs at least TAP_MIN_WIDTH wide (TAP_MIN_WEIGHT_WIDTH
for the weight gradient; the unused cells cost (kw - 1)·dw / Wp of the products). Above those limits the
taps ran the cnn model's 16- and 32-channel layers faster than im2col (kernels/conv/__init__.py), forward and weight
gradient, on OpenBLAS's SkylakeX and Haswell kernels alike; below them the thin products lose
(bench_ops.ConvOps, Conv and ConvWeightGrad of the cnn).

Work memory per part (`tap_work_sizes`): the padded planes (or, for dX, its rows on the padded width), the
output or dY on the padded width (framed: S more cells per channel), and the tap-major weights or dW sums
[G, kh·kw, M/G, C/G]. Threads: the `_parts` twins split the batch as kernels/conv/__init__.py does; weight-gradient
parts sum their own images, added in part order after.
"""
from __future__ import annotations

import numpy as np

from ..jit import njit, prange

from ..blas import gemm_blocks
from ..parallel_split import on_parts, part_count, twin_of
from ..windows import FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT

TAP_MIN_CHANNELS = 16  # thinner products (K = C/G per tap) lose to im2col's K = C/G·kh·kw
# Narrower outputs waste more of every product on unused cells ((kw - 1)·dw / Wp). At 8 wide taps still run the
# forward and input gradient faster than im2col, but not the weight gradient: its per-tap products [M/G, C/G]
# over Q cells are too short for OpenBLAS (bench_ops.ConvOps; the runs: benchmarks/README.md, "Figures behind
# kernel choices").
TAP_MIN_WIDTH = 8
TAP_MIN_WEIGHT_WIDTH = 16


@njit(cache=True, error_model="numpy", inline="always")
def _extents(geom):
    """(Hp, Wp, Q cells on the padded width, S the largest tap offset, kh·kw): the one place of these
    sizes, for the kernels and for the layout at bind time."""
    kh, kw, dh, dw = geom[1], geom[2], geom[7], geom[8]
    hp, wp = geom[13] + (kh - 1) * dh, geom[14] + (kw - 1) * dw
    return hp, wp, geom[13] * wp - (kw - 1) * dw, (kh - 1) * dh * wp + (kw - 1) * dw, kh * kw


def tap_work_sizes(geom, in_per_group: int, out_per_group: int, groups: int):
    """(plane, grid, taps): elements per part of the padded planes, the padded-width output or framed dY,
    and the tap weights or dW sums."""
    hp, wp, _, frame, count = (int(v) for v in _extents(geom))
    return in_per_group * hp * wp, out_per_group * (hp * wp + frame), groups * count * out_per_group * in_per_group


@njit(cache=True, error_model="numpy", inline="always")
def work_pieces(mine, sizes):
    """A part's work memory as (padded planes or dX rows, grid, taps or dW sums), of sizes[0:3] elements."""
    start = sizes[0] + sizes[1]
    return mine[:sizes[0]], mine[sizes[0]:start], mine[start:start + sizes[2]]


@njit(cache=True, error_model="numpy", inline="always")
def _shift(t, geom, wp):
    """Offset of tap t in the flattened padded plane."""
    return (t // geom[2]) * geom[7] * wp + (t % geom[2]) * geom[8]


@njit(cache=True, error_model="numpy", inline="always")
def _gather_taps(w_group, taps, count):
    """taps[t, m, c] = w_group[m, c·count + t] (flat, tap-major)."""
    per_group, channels = w_group.shape[0], w_group.shape[1] // count
    for t in range(count):
        for m in range(per_group):
            base = (t * per_group + m) * channels
            for c in range(channels):
                taps[base + c] = w_group[m, c * count + t]


@njit(cache=True, error_model="numpy", inline="always")
def _pad_image(image, plane, geom, hp, wp):
    """plane[c, pt + i, pl + j] = image[c, 0, i, j] (flat, Hp·Wp per channel), zero around."""
    plane[:image.shape[0] * hp * wp] = 0
    top, left = geom[10], geom[11]
    for c in range(image.shape[0]):
        for i in range(image.shape[2]):
            target = plane[(c * hp + top + i) * wp + left:]
            source = image[c, 0, i]
            for j in range(source.size):
                target[j] = source[j]


@njit(cache=True, error_model="numpy", inline="always")
def _spread_rows(rows, grid, offset, pitch, cells, out_w, wp):
    """grid[m·pitch + offset + oh·Wp + ow] = rows[m, oh·oW + ow]; zero in the unused cells and the frame."""
    grid[:rows.shape[0] * pitch] = 0
    for m in range(rows.shape[0]):
        source = rows[m]
        for oh in range(cells // out_w):
            target = grid[m * pitch + offset + oh * wp:]
            line = source[oh * out_w:]
            for ow in range(out_w):
                target[ow] = line[ow]


@njit(cache=True, error_model="numpy")
def _tap_forward(x, w, bias, has_bias, y, plane, grid, taps, geom, begin, end):
    """y[n, g] = Σ_t W_t · Xpad(x[n, g]) shifted by s_t (+ bias), for the images n in [begin, end)."""
    groups, channels, per_group, cells = x.shape[1], x.shape[2], y.shape[2], y.shape[3]
    hp, wp, q, frame, count = _extents(geom)
    out_w = geom[14]
    for g in range(groups):
        _gather_taps(w[g], taps, count)
        for n in range(begin, end):
            _pad_image(x[n, g], plane, geom, hp, wp)
            for t in range(count):
                gemm_blocks(0, 0, per_group, q, channels, 1.0, taps, t * per_group * channels, channels, plane,
                            _shift(t, geom, wp), hp * wp, 0.0 if t == 0 else 1.0, grid, 0, q)
            for m in range(per_group):
                target = y[n, g, m]
                value = bias[g, m] if has_bias else 0.0
                for oh in range(cells // out_w):
                    row = target[oh * out_w:]
                    source = grid[m * q + oh * wp:]
                    for ow in range(out_w):
                        row[ow] = source[ow] + value


@twin_of(_tap_forward, range=("begin", "end"), replaces=("plane", "grid", "taps"), takes=("work", "sizes"),
         because="each part runs on its own work memory")
@njit(cache=True, error_model="numpy", parallel=True)
def _tap_forward_parts(x, w, bias, has_bias, y, work, sizes, geom, bounds):
    """_tap_forward on the images [bounds[p], bounds[p + 1]) of each part p, in parallel, each with work[p]."""
    for part in prange(bounds.size - 1):
        plane, grid, taps = work_pieces(work[part], sizes)
        _tap_forward(x, w, bias, has_bias, y, plane, grid, taps, geom, bounds[part], bounds[part + 1])


@njit(cache=True, error_model="numpy")
def _tap_input_grad(dy, w, dx, rows, grid, taps, geom, begin, end):
    """dx[n, g] = the image's rows of Σ_t W_tᵀ · dYframe shifted back by s_t, for the images in [begin, end)."""
    groups, channels, height, width = dx.shape[1], dx.shape[2], dx.shape[4], dx.shape[5]
    per_group, cells = dy.shape[2], dy.shape[3]
    hp, wp, q, frame, count = _extents(geom)
    pitch = frame + hp * wp  # one channel of dY framed
    top, left = geom[10], geom[11]
    span = height * wp  # the image's rows on the padded width
    for g in range(groups):
        _gather_taps(w[g], taps, count)
        for n in range(begin, end):
            _spread_rows(dy[n, g], grid, frame, pitch, cells, geom[14], wp)
            for t in range(count):
                gemm_blocks(1, 0, channels, span, per_group, 1.0, taps, t * per_group * channels, channels, grid,
                            top * wp + frame - _shift(t, geom, wp), pitch, 0.0 if t == 0 else 1.0, rows, 0, span)
            for c in range(channels):
                for i in range(height):
                    target = dx[n, g, c, 0, i]
                    source = rows[c * span + i * wp + left:]
                    for j in range(width):
                        target[j] = source[j]


@twin_of(_tap_input_grad, range=("begin", "end"), replaces=("rows", "grid", "taps"), takes=("work", "sizes"),
         because="each part runs on its own work memory")
@njit(cache=True, error_model="numpy", parallel=True)
def _tap_input_grad_parts(dy, w, dx, work, sizes, geom, bounds):
    """_tap_input_grad on the images of each part (bounds), in parallel, each with its own work[p]."""
    for part in prange(bounds.size - 1):
        rows, grid, taps = work_pieces(work[part], sizes)
        _tap_input_grad(dy, w, dx, rows, grid, taps, geom, bounds[part], bounds[part + 1])


@njit(cache=True, error_model="numpy")
def _tap_weight_sums(dy, x, plane, grid, sums, geom, begin, end):
    """sums[g, t] = Σ over the images n in [begin, end) of dYwide(dy[n, g]) · Xpad(x[n, g])[:, s_t:]ᵀ."""
    groups, channels, per_group, cells = x.shape[1], x.shape[2], dy.shape[2], dy.shape[3]
    hp, wp, q, frame, count = _extents(geom)
    size = per_group * channels
    for g in range(groups):
        for n in range(begin, end):
            _pad_image(x[n, g], plane, geom, hp, wp)
            _spread_rows(dy[n, g], grid, 0, q, cells, geom[14], wp)
            for t in range(count):
                gemm_blocks(0, 1, per_group, channels, q, 1.0, grid, 0, q, plane, _shift(t, geom, wp), hp * wp,
                            0.0 if n == begin else 1.0, sums, (g * count + t) * size, channels)


@njit(cache=True, error_model="numpy", inline="always")
def _taps_to_weights(sums, dw, count, parts):
    """dw[g, m, c·count + t] = Σ over the parts, in order, of sums[part][g, t, m, c] (flat)."""
    groups, per_group, channels = dw.shape[0], dw.shape[1], dw.shape[2] // count
    for g in range(groups):
        for t in range(count):
            for m in range(per_group):
                base = ((g * count + t) * per_group + m) * channels
                for c in range(channels):
                    total = sums[0, base + c]
                    for part in range(1, parts):
                        total += sums[part, base + c]
                    dw[g, m, c * count + t] = total


@njit(cache=True, error_model="numpy")
def _tap_weight_grad(dy, x, dw, plane, grid, sums, geom):
    """dw from every image, summed tap-major in sums, then laid out as W."""
    _tap_weight_sums(dy, x, plane, grid, sums, geom, 0, dy.shape[0])
    _taps_to_weights(sums.reshape(1, -1), dw, geom[1] * geom[2], 1)


@twin_of(_tap_weight_grad, replaces=("plane", "grid", "sums"), takes=("work", "sizes"),
         because="each part sums its images' dW into its own sums, added in part order after")
@njit(cache=True, error_model="numpy", parallel=True)
def _tap_weight_grad_parts(dy, x, dw, work, sizes, geom, bounds):
    """dw as _tap_weight_grad, each part (bounds) summing its images into its own sums in work[p], in
    parallel; the parts' sums are then added in part order: the same at every run."""
    for part in prange(bounds.size - 1):
        plane, grid, sums = work_pieces(work[part], sizes)
        _tap_weight_sums(dy, x, plane, grid, sums, geom, bounds[part], bounds[part + 1])
    start = sizes[0] + sizes[1]
    _taps_to_weights(work[:, start:start + sizes[2]], dw, geom[1] * geom[2], bounds.size - 1)


# ---- the plan: whether a convolution runs on taps, its work memory and its calls ----------------------------


KERNELS = {FORWARD: _tap_forward, INPUT_GRADIENT: _tap_input_grad, WEIGHT_GRADIENT: _tap_weight_grad}


class TapPlan:
    """How a convolution's op runs on the tap kernels: whether it may (`takes`), each part's work memory
    (`tap_work_sizes`: planes, grid, taps or dW sums) and the calls, the batch split into parts."""

    @staticmethod
    def takes(conv, op: int) -> bool:
        """Whether `op` of `conv` (kernels/windows.py's Convolution) runs on the tap kernels: 2-D, stride 1,
        not depthwise, at least TAP_MIN_CHANNELS input channels per group, outputs at least TAP_MIN_WIDTH wide
        (TAP_MIN_WEIGHT_WIDTH for the weight gradient), and the image inside the padded planes (a
        ConvTranspose's output padding can leave cells past them, which no tap reads; im2col handles those)."""
        geom = conv.geom
        two_d = geom[0] == 1 and geom[12] == 1 and conv.x3[0] == 1  # one depth cell
        hp, wp = _extents(geom)[:2]
        inside = conv.x3[1] + geom[10] <= hp and conv.x3[2] + geom[11] <= wp
        return bool(two_d and inside and not conv.depthwise and (geom[3:6] == 1).all() and geom[1] * geom[2] > 1
                    and conv.in_per_group >= TAP_MIN_CHANNELS
                    and geom[14] >= (TAP_MIN_WEIGHT_WIDTH if op == WEIGHT_GRADIENT else TAP_MIN_WIDTH))

    def __init__(self, conv, threads: int):
        self.geom, self.batch = conv.geom, conv.batch
        self.parts = part_count(threads, conv.batch, conv.multiply_adds)
        self.sizes = np.array(tap_work_sizes(conv.geom, conv.in_per_group, conv.out_per_group, conv.groups), np.int64)

    def scratch_bytes(self, op: int, itemsize: int = 4) -> int:
        """Bytes of work memory for all parts (the same for every op), in elements of `itemsize` bytes."""
        return itemsize * self.parts * int(self.sizes.sum())

    def calls(self, op: int, arrays: tuple, scratch) -> list:
        """The call of `op`'s tap kernel on `arrays` (X as [N, G, C/G, D, H, W], W as [G, M/G, K], Y as
        [N, G, M/G, P]) over the batch, or its parallel twin on the plan's parts, each with its own work memory
        (in the dtype the convolution runs in)."""
        memory = scratch.view(arrays[0].dtype)[:self.parts * int(self.sizes.sum())].reshape(self.parts, -1)
        pieces = work_pieces(memory[0], self.sizes)
        tail = (self.geom,) if op == WEIGHT_GRADIENT else (self.geom, 0, self.batch)
        return [on_parts((KERNELS[op], arrays + pieces + tail), self.batch, self.parts, (memory, self.sizes))]
