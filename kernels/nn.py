"""Kernels: batch normalization, activations with parameters (Clip, LeakyRelu, HardSigmoid, HardSwish, Elu, Selu,
Celu, ThresholdedRelu, Shrink, Swish), Pad and Dropout.

BatchNormalization sums in float64 per channel (Σx, Σx²), so one pass gives
statistics accurate for float32 data; in training it also writes the batch
mean and 1/√(σ² + ε) it used (float64), which its gradient reads: the
backward then sums only Σdy and Σdy·x (float64) over a block of channels,
then writes dx from the block while it is in the cache. Given no saved
statistics (artifacts from before they existed), the gradient sums Σx and Σx²
as well, in the same pass. Its output pass clamps to [low, high], which is how
a fused Relu/Clip costs nothing. Its gradient, given that activation's output
y, computes the activation's gradient g = dy · (low < y < high) itself
(ClipGrad's loop), into dx a block of an image at a time, summed right after
while it is in the cache (on planes of MASKED_ROW_FUSION elements or more, with
the statistics known, one loop per row writes g and sums it): one call, and
with threads one parallel region, instead of two. Forward and
backward walk a block of channels at a time (CHANNEL_BLOCK), its sums then its
outputs, so the second pass reads the block from the cache rather than memory
(the same sums in the same order as one pass over the whole tensor: the same
bits).
Channels are independent: with threads, parts of them run in one parallel
region, each channel computed as in the serial kernel.

Kernels that may run in place loop over one array when they do (an aliasing
check would otherwise send them to a scalar path).
"""
from __future__ import annotations

import numpy as np

from .jit import njit, prange  # noqa: F401 (prange: the loops of the generated twins)

from .registry import ODTRAIN_DOMAIN, binding
from .copies import same_buffer
from .parallel_split import parallel_twin, split
from .scalar import fast_sigmoid, fast_sigmoid_pair
from .windows import text

# Sums may be reassociated (fastmath "reassoc"): they vectorise, and partial sums are no less accurate.
REDUCTION = {"reassoc", "contract"}
FLOAT_MAX = float(np.finfo(np.float32).max)
# Elements of each array (x, y; backward x, dy, y, dx) a block of channels spans: batch normalization sums a
# block, then writes its outputs while the block is still in a core's L2 cache. A channel at a time would do
# that too, but where the planes are small its rows are short and scattered (one per image), which the
# prefetchers do not follow: 8x384 planes of 6x6 took 3x longer channel by channel than in one pass.
CHANNEL_BLOCK = 1 << 15
# Planes (elements per image and channel) from which a masked batch-normalization gradient computes the mask
# and the sums in one loop per row: on shorter rows the loop's vector part hardly runs, and masking the
# block's rows of an image in one long loop, then summing, was faster (benchmarks/README.md, figures behind
# kernel choices: per row 1.23x the time at 16x16, 1.01x at 20x20, 0.97x at 24x24, 0.90x at 48x48).
MASKED_ROW_FUSION = 512

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
def _row_gradient_sums(x, dy):
    """(Σ dy, Σ dy·x) in float64."""
    g, gx = 0.0, 0.0
    for i in range(x.size):
        d = np.float64(dy[i])
        g += d
        gx += d * np.float64(x[i])
    return g, gx


@njit(cache=True, error_model="numpy", fastmath=REDUCTION)
def _row_masked_gradient_sums(x, dy, y, low, high, g):
    """g = dy · (low < y < high) (ClipGrad's product), and (Σ g, Σ g·x) in float64, in one loop."""
    s, sx = 0.0, 0.0
    for i in range(x.size):
        value = dy[i] * np.float32((y[i] > low) & (y[i] < high))
        g[i] = value
        d = np.float64(value)
        s += d
        sx += d * np.float64(x[i])
    return s, sx


