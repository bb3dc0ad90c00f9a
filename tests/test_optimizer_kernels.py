"""The AdamW update kernel bound directly: against the formula in float64 (ONNX Runtime's AdamW with bias
correction and decoupled decay), moments below float32's normal range flushed to zero, NaN carried through,
and the parallel parts giving the serial loop's bits.

Tolerance: one float32 update against float64 differs by up to 2e-9 (w near zero) or a few units in the last
place; 1e-8 absolute and 1e-6 relative fail a 1% change of the learning rate or a beta (updates of ~1e-3).
"""
import math

import numpy as np

from odtrain.kernels.optim import adamw_update, adamw_update_parts

LR, BETA1, BETA2, EPS, DECAY, STEP = 1e-3, 0.9, 0.999, 1e-6, 0.01, 3


def state(size=4099, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) for _ in range(3)] + [
        rng.random(size).astype(np.float32)]


def formula(w, g, m, v):
    w, g, m, v = (a.astype(np.float64) for a in (w, g, m, v))
    m = BETA1 * m + (1 - BETA1) * g
    v = BETA2 * v + (1 - BETA2) * g * g
    size = LR * math.sqrt(1 - BETA2 ** STEP) / (1 - BETA1 ** STEP)
    w = w - size * m / (np.sqrt(v) + EPS)
    return w - LR * DECAY * w, m, v


def test_adamw_matches_the_formula():
    w, g, m, v = state()
    expected = formula(w, g, m, v)
    adamw_update(w, g, m, v, LR, BETA1, BETA2, EPS, DECAY, STEP, True)
    for got, want in zip((w, m, v), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def test_subnormal_moments_flush_to_zero_and_nan_stays():
    w, g, m, v = (np.zeros(4, np.float32) for _ in range(4))
    w[:] = 1.0
    m[:2] = 1e-38  # decays to 9e-39 (subnormal) and is flushed
    v[:2] = 1e-38
    g[2] = np.nan
    adamw_update(w, g, m, v, LR, BETA1, BETA2, EPS, 0.0, STEP, True)
    assert m[0] == 0 and v[0] == 0 and m[1] == 0 and v[1] == 0
    assert np.isnan(m[2]) and np.isnan(v[2]) and np.isnan(w[2])
    assert w[0] == 1.0 and w[3] == 1.0


def test_parts_give_the_serial_bits():
    serial, parallel = state(seed=1), state(seed=1)
    adamw_update(*serial, LR, BETA1, BETA2, EPS, DECAY, STEP, True)
    adamw_update_parts(*parallel, LR, BETA1, BETA2, EPS, DECAY, STEP, True, 2)
    for a, b in zip(serial, parallel):
        assert np.array_equal(a, b)
