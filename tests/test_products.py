"""Matrix-product kernels bound directly: attention's batched per-head products against numpy's einsum,
split across Numba's threads only where each product has an output matrix of its own, with the same bits
at any thread count; a bias added inside the product (beta = 1) against numpy.

Oracles: numpy (einsum, matmul, broadcasting) in float64.
"""
import numba
import numpy as np
import pytest

from odtrain.kernels import BINDINGS
from odtrain.kernels.linalg import SMALL_PRODUCT, _gemm_batched, _gemm_batched_parallel

ODTRAIN = "ai.odtrain"
BATCH, SEQ, HEADS, DIM = 3, 8, 2, 4


def run(calls):
    for kernel, args in calls:
        kernel(*args)


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def bind(op, inputs, out_shape, **attrs):
    out = np.full(out_shape, np.nan, np.float32)
    return BINDINGS[(ODTRAIN if op == "FusedMatMul" else "", op)](inputs, [out], **attrs), out


def attention_scores():
    """S[b, h] = α · Q[b, :, h] · K[b, :, h]ᵀ with Q, K stored [b, s, h, d] (the heads read in place)."""
    q, k = rand(BATCH, SEQ, HEADS, DIM), rand(BATCH, SEQ, HEADS, DIM, seed=1)
    calls, out = bind("FusedMatMul", [q, k], (BATCH, HEADS, SEQ, SEQ), alpha=0.5, permA=[0, 2, 1, 3],
                      permB=[0, 2, 3, 1])
    expected = 0.5 * np.einsum("bshd,bthd->bhst", q.astype(np.float64), k.astype(np.float64))
    return calls, out, expected


def test_per_head_products_run_in_parallel_and_match_numpy():
    calls, out, expected = attention_scores()
    assert [kernel for kernel, _ in calls] == [_gemm_batched_parallel]
    run(calls)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_merged_heads_are_written_in_place_in_parallel():
    """O[b, s, h] = P[b, h] · V[b, :, h], stored with the heads merged ([b, s, h, d], permY)."""
    p, v = rand(BATCH, HEADS, SEQ, SEQ), rand(BATCH, SEQ, HEADS, DIM, seed=1)
    calls, out = bind("FusedMatMul", [p, v], (BATCH, SEQ, HEADS, DIM), permB=[0, 2, 1, 3], permY=[0, 2, 1, 3])
    assert [kernel for kernel, _ in calls] == [_gemm_batched_parallel]
    run(calls)
    np.testing.assert_allclose(out, np.einsum("bhst,bthd->bshd", p.astype(np.float64), v.astype(np.float64)),
                               rtol=1e-5, atol=1e-5)


def test_products_summed_into_one_output_stay_serial():
    """dB of a B broadcast over the batch: every product adds into the same matrix."""
    a, dy = rand(BATCH, SEQ, DIM), rand(BATCH, SEQ, 5, seed=1)
    b = np.zeros((DIM, 5), np.float32)
    calls, out = bind("FusedMatMul", [a, dy, b], b.shape, transA=1)
    run(calls)
    np.testing.assert_allclose(out, np.einsum("bsi,bsj->ij", a.astype(np.float64), dy), rtol=1e-5, atol=1e-5)
    a4, dy4 = rand(2, BATCH, SEQ, DIM), rand(2, BATCH, SEQ, 5, seed=1)  # summed over the leading axis only
    like = np.zeros((BATCH, DIM, 5), np.float32)
    calls, out = bind("FusedMatMul", [a4, dy4, like], like.shape, transA=1)
    assert [kernel for kernel, _ in calls] == [_gemm_batched]
    run(calls)
    np.testing.assert_allclose(out, np.einsum("absi,absj->bij", a4.astype(np.float64), dy4), rtol=1e-5, atol=1e-5)


def test_large_products_keep_blas_threads():
    side = round(SMALL_PRODUCT ** (1 / 3)) + 1  # m·n·k just above the size OpenBLAS keeps on one thread
    a, b = rand(2, side, side), rand(2, side, side, seed=1)
    calls, out = bind("MatMul", [a, b], (2, side, side))
    assert [kernel for kernel, _ in calls] == [_gemm_batched]


def test_the_bits_do_not_depend_on_the_thread_count():
    calls, out, _ = attention_scores()
    results = []
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            out[...] = np.nan
            run(calls)
            results.append(out.copy())
    finally:
        numba.set_num_threads(before)
    assert all(np.array_equal(r, results[0]) for r in results)


@pytest.mark.parametrize("bias_shape", [(5,), (SEQ, 1), (BATCH, SEQ, 5)])
def test_a_bias_starts_the_output_and_blas_adds_the_product(bias_shape):
    x, w, bias = rand(BATCH, SEQ, DIM), rand(5, DIM, seed=1), rand(*bias_shape, seed=2)
    calls, out = bind("FusedMatMul", [x, w, None, bias], (BATCH, SEQ, 5), transB=1)
    run(calls)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64) + bias, rtol=1e-5, atol=1e-5)
