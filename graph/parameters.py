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
    values as one-element initializers (the dynamo exporter's `val_N`, `zeros`); one
    element that a layer reads as its weights (a 1-channel BatchNormalization's scale and
    bias: `WEIGHT_INPUTS`) is a parameter;
  - a table of the input's shape: combined with values computed from the input's shape
    (positions from Shape and Range) before it meets any data, such as rotary embeddings'
    `inv_freq`. Such an initializer describes positions, not the data.
An initializer that reaches the loss only through non-differentiable ops is found later, when
the gradient graph is built (autodiff's `without_gradient`).

`choose_parameters(graph, loss_inputs, ...)` is the choice a user makes on top of that default, as
the command line offers it: glob patterns to train (`requires_grad`, which may also name what the
default leaves out) or to freeze, or the last N layers (parameters grouped by the first node that
consumes them, in graph order: `parameter_layers`). Whatever is chosen, BatchNormalization's running
statistics and integer weights (with their scales and zero points) are frozen, never trained.

A value "depends on the data" when it is computed from a graph input's values; reading only
an input's shape (Shape, Size, an op's shape-only inputs) does not make it so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Callable

import numpy as np

from .errors import ArgumentError
from .ir import Graph
from .ops import OPS
from .ops.quantize import dequantized_weights, quantization_inputs
from .wording import count, name_list

CONFIGURING = "configures an op (a shape, axes, scales or pads)"
QUANTIZATION = "a scale or zero point of quantization: it configures the quantization and never trains"
SINGLE_VALUE = ("a single value (an exponent, epsilon, scale or fill value stored as an initializer); "
                "name it in requires_grad to train it")
SHAPE_TABLE = ("computed with positions from the input's shape before it meets the data (a position table such as "
               "rotary inv_freq); name it in requires_grad to train it")
NO_GRADIENT = "no gradient reaches it from the loss (it feeds only comparisons, indices or integer values)"
SHAPE_READERS = {("", "Shape"), ("", "Size")}
# Inputs that hold a layer's weights whatever their size: one element there is a layer of one channel (a
# 1-channel BatchNormalization's scale), a parameter, not an exporter's single value.
WEIGHT_INPUTS = {("", "BatchNormalization"): (1, 2), ("", "InstanceNormalization"): (1, 2),
                 ("", "LayerNormalization"): (1, 2), ("", "GroupNormalization"): (1, 2), ("", "Conv"): (1, 2),
                 ("", "ConvTranspose"): (1, 2), ("", "Gemm"): (1, 2), ("", "MatMul"): (0, 1), ("", "PRelu"): (1,)}


@dataclass
class Selection:
    trainable: list[str]
    state: list[str]
    left_out: dict[str, str] = field(default_factory=dict)  # name -> why it does not train


def state_inputs(graph: Graph) -> set[str]:
    """Initializers that ops update as state (running statistics): parameters, never trained. An op in an
    If, Loop or Scan body counts too: it reads the initializer by name, as a captured value."""
    from .control_flow import walk

    names = set()
    for node in walk(graph):
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


def _is_weight(name: str, consumers) -> bool:
    """Whether a node reads `name` as a layer's weights (WEIGHT_INPUTS)."""
    return any(k in WEIGHT_INPUTS.get(node.key, ()) and i == name
               for node in consumers.get(name, []) for k, i in enumerate(node.inputs))


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
        elif np.asarray(graph.initializers[name]).size == 1 and not _is_weight(name, consumers):
            left_out[name] = SINGLE_VALUE
        elif _is_shape_table(name, consumers, data, shaped):
            left_out[name] = SHAPE_TABLE
        else:
            trainable.append(name)
    return Selection(trainable, [n for n in floating if n in state and n not in frozen], left_out)


def quantization_parameters(graph: Graph, frozen, trainable=()) -> list[str]:
    """The scales and zero points that go with the frozen quantized weights among `frozen` (integer
    initializers read by DequantizeLinear), not yet in `frozen` or `trainable`: a frozen int8 weight is
    held in the checkpoint with its scale and zero point."""
    weights = dequantized_weights(graph)
    extra: list[str] = []
    for name in frozen:
        extra += [n for n in weights.get(name, ()) if n not in frozen and n not in trainable and n not in extra]
    return extra


@dataclass
class ParameterChoice:
    """What generate_artifacts receives as requires_grad and frozen_params, and what stays a constant, why."""

    trainable: list[str]
    frozen: list[str]
    left_out: dict[str, str]


@dataclass
class ParameterLayers:
    """The parameters on the way to the loss, as the user chooses among them."""

    layers: list[tuple[str, list[str]]]  # (first consuming node, its new parameters), in graph order
    state: list[str]  # updated by ops as they run (running statistics): frozen, never trained
    left_out: dict[str, str]  # name -> why the default selection does not train it
    used: set[str]  # every initializer on the way to the loss


def parameter_layers(graph: Graph, loss_inputs) -> ParameterLayers:
    """Float parameters on the way to the loss, grouped by the first node consuming them, in graph order,
    with the state and the left-out initializers of `default_selection`. Configuring inputs and the scales
    and zero points of quantization are never parameters to choose, so they join no layer."""
    used = set(graph.prune(list(loss_inputs)).initializers)
    selection = default_selection(graph)
    left_out = {n: why for n, why in selection.left_out.items() if n in used}
    choosable = {n for n in selection.trainable if n in used}
    choosable.update(n for n, why in left_out.items() if why not in (CONFIGURING, QUANTIZATION))
    layers, seen = [], set()
    for node in graph.nodes:
        names = [i for i in node.inputs if i in choosable and i not in seen]
        if names:
            seen.update(names)
            layers.append((node.name, names))
    return ParameterLayers(layers, [n for n in selection.state if n in used], left_out, used)


def choose_parameters(graph: Graph, loss_inputs, requires_grad=None, freeze=None, train_last: int | None = None,
                      list_names: Callable[[list[str]], str] = name_list) -> ParameterChoice:
    """The trainable, frozen (`state`) and left-out parameters from glob patterns to train (`requires_grad`,
    which may name what the default leaves out, such as a rotary table) or to `freeze`, or a count of last
    layers (`train_last`); with none of them, the default selection. `list_names` words the lists of
    names in error messages. Quantized (integer) weights are frozen with their scales and zero points."""
    found = parameter_layers(graph, loss_inputs)
    everything = [n for _, names in found.layers for n in names]
    names = [n for n in everything if n not in found.left_out]
    if not names:
        raise ArgumentError("the model has no floating-point initializers to train")
    candidates = everything if requires_grad else names
    for pattern in requires_grad or freeze or ():
        if not any(fnmatchcase(n, pattern) for n in candidates):
            raise ArgumentError(f"'{pattern}' matches no parameter; the {count(len(candidates), 'parameter')} "
                                f"{'is' if len(candidates) == 1 else 'are'}: {list_names(candidates)}")
    left_out = found.left_out
    if requires_grad:
        trainable = [n for n in candidates if any(fnmatchcase(n, p) for p in requires_grad)]
        left_out = {n: why for n, why in left_out.items() if n not in trainable}
    elif freeze:
        trainable = [n for n in names if not any(fnmatchcase(n, p) for p in freeze)]
    elif train_last is not None:
        layers = [(node, [n for n in group if n not in left_out]) for node, group in found.layers]
        layers = [(node, group) for node, group in layers if group]
        if not 1 <= train_last <= len(layers):
            raise ArgumentError(f"cannot train the last {count(train_last, 'layer')}: the model has "
                                f"{count(len(layers), 'layer')} with parameters ({list_names([n for n, _ in layers])}"
                                f"); give a number from 1 to {len(layers)}")
        trainable = [n for _, group in layers[-train_last:] for n in group]
    else:
        trainable = names
    if not trainable:
        raise ArgumentError("no parameter is left to train: freeze fewer parameters")
    frozen = [n for n in names if n not in trainable] + found.state
    frozen += [n for n in dequantized_weights(graph) if n in found.used]  # int8 weights, with their scales below
    frozen += [n for n in quantization_parameters(graph, frozen) if n not in trainable]
    return ParameterChoice(trainable, frozen, {n: why for n, why in left_out.items() if n not in frozen})
