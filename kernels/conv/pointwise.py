"""Kernels: pointwise convolutions (1x1 kernel, stride 1, no padding) over small planes, split by channels.

A pointwise convolution is a product per image over its P cells: Y[n] = W · X[n], dX[n] = Wᵀ · dY[n] and
dW = Σ_n dY[n] · X[n]ᵀ (per group, X[n] as [C/G, P]). Over planes of P < COLUMNS cells these products
are too thin for BLAS, so the images of a chunk are gathered side by side (their channel rows, [channels,
nb·P]), one product runs over the chunk, and the forward and input gradient scatter its rows back into
their images. dW takes each chunk's product straight into dW (beta = 1 after the first chunk): no partial
sums and no transpose.

Threads split the output channels of that one product, not the batch: splitting the batch would give each
part a product of half the columns against the whole W, and W's packing, which these thin products are
bound by, would be done once per part. So each part owns a block of rows of the output (Y's channels, dX's
channels, dW's rows or, when C/G > M/G, dW's columns), gathers the other operand whole (the smaller share
of the work) and runs its product and scatter; nothing is added across parts, so a result has the same
sums at every thread count.

Work memory per part (`PointwisePlan.layout`), in the convolution's dtype: the whole gathered operand of a chunk
and its own block, chunk·P elements a channel: small, since only small planes take this route.
"""
from __future__ import annotations

import numpy as np

from ..jit import njit, prange

from ..blas import gemm_blocks, product
from ..parallel_split import on_parts, part_bounds, part_count, twin_of
from ..windows import FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT

COLUMNS = 512  # convolutions gather images into one product until it has this many columns (also kernels/conv/__init__.py)
MIN_CHANNELS = 16  # output channels per part when parts split channels (narrower products lose speed)


@njit(cache=True, error_model="numpy", inline="always")
def gather_rows(a, n0, nb, g, c0, c1, out):
    """out[c - c0, b·P + p] = a[n0 + b, g, c, p] for the channels c in [c0, c1): rows of nb images side by
    side (a is [N, G, channels, P]; also kernels/conv/__init__.py's gathered dY rows)."""
    cells = a.shape[3]
    for c in range(c0, c1):
        row = out[c - c0]
        for b in range(nb):
            source, target = a[n0 + b, g, c], row[b * cells:(b + 1) * cells]
            for p in range(cells):
                target[p] = source[p]


@njit(cache=True, error_model="numpy", inline="always")
def scatter_rows(rows, n0, nb, g, c0, a, bias, has_bias):
    """a[n0 + b, g, c0 + r, p] = rows[r, b·P + p] (+ bias[g, c0 + r]): gather_rows' adjoint, each cell written
    once."""
    cells = a.shape[3]
    for r in range(rows.shape[0]):
        for b in range(nb):
            source, target = rows[r, b * cells:(b + 1) * cells], a[n0 + b, g, c0 + r]
            if has_bias:
                value = bias[g, c0 + r]
                for p in range(cells):
                    target[p] = source[p] + value
            else:
                for p in range(cells):
                    target[p] = source[p]


@njit(cache=True, error_model="numpy")
def _pointwise_forward(x, w, bias, has_bias, y, work, chunk, m0, m1):
    """y[n, g, m] = w[g, m] · x[n, g] (+ bias[g, m]) for the output channels m in [m0, m1) of every group,
    `chunk` images per product (x [N, G, C/G, P], y [N, G, M/G, P], w [G, M/G, C/G])."""
    batch, groups, cells = y.shape[0], y.shape[1], y.shape[3]
    k = w.shape[2]
    for n0 in range(0, batch, chunk):
        nb = min(chunk, batch - n0)
        width = nb * cells
        for g in range(groups):
            if nb == 1:
                product(w[g][m0:m1], x[n0, g], y[n0, g][m0:m1])
                if has_bias:
                    for m in range(m0, m1):
                        y[n0, g, m] += bias[g, m]
                continue
            columns = work[:k * width].reshape(k, width)
            gather_rows(x, n0, nb, g, 0, k, columns)
            rows = work[k * width:(k + m1 - m0) * width].reshape(m1 - m0, width)
            product(w[g][m0:m1], columns, rows)
            scatter_rows(rows, n0, nb, g, m0, y, bias, has_bias)


