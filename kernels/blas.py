"""The one BLAS entry point of the kernels: a general matrix product on arrays at element offsets.

`blas_gemm` is row-major ?gemm with the transpose flags, leading dimensions, offsets, alpha and beta
that `np.dot` does not expose. Compiled code calls it through two symbols of ours, `odtrain_cblas_sgemm`
and `odtrain_cblas_dgemm`, with the ABI of OpenBLAS's 64-bit-integer CBLAS (`cblas_?gemm` with int64
sizes). Which library stands behind them is decided once per process, when this module is imported,
before any kernel is compiled or loaded from Numba's cache (cached code names the symbols, never an
address, so a cache stays valid whichever library the next process finds):

- numpy's own OpenBLAS (the `scipy_openblas64_` that numpy's wheels bundle), when numpy carries one.
  It is a newer OpenBLAS than scipy's and faster on the thin products of convolutions, at one thread
  (`ODTRAIN_GEMM=numba` against the default in bench_ops.ConvOps and ProductOps);
- otherwise (numpy built against another BLAS, Accelerate, MKL) a C callback compiled here that
  forwards to Numba's `numba_xxgemm`, which finds scipy's BLAS at run time: the route `np.dot`
  takes inside compiled code. That route relies on two Numba internals, `numba_xxgemm` and
  `ensure_blas`: a Numba upgrade must run the linalg, vision and recurrent tests.
ODTRAIN_GEMM=numba chooses the second route where both exist. `GEMM_LIBRARY` names the choice.

Kernels run BLAS on one thread (their parts are the threads): `hold_one_thread()` / `release_thread()`
(kernels/blas_library.py, which finds numpy's OpenBLAS without Numba) set numpy's OpenBLAS to one thread
for the duration of a step and give the program its own count back afterwards (scipy's BLAS, used by the
second route, is set to one thread for the process by odtrain.threads).

`product(a, b, c)` is c = a · b for 2-D views with a unit stride along one axis;
`gemm_batched_parts(...)` runs a batch of products in parallel parts, of the products or of their rows or
columns.

Imports numpy; Numba, and llvmlite (Numba's code generator) to register the symbols, when the compiler
loads (kernels/jit.py).
"""
from __future__ import annotations

import numpy as np

from .jit import carray, intrinsic, njit, on_load, prange, types

from .blas_library import (ROUTE_VARIABLE, found_openblas, gemm_addresses, hold_one_thread,  # noqa: F401
                           product_threads, release_thread)

SYMBOLS = {"float32": "odtrain_cblas_sgemm", "float64": "odtrain_cblas_dgemm"}
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


