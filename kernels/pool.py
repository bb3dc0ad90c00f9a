"""Kernels: MaxPool, AveragePool, LpPool, GlobalMaxPool, GlobalAveragePool and their gradient ops.

Every (image, channel) pair is one plane: X is seen as [N·C, D, H, W], with the 3 spatial axes
and `geom` of windows.py (a global pool is one window the size of the input). MaxPool's first
maximum wins, and its gradient recomputes each window's argmax from X, so no index output is
needed; MaxPool windows that tile the input (stride = kernel, no padding or dilation) skip the
per-cell bounds checks, and 2x2 tiles of planes get their own loops along the rows. AveragePool multiplies each window's sum by 1/count, counts precomputed
at bind time per window position (input cells, or with count_include_pad also the declared padding).

Planes are independent: with threads, each kernel's `_parts` twin runs it on parts of the planes in one
parallel region (kernels/parallel_split.py); every value is computed as in the serial kernel.
"""
from __future__ import annotations

import numpy as np

from .jit import njit, prange

from .registry import ODTRAIN_DOMAIN, binding
from .parallel_split import parallel_twin, split, twin_of
from .windows import as_3d, window_geometry


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
def _max_pool_2x2(x, y):
    """y = max over each 2x2 tile of the planes x[:, 0] (first maximum wins), a pair of input rows at a time."""
    for nc in range(x.shape[0]):
        for oh in range(y.shape[2]):
            top, bottom, out = x[nc, 0, 2 * oh], x[nc, 0, 2 * oh + 1], y[nc, 0, oh]
            for ow in range(out.size):
                best = top[2 * ow]
                value = top[2 * ow + 1]
                if value > best:
                    best = value
                value = bottom[2 * ow]
                if value > best:
                    best = value
                value = bottom[2 * ow + 1]
                if value > best:
                    best = value
                out[ow] = best


@njit(cache=True, error_model="numpy")
def _max_pool_2x2_grad(dy_bits, x, dx_bits):
    """dx = dy at each 2x2 tile's first maximum, 0 elsewhere in the tile (the tiles cover the plane): the
    first cell equal to the tile's maximum (the maximum is NaN only when the first cell is).

    dy and dx come as their bits (an integer view of the same width): each cell is dy's bits masked by
    all ones or all zeros, so no store depends on a branch. Branches on which cell wins are taken at
    random on real data, and their mispredictions made a float version several times slower
    (bench_ops.PoolOps, MaxPoolGrad)."""
    for nc in range(x.shape[0]):
        for oh in range(dy_bits.shape[2]):
            top, bottom = x[nc, 0, 2 * oh], x[nc, 0, 2 * oh + 1]
            out_top, out_bottom, grads = dx_bits[nc, 0, 2 * oh], dx_bits[nc, 0, 2 * oh + 1], dy_bits[nc, 0, oh]
            for ow in range(grads.size):
                a, b, c, d = top[2 * ow], top[2 * ow + 1], bottom[2 * ow], bottom[2 * ow + 1]
                best = b if b > a else a
                best = c if c > best else best
                best = d if d > best else best
                take_a = np.int64(a == best) | np.int64(best != best)
                take_b = np.int64(b == best) & (1 - take_a)
                take_c = np.int64(c == best) & (1 - (take_a | take_b))
                take_d = 1 - (take_a | take_b | take_c)
                grad = grads[ow]
                out_top[2 * ow] = grad & -take_a
                out_top[2 * ow + 1] = grad & -take_b
                out_bottom[2 * ow] = grad & -take_c
                out_bottom[2 * ow + 1] = grad & -take_d


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


# ---- the same on parts of the planes, in parallel: part p runs planes [bounds[p], bounds[p + 1]) ------


@twin_of(_max_pool, because="its parts run without indices (their values would count planes from the part's first)")
@njit(cache=True, error_model="numpy", parallel=True)
def _max_pool_parts(x, y, indices, want_indices, column_major, geom, tiled, bounds):
    """Without indices only (their values count planes from the first)."""
    for p in prange(bounds.size - 1):
        _max_pool(x[bounds[p]:bounds[p + 1]], y[bounds[p]:bounds[p + 1]], indices, False, column_major, geom, tiled)


_max_pool_grad_parts = parallel_twin(_max_pool_grad, sliced=("dy", "x", "dx"))
_max_pool_2x2_parts = parallel_twin(_max_pool_2x2, sliced=("x", "y"))
_max_pool_2x2_grad_parts = parallel_twin(_max_pool_2x2_grad, sliced=("dy_bits", "x", "dx_bits"))
_average_pool_parts = parallel_twin(_average_pool, sliced=("x", "y"))
_average_pool_grad_parts = parallel_twin(_average_pool_grad, sliced=("dy", "dx"))