@njit(cache=True, error_model="numpy")
def _pointwise_input_grad(dy, w, dx, work, chunk, c0, c1):
    """dx[n, g, c] = w[g][:, c]ᵀ · dy[n, g] for the input channels c in [c0, c1) of every group, `chunk` images
    per product."""
    batch, groups, per_group, cells = dy.shape[0], dy.shape[1], dy.shape[2], dy.shape[3]
    for n0 in range(0, batch, chunk):
        nb = min(chunk, batch - n0)
        width = nb * cells
        for g in range(groups):
            weights = w[g][:, c0:c1].T
            if nb == 1:
                product(weights, dy[n0, g], dx[n0, g][c0:c1])
                continue
            gathered = work[:per_group * width].reshape(per_group, width)
            gather_rows(dy, n0, nb, g, 0, per_group, gathered)
            rows = work[per_group * width:(per_group + c1 - c0) * width].reshape(c1 - c0, width)
            product(weights, gathered, rows)
            scatter_rows(rows, n0, nb, g, c0, dx, w[:, :1, 0], False)


@njit(cache=True, error_model="numpy")
def _pointwise_weight_grad(dy, x, dw, work, chunk, m0, m1, c0, c1):
    """dw[g, m0:m1, c0:c1] = Σ_n dy[n, g, m0:m1] · x[n, g, c0:c1]ᵀ for every group, `chunk` images per product,
    each chunk's product added into dw by BLAS (beta = 1)."""
    batch, groups, per_group, cells = dy.shape[0], dy.shape[1], dy.shape[2], dy.shape[3]
    k = x.shape[2]
    rows, columns = m1 - m0, c1 - c0
    for n0 in range(0, batch, chunk):
        nb = min(chunk, batch - n0)
        width = nb * cells
        beta = 0.0 if n0 == 0 else 1.0
        for g in range(groups):
            target = (g * per_group + m0) * k + c0
            if nb == 1:
                gemm_blocks(0, 1, rows, columns, cells, 1.0, dy[n0, g], m0 * cells, cells, x[n0, g], c0 * cells, cells,
                            beta, dw, target, k)
                continue
            gathered_dy = work[:rows * width].reshape(rows, width)
            gather_rows(dy, n0, nb, g, m0, m1, gathered_dy)
            gathered_x = work[rows * width:(rows + columns) * width].reshape(columns, width)
            gather_rows(x, n0, nb, g, c0, c1, gathered_x)
            gemm_blocks(0, 1, rows, columns, width, 1.0, gathered_dy, 0, width, gathered_x, 0, width, beta, dw, target, k)


@twin_of(_pointwise_forward, range=("m0", "m1"), replaces=("work",), takes=("work",),
         because="each part runs on its own work memory")
@njit(cache=True, error_model="numpy", parallel=True)
def _pointwise_forward_parts(x, w, bias, has_bias, y, work, chunk, bounds):
    """_pointwise_forward on the output channels [bounds[p], bounds[p + 1]) of each part p, in parallel."""
    for part in prange(bounds.size - 1):
        _pointwise_forward(x, w, bias, has_bias, y, work[part], chunk, bounds[part], bounds[part + 1])


@twin_of(_pointwise_input_grad, range=("c0", "c1"), replaces=("work",), takes=("work",),
         because="each part runs on its own work memory")
@njit(cache=True, error_model="numpy", parallel=True)
def _pointwise_input_grad_parts(dy, w, dx, work, chunk, bounds):
    """_pointwise_input_grad on the input channels [bounds[p], bounds[p + 1]) of each part p, in parallel."""
    for part in prange(bounds.size - 1):
        _pointwise_input_grad(dy, w, dx, work[part], chunk, bounds[part], bounds[part + 1])


@twin_of(_pointwise_weight_grad, range=("m0", "m1", "c0", "c1"), replaces=("work",), takes=("work", "split_inputs"),
         because="each part runs on its own work memory, over parts of channels or images as the plan says")
