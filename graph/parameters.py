"""Which initializers train when the user names none: every floating-point one, less those a user would not train.

`default_selection(graph)` sorts a model's floating-point initializers into:
- trainable: the rest;
- state: values that ops update as they run (BatchNormalization's running statistics):
  kept in the checkpoint as frozen parameters, never trained;
- left out, each with its reason, staying constants of the model:
  - configuring: an input that configures an op (a shape, axes, scales, pads);
  - quantization: a scale or zero point of QuantizeLinear or DequantizeLinear (artifact
    generation freezes those of a frozen quantized weight with it);
  - a single value: exporters store exponents, epsilons, attention scales and mask fill
    values as one-element initializers (the dynamo exporter's `val_N`, `zeros`);
  - a table of the input's shape: combined with values computed from the input's shape
    (positions from Shape and Range) before it meets any data, such as rotary embeddings'
    `inv_freq`. Such an initializer describes positions, not the data.
An initializer that reaches the loss only through non-differentiable ops is found later, when
the gradient graph is built (autodiff's `without_gradient`).

A value "depends on the data" when it is computed from a graph input's values; reading only
an input's shape (Shape, Size, an op's shape-only inputs) does not make it so.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .ir import Graph
from .ops import OPS
from .ops.quantize import quantization_inputs

CONFIGURING = "configures an op (a shape, axes, scales or pads)"
QUANTIZATION = "a scale or zero point of quantization: it configures the quantization and never trains"
SINGLE_VALUE = ("a single value (an exponent, epsilon, scale or fill value stored as an initializer); "
                "name it in requires_grad to train it")
SHAPE_TABLE = ("computed with positions from the input's shape before it meets the data (a position table such as "
               "rotary inv_freq); name it in requires_grad to train it")
NO_GRADIENT = "no gradient reaches it from the loss (it feeds only comparisons, indices or integer values)"
SHAPE_READERS = {("", "Shape"), ("", "Size")}


@dataclass
class Selection:
    trainable: list[str]
    state: list[str]
    left_out: dict[str, str] = field(default_factory=dict)  # name -> why it does not train


def state_inputs(graph: Graph) -> set[str]:
    """Initializers that ops update as state (running statistics): parameters, never trained."""
    names = set()
    for node in graph.nodes:
        opdef = OPS.get(node.key)
        for _, i in (opdef.updates if opdef else ()):
            if i < len(node.inputs):
                names.add(node.inputs[i])
    return names


def configuring_initializers(graph: Graph) -> set[str]:
    """Values that feed an op's configuring inputs (shapes, axes, scales, pads) directly: the initializers
    among them never train. (The graph inputs that configure ops, also through other ops, are
    `schedule.configuring_inputs`.)"""
    return {node.inputs[k] for node in graph.nodes if node.key in OPS
            for k in OPS[node.key].constant_inputs if k < len(node.inputs)}


def _value_inputs(node) -> list[str]:
    """The inputs whose values (not only shapes) the node reads."""
    if node.key in SHAPE_READERS:
        return []
    shape_only = OPS[node.key].shape_only if node.key in OPS else frozenset()
    return [name for k, name in enumerate(node.inputs) if name and k not in shape_only]


def _dependence(graph: Graph) -> tuple[set[str], set[str]]:
    """(values computed from the inputs' values, values computed from the inputs' shapes but not values)."""
    data, from_inputs = set(graph.inputs), set(graph.inputs)
    for node in graph.nodes:
        if any(i in data for i in _value_inputs(node)):
            data.update(o for o in node.outputs if o)
        if any(i in from_inputs for i in node.inputs if i):
            from_inputs.update(o for o in node.outputs if o)
    return data, from_inputs - data


def _is_shape_table(name: str, consumers, data: set[str], shaped: set[str]) -> bool:
    """Whether `name`, before meeting any data, is combined with a value computed from the input's shape."""
    frontier, seen = [name], {name}
    while frontier:
        for node in consumers.get(frontier.pop(), []):
            if any(i in data for i in node.inputs if i):
                continue  # meets the data here: a weight on this path
            if any(i in shaped for i in node.inputs if i):
                return True
            for out in node.outputs:
                if out and out not in seen:
                    seen.add(out)
                    frontier.append(out)
    return False


def default_selection(graph: Graph, frozen=()) -> Selection:
    """The trainable, state and left-out floating-point initializers of `graph` (see the module docstring)."""
    floating = [n for n, v in graph.initializers.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]
    state, configuring, quantization = state_inputs(graph), configuring_initializers(graph), quantization_inputs(graph)
    data, shaped = _dependence(graph)
    consumers = graph.consumers()
    trainable, left_out = [], {}
    for name in floating:
        if name in frozen or name in state:
            continue
        if name in configuring:
            left_out[name] = CONFIGURING
        elif name in quantization:
            left_out[name] = QUANTIZATION
        elif np.asarray(graph.initializers[name]).size == 1:
            left_out[name] = SINGLE_VALUE
        elif _is_shape_table(name, consumers, data, shaped):
            left_out[name] = SHAPE_TABLE
        else:
            trainable.append(name)
    return Selection(trainable, [n for n in floating if n in state and n not in frozen], left_out)