@njit(cache=True, error_model="numpy")
def _lp_pool(x, y, dy, dx, p, geom, backward):
    """Forward: y = (Σ |x|^p)^(1/p) over each window. Backward: dx = Σ over the windows holding a cell of
    dy · sign(x) · (|x| / y)^(p-1) (zero where y is zero)."""
    depth, height, width = x.shape[1], x.shape[2], x.shape[3]
    if backward:
        dx.reshape(-1)[:] = 0
    for nc in range(x.shape[0]):
        plane = x[nc]
        for od in range(y.shape[1]):
            for oh in range(y.shape[2]):
                for ow in range(y.shape[3]):
                    total = np.float32(0.0)
                    norm = y[nc, od, oh, ow]
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
                                v = plane[i_d, i_h, i_w]
                                if not backward:
                                    total += abs(v) ** p
                                elif norm > 0:
                                    sign = np.float32((v > 0) - (v < 0))
                                    dx[nc, i_d, i_h, i_w] += dy[nc, od, oh, ow] * sign * (abs(v) / norm) ** (p - 1)
                    if not backward:
                        y[nc, od, oh, ow] = total ** (np.float32(1.0) / p)


@binding("LpPool")
def LpPool(inputs, outputs, p=2, **attrs):
    x, y = inputs[0], outputs[0]
    geom, _ = _pool_geometry(x.shape, y.shape, **attrs)
    xv, yv = _pool_views(x.shape, y.shape)
    x4, y4 = x.reshape(xv), y.reshape(yv)
    return [(_lp_pool, (x4, y4, y4, x4, np.float32(p), geom, False))]


@binding("LpPoolGrad", ODTRAIN_DOMAIN)
def LpPoolGrad(inputs, outputs, p=2, **attrs):
    dy, x, y = inputs
    dx = outputs[0]
    geom, _ = _pool_geometry(x.shape, y.shape, **attrs)
    xv, yv = _pool_views(x.shape, y.shape)
    return [(_lp_pool, (x.reshape(xv), y.reshape(yv), dy.reshape(yv), dx.reshape(xv), np.float32(p), geom, True))]


def _calls(kernel, args, threads: int, x_view, y_view, geom, serial: bool = False) -> list:
    """[(kernel, args)], or its parallel twin on parts of the planes when the work pays for it (a pass over
    the input, and each output cell's window)."""
    work = max(int(np.prod(x_view)), int(np.prod(y_view)) * int(np.prod(geom[0:3])))
    return [split((kernel, args), x_view[0], work, 1 if serial else threads)]


def _pool_views(x_shape, y_shape):
    planes = int(x_shape[0]) * int(x_shape[1])
    return (planes,) + as_3d(x_shape[2:]), (planes,) + as_3d(y_shape[2:])


def _pool_geometry(x_shape, y_shape, kernel_shape=None, auto_pad="NOTSET", pads=None, strides=None,
                   dilations=None, **_):
    return window_geometry(x_shape[2:], y_shape[2:], kernel_shape, auto_pad, pads, strides, dilations)


def _inverse_counts(x_shape, geom, end_pads, count_include_pad) -> np.ndarray:
    """1 / (cells counted in each window): input cells, or with count_include_pad also the declared padding."""
    x3 = as_3d(x_shape[2:])
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


def _tiles_2x2(geom, x_view, y_view, cover: bool = False) -> bool:
    """Whether the windows are 2x2 tiles of planes (depth 1); with `cover`, tiles covering every input cell."""
    if not (_tiles(geom, x_view, y_view) and x_view[1] == 1 and (geom[0:3] == (1, 2, 2)).all()):
        return False
    return not cover or (2 * y_view[2] == x_view[2] and 2 * y_view[3] == x_view[3])


def _tiles(geom, x_view, y_view) -> bool:
    """Whether the windows tile the input: stride = kernel, no padding or dilation, all inside."""
    return bool((geom[3:6] == geom[0:3]).all() and (geom[6:9] == 1).all() and (geom[9:12] == 0).all()
                and all(y_view[1 + a] * geom[a] <= x_view[1 + a] for a in range(3)))