@njit(cache=True, error_model="numpy", parallel=True)
def _pointwise_weight_grad_parts(dy, x, dw, work, split_inputs, chunk, bounds):
    """_pointwise_weight_grad on a block of dW per part p, in parallel: its rows [bounds[p], bounds[p + 1]),
    or with `split_inputs` its columns."""
    per_group, k = dy.shape[2], x.shape[2]
    for part in prange(bounds.size - 1):
        first, last = bounds[part], bounds[part + 1]
        if split_inputs:
            _pointwise_weight_grad(dy, x, dw, work[part], chunk, 0, per_group, first, last)
        else:
            _pointwise_weight_grad(dy, x, dw, work[part], chunk, first, last, 0, k)


# ---- the plan: whether a convolution runs here, each op's layout, work memory and calls ----------------------


class OpLayout:
    """How one op of a pointwise convolution runs: `chunk` images per product; parts over `bounds` of the split
    channels (those of dW's columns when `split_inputs`), each with `per_part` elements of work memory."""

    def __init__(self, chunk: int, bounds: np.ndarray, split_inputs: bool, per_part: int):
        self.chunk, self.bounds, self.split_inputs, self.per_part = chunk, bounds, split_inputs, per_part

    @property
    def parts(self) -> int:
        return self.bounds.size - 1


class PointwisePlan:
    """How a pointwise convolution over planes of fewer than COLUMNS cells (`takes`) runs at the step's
    threads: each op's layout (`layout`), its work memory and its calls."""

    @staticmethod
    def takes(conv, op: int) -> bool:
        return conv.pointwise and conv.cells < COLUMNS

    def __init__(self, conv, threads: int):
        self.conv, self.threads = conv, threads

    def layout(self, op: int) -> OpLayout:
        """The layout of the FORWARD, INPUT_GRADIENT or WEIGHT_GRADIENT op."""
        conv = self.conv
        batch, cells, in_per_group, out_per_group = conv.batch, conv.cells, conv.in_per_group, conv.out_per_group
        chunk = int(max(1, min(batch, -(-COLUMNS // max(cells, 1)))))
        split_inputs = op == INPUT_GRADIENT or (op == WEIGHT_GRADIENT and in_per_group > out_per_group)
        split, whole = (in_per_group, out_per_group) if split_inputs else (out_per_group, in_per_group)
        parts = part_count(self.threads, split // MIN_CHANNELS, conv.multiply_adds)
        own = -(-split // parts)
        if op == WEIGHT_GRADIENT:  # both operands gathered, unless one image per chunk (views then)
            per_part = 0 if chunk == 1 else (own + whole) * chunk * cells
        else:  # the gathered input (views for one image), and the product's rows before the scatter
            per_part = (0 if chunk == 1 else whole * chunk * cells) + own * chunk * cells
        return OpLayout(chunk, part_bounds(split, parts), split_inputs, per_part)

    def scratch_bytes(self, op: int, itemsize: int = 4) -> int:
        """Bytes of work memory of `op` for all parts, in elements of `itemsize` bytes."""
        layout = self.layout(op)
        return itemsize * layout.parts * layout.per_part

    def calls(self, op: int, arrays: tuple, scratch) -> list:
        """The call of `op` on `arrays` (X as [N, G, C/G, D, H, W], W or dW as [G, M/G, C/G], Y as [N, G, M/G, P];
        the forward's bias [G, M/G] and its flag), X read as planes [N, G, C/G, P]: the serial kernel over all
        channels, or its parallel twin."""
        arrays = tuple(a.reshape(a.shape[:3] + (-1,)) if np.ndim(a) == 6 else a for a in arrays)
        layout, dtype = self.layout(op), arrays[0].dtype
        memory = scratch.view(dtype) if scratch is not None and scratch.size else np.zeros(0, dtype)
        work = memory[:layout.parts * layout.per_part].reshape(layout.parts, layout.per_part)
        units = int(layout.bounds[-1])
        if op == WEIGHT_GRADIENT:
            dw = arrays[2]
            call = (_pointwise_weight_grad, arrays + (work[0], layout.chunk, 0, dw.shape[1], 0, dw.shape[2]))
            return [on_parts(call, units, layout.parts, (work, layout.split_inputs))]
        kernel = _pointwise_forward if op == FORWARD else _pointwise_input_grad
        return [on_parts((kernel, arrays + (work[0], layout.chunk, 0, units)), units, layout.parts, (work,))]
