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

from .jit import njit

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
