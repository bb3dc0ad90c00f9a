"""Optimizer updates and gradient accumulation, each one fused loop over flat buffers.

AdamW (ONNX Runtime's generated optimizer; Hugging Face's AdamW):
    m ← β1·m + (1-β1)·g;  v ← β2·v + (1-β2)·g²
    w ← w - step_size · m / (√v + ε),  step_size = lr·√(1-β2ᵗ)/(1-β1ᵗ) with bias correction, else lr
    w ← w - lr·λ·w
SGD: w ← w - lr·g.
SGD with momentum (torch.optim.SGD; μ momentum, τ dampening, λ weight decay):
    d ← g + λ·w;  b ← d on the first step, else μ·b + (1-τ)·d
    w ← w - lr·(d + μ·b) with Nesterov, else w ← w - lr·b

Each update is elementwise: its `_parts` twin runs it on parts of the buffers (kernels/parallel_split.py) in one
parallel region, every value as in the serial loop.
"""
from __future__ import annotations

import math

import numpy as np

from .jit import intrinsic, njit, prange, types
from .parallel_split import parallel_twin, twin_of


@njit(cache=True, error_model="numpy", inline="always")
def adam_step_size(lr, beta1, beta2, step, bias_correction):
    """The learning rate with Adam's bias correction of both moments folded in, when asked for."""
    if not bias_correction:
        return lr
    return lr * math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)


@njit(cache=True, error_model="numpy")
def adamw_update(w, g, m, v, lr, beta1, beta2, eps, weight_decay, step, bias_correction):
    step_size = adam_step_size(lr, beta1, beta2, step, bias_correction)
    one_minus_beta1 = np.float32(1.0 - beta1)
    one_minus_beta2 = np.float32(1.0 - beta2)
    b1 = np.float32(beta1)
    b2 = np.float32(beta2)
    size = np.float32(step_size)
    e = np.float32(eps)
    decay = np.float32(lr * weight_decay)
    tiny = np.float32(1.1754944e-38)  # the smallest normal float32
    zero = np.float32(0.0)
    for i in range(w.size):
        gi = g[i]
        mi = b1 * m[i] + one_minus_beta1 * gi
        vi = b2 * v[i] + one_minus_beta2 * gi * gi
        # Decaying moments would go subnormal, and subnormal arithmetic is many times slower on
        # most CPUs; below the normal range they are flushed to zero (their update is < 1e-32). NaN
        # compares false and stays. Written as a choice of zero, this loop vectorises, where `mi * 0`
        # ran it at less than half the speed (bench_ops.OptimizerOps).
        mi = zero if abs(mi) < tiny else mi
        vi = zero if vi < tiny else vi
        m[i] = mi
        v[i] = vi
        wi = w[i] - size * mi / (np.sqrt(vi) + e)
        if decay != 0:
            wi = wi - decay * wi
        w[i] = wi


@njit(cache=True, error_model="numpy")
def sgd_update(w, g, lr):
    rate = np.float32(lr)
    for i in range(w.size):
        w[i] -= rate * g[i]


@njit(cache=True, error_model="numpy")
def sgd_momentum_update(w, g, b, lr, momentum, dampening, weight_decay, nesterov, first_step):
    rate = np.float32(lr)
    mu = np.float32(momentum)
    keep = np.float32(1.0 - dampening)
    decay = np.float32(weight_decay)
    for i in range(w.size):
        d = g[i]
        if decay != 0:
            d = d + decay * w[i]
        if mu != 0:
            bi = d if first_step else mu * b[i] + keep * d
            b[i] = bi
            d = d + mu * bi if nesterov else bi
        w[i] -= rate * d


adamw_update_parts = parallel_twin(adamw_update, sliced=("w", "g", "m", "v"))
sgd_update_parts = parallel_twin(sgd_update, sliced=("w", "g"))
sgd_momentum_update_parts = parallel_twin(sgd_momentum_update, sliced=("w", "g", "b"))


@njit(cache=True, error_model="numpy")
def add_into(dst, src):
    """dst ← dst + src: gradient accumulation across steps."""
    for i in range(dst.size):
        dst[i] += src[i]


@njit(cache=True, error_model="numpy")
def copy_into(dst, src):
    """dst ← src."""
    for i in range(dst.size):
        dst[i] = src[i]


