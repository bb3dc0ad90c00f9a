"""Loss blocks: MSELoss, L1Loss, CrossEntropyLoss and BCEWithLogitsLoss, each with `reduction`
('mean', 'sum' or 'none').

`build(loss_input_name, target_name="target")` scores a model output; the target (`labels` for
CrossEntropyLoss, int64) becomes a new model input unless the model already has a value of that
name, so two losses in one block take two targets by naming them. BCEWithLogitsLoss is written in
its overflow-free form
    (1 + (p-1)·y)·softplus(x) - p·y·x,   softplus(x) = max(x, 0) + log(1 + exp(-|x|))
(p = pos_weight, 1 when not given), times `weight` when given; its gradient stays finite for any x.
"""
from __future__ import annotations

import numpy as np

from ..graph.errors import ArgumentError, ModelError
from ..graph.ir import TensorType
from .blocks import Block, PassThrough, ReduceMean, ReduceSum

_REDUCTIONS = {"mean": ReduceMean, "sum": ReduceSum, "none": PassThrough}


def _reducer(reduction: str) -> Block:
    if reduction not in _REDUCTIONS:
        raise ArgumentError(f"reduction must be one of {list(_REDUCTIONS)}, got {reduction!r}")
    return _REDUCTIONS[reduction]()


class MSELoss(Block):
    """reduce((input - target)²); the target input is created like the input unless it exists."""

    def __init__(self, reduction: str = "mean"):
        self._reduce = _reducer(reduction)

    def build(self, loss_input_name: str, target_name: str = "target"):
        target = self.base.input_like(loss_input_name, target_name)
        diff = self.base.node("Sub", [loss_input_name, target], hint="mse_diff")
        return self._reduce(self.base.node("Mul", [diff, diff], hint="mse_square"))


class L1Loss(Block):
    """reduce(|input - target|)."""

    def __init__(self, reduction: str = "mean"):
        self._reduce = _reducer(reduction)

    def build(self, loss_input_name: str, target_name: str = "target"):
        target = self.base.input_like(loss_input_name, target_name)
        return self._reduce(self.base.node("Abs", [self.base.node("Sub", [loss_input_name, target], hint="l1_diff")],
                                           hint="l1_abs"))


class CrossEntropyLoss(Block):
    """ONNX SoftmaxCrossEntropyLoss on scores [N, C, ...] and int64 labels [N, ...], with optional class
    `weight` [C] and `ignore_index`."""

    def __init__(self, weight=None, reduction: str = "mean", ignore_index: int | None = None):
        _reducer(reduction)
        self._weight, self._reduction, self._ignore_index = weight, reduction, ignore_index

    def build(self, scores_input_name: str, labels_name: str = "labels"):
        builder = self.base
        scores = builder.type_of(scores_input_name)
        if not builder.has(labels_name):
            if scores is None or scores.shape is None or len(scores.shape) < 2:
                raise ModelError(f"CrossEntropyLoss needs scores of shape [N, C, ...]; '{scores_input_name}' is "
                                 f"{scores if scores is not None else 'of unknown type'}")
            builder.input(labels_name, TensorType(np.dtype(np.int64), (scores.shape[0],) + tuple(scores.shape[2:])))
        inputs = [scores_input_name, labels_name]
        if self._weight is not None:
            dtype = scores.dtype if scores is not None else np.float32
            inputs.append(builder.constant(np.asarray(self._weight, dtype=dtype), "celoss_weight"))
        attrs = {"reduction": self._reduction}
        if self._ignore_index is not None:
            attrs["ignore_index"] = int(self._ignore_index)
        return builder.node("SoftmaxCrossEntropyLoss", inputs, attrs, hint="celoss")


class BCEWithLogitsLoss(Block):
    """Binary cross entropy on logits, with optional element `weight` and `pos_weight` (broadcast as in torch)."""

    def __init__(self, weight=None, reduction: str = "mean", pos_weight=None):
        self._reduce = _reducer(reduction)
        self._weight, self._pos_weight = weight, pos_weight

    def build(self, loss_input_name: str, target_name: str = "target"):
        b, x = self.base, loss_input_name
        y = b.input_like(x, target_name)
        dtype = (b.type_of(x) or TensorType(np.dtype(np.float32), None)).dtype
        tail = b.node("Exp", [b.node("Neg", [b.node("Abs", [x], hint="bce_abs")], hint="bce_neg")], hint="bce_exp")
        log1p = b.node("Log", [b.node("Add", [tail, b.constant(1.0, "bce_one", dtype)], hint="bce_1p")], hint="bce_log")
        softplus = b.node("Add", [b.node("Relu", [x], hint="bce_relu"), log1p], hint="bce_softplus")
        if self._pos_weight is None:
            elementwise = b.node("Sub", [softplus, b.node("Mul", [x, y], hint="bce_xy")], hint="bce_elem")
        else:
            p = np.asarray(self._pos_weight, dtype=dtype)
            coefficient = b.node("Add", [b.constant(1.0, "bce_one", dtype),
                                         b.node("Mul", [y, b.constant(p - 1, "bce_pos_weight_m1")], hint="bce_py")],
                                 hint="bce_coefficient")
            positive = b.node("Mul", [b.node("Mul", [y, b.constant(p, "bce_pos_weight")], hint="bce_py"), x],
                              hint="bce_pyx")
            elementwise = b.node("Sub", [b.node("Mul", [coefficient, softplus], hint="bce_weighted"), positive],
                                 hint="bce_elem")
        if self._weight is not None:
            elementwise = b.node("Mul", [elementwise, b.constant(np.asarray(self._weight, dtype=dtype), "bce_weight")],
                                 hint="bce_elem_weighted")
        return self._reduce(elementwise)