@njit(cache=True, error_model="numpy", fastmath=REDUCTION)
def _row_masked_gradient_sums_in_place(x, g, y, low, high):
    """_row_masked_gradient_sums with dy = g: one array, so no aliasing check sends the loop to a scalar path.
    Written out rather than inlined into the caller with one array passed twice (as _activation_grad does): the
    caller's flags would then govern the loop, without the reassociation that vectorises its float64 sums."""
    s, sx = 0.0, 0.0
    for i in range(x.size):
        value = g[i] * np.float32((y[i] > low) & (y[i] < high))
        g[i] = value
        d = np.float64(value)
        s += d
        sx += d * np.float64(x[i])
    return s, sx


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
def _affine_rows(x, center, factor, shift, low, high, y, c0, c1):
    """y[n, c] = clip((x[n, c] - center[c]) · factor[c] + shift[c], low, high) for the channels [c0, c1): the
    clip is a fused Relu/Clip (±inf when there is none)."""
    for n in range(x.shape[0]):
        for c in range(c0, c1):
            mean, scale, offset = np.float32(center[c]), np.float32(factor[c]), np.float32(shift[c])
            source, target = x[n, c], y[n, c]
            for i in range(source.size):
                target[i] = min(max((source[i] - mean) * scale + offset, low), high)


@njit(cache=True, error_model="numpy")
def _batch_norm_train(x, scale, bias, mean_in, var_in, y, mean_out, var_out, has_running, momentum, epsilon,
                      saved_mean, saved_inv_std, stats, low, high, in_place, block, c0, c1):
    """y = (x - μ_batch) · γ/√(σ²_batch + ε) + β; running = momentum·running + (1 - momentum)·batch
    (unbiased variance), for the channels [c0, c1), `block` channels at a time; saved_mean = μ_batch,
    saved_inv_std = 1/√(σ²_batch + ε), for the gradient. The running outputs may alias their inputs: each
    reads then writes one channel. stats is [3, C] float64 scratch."""
    count = x.shape[0] * x.shape[2]
    for first in range(c0, c1, block):
        last = min(first + block, c1)
        for c in range(first, last):
            stats[0, c] = 0.0
            stats[1, c] = 0.0
        for n in range(x.shape[0]):
            for c in range(first, last):
                s, q = _row_sums(x[n, c])
                stats[0, c] += s
                stats[1, c] += q
        for c in range(first, last):
            mean = stats[0, c] / count
            var = max(stats[1, c] / count - mean * mean, 0.0)
            if has_running:
                unbiased = var * count / (count - 1) if count > 1 else var
                mean_out[c] = momentum * mean_in[c] + (1.0 - momentum) * mean
                var_out[c] = momentum * var_in[c] + (1.0 - momentum) * unbiased
            saved_mean[c] = mean
            saved_inv_std[c] = 1.0 / np.sqrt(var + epsilon)
            stats[0, c] = mean
            stats[1, c] = scale[c] / np.sqrt(var + epsilon)
            stats[2, c] = bias[c]
        if in_place:  # one array in the loop: no aliasing check sends it to a scalar path
            _affine_rows(y, stats[0], stats[1], stats[2], low[0], high[0], y, first, last)
        else:
            _affine_rows(x, stats[0], stats[1], stats[2], low[0], high[0], y, first, last)


@njit(cache=True, error_model="numpy")
def _batch_norm_infer(x, scale, bias, mean, var, y, epsilon, stats, low, high, in_place, c0, c1):
    """y = (x - mean) · γ/√(var + ε) + β with the running statistics (clipped to [low, high]) for the channels
    [c0, c1)."""
    for c in range(c0, c1):
        stats[0, c] = mean[c]
        stats[1, c] = scale[c] / np.sqrt(np.float64(var[c]) + epsilon)
        stats[2, c] = bias[c]
    if in_place:
        _affine_rows(y, stats[0], stats[1], stats[2], low[0], high[0], y, c0, c1)
    else:
        _affine_rows(x, stats[0], stats[1], stats[2], low[0], high[0], y, c0, c1)


