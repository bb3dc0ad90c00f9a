"""Choices that suit personalising a trained model on a few samples: frozen BatchNorm statistics, bias-only updates.

- `freeze_batch_norm(model)`: BatchNormalization in training mode
  (`training_mode=1`, as `torch.onnx.export(..., training=TrainingMode.TRAINING)`
  writes it) normalises each batch by the batch's own mean and variance and
  updates the running statistics. On a handful of personal samples, in
  small batches, those statistics are noisy and drift away from the ones
  the model was trained with. Frozen, each such node is rewritten to its
  inference form (`training_mode=0`, its running-statistics outputs
  dropped): training normalises with the running mean and variance, as
  inference does, and leaves them as they were. The running statistics
  stay frozen parameters in the checkpoint; the scale and bias still train.
- `bias_parameters(graph)`: the additive parameters of a model's layers,
  which TinyTL (Cai et al., 2020) trains alone to adapt a frozen network in
  little memory: the bias of Conv, ConvTranspose and Gemm (input 2), the
  shift of a normalization (input 2 of BatchNormalization,
  LayerNormalization, InstanceNormalization, GroupNormalization), and a
  one-dimensional initializer added to a MatMul's output (an exported
  Linear layer). `with_biases` adds them to a parameter choice.
"""
from __future__ import annotations

import numpy as np

BIAS_INPUTS = {"Conv": 2, "ConvTranspose": 2, "Gemm": 2, "BatchNormalization": 2, "LayerNormalization": 2,
               "InstanceNormalization": 2, "GroupNormalization": 2}


def freeze_batch_norm(model) -> tuple[int, int]:
    """Rewrite the training-mode BatchNormalization nodes of an onnx ModelProto in place to their inference
    form (see the module docstring): (nodes rewritten, nodes already in inference form)."""
    from onnx import helper

    rewritten, already = 0, 0
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        mode = next((a for a in node.attribute if a.name == "training_mode"), None)
        if mode is None or helper.get_attribute_value(mode) == 0:
            already += 1
            continue
        node.attribute.remove(mode)
        node.attribute.append(helper.make_attribute("training_mode", 0))
        statistics = list(node.output[1:])
        del node.output[1:]
        # the running-statistics outputs are gone; a graph output naming one would dangle
        kept = [o for o in model.graph.output if o.name not in statistics]
        if len(kept) != len(model.graph.output):
            del model.graph.output[:]
            model.graph.output.extend(kept)
        rewritten += 1
    return rewritten, already


def bias_parameters(graph) -> list[str]:
    """The float32 initializers that are layers' biases (see the module docstring), in graph order."""
    producers = graph.producers()
    found = []
    for node in graph.nodes:
        index = BIAS_INPUTS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        candidates = [node.inputs[index]] if index is not None and index < len(node.inputs) else []
        if node.op_type == "Add" and node.domain in ("", "ai.onnx") and len(node.inputs) == 2:
            for this, other in (node.inputs, node.inputs[::-1]):
                made_by = producers.get(other)
                if made_by is not None and made_by.op_type == "MatMul":
                    candidates.append(this)
        for name in candidates:
            value = graph.initializers.get(name)
            if value is not None and value.dtype == np.float32 and value.ndim == 1 and name not in found:
                found.append(name)
    return found


def with_biases(graph, trainable: list[str], frozen: list[str], chosen: bool) -> tuple[list[str], list[str]]:
    """(trainable, frozen) with every bias among the parameters trainable besides what `chosen` (a selection
    the user made, e.g. the last layers) picked; without one, the biases alone train."""
    biases = set(bias_parameters(graph))
    everything = list(trainable) + [n for n in frozen if n not in trainable]
    base = set(trainable) if chosen else set()
    order = list(graph.initializers)
    wanted = sorted((n for n in everything if n in base or n in biases), key=order.index)
    return wanted, sorted((n for n in everything if n not in wanted), key=order.index)
