"""Kernels: convolution (Conv) and ConvTranspose, with their gradient ops.

A convolution with G groups sees X as [N, G, C/G, D, H, W], W as [G, M/G, K]
(K = C/G·kd·kh·kw) and Y as [N, G, M/G, P] (P = output cells), with the 3 spatial
axes and `geom` of windows.py.

Convolution:
- general: im2col + one BLAS product per group: Y_g = W_g · col(X_g). When
  an image has few output cells (P < COLUMNS), `chunk` images share one
  product (their columns side by side), so BLAS sees a wide matrix. With few
  output channels and a deep K (TRANSPOSED_CHANNELS, on scipy's BLAS) the forward
  product runs as Y_gᵀ = col(X_g)ᵀ · W_gᵀ into work memory, then is transposed into Y.
  (Products are cut into blocks of cells only where OpenBLAS has small-matrix
  kernels for them: kernels/blas.py's SMALL_PRODUCT_CELLS.)
  Pointwise convolutions (1x1, stride 1, no padding) skip im2col (over
  planes of fewer than COLUMNS cells they run in pointwise.py); for
  stride 1 with the output as wide as the input, each im2col row is one
  shifted contiguous copy of the image (edge columns zeroed after).
  Backward: dcol = W_gᵀ · dY_g then col2im (input); dW_gᵀ = Σ col · dY_gᵀ
  (weight; BLAS's faster order for these shapes).
- stride-1 2-D convolutions with at least 16 input channels per group and outputs at least 8 wide (16
  for the weight gradient): one product per kernel tap over shifted views of the padded image, no im2col
  (taps.py, whose TapPlan says which ops run there and makes their calls).
- depthwise (C/G = 1): a direct loop, over whole planes for wide outputs (the
  padded plane split into stride phases, flattened, nine taps a pass),
  channels-last for narrow ones (three taps a multiply-add over the channels);
  depthwise.py's DepthwisePlan lays it out, sizes its work memory and makes its calls.
`strategy` chooses the strategy of each op, in one place: depthwise, pointwise over small
planes (pointwise.py), taps (taps.py), or im2col here (Im2colPlan). Each strategy's plan is built from the
op's `Convolution` (kernels/windows.py) and the step's threads, and answers the same two questions: its
work memory (`scratch_bytes`) and its calls (`calls`); every binding below asks the chosen plan.
- work memory is the node's arena scratch (declared by `conv_scratch`,
  placed by the planner for that one step): im2col columns K·chunk·P, rows
  gathered from several images M/G·chunk·P (in a forward, also its
  transposed product), and dW's sums (G + 1)·K·M/G floats. Depthwise: one padded plane in
  phases and one framed plane, or one padded image and one output plane
  (dY framed), channels-last.
- threads (kernels/parallel_split.py): each kernel's `_parts` twin splits the batch
  (depthwise in planes: the image-channel pairs) into one part per thread,
  in one parallel region, each part with its own work memory. The parts
  share one thread's product width (COLUMNS / parts each), so together they
  hold about the work memory of one thread. Each part sums its images' dW
  into its own sums, added in part order after; where those sums outweigh
  the work memory (many channels over few cells), the weight gradient
  splits its output channels instead, each part over all images.

ConvTranspose runs the convolution kernels with X and Y exchanged: its forward is a convolution's
input gradient (col2im), its input gradient a convolution forward, its weight gradient a
convolution's weight gradient with X in dY's place.
"""
from __future__ import annotations

import numpy as np

from ..jit import njit, prange

from ..registry import ODTRAIN_DOMAIN, binding
from ..blas import NUMPY_OPENBLAS, gemm_blocks, product
from ..parallel_split import on_parts, parallel_twin, part_count, split, twin_of
from ..windows import FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT, Convolution, text, valid_range
from .depthwise import DepthwisePlan
from .pointwise import COLUMNS, MIN_CHANNELS, PointwisePlan, gather_rows, scatter_rows
from .taps import TapPlan

# Forward products with at most this many output channels per group and at least this deep a K run as
# Yᵀ = im2colᵀ · Wᵀ, then a transpose into Y, on the route to scipy's OpenBLAS (kernels/blas.py), which runs
# faster with the few channels as its row count (with shallower K or more channels it is slower). numpy's
# newer OpenBLAS runs the direct order faster, so there no product is transposed (bench_ops.ConvOps, Conv,
# with and without ODTRAIN_GEMM=numba).
TRANSPOSED_CHANNELS = 0 if NUMPY_OPENBLAS else 32
TRANSPOSED_DEPTH = 64
# A weight gradient splits its output channels only when each part's dW sums would hold more than this many
# elements: smaller sums cost little memory and little to add, and splitting the batch then runs faster
# (bench_ops.ConvOps, ConvWeightGrad; the runs: benchmarks/README.md, "Figures behind kernel choices").
CHANNEL_SPLIT_SUMS = 1 << 14


