"""Matrix products through BLAS: Gemm, MatMul (batch broadcasting, 1-D operands), MatMul's gradients,
and Einsum.

Every product is one call of `_gemm_batched`: BLAS ?gemm (blas.py) per matrix of a batch, with the
transpose flags, element offsets and accumulation (beta) worked out once at bind time.
Transposes are never copied, and a gradient summed over broadcast batch axes accumulates
in place (beta = 1) instead of materialising per-batch products. Where the batch can be
folded into the rows of one product (activations times a weight matrix, and the weight's
gradient), it is a single large BLAS call.

Einsum of two operands is one batched product C[b, m, n] = Σ_k A[b, m, k] · B[b, k, n], where
b are the labels both operands and the output have, m and n the output labels of one operand
only, and k the labels the output lacks (a label of one operand only is summed against the
other operand repeated along it). An operand already laid out as [b, m, k] (or [b, k, m]) is
read in place; any other layout (a permutation, a diagonal, a broadcast) is first copied into
scratch memory, as is C when the output's label order is not [b, m, n]. One operand is a
copy through its permuted strides, summed over the labels the output lacks.

With threads, a batch of products large enough runs in parallel parts (blas.gemm_batched_parts, the twin of
_gemm_batched that also takes how it splits):
whole products when there are enough with distinct outputs, else blocks of at least MIN_ROWS rows
of every product, or of columns when the products are wider than tall (a weight matrix times a batch of
activations: each part then streams its own part of the weights, faster than splitting by rows;
bench_ops.ProductOps, Gemm).
"""
from __future__ import annotations

import numpy as np

from .jit import njit, prange  # noqa: F401 (prange: the loops of the written twins)

from .registry import ODTRAIN_DOMAIN, binding
from .blas import COLUMNS, PRODUCTS, ROWS, gemm_batched_parts, gemm_blocks
from .copies import copy_call, gather_call, same_buffer, sum_call
from .layout import broadcast_layout, element_strides, promoted_shapes
from .parallel_split import on_parts, parallel_twin, part_count, split, splitting_everything, twin_of, worth_parallel
from .scalar import gelu, gelu_grad
from .windows import text


@njit(cache=True, error_model="numpy")
def _gemm_batched(a, b, out, m, n, k, trans_a, trans_b, lda, ldb, ldc, a_offsets, b_offsets, out_offsets, betas, alpha):
    """out[o_i] = alpha · op(a[a_i]) · op(b[b_i]) + betas[i] · out[o_i] for each product i of a batch."""
    for i in range(a_offsets.size):
        gemm_blocks(trans_a, trans_b, m, n, k, alpha, a, a_offsets[i], lda, b, b_offsets[i], ldb, betas[i],
                    out, out_offsets[i], ldc)


twin_of(_gemm_batched, takes=("split",),
        because="it cuts whole products, rows or columns, as its `split` argument says")(gemm_batched_parts)


@njit(cache=True, error_model="numpy")
def _zero(out):
    for i in range(out.size):
        out[i] = 0


# Products of fewer multiply-adds run on one thread: BLAS does that many in about the time a parallel region
# costs to wake its threads after they idle (kernels/parallel_split.py), so an MLP's last layer ran slower in two
# parts than on one thread (bench_ops.ProductOps, Gemm).
MIN_PARALLEL_PRODUCT = 1 << 20
MIN_ROWS = 16  # rows (or columns) of a product per part: fewer make BLAS's blocks inefficient


def _batch_offsets(batch: tuple, full: tuple, matrix_size: int) -> np.ndarray:
    """For each flat position of the `full` batch, the element offset of the matrix an operand uses."""
    if not full:
        return np.zeros(1, dtype=np.int64)
    strides = np.array(element_strides(batch, full), dtype=np.int64) * matrix_size
    grid = np.indices(full).reshape(len(full), -1)
    return (strides[:, None] * grid).sum(axis=0).astype(np.int64)


