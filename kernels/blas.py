"""The one BLAS entry point of the kernels: a general matrix product on arrays at element offsets.

`blas_gemm` calls the ?gemm that `np.dot` reaches inside compiled code (Numba's `numba_xxgemm`,
which finds scipy's BLAS at run time), with the transpose flags, leading dimensions, offsets,
alpha and beta that `np.dot` does not expose. It relies on two Numba internals, `numba_xxgemm`
and `ensure_blas`: a Numba upgrade must run the linalg, vision and recurrent tests.

`product(a, b, c)` is c = a · b for 2-D views with a unit stride along one axis;
`gemm_batched_parts(...)` runs a batch of products in parallel parts, of the products or of their
rows (BLAS itself runs one thread inside them: odtrain.threads).

Imports numpy and numba only.
"""
from __future__ import annotations

from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.linalg import ensure_blas


@intrinsic
def blas_gemm(typingctx, trans_a, trans_b, m, n, k, alpha, a, a_offset, lda, b, b_offset, ldb, beta, c, c_offset, ldc):
    """Row-major c[m, n] = alpha · op(a)[m, k] · op(b)[k, n] + beta · c, through BLAS ?gemm.

    Operands are flat arrays with element offsets and row strides (lda, ldb, ldc), so any
    matrix of a batch, or a strided block, is one call without a copy. BLAS is column-major:
    the row-major product is computed as cᵀ = op(b)ᵀ · op(a)ᵀ. Numba exports `numba_xxgemm`,
    which finds scipy's BLAS at run time: the same route `np.dot` takes, with the transpose
    flags, offsets and beta that `np.dot` does not expose.
    """
    if not all(isinstance(t, types.Array) for t in (a, b, c)) or not a.dtype == b.dtype == c.dtype \
            or c.dtype not in (types.float32, types.float64):
        return None
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


@njit(cache=True, error_model="numpy", inline="always")
def _operand(a):
    """(transposed, leading dimension) of a 2-D view with unit stride along one of its axes."""
    size = a.itemsize
    if a.shape[1] <= 1 or a.strides[1] == size:
        return 0, max(a.strides[0] // size, a.shape[1], 1)
    return 1, max(a.strides[1] // size, a.shape[0], 1)


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
    blas_gemm(trans_a, trans_b, c.shape[0], c.shape[1], a.shape[1], 1.0, a, 0, lda, b, 0, ldb, 0.0, c, 0,
         max(c.strides[0] // c.itemsize, c.shape[1], 1))


@njit(cache=True, error_model="numpy", parallel=True)
def gemm_batched_parts(a, b, out, m, n, k, trans_a, trans_b, lda, ldb, ldc, a_offsets, b_offsets, out_offsets, betas,
                       alpha, bounds, by_rows):
    """out[o_i] = alpha · op(a[a_i]) · op(b[b_i]) + betas[i] · out[o_i] for each product i, in parallel parts:
    `by_rows`, part p computes rows [bounds[p], bounds[p + 1]) of every product, in product order (so
    products that share an output add up as in one thread); otherwise the products [bounds[p], bounds[p + 1])
    (their outputs distinct). Row r of op(a) starts r·lda elements in (r when a is transposed)."""
    a_row = 1 if trans_a else lda
    for p in prange(bounds.size - 1):
        if by_rows:
            first, rows = bounds[p], bounds[p + 1] - bounds[p]
            for i in range(a_offsets.size):
                blas_gemm(trans_a, trans_b, rows, n, k, alpha, a, a_offsets[i] + first * a_row, lda, b, b_offsets[i], ldb,
                     betas[i], out, out_offsets[i] + first * ldc, ldc)
        else:
            for i in range(bounds[p], bounds[p + 1]):
                blas_gemm(trans_a, trans_b, m, n, k, alpha, a, a_offsets[i], lda, b, b_offsets[i], ldb, betas[i], out,
                     out_offsets[i], ldc)
