"""Softmax, LogSoftmax, LayerNormalization, RMSNormalization and LpNormalization kernels, forward and backward.

Tensors are viewed as [outer, n, inner] around the normalised axis (softmax) or as rows of
the normalised axes (layer norm), so every kernel is a loop over independent rows; the
common case inner = 1 walks contiguous rows that LLVM vectorises. Statistics accumulate in
float32, two passes (mean, then centred variance), as ONNX Runtime's CPU kernels do.
LayerNorm's gradient reads the μ and σ⁻¹ the forward saved (its Mean and InvStdDev outputs),
then per row sums g and g·x̂ (and the row's dscale, dbias terms) in one pass and writes dx in a
second while the row is in the cache. RMSNorm has no statistics output: its gradient computes
r again (one pass over the row, in the cache); summing g·x and adding the row's dscale terms
in one loop ran 1.3-1.4x slower than in two (benchmarks/README.md), so they stay apart.

With threads, each kernel's `_parts` twin (kernels/parallel_split.py) runs it on parts of the outer rows
(contiguous slabs of the flat arrays) in one parallel region; every value is computed as in the serial
kernel, except the scale (and bias) gradients of LayerNorm and RMSNorm, summed per part and then added in
part order.
"""
from __future__ import annotations

import numpy as np

from .jit import njit, prange

from .registry import ODTRAIN_DOMAIN, binding
from .copies import same_buffer
from .layout import flat
from .parallel_split import parallel_twin, split, twin_of
from .scalar import fast_exp


REDUCE = {"reassoc"}  # reductions may reorder their sums: lets LLVM vectorise them (bench_ops.ElementwiseOps, Softmax)


@njit(cache=True, inline="always", error_model="numpy", fastmath=REDUCE)
def _softmax_row(x, out, base, n, inner):
    """One softmax along n elements from base, inner apart."""
    top = x[base]
    for j in range(1, n):
        top = max(top, x[base + j * inner])
    total = np.float32(0.0)
    for j in range(n):
        e = fast_exp(x[base + j * inner] - top)
        out[base + j * inner] = e
        total += e
    scale = np.float32(1.0) / total
    for j in range(n):
        out[base + j * inner] *= scale


@njit(cache=True, inline="always", error_model="numpy", fastmath=REDUCE)
def _softmax_loops(x, out, outer, n, inner):
    if inner == 1:  # contiguous rows: a constant stride LLVM vectorises
        for o in range(outer):
            _softmax_row(x, out, o * n, n, 1)
    else:
        for o in range(outer):
            for i in range(inner):
                _softmax_row(x, out, o * n * inner + i, n, inner)


@njit(cache=True, error_model="numpy", fastmath=REDUCE)
def _softmax(x, out, outer, n, inner):
    """out = softmax(x) along the middle axis of [outer, n, inner]."""
    _softmax_loops(x, out, outer, n, inner)


@njit(cache=True, error_model="numpy", fastmath=REDUCE)
def _softmax_inplace(x, outer, n, inner):
    """In place through x's own name, so that the loops vectorise (see elementwise._gelu_inplace)."""
    _softmax_loops(x, x, outer, n, inner)


@njit(cache=True, error_model="numpy", fastmath=REDUCE)
def _log_softmax(x, out, outer, n, inner):
    """out = x - max - log Σ exp(x - max) along the middle axis of [outer, n, inner]."""
    for o in range(outer):
        for i in range(inner):
            base = o * n * inner + i
            top = x[base]
            for j in range(1, n):
                top = max(top, x[base + j * inner])
            total = np.float32(0.0)
            for j in range(n):
                total += fast_exp(x[base + j * inner] - top)
            log_total = np.log(total)
            for j in range(n):  # (x - top) first: top + log_total would round away small differences
                out[base + j * inner] = (x[base + j * inner] - top) - log_total


@njit(cache=True, inline="always", error_model="numpy", fastmath=REDUCE)
def _softmax_grad_row(dy, y, dx, base, n, inner):
    total = np.float32(0.0)
    for j in range(n):
        total += dy[base + j * inner] * y[base + j * inner]
    for j in range(n):
        dx[base + j * inner] = y[base + j * inner] * (dy[base + j * inner] - total)