@njit(cache=True, error_model="numpy", inline="always")
def _batch_norm_grad_rows(dy, x, coefficients, dx, c0, c1):
    """dx = a·dy + b·(x - μ) + e per channel of [c0, c1), coefficients rows (a, b, e, μ)."""
    for n in range(x.shape[0]):
        for c in range(c0, c1):
            a, b = np.float32(coefficients[0, c]), np.float32(coefficients[1, c])
            e, mean = np.float32(coefficients[2, c]), np.float32(coefficients[3, c])
            xs, gs, target = x[n, c], dy[n, c], dx[n, c]
            for i in range(xs.size):
                target[i] = a * gs[i] + b * (xs[i] - mean) + e


@njit(cache=True, error_model="numpy", inline="always")
def _batch_norm_grad_coefficients(sums, c, count, scale, mean_in, var_in, dscale, dbias, dmean, dvar, wants, training,
                                  saved, epsilon):
    """Channel c's small gradients from its sums (Σx, Σx², Σdy, Σdy·x), then sums[:, c] ← (a, b, e, μ) of
    dx = a·dy + b·(x - μ) + e. With `saved` (training), μ and 1/√(σ² + ε) are mean_in[c] and var_in[c], the
    forward's, and Σx, Σx² are not read."""
    if training and saved:
        mean, inv_std = np.float64(mean_in[c]), np.float64(var_in[c])
    elif training:
        mean = sums[0, c] / count
        inv_std = 1.0 / np.sqrt(max(sums[1, c] / count - mean * mean, 0.0) + epsilon)
    else:
        mean = np.float64(mean_in[c])
        inv_std = 1.0 / np.sqrt(np.float64(var_in[c]) + epsilon)
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
    a = gamma * inv_std
    sums[0, c] = a
    sums[1, c] = -a * inv_std * inv_std * sum_dy_centered / count if training else 0.0
    sums[2, c] = -a * sum_dy / count if training else 0.0
    sums[3, c] = mean


@njit(cache=True, error_model="numpy")
def _batch_norm_grad(dy, x, y, scale, mean_in, var_in, dx, dscale, dbias, dmean, dvar, wants, training, saved,
                     epsilon, masked, fuse_mask, low, high, sums, in_place, block, c0, c1):
    """Gradients of batch normalization (see graph/ops/nn.py) for the channels [c0, c1), `block` channels at a
    time; outputs with wants[i] == 0 are skipped. In training, with `saved`, mean_in and var_in are the forward's
    batch mean and 1/√(σ² + ε), and a block's pass sums Σdy and Σdy·x only (as out of training, which reads the
    running statistics); without, it sums Σx and Σx² too.
    When `masked` (dx wanted), the incoming gradient is dy · (low < y < high), y the output of a Relu/Clip that
    followed (1-element bounds): it is written into dx a block of an image at a time, then summed while in the
    cache, or with `fuse_mask` (the statistics known) summed per row as it is written; else y is not read. dx may
    be dy (in_place): each element is read before it is written. sums is [4, C] float64 scratch."""
    count = x.shape[0] * x.shape[2]
    size, channels = x.shape[2], x.shape[1]
    known = saved or not training  # the statistics: Σx and Σx² are not needed
    dy_flat, y_flat, dx_flat = dy.reshape(-1), y.reshape(-1), dx.reshape(-1)
    for first in range(c0, c1, block):
        last = min(first + block, c1)
        for c in range(first, last):
            for row in range(4):  # Σx, Σx², Σdy, Σdy·x
                sums[row, c] = 0.0
        for n in range(x.shape[0]):
            if fuse_mask:  # long rows: the Clip gradient, as ClipGrad computes it, summed as it is written
                for c in range(first, last):
                    if in_place:
                        g, gx = _row_masked_gradient_sums_in_place(x[n, c], dx[n, c], y[n, c], low[0], high[0])
                    else:
                        g, gx = _row_masked_gradient_sums(x[n, c], dy[n, c], y[n, c], low[0], high[0], dx[n, c])
                    sums[2, c] += g
                    sums[3, c] += gx
                continue
            if masked:  # the Clip gradient (code 0) of the block's rows in this image, as ClipGrad computes it
                start, stop = (n * channels + first) * size, (n * channels + last) * size
                _activation_grad(0, dy_flat[start:stop], y_flat[start:stop], low, high, dx_flat[start:stop],
                                 in_place)
            for c in range(first, last):
                if known:
                    g, gx = _row_gradient_sums(x[n, c], dx[n, c] if masked else dy[n, c])
                else:
                    s, q, g, gx = _row_grad_sums(x[n, c], dx[n, c] if masked else dy[n, c])
                    sums[0, c] += s
                    sums[1, c] += q
                sums[2, c] += g
                sums[3, c] += gx
        for c in range(first, last):
            _batch_norm_grad_coefficients(sums, c, count, scale, mean_in, var_in, dscale, dbias, dmean, dvar, wants,
                                          training, saved, epsilon)
        if not wants[0]:
            continue
        if in_place or masked:  # one array for dy and dx: no aliasing check sends the loop to a scalar path
            _batch_norm_grad_rows(dx, x, sums, dx, first, last)
        else:
            _batch_norm_grad_rows(dy, x, sums, dx, first, last)


