"""Matrix-product kernels bound directly: attention's batched per-head products against numpy's einsum,
split into whole products (even fewer than the threads) only where each product has an output matrix of
its own, with the same bits at any thread count; a bias added inside the product (beta = 1) against numpy.

Oracles: numpy (einsum, matmul, broadcasting) in float64.
"""
import numba
import numpy as np
import pytest

from odtrain.kernels import BINDINGS
from odtrain.kernels.blas import COLUMNS, ROWS, gemm_batched_parts
from odtrain.kernels.linalg import MIN_PARALLEL_PRODUCT, SMALL_PRODUCT, _gemm_batched

ODTRAIN = "ai.odtrain"
# per-head products of SEQ·SEQ·DIM = SMALL_PRODUCT / 4 multiply-adds, MIN_PARALLEL_PRODUCT in all
BATCH, SEQ, HEADS, DIM = 8, 64, 2, 16
THREADS = 32  # more than the BATCH · HEADS products: split by products all the same


def run(calls):
    for kernel, args in calls:
        kernel(*args)


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def bind(op, inputs, out_shape, **attrs):
    out = np.full(out_shape, np.nan, np.float32)
    return BINDINGS[(ODTRAIN if op == "FusedMatMul" else "", op)](inputs, [out], **attrs), out


def split_by(calls) -> str:
    """How a product's one call runs: "serial", "products" (whole products per part), "rows" or "columns"."""
    (kernel, args), = calls
    if kernel is _gemm_batched:
        return "serial"
    assert kernel is gemm_batched_parts
    return {ROWS: "rows", COLUMNS: "columns"}.get(args[-2], "products")


def attention_scores(threads=THREADS):
    """S[b, h] = α · Q[b, :, h] · K[b, :, h]ᵀ with Q, K stored [b, s, h, d] (the heads read in place)."""
    q, k = rand(BATCH, SEQ, HEADS, DIM), rand(BATCH, SEQ, HEADS, DIM, seed=1)
    calls, out = bind("FusedMatMul", [q, k], (BATCH, HEADS, SEQ, SEQ), alpha=0.5, permA=[0, 2, 1, 3],
                      permB=[0, 2, 3, 1], threads=threads)
    expected = 0.5 * np.einsum("bshd,bthd->bhst", q.astype(np.float64), k.astype(np.float64))
    return calls, out, expected


def test_per_head_products_run_in_parallel_and_match_numpy():
    calls, out, expected = attention_scores()
    assert split_by(calls) == "products"
    run(calls)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_merged_heads_are_written_in_place_in_parallel():
    """O[b, s, h] = P[b, h] · V[b, :, h], stored with the heads merged ([b, s, h, d], permY)."""
    p, v = rand(BATCH, HEADS, SEQ, SEQ), rand(BATCH, SEQ, HEADS, DIM, seed=1)
    calls, out = bind("FusedMatMul", [p, v], (BATCH, SEQ, HEADS, DIM), permB=[0, 2, 1, 3], permY=[0, 2, 1, 3],
                      threads=THREADS)
    assert split_by(calls) == "products"
    run(calls)
    np.testing.assert_allclose(out, np.einsum("bhst,bthd->bshd", p.astype(np.float64), v.astype(np.float64)),
                               rtol=1e-5, atol=1e-5)


def test_products_summed_into_one_output_stay_serial():
    """dB of a B broadcast over the batch: every product adds into the same matrix."""
    a, dy = rand(BATCH, SEQ, DIM), rand(BATCH, SEQ, 5, seed=1)
    b = np.zeros((DIM, 5), np.float32)
    calls, out = bind("FusedMatMul", [a, dy, b], b.shape, transA=1, threads=THREADS)
    run(calls)
    np.testing.assert_allclose(out, np.einsum("bsi,bsj->ij", a.astype(np.float64), dy), rtol=1e-5, atol=1e-5)
    a4, dy4 = rand(2, BATCH, SEQ, DIM), rand(2, BATCH, SEQ, 5, seed=1)  # summed over the leading axis only
    like = np.zeros((BATCH, DIM, 5), np.float32)
    calls, out = bind("FusedMatMul", [a4, dy4, like], like.shape, transA=1, threads=THREADS)
    assert split_by(calls) != "products"
    run(calls)
    np.testing.assert_allclose(out, np.einsum("absi,absj->bij", a4.astype(np.float64), dy4), rtol=1e-5, atol=1e-5)