@njit(cache=True, inline="always", error_model="numpy", fastmath=REDUCE)
def _softmax_grad_loops(dy, y, dx, outer, n, inner):
    if inner == 1:
        for o in range(outer):
            _softmax_grad_row(dy, y, dx, o * n, n, 1)
    else:
        for o in range(outer):
            for i in range(inner):
                _softmax_grad_row(dy, y, dx, o * n * inner + i, n, inner)


@njit(cache=True, error_model="numpy", fastmath=REDUCE)
def _softmax_grad(dy, y, dx, outer, n, inner):
    """dx = y · (dy - Σ dy·y)."""
    _softmax_grad_loops(dy, y, dx, outer, n, inner)


@njit(cache=True, error_model="numpy", fastmath=REDUCE)
def _softmax_grad_inplace(dy, y, outer, n, inner):
    """dx written over dy, through dy's own name."""
    _softmax_grad_loops(dy, y, dy, outer, n, inner)


@njit(cache=True, error_model="numpy", fastmath=REDUCE)
def _log_softmax_grad(dy, y, dx, outer, n, inner):
    """dx = dy - exp(y) · Σ dy."""
    for o in range(outer):
        for i in range(inner):
            base = o * n * inner + i
            total = np.float32(0.0)
            for j in range(n):
                total += dy[base + j * inner]
            for j in range(n):
                dx[base + j * inner] = dy[base + j * inner] - fast_exp(y[base + j * inner]) * total


# ---- softmax on parts of the outer rows, in parallel: part p runs rows [bounds[p], bounds[p + 1]), the
# flat elements [bounds[p]·n·inner, bounds[p + 1]·n·inner)


ROWS = {"unit": ("n", "inner"), "count": "outer"}  # a part's rows: n·inner elements each, `outer` of them
_softmax_parts = parallel_twin(_softmax, sliced=("x", "out"), **ROWS)
_softmax_inplace_parts = parallel_twin(_softmax_inplace, sliced=("x",), **ROWS)
_log_softmax_parts = parallel_twin(_log_softmax, sliced=("x", "out"), **ROWS)
_softmax_grad_parts = parallel_twin(_softmax_grad, sliced=("dy", "y", "dx"), **ROWS)
_softmax_grad_inplace_parts = parallel_twin(_softmax_grad_inplace, sliced=("dy", "y"), **ROWS)
_log_softmax_grad_parts = parallel_twin(_log_softmax_grad, sliced=("dy", "y", "dx"), **ROWS)


def _rows_call(kernel, arrays: tuple, shape, axis, threads: int) -> list:
    """[(kernel, arrays + (outer, n, inner))], or its parallel twin on parts of the outer rows."""
    outer, n, inner = _around(shape, axis)
    return [split((kernel, arrays + (outer, n, inner)), outer, outer * n * inner, threads)]


def _around(shape, axis):
    axis = int(axis) % len(shape)
    return (int(np.prod(shape[:axis], dtype=np.int64)), int(shape[axis]),
            int(np.prod(shape[axis + 1:], dtype=np.int64)))


@njit(cache=True, inline="always", error_model="numpy")
def _lp_norm(x, base, n, inner, p):
    total = x[base] * 0
    for k in range(n):
        v = x[base + k * inner]
        total += abs(v) if p == 1 else v * v
    norm = total if p == 1 else np.sqrt(total)
    return norm if norm > 0 else norm + 1  # a zero line stays zero


@njit(cache=True, error_model="numpy")
def _lp_normalize(x, out, outer, n, inner, p):
    """out = x / its L1 or L2 norm along the middle axis of [outer, n, inner]."""
    for o in range(outer):
        for i in range(inner):
            base = o * n * inner + i
            norm = _lp_norm(x, base, n, inner, p)
            for k in range(n):
                out[base + k * inner] = x[base + k * inner] / norm


@njit(cache=True, error_model="numpy")
def _lp_normalize_grad(dy, x, dx, outer, n, inner, p):
    """dx = (dy - g · Σ dy·y) / N along the middle axis, y = x / N, g = y (L2) or sign(x) (L1); dx may be dy."""
    for o in range(outer):
        for i in range(inner):
            base = o * n * inner + i
            norm = _lp_norm(x, base, n, inner, p)
            s = x[base] * 0
            for k in range(n):
                s += dy[base + k * inner] * x[base + k * inner] / norm
            for k in range(n):
                v = x[base + k * inner]
                g = v / norm if p == 2 else (v > 0) - (v < 0)
                dx[base + k * inner] = (dy[base + k * inner] - g * s) / norm