def gemm_calls(a: np.ndarray, b: np.ndarray, out: np.ndarray, trans_a: int = 0, trans_b: int = 0,
               alpha: float = 1.0, accumulate: bool = False, threads: int = 1) -> list:
    """out = alpha · op(a) · op(b) (+ out when accumulate) over numpy-broadcast batch axes, for arrays of
    rank >= 2. Batch axes that `out` lacks (or has as 1) are summed: each product adds into its slot."""
    if a.dtype not in (np.float32, np.float64) or b.dtype != a.dtype or out.dtype != a.dtype:
        raise ValueError(f"matrix products run on float32 or float64, got {a.dtype} and {b.dtype}")
    m, k = (a.shape[-1], a.shape[-2]) if trans_a else (a.shape[-2], a.shape[-1])
    n = b.shape[-2] if trans_b else b.shape[-1]
    a_batch, b_batch, out_batch = a.shape[:-2], b.shape[:-2], out.shape[:-2]
    full = broadcast_batch(a_batch, b_batch, out_batch)
    count = int(np.prod(full, dtype=np.int64))
    a_size, b_size, out_size = a.shape[-2] * a.shape[-1], b.shape[-2] * b.shape[-1], m * n
    whole = (lambda batch: int(np.prod(batch, dtype=np.int64)) == count)
    shared = (lambda batch: int(np.prod(batch, dtype=np.int64)) == 1)
    lda, ldb, ldc = a.shape[-1], b.shape[-1], n
    beta0 = 1.0 if accumulate else 0.0
    one = np.zeros(1, dtype=np.int64)
    if count > 1 and shared(b_batch) and whole(a_batch) and whole(out_batch) and not trans_a:
        # a batch of row blocks times one matrix: a single product with count·m rows
        return _calls(a, b, out, count * m, n, k, trans_a, trans_b, lda, ldb, ldc, one, one, one, [beta0], alpha,
                      threads)
    if count > 1 and shared(out_batch) and whole(a_batch) and whole(b_batch) and trans_a and not trans_b:
        # Σ_i a_iᵀ · b_i = aᵀ · b with the batches stacked along the rows: one product with count·k_rows
        return _calls(a, b, out, m, n, count * a.shape[-2], 1, 0, lda, ldb, ldc, one, one, one, [beta0], alpha,
                      threads)
    a_offsets = _batch_offsets(a_batch, full, a_size)
    b_offsets = _batch_offsets(b_batch, full, b_size)
    out_offsets = _batch_offsets(out_batch, full, out_size)
    betas, seen = [], set()
    for offset in out_offsets:
        betas.append(1.0 if accumulate or offset in seen else 0.0)
        seen.add(int(offset))
    return _calls(a, b, out, m, n, k, trans_a, trans_b, lda, ldb, ldc, a_offsets, b_offsets, out_offsets, betas, alpha,
                  threads)


# OpenBLAS runs a product of at most 4·65536 multiply-adds (m·n·k) on one thread whatever its setting: a
# batch of such products (attention's, per head) with distinct outputs is split into whole products, even
# when there are fewer of them than threads, never into blocks of rows.
SMALL_PRODUCT = 4 * 65536


def _calls(a, b, out, m, n, k, trans_a, trans_b, lda, ldb, ldc, a_offsets, b_offsets, out_offsets, betas, alpha,
           threads: int = 1):
    dtype = out.dtype.type
    if m == 0 or n == 0:
        return []
    if k == 0:  # an empty sum: the product is zero (BLAS refuses zero leading dimensions)
        return [] if all(beta == 1.0 for beta in betas) else [(_zero, (out.reshape(-1),))]
    lda, ldb, ldc = max(int(lda), 1), max(int(ldb), 1), max(int(ldc), 1)
    args = (a.reshape(-1), b.reshape(-1), out.reshape(-1), int(m), int(n), int(k), int(trans_a), int(trans_b), int(lda),
            int(ldb), int(ldc), a_offsets, b_offsets, out_offsets, np.asarray(betas, dtype=out.dtype), dtype(alpha))
    count, work = len(out_offsets), len(out_offsets) * int(m) * int(n) * int(k)
    # a product split into blocks: of its columns when it has more columns than rows (each part then reads
    # all of the smaller operand, op(a), and its own block of op(b)), else of its rows
    by_columns = int(n) > int(m)
    extent = int(n) if by_columns else int(m)  # columns or rows, split into blocks
    blocks = extent // MIN_ROWS
    if not worth_parallel(work, MIN_PARALLEL_PRODUCT) or part_count(threads, max(count, blocks), work) == 1:
        return [(_gemm_batched, args)]
    distinct = len(set(out_offsets.tolist())) == count
    if distinct and (count >= threads or int(m) * int(n) * int(k) <= SMALL_PRODUCT):  # whole products
        parts = part_count(threads, count, work)
        # recording (every_split): a single small product is cut into blocks, as it is once a larger batch makes
        # it larger than SMALL_PRODUCT, so that the library holds the twin that size runs
        if parts > 1 or not splitting_everything():
            return [on_parts((_gemm_batched, args), count, parts, (PRODUCTS,))]
    # blocks of rows or columns: parts of at least MIN_ROWS each
    parts = part_count(threads, blocks, work)
    return [on_parts((_gemm_batched, args), extent, parts, (COLUMNS if by_columns else ROWS,))]