def test_fewer_large_products_than_threads_split_their_rows():
    # m·n·k above the size OpenBLAS keeps on one thread, and the two products worth a parallel region
    side = max(round(SMALL_PRODUCT ** (1 / 3)) + 1, round((MIN_PARALLEL_PRODUCT / 2) ** (1 / 3)) + 1)
    a, b = rand(2, side, side), rand(2, side, side, seed=1)
    calls, out = bind("MatMul", [a, b], (2, side, side), threads=THREADS)
    assert split_by(calls) == "rows"
    run(calls)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_a_wide_product_splits_its_columns(trans_b):
    """[64×784]·[784×500], an MLP layer's forward (Gemm with transB: the weights stored [out, in])."""
    x, w = rand(64, 784), rand(500, 784, seed=1)
    b = w if trans_b else np.ascontiguousarray(w.T)
    calls, out = bind("Gemm", [x, b], (64, 500), transB=trans_b, threads=THREADS)
    assert split_by(calls) == "columns"
    run(calls)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)
    calls, out = bind("Gemm", [rand(128, 784), w[:100]], (128, 100), transB=1, threads=THREADS)
    assert split_by(calls) == "rows"  # taller than wide


def test_the_bits_do_not_depend_on_the_thread_count():
    serial, serial_out, _ = attention_scores(threads=1)
    assert split_by(serial) == "serial"
    run(serial)
    calls, out, _ = attention_scores()
    results = [serial_out]
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


ROUTE_CHECK = """
import numpy as np
from odtrain.kernels import blas
from odtrain.kernels.jit import load
load()  # Numba's objects in the kernel modules, the products' symbols registered
from odtrain.kernels.blas import blas_gemm
from numba import njit

@njit
def gemm(trans_a, trans_b, m, n, k, alpha, a, a_off, lda, b, b_off, ldb, beta, c, c_off, ldc):
    blas_gemm(trans_a, trans_b, m, n, k, alpha, a, a_off, lda, b, b_off, ldb, beta, c, c_off, ldc)

rng = np.random.default_rng(0)
worst = 0.0
for dtype in (np.float32, np.float64):
    for trans_a in (0, 1):
        for trans_b in (0, 1):
            m, n, k = 7, 33, 19
            a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
            b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
            # operands at an offset inside a wider buffer: lda, ldb and ldc above the matrices' widths
            a_buffer = np.zeros(3 + a.shape[0] * (a.shape[1] + 2), dtype)
            a_buffer[3:].reshape(a.shape[0], a.shape[1] + 2)[:, :a.shape[1]] = a
            b_buffer = np.zeros(5 + b.shape[0] * (b.shape[1] + 1), dtype)
            b_buffer[5:].reshape(b.shape[0], b.shape[1] + 1)[:, :b.shape[1]] = b
            c = rng.standard_normal((m, n + 4)).astype(dtype)
            start = c.copy()
            gemm(trans_a, trans_b, m, n, k, 0.5, a_buffer, 3, a.shape[1] + 2, b_buffer, 5, b.shape[1] + 1, 2.0,
                 c.reshape(-1), 0, n + 4)
            op_a = a.T if trans_a else a
            op_b = b.T if trans_b else b
            expected = 0.5 * op_a.astype(np.float64) @ op_b.astype(np.float64) + 2.0 * start[:, :n]
            worst = max(worst, float(np.abs(c[:, :n] - expected).max()))
            assert np.array_equal(c[:, n:], start[:, n:]), "wrote outside the product"
print(blas.GEMM_LIBRARY)
print(worst)
"""