@binding("LpNormalization")
def LpNormalization(inputs, outputs, axis=-1, p=2):
    x = inputs[0]
    return [(_lp_normalize, (flat(x), flat(outputs[0])) + _around(x.shape, axis) + (int(p),))]


@binding("LpNormalizationGrad", ODTRAIN_DOMAIN)
def LpNormalizationGrad(inputs, outputs, axis=-1, p=2):
    dy, x = inputs
    return [(_lp_normalize_grad, (flat(dy), flat(x), flat(outputs[0])) + _around(x.shape, axis) + (int(p),))]


@binding("Softmax", parallel=True)
def Softmax(inputs, outputs, axis=-1, threads=1):
    x, out = inputs[0], outputs[0]
    if same_buffer(x, out):
        return _rows_call(_softmax_inplace, (flat(x),), x.shape, axis, threads)
    return _rows_call(_softmax, (flat(x), flat(out)), x.shape, axis, threads)


@binding("LogSoftmax", parallel=True)
def LogSoftmax(inputs, outputs, axis=-1, threads=1):
    x = inputs[0]
    return _rows_call(_log_softmax, (flat(x), flat(outputs[0])), x.shape, axis, threads)


@binding("SoftmaxGrad", ODTRAIN_DOMAIN, parallel=True)
def SoftmaxGrad(inputs, outputs, axis=-1, threads=1):
    dy, y = inputs
    dx = outputs[0]
    if same_buffer(dy, dx):
        return _rows_call(_softmax_grad_inplace, (flat(dy), flat(y)), y.shape, axis, threads)
    return _rows_call(_softmax_grad, (flat(dy), flat(y), flat(dx)), y.shape, axis, threads)


@binding("LogSoftmaxGrad", ODTRAIN_DOMAIN, parallel=True)
def LogSoftmaxGrad(inputs, outputs, axis=-1, threads=1):
    dy, y = inputs
    return _rows_call(_log_softmax_grad, (flat(dy), flat(y), flat(outputs[0])), y.shape, axis, threads)


@njit(cache=True, inline="always", error_model="numpy", fastmath=REDUCE)
def _row_statistics(x, base, inner, epsilon):
    mean = np.float32(0.0)
    for j in range(inner):
        mean += x[base + j]
    mean /= inner
    var = np.float32(0.0)
    for j in range(inner):
        d = x[base + j] - mean
        var += d * d
    var /= inner
    return mean, np.float32(1.0) / np.sqrt(var + epsilon)


@njit(cache=True, error_model="numpy", fastmath=REDUCE)
def _layer_norm(x, scale, scale_index, bias, bias_index, has_bias, y, mean_out, inv_out, want_stats, rows, inner,
                epsilon):
    """y = (x - μ) · σ⁻¹ · scale + bias per row; μ and σ⁻¹ stored when wanted.
    scale and bias are read at scale_index[j], bias_index[j] when they broadcast (else directly)."""
    eps = np.float32(epsilon)
    for r in range(rows):
        base = r * inner
        mean, inv = _row_statistics(x, base, inner, eps)
        if want_stats:
            mean_out[r] = mean
            inv_out[r] = inv
        if scale_index.size == 0 and bias_index.size == 0:
            if has_bias:
                for j in range(inner):
                    y[base + j] = (x[base + j] - mean) * inv * scale[j] + bias[j]
            else:
                for j in range(inner):
                    y[base + j] = (x[base + j] - mean) * inv * scale[j]
        else:
            for j in range(inner):
                shift = bias[bias_index[j] if bias_index.size else j] if has_bias else np.float32(0.0)
                y[base + j] = (x[base + j] - mean) * inv * scale[scale_index[j] if scale_index.size else j] + shift