def broadcast_batch(*batches: tuple) -> tuple:
    rank = max((len(b) for b in batches), default=0)
    padded = [(1,) * (rank - len(b)) + tuple(b) for b in batches]
    return tuple(max(dims) for dims in zip(*padded)) if rank else ()


def bias_call(c: np.ndarray, out: np.ndarray, beta: float = 1.0):
    """out ← beta · C broadcast to out's shape: the start of a product that BLAS adds to (beta = 1)."""
    dims, _, sc = broadcast_layout(out.shape, c.shape)
    return gather_call(c, out, dims, sc, beta)


@binding("Gemm", parallel=True)
def Gemm(inputs, outputs, alpha=1.0, beta=1.0, transA=0, transB=0, threads=1):
    a, b, out = inputs[0], inputs[1], outputs[0]
    c = inputs[2] if len(inputs) > 2 else None
    if c is None or beta == 0.0:
        return gemm_calls(a, b, out, transA, transB, alpha, threads=threads)
    # out ← beta · C (broadcast), then out += alpha · A' · B' inside BLAS
    return [bias_call(c, out, beta)] + gemm_calls(a, b, out, transA, transB, alpha, accumulate=True, threads=threads)


@binding("MatMul", parallel=True)
def MatMul(inputs, outputs, threads=1):
    a, b, out = inputs[0], inputs[1], outputs[0]
    a2, b2, y2 = promoted_shapes(a.shape, b.shape, out.shape)
    return gemm_calls(a.reshape(a2), b.reshape(b2), out.reshape(y2), threads=threads)


@binding("MatMulGradA", ODTRAIN_DOMAIN, parallel=True)
def MatMulGradA(inputs, outputs, threads=1):
    """dA = dY · Bᵀ, summed over the batch axes A was broadcast along."""
    dy, b, da = inputs[0], inputs[1], outputs[0]
    a2, b2, y2 = promoted_shapes(da.shape, b.shape, dy.shape)
    return gemm_calls(dy.reshape(y2), b.reshape(b2), da.reshape(a2), trans_b=1, threads=threads)


@binding("MatMulGradB", ODTRAIN_DOMAIN, parallel=True)
def MatMulGradB(inputs, outputs, threads=1):
    """dB = Aᵀ · dY, summed over the batch axes B was broadcast along."""
    a, dy, db = inputs[0], inputs[1], outputs[0]
    a2, b2, y2 = promoted_shapes(a.shape, db.shape, dy.shape)
    return gemm_calls(a.reshape(a2), dy.reshape(y2), db.reshape(b2), trans_a=1, threads=threads)


