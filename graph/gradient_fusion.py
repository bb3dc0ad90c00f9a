"""Fusions of gradient patterns, applied to the training graph once its backward nodes are emitted.

Where graph/fusion.py fuses exported forward patterns before differentiation, this module fuses what
the gradient rules emit side by side:

- An activation's gradient read only by a batch normalization's gradient (Conv → BatchNormalization →
  Relu or Clip, as ResNets and MobileNetV2's Relu6 write it):
      BatchNormalizationGrad(ClipGrad(dY, Y, min, max), X, scale, ...)
  → BatchNormalizationGrad(dY, X, scale, ..., Y, min, max, activation="Clip")   (ReluGrad: "Relu")
  The normalization's gradient applies the activation's mask (min < Y < max; Relu: 0 < Y) to dY
  itself, writing the masked gradient into its dX a block of channels at a time and summing each
  block while it is in the cache: the activation's node, its call (with threads, its parallel
  region) and its gradient value disappear. Y is the activation's output, which the activation's
  gradient read anyway, so no forward value lives longer. The activation's inputs go after the normalization's five (positions 5, 6, 7: '' for the
  optional ones left out), its min/max attributes (opsets before 11) come along.

A fold happens only when it is safe: the activation's gradient is read by that one node, as its dY
only, and is not a graph output; and the normalization's dX is wanted (its buffer holds the masked
gradient). When the activation's gradient is read elsewhere too (a residual branch summing
gradients, a second normalization behind an Add), it stays a node of its own.
"""
from __future__ import annotations

from .ir import ODTRAIN_DOMAIN, Graph, Node

# activation gradient -> the activation the normalization gradient applies
ACTIVATION_GRADIENTS = {(ODTRAIN_DOMAIN, "ClipGrad"): "Clip", (ODTRAIN_DOMAIN, "ReluGrad"): "Relu"}
# normalization gradient -> position of its first activation input (after its own optional ones)
NORMALIZATION_GRADIENTS = {(ODTRAIN_DOMAIN, "BatchNormalizationGrad"): 5}


def fold_activation_gradients(graph: Graph) -> None:
    """Fold activation gradients into the normalization gradients that alone read them, in place."""
    producers, consumers, outputs = graph.producers(), graph.consumers(), set(graph.outputs)
    folded: set[int] = set()  # ids of the activation gradients folded away
    replaced: dict[int, Node] = {}  # id of a normalization gradient -> its folded form
    for norm in graph.nodes:
        first = NORMALIZATION_GRADIENTS.get(norm.key)
        if first is None or "activation" in norm.attrs or not norm.inputs[0] or not norm.outputs[0]:
            continue
        incoming = norm.inputs[0]
        act = producers.get(incoming)
        if act is None or act.key not in ACTIVATION_GRADIENTS or incoming in outputs or \
                consumers.get(incoming, []) != [norm] or incoming in norm.inputs[1:]:
            continue
        activation = ACTIVATION_GRADIENTS[act.key]
        inputs = [act.inputs[0]] + norm.inputs[1:] + [""] * (first - len(norm.inputs))
        inputs += act.inputs[1:] if activation == "Clip" else act.inputs[1:2]
        while inputs[-1] == "":
            inputs.pop()
        attrs = dict(norm.attrs, activation=activation)
        attrs.update({k: float(v) for k, v in act.attrs.items() if k in ("min", "max")})
        replaced[id(norm)] = Node(norm.op_type, inputs, list(norm.outputs), attrs, norm.name, norm.domain)
        folded.add(id(act))
    graph.nodes = [replaced.get(id(n), n) for n in graph.nodes if id(n) not in folded]
