"""Quantization-aware training: fake quantization inserted into a forward graph, and the QDQ model
exported from it.

`insert_fake_quantization(graph, config, parameters)` (before the loss and gradients are built):
- the weight (input 1, when it is an initializer) of every Conv, MatMul and Gemm goes through
  ai.odtrain FakeQuantizeWeight: int8, symmetric, one scale per output channel (Conv: axis 0;
  Gemm: axis 0 with transB, else 1; MatMul: the last axis), recomputed from the weight each step;
- their other inputs (activations) go through ai.odtrain FakeQuantizeRange: uint8 (or int8), one
  scale and zero point per tensor, from a [min, max] range that training tracks by a moving average
  and that lives in the checkpoint as the frozen parameter `<value>_qat_range` (a value read by
  several such ops is quantized once);
- gradients are straight-through (graph/ops/quantize.py).

`quantized_for_inference(graph)` (the inference model, parameters embedded as initializers) turns
each FakeQuantizeWeight into an int8 initializer read by DequantizeLinear (per channel: axis), and
each FakeQuantizeRange into QuantizeLinear → DequantizeLinear with the scale and zero point of its
stored range: a standard QDQ model that computes the eval model's numbers. The bias of a Conv or
Gemm whose input and weight are both quantized becomes int32, as onnxruntime's quantizer writes it:
scale input_scale × weight_scale (per channel with the weight), zero point 0, read by
DequantizeLinear. That rounds each bias by at most half of its step, a small fraction of the
output's own quantization step; the eval model keeps the float bias.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ArgumentError, ModelError
from .ir import DEFAULT_DOMAIN, ODTRAIN_DOMAIN, Graph, NameScope, Node
from .ops.quantize import QUANTIZED_RANGES

RANGE_SUFFIX = "_qat_range"
PER_AXIS_OPSET = 13  # DequantizeLinear's axis attribute


@dataclass(frozen=True)
class QatConfig:
    """Quantization-aware training settings for `generate_artifacts(..., qat=QatConfig())`.

    weight_dtype: "int8" (symmetric: zero point 0, scale max|w| / 127).
    per_channel: one weight scale per output channel (True) or per tensor.
    activation_dtype: "uint8" (default) or "int8", per tensor, asymmetric.
    averaging: the moving-average constant of the activation ranges (PyTorch's default 0.01).
    op_types: the ops whose weights and inputs are fake-quantized.
    """

    weight_dtype: str = "int8"
    per_channel: bool = True
    activation_dtype: str = "uint8"
    averaging: float = 0.01
    op_types: tuple = ("Conv", "MatMul", "Gemm")

    def __post_init__(self):
        if self.weight_dtype != "int8":
            raise ArgumentError(f"QatConfig(weight_dtype={self.weight_dtype!r}): weights quantize to 'int8'")
        if self.activation_dtype not in ("uint8", "int8"):
            raise ArgumentError(f"QatConfig(activation_dtype={self.activation_dtype!r}): choose 'uint8' or 'int8'")
        if not 0 < self.averaging <= 1:
            raise ArgumentError(f"QatConfig(averaging={self.averaging}): it must lie in (0, 1]")
        unknown = sorted(set(self.op_types) - {"Conv", "MatMul", "Gemm"})
        if unknown:
            raise ArgumentError(f"QatConfig(op_types=...): {unknown} are not quantized; choose from Conv, MatMul, Gemm")


def _weight_axis(node: Node, rank: int) -> int:
    """The output-channel axis of a weight (input 1) of a Conv, Gemm or MatMul."""
    if node.op_type == "Conv":
        return 0
    if node.op_type == "Gemm":
        return 0 if node.attrs.get("transB", 0) else 1
    return rank - 1


def insert_fake_quantization(graph: Graph, config: QatConfig, parameters=()) -> list[str]:
    """In place: fake quantization on the weights and inputs of the chosen ops (see the module docstring);
    returns the names of the range initializers added (state to keep in the checkpoint)."""
    names = NameScope(graph)
    qmin, qmax = QUANTIZED_RANGES[np.dtype(config.activation_dtype)]
    weights = set(graph.initializers) | set(parameters)
    quantized: dict[str, str] = {}  # value -> its fake-quantized name
    ranges: list[str] = []
    nodes: list[Node] = []
    for node in graph.nodes:
        if node.key == (DEFAULT_DOMAIN, "Conv") or node.key in ((DEFAULT_DOMAIN, t) for t in ("MatMul", "Gemm")):
            if node.op_type in config.op_types:
                for index in (0, 1):
                    value = node.inputs[index]
                    if value not in quantized:
                        if index == 1 and value in weights:
                            nodes.append(_weight_node(graph, node, value, names, config))
                        else:
                            nodes.append(_range_node(graph, value, names, config, qmin, qmax, ranges))
                        quantized[value] = nodes[-1].outputs[0]
                    node.inputs[index] = quantized[value]
        nodes.append(node)
    graph.nodes = nodes
    return ranges


def _weight_node(graph: Graph, reader: Node, weight: str, names: NameScope, config: QatConfig) -> Node:
    t = graph.value_types.get(weight)
    if t is None or t.shape is None:
        raise ModelError(f"{reader.describe()}: the shape of weight '{weight}' is unknown; it is needed to quantize it")
    axis = _weight_axis(reader, len(t.shape)) if config.per_channel and len(t.shape) > 1 else -1
    output = names.fresh(f"{weight}_qat")
    graph.value_types[output] = t
    return Node("FakeQuantizeWeight", [weight], [output], {"axis": axis, "qmax": 127},
                names.fresh(f"{weight}_fake_quantize"), ODTRAIN_DOMAIN)


def _range_node(graph: Graph, value: str, names: NameScope, config: QatConfig, qmin: int, qmax: int,
                ranges: list[str]) -> Node:
    stored = names.fresh(f"{value}{RANGE_SUFFIX}")
    graph.initializers[stored] = np.zeros(2, np.float32)  # [0, 0]: unset until the first training batch
    ranges.append(stored)
    outputs = [names.fresh(f"{value}_qat"), names.fresh(f"{stored}_updated"), names.fresh(f"{value}_qat_scale"),
               names.fresh(f"{value}_qat_zero_point")]
    if value in graph.value_types:
        graph.value_types[outputs[0]] = graph.value_types[value]
    return Node("FakeQuantizeRange", [value, stored], outputs,
                {"qmin": qmin, "qmax": qmax, "averaging": float(config.averaging), "training_mode": 1},
                names.fresh(f"{value}_fake_quantize"), ODTRAIN_DOMAIN)


# ---- export --------------------------------------------------------------------------------------------


def range_parameters(stored: np.ndarray, qmin: int, qmax: int) -> tuple[np.float32, float]:
    """The scale and zero point of a tracked [min, max] range (as the FakeQuantizeRange kernel computes them)."""
    low, high = min(np.float32(stored[0]), np.float32(0)), max(np.float32(stored[1]), np.float32(0))
    scale = np.float32((high - low) / np.float32(qmax - qmin))
    scale = scale if scale > 0 else np.float32(1.0)
    return scale, float(np.rint(min(max(np.float32(qmin) - low / scale, qmin), qmax)))


def symmetric_weight(weight: np.ndarray, axis: int, qmax: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values, float32 scales) of a weight quantized as FakeQuantizeWeight does: s = max|w| / qmax."""
    weight = np.asarray(weight, np.float32)
    if axis < 0:
        largest = np.abs(weight).max(initial=np.float32(0)).reshape(())
        shape = ()
    else:
        largest = np.abs(np.moveaxis(weight, axis, 0)).reshape(weight.shape[axis], -1).max(axis=1, initial=0)
        shape = [1] * weight.ndim
        shape[axis] = -1
    scale = np.where(largest > 0, largest / np.float32(qmax), np.float32(1.0)).astype(np.float32)
    values = np.clip(np.rint(weight / scale.reshape(shape)), -qmax - 1, qmax).astype(np.int8)
    return values, scale


def quantized_for_inference(graph: Graph) -> Graph:
    """In place: every FakeQuantizeWeight and FakeQuantizeRange of an inference graph (parameters embedded)
    replaced by standard QuantizeLinear/DequantizeLinear with int8 weights; returns the graph."""
    names = NameScope(graph)
    nodes: list[Node] = []
    scales: dict[str, np.ndarray] = {}  # a dequantized value -> its scale
    for node in graph.nodes:
        if node.key == (ODTRAIN_DOMAIN, "FakeQuantizeWeight"):
            nodes.append(_dequantized_weight(graph, node, names, scales))
        elif node.key == (ODTRAIN_DOMAIN, "FakeQuantizeRange"):
            nodes.extend(_quantize_dequantize(graph, node, names, scales))
        else:
            if node.key in ((DEFAULT_DOMAIN, "Conv"), (DEFAULT_DOMAIN, "Gemm")):
                nodes.extend(_int32_bias(graph, node, names, scales))
            nodes.append(node)
    graph.nodes = nodes
    read = {name for node in nodes for name in node.inputs}
    for name in [n for n in graph.initializers if n not in read and n not in graph.outputs]:
        del graph.initializers[name]  # float weights and ranges, now replaced
    return graph


def _constant(graph: Graph, node: Node, name: str) -> np.ndarray:
    if name not in graph.initializers:
        raise ModelError(f"{node.describe()}: '{name}' must be a parameter or constant to export a quantized model")
    return graph.initializers[name]


def _dequantized_weight(graph: Graph, node: Node, names: NameScope, scales: dict) -> Node:
    weight = node.inputs[0]
    axis = int(node.attrs.get("axis", 0))
    if axis >= 0 and graph.opsets.get(DEFAULT_DOMAIN, PER_AXIS_OPSET) < PER_AXIS_OPSET:
        raise ModelError(f"{node.describe()}: per-channel weights need DequantizeLinear's axis (opset "
                         f"{PER_AXIS_OPSET}); export the model with opset {PER_AXIS_OPSET} or newer, or train with "
                         "QatConfig(per_channel=False)")
    values, scale = symmetric_weight(_constant(graph, node, weight), axis, int(node.attrs.get("qmax", 127)))
    quantized, scale_name, zero_name = (names.fresh(f"{weight}_quantized"), names.fresh(f"{weight}_scale"),
                                        names.fresh(f"{weight}_zero_point"))
    graph.initializers.update({quantized: values, scale_name: scale, zero_name: np.zeros(scale.shape, np.int8)})
    scales[node.outputs[0]] = scale
    attrs = {"axis": axis} if axis >= 0 else {}
    return Node("DequantizeLinear", [quantized, scale_name, zero_name], node.outputs[:1], attrs, node.name)


def _quantize_dequantize(graph: Graph, node: Node, names: NameScope, scales: dict) -> list[Node]:
    value, stored = node.inputs[0], node.inputs[1]
    qmin, qmax = int(node.attrs["qmin"]), int(node.attrs["qmax"])
    scale, zero = range_parameters(_constant(graph, node, stored), qmin, qmax)
    dtype = next(d for d, r in QUANTIZED_RANGES.items() if r == (qmin, qmax))
    scale_name, zero_name, quantized = (names.fresh(f"{value}_scale"), names.fresh(f"{value}_zero_point"),
                                        names.fresh(f"{value}_quantized"))
    graph.initializers.update({scale_name: np.asarray(scale, np.float32), zero_name: np.asarray(zero, dtype)})
    scales[node.outputs[0]] = np.asarray(scale, np.float32)
    return [Node("QuantizeLinear", [value, scale_name, zero_name], [quantized], {}, f"{node.name}_quantize"),
            Node("DequantizeLinear", [quantized, scale_name, zero_name], node.outputs[:1], {}, f"{node.name}_dequantize")]


def _int32_bias(graph: Graph, node: Node, names: NameScope, scales: dict) -> list[Node]:
    """In place on `node` (a Conv or Gemm): its float bias as int32 values read by DequantizeLinear, with scale
    input_scale × weight_scale and zero point 0, when its input and weight are quantized; returns that
    DequantizeLinear, or nothing where the bias stays float (none, not a constant, not one value per output
    channel, or a Gemm that scales it: alpha or beta other than 1)."""
    bias = node.inputs[2] if len(node.inputs) > 2 else ""
    x, weight = node.inputs[0], node.inputs[1]
    if not bias or bias not in graph.initializers or x not in scales or weight not in scales:
        return []
    if node.op_type == "Gemm" and (node.attrs.get("alpha", 1.0) != 1.0 or node.attrs.get("beta", 1.0) != 1.0):
        return []
    values = np.asarray(graph.initializers[bias], np.float32)
    scale = (scales[x] * scales[weight]).astype(np.float32)  # float32, as onnxruntime's quantizer multiplies
    if values.ndim != 1 or scale.ndim > 1 or (scale.ndim == 1 and scale.size != values.size):
        return []
    info = np.iinfo(np.int32)
    quantized = np.clip(np.rint(values / scale).astype(np.float64), info.min, info.max).astype(np.int32)
    quantized_name, scale_name, zero_name, dequantized = (
        names.fresh(f"{bias}_quantized"), names.fresh(f"{bias}_scale"), names.fresh(f"{bias}_zero_point"),
        names.fresh(f"{bias}_dequantized"))
    graph.initializers.update({quantized_name: quantized, scale_name: scale,
                               zero_name: np.zeros(scale.shape, np.int32)})
    if bias in graph.value_types:
        graph.value_types[dequantized] = graph.value_types[bias]
    node.inputs[2] = dequantized
    attrs = {"axis": 0} if scale.ndim == 1 else {}
    return [Node("DequantizeLinear", [quantized_name, scale_name, zero_name], [dequantized], attrs,
                 names.fresh(f"{bias}_dequantize"))]