@intrinsic
def blas_gemm(typingctx, trans_a, trans_b, m, n, k, alpha, a, a_offset, lda, b, b_offset, ldb, beta, c, c_offset, ldc):
    """Row-major c[m, n] = alpha · op(a)[m, k] · op(b)[k, n] + beta · c through `odtrain_cblas_?gemm`.

    Operands are flat arrays with element offsets and row strides (lda, ldb, ldc), so any matrix of
    a batch, or a strided block, is one call without a copy.
    """
    if not all(isinstance(t, types.Array) for t in (a, b, c)) or not a.dtype == b.dtype == c.dtype \
            or c.dtype not in (types.float32, types.float64):
        return None
    sig = types.void(trans_a, trans_b, m, n, k, alpha, a, a_offset, lda, b, b_offset, ldb, beta, c, c_offset, ldc)
    dtype = c.dtype

    def codegen(context, builder, signature, args):
        from numba.core import cgutils

        ir = cgutils.ir
        ta, tb, m_, n_, k_, alpha_, a_, aoff, lda_, b_, boff, ldb_, beta_, c_, coff, ldc_ = args
        arg_types = signature.args
        i64, i32 = ir.IntType(64), ir.IntType(32)
        scalar = context.get_value_type(dtype)

        def size(value, i):
            return context.cast(builder, value, arg_types[i], types.int64)

        def pointer(array, i, offset, j):
            data = context.make_array(arg_types[i])(context, builder, array).data
            return builder.gep(data, [context.cast(builder, offset, arg_types[j], types.intp)])

        def flag(value, i):
            transposed = builder.icmp_signed("!=", size(value, i), ir.Constant(i64, 0))
            return builder.select(transposed, ir.Constant(i32, _TRANS), ir.Constant(i32, _NO_TRANS))

        def number(value, i):
            return context.cast(builder, value, arg_types[i], dtype)

        pointer_type = scalar.as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, scalar, pointer_type, i64,
                                               pointer_type, i64, scalar, pointer_type, i64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, SYMBOLS[str(dtype)])
        builder.call(fn, (ir.Constant(i32, _ROW_MAJOR), flag(ta, 0), flag(tb, 1), size(m_, 2), size(n_, 3),
                          size(k_, 4), number(alpha_, 5), pointer(a_, 6, aoff, 7), size(lda_, 8),
                          pointer(b_, 9, boff, 10), size(ldb_, 11), number(beta_, 12), pointer(c_, 13, coff, 14),
                          size(ldc_, 15)))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _numba_gemm(typingctx, trans_a, trans_b, m, n, k, alpha, a, a_offset, lda, b, b_offset, ldb, beta, c, c_offset, ldc):
    """blas_gemm's operation through Numba's `numba_xxgemm` (scipy's BLAS, found at run time). BLAS is
    column-major: the row-major product is computed as cᵀ = op(b)ᵀ · op(a)ᵀ."""
    if not all(isinstance(t, types.Array) for t in (a, b, c)) or not a.dtype == b.dtype == c.dtype \
            or c.dtype not in (types.float32, types.float64):
        return None
    from numba.core import cgutils
    from numba.np.linalg import ensure_blas

    ensure_blas()  # scipy's BLAS table, or Numba's own clear error
    sig = types.int32(trans_a, trans_b, m, n, k, alpha, a, a_offset, lda, b, b_offset, ldb, beta, c, c_offset, ldc)
    dtype = c.dtype
    kind = {"float32": "s", "float64": "d"}[str(dtype)]

    def codegen(context, builder, signature, args):
        ir = cgutils.ir  # llvmlite's IR module, as numba's own BLAS calls use it
        ta, tb, m_, n_, k_, alpha_, a_, aoff, lda_, b_, boff, ldb_, beta_, c_, coff, ldc_ = args
        arg_types = signature.args
        intp = context.get_value_type(types.intp)
        char = ir.IntType(8)
        void_ptr = ir.IntType(8).as_pointer()

        def index(value, i):
            return context.cast(builder, value, arg_types[i], types.intp)

        def pointer(array, i, offset, j):
            data = context.make_array(arg_types[i])(context, builder, array).data
            return builder.bitcast(builder.gep(data, [index(offset, j)]), void_ptr)

        def flag(value, i):
            transposed = builder.icmp_signed("!=", index(value, i), ir.Constant(intp, 0))
            return builder.select(transposed, ir.Constant(char, ord("t")), ir.Constant(char, ord("n")))

        alpha_slot = cgutils.alloca_once_value(builder, context.cast(builder, alpha_, arg_types[5], dtype))
        beta_slot = cgutils.alloca_once_value(builder, context.cast(builder, beta_, arg_types[12], dtype))
        fnty = ir.FunctionType(ir.IntType(32), [char, char, char, intp, intp, intp, void_ptr, void_ptr, intp,
                                                void_ptr, intp, void_ptr, void_ptr, intp])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "numba_xxgemm")
        return builder.call(fn, (ir.Constant(char, ord(kind)), flag(tb, 1), flag(ta, 0),
                                 index(n_, 3), index(m_, 2), index(k_, 4), builder.bitcast(alpha_slot, void_ptr),
                                 pointer(b_, 9, boff, 10), index(ldb_, 11), pointer(a_, 6, aoff, 7), index(lda_, 8),
                                 builder.bitcast(beta_slot, void_ptr), pointer(c_, 13, coff, 14), index(ldc_, 15)))

    return sig, codegen



