"""Reverse-mode differentiation of a Graph into a training Graph.

Algorithm:
- Forward reach: the values that depend on a trainable parameter.
- Backward reach: the nodes whose outputs lead to the loss.
- Walk the nodes in both sets in reverse order; for each node whose outputs
  received gradients, call its gradient rule, asking only for the input
  gradients that lead back to a trainable parameter. Frozen parameters and
  the nodes that feed only them get no gradient and cost nothing backward.
- A value used by several nodes receives one contribution from each; they
  are summed (one Sum node) just before the value's producer is visited.
- The gradient of parameter p is named `p_grad`, as in ONNX Runtime.
- Gradient nodes emitted side by side are fused afterwards where that is
  safe (graph/gradient_fusion.py).

`missing_support` makes the same walk without emitting anything, to name every
node that lacks a kernel or a gradient rule before artifacts are generated
(`odtrain check`).

The loss gradient seed is a constant 1 of the loss's type, stored as an
initializer of the training graph.
"""
from __future__ import annotations

import numpy as np

from .control_flow import walk
from .errors import ModelError, UnsupportedOpError
from .fusion import fuse_for_training
from .gradient_fusion import fold_activation_gradients
from .ir import DEFAULT_DOMAIN, Graph, NameScope, Node, TensorType
from .ops import OPS, GradContext, lookup
from .ops.nn import fuse_normalization_activations
from .ops.quantize import fuse_quantize_pairs
from .product_epilogues import fold_product_epilogues

GRAD_SUFFIX = "_grad"
# ops a gradient rule's constant input (axes, a shape) is folded through; none of them makes a large tensor
# from a small one (as ConstantOfShape, Expand or Range would)
INDEX_ARITHMETIC = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Concat", "Cast", "Identity", "Gather", "Slice",
                              "Add", "Sub", "Mul", "Div", "Neg"})
LOSS_SEED = "loss_grad_seed"