# ---- convolution: im2col + BLAS ------------------------------------------------------------------


@njit(cache=True, error_model="numpy", inline="always")
def _block_rows(row_offset, out_h, height):
    """Output rows oh in [a, b) whose input row oh + row_offset lies in [0, height)."""
    return min(max(-row_offset, 0), out_h), min(max(height - row_offset, 0), out_h)


@njit(cache=True, error_model="numpy", inline="always")
def _shifted_copy(flat, block, row_offset, offset, lo, hi, out_h, width):
    """block[oh·W + ow] = flat[(oh + row_offset)·W + ow + offset] where that cell is inside the plane, else 0:
    one contiguous copy, then the edge columns [0, lo) and [hi, W) of each row set to zero."""
    a, b = _block_rows(row_offset, out_h, flat.size // width)
    block[:a * width] = 0
    block[b * width:] = 0
    begin = (a + row_offset) * width + offset  # flat index of block cell a·W
    first = max(0, -begin)
    last = max(first, min((b - a) * width, flat.size - begin))  # empty when no row is inside
    target, source = block[a * width + first:a * width + last], flat[begin + first:]
    for t in range(target.size):
        target[t] = source[t]
    _zero_edges(block, a, b, lo, hi, width)


@njit(cache=True, error_model="numpy", inline="always")
def _zero_edges(block, a, b, lo, hi, width):
    """block[oh·W + ow] = 0 for rows [a, b) and columns outside [lo, hi) (a few cells per row)."""
    for oh in range(a, b):
        base = oh * width
        for ow in range(lo):
            block[base + ow] = 0
        for ow in range(hi, width):
            block[base + ow] = 0


@njit(cache=True, error_model="numpy", inline="always")
def _shifted_add(flat, block, row_offset, offset, lo, hi, out_h, width):
    """The adjoint of _shifted_copy: flat[(oh + row_offset)·W + ow + offset] += block[oh·W + ow] over the
    cells inside the plane (the edge columns of block are zeroed first, so one contiguous add does it)."""
    a, b = _block_rows(row_offset, out_h, flat.size // width)
    _zero_edges(block, a, b, lo, hi, width)
    begin = (a + row_offset) * width + offset
    first = max(0, -begin)
    last = max(first, min((b - a) * width, flat.size - begin))  # empty when no row is inside
    source, target = block[a * width + first:a * width + last], flat[begin + first:]
    for t in range(source.size):
        target[t] += source[t]


@njit(cache=True, error_model="numpy", inline="always")
def _window_columns(image, n0, nb, g, geom, col, adjoint):
    """im2col, or with `adjoint` its adjoint col2im: one walk over the rows (c, kd, kh, kw) of col and the
    blocks of output cells (b, od, oh) in each row, pairing each block with the image row it reads.
    im2col: col[(c, kd, kh, kw), b·P + (od, oh, ow)] = image[n0 + b, g, c, od·sd + kd·dd - pd, ...], 0 outside.
    col2im: image[n0 + b, g, c, ...] += col[(c, kd, kh, kw), b·P + ...] over the cells inside (image zeroed
    before; col is used as scratch). Inlined into _im2col and _col2im, where `adjoint` is a constant, so each
    compiles to its own loops."""
    depth, height, width = image.shape[3], image.shape[4], image.shape[5]
    out_d, out_h, out_w = geom[12], geom[13], geom[14]
    stride_w = geom[5]
    # stride 1 with the output as wide as the input: a row's valid cells are one contiguous run of the image
    shifted_block = stride_w == 1 and geom[4] == 1 and out_w == width
    cells = out_d * out_h * out_w
    plane_cells = out_h * out_w
    row = 0
    for c in range(image.shape[2]):
        for kd in range(geom[0]):
            for kh in range(geom[1]):
                for kw in range(geom[2]):
                    offset = kw * geom[8] - geom[11]
                    lo, hi = valid_range(offset, stride_w, width, out_w)
                    col_row = col[row]
                    for b in range(nb):
                        for od in range(out_d):
                            i_d = od * geom[3] + kd * geom[6] - geom[9]
                            start = b * cells + od * plane_cells
                            block = col_row[start:start + plane_cells]
                            if i_d < 0 or i_d >= depth:
                                if not adjoint:
                                    block[:] = 0
                                continue
                            plane = image[n0 + b, g, c, i_d]
                            if shifted_block:
                                if adjoint:
                                    _shifted_add(plane.reshape(-1), block, kh * geom[7] - geom[10], offset, lo, hi,
                                                 out_h, width)
                                else:
                                    _shifted_copy(plane.reshape(-1), block, kh * geom[7] - geom[10], offset, lo, hi,
                                                  out_h, width)
                                continue
                            for oh in range(out_h):
                                i_h = oh * geom[4] + kh * geom[7] - geom[10]
                                cells_row = block[oh * out_w:(oh + 1) * out_w]
                                if i_h < 0 or i_h >= height:
                                    if not adjoint:
                                        cells_row[:] = 0
                                    continue
                                # slices keep every index below non-negative, so the loops vectorise
                                inner, pixels = cells_row[lo:hi], plane[i_h][lo * stride_w + offset:]
                                if adjoint:
                                    if stride_w == 1:
                                        for t in range(inner.size):
                                            pixels[t] += inner[t]
                                    else:
                                        for t in range(inner.size):
                                            pixels[t * stride_w] += inner[t]
                                    continue
                                cells_row[:lo] = 0
                                cells_row[hi:] = 0
                                if stride_w == 1:
                                    for t in range(inner.size):
                                        inner[t] = pixels[t]
                                else:
                                    for t in range(inner.size):
                                        inner[t] = pixels[t * stride_w]
                    row += 1


@njit(cache=True, error_model="numpy")
def _im2col(x, n0, nb, g, geom, col):
    """col[(c, kd, kh, kw), b·P + (od, oh, ow)] = x[n0 + b, g, c, od·sd + kd·dd - pd, ...], 0 outside."""
    _window_columns(x, n0, nb, g, geom, col, False)


@njit(cache=True, error_model="numpy")
def _col2im(col, n0, nb, g, geom, dx):
    """dx[n0 + b, g, c, ...] += col[(c, kd, kh, kw), b·P + ...]: the adjoint of _im2col (dx zeroed before;
    col is used as scratch)."""
    _window_columns(dx, n0, nb, g, geom, col, True)


@njit(cache=True, error_model="numpy", inline="always")
def _weight_operands(dy, x, col_work, row_work, geom, pointwise, k, n0, nb, g, m0, m1):
    """(im2col columns [K, nb·P] of the images n0..n0+nb of group g, their dy rows [m1 - m0, nb·P] of the
    channels m0..m1): the operands of one chunk's weight-gradient product, views of x or dy where they can be."""
    cells = dy.shape[3]
    width = nb * cells
    if nb == 1 and pointwise:
        col = x[n0, g].reshape(k, cells)
    else:
        col = col_work[:k * width].reshape(k, width)
        _im2col(x, n0, nb, g, geom, col)
    if nb == 1:
        return col, dy[n0, g][m0:m1]
    grad_rows = row_work[:(m1 - m0) * width].reshape(m1 - m0, width)
    gather_rows(dy, n0, nb, g, m0, m1, grad_rows)
    return col, grad_rows


@njit(cache=True, error_model="numpy", inline="always")
def _transposed_to_images(product_t, y, n0, nb, g):
    """y[n0 + b, g, m, p] = product_t[b·P + p, m]: a chunk's transposed product into its images, in blocks of
    64 cells so both sides stay in cache."""
    per_group, cells = y.shape[2], y.shape[3]
    for b in range(nb):
        image = y[n0 + b, g]
        source = product_t[b * cells:(b + 1) * cells]
        for p0 in range(0, cells, 64):
            p1 = min(p0 + 64, cells)
            for m in range(per_group):
                target = image[m]
                for p in range(p0, p1):
                    target[p] = source[p, m]


@njit(cache=True, error_model="numpy")
def _conv_forward(x, w, bias, has_bias, y, col_work, row_work, geom, chunk, pointwise, transposed, begin, end):
    """y[n, g] = w[g] · im2col(x[n, g]) (+ bias) for the images n in [begin, end), `chunk` images per im2col
    and per product; `transposed`: the product computed as yᵀ = im2colᵀ · w[g]ᵀ into row_work, then transposed
    into y (BLAS's faster order when the output channels are few)."""
    groups, per_group, cells = y.shape[1], y.shape[2], y.shape[3]
    k = w.shape[2]
    for n0 in range(begin, end, chunk):
        nb = min(chunk, end - n0)
        width = nb * cells
        for g in range(groups):
            if nb == 1 and pointwise:
                product(w[g], x[n0, g].reshape(k, cells), y[n0, g])
                continue
            col = col_work[:k * width].reshape(k, width)
            _im2col(x, n0, nb, g, geom, col)
            if transposed:
                product_t = row_work[:width * per_group].reshape(width, per_group)
                product(col.T, w[g].T, product_t)
                _transposed_to_images(product_t, y, n0, nb, g)
                continue
            if nb == 1:
                product(w[g], col, y[n0, g])
                continue
            wide = row_work[:per_group * width].reshape(per_group, width)
            product(w[g], col, wide)
            scatter_rows(wide, n0, nb, g, 0, y, bias, False)  # the bias is added below, to every image
    if has_bias:
        for n in range(begin, end):
            for g in range(groups):
                for m in range(per_group):
                    value = bias[g, m]
                    target = y[n, g, m]
                    for p in range(cells):
                        target[p] += value


@twin_of(_conv_forward, range=("begin", "end"), replaces=("col_work", "row_work"), takes=("work", "columns"),
         because="each part runs on its own work memory")
@njit(cache=True, error_model="numpy", parallel=True)
def _conv_forward_parts(x, w, bias, has_bias, y, work, columns, geom, chunk, pointwise, transposed, bounds):
    """_conv_forward on the images [bounds[p], bounds[p + 1]) of each part p, in parallel, each part with
    its own work memory: work[p] holds its im2col columns, then its gathered rows (or transposed product)."""
    for part in prange(bounds.size - 1):
        mine = work[part]
        _conv_forward(x, w, bias, has_bias, y, mine[:columns], mine[columns:], geom, chunk, pointwise, transposed,
                      bounds[part], bounds[part + 1])


@njit(cache=True, error_model="numpy")
def _conv_input_grad(dy, w, dx, col_work, row_work, geom, chunk, pointwise, begin, end):
    """dx = col2im(w[g]ᵀ · dy[n, g]) for the images n in [begin, end) and every group, `chunk` images per
    product (their dy rows gathered side by side)."""
    groups, per_group, cells = dy.shape[1], dy.shape[2], dy.shape[3]
    k = w.shape[2]
    for n0 in range(begin, end, chunk):
        nb = min(chunk, end - n0)
        width = nb * cells
        for g in range(groups):
            if nb == 1 and pointwise:
                product(w[g].T, dy[n0, g], dx[n0, g].reshape(k, cells))
                continue
            col = col_work[:k * width].reshape(k, width)
            if nb == 1:
                product(w[g].T, dy[n0, g], col)
            else:
                gathered = row_work[:per_group * width].reshape(per_group, width)
                gather_rows(dy, n0, nb, g, 0, per_group, gathered)
                product(w[g].T, gathered, col)
            for b in range(nb):
                dx[n0 + b, g].reshape(-1)[:] = 0
            _col2im(col, n0, nb, g, geom, dx)


@twin_of(_conv_input_grad, range=("begin", "end"), replaces=("col_work", "row_work"), takes=("work", "columns"),
         because="each part runs on its own work memory")
@njit(cache=True, error_model="numpy", parallel=True)
def _conv_input_grad_parts(dy, w, dx, work, columns, geom, chunk, pointwise, bounds):
    """_conv_input_grad on the images of each part (bounds), in parallel, each with its own work[p]."""
    for part in prange(bounds.size - 1):
        mine = work[part]
        _conv_input_grad(dy, w, dx, mine[:columns], mine[columns:], geom, chunk, pointwise, bounds[part],
                         bounds[part + 1])


@njit(cache=True, error_model="numpy")
def _conv_weight_sums(dy, x, col_work, row_work, sums, chunk_product, geom, chunk, pointwise, begin, end):
    """sums[g] = Σ over the images n in [begin, end) of im2col(x[n, g]) · dy[n, g]ᵀ: dw[g] transposed
    (BLAS's faster order for these shapes); `chunk_product` holds one chunk's product before it is added."""
    groups, per_group = dy.shape[1], dy.shape[2]
    k = sums.shape[1]
    for n0 in range(begin, end, chunk):
        nb = min(chunk, end - n0)
        for g in range(groups):
            col, grad_rows = _weight_operands(dy, x, col_work, row_work, geom, pointwise, k, n0, nb, g, 0, per_group)
            if n0 == begin:
                product(col, grad_rows.T, sums[g])
            else:
                product(col, grad_rows.T, chunk_product)
                target = sums[g].reshape(-1)
                source = chunk_product.reshape(-1)
                for i in range(target.size):
                    target[i] += source[i]


@njit(cache=True, error_model="numpy")
def _conv_weight_grad(dy, x, dw, col_work, row_work, sums, chunk_product, geom, chunk, pointwise):
    """dw[g] = Σ over images of dy[n, g] · im2col(x[n, g])ᵀ, summed transposed in sums (_conv_weight_sums),
    then transposed into dw."""
    _conv_weight_sums(dy, x, col_work, row_work, sums, chunk_product, geom, chunk, pointwise, 0, dy.shape[0])
    for g in range(dw.shape[0]):
        for m in range(dw.shape[1]):
            for j in range(dw.shape[2]):
                dw[g, m, j] = sums[g, j, m]


@twin_of(_conv_weight_grad, replaces=("col_work", "row_work", "sums", "chunk_product"),
         takes=("work", "columns", "rows", "product_size"),
         because="each part sums its images' dW into its own sums, added in part order after")
@njit(cache=True, error_model="numpy", parallel=True)
def _conv_weight_grad_parts(dy, x, dw, work, columns, rows, product_size, geom, chunk, pointwise, bounds):
    """dw as _conv_weight_grad, each part (bounds) summing its images into its own sums in work[p] (after its
    columns and rows; then its chunk product when it has several chunks), in parallel; the parts' sums are
    then added in part order: the same at every run."""
    groups, per_group, k = dw.shape[0], dw.shape[1], dw.shape[2]
    size = groups * k * per_group
    start = columns + rows
    for part in prange(bounds.size - 1):
        mine = work[part]
        sums = mine[start:start + size].reshape(groups, k, per_group)
        # a part of one chunk never adds a product: its sums stand in
        chunk_product = mine[start + size:start + size + product_size].reshape(k, per_group) if product_size else sums[0]
        _conv_weight_sums(dy, x, mine[:columns], mine[columns:start], sums, chunk_product, geom, chunk, pointwise,
                          bounds[part], bounds[part + 1])
    for g in range(groups):
        for m in range(per_group):
            for j in range(k):
                total = work[0, start + (g * k + j) * per_group + m]
                for part in range(1, bounds.size - 1):
                    total += work[part, start + (g * k + j) * per_group + m]
                dw[g, m, j] = total


@njit(cache=True, error_model="numpy")
def _conv_weight_channels(dy, x, dw, col_work, row_work, sums, geom, chunk, pointwise, m0, m1):
    """dw[g, m] for the output channels m in [m0, m1), summed over every image: sums[g][:, m] = Σ col · dy[m]ᵀ,
    each chunk's product added by BLAS (beta = 1), then transposed into dw."""
    batch, groups, per_group, cells = dy.shape[0], dy.shape[1], dy.shape[2], dy.shape[3]
    k = sums.shape[1]
    for n0 in range(0, batch, chunk):
        nb = min(chunk, batch - n0)
        width = nb * cells
        for g in range(groups):
            col, grad_rows = _weight_operands(dy, x, col_work, row_work, geom, pointwise, k, n0, nb, g, m0, m1)
            gemm_blocks(0, 1, k, m1 - m0, width, 1.0, col, 0, width, grad_rows, 0, width, 0.0 if n0 == 0 else 1.0,
                        sums, (g * k) * per_group + m0, per_group)
    for g in range(groups):
        for m in range(m0, m1):
            for j in range(k):
                dw[g, m, j] = sums[g, j, m]


@twin_of(_conv_weight_channels, range=("m0", "m1"), replaces=("col_work", "row_work"), takes=("work", "columns"),
         because="each part runs on its own work memory")
@njit(cache=True, error_model="numpy", parallel=True)
def _conv_weight_grad_channel_parts(dy, x, dw, work, columns, sums, geom, chunk, pointwise, bounds):
    """dw as _conv_weight_grad, each part (bounds) computing its own output channels over every image, with
    its own work memory (im2col columns, then gathered rows): no partial sums to add."""
    for part in prange(bounds.size - 1):
        mine = work[part]
        _conv_weight_channels(dy, x, dw, mine[:columns], mine[columns:], sums, geom, chunk, pointwise, bounds[part],
                              bounds[part + 1])


@njit(cache=True, error_model="numpy")
def _conv_bias_grad(dy, db, m0, m1):
    """db[m] = Σ_n Σ_p dy[n, m, p], summed in float64, for the channels m in [m0, m1)."""
    for m in range(m0, m1):
        total = 0.0
        for n in range(dy.shape[0]):
            row = dy[n, m]
            partial = np.float32(0.0)
            for p in range(row.size):
                partial += row[p]
            total += partial
        db[m] = total

_conv_bias_grad_parts = parallel_twin(_conv_bias_grad, range=("m0", "m1"))


class Im2colPlan:
    """How a convolution's op runs on im2col + BLAS (every convolution may): how many parts of the batch run
    in parallel (kernels/parallel_split.py), images per product, work sizes per part, and for a weight gradient
    whose sums outweigh its work memory, parts of the output channels instead."""

    @staticmethod
    def takes(conv: Convolution, op: int) -> bool:
        return True

    def __init__(self, conv: Convolution, threads: int):
        batch, cells, k, out_per_group = conv.batch, conv.cells, conv.k, conv.out_per_group
        self.conv = conv
        self.parts = part_count(threads, batch, conv.multiply_adds)
        per_part = -(-batch // self.parts)  # images of the largest part
        # the parts share the columns of one product: together they hold no more work memory than one thread
        self.chunk = int(max(1, min(per_part, -(-COLUMNS // (self.parts * max(cells, 1))))))
        width = self.chunk * cells
        # forward products as yᵀ = im2colᵀ · Wᵀ (then transposed into Y) for few output channels and a deep K
        self.transposed = bool(not conv.pointwise and out_per_group <= TRANSPOSED_CHANNELS and k >= TRANSPOSED_DEPTH)
        # elements of work memory per part: im2col columns, gathered rows (several images), a partial dW
        self.columns = 0 if conv.pointwise and self.chunk == 1 else k * width
        self.rows = 0 if self.chunk == 1 else out_per_group * width
        # the forward's rows: gathered from several images, or its transposed product
        self.forward_rows = out_per_group * width if self.transposed else self.rows
        # the weight gradient's transposed sums [G, K, M/G], and one product [K, M/G] to add from later chunks
        self.product = k * out_per_group if per_part > self.chunk else 0
        self.partial = conv.groups * k * out_per_group + self.product
        # Parts of the batch sum their own weight gradients, then add them. Where those sums outweigh the
        # parts' im2col memory (many channels over few cells) and CHANNEL_SPLIT_SUMS, the weight
        # gradient splits its output channels instead: each part all images, no sums to add. Its work memory
        # per part: one thread's columns, and its channels' gathered rows.
        self.channel_parts = 1
        if self.parts > 1 and self.partial > max(self.columns + self.rows, CHANNEL_SPLIT_SUMS):
            self.channel_parts = part_count(threads, out_per_group // MIN_CHANNELS, conv.multiply_adds)
        self.channel_chunk = int(max(1, min(batch, -(-COLUMNS // max(cells, 1)))))
        width = self.channel_chunk * cells
        self.channel_columns = 0 if conv.pointwise and self.channel_chunk == 1 else k * width
        self.channel_rows = 0 if self.channel_chunk == 1 else -(-out_per_group // self.channel_parts) * width

    def scratch_bytes(self, op: int, itemsize: int = 4) -> int:
        """Bytes of work memory of `op` for all parts (the dW sums only for a weight gradient, the forward's
        rows for a forward), in elements of `itemsize` bytes (float32, or float64 for the integer convolutions
        of quantize.py)."""
        if op == WEIGHT_GRADIENT and self.channel_parts > 1:
            sums = self.conv.groups * self.conv.k * self.conv.out_per_group
            return itemsize * (self.channel_parts * (self.channel_columns + self.channel_rows) + sums)
        extra = self.partial if op == WEIGHT_GRADIENT else 0
        rows = self.forward_rows if op == FORWARD else self.rows
        return itemsize * self.parts * (self.columns + rows + extra)

    def calls(self, op: int, arrays: tuple, scratch) -> list:
        """The call of `op` on `arrays` (X as [N, G, C/G, D, H, W], W as [G, M/G, K], Y as [N, G, M/G, P]; the
        forward's bias [G, M/G] and its flag), serial or in parts."""
        if op == FORWARD:
            columns, rows = self._work(scratch, dtype=arrays[0].dtype, forward=True)
            call = (_conv_forward, arrays + (columns, rows, self.conv.geom, self.chunk, self.conv.pointwise,
                                             self.transposed, 0, self.conv.batch))
        elif op == INPUT_GRADIENT:
            columns, rows = self._work(scratch)
            call = (_conv_input_grad, arrays + (columns, rows, self.conv.geom, self.chunk, self.conv.pointwise, 0,
                                                self.conv.batch))
        elif self.channel_parts > 1:
            return [self._weight_channel_parts(arrays, scratch)]
        else:
            columns, rows, sums, product = self._work(scratch, sums=True)
            call = (_conv_weight_grad, arrays + (columns, rows, sums, product, self.conv.geom, self.chunk,
                                                 self.conv.pointwise))
            return [on_parts(call, self.conv.batch, self.parts, (self._per_part(scratch), self.columns, self.rows,
                                                                  self.product))]
        return [on_parts(call, self.conv.batch, self.parts, (self._per_part(scratch), self.columns))]

    def _weight_channel_parts(self, arrays: tuple, scratch) -> tuple:
        """The weight gradient's call on parts of the output channels, each over all images."""
        memory = scratch.view(np.float32)
        columns, per_part = self.channel_columns, self.channel_columns + self.channel_rows
        work = memory[:self.channel_parts * per_part].reshape(self.channel_parts, per_part)
        conv = self.conv
        sums = memory[work.size:].reshape(conv.groups, conv.k, conv.out_per_group)
        call = (_conv_weight_channels, arrays + (work[0, :columns], work[0, columns:], sums, conv.geom,
                                                 self.channel_chunk, conv.pointwise, 0, conv.out_per_group))
        return on_parts(call, conv.out_per_group, self.channel_parts, (work, columns))

    def _per_part(self, scratch) -> np.ndarray:
        """The scratch as float32 [parts, elements per part]."""
        memory = scratch.view(np.float32) if scratch is not None else np.zeros(0, np.float32)
        return memory.reshape(self.parts, -1) if memory.size else np.zeros((self.parts, 0), np.float32)

    def _work(self, scratch, sums: bool = False, dtype=np.float32, forward: bool = False):
        """(columns, rows[, dW sums [G, K, M/G], product [K, M/G]]) as views of the node's scratch (float32,
        or the dtype the convolution runs in; a `forward` convolution's rows)."""
        memory = scratch.view(dtype) if scratch is not None else np.zeros(0, dtype)
        columns = memory[:self.columns]
        rows = memory[self.columns:self.columns + (self.forward_rows if forward else self.rows)]
        if not sums:
            return columns, rows
        conv = self.conv
        start = self.columns + self.rows
        size = conv.groups * conv.k * conv.out_per_group
        totals = memory[start:start + size].reshape(conv.groups, conv.k, conv.out_per_group)
        rest = memory[start + size:start + self.partial]
        product = rest.reshape(conv.k, conv.out_per_group) if rest.size else np.zeros((1, 1), np.float32)
        return columns, rows, totals, product


# ---- the one choice of strategy, and the bindings ---------------------------------------------------------------
# Every binding below runs one op of a convolution (FORWARD, INPUT_GRADIENT or WEIGHT_GRADIENT) through the plan
# of the strategy that takes it; each strategy's plan has the same three answers: takes(conv, op), and from
# plan(conv, threads): scratch_bytes(op, itemsize) and calls(op, arrays, scratch).

STRATEGIES = (DepthwisePlan, PointwisePlan, TapPlan, Im2colPlan)  # the first that takes an op runs it

# The convolution op each op type runs. ConvTranspose(X, W) is the input gradient of the convolution of Y by W
# (X and Y exchanged): its forward is that convolution's input gradient, its input gradient a forward, its weight
# gradient a weight gradient with X in dY's place.
OPS = {"Conv": FORWARD, "ConvInputGrad": INPUT_GRADIENT, "ConvWeightGrad": WEIGHT_GRADIENT,
       "ConvTranspose": INPUT_GRADIENT, "ConvTransposeInputGrad": FORWARD, "ConvTransposeWeightGrad": WEIGHT_GRADIENT}
EXCHANGED = ("ConvTransposeWeightGrad",)  # its inputs (dY, X) are the convolution's (X, dY)


def strategy(op: int, conv: Convolution, threads: int = 1):
    """The plan of the strategy that runs `op` of `conv` at `threads` threads: depthwise, pointwise over small
    planes, taps, or im2col, chosen here and nowhere else."""
    return next(plan for plan in STRATEGIES if plan.takes(conv, op))(conv, threads)


def _operands(op_type: str, first, second, out) -> tuple:
    """The op's two inputs and output in its convolution op's order: FORWARD (X, W, Y), INPUT_GRADIENT
    (dY, W, dX), WEIGHT_GRADIENT (dY, X, dW)."""
    return (second, first, out) if op_type in EXCHANGED else (first, second, out)


def _plan(op_type: str, first, second, out, threads=1, **attrs):
    """(the convolution op, the convolution, the plan that runs it) of `op_type` with these shapes of its inputs
    and output."""
    op = OPS[op_type]
    a, b, c = _operands(op_type, first, second, out)
    x, w, y = (a, b, c) if op == FORWARD else (c, b, a) if op == INPUT_GRADIENT else (b, c, a)
    conv = _transposed(x, w, y, **attrs) if op_type.startswith("ConvTranspose") else Convolution(x, w, y, **attrs)
    return op, conv, strategy(op, conv, threads)


def _views(op: int, conv: Convolution, arrays: tuple, bias=None) -> tuple:
    """The op's arrays as every strategy reads them: X as [N, G, C/G, D, H, W], W as [G, M/G, K], Y as
    [N, G, M/G, P]; a forward also gets its bias as [G, M/G] (zeros when absent) and whether it has one."""
    a, b, c = arrays
    if op == FORWARD:
        bias_view = bias.reshape(conv.groups, conv.out_per_group) if bias is not None else np.zeros((1, 1), a.dtype)
        return a.reshape(conv.x6), b.reshape(conv.w3), bias_view, bias is not None, c.reshape(conv.y4)
    if op == INPUT_GRADIENT:
        return a.reshape(conv.y4), b.reshape(conv.w3), c.reshape(conv.x6)
    return a.reshape(conv.y4), b.reshape(conv.x6), c.reshape(conv.w3)


def _calls(op_type: str, inputs, outputs, scratch, attrs, bias=None) -> list:
    """The calls of `op_type` on its first two inputs and its output (and a convolution's bias)."""
    first, second, out = inputs[0], inputs[1], outputs[0]
    op, conv, plan = _plan(op_type, first.shape, second.shape, out.shape, **attrs)
    return plan.calls(op, _views(op, conv, _operands(op_type, first, second, out), bias), scratch)


def conv_scratch(op_type: str, itemsize: int | None = None):
    """The scratch-size rule of a convolution op: bytes of its strategy's work memory, in elements of the first
    input's size (or of `itemsize`)."""

    def size(specs_in, specs_out, **attrs):
        op, _, plan = _plan(op_type, specs_in[0][0], specs_in[1][0], specs_out[0][0], **attrs)
        return plan.scratch_bytes(op, itemsize or np.dtype(specs_in[0][1]).itemsize)

    return size


@binding("Conv", scratch=conv_scratch("Conv"), parallel=True)
def Conv(inputs, outputs, scratch=None, **attrs):
    bias = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    return _calls("Conv", inputs, outputs, scratch, attrs, bias)


@binding("ConvInputGrad", ODTRAIN_DOMAIN, scratch=conv_scratch("ConvInputGrad"), parallel=True)
def ConvInputGrad(inputs, outputs, scratch=None, **attrs):
    return _calls("ConvInputGrad", inputs, outputs, scratch, attrs)


@binding("ConvWeightGrad", ODTRAIN_DOMAIN, scratch=conv_scratch("ConvWeightGrad"), parallel=True)
def ConvWeightGrad(inputs, outputs, scratch=None, **attrs):
    return _calls("ConvWeightGrad", inputs, outputs, scratch, attrs)


@binding("ConvBiasGrad", ODTRAIN_DOMAIN, parallel=True)
def ConvBiasGrad(inputs, outputs, threads=1):
    dy = inputs[0]
    args = (dy.reshape(dy.shape[0], dy.shape[1], -1), outputs[0])
    return [split((_conv_bias_grad, args + (0, dy.shape[1])), dy.shape[1], dy.size, threads)]


# ---- ConvTranspose: the convolution kernels with X and Y exchanged --------------------------------
# ConvTranspose(X, W) is the input gradient of the convolution of Y by W, so that convolution (_transposed)
# runs it: forward as its input gradient, dX as its forward, dW as its weight gradient (OPS above).


def _transpose_begin_pads(x_spatial, y_spatial, kernel, auto_pad="NOTSET", dilations=None, output_padding=None,
                          output_shape=None, pads=None, strides=None):
    """Begin pads of a ConvTranspose whose output dims are known (the type rule chose them)."""
    rank = len(x_spatial)
    strides = list(strides) if strides else [1] * rank
    dilations = list(dilations) if dilations else [1] * rank
    output_padding = list(output_padding) if output_padding else [0] * rank
    pads = list(pads) if pads else [0] * (2 * rank)
    auto_pad = text(auto_pad)
    begin = []
    for axis in range(rank):
        natural = (strides[axis] * (x_spatial[axis] - 1) + output_padding[axis]
                   + (kernel[axis] - 1) * dilations[axis] + 1)
        total = natural - y_spatial[axis]
        if output_shape or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            begin.append(0 if total < 0 else total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
        elif auto_pad == "VALID":
            begin.append(0)
        else:
            begin.append(int(pads[axis]))
    if min(begin) < 0:
        raise ValueError(f"negative begin pads {begin} are not supported")
    return begin


def _transposed(x_shape, w_shape, y_shape, group=1, auto_pad="NOTSET", dilations=None, kernel_shape=None,
                output_padding=None, output_shape=None, pads=None, strides=None) -> Convolution:
    """The convolution of ConvTranspose's Y (x_shape here) by W into its X (y_shape here)."""
    rank = len(x_shape) - 2
    begin = _transpose_begin_pads(y_shape[2:], x_shape[2:], [int(k) for k in w_shape[2:]], auto_pad, dilations,
                                  output_padding, output_shape, pads, strides)
    return Convolution(x_shape, w_shape, y_shape, group, "NOTSET", dilations, None, begin + [0] * rank, strides)


@njit(cache=True, error_model="numpy")
def _add_channel_bias(y, bias):
    """y[n, m, p] += bias[m]."""
    for n in range(y.shape[0]):
        for m in range(y.shape[1]):
            value = bias[m]
            row = y[n, m]
            for p in range(row.size):
                row[p] += value


# ConvTranspose's scratch is counted in float32 elements whatever its dtype (it runs in float32 only).
@binding("ConvTranspose", scratch=conv_scratch("ConvTranspose", itemsize=4), parallel=True)
def ConvTranspose(inputs, outputs, scratch=None, **attrs):
    calls = _calls("ConvTranspose", inputs, outputs, scratch, attrs)
    if len(inputs) > 2 and inputs[2] is not None:
        y = outputs[0]
        calls.append((_add_channel_bias, (y.reshape(y.shape[0], y.shape[1], -1), inputs[2])))
    return calls


@binding("ConvTransposeInputGrad", ODTRAIN_DOMAIN, scratch=conv_scratch("ConvTransposeInputGrad", itemsize=4),
         parallel=True)
def ConvTransposeInputGrad(inputs, outputs, scratch=None, **attrs):
    return _calls("ConvTransposeInputGrad", inputs, outputs, scratch, attrs)


@binding("ConvTransposeWeightGrad", ODTRAIN_DOMAIN, scratch=conv_scratch("ConvTransposeWeightGrad", itemsize=4),
         parallel=True)
def ConvTransposeWeightGrad(inputs, outputs, scratch=None, **attrs):
    return _calls("ConvTransposeWeightGrad", inputs, outputs, scratch, attrs)
