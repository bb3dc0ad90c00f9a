"""Loss ops: ONNX SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss, and their gradients.

SoftmaxCrossEntropyLoss(scores [N, C, d...], labels [N, d...] int, weights [C]?)
  -> loss (scalar for reduction mean/sum, [N, d...] for none), log_prob?
The gradient op recomputes the softmax from the scores instead of keeping
log_prob alive through the backward pass: N·C exponentials buy back a
whole activation of memory.

NegativeLogLikelihoodLoss(log_prob [N, C, d...], labels, weights?) -> loss
takes the same labels, weights, reduction and ignore_index; it is
SoftmaxCrossEntropyLoss after a LogSoftmax over the classes.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ModelError
from ..ir import ODTRAIN_DOMAIN, TensorType
from .registry import grad, op
from .dequantized import FROZEN_WEIGHT, check_stored_weight


@op("SoftmaxCrossEntropyLoss")
@op("NegativeLogLikelihoodLoss")
def _class_loss_rule(node, types, consts):
    scores, labels = types[0], types[1]
    if scores.shape is not None and len(scores.shape) < 2:
        raise ModelError(f"{node.describe()}: its first input must be [N, C, ...], got {scores}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ModelError(f"{node.describe()}: labels must be integers, got {labels}")
    reduction = node.attrs.get("reduction", "mean")
    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    loss_shape = labels.shape if reduction == "none" else ()
    out = [TensorType(scores.dtype, loss_shape)]
    if len(node.outputs) > 1:
        out.append(scores)
    return out


def _class_loss_grad(ctx):
    inputs = [ctx.GO(0), ctx.I(0), ctx.I(1)] + ([ctx.I(2)] if ctx.I(2) else [])
    attrs = {k: ctx.attr(k) for k in ("reduction", "ignore_index") if ctx.attr(k) is not None}
    ctx.set_grad(0, ctx.odtrain(f"{ctx.node.op_type}Grad", inputs, attrs))


# dScores = dLoss · (softmax(scores) - onehot(labels)) · weight / normaliser
grad("SoftmaxCrossEntropyLoss")(_class_loss_grad)
# dLogProb = -dLoss · onehot(labels) · weight / normaliser
grad("NegativeLogLikelihoodLoss")(_class_loss_grad)


@op("SoftmaxCrossEntropyLossGrad", ODTRAIN_DOMAIN)
@op("NegativeLogLikelihoodLossGrad", ODTRAIN_DOMAIN)
def _class_loss_grad_rule(node, types, consts):
    return [types[1]]


APPLY_UPDATE = "ApplyUpdate"


@op(APPLY_UPDATE, ODTRAIN_DOMAIN, no_kernel="the executor runs the optimizer's update kernels for it")
def _apply_update_rule(node, types, consts):
    """ApplyUpdate(gradient, parameter): the optimizer update of one parameter during the backward
    pass (fused update mode); it reads the gradient, writes the parameter, and outputs nothing."""
    return []


# LinearCrossEntropy(hidden [N.., H], W, labels [N..][, scale]) -> loss: SoftmaxCrossEntropyLoss(hidden · op(W),
# labels) with the classes last, op(W) = Wᵀ for W [V, H] (transB=1) or W [H, V]; reduction mean (over the labels
# that are not ignore_index) or sum. W may be a frozen weight stored as int8 (with its float32 scale along `axis`)
# or bfloat16, read a panel at a time as DequantizedMatMul reads it (graph/ops/dequantized.py). Graph fusion
# (graph/fusion.py) makes it from a causal LM's vocabulary product and its class-last loss; the kernels
# (kernels/training.py) hold one chunk of logits at a time, never all of them.
def _vocabulary(node, types) -> tuple:
    """(rows, width, classes) of the product, checked against the labels."""
    hidden, weight, labels = types[0].shape, types[1].shape, types[2].shape
    transposed = int(node.attrs.get("transB", 0))
    if len(weight) != 2 or len(hidden) < 2:
        raise ModelError(f"{node.describe()}: LinearCrossEntropy needs hidden [..., H] and a 2-D weight, got "
                         f"{list(hidden)} and {list(weight)}")
    width, classes = (weight[1], weight[0]) if transposed else weight
    if isinstance(width, int) and isinstance(hidden[-1], int) and width != hidden[-1]:
        raise ModelError(f"{node.describe()}: hidden {list(hidden)} does not fit the weight {list(weight)} "
                         f"(transB={transposed})")
    rows = math.prod(hidden[:-1]) if all(isinstance(d, int) for d in hidden[:-1]) else None
    count = math.prod(labels) if all(isinstance(d, int) for d in labels) else None
    if rows is not None and count is not None and rows != count:
        raise ModelError(f"{node.describe()}: {count} labels for {rows} rows of hidden {list(hidden)}")
    return rows, width, classes


def _vocabulary_flops(node, types, out) -> float:
    rows, width, classes = _vocabulary(node, types)
    return 2.0 * rows * width * classes


# Its optional second output is the gradient with respect to hidden for a loss gradient of 1, computed from the
# forward's own chunks of logits: the backward scales it instead of forming the logits again for it.
def _vocabulary_outputs_flops(node, types, out) -> float:  # the product, and dHidden's if the forward makes it
    return _vocabulary_flops(node, types, out) * (2 if len(node.outputs) > 1 and node.outputs[1] else 1)


@op("LinearCrossEntropy", ODTRAIN_DOMAIN, passes=3, flops=_vocabulary_outputs_flops)
def _linear_cross_entropy_rule(node, types, consts):
    if node.attrs.get("reduction", "mean") not in ("mean", "sum", b"mean", b"sum"):
        raise ModelError(f"{node.describe()}: LinearCrossEntropy reduces by 'mean' or 'sum'")
    if not np.issubdtype(types[2].dtype, np.integer):
        raise ModelError(f"{node.describe()}: labels must be integers, got {types[2]}")
    if types[1].dtype != np.float32 or len(types) > 3:  # a frozen weight stored in fewer bytes, and its scale
        check_stored_weight(node, types, weight=1, scale=3)
    if types[0].shape is not None and types[1].shape is not None and types[2].shape is not None:
        _vocabulary(node, types)
    return [TensorType(types[0].dtype, ())] + [types[0]] * (len(node.outputs) > 1 and bool(node.outputs[1]))


@grad("LinearCrossEntropy", ODTRAIN_DOMAIN)
def _linear_cross_entropy_grad(ctx):
    # G = (softmax(hidden · op(W)) - onehot(labels)) / count, a chunk at a time;
    # dHidden = dLoss · (G · op(W)ᵀ) (the forward's second output), dW = dLoss · (Gᵀ · hidden or hiddenᵀ · G)
    if ctx.needs(0):
        ctx.set_grad(0, ctx.emit("Mul", [ctx.forward_output(1, "unit_grad"), ctx.GO(0)]))
    if ctx.needs(1):
        if len(ctx.node.inputs) > 3 or ctx.dtype(ctx.I(1)) not in (None, np.float32):
            raise ModelError(f"{ctx.node.describe()}: {FROZEN_WEIGHT}")
        attrs = {k: ctx.attr(k) for k in ("transB", "reduction", "ignore_index") if ctx.attr(k) is not None}
        ctx.set_grad(1, ctx.odtrain("LinearCrossEntropyGrad", [ctx.GO(0), ctx.I(0), ctx.I(1), ctx.I(2)], attrs))


def _vocabulary_grad_flops(node, types, out) -> float:  # the logits again, then dW's product (inputs: dLoss first)
    return 2 * _vocabulary_flops(node, types[1:], out)


# LinearCrossEntropyGrad(dLoss, hidden, W, labels) -> dW, forming each chunk's logits again
@op("LinearCrossEntropyGrad", ODTRAIN_DOMAIN, passes=3, flops=_vocabulary_grad_flops)
def _linear_cross_entropy_grad_rule(node, types, consts):
    return [types[2]]
