"""Loss builders: append a loss to a forward graph, giving the eval graph.

Each builder takes the graph, the name of the model output it scores and
returns the loss value's name, after adding the target input and the loss
nodes. Target inputs are named as ONNX Runtime names them: `labels` for
CrossEntropyLoss, `target` for the others. All losses reduce by the mean.

BCEWithLogitsLoss is written in its overflow-free form
    max(x, 0) - x·y + log(1 + exp(-|x|)),
whose gradient is sigmoid(x) - y.
"""
from __future__ import annotations

import enum

import numpy as np

from .errors import ArgumentError, ModelError
from .ir import Graph, NameScope, Node, TensorType


class LossType(enum.Enum):
    """The built-in losses, named as in onnxruntime.training.artifacts.LossType."""

    MSELoss = 1
    CrossEntropyLoss = 2
    BCEWithLogitsLoss = 3
    L1Loss = 4


class _Emitter:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.names = NameScope(graph)

    def __call__(self, op_type: str, inputs: list[str], attrs: dict | None = None, hint: str = "loss") -> str:
        out = self.names.fresh(hint)
        self.graph.nodes.append(Node(op_type, inputs, [out], attrs or {}, self.names.fresh(f"{hint}_node")))
        return out

    def input(self, hint: str, t: TensorType) -> str:
        name = self.names.fresh(hint)
        self.graph.inputs.append(name)
        self.graph.value_types[name] = t
        return name

    def constant(self, value, hint: str) -> str:
        name = self.names.fresh(hint)
        self.graph.initializers[name] = np.asarray(value)
        return name


def _output_type(graph: Graph, name: str) -> TensorType:
    t = graph.value_types.get(name)
    if t is None:
        raise ModelError(f"the type of model output '{name}' is unknown; give the model typed outputs")
    return t


def add_loss(graph: Graph, loss_type: LossType, loss_inputs: list[str]) -> str:
    """Append `loss_type` scoring `loss_inputs[0]`; returns the loss value's name."""
    emit = _Emitter(graph)
    scores = loss_inputs[0]
    out_type = _output_type(graph, scores)
    if loss_type is LossType.CrossEntropyLoss:
        if out_type.shape is None or len(out_type.shape) < 2:
            raise ModelError(f"CrossEntropyLoss needs scores of shape [N, C, ...]; output '{scores}' is {out_type}")
        label_shape = (out_type.shape[0],) + tuple(out_type.shape[2:])
        labels = emit.input("labels", TensorType(np.dtype(np.int64), label_shape))
        loss = emit("SoftmaxCrossEntropyLoss", [scores, labels], {"reduction": "mean"})
    elif loss_type in (LossType.MSELoss, LossType.L1Loss):
        target = emit.input("target", out_type)
        diff = emit("Sub", [scores, target], hint="loss_diff")
        per_element = emit("Mul", [diff, diff], hint="loss_sq") if loss_type is LossType.MSELoss else emit("Abs", [diff], hint="loss_abs")
        loss = emit("ReduceMean", [per_element], {"keepdims": 0})
    elif loss_type is LossType.BCEWithLogitsLoss:
        target = emit.input("target", out_type)
        positive = emit("Relu", [scores], hint="bce_relu")
        product = emit("Mul", [scores, target], hint="bce_xy")
        linear = emit("Sub", [positive, product], hint="bce_linear")
        tail = emit("Exp", [emit("Neg", [emit("Abs", [scores], hint="bce_abs")], hint="bce_neg")], hint="bce_exp")
        one = emit.constant(np.ones((), dtype=out_type.dtype), "bce_one")
        softplus = emit("Log", [emit("Add", [tail, one], hint="bce_1p")], hint="bce_log")
        loss = emit("ReduceMean", [emit("Add", [linear, softplus], hint="bce_elem")], {"keepdims": 0})
    else:
        raise ArgumentError(f"unknown loss {loss_type!r}; use one of {[t.name for t in LossType]}")
    graph.value_types[loss] = TensorType(out_type.dtype, ())
    return loss


def parse_loss(loss) -> LossType:
    if isinstance(loss, LossType):
        return loss
    if isinstance(loss, str) and loss in LossType.__members__:
        return LossType[loss]
    raise ArgumentError(f"loss must be an odtrain.artifacts.LossType (one of {list(LossType.__members__)}), got {loss!r}")