@njit(cache=True, inline="always", error_model="numpy", fastmath=REDUCE)
def _layer_norm_grad_rows(dy, x, scale, param_index, full, dx, dscale, dbias, rows, inner, eps, saved_mean,
                          saved_inv, saved):
    for r in range(rows):
        base = r * inner
        if saved:
            mean, inv = saved_mean[r], saved_inv[r]
        else:
            mean, inv = _row_statistics(x, base, inner, eps)
        mean_g = np.float32(0.0)
        mean_gx = np.float32(0.0)
        for j in range(inner):
            xhat = (x[base + j] - mean) * inv
            g = dy[base + j] * (scale[j] if full else scale[param_index[j]])
            mean_g += g
            mean_gx += g * xhat
            dscale[j] += dy[base + j] * xhat
            dbias[j] += dy[base + j]
        mean_g /= inner
        mean_gx /= inner
        for j in range(inner):
            xhat = (x[base + j] - mean) * inv
            g = dy[base + j] * (scale[j] if full else scale[param_index[j]])
            dx[base + j] = inv * (g - mean_g - xhat * mean_gx)


@njit(cache=True, error_model="numpy", fastmath=REDUCE)
def _layer_norm_grad(dy, x, scale, param_index, dx, dscale, dbias, rows, inner, epsilon, saved_mean, saved_inv,
                     saved):
    """dx = σ⁻¹ (g - mean(g) - x̂ · mean(g·x̂)) with g = dy·scale; dscale = Σ dy·x̂, dbias = Σ dy. μ and σ⁻¹
    are the forward's saved_mean and saved_inv per row when `saved`, else computed from x as the forward does."""
    eps = np.float32(epsilon)
    for j in range(inner):
        dscale[j] = 0
        dbias[j] = 0
    if param_index.size == 0:  # a literal flag: the inlined loops lose the branch
        _layer_norm_grad_rows(dy, x, scale, param_index, True, dx, dscale, dbias, rows, inner, eps, saved_mean,
                              saved_inv, saved)
    else:
        _layer_norm_grad_rows(dy, x, scale, param_index, False, dx, dscale, dbias, rows, inner, eps, saved_mean,
                              saved_inv, saved)


@twin_of(_layer_norm, because="its statistics are cut to the part only when it writes them")
@njit(cache=True, error_model="numpy", fastmath=REDUCE, parallel=True)
def _layer_norm_parts(x, scale, scale_index, bias, bias_index, has_bias, y, mean_out, inv_out, want_stats, rows,
                      inner, epsilon, bounds):
    """_layer_norm on parts of the rows (bounds), in parallel."""
    for p in prange(bounds.size - 1):
        lo, hi = bounds[p], bounds[p + 1]
        stats_lo, stats_hi = (lo, hi) if want_stats else (0, 1)
        _layer_norm(x[lo * inner:hi * inner], scale, scale_index, bias, bias_index, has_bias, y[lo * inner:hi * inner],
                    mean_out[stats_lo:stats_hi], inv_out[stats_lo:stats_hi], want_stats, hi - lo, inner, epsilon)


@twin_of(_layer_norm_grad, takes=("partial",),
         because="each part sums dscale and dbias into its own partial, added in part order after")
@njit(cache=True, error_model="numpy", fastmath=REDUCE, parallel=True)
def _layer_norm_grad_parts(dy, x, scale, param_index, dx, dscale, dbias, rows, inner, epsilon, saved_mean,
                           saved_inv, saved, partial, bounds):
    """_layer_norm_grad on parts of the rows (bounds), in parallel, each part summing its dscale and dbias
    into partial[p] ([2, inner]); the parts' sums are then added in part order."""
    parts = bounds.size - 1
    for p in prange(parts):
        lo, hi = bounds[p] * inner, bounds[p + 1] * inner
        stats_lo, stats_hi = (bounds[p], bounds[p + 1]) if saved else (0, 1)
        _layer_norm_grad(dy[lo:hi], x[lo:hi], scale, param_index, dx[lo:hi], partial[p, 0], partial[p, 1],
                         bounds[p + 1] - bounds[p], inner, epsilon, saved_mean[stats_lo:stats_hi],
                         saved_inv[stats_lo:stats_hi], saved)
    for j in range(inner):
        dscale[j] = partial[0, 0, j]
        dbias[j] = partial[0, 1, j]
    for p in range(1, parts):
        for j in range(inner):
            dscale[j] += partial[p, 0, j]
            dbias[j] += partial[p, 1, j]


