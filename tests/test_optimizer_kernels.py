"""The AdamW update kernel bound directly: against the formula in float64 (ONNX Runtime's AdamW with bias
correction and decoupled decay), moments below float32's normal range flushed to zero, NaN carried through,
and the parallel parts giving the serial loop's bits.

Tolerance: one float32 update against float64 differs by up to 2e-9 (w near zero) or a few units in the last
place; 1e-8 absolute and 1e-6 relative fail a 1% change of the learning rate or a beta (updates of ~1e-3).
"""
import math

import numpy as np

from odtrain.kernels.optim import (CODE_MAPS, CODE_TABLES, adamw8_update, adamw8_update_parts, adamw_update,
                                   adamw_update_parts, dequantize_blocks, dynamic_code_map, quantize_blocks)
from odtrain.kernels.parallel_split import part_bounds

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
    adamw_update_parts(*parallel, LR, BETA1, BETA2, EPS, DECAY, STEP, True, part_bounds(parallel[0].size, 2))
    for a, b in zip(serial, parallel):
        assert np.array_equal(a, b)


# ---- 8-bit moments ------------------------------------------------------------------------------------------

def test_dynamic_code_maps():
    """256 sorted distinct codes each, 0 and 1 among them; the first moment's map signed (its negative codes
    mirror the positive ones but 1), the second's on [0, 1]; six decades below 1 get codes."""
    for signed in (True, False):
        codes = dynamic_code_map(signed)
        assert codes.dtype == np.float32 and codes.size == 256 and np.all(np.diff(codes) > 0)
        assert {0.0, 1.0} <= set(codes.tolist())
        positive = codes[(codes > 0) & (codes < 1)]
        assert positive.min() < 1e-6 and (positive.size == 127 if signed else positive.size == 254)
        if signed:
            np.testing.assert_array_equal(-codes[codes < 0][::-1], positive)
        else:
            assert codes.min() == 0


def quantized(values, starts, signed):
    codes, absmax = np.zeros(values.size, np.uint8), np.zeros(starts.size - 1, np.float32)
    row = 0 if signed else 1
    quantize_blocks(values, starts, CODE_TABLES[row], codes, absmax)
    return codes, absmax


def dequantized(codes, absmax, starts, signed):
    values = np.zeros(codes.size, np.float32)
    dequantize_blocks(codes, absmax, starts, CODE_MAPS[0 if signed else 1], values)
    return values


def test_adamw8_updates_from_the_dequantized_moments_and_stores_their_nearest_codes():
    """One step on 8-bit moments in blocks of 2048 (the last of 3): the weights move as the formula says for the
    dequantized moments (the float32 tolerance above: a 1% learning rate fails), each block's absmax becomes the
    new moments' largest magnitude, and each code is the nearest of the 256 to the new moment over that absmax."""
    w, g, m, v = state()
    v *= 1e-3
    starts = np.array([0, 2048, 4096, 4099], np.int64)
    m_codes, m_absmax = quantized(m, starts, True)
    v_codes, v_absmax = quantized(v, starts, False)
    expected_w, expected_m, expected_v = formula(w, g, dequantized(m_codes, m_absmax, starts, True),
                                                 dequantized(v_codes, v_absmax, starts, False))
    adamw8_update(w, g, m_codes, v_codes, m_absmax, v_absmax, CODE_MAPS, CODE_TABLES, starts, LR, BETA1, BETA2, EPS,
                  DECAY, STEP, True)
    np.testing.assert_allclose(w, expected_w, rtol=1e-6, atol=1e-8)
    for codes, absmax, expected, code_map in ((m_codes, m_absmax, expected_m, CODE_MAPS[0]),
                                              (v_codes, v_absmax, expected_v, CODE_MAPS[1])):
        top = np.array([np.abs(expected[a:b]).max() for a, b in zip(starts[:-1], starts[1:])])
        np.testing.assert_allclose(absmax, top, rtol=1e-6)
        scaled = expected / np.repeat(top, np.diff(starts))
        nearest = np.abs(scaled[:, None] - code_map[None, :].astype(np.float64)).argmin(axis=1)
        assert np.mean(codes == nearest) > 0.999  # ties and float32 rounding at a midpoint aside


def test_adamw8_parts_give_the_serial_bits():
    w, g, m, v = state(size=5 * 2048 + 7, seed=2)
    starts = np.append(np.arange(0, w.size, 2048), w.size).astype(np.int64)
    serial = [w.copy(), *quantized(m, starts, True), *quantized(np.abs(v), starts, False)]
    split = [a.copy() for a in serial]
    halves = part_bounds(starts.size - 1, 2)
    for args, kernel, extra in ((serial, adamw8_update, ()), (split, adamw8_update_parts, (halves,))):
        weights, m_codes, m_absmax, v_codes, v_absmax = args
        kernel(weights, g, m_codes, v_codes, m_absmax, v_absmax, CODE_MAPS, CODE_TABLES, starts, LR, BETA1, BETA2, EPS,
               DECAY, STEP, True, *extra)
    for a, b in zip(serial, split):
        np.testing.assert_array_equal(a, b)


def test_the_nearest_code_is_found_from_the_upper_bits():
    """quantize_blocks' code search (a table entry by the float's upper 16 bits, then one comparison) against a
    brute-force nearest code: every code, every midpoint between codes and its float32 neighbours, and random
    values over six decades, in one block of absmax 1."""
    rng = np.random.default_rng(3)
    for row, code_map in enumerate(CODE_MAPS):
        middles = (code_map[:-1].astype(np.float64) + code_map[1:]) / 2
        values = np.concatenate([code_map, middles, np.nextafter(middles.astype(np.float32), 2),
                                 np.nextafter(middles.astype(np.float32), -2), rng.uniform(-1, 1, 20000),
                                 np.exp(rng.uniform(-16, 0, 20000)) * rng.choice([-1, 1], 20000), [1.0]])
        values = (np.abs(values) if row else values).astype(np.float32)
        codes, absmax = np.zeros(values.size, np.uint8), np.zeros(1, np.float32)
        quantize_blocks(values, np.array([0, values.size], np.int64), CODE_TABLES[row], codes, absmax)
        assert absmax[0] == 1
        distance = np.abs(values[:, None].astype(np.float64) - code_map[None, :])
        chosen = distance[np.arange(values.size), codes]
        np.testing.assert_array_equal(chosen, distance.min(axis=1))  # the nearest, ties either way
