"""Loss builders: append a loss to a forward graph, giving the eval graph.

Each builder takes the graph, the name of the model output it scores and
returns the loss value's name, after adding the target input and the loss
nodes. Target inputs are named as ONNX Runtime names them: `labels` for
CrossEntropyLoss, `target` for the others. All losses reduce by the mean.

CrossEntropyLoss reads the classes on axis 1, as ONNX and ONNX Runtime do
(scores [N, C, d1...], labels [N, d1...]), unless told `class_axis=-1`: then
the classes are the last axis (a causal LM's logits [batch, seq, vocab],
labels [batch, seq]), and both are reshaped (views, no copy) to [tokens, C]
and [tokens] for SoftmaxCrossEntropyLoss. `ignore_index` labels (padding)
count neither in the sum nor in the mean's denominator.

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


CLASSES_LAST_HINT = "ce_classes_last"


def class_axis_of(class_axis) -> int:
    """1 (ONNX's [N, C, ...], the default) or -1 (classes last) from None, 1, -1 or 'last'."""
    if class_axis is None or (not isinstance(class_axis, bool) and class_axis in (1, "1")):
        return 1
    if class_axis in (-1, "-1", "last"):
        return -1
    raise ArgumentError(f"class_axis must be 1 (scores [N, C, ...], ONNX Runtime's meaning) or -1/'last' "
                        f"(scores [..., C], e.g. logits [batch, seq, vocab]), got {class_axis!r}")


def detect_class_axis(scores: TensorType) -> tuple[int, str]:
    """Where a model output's classes are, with the reason: the last axis when the output is [N, seq, C] with
    a symbolic sequence axis and a fixed number of classes (a language model's logits), else axis 1."""
    shape = scores.shape
    if shape is not None and len(shape) >= 3 and isinstance(shape[1], str) and isinstance(shape[-1], int):
        return -1, f"axis 1 ('{shape[1]}') is symbolic and the last axis has a fixed size {shape[-1]}"
    return 1, "ONNX's [N, C, ...] layout"


def _cross_entropy(emit: _Emitter, scores: str, out_type: TensorType, class_axis: int, ignore_index) -> str:
    shape = out_type.shape
    if shape is None or len(shape) < 2:
        raise ModelError(f"CrossEntropyLoss needs scores of rank 2 or more; output '{scores}' is {out_type}")
    attrs = {"reduction": "mean"}
    if ignore_index is not None:
        attrs["ignore_index"] = int(ignore_index)
    if class_axis == 1 or len(shape) == 2:
        labels = emit.input("labels", TensorType(np.dtype(np.int64), (shape[0],) + tuple(shape[2:])))
        return emit("SoftmaxCrossEntropyLoss", [scores, labels], attrs)
    classes = shape[-1]
    if not isinstance(classes, int):
        raise ModelError(f"CrossEntropyLoss with the classes last needs a fixed number of classes; output "
                         f"'{scores}' is {out_type}")
    labels = emit.input("labels", TensorType(np.dtype(np.int64), tuple(shape[:-1])))
    rows = emit("Reshape", [scores, emit.constant(np.array([-1, classes], np.int64), "ce_rows_shape")],
                hint=CLASSES_LAST_HINT)
    flat = emit("Reshape", [labels, emit.constant(np.array([-1], np.int64), "ce_labels_shape")], hint="ce_labels")
    return emit("SoftmaxCrossEntropyLoss", [rows, flat], attrs)


def cross_entropy_layout(graph: Graph) -> tuple[int, int | None] | None:
    """(class axis, ignore index) of the cross-entropy that `add_loss` appended to `graph`, or None."""
    producers = graph.producers()
    for node in graph.nodes:
        if node.op_type == "SoftmaxCrossEntropyLoss":
            source = producers.get(node.inputs[0])
            last = source is not None and source.op_type == "Reshape" and \
                source.outputs[0].startswith(CLASSES_LAST_HINT)
            ignore = node.attrs.get("ignore_index")
            return (-1 if last else 1), (int(ignore) if ignore is not None else None)
    return None


def cross_entropy_classes(graph: Graph, types: dict | None = None) -> int | None:
    """The number of classes of the cross-entropy that `add_loss` appended to `graph` (axis 1 of its scores,
    whichever the model's layout), or None when there is none or it is not fixed. `types` (a bound step's value
    types) knows the scores where a saved training model does not: ONNX infers no shape past odtrain's own ops."""
    for node in graph.nodes:
        if node.op_type == "SoftmaxCrossEntropyLoss":
            scores = (types or graph.value_types).get(node.inputs[0])
            if scores is None or scores.shape is None or len(scores.shape) < 2:
                return None
            return scores.shape[1] if isinstance(scores.shape[1], int) else None
    return None


def add_loss(graph: Graph, loss_type: LossType, loss_inputs: list[str], class_axis=None, ignore_index=None) -> str:
    """Append `loss_type` scoring `loss_inputs[0]`; returns the loss value's name. `class_axis` and
    `ignore_index` apply to CrossEntropyLoss only."""
    emit = _Emitter(graph)
    scores = loss_inputs[0]
    out_type = _output_type(graph, scores)
    if loss_type is not LossType.CrossEntropyLoss and (class_axis is not None or ignore_index is not None):
        raise ArgumentError(f"class_axis and ignore_index apply to CrossEntropyLoss, not {loss_type.name}")
    if loss_type is LossType.CrossEntropyLoss:
        loss = _cross_entropy(emit, scores, out_type, class_axis_of(class_axis), ignore_index)
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