def _param_index(param_shape, normalised_shape):
    """Empty when a parameter covers the normalised axes exactly, else each position's index into it."""
    if tuple(param_shape) == tuple(normalised_shape):
        return np.zeros(0, dtype=np.int64)
    from .layout import element_strides

    strides = np.array(element_strides(tuple(param_shape), tuple(normalised_shape)), dtype=np.int64)
    grid = np.indices(normalised_shape).reshape(len(normalised_shape), -1)
    return (strides[:, None] * grid).sum(axis=0).astype(np.int64)


@binding("LayerNormalization", parallel=True)
def LayerNormalization(inputs, outputs, axis=-1, epsilon=1e-5, stash_type=1, threads=1):
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    axis = int(axis) % x.ndim
    normalised = x.shape[axis:]
    rows, inner = int(np.prod(x.shape[:axis], dtype=np.int64)), int(np.prod(normalised, dtype=np.int64))
    scale_index = _param_index(scale.shape, normalised)
    bias_index = _param_index(bias.shape if bias is not None else normalised, normalised)
    stats = [outputs[i] if len(outputs) > i else None for i in (1, 2)]
    want_stats = any(s is not None for s in stats)
    # an omitted statistic, when the other is wanted, goes to a buffer made here, once
    mean, inv = (flat(s) if s is not None else np.zeros(rows if want_stats else 1, np.float32) for s in stats)
    bias_flat = flat(bias) if bias is not None else np.zeros(1, x.dtype)
    args = (flat(x), flat(scale), scale_index, bias_flat, bias_index, bias is not None, flat(outputs[0]), mean, inv,
            want_stats, rows, inner, float(epsilon))
    return [split((_layer_norm, args), rows, rows * inner, threads)]


@binding("LayerNormalizationGrad", ODTRAIN_DOMAIN, parallel=True)
def LayerNormalizationGrad(inputs, outputs, axis=-1, epsilon=1e-5, threads=1):
    """Inputs dY, X, scale, then the forward's Mean and InvStdDev (absent in artifacts written before the
    gradient read them: then computed again from X)."""
    dy, x, scale = inputs[:3]
    axis = int(axis) % x.ndim
    normalised = x.shape[axis:]
    rows, inner = int(np.prod(x.shape[:axis], dtype=np.int64)), int(np.prod(normalised, dtype=np.int64))
    index = _param_index(scale.shape, normalised)
    saved = len(inputs) > 4 and inputs[3] is not None and inputs[4] is not None
    mean, inv = (flat(inputs[3]), flat(inputs[4])) if saved else (np.zeros(1, np.float32), np.zeros(1, np.float32))
    args = (flat(dy), flat(x), flat(scale), index, flat(outputs[0]), flat(outputs[1]), flat(outputs[2]), rows, inner,
            float(epsilon), mean, inv, saved)
    # in parts: each part's dscale and dbias sums ([parts, 2, inner]), made once here
    return [split((_layer_norm_grad, args), rows, rows * inner, threads,
                  lambda parts: (np.zeros((parts, 2, inner), np.float32),))]


@njit(cache=True, inline="always", error_model="numpy", fastmath=REDUCE)
def _row_inverse_rms(row, epsilon):
    """1/√(mean(row²) + ε) of one row (a slice)."""
    squares = np.float32(0.0)
    for j in range(row.size):
        squares += row[j] * row[j]
    return np.float32(1.0) / np.sqrt(squares / row.size + epsilon)


@njit(cache=True, error_model="numpy", fastmath=REDUCE)
def _rms_norm(x, scale, scale_index, y, rows, inner, epsilon):
    """y = x · r · scale per row, r = 1/√(mean(x²) + ε); scale read at scale_index[j] when it broadcasts.
    Rows are slices indexed from 0 and the broadcast test is outside the loops, so they vectorise."""
    eps = np.float32(epsilon)
    for r in range(rows):
        xr, yr = x[r * inner:(r + 1) * inner], y[r * inner:(r + 1) * inner]
        inv = _row_inverse_rms(xr, eps)
        if scale_index.size == 0:
            for j in range(inner):
                yr[j] = xr[j] * inv * scale[j]
        else:
            for j in range(inner):
                yr[j] = xr[j] * inv * scale[scale_index[j]]


