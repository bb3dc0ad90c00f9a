"""Fused softmax cross-entropy and negative log-likelihood, forward and backward; and the vocabulary product
fused with a class-last cross-entropy (LinearCrossEntropy, stated at its kernels below).

Scores are viewed as [N, C, D] (D = 1 for [N, C]) and labels as [N, D]:
each (n, d) is one sample. With class weights w and ignore_index:
    loss(n, d) = -w[y] · (x[n, y, d] - logsumexp_c x[n, c, d]),  w = 0 when y is ignored
    mean: Σ loss / Σ w[y];  sum: Σ loss;  none: loss per sample
    dx[n, c, d] = g(n, d) · w[y] · (softmax(x)[n, c, d] - [c == y])   (÷ Σ w[y] for mean)
Negative log-likelihood takes log-probabilities x: loss(n, d) = -w[y] · x[n, y, d], reduced
alike, and dx[n, c, d] = -g(n, d) · w[y] · [c == y].
"""
from __future__ import annotations

import numpy as np

from .jit import njit, prange

from .registry import ODTRAIN_DOMAIN, binding
from .blas import gemm_blocks
from .layout import flat, float_buffers
from .parallel_split import on_parts, part_count, split, twin_of
from .scalar import fast_exp
from .stored_weights import INT4, INT8, PANEL_ELEMENTS, panel_product, stored_values

REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}
REDUCE = {"reassoc"}  # the row sums may reorder: LLVM vectorises them


@njit(cache=True, error_model="numpy")
def _sample_weight(labels, weights, has_weights, ignore_index, classes, n, d):
    y = labels[n, d]
    if y == ignore_index:
        return y, 0.0
    if y < 0 or y >= classes:
        raise ValueError("a label is outside [0, number of classes)")
    return y, weights[y] if has_weights else 1.0


@njit(cache=True, error_model="numpy")
def _logsumexp(x, n, d):
    top = x[n, 0, d]
    for c in range(1, x.shape[1]):
        top = max(top, x[n, c, d])
    total = 0.0
    for c in range(x.shape[1]):
        total += np.exp(x[n, c, d] - top)
    return top + np.log(total)


@njit(cache=True, error_model="numpy")
def _class_loss(x, labels, weights, has_weights, ignore_index, reduction, softmax, loss, log_prob, want_log_prob):
    """loss ← cross-entropy of softmax(x) against labels (softmax) or negative log-likelihood of the
    log-probabilities x; log_prob ← log softmax(x) if wanted."""
    total, weight_sum = 0.0, 0.0
    for n in range(x.shape[0]):
        for d in range(x.shape[2]):
            lse = _logsumexp(x, n, d) if softmax else 0.0
            if want_log_prob:
                for c in range(x.shape[1]):
                    log_prob[n, c, d] = x[n, c, d] - lse
            y, w = _sample_weight(labels, weights, has_weights, ignore_index, x.shape[1], n, d)
            value = 0.0 if w == 0.0 else -w * (x[n, y, d] - lse)
            if reduction == 0:
                loss[n * x.shape[2] + d] = value
            total += value
            weight_sum += w
    if reduction == 1:
        loss[0] = total
    elif reduction == 2:
        loss[0] = total / weight_sum if weight_sum > 0 else 0.0


@njit(cache=True, error_model="numpy")
def _class_loss_backward(dloss, x, labels, weights, has_weights, ignore_index, reduction, softmax, dx):
    """dx ← gradient of the loss with respect to the scores (softmax) or log-probabilities x."""
    weight_sum = 0.0
    if reduction == 2:
        for n in range(x.shape[0]):
            for d in range(x.shape[2]):
                weight_sum += _sample_weight(labels, weights, has_weights, ignore_index, x.shape[1], n, d)[1]
    for n in range(x.shape[0]):
        for d in range(x.shape[2]):
            y, w = _sample_weight(labels, weights, has_weights, ignore_index, x.shape[1], n, d)
            g = dloss[n * x.shape[2] + d] if reduction == 0 else dloss[0]
            if reduction == 2:
                g = g / weight_sum if weight_sum > 0 else 0.0
            scale = g * w
            if scale != 0.0 and softmax:
                lse = _logsumexp(x, n, d)
                for c in range(x.shape[1]):
                    dx[n, c, d] = scale * np.exp(x[n, c, d] - lse)
            else:
                for c in range(x.shape[1]):
                    dx[n, c, d] = 0.0
            if scale != 0.0:  # an ignored label (weight 0) may lie outside the classes
                dx[n, y, d] -= scale