@njit(cache=True, error_model="numpy")
def assert_finite(values):
    """Raise FloatingPointError if any value is NaN or infinite."""
    for i in range(values.size):
        if not np.isfinite(values[i]):
            raise FloatingPointError("a NaN or infinity appeared in the loss; the step stopped before backward")


# ---- AdamW with 8-bit moments ----------------------------------------------------------------------------
# Each moment is stored as one byte per value, an index into a 256-entry code map, and one float32 absmax per
# block of values: value = map[code] · absmax. The maps are dynamic (bitsandbytes' dynamic quantization): for each
# of 7 decades 10^-6 .. 10^0 the interval [0.1, 1) of that decade is cut into equal pieces whose midpoints are
# codes, more pieces in the larger decades, plus 0 and 1; the first moment's map is signed (2^i pieces in decade
# i, both signs), the second's unsigned (2^(i+1) pieces). Relative precision is then about even over six decades.
# A step dequantizes a block, updates the weights from the float moments (as adamw_update), takes the block's new
# absmax and requantizes each moment to its nearest code. The moments are computed twice (once for the absmax)
# instead of being kept: the update needs no working memory.


def dynamic_code_map(signed: bool) -> np.ndarray:
    """The 256 sorted float32 codes of a dynamic map on [-1, 1] (signed) or [0, 1]."""
    codes = [0.0, 1.0]
    for decade in range(7):
        pieces = 2 ** decade if signed else 2 ** (decade + 1)
        edges = np.linspace(0.1, 1.0, pieces + 1)
        middles = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (decade - 6)
        codes += list(middles) + (list(-middles) if signed else [])
    return np.sort(np.array(codes, np.float32))


def code_table(codes: np.ndarray) -> np.ndarray:
    """The nearest-code search as a table on the upper 16 bits of a float32 (sign, exponent, 7 mantissa bits):
    float32 [65536, 2] of (the code nearest the lowest value with those bits, the smallest float32 nearer the
    next code). Values sharing those bits span at most 2^-7 of their size, less than the maps' gaps, so at
    most one midpoint between codes falls among them: the nearest code of x is entry 0 + (x >= entry 1)."""
    upper = np.arange(1 << 16, dtype=np.uint32) << 16
    negative = (upper >> 31).astype(bool)
    with np.errstate(invalid="ignore"):  # the NaN patterns
        lowest = np.where(negative, upper | 0xFFFF, upper).view(np.float32).astype(np.float64)
        highest = np.where(negative, upper, upper | 0xFFFF).view(np.float32).astype(np.float64)
    finite = np.isfinite(lowest) & np.isfinite(highest)
    lowest, highest = np.where(finite, lowest, 0.0), np.where(finite, highest, 0.0)
    wide = codes.astype(np.float64)
    middles = np.append((wide[:-1] + wide[1:]) / 2, np.inf)  # middles[i]: between code i and code i + 1
    nearest = np.searchsorted(middles, lowest, side="left")  # the first middle >= lowest: ties go down
    split = middles[nearest]
    assert np.all(middles[np.minimum(nearest + 1, codes.size - 1)] > highest), "two middles in one bucket"
    threshold = split.astype(np.float32)
    threshold = np.where(threshold < split, np.nextafter(threshold, np.float32(np.inf)), threshold)
    return np.stack([nearest.astype(np.float32), threshold.astype(np.float32)], axis=1)


CODE_MAPS = np.stack([dynamic_code_map(True), dynamic_code_map(False)])  # the first moment's, the second's
CODE_TABLES = np.stack([code_table(codes) for codes in CODE_MAPS])