def _gemm_through_numba(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """The C callback behind the symbols where numpy carries no OpenBLAS (called row-major only)."""
    if m <= 0 or n <= 0:
        return
    a_transposed, b_transposed = trans_a == _TRANS, trans_b == _TRANS
    a_rows, a_columns = (k, m) if a_transposed else (m, k)
    b_rows, b_columns = (n, k) if b_transposed else (k, n)
    a_view = carray(a, (max((a_rows - 1) * lda + a_columns, 0),))
    b_view = carray(b, (max((b_rows - 1) * ldb + b_columns, 0),))
    c_view = carray(c, ((m - 1) * ldc + n,))
    _numba_gemm(a_transposed, b_transposed, m, n, k, alpha, a_view, 0, lda, b_view, 0, ldb, beta, c_view, 0, ldc)


def _callback_signature(dtype):
    pointer = types.CPointer(dtype)
    return types.void(types.int32, types.int32, types.int32, types.int64, types.int64, types.int64, dtype,
                      pointer, types.int64, pointer, types.int64, dtype, pointer, types.int64)


def _register_route() -> None:
    """Give Numba's code the symbols of the products: numpy's OpenBLAS, else Numba's route (when Numba loads)."""
    from llvmlite import binding
    from numba import cfunc

    found = found_openblas()
    if found is None:
        for dtype in (types.float32, types.float64):
            callback = cfunc(_callback_signature(dtype), cache=True, error_model="numpy")(_gemm_through_numba)
            binding.add_symbol(SYMBOLS[str(dtype)], callback.address)
        return
    for dtype, address in zip(("float32", "float64"), gemm_addresses(found)):
        binding.add_symbol(SYMBOLS[dtype], address)


on_load(_register_route)
GEMM_LIBRARY = product_threads().name or "scipy's BLAS, through Numba (numba_xxgemm)"
NUMPY_OPENBLAS = found_openblas() is not None  # the products call numpy's OpenBLAS (else Numba's route)
BLAS_CORE = product_threads().core
# OpenBLAS's AVX-512 kernel families (SkylakeX, and Cooperlake and SapphireRapids, which include it) have
# float32 small-matrix kernels that skip packing the operands, taken when m·n·k <= 100³ and the first
# operand of the row-major product is not transposed against a transposed second one. On the thin products
# of convolutions they run faster than the packed path, blocks included (bench_ops.ConvOps), so
# `gemm_blocks`, which the products of convolutions, matrix products and attention go through, cuts wider
# float32 products into blocks of columns under that size. Other kernel families have no such kernels, and
# cutting there loses (the runs: benchmarks/README.md, "Figures behind kernel choices"). Compiled kernels keep
# the value of the process that compiled them.
SMALL_PRODUCT_CELLS = 100 ** 3 if BLAS_CORE.lower() in ("skylakex", "cooperlake", "sapphirerapids") else 0
SMALL_PRODUCT_MIN_COLUMNS = 32  # narrower blocks gain nothing over the packed path (bench_ops.ConvOps)
# Against a transposed second operand (c = a · bᵀ, OpenBLAS's "TN" in its column-major terms) the small
# kernels take only outputs of at most 1200 cells and K >= 32. Blocks of an MLP layer's forward (the weights
# stored [out, in]) run faster so cut than whole; taller products lose in such blocks, so only products of
# few rows are cut (bench_ops.ProductOps, Gemm).
SMALL_TN_OUTPUT, SMALL_TN_DEPTH, SMALL_TN_ROWS = 1200, 32, 64


@njit(cache=True, error_model="numpy", inline="always")
def _operand(a):
    """(transposed, leading dimension) of a 2-D view with unit stride along one of its axes."""
    size = a.itemsize
    if a.shape[1] <= 1 or a.strides[1] == size:
        return 0, max(a.strides[0] // size, a.shape[1], 1)
    return 1, max(a.strides[1] // size, a.shape[0], 1)


@njit(cache=True, error_model="numpy", inline="always")
def gemm_blocks(trans_a, trans_b, m, n, k, alpha, a, a_offset, lda, b, b_offset, ldb, beta, c, c_offset, ldc):
    """blas_gemm in blocks of columns where OpenBLAS's small-matrix kernels take them (SMALL_PRODUCT_CELLS:
    float32; the second operand not transposed, or transposed against at most SMALL_TN_ROWS rows of a
    deep enough first one); each block the same sums as the whole."""
    gemm_in_blocks(SMALL_PRODUCT_CELLS, trans_a, trans_b, m, n, k, alpha, a, a_offset, lda, b, b_offset, ldb, beta,
                   c, c_offset, ldc)


@njit(cache=True, error_model="numpy", inline="always")
def block_columns(cells, trans_a, trans_b, m, n, k, itemsize):
    """Columns per block of gemm_in_blocks (n: the product whole)."""
    if not cells or itemsize != 4 or m * n * k <= cells:
        return n
    if trans_b == 0:
        columns = cells // (m * k) // 16 * 16  # whole vectors of 16 floats
        return columns if columns >= SMALL_PRODUCT_MIN_COLUMNS else n
    if trans_a == 0 and m <= SMALL_TN_ROWS and k >= SMALL_TN_DEPTH:
        columns = min(SMALL_TN_OUTPUT // m, cells // (m * k)) // 8 * 8
        return columns if columns >= 16 else n  # narrower blocks unmeasured
    return n


@njit(cache=True, error_model="numpy", inline="always")
def gemm_in_blocks(cells, trans_a, trans_b, m, n, k, alpha, a, a_offset, lda, b, b_offset, ldb, beta, c, c_offset,
                   ldc):
    """gemm_blocks with the small kernels' bound `cells` (m·n·k of a block) given: 0 runs the product whole."""
    columns = block_columns(cells, trans_a, trans_b, m, n, k, c.itemsize)
    step = ldb if trans_b else 1  # elements from one column of op(b) to the next
    for first in range(0, n, columns):
        blas_gemm(trans_a, trans_b, m, min(columns, n - first), k, alpha, a, a_offset, lda, b,
                  b_offset + first * step, ldb, beta, c, c_offset + first, ldc)


@njit(cache=True, error_model="numpy", inline="always")
def product(a, b, c):
    """c = a · b for 2-D views (each with unit stride along one axis; c along its rows)."""
    if c.shape[0] == 0 or c.shape[1] == 0:
        return
    if a.shape[1] == 0:
        c[:] = 0
        return
    trans_a, lda = _operand(a)
    trans_b, ldb = _operand(b)
    gemm_blocks(trans_a, trans_b, c.shape[0], c.shape[1], a.shape[1], 1.0, a, 0, lda, b, 0, ldb, 0.0, c, 0,
                max(c.strides[0] // c.itemsize, c.shape[1], 1))


PRODUCTS, ROWS, COLUMNS = 0, 1, 2  # how gemm_batched_parts splits a batch of products into parts


@njit(cache=True, error_model="numpy", parallel=True)
def gemm_batched_parts(a, b, out, m, n, k, trans_a, trans_b, lda, ldb, ldc, a_offsets, b_offsets, out_offsets, betas,
                       alpha, split, bounds):
    """out[o_i] = alpha · op(a[a_i]) · op(b[b_i]) + betas[i] · out[o_i] for each product i, in parallel parts:
    `split` ROWS, part p computes rows [bounds[p], bounds[p + 1]) of every product, in product order (so
    products that share an output add up as in one thread); COLUMNS, the same with columns; PRODUCTS, the
    products [bounds[p], bounds[p + 1]) (their outputs distinct). Row r of op(a) starts r·lda elements in
    (r when a is transposed); column j of op(b) j elements in (j·ldb when b is transposed)."""
    a_row = 1 if trans_a else lda
    b_column = ldb if trans_b else 1
    for p in prange(bounds.size - 1):
        first, size = bounds[p], bounds[p + 1] - bounds[p]
        if split == ROWS:
            for i in range(a_offsets.size):
                gemm_blocks(trans_a, trans_b, size, n, k, alpha, a, a_offsets[i] + first * a_row, lda, b,
                            b_offsets[i], ldb, betas[i], out, out_offsets[i] + first * ldc, ldc)
        elif split == COLUMNS:
            for i in range(a_offsets.size):
                gemm_blocks(trans_a, trans_b, m, size, k, alpha, a, a_offsets[i], lda, b,
                            b_offsets[i] + first * b_column, ldb, betas[i], out, out_offsets[i] + first, ldc)
        else:
            for i in range(first, first + size):
                gemm_blocks(trans_a, trans_b, m, n, k, alpha, a, a_offsets[i], lda, b, b_offsets[i], ldb, betas[i],
                            out, out_offsets[i], ldc)