@njit(cache=True, error_model="numpy", fastmath=REDUCE)
def _rms_norm_grad(dy, x, scale, scale_index, dx, dscale, rows, inner, epsilon):
    """dx = r · (g - x · r² · mean(g·x)) with g = dy·scale;  dscale = Σ dy·x·r (as _rms_norm, row slices)."""
    eps = np.float32(epsilon)
    for j in range(inner):
        dscale[j] = 0
    for r in range(rows):
        xr, gr, dr = x[r * inner:(r + 1) * inner], dy[r * inner:(r + 1) * inner], dx[r * inner:(r + 1) * inner]
        inv = _row_inverse_rms(xr, eps)
        mean_gx = np.float32(0.0)
        if scale_index.size == 0:
            for j in range(inner):
                mean_gx += gr[j] * scale[j] * xr[j]
        else:
            for j in range(inner):
                mean_gx += gr[j] * scale[scale_index[j]] * xr[j]
        for j in range(inner):  # apart from the sum: a loop storing into dscale would not vectorise it
            dscale[j] += gr[j] * xr[j] * inv
        mean_gx /= inner
        factor = inv * inv * mean_gx
        if scale_index.size == 0:
            for j in range(inner):
                dr[j] = inv * (gr[j] * scale[j] - xr[j] * factor)
        else:
            for j in range(inner):
                dr[j] = inv * (gr[j] * scale[scale_index[j]] - xr[j] * factor)


_rms_norm_parts = parallel_twin(_rms_norm, sliced=("x", "y"), unit=("inner",), count="rows")


@twin_of(_rms_norm_grad, takes=("partial",),
         because="each part sums dscale into its own partial, added in part order after")
@njit(cache=True, error_model="numpy", fastmath=REDUCE, parallel=True)
def _rms_norm_grad_parts(dy, x, scale, scale_index, dx, dscale, rows, inner, epsilon, partial, bounds):
    """_rms_norm_grad on parts of the rows (bounds), in parallel, each part summing its dscale into partial[p];
    the parts' sums are then added in part order."""
    parts = bounds.size - 1
    for p in prange(parts):
        lo, hi = bounds[p] * inner, bounds[p + 1] * inner
        _rms_norm_grad(dy[lo:hi], x[lo:hi], scale, scale_index, dx[lo:hi], partial[p], bounds[p + 1] - bounds[p],
                       inner, epsilon)
    for j in range(inner):
        dscale[j] = partial[0, j]
    for p in range(1, parts):
        for j in range(inner):
            dscale[j] += partial[p, j]


def _rows(x, axis):
    axis = int(axis) % x.ndim
    return axis, int(np.prod(x.shape[:axis], dtype=np.int64)), int(np.prod(x.shape[axis:], dtype=np.int64))


def RMSNormalization(inputs, outputs, axis=-1, epsilon=1e-5, stash_type=1, threads=1):
    x, scale = inputs[0], inputs[1]
    axis, rows, inner = _rows(x, axis)
    index = _param_index(scale.shape, x.shape[axis:])
    args = (flat(x), flat(scale), index, flat(outputs[0]), rows, inner, float(epsilon))
    return [split((_rms_norm, args), rows, rows * inner, threads)]


binding("RMSNormalization", parallel=True)(RMSNormalization)
binding("RMSNormalization", ODTRAIN_DOMAIN, parallel=True)(RMSNormalization)


@binding("RMSNormalizationGrad", ODTRAIN_DOMAIN, parallel=True)
def RMSNormalizationGrad(inputs, outputs, axis=-1, epsilon=1e-5, threads=1):
    dy, x, scale = inputs
    axis, rows, inner = _rows(x, axis)
    index = _param_index(scale.shape, x.shape[axis:])
    # an omitted output goes to a buffer made here, once
    dx = outputs[0] if outputs[0] is not None else np.zeros_like(x)
    dscale = outputs[1] if len(outputs) > 1 and outputs[1] is not None else np.zeros(inner, x.dtype)
    args = (flat(dy), flat(x), flat(scale), index, flat(dx), flat(dscale), rows, inner, float(epsilon))
    # in parts: each part's dscale sums ([parts, inner]), made once here
    return [split((_rms_norm_grad, args), rows, rows * inner, threads,
                  lambda parts: (np.zeros((parts, inner), np.float32),))]
