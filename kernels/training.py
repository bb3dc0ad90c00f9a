"""Fused softmax cross-entropy and negative log-likelihood, forward and backward.

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
from numba import njit

from . import ODTRAIN_DOMAIN, binding

REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


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
def _reduce_loss(loss, total, weight_sum, reduction):
    """loss[0] ← the sum, or the weighted mean, of the per-sample losses (reduction none wrote them already)."""
    if reduction == 1:
        loss[0] = total
    elif reduction == 2:
        loss[0] = total / weight_sum if weight_sum > 0 else 0.0


@njit(cache=True, error_model="numpy")
def _sample_gradient(dloss, x, labels, weights, has_weights, ignore_index, reduction, weight_sum, n, d):
    """(label, g · w[label]) of sample (n, d): its loss's gradient times its weight (÷ Σ w for mean)."""
    y, w = _sample_weight(labels, weights, has_weights, ignore_index, x.shape[1], n, d)
    g = dloss[n * x.shape[2] + d] if reduction == 0 else dloss[0]
    if reduction == 2:
        g = g / weight_sum if weight_sum > 0 else 0.0
    return y, g * w


@njit(cache=True, error_model="numpy")
def _weight_sum(x, labels, weights, has_weights, ignore_index):
    total = 0.0
    for n in range(x.shape[0]):
        for d in range(x.shape[2]):
            total += _sample_weight(labels, weights, has_weights, ignore_index, x.shape[1], n, d)[1]
    return total


@njit(cache=True, error_model="numpy")
def _sce_forward(x, labels, weights, has_weights, ignore_index, reduction, loss, log_prob, want_log_prob):
    """loss ← cross-entropy of softmax(x) against labels; log_prob ← log softmax(x) if wanted."""
    total, weight_sum = 0.0, 0.0
    for n in range(x.shape[0]):
        for d in range(x.shape[2]):
            lse = _logsumexp(x, n, d)
            if want_log_prob:
                for c in range(x.shape[1]):
                    log_prob[n, c, d] = x[n, c, d] - lse
            y, w = _sample_weight(labels, weights, has_weights, ignore_index, x.shape[1], n, d)
            value = 0.0 if w == 0.0 else -w * (x[n, y, d] - lse)
            if reduction == 0:
                loss[n * x.shape[2] + d] = value
            total += value
            weight_sum += w
    _reduce_loss(loss, total, weight_sum, reduction)


@njit(cache=True, error_model="numpy")
def _sce_backward(dloss, x, labels, weights, has_weights, ignore_index, reduction, dx):
    """dx ← gradient of the loss with respect to the scores x."""
    weight_sum = _weight_sum(x, labels, weights, has_weights, ignore_index) if reduction == 2 else 0.0
    for n in range(x.shape[0]):
        for d in range(x.shape[2]):
            y, scale = _sample_gradient(dloss, x, labels, weights, has_weights, ignore_index, reduction, weight_sum,
                                        n, d)
            if scale == 0.0:
                for c in range(x.shape[1]):
                    dx[n, c, d] = 0.0
                continue
            lse = _logsumexp(x, n, d)
            for c in range(x.shape[1]):
                dx[n, c, d] = scale * np.exp(x[n, c, d] - lse)
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


@binding("SoftmaxCrossEntropyLoss")
def SoftmaxCrossEntropyLoss(inputs, outputs, reduction="mean", ignore_index=None):
    x, labels, weights, has_weights, ignore, code = _common(inputs, reduction, ignore_index)
    want_log_prob = len(outputs) > 1 and outputs[1] is not None
    log_prob = _as_ncd(outputs[1]) if want_log_prob else np.zeros((1, 1, 1), dtype=x.dtype)
    loss = outputs[0].reshape(-1)
    return [(_sce_forward, (x, labels, weights, has_weights, ignore, code, loss, log_prob, want_log_prob))]


@binding("SoftmaxCrossEntropyLossGrad", ODTRAIN_DOMAIN)
def SoftmaxCrossEntropyLossGrad(inputs, outputs, reduction="mean", ignore_index=None):
    dloss = inputs[0].reshape(-1)
    x, labels, weights, has_weights, ignore, code = _common(inputs[1:], reduction, ignore_index)
    return [(_sce_backward, (dloss, x, labels, weights, has_weights, ignore, code, _as_ncd(outputs[0])))]


@njit(cache=True, error_model="numpy")
def _nll_forward(x, labels, weights, has_weights, ignore_index, reduction, loss):
    """loss ← negative log-likelihood of the log-probabilities x at the labels."""
    total, weight_sum = 0.0, 0.0
    for n in range(x.shape[0]):
        for d in range(x.shape[2]):
            y, w = _sample_weight(labels, weights, has_weights, ignore_index, x.shape[1], n, d)
            value = 0.0 if w == 0.0 else -w * x[n, y, d]
            if reduction == 0:
                loss[n * x.shape[2] + d] = value
            total += value
            weight_sum += w
    _reduce_loss(loss, total, weight_sum, reduction)


@njit(cache=True, error_model="numpy")
def _nll_backward(dloss, x, labels, weights, has_weights, ignore_index, reduction, dx):
    """dx ← gradient of the loss with respect to the log-probabilities x."""
    weight_sum = _weight_sum(x, labels, weights, has_weights, ignore_index) if reduction == 2 else 0.0
    for n in range(x.shape[0]):
        for d in range(x.shape[2]):
            y, scale = _sample_gradient(dloss, x, labels, weights, has_weights, ignore_index, reduction, weight_sum,
                                        n, d)
            for c in range(x.shape[1]):
                dx[n, c, d] = 0.0
            if scale != 0.0:
                dx[n, y, d] = -scale


@binding("NegativeLogLikelihoodLoss")
def NegativeLogLikelihoodLoss(inputs, outputs, reduction="mean", ignore_index=None):
    x, labels, weights, has_weights, ignore, code = _common(inputs, reduction, ignore_index)
    return [(_nll_forward, (x, labels, weights, has_weights, ignore, code, outputs[0].reshape(-1)))]


@binding("NegativeLogLikelihoodLossGrad", ODTRAIN_DOMAIN)
def NegativeLogLikelihoodLossGrad(inputs, outputs, reduction="mean", ignore_index=None):
    dloss = inputs[0].reshape(-1)
    x, labels, weights, has_weights, ignore, code = _common(inputs[1:], reduction, ignore_index)
    return [(_nll_backward, (dloss, x, labels, weights, has_weights, ignore, code, _as_ncd(outputs[0])))]