@pytest.mark.parametrize("route", ["default", "numba"])
def test_both_blas_routes_compute_row_major_products_at_offsets(route):
    """Every transpose combination, alpha and beta, operands at offsets with wide leading dimensions, on
    numpy's OpenBLAS where numpy carries one and on Numba's route to scipy's BLAS (ODTRAIN_GEMM=numba), in
    a fresh process each: the route is chosen once per process."""
    import os
    import subprocess
    import sys

    environment = dict(os.environ)
    environment.pop("ODTRAIN_GEMM", None)
    if route == "numba":
        environment["ODTRAIN_GEMM"] = "numba"
    result = subprocess.run([sys.executable, "-c", ROUTE_CHECK], capture_output=True, text=True, env=environment,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    library, worst = result.stdout.split("\n")[-3:-1]
    if route == "numba":
        assert "Numba" in library
    elif _numpy_carries_openblas():
        assert library.startswith("numpy's OpenBLAS")
    assert float(worst) < 1e-4  # float32 sums of 19 products of normals: about 1e-6 each


def _numpy_carries_openblas() -> bool:
    """Whether numpy's wheel bundles its 64-bit OpenBLAS (scipy-openblas64), as on Linux x86-64 and aarch64."""
    import numpy

    blas = numpy.show_config(mode="dicts")["Build Dependencies"]["blas"]
    return blas.get("name") == "scipy-openblas" and "64" in str(blas.get("openblas configuration", ""))


def test_a_step_runs_blas_on_one_thread_and_gives_the_program_its_count_back():
    from odtrain.kernels import blas

    route = blas.product_threads()
    if route.get_threads is None:
        pytest.skip(f"the products call {blas.GEMM_LIBRARY}, whose threads odtrain sets once per process")
    program = route.get_threads()
    route.set_threads(2)
    try:
        blas.hold_one_thread()
        blas.hold_one_thread()  # a second module's step overlapping the first
        assert route.get_threads() == 1
        blas.release_thread()
        assert route.get_threads() == 1  # the other step still runs
        blas.release_thread()
        assert route.get_threads() == 2
    finally:
        route.set_threads(program)


@pytest.mark.parametrize("trans_a, trans_b, m, n, k, columns", [
    (0, 0, 16, 1000, 144, 432),  # a convolution's forward: blocks of 432 columns (16·432·144 <= 100³)
    (1, 0, 16, 1000, 144, 432),  # its input gradient (Wᵀ · dY)
    (0, 1, 64, 500, 784, 16),  # an MLP layer with weights [out, in]: [64 × 16] blocks for the TN kernels
    (0, 1, 128, 500, 784, 500),  # taller: whole
    (1, 1, 16, 1000, 144, 1000),  # both transposed: no small kernels, whole
    (0, 0, 64, 256, 576, 256),  # blocks would be narrower than 32 columns: whole
])
def test_products_in_blocks_give_the_whole_product(trans_a, trans_b, m, n, k, columns):
    """gemm_in_blocks at OpenBLAS's small-kernel bound (whatever kernels this CPU's OpenBLAS chose), on
    operands inside larger arrays (offsets, leading dimensions): the blocks it cuts, and the product
    against numpy and against the product whole; beta = 1 adds to what the output held. Tolerance: a
    float32 sum of k products against float64, 1e-6 of Σ|a·b| (measured up to 3e-8 of it)."""
    from odtrain.kernels.blas import block_columns, gemm_in_blocks

    assert block_columns(100 ** 3, trans_a, trans_b, m, n, k, 4) == columns
    assert block_columns(0, trans_a, trans_b, m, n, k, 4) == n
    assert block_columns(100 ** 3, trans_a, trans_b, m, n, k, 8) == n  # float64: whole

    @numba.njit
    def blocks(a, b, c, a_off, lda, b_off, ldb, c_off, ldc, cells):
        gemm_in_blocks(cells, trans_a, trans_b, m, n, k, 0.5, a, a_off, lda, b, b_off, ldb, 1.0, c, c_off, ldc)

    rng = np.random.default_rng(m + n + k)
    op_a = rng.standard_normal((m, k)).astype(np.float32)
    op_b = rng.standard_normal((k, n)).astype(np.float32)
    stored_a = np.ascontiguousarray(op_a.T) if trans_a else op_a
    stored_b = np.ascontiguousarray(op_b.T) if trans_b else op_b
    pad = 3  # each matrix sits in a wider array, 3 elements in
    a = np.zeros((stored_a.shape[0], stored_a.shape[1] + pad), np.float32)
    b = np.zeros((stored_b.shape[0], stored_b.shape[1] + pad), np.float32)
    a[:, pad:], b[:, pad:] = stored_a, stored_b
    c = np.zeros((m, n + pad), np.float32)
    c[:, pad:] = 1.0
    args = (a.reshape(-1), b.reshape(-1), c.reshape(-1), pad, a.shape[1], pad, b.shape[1], pad, c.shape[1])
    blocks(*args, 100 ** 3)
    expected = 1.0 + 0.5 * op_a.astype(np.float64) @ op_b.astype(np.float64)
    bound = 1e-6 * (0.5 * np.abs(op_a).astype(np.float64) @ np.abs(op_b)).max()
    assert np.abs(c[:, pad:] - expected).max() <= bound
    assert np.all(c[:, :pad] == 0)
    whole = np.zeros_like(c)
    whole[:, pad:] = 1.0
    blocks(a.reshape(-1), b.reshape(-1), whole.reshape(-1), *args[3:], 0)
    assert np.abs(c - whole).max() <= bound
