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

import numpy as np

from ..errors import ModelError
from ..ir import ODTRAIN_DOMAIN, TensorType
from . import grad, op


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


@op(APPLY_UPDATE, ODTRAIN_DOMAIN)
def _apply_update_rule(node, types, consts):
    """ApplyUpdate(gradient, parameter): the optimizer update of one parameter during the backward
    pass (fused update mode); it reads the gradient, writes the parameter, and outputs nothing."""
    return []