def _as_ncd(scores: np.ndarray) -> np.ndarray:
    return scores.reshape(scores.shape[0], scores.shape[1], -1)


def _common(inputs, reduction, ignore_index):
    scores, labels = inputs[0], inputs[1]
    weights = inputs[2] if len(inputs) > 2 and inputs[2] is not None else np.ones(1, dtype=scores.dtype)
    has_weights = len(inputs) > 2 and inputs[2] is not None
    labels = labels.reshape(labels.shape[0], -1) if labels.ndim else labels.reshape(1, 1)
    ignore = np.int64(ignore_index) if ignore_index is not None else np.int64(-(2 ** 62))
    return _as_ncd(scores), labels, weights, has_weights, ignore, REDUCTIONS[reduction]


def _make_loss(softmax: bool):
    def bind(inputs, outputs, reduction="mean", ignore_index=None):
        x, labels, weights, has_weights, ignore, code = _common(inputs, reduction, ignore_index)
        want_log_prob = len(outputs) > 1 and outputs[1] is not None
        log_prob = _as_ncd(outputs[1]) if want_log_prob else np.zeros((1, 1, 1), dtype=x.dtype)
        return [(_class_loss, (x, labels, weights, has_weights, ignore, code, softmax, outputs[0].reshape(-1),
                               log_prob, want_log_prob))]

    return bind


def _make_loss_grad(softmax: bool):
    def bind(inputs, outputs, reduction="mean", ignore_index=None):
        x, labels, weights, has_weights, ignore, code = _common(inputs[1:], reduction, ignore_index)
        return [(_class_loss_backward, (inputs[0].reshape(-1), x, labels, weights, has_weights, ignore, code, softmax,
                                        _as_ncd(outputs[0])))]

    return bind


for _name, _softmax in (("SoftmaxCrossEntropyLoss", True), ("NegativeLogLikelihoodLoss", False)):
    binding(_name)(_make_loss(_softmax))
    binding(f"{_name}Grad", ODTRAIN_DOMAIN)(_make_loss_grad(_softmax))


# ---- the vocabulary product fused with the class-last cross-entropy ----------------------------------------
# LinearCrossEntropy(hidden [N.., H], W, labels [N..]) = cross-entropy of logits = hidden · op(W) (op(W) = Wᵀ for
# W [V, H] with transB, else W [H, V]) against labels, reduced by the mean over counted labels (or the sum), with
# `ignore_index` labels left out. The logits exist one chunk of rows at a time, in the node's scratch:
#   forward   per chunk: logits = hidden_c · op(W); loss += Σ_rows lse(logits_r) - logits_r[y_r]; and when hidden
#             needs a gradient, G = (softmax(logits) - onehot(y)) / count in place (0 on ignored rows) and
#             dHidden_c = G · op(W)ᵀ for a loss gradient of 1 (the backward scales it: no second product for it)
#   backward  (W trained) per chunk: logits again; G = g · (softmax(logits) - onehot(y)) in place;
#             dW += Gᵀ · hidden_c (transB) or hidden_cᵀ · G (the first chunk writes it)
# In parts (threads), a product splits the vocabulary (logits and dW columns) or hidden's width (dHidden), and the
# softmax the chunk's rows, all disjoint: no partial sums, the bits of one thread. Row losses are summed in order.
# Each chunk's products pack all of W for BLAS, so chunks of many rows pay that packing less often, for more
# scratch: a large vocabulary's fused loss ran markedly faster at 256 rows than at 64 (bench_ops.VocabularyLossOps).
CHUNK_BYTES = 48 << 20  # the logits of one chunk at most (unless CHUNK_MIN_ROWS rows take more)
CHUNK_MIN_ROWS = 64  # fewer rows make each product read all of W for too little work