class BackwardBuilder:
    """Collects the nodes and constants that gradient rules emit."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.names = NameScope(graph)
        self.nodes: list[Node] = []

    def emit(self, op_type, inputs, attrs, domain, outputs, hint):
        outs = [self.names.fresh(hint) for _ in range(outputs)]
        self.nodes.append(Node(op_type, list(inputs), outs, dict(attrs), self.names.fresh(f"{hint}_node"), domain))
        return outs

    def constant(self, value: np.ndarray, hint: str) -> str:
        name = self.names.fresh(hint)
        self.graph.initializers[name] = value.astype(np.float32) if value.dtype == np.float64 else value
        return name

    def constant_value(self, name: str, depth: int = 0):
        """The value of `name` when the model fixes it, else None: an initializer, a Constant node's value, or
        an op on such values that its type rule folds (the dynamo exporter's axes: Reshape of two Constants)."""
        if name in self.graph.initializers:
            return self.graph.initializers[name]
        producer = next((n for n in self.graph.nodes if name in n.outputs), None)
        if producer is None or producer.attrs and any(isinstance(v, Graph) for v in producer.attrs.values()):
            return None
        if producer.op_type == "Constant":
            from .ops.tensor import constant_value

            return constant_value(producer)
        if depth > 8 or producer.op_type not in INDEX_ARITHMETIC or not producer.inputs:
            return None  # axes come from a few small ops; a deeper chain, or an op that makes tensors, is work
        values = [self.constant_value(i, depth + 1) if i else None for i in producer.inputs]
        if any(v is None or np.asarray(v).size > 1024 for i, v in zip(producer.inputs, values) if i):
            return None  # not known, or a weight rather than an index
        types = [TensorType(np.asarray(v).dtype, tuple(np.asarray(v).shape)) if v is not None else None for v in values]
        try:
            result = lookup(producer).infer(producer, types, values)
        except Exception:  # a rule that cannot fold these: the value is not a constant we know
            return None
        folded = result[1] if isinstance(result, tuple) else None
        return None if folded is None else np.asarray(folded[producer.outputs.index(name)])


def depends_on(graph: Graph, sources: set[str]) -> set[str]:
    reached = set(sources)
    for node in graph.nodes:
        if any(i in reached for i in node.inputs if i):
            reached.update(o for o in node.outputs if o)
    return reached


def wanted_inputs(graph: Graph, node: Node, reaches_param: set[str]) -> list[bool]:
    """For each input of `node`: whether its gradient leads back to a trainable parameter (a floating-point
    value that depends on one, and not an input that configures the op)."""
    constant_inputs = OPS[node.key].constant_inputs if node.key in OPS else frozenset()
    return [bool(i) and k not in constant_inputs and i in reaches_param and np.issubdtype(
        (graph.value_types[i].dtype if i in graph.value_types else np.float32), np.floating)
        for k, i in enumerate(node.inputs)]


def missing_support(graph: Graph, trainable, loss_inputs) -> tuple[list[Node], list[tuple[Node, str | None]]]:
    """(nodes without a kernel, (node, why) for each node without a gradient rule that a trainable parameter
    needs): the reverse walk of build_gradient_graph on the graph as given, recording instead of stopping,
    and walking on past a missing rule so that one report names every one."""
    no_kernel = [node for node in walk(graph) if node.key not in OPS]  # inside If, Loop and Scan bodies too
    reaches_param = depends_on(graph, set(trainable))
    flowing, no_gradient = set(loss_inputs), []
    for node in reversed(graph.nodes):
        if not any(o in flowing for o in node.outputs):
            continue
        wanted = [i for i, w in zip(node.inputs, wanted_inputs(graph, node, reaches_param)) if w]
        opdef = OPS.get(node.key)
        if opdef is not None and opdef.gradient is None and wanted:
            no_gradient.append((node, opdef.no_grad_reason))
        flowing.update(wanted)
    return no_kernel, no_gradient


def rank_lookup(graph: Graph):
    def rank_of(name):
        t = graph.value_types.get(name)
        return None if t is None or t.shape is None else len(t.shape)

    return rank_of


def reverse_walk(graph: Graph, builder, contributions: dict[str, list[str]], reaches: set[str], no_rule):
    """Emit, through `builder`, every gradient rule of `graph`'s nodes from the last to the first, starting from
    `contributions` (value -> the names of its gradient's parts: the seeds), for the inputs through which
    `reaches` (values depending on what is differentiated) runs; fan-out is summed. A node without a rule
    raises `no_rule(node, reason)`. Returns total(value): the name of a value's whole gradient ('' for none)."""

    def total(value: str) -> str:
        parts = contributions.get(value, [])
        if len(parts) <= 1:
            return parts[0] if parts else ""
        summed = builder.emit("Sum", parts, {}, DEFAULT_DOMAIN, 1, f"{value}_grad_sum")[0]
        contributions[value] = [summed]
        return summed

    for node in reversed(graph.nodes):
        if not any(o in contributions for o in node.outputs):
            continue
        wanted = wanted_inputs(graph, node, reaches)
        if not any(wanted):
            continue
        opdef = lookup(node)
        if opdef.gradient is None:
            raise no_rule(node, f" ({opdef.no_grad_reason})" if opdef.no_grad_reason else "")
        output_grads = [total(o) for o in node.outputs]
        ctx = GradContext(node, output_grads, wanted, builder, rank_lookup(graph))
        opdef.gradient(ctx)
        for index, grad_name in ctx.input_grads.items():
            contributions.setdefault(node.inputs[index], []).append(grad_name)
    return total


def build_gradient_graph(graph: Graph, loss: str, trainable: list[str], without_gradient: list | None = None) -> Graph:
    """A copy of `graph` that also outputs `p_grad` for each trainable parameter p.

    `graph` computes `loss` (a scalar) among its outputs; `trainable` names
    values (parameters) that the loss depends on.
    """
    training = fuse_for_training(graph)  # a copy, with exported patterns fused (graph/fusion.py)
    fuse_normalization_activations(training)  # BatchNormalization → Relu/Clip (graph/ops/nn.py)
    fuse_quantize_pairs(training)  # QuantizeLinear → DequantizeLinear: FakeQuantize (graph/ops/quantize.py)
    fold_product_epilogues(training)  # product → activation: one node (graph/product_epilogues.py)
    builder = BackwardBuilder(training)
    reaches_param = depends_on(training, set(trainable))
    if loss not in reaches_param:
        raise ModelError(f"the loss '{loss}' does not depend on any trainable parameter {trainable}")
    for name in trainable:
        if name not in reaches_param or not any(name in n.inputs for n in training.nodes):
            raise ModelError(f"trainable parameter '{name}' is not used by the model")

    seed_type = graph.value_types.get(loss)
    seed_dtype = seed_type.dtype if seed_type is not None else np.float32
    training.initializers[LOSS_SEED] = np.ones((), dtype=seed_dtype)
    def no_rule(node, reason: str) -> UnsupportedOpError:
        with_rules = ", ".join(sorted(t for (d, t), o in OPS.items() if o.gradient and d == DEFAULT_DOMAIN))
        return UnsupportedOpError(
            f"{node.describe()}: no gradient rule for {node.op_type}{reason}, and a trainable parameter "
            f"depends on it. Freeze the parameters before it, or use ops with gradient rules: {with_rules}")

    total = reverse_walk(training, builder, {loss: [LOSS_SEED]}, reaches_param, no_rule)

    grad_outputs = []
    for name in trainable:
        grad_value = total(name)
        if not grad_value and without_gradient is not None:  # the caller asked to hear, not to fail
            without_gradient.append(name)
            continue
        if not grad_value:
            users = [n.describe() for n in graph.nodes if name in n.inputs]
            raise ModelError(f"trainable parameter '{name}' receives no gradient through {', '.join(users)}; "
                             "list it in frozen_params instead of requires_grad")
        target = f"{name}{GRAD_SUFFIX}"
        producer = next((n for n in builder.nodes if grad_value in n.outputs), None)
        if producer is None or grad_value in grad_outputs:
            builder.nodes.append(Node("Identity", [grad_value], [target], {}, builder.names.fresh(f"{target}_copy")))
        else:
            _rename(builder.nodes, grad_value, target)
        grad_outputs.append(target)
        training.value_types[target] = training.value_types.get(name) or seed_type

    training.nodes = training.nodes + builder.nodes
    training.outputs = list(graph.outputs) + grad_outputs
    fold_activation_gradients(training)  # ClipGrad → BatchNormalizationGrad (graph/gradient_fusion.py)
    return training


def _rename(nodes: list[Node], old: str, new: str) -> None:
    for node in nodes:
        node.inputs = [new if i == old else i for i in node.inputs]
        node.outputs = [new if o == old else o for o in node.outputs]