# ---- the same on parts of the channels, in parallel: each channel is computed as in the serial kernel --


_batch_norm_train_parts = parallel_twin(_batch_norm_train, range=("c0", "c1"))
_batch_norm_infer_parts = parallel_twin(_batch_norm_infer, range=("c0", "c1"))
_batch_norm_grad_parts = parallel_twin(_batch_norm_grad, range=("c0", "c1"))


def _channel_block(x: np.ndarray) -> int:
    """Channels per block of the batch-normalization kernels (CHANNEL_BLOCK)."""
    return max(1, CHANNEL_BLOCK // max(1, x.size // max(1, x.shape[1])))


def _ncs(array: np.ndarray) -> np.ndarray:
    return array.reshape(array.shape[0], array.shape[1], -1)


def _batch_norm_calls(inputs, outputs, low, high, epsilon=1e-5, momentum=0.9, training_mode=0, spatial=1,
                      threads=1):
    x, scale, bias, mean, var = inputs[:5]
    y = outputs[0]
    in_place = bool(np.shares_memory(x, y))
    channels = x.shape[1]  # the parts' units
    if not training_mode:
        return [split((_batch_norm_infer, (_ncs(x), scale, bias, mean, var, _ncs(y), float(epsilon),
                                           np.zeros((3, channels)), low, high, in_place, 0, channels)),
                      channels, x.size, threads)]
    mean_out = outputs[1] if len(outputs) > 1 and outputs[1] is not None else None
    var_out = outputs[2] if len(outputs) > 2 and outputs[2] is not None else None
    has_running = mean_out is not None and var_out is not None
    if not has_running:
        mean_out, var_out = np.zeros_like(mean), np.zeros_like(var)
    # the batch mean and 1/√(σ² + ε), for the gradient (BatchNormalizationActivation's outputs 3, 4)
    saved = [outputs[i] if len(outputs) > i and outputs[i] is not None else np.zeros(channels, np.float64)
             for i in (3, 4)]
    stats = np.zeros((3, channels), dtype=np.float64)
    return [split((_batch_norm_train, (_ncs(x), scale, bias, mean, var, _ncs(y), mean_out, var_out, has_running,
                                       float(momentum), float(epsilon), *saved, stats, low, high, in_place,
                                       _channel_block(x), 0, channels)),
                  channels, x.size, threads)]


def _activation_bounds(activation, bound_inputs, attrs) -> tuple:
    """(low, high) as 1-element arrays: the clip of a Relu or Clip fused with a normalization (Clip's bounds
    from its inputs, read at run time, or its min/max attributes, which this takes out of `attrs`); ±inf
    without one."""
    bounds = {k: attrs.pop(k) for k in ("min", "max") if k in attrs}
    if activation is None:
        return _scalar(-np.inf), _scalar(np.inf)
    if activation == "Relu":
        return _scalar(0.0), _scalar(np.inf)
    if activation == "Clip":
        return _activation_params("Clip", [None] + list(bound_inputs), bounds)
    raise ValueError(f"activation {activation!r}: a normalization fuses Relu or Clip only")


@binding("BatchNormalization", parallel=True)
def BatchNormalization(inputs, outputs, **attrs):
    return _batch_norm_calls(inputs, outputs, _scalar(-np.inf), _scalar(np.inf), **attrs)


@binding("BatchNormalizationActivation", ODTRAIN_DOMAIN, parallel=True)
def BatchNormalizationActivation(inputs, outputs, activation=None, **attrs):
    """BatchNormalization, then Relu (clip at 0) or Clip (bounds from inputs 5, 6 or min/max attributes), or
    nothing; outputs 3, 4 (in training) the batch mean and 1/√(σ² + ε)."""
    low, high = _activation_bounds(activation, inputs[5:7], attrs)
    return _batch_norm_calls(inputs[:5], outputs, low, high, **attrs)


@binding("BatchNormalizationGrad", ODTRAIN_DOMAIN, parallel=True)
def BatchNormalizationGrad(inputs, outputs, epsilon=1e-5, training_mode=1, activation=None, threads=1, **bounds):
    """The gradient of BatchNormalization, or, with `activation`, of BatchNormalization then that Relu or Clip:
    input 5 is the activation's output, 6 and 7 Clip's bounds (min/max attributes in opsets before 11). Inputs
    3, 4 are the running mean and variance out of training; in training, the forward's saved batch mean and
    1/√(σ² + ε), or absent (the batch statistics are then summed again from X)."""
    low, high = _activation_bounds(activation, inputs[6:8], bounds)
    if bounds:
        raise TypeError(f"unexpected attributes {sorted(bounds)}")
    dy, x, scale = inputs[:3]
    channels = scale.shape[0]
    saved = bool(training_mode) and len(inputs) > 4 and inputs[3] is not None and inputs[4] is not None
    mean = inputs[3] if len(inputs) > 3 and inputs[3] is not None else np.zeros(channels, np.float32)
    var = inputs[4] if len(inputs) > 4 and inputs[4] is not None else np.ones(channels, np.float32)
    outs = list(outputs) + [None] * (5 - len(outputs))
    wants = np.array([o is not None for o in outs], dtype=np.int64)
    dx = _ncs(outs[0]) if outs[0] is not None else np.zeros((1, 1, 1), np.float32)
    small = [o if o is not None else np.zeros(channels, np.float32) for o in outs[1:]]
    sums = np.zeros((4, channels), dtype=np.float64)
    in_place = outs[0] is not None and bool(np.shares_memory(dy, outs[0]))
    masked = activation is not None
    if masked and outs[0] is None:
        raise ValueError("a folded activation needs the input gradient dX (its buffer holds the activation's)")
    y = _ncs(inputs[5]) if masked else _ncs(x)  # y is read only when masked
    size = x.size // max(1, x.shape[0] * channels)
    fuse_mask = masked and (saved or not training_mode) and size >= MASKED_ROW_FUSION
    return [split((_batch_norm_grad, (_ncs(dy), _ncs(x), y, scale, mean, var, dx, *small, wants, bool(training_mode),
                                      saved, float(epsilon), masked, fuse_mask, low, high, sums, in_place,
                                      _channel_block(x), 0, channels)),
                  channels, x.size, threads)]

# ---- activations ---------------------------------------------------------------------------------
# Codes (arguments, so one compiled kernel serves the family), parameters a and b as 1-element arrays:
#   0 Clip(a = min, b = max), 1 LeakyRelu(a = alpha), 2 HardSigmoid(a = alpha, b = beta), 3 HardSwish,
#   4 Elu(a = alpha), 5 Selu(a = alpha, b = gamma), 6 Celu(a = alpha), 7 ThresholdedRelu(a = alpha),
#   8 Shrink(a = lambd, b = bias), 9 Swish(a = alpha)

ACTIVATIONS = {"Clip": 0, "LeakyRelu": 1, "HardSigmoid": 2, "HardSwish": 3, "Elu": 4, "Selu": 5, "Celu": 6,
               "ThresholdedRelu": 7, "Shrink": 8, "Swish": 9}


@njit(cache=True, error_model="numpy", inline="always")
def _activation_loops(code, x, a, b, out):
    """out = f(x) elementwise; one loop per op, so each vectorises."""
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
    elif code == 3:
        sixth, half = np.float32(1.0 / 6.0), np.float32(0.5)
        for i in range(out.size):
            v = x[i]
            out[i] = v * max(zero, min(one, v * sixth + half))
    elif code <= 6:  # Elu, Selu (scaled by gamma), Celu (alpha also divides x): below 0, alpha · (e^x - 1)
        scale = b if code == 5 else one
        inner = one / a if code == 6 else one
        for i in range(out.size):
            v = x[i]
            out[i] = scale * (v if v > 0 else a * (np.exp(v * inner) - one))
    elif code == 7:
        for i in range(out.size):
            v = x[i]
            out[i] = v if v > a else zero
    elif code == 8:
        for i in range(out.size):
            v = x[i]
            out[i] = v - b if v > a else (v + b if v < -a else zero)
    else:  # x · sigmoid(alpha · x)
        for i in range(out.size):
            v = x[i]
            out[i] = v * fast_sigmoid(a * v)


@njit(cache=True, error_model="numpy")
def _activation(code, x, a_in, b_in, out, in_place):
    """out = f(x) elementwise. In place (out is x) the loops see one array, so no aliasing check sends them to a
    scalar path."""
    if in_place:
        _activation_loops(code, out, a_in[0], b_in[0], out)
    else:
        _activation_loops(code, x, a_in[0], b_in[0], out)


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
    elif code == 3:  # PyTorch's hardswish_backward: 0 below -3, x/3 + 1/2 up to 3, then 1
        third, half = np.float32(1.0 / 3.0), np.float32(0.5)
        for i in range(out.size):
            x = v[i]
            above = np.float32(x > 3)
            out[i] = dy[i] * (np.float32(x >= -3) * ((one - above) * (x * third + half) + above))
    elif code <= 6:  # from y (y > 0 exactly where x > 0): Elu 1 | y + alpha, Selu gamma | y + gamma·alpha,
        # Celu 1 | y / alpha + 1
        above = b if code == 5 else one
        slope = one / a if code == 6 else one
        offset = one if code == 6 else (a * b if code == 5 else a)
        for i in range(out.size):
            y = v[i]
            out[i] = dy[i] * (above if y > 0 else y * slope + offset)
    elif code == 7:  # from x: x > alpha
        for i in range(out.size):
            out[i] = dy[i] * np.float32(v[i] > a)
    elif code == 8:  # from x: |x| > lambd
        for i in range(out.size):
            out[i] = dy[i] * np.float32(abs(v[i]) > a)
    else:  # from x: s · (1 + alpha · x · (1 - s)), s = sigmoid(alpha · x)
        for i in range(out.size):
            x = v[i]
            s, rest = fast_sigmoid_pair(a * x)
            out[i] = dy[i] * (s * (one + a * x * rest))


@njit(cache=True, error_model="numpy")
def _activation_grad(code, dy, v, a_in, b_in, out, in_place):
    """out = dy · f'(.) where v is the forward output (Clip, HardSigmoid, LeakyRelu) or input (HardSwish).
    In place (out is dy) the loops see one array, so no aliasing check sends them to a scalar path."""
    if in_place:
        _activation_grad_loops(code, out, v, a_in[0], b_in[0], out)
    else:
        _activation_grad_loops(code, dy, v, a_in[0], b_in[0], out)


_activation_parts = parallel_twin(_activation, sliced=("x", "out"))


_activation_grad_parts = parallel_twin(_activation_grad, sliced=("dy", "v", "out"))


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
    if op_type == "Selu":
        return (_scalar(attrs.get("alpha", 1.67326319217681884765625)),
                _scalar(attrs.get("gamma", 1.05070102214813232421875)))
    if op_type == "Shrink":
        return _scalar(attrs.get("lambd", 0.5)), _scalar(attrs.get("bias", 0.0))
    if op_type in ("Elu", "Celu", "ThresholdedRelu", "Swish"):
        return _scalar(attrs.get("alpha", 1.0)), _scalar(0.0)
    return _scalar(0.0), _scalar(0.0)


def _flat(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1)


def _make_activation(op_type):
    def bind(inputs, outputs, threads=1, **attrs):
        a, b = _activation_params(op_type, inputs, attrs)
        x, out = _flat(inputs[0]), _flat(outputs[0])
        in_place = same_buffer(x, out)
        return [split((_activation, (ACTIVATIONS[op_type], x, a, b, out, in_place)), out.size, out.size, threads)]

    return bind


def _make_activation_grad(op_type):
    def bind(inputs, outputs, threads=1, **attrs):
        a, b = _activation_params(op_type, inputs[1:], attrs)
        dy, out = _flat(inputs[0]), _flat(outputs[0])
        in_place = bool(np.shares_memory(dy, out))
        return [split((_activation_grad, (ACTIVATIONS[op_type], dy, _flat(inputs[1]), a, b, out, in_place)), out.size,
                      out.size, threads)]

    return bind


for _op in ACTIVATIONS:
    binding(_op, parallel=True)(_make_activation(_op))
    binding(f"{_op}Grad", ODTRAIN_DOMAIN, parallel=True)(_make_activation_grad(_op))
binding("Swish", ODTRAIN_DOMAIN, parallel=True)(_make_activation("Swish"))  # a SiLU fused from Mul(x, Sigmoid(x))


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
    table, x6, y6 = _pad_tables(x.shape, y.shape, pads, text(mode))
    return [(_pad, (x.reshape(x6), y.reshape(y6), table, fill_value))]


@binding("PadGrad", ODTRAIN_DOMAIN)
def PadGrad(inputs, outputs, pads, mode="constant"):
    dy, dx = inputs[0], outputs[0]
    table, x6, y6 = _pad_tables(dx.shape, dy.shape, pads, text(mode))
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
def Dropout(inputs, outputs, ratio=0.5, seed=0, is_test=0, stream=None):
    """`stream` (one int64, set before each step by the caller: the node's own stream at that step) seeds the
    mask; without it the node's `seed` attribute does, advancing by one per call."""
    x, y = inputs[0], outputs[0]
    ratio_array, training = _dropout_controls(inputs, ratio)
    want = len(outputs) > 1 and outputs[1] is not None
    mask = _flat(outputs[1]) if want else np.zeros(1, dtype=np.bool_)
    state = stream if stream is not None else np.array([int(seed)], dtype=np.int64)
    return [(_dropout, (_flat(x), ratio_array, training, state, _flat(y), mask, want))]


@binding("DropoutGrad", ODTRAIN_DOMAIN)
def DropoutGrad(inputs, outputs, ratio=0.5):
    dy, mask = inputs[0], inputs[1]
    ratio_array, training = _dropout_controls([None] + list(inputs[2:]), ratio)
    return [(_dropout_grad, (_flat(dy), _flat(mask), ratio_array, training, _flat(outputs[0])))]