@intrinsic
def _float_bits(typingctx, x):
    """The bits of a float32 as a uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        from numba.core import cgutils

        return builder.bitcast(args[0], cgutils.ir.IntType(32))

    return types.uint32(types.float32), codegen


@njit(cache=True, error_model="numpy", inline="always")
def _nearest_code(table, x):
    """The index of the code nearest x (a tie goes to the lower code), from `table` (code_table's)."""
    x = np.float32(x)
    entry = _float_bits(x) >> 16
    return np.int64(table[entry, 0]) + (x >= table[entry, 1])


@njit(cache=True, error_model="numpy", inline="always")
def _moments8(g, m_codes, v_codes, code_maps, m_scale, v_scale, b1, b2, one_minus_beta1,
              one_minus_beta2, tiny, i):
    gi = g[i]
    mi = b1 * (code_maps[0, m_codes[i]] * m_scale) + one_minus_beta1 * gi
    vi = b2 * (code_maps[1, v_codes[i]] * v_scale) + one_minus_beta2 * gi * gi
    return (np.float32(0.0) if abs(mi) < tiny else mi), (np.float32(0.0) if vi < tiny else vi)


@njit(cache=True, error_model="numpy")
def adamw8_update(w, g, m_codes, v_codes, m_absmax, v_absmax, code_maps, code_tables, starts, lr, beta1, beta2,
                  eps, weight_decay, step, bias_correction):
    """adamw_update on moments quantized in blocks [starts[j], starts[j + 1]) with absmax m_absmax[j], v_absmax[j]."""
    step_size = adam_step_size(lr, beta1, beta2, step, bias_correction)
    one_minus_beta1, one_minus_beta2 = np.float32(1.0 - beta1), np.float32(1.0 - beta2)
    b1, b2, size, e = np.float32(beta1), np.float32(beta2), np.float32(step_size), np.float32(eps)
    decay = np.float32(lr * weight_decay)
    tiny = np.float32(1.1754944e-38)
    for j in range(starts.size - 1):
        lo, hi = starts[j], starts[j + 1]
        m_scale, v_scale = m_absmax[j], v_absmax[j]
        m_top, v_top = np.float32(0.0), np.float32(0.0)
        for i in range(lo, hi):
            mi, vi = _moments8(g, m_codes, v_codes, code_maps, m_scale, v_scale, b1, b2,
                               one_minus_beta1, one_minus_beta2, tiny, i)
            m_top, v_top = max(m_top, abs(mi)), max(v_top, vi)
        m_inverse = np.float32(1.0) / m_top if m_top > 0 else np.float32(0.0)
        v_inverse = np.float32(1.0) / v_top if v_top > 0 else np.float32(0.0)
        for i in range(lo, hi):
            mi, vi = _moments8(g, m_codes, v_codes, code_maps, m_scale, v_scale, b1, b2,
                               one_minus_beta1, one_minus_beta2, tiny, i)
            wi = w[i] - size * mi / (np.sqrt(vi) + e)
            if decay != 0:
                wi = wi - decay * wi
            w[i] = wi
            m_codes[i] = _nearest_code(code_tables[0], mi * m_inverse)
            v_codes[i] = _nearest_code(code_tables[1], vi * v_inverse)
        m_absmax[j], v_absmax[j] = m_top, v_top


@twin_of(adamw8_update, because="a part's block starts overlap its neighbour's by one (starts[a:b + 1])")
@njit(cache=True, error_model="numpy", parallel=True)
def adamw8_update_parts(w, g, m_codes, v_codes, m_absmax, v_absmax, code_maps, code_tables, starts, lr, beta1,
                        beta2, eps, weight_decay, step, bias_correction, bounds):
    """adamw8_update on parts of the blocks."""
    for p in prange(bounds.size - 1):
        a, b = bounds[p], bounds[p + 1]
        adamw8_update(w, g, m_codes, v_codes, m_absmax[a:b], v_absmax[a:b], code_maps, code_tables,
                      starts[a:b + 1], lr, beta1, beta2, eps, weight_decay, step, bias_correction)


@njit(cache=True, error_model="numpy")
def quantize_blocks(values, starts, table, codes, absmax):
    """codes, absmax ← values quantized in blocks [starts[j], starts[j + 1]) to the nearest code · absmax (`table`:
    code_table's of the map)."""
    for j in range(starts.size - 1):
        top = np.float32(0.0)
        for i in range(starts[j], starts[j + 1]):
            top = max(top, abs(values[i]))
        inverse = np.float32(1.0) / top if top > 0 else np.float32(0.0)
        for i in range(starts[j], starts[j + 1]):
            codes[i] = _nearest_code(table, values[i] * inverse)
        absmax[j] = top


@njit(cache=True, error_model="numpy")
def dequantize_blocks(codes, absmax, starts, code_map, values):
    """values ← code_map[codes] · absmax of each block."""
    for j in range(starts.size - 1):
        for i in range(starts[j], starts[j + 1]):
            values[i] = code_map[codes[i]] * absmax[j]