@binding("MaxPool", parallel=True)
def MaxPool(inputs, outputs, storage_order=0, threads=1, **attrs):
    x, y = inputs[0], outputs[0]
    geom, _ = _pool_geometry(x.shape, y.shape, **attrs)
    xv, yv = _pool_views(x.shape, y.shape)
    want = len(outputs) > 1 and outputs[1] is not None
    indices = outputs[1].reshape(yv) if want else np.zeros((1, 1, 1, 1), np.int64)
    if not want and _tiles_2x2(geom, xv, yv):
        return _calls(_max_pool_2x2, (x.reshape(xv), y.reshape(yv)), threads, xv, yv, geom)
    return _calls(_max_pool, (x.reshape(xv), y.reshape(yv), indices, want, bool(storage_order), geom,
                              _tiles(geom, xv, yv)), threads, xv, yv, geom, serial=want)


@binding("MaxPoolGrad", ODTRAIN_DOMAIN, parallel=True)
def MaxPoolGrad(inputs, outputs, threads=1, **attrs):
    dy, x, dx = inputs[0], inputs[1], outputs[0]
    geom, _ = _pool_geometry(x.shape, dy.shape, **attrs)
    xv, yv = _pool_views(x.shape, dy.shape)
    if _tiles_2x2(geom, xv, yv, cover=True):
        bits = np.dtype(f"int{8 * dx.itemsize}")
        return _calls(_max_pool_2x2_grad, (dy.reshape(yv).view(bits), x.reshape(xv), dx.reshape(xv).view(bits)), threads,
                      xv, yv, geom)
    return _calls(_max_pool_grad, (dy.reshape(yv), x.reshape(xv), dx.reshape(xv), geom, _tiles(geom, xv, yv)),
                  threads, xv, yv, geom)


@binding("AveragePool", parallel=True)
def AveragePool(inputs, outputs, count_include_pad=0, threads=1, **attrs):
    x, y = inputs[0], outputs[0]
    geom, end = _pool_geometry(x.shape, y.shape, **attrs)
    xv, yv = _pool_views(x.shape, y.shape)
    inverse = _inverse_counts(x.shape, geom, end, count_include_pad)
    return _calls(_average_pool, (x.reshape(xv), y.reshape(yv), inverse, geom), threads, xv, yv, geom)


@binding("AveragePoolGrad", ODTRAIN_DOMAIN, parallel=True)
def AveragePoolGrad(inputs, outputs, count_include_pad=0, threads=1, **attrs):
    dy, dx = inputs[0], outputs[0]
    geom, end = _pool_geometry(dx.shape, dy.shape, **attrs)
    xv, yv = _pool_views(dx.shape, dy.shape)
    inverse = _inverse_counts(dx.shape, geom, end, count_include_pad)
    return _calls(_average_pool_grad, (dy.reshape(yv), dx.reshape(xv), inverse, geom), threads, xv, yv, geom)


@binding("GlobalMaxPool", parallel=True)
def GlobalMaxPool(inputs, outputs, threads=1):
    x, y = inputs[0], outputs[0]
    geom, _ = _global_geometry(x.shape)
    xv, yv = _pool_views(x.shape, y.shape)
    return _calls(_max_pool, (x.reshape(xv), y.reshape(yv), np.zeros((1, 1, 1, 1), np.int64), False, False, geom,
                              True), threads, xv, yv, geom)


@binding("GlobalMaxPoolGrad", ODTRAIN_DOMAIN, parallel=True)
def GlobalMaxPoolGrad(inputs, outputs, threads=1):
    dy, x, dx = inputs[0], inputs[1], outputs[0]
    geom, _ = _global_geometry(x.shape)
    xv, yv = _pool_views(x.shape, dy.shape)
    return _calls(_max_pool_grad, (dy.reshape(yv), x.reshape(xv), dx.reshape(xv), geom, True), threads, xv, yv,
                  geom)


@binding("GlobalAveragePool", parallel=True)
def GlobalAveragePool(inputs, outputs, threads=1):
    x, y = inputs[0], outputs[0]
    geom, _ = _global_geometry(x.shape)
    xv, yv = _pool_views(x.shape, y.shape)
    inverse = np.array([1.0 / max(1, int(np.prod(x.shape[2:])))], np.float32)
    return _calls(_average_pool, (x.reshape(xv), y.reshape(yv), inverse, geom), threads, xv, yv, geom)


@binding("GlobalAveragePoolGrad", ODTRAIN_DOMAIN, parallel=True)
def GlobalAveragePoolGrad(inputs, outputs, threads=1):
    dy, dx = inputs[0], outputs[0]
    geom, _ = _global_geometry(dx.shape)
    xv, yv = _pool_views(dx.shape, dy.shape)
    inverse = np.array([1.0 / max(1, int(np.prod(dx.shape[2:])))], np.float32)
    return _calls(_average_pool_grad, (dy.reshape(yv), dx.reshape(xv), inverse, geom), threads, xv, yv, geom)