def chunk_rows(rows: int, classes: int) -> int:
    """Rows of hidden per chunk of logits."""
    return int(max(1, min(rows, max(CHUNK_MIN_ROWS, CHUNK_BYTES // (4 * max(classes, 1))))))


@njit(cache=True, error_model="numpy")
def _counted_labels(labels, ignore_index, classes):
    """How many labels count (not ignore_index); fails on a label outside the classes."""
    count = 0
    dummy = np.ones(1, np.float32)
    for n in range(labels.shape[0]):
        count += _sample_weight(labels, dummy, False, ignore_index, classes, n, 0)[1] != 0.0
    return count


@njit(cache=True, error_model="numpy", inline="always")
def _chunk_logits(hidden, weight, transposed, logits, first, rows, classes, width, lo, hi):
    """logits[:rows, lo:hi] = hidden[first:first + rows] · op(W)[:, lo:hi]."""
    if transposed:  # W [V, H]
        gemm_blocks(0, 1, rows, hi - lo, width, 1.0, hidden, first * width, width, weight, lo * width, width, 0.0,
                    logits, lo, classes)
    else:  # W [H, V]
        gemm_blocks(0, 0, rows, hi - lo, width, 1.0, hidden, first * width, width, weight, lo, classes, 0.0,
                    logits, lo, classes)


@njit(cache=True, error_model="numpy", inline="always", fastmath=REDUCE)
def _row_softmax(logits, base, classes, y, g):
    """lse(row) - row[y] of the row of `classes` logits at `base`; the row becomes g · (softmax(row) - onehot(y))
    in place. One exponential per logit (fast_exp, vectorised with the float32 sum's order free)."""
    top = logits[base]
    for c in range(1, classes):
        top = max(top, logits[base + c])
    picked = logits[base + y]
    total = np.float32(0.0)
    for c in range(classes):
        e = fast_exp(logits[base + c] - top)
        logits[base + c] = e
        total += e
    scale = np.float32(g) / total
    for c in range(classes):
        logits[base + c] *= scale
    logits[base + y] -= np.float32(g)
    return np.log(np.float64(total)) + np.float64(top) - np.float64(picked)


@njit(cache=True, error_model="numpy", inline="always")
def _chunk_rows_softmax(logits, labels, ignore_index, first, lo, hi, g, values):
    """values[r] = the loss of row r for rows lo..hi of the chunk (0 when ignored), and each row of logits
    ← g · (softmax - onehot(y)) (0 when ignored)."""
    classes = logits.size // values.size
    dummy = np.ones(1, np.float32)
    for r in range(lo, hi):
        y, w = _sample_weight(labels, dummy, False, ignore_index, classes, first + r, 0)
        if w == 0.0:
            logits[r * classes:(r + 1) * classes] = 0.0
            values[r] = 0.0
        else:
            values[r] = _row_softmax(logits, r * classes, classes, y, g)


@njit(cache=True, error_model="numpy", inline="always")
def _hidden_gradient(grads, weight, transposed, dhidden, first, size, classes, width, lo, hi):
    """dHidden[first:first + size, lo:hi] = G · op(W)ᵀ[:, lo:hi] (lo..hi: columns of hidden, so that parts read
    disjoint parts of W and each product has all the chunk's rows)."""
    if transposed:  # G [size, V] · W [V, H][:, lo:hi]
        gemm_blocks(0, 0, size, hi - lo, classes, 1.0, grads, 0, classes, weight, lo, width, 0.0, dhidden,
                    first * width + lo, width)
    else:  # G · (W [H, V][lo:hi])ᵀ
        gemm_blocks(0, 1, size, hi - lo, classes, 1.0, grads, 0, classes, weight, lo * classes, classes, 0.0,
                    dhidden, first * width + lo, width)


@njit(cache=True, error_model="numpy", inline="always")
def _weight_gradient(grads, hidden, transposed, dweight, first, rows, classes, width, lo, hi, beta):
    """dW[vocabulary lo:hi] = Gᵀ · hidden_c (W [V, H]) or hidden_cᵀ · G (W [H, V]), + beta · dW."""
    if transposed:
        gemm_blocks(1, 0, hi - lo, width, rows, 1.0, grads, lo, classes, hidden, first * width, width, beta,
                    dweight, lo * width, width)
    else:
        gemm_blocks(1, 0, width, hi - lo, rows, 1.0, hidden, first * width, width, grads, lo, classes, beta,
                    dweight, lo, classes)


@njit(cache=True, error_model="numpy")
def _linear_cross_entropy(hidden, weight, transposed, labels, ignore_index, mean, logits, values, loss, dhidden,
                          want_hidden, width, classes, chunk):
    """loss ← the mean (or sum) cross-entropy of hidden · op(W) against labels, a chunk of logits at a time;
    if wanted, dhidden ← its gradient with respect to hidden (for a loss gradient of 1), from the same logits."""
    rows = labels.shape[0]
    g = _unit_weight(labels, ignore_index, classes, mean)
    total = 0.0
    for first in range(0, rows, chunk):
        size = min(chunk, rows - first)
        _chunk_logits(hidden, weight, transposed, logits, first, size, classes, width, 0, classes)
        _chunk_rows_softmax(logits, labels, ignore_index, first, 0, size, g, values)
        for r in range(size):
            total += values[r]
        if want_hidden:
            _hidden_gradient(logits, weight, transposed, dhidden, first, size, classes, width, 0, width)
    loss[0] = total * g if mean else total


@twin_of(_chunk_logits, range=("lo", "hi"),
         because="an inline loop of _linear_cross_entropy_parts' own parallel region, not a kernel a call names")
@njit(cache=True, error_model="numpy", inline="always")
def _logits_in_parts(hidden, weight, transposed, logits, first, rows, classes, width, bounds):
    """_chunk_logits with the vocabulary split into parts (bounds), in parallel."""
    for p in prange(bounds.size - 1):
        _chunk_logits(hidden, weight, transposed, logits, first, rows, classes, width, bounds[p], bounds[p + 1])


@twin_of(_linear_cross_entropy,
         because="each chunk splits the vocabulary, then the rows, then hidden's width, by turns")
@njit(cache=True, error_model="numpy", parallel=True)
def _linear_cross_entropy_parts(hidden, weight, transposed, labels, ignore_index, mean, logits, values, loss, dhidden,
                                want_hidden, width, classes, chunk, bounds):
    """_linear_cross_entropy with each chunk's logits split over the vocabulary (bounds), the row work over as
    many parts of its rows and dHidden over as many parts of hidden's width."""
    rows, parts = labels.shape[0], bounds.size - 1
    g = _unit_weight(labels, ignore_index, classes, mean)
    total = 0.0
    for first in range(0, rows, chunk):
        size = min(chunk, rows - first)
        _logits_in_parts(hidden, weight, transposed, logits, first, size, classes, width, bounds)
        for p in prange(parts):
            _chunk_rows_softmax(logits, labels, ignore_index, first, size * p // parts, size * (p + 1) // parts, g,
                                values)
        if want_hidden:
            for p in prange(parts):
                _hidden_gradient(logits, weight, transposed, dhidden, first, size, classes, width,
                                 width * p // parts, width * (p + 1) // parts)
        for r in range(size):
            total += values[r]
    loss[0] = total * g if mean else total


@njit(cache=True, error_model="numpy")
def _linear_cross_entropy_grad(dloss, hidden, weight, transposed, labels, ignore_index, mean, logits, values,
                               dweight, width, classes, chunk):
    """dW of _linear_cross_entropy's loss, recomputing each chunk's logits."""
    rows = labels.shape[0]
    g = dloss[0] * _unit_weight(labels, ignore_index, classes, mean)
    for first in range(0, rows, chunk):
        size = min(chunk, rows - first)
        _chunk_logits(hidden, weight, transposed, logits, first, size, classes, width, 0, classes)
        _chunk_rows_softmax(logits, labels, ignore_index, first, 0, size, g, values)
        _weight_gradient(logits, hidden, transposed, dweight, first, size, classes, width, 0, classes,
                         0.0 if first == 0 else 1.0)


@twin_of(_linear_cross_entropy_grad, because="each chunk splits the vocabulary products and the rows by turns")
@njit(cache=True, error_model="numpy", parallel=True)
def _linear_cross_entropy_grad_parts(dloss, hidden, weight, transposed, labels, ignore_index, mean, logits, values,
                                     dweight, width, classes, chunk, bounds):
    """_linear_cross_entropy_grad with the vocabulary products split over the vocabulary (bounds) and the
    row work over as many parts of the chunk's rows."""
    rows, parts = labels.shape[0], bounds.size - 1
    g = dloss[0] * _unit_weight(labels, ignore_index, classes, mean)
    for first in range(0, rows, chunk):
        size = min(chunk, rows - first)
        _logits_in_parts(hidden, weight, transposed, logits, first, size, classes, width, bounds)
        for p in prange(parts):
            _chunk_rows_softmax(logits, labels, ignore_index, first, size * p // parts, size * (p + 1) // parts, g,
                                values)
        for p in prange(parts):
            _weight_gradient(logits, hidden, transposed, dweight, first, size, classes, width, bounds[p],
                             bounds[p + 1], 0.0 if first == 0 else 1.0)


# A weight stored as int8, int4 or bfloat16 (graph/frozen.py; frozen, so no dW) is read a panel at a time, as
# DequantizedMatMul reads it (kernels/dequantized.py): per chunk, the logits' product dequantizes every panel
# once, and dHidden's once more. Parts split the vocabulary for the logits and hidden's width for dHidden, each
# with its own panel, so no panel is dequantized twice in one product.
@njit(cache=True, error_model="numpy", inline="always")
def _stored_product(a, w, scale, axis, stored, group, out, m, rows, columns, trans_b, panel, bits, r0, r1, c0, c1):
    """kernels/dequantized.py's product over stored rows [r0, r1) and columns [c0, c1) with panels of `panel`'s
    size (its _tile: rows x columns in both orientations)."""
    panel_product(a, w, scale, axis, stored, group, out, m, rows, columns, trans_b, panel, bits, r0, r1, c0, c1)


@njit(cache=True, error_model="numpy", inline="always")
def _stored_logits(hidden, w, scale, axis, stored, group, transposed, logits, first, size, classes, width, panel,
                   bits, lo, hi):
    """logits[:size, lo:hi] = hidden[first:first + size] · op(dequant(W))[:, lo:hi]."""
    a = hidden[first * width:(first + size) * width]
    if transposed:  # W [V, H]: rows lo..hi of W
        _stored_product(a, w, scale, axis, stored, group, logits, size, classes, width, 1, panel, bits, lo, hi, 0,
                        width)
    else:  # W [H, V]: columns lo..hi
        _stored_product(a, w, scale, axis, stored, group, logits, size, width, classes, 0, panel, bits, 0, width, lo,
                        hi)


@njit(cache=True, error_model="numpy", inline="always")
def _stored_hidden_gradient(grads, w, scale, axis, stored, group, transposed, dhidden, first, size, classes, width,
                            panel, bits, lo, hi):
    """dHidden[first:first + size, lo:hi] = G · op(dequant(W))ᵀ[:, lo:hi] (lo..hi: columns of hidden)."""
    d = dhidden[first * width:(first + size) * width]
    if transposed:  # G [size, V] · W [V, H], columns lo..hi of W
        _stored_product(grads, w, scale, axis, stored, group, d, size, classes, width, 0, panel, bits, 0, classes, lo,
                        hi)
    else:  # G · W [H, V]ᵀ: rows lo..hi of W
        _stored_product(grads, w, scale, axis, stored, group, d, size, width, classes, 1, panel, bits, lo, hi, 0,
                        classes)


@njit(cache=True, error_model="numpy")
def _stored_linear_cross_entropy(hidden, w, scale, axis, stored, group, transposed, labels, ignore_index, mean,
                                 logits, values, loss, dhidden, want_hidden, width, classes, chunk, panel, bits):
    """_linear_cross_entropy of a weight stored as int8, int4 or bfloat16."""
    rows = labels.shape[0]
    g = _unit_weight(labels, ignore_index, classes, mean)
    total = 0.0
    for first in range(0, rows, chunk):
        size = min(chunk, rows - first)
        _stored_logits(hidden, w, scale, axis, stored, group, transposed, logits, first, size, classes, width, panel,
                       bits, 0, classes)
        _chunk_rows_softmax(logits, labels, ignore_index, first, 0, size, g, values)
        for r in range(size):
            total += values[r]
        if want_hidden:
            _stored_hidden_gradient(logits, w, scale, axis, stored, group, transposed, dhidden, first, size, classes,
                                    width, panel, bits, 0, width)
    loss[0] = total * g if mean else total


@twin_of(_stored_linear_cross_entropy, replaces=("panel", "bits"), takes=("panels", "bits"),
         because="each part dequantizes into its own panel, and each chunk splits by turns")
@njit(cache=True, error_model="numpy", parallel=True)
def _stored_linear_cross_entropy_parts(hidden, w, scale, axis, stored, group, transposed, labels, ignore_index, mean,
                                       logits, values, loss, dhidden, want_hidden, width, classes, chunk, panels,
                                       bits, bounds):
    """_stored_linear_cross_entropy with the logits split over the vocabulary (bounds), the row work over parts
    of the chunk's rows and dHidden over parts of its width; each part dequantizes into its own panel."""
    rows, parts = labels.shape[0], bounds.size - 1
    size_of_panel = panels.size // parts
    g = _unit_weight(labels, ignore_index, classes, mean)
    total = 0.0
    for first in range(0, rows, chunk):
        size = min(chunk, rows - first)
        for p in prange(parts):
            own = slice(p * size_of_panel, (p + 1) * size_of_panel)
            _stored_logits(hidden, w, scale, axis, stored, group, transposed, logits, first, size, classes, width,
                           panels[own], bits[own], bounds[p], bounds[p + 1])
        for p in prange(parts):
            _chunk_rows_softmax(logits, labels, ignore_index, first, size * p // parts, size * (p + 1) // parts, g,
                                values)
        if want_hidden:
            for p in prange(parts):
                own = slice(p * size_of_panel, (p + 1) * size_of_panel)
                _stored_hidden_gradient(logits, w, scale, axis, stored, group, transposed, dhidden, first, size,
                                        classes, width, panels[own], bits[own], width * p // parts,
                                        width * (p + 1) // parts)
        for r in range(size):
            total += values[r]
    loss[0] = total * g if mean else total


@njit(cache=True, error_model="numpy", inline="always")
def _unit_weight(labels, ignore_index, classes, mean):
    """The loss gradient's weight of each counted row: 1 / count for the mean, 1 for the sum."""
    if not mean:
        return 1.0
    count = _counted_labels(labels, ignore_index, classes)
    return 1.0 / count if count > 0 else 0.0


def _vocabulary_layout(hidden_shape, weight_shape, transB):
    """(rows, width, classes) of hidden [rows.., width] · op(W)."""
    width = int(hidden_shape[-1])
    rows = int(np.prod(hidden_shape[:-1], dtype=np.int64))
    classes = int(weight_shape[0] if transB else weight_shape[1])
    return rows, width, classes


def _vocabulary_parts(rows, width, classes, threads) -> int:
    return part_count(threads, classes, rows * width * classes)


def _vocabulary_scratch(specs_in, specs_out, transB=0, threads=1, **attrs):
    (hidden_shape, _), (weight_shape, weight_type) = specs_in[0], specs_in[1]
    rows, width, classes = _vocabulary_layout(hidden_shape, weight_shape, transB)
    panels = 0 if np.dtype(weight_type) == np.float32 else PANEL_ELEMENTS * _vocabulary_parts(rows, width, classes,
                                                                                              threads)
    return 4 * (chunk_rows(rows, classes) * classes + panels)


def _vocabulary_operands(labels, scratch, rows, classes, ignore_index, reduction):
    """(the chunk's rows, (labels, ignore_index, mean, logits, values)) and the scratch after the logits."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"LinearCrossEntropy reduces by 'mean' or 'sum', not {reduction!r}")
    chunk = chunk_rows(rows, classes)
    logits, rest = float_buffers(scratch, chunk * classes, scratch.size // 4 - chunk * classes)
    ignore = np.int64(ignore_index) if ignore_index is not None else np.int64(-(2 ** 62))
    return chunk, (labels.reshape(-1, 1), ignore, reduction == "mean", logits, np.zeros(chunk, np.float64)), rest


@binding("LinearCrossEntropy", ODTRAIN_DOMAIN, scratch=_vocabulary_scratch, parallel=True)
def LinearCrossEntropy(inputs, outputs, scratch=None, transB=0, ignore_index=None, reduction="mean", axis=0,
                       threads=1, block_size=0):
    hidden, weight, labels = inputs[:3]
    rows, width, classes = _vocabulary_layout(hidden.shape, weight.shape, transB)
    chunk, loss_operands, rest = _vocabulary_operands(labels, scratch, rows, classes, ignore_index, reduction)
    want_hidden = len(outputs) > 1 and outputs[1] is not None
    results = (outputs[0].reshape(-1), flat(outputs[1]) if want_hidden else np.zeros(1, np.float32), want_hidden,
               width, classes, chunk)
    if weight.dtype == np.float32:
        args = (flat(hidden), flat(weight), bool(transB)) + loss_operands + results
        return [split((_linear_cross_entropy, args), classes, rows * width * classes, threads)]
    values, stored = stored_values(weight)
    scale = flat(inputs[3]) if stored in (INT8, INT4) else np.ones(1, np.float32)
    parts = _vocabulary_parts(rows, width, classes, threads)
    panels = rest[:PANEL_ELEMENTS * parts]
    args = (flat(hidden), values, scale, int(axis), stored, int(block_size), bool(transB)) + loss_operands + results
    serial = (_stored_linear_cross_entropy, args + (panels[:PANEL_ELEMENTS], panels[:PANEL_ELEMENTS].view(np.uint32)))
    return [on_parts(serial, classes, parts, (panels, panels.view(np.uint32)))]


def _vocabulary_grad_scratch(specs_in, specs_out, **attrs):  # inputs: dLoss, then the forward's
    return _vocabulary_scratch(specs_in[1:], specs_out, **attrs)


@binding("LinearCrossEntropyGrad", ODTRAIN_DOMAIN, scratch=_vocabulary_grad_scratch, parallel=True)
def LinearCrossEntropyGrad(inputs, outputs, scratch=None, transB=0, ignore_index=None, reduction="mean", threads=1):
    dloss, hidden, weight, labels = inputs
    rows, width, classes = _vocabulary_layout(hidden.shape, weight.shape, transB)
    chunk, loss_operands, _ = _vocabulary_operands(labels, scratch, rows, classes, ignore_index, reduction)
    args = (dloss.reshape(-1), flat(hidden), flat(weight), bool(transB)) + loss_operands + (flat(outputs[0]), width,
                                                                                            classes, chunk)
    return [split((_linear_cross_entropy_grad, args), classes, rows * width * classes, threads)]