def _matrix_layout(view: np.ndarray, trans: int):
    """(BLAS transpose flag, leading dimension) reading the last two axes of a strided view, or None
    when neither axis is contiguous (then BLAS cannot read it in place)."""
    rows, cols = view.shape[-2:]
    row_stride, col_stride = (s // view.itemsize for s in view.strides[-2:])
    if cols == 1 or col_stride == 1:
        return trans, max(row_stride if rows > 1 else cols, cols, 1)
    if rows == 1 or row_stride == 1:
        return 1 - trans, max(col_stride if cols > 1 else rows, rows, 1)
    return None


def _view_offsets(view: np.ndarray, base: np.ndarray, full: tuple) -> np.ndarray:
    """Element offset, from base's first element, of the matrix a view uses at each position of `full`."""
    start = (view.ctypes.data - base.ctypes.data) // view.itemsize
    batch = view.shape[:-2]
    pad = len(full) - len(batch)
    strides = [0] * pad + [s // view.itemsize if d != 1 else 0 for d, s in zip(batch, view.strides[:-2])]
    if not full:
        return np.full(1, start, dtype=np.int64)
    grid = np.indices(full).reshape(len(full), -1)
    return (start + (np.array(strides, dtype=np.int64)[:, None] * grid).sum(axis=0)).astype(np.int64)


def view_gemm_calls(a: np.ndarray, a_view: np.ndarray, b: np.ndarray, b_view: np.ndarray, out: np.ndarray,
                    out_view: np.ndarray, trans_a: int, trans_b: int, alpha: float, threads: int = 1) -> list:
    """out_view = alpha · op(a_view) · op(b_view) where the views are strided views (transposes) of the
    contiguous arrays a, b and out: BLAS reads and writes them in place, one call per matrix of the batch,
    summing into the output matrices that several batch positions share."""
    if out_view.shape[-1] != 1 and out_view.strides[-1] != out_view.itemsize:
        # a column-major output: compute its transpose, outᵀ = op(b)ᵀ · op(a)ᵀ, row-major
        swap = tuple(range(out_view.ndim - 2)) + (out_view.ndim - 1, out_view.ndim - 2)
        return view_gemm_calls(b, b_view, a, a_view, out, out_view.transpose(swap), 1 - trans_b, 1 - trans_a, alpha,
                               threads)
    layouts = [_matrix_layout(a_view, trans_a), _matrix_layout(b_view, trans_b), _matrix_layout(out_view, 0)]
    if any(layout is None for layout in layouts):
        raise ValueError("a matrix product over a layout with no contiguous axis")
    (flag_a, lda), (flag_b, ldb), (_, ldc) = layouts
    m, n = out_view.shape[-2:]
    k = a_view.shape[-2] if trans_a else a_view.shape[-1]
    full = broadcast_batch(a_view.shape[:-2], b_view.shape[:-2], out_view.shape[:-2])
    out_offsets = _view_offsets(out_view, out, full)
    betas, seen = [], set()
    for offset in out_offsets:
        betas.append(1.0 if offset in seen else 0.0)
        seen.add(int(offset))
    return _calls(a, b, out, m, n, k, flag_a, flag_b, lda, ldb, ldc, _view_offsets(a_view, a, full),
                  _view_offsets(b_view, b, full), out_offsets, betas, alpha, threads)


# A product's activation epilogue (graph/product_epilogues.py) by name: the code its kernels take.
EPILOGUE_CODES = {"Relu": 1, "Gelu": 2}
# Rows of a product's output per panel of an epilogue: a panel of EPILOGUE_PANEL_BYTES at most, at least
# EPILOGUE_MIN_ROWS rows. BLAS repacks the weight at every call and runs short panels slower than the pass they
# save (benchmarks/README.md, "Figures behind kernel choices").
EPILOGUE_PANEL_BYTES = 1 << 22
EPILOGUE_MIN_ROWS = 512


@njit(cache=True, error_model="numpy")
def _gelu_of(product, values):
    """values = GELU(product), on its own: inlined into the loop of the products, it ran unvectorised."""
    for i in range(values.size):
        values[i] = gelu(product[i])


@njit(cache=True, error_model="numpy")
def _product_epilogue(a, b, bias, out, pre, n, k, trans_b, ldb, alpha, activation, panel, first, last):
    """Rows [first, last) of out = f(alpha · a · op(b) + bias), a[m, k] and out[m, n] flat and row-major, `panel`
    rows at a time: a panel's bias, its BLAS product and f (1 Relu, 2 GELU) while the panel is in the cache.
    Where f's gradient reads P = alpha · a · op(b) + bias (GELU), BLAS writes P into `pre`, and f reads it from
    there; otherwise `pre` is empty and f runs in place."""
    target = pre if activation == 2 else out
    for start in range(first, last, panel):
        rows = min(panel, last - start)
        begin, end = start * n, (start + rows) * n
        beta = 0.0
        if bias.size > 0:  # the panel starts as the bias, BLAS adds the product to it
            for i in range(begin, end, n):
                row = target[i:i + n]
                for j in range(n):
                    row[j] = bias[j]
            beta = 1.0
        gemm_blocks(0, trans_b, rows, n, k, alpha, a, start * k, k, b, 0, ldb, beta, target, begin, n)
        if activation == 1:
            values = out[begin:end]  # from 0 on a slice: with offsets into the whole array LLVM vectorised worse
            for i in range(values.size):
                values[i] = max(values[i], 0)
        elif activation == 2:
            _gelu_of(pre[begin:end], out[begin:end])


_product_epilogue_parts = parallel_twin(_product_epilogue, range=("first", "last"))


@njit(cache=True, error_model="numpy")
def _activation_bias_grad(dy, x, dx, dbias, rows, n, activation, in_place, first, last):
    """Columns [first, last) of dx = dy · f'(x) over [rows, n] row-major matrices (1 Relu, x its output Y: dy · (0 <
    Y); 2 GELU, x its input P), and dbias[j] = Σ_r dx[r, j] in row order when dbias is not empty; `in_place`: dx is
    dy."""
    sums = dbias.size > 0
    column_sums = dbias[first:last] if sums else dbias
    for j in range(column_sums.size):
        column_sums[j] = 0
    for r in range(rows):
        row = r * n
        # each row's segment under one name (dx, after a copy of dy when they are two buffers): a loop reading and
        # writing one buffer through two names fails LLVM's overlap check and runs unvectorised, 8x slower
        gradient, values = dx[row + first:row + last], x[row + first:row + last]
        if not in_place:
            incoming = dy[row + first:row + last]
            for j in range(gradient.size):
                gradient[j] = incoming[j]
        if activation == 1 and sums:
            for j in range(gradient.size):
                g = gradient[j] * (values[j] > 0)
                gradient[j] = g
                column_sums[j] += g
        elif activation == 1:
            for j in range(gradient.size):
                gradient[j] = gradient[j] * (values[j] > 0)
        elif sums:
            for j in range(gradient.size):
                g = gelu_grad(gradient[j], values[j])
                gradient[j] = g
                column_sums[j] += g
        else:
            for j in range(gradient.size):
                gradient[j] = gelu_grad(gradient[j], values[j])


_activation_bias_grad_parts = parallel_twin(_activation_bias_grad, range=("first", "last"))


def _epilogue_call(a, b, bias, out, pre, trans_b: int, alpha: float, activation: str, threads: int):
    """The call of a product with its epilogue: rows of the output in parts at `threads`, as products split."""
    n = out.shape[-1]
    k = a.shape[-1]
    m = out.size // n if n else 0
    code = EPILOGUE_CODES[activation]
    dtype = out.dtype
    if bias is not None and (bias.size != n or not bias.flags.c_contiguous):
        raise ValueError(f"an epilogue's bias has one value per output column ({n}), got shape {bias.shape}")
    flat_bias = bias.reshape(-1) if bias is not None else np.zeros(0, dtype)  # a view: the step reads it live
    flat_pre = pre.reshape(-1) if code == 2 else np.zeros(0, dtype)
    panel = max(EPILOGUE_MIN_ROWS, EPILOGUE_PANEL_BYTES // max(n * out.itemsize, 1))
    call = (_product_epilogue, (a.reshape(-1), b.reshape(-1), flat_bias, out.reshape(-1), flat_pre, n, k, trans_b,
                                b.shape[-1], dtype.type(alpha), code, panel, 0, m))
    work = m * n * k
    if not worth_parallel(work, MIN_PARALLEL_PRODUCT):
        return call
    return on_parts(call, m, part_count(threads, m // MIN_ROWS, work))


@binding("ActivationBiasGrad", ODTRAIN_DOMAIN, parallel=True)
def ActivationBiasGrad(inputs, outputs, activation="Relu", threads=1):
    """dP = dY · f'(Y or P) and dBias = dP summed over every axis but the last, in one pass."""
    dy, x, dx = inputs[0], inputs[1], outputs[0]
    dbias = outputs[1] if len(outputs) > 1 and outputs[1] is not None else np.zeros(0, dx.dtype)
    n = dx.shape[-1] if dx.ndim else 1
    rows = dx.size // n if n else 0
    call = (_activation_bias_grad, (dy.reshape(-1), x.reshape(-1), dx.reshape(-1), dbias.reshape(-1), rows, n,
                                    EPILOGUE_CODES[activation], same_buffer(dy, dx), 0, n))
    return [split(call, n, dx.size, threads)]


@binding("FusedMatMul", ODTRAIN_DOMAIN, parallel=True)
def FusedMatMul(inputs, outputs, transA=0, transB=0, alpha=1.0, permA=None, permB=None, permY=None, activation=None,
                threads=1):
    """out = alpha · op(A') · op(B') stored through permY (+ bias, without perms), summed over the batch axes
    `out` lacks; with an `activation` epilogue, out = f(alpha · A · op(B) + bias) (and P, its argument)."""
    a, b, out = inputs[0], inputs[1], outputs[0]
    bias = inputs[3] if len(inputs) > 3 else None
    if activation is not None:
        pre = outputs[1] if len(outputs) > 1 else None
        return [_epilogue_call(a, b, bias, out, pre, int(transB), float(alpha), activation, threads)]
    if bias is not None:  # out ← bias (broadcast), then out += alpha · op(A) · op(B) inside BLAS
        if permA is not None or permB is not None or permY is not None:
            raise ValueError("a bias is added to products without permA, permB or permY only")
        return [bias_call(bias, out)] + gemm_calls(a, b, out, int(transA), int(transB), float(alpha), accumulate=True,
                                                   threads=threads)
    if permA is None and permB is None and permY is None:
        return gemm_calls(a, b, out, int(transA), int(transB), float(alpha), threads=threads)
    a_view = a.transpose(permA) if permA is not None else a
    b_view = b.transpose(permB) if permB is not None else b
    out_view = out.transpose(np.argsort(permY)) if permY is not None else out
    return view_gemm_calls(a, a_view, b, b_view, out, out_view, int(transA), int(transB), float(alpha), threads)


def _einsum_labels(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """The operand and output terms of an equation, each '...' replaced by letters it does not use for
    the broadcast axes (right-aligned across operands), the implicit output written out."""
    equation = equation.replace(" ", "")
    inputs, _, output = equation.partition("->")
    unused = iter(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in equation)
    named = inputs.split(",")
    spans = [rank - len(term) + 3 for term, rank in zip(named, ranks) if "..." in term]
    ellipsis = "".join(next(unused) for _ in range(max(spans, default=0)))
    terms = [term.replace("...", ellipsis[len(ellipsis) - (rank - len(term) + 3):] if "..." in term else "")
             for term, rank in zip(named, ranks)]
    if "->" not in equation:
        output = ellipsis + "".join(sorted(c for c in set(inputs) if c.isalpha() and inputs.count(c) == 1))
    return terms, output.replace("...", ellipsis)


class _EinsumPlan:
    """How one Einsum runs at given operand shapes: strides that read each operand in the product's
    axis order, what must be copied first, and the scratch bytes (64-byte aligned pieces) that takes."""

    def __init__(self, equation: str, shapes: list[tuple], itemsize: int):
        terms, output = _einsum_labels(equation, [len(shape) for shape in shapes])
        self.sizes: dict[str, int] = {}
        for term, shape in zip(terms, shapes):
            for label, d in zip(term, shape):
                self.sizes[label] = max(self.sizes.get(label, 1), int(d))
        self.terms, self.shapes, self.output = terms, [tuple(s) for s in shapes], output
        self.summed = "".join(dict.fromkeys(c for c in "".join(terms) if c not in output))
        if len(terms) == 1:
            self.axes = [output + self.summed]
            pieces = [self.count(output + self.summed)] if self.summed else []
        else:
            a, b = terms
            self.batch = "".join(c for c in output if c in a and c in b)
            self.rows = "".join(c for c in output if c in a and c not in b)
            self.cols = "".join(c for c in output if c in b and c not in a)
            self.axes = [self.batch + self.rows + self.summed, self.batch + self.summed + self.cols]
            self.trans = [self._in_place(0, self.batch + self.summed + self.rows),
                          self._in_place(1, self.batch + self.cols + self.summed)]
            pieces = [self.count(order) for order, trans in zip(self.axes, self.trans) if trans is None]
            if output != self.batch + self.rows + self.cols:
                pieces.append(self.count(self.batch + self.rows + self.cols))
        self.scratch_bytes = sum(_aligned(count * itemsize) for count in pieces)

    def count(self, labels: str) -> int:
        return int(np.prod([self.sizes[c] for c in labels], dtype=np.int64))

    def strides(self, operand: int, labels: str) -> list[int]:
        """Element strides reading operand `operand` along `labels` (0 where it lacks or broadcasts a label;
        the sum of its axes' strides for a repeated label, the diagonal)."""
        term, shape = self.terms[operand], self.shapes[operand]
        own = element_strides(shape, shape)
        return [sum(own[axis] for axis, c in enumerate(term) if c == label and shape[axis] != 1) for label in labels]

    def _in_place(self, operand: int, transposed: str) -> int | None:
        """0 (or 1) when the operand is already contiguous in its product order (or with its last two label
        groups swapped), so BLAS reads it as it is; None when it must be copied."""
        for flag, labels in ((0, self.axes[operand]), (1, transposed)):
            dims = [self.sizes[c] for c in labels]
            kept = [(d, s) for d, s in zip(dims, self.strides(operand, labels)) if d != 1]
            contiguous = element_strides(tuple(d for d, _ in kept), tuple(d for d, _ in kept))
            if [s for _, s in kept] == contiguous and self.count(labels) == int(np.prod(self.shapes[operand])):
                return flag
        return None


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _einsum_scratch(input_specs, output_specs, equation=""):
    dtype = np.dtype(output_specs[0][1])
    return _EinsumPlan(text(equation), [shape for shape, _ in input_specs], dtype.itemsize).scratch_bytes


@binding("Einsum", scratch=_einsum_scratch)
def Einsum(inputs, outputs, equation="", scratch=None):
    out = outputs[0]
    plan = _EinsumPlan(text(equation), [x.shape for x in inputs], out.dtype.itemsize)
    take = _pieces(scratch, out.dtype)
    if len(inputs) == 1:
        x, order = inputs[0], plan.axes[0]
        dims = [plan.sizes[c] for c in order]
        if not plan.summed:
            return [copy_call(x, 0, plan.strides(0, order), out, 0, element_strides(out.shape, out.shape), dims)]
        rows, total = plan.count(plan.output), plan.count(order)
        gathered = take(total).reshape(rows, total // max(rows, 1))
        return [copy_call(x, 0, plan.strides(0, order), gathered, 0, element_strides(dims, dims), dims),
                *sum_call(gathered, out, (rows, 1), 1.0)]
    calls, operands = [], []
    groups = [(plan.batch, plan.rows, plan.summed), (plan.batch, plan.summed, plan.cols)]
    for index, (x, trans) in enumerate(zip(inputs, plan.trans)):
        batch, first, second = groups[index]
        if trans is not None:  # read as it is: [b, first, second], or [b, second, first] with a transpose flag
            inner = (second, first) if trans else (first, second)
            operands.append((x.reshape(plan.count(batch), plan.count(inner[0]), plan.count(inner[1])), trans))
            continue
        order = plan.axes[index]
        dims = [plan.sizes[c] for c in order]
        copy = take(plan.count(order))
        calls.append(copy_call(x, 0, plan.strides(index, order), copy, 0, element_strides(dims, dims), dims))
        operands.append((copy.reshape(plan.count(batch), plan.count(first), plan.count(second)), 0))
    product = plan.batch + plan.rows + plan.cols
    shape = (plan.count(plan.batch), plan.count(plan.rows), plan.count(plan.cols))
    result = out.reshape(shape) if plan.output == product else take(plan.count(product)).reshape(shape)
    (a, trans_a), (b, trans_b) = operands
    calls += gemm_calls(a, b, result, trans_a, trans_b)
    if plan.output != product:
        dims = [plan.sizes[c] for c in product]
        own = element_strides(out.shape, out.shape)
        calls.append(copy_call(result, 0, element_strides(dims, dims), out, 0,
                               [own[plan.output.index(c)] for c in product], dims))
    return calls


def _pieces(scratch, dtype):
    """take(count): the next 64-byte aligned array of `count` elements of `dtype` in the scratch bytes."""
    offset = 0

    def take(count: int) -> np.ndarray:
        nonlocal offset
        piece = scratch[offset:offset + count * dtype.itemsize].view(dtype)
        offset += _aligned(count * dtype.itemsize)
        return piece

    return take
