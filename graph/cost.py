"""Cost model: how much work running a node once takes, estimated from its op type and bound shapes.

Used to choose what to recompute under a memory budget (`graph/recompute.py`), where only the
relative cost of nodes matters. The unit is the time a memory-bound loop takes to read or write
one element:
- Every op touches each element of its inputs and outputs once (inputs read for their shape
  only do not count), times PASSES for ops that go over their data more than once
  (normalizations, softmax) or evaluate a transcendental function per element.
- Products (Conv, ConvTranspose, Gemm, MatMul, FusedMatMul, GRU, LSTM) add their operations,
  2 per multiply-add, FLOPS_PER_ELEMENT of them per unit; a Conv also reads a window of its
  input per output element and channel group (its im2col), which is what dominates a
  depthwise Conv.
- `product_flops` also counts the gradients that are products again (GRADIENT_PRODUCTS: a Conv's
  input and weight gradients, MatMul's), as the step profile (`odtrain.profile`) reports them.
- Windowed ops (MaxPool, AveragePool) read WINDOW_READ units per window element.
- Views (Reshape, Flatten, ...) cost nothing.
Values without a static type count as one element. The constants come from timing each forward
node of MobileNetV2, a ResNet-style CNN and a transformer encoder on one x86-64 core: most ops
then take 0.05-0.3 ns per unit (Conv 0.13, BatchNormalization 0.05-0.07, Relu and Add 0.1-0.3,
FusedMatMul 0.06); pooling and reductions over small outputs are slower (0.5-1.5).
"""
from __future__ import annotations

import math

from .ir import Node, TensorType
from .ops import is_view, lookup
from .ops.linalg import fused_matmul_shape, matmul_shape

# Operations of a blocked product in the time a memory-bound loop moves one element.
FLOPS_PER_ELEMENT = 8.0
WINDOW_READ = 4.0

PASSES = {
    "BatchNormalization": 3.0,  # in training: mean, variance, then normalize
    "BatchNormalizationActivation": 3.0,
    "LayerNormalization": 3.0,
    "Softmax": 3.0, "LogSoftmax": 3.0,  # maximum, sum of exponentials, normalize
    "Exp": 2.0, "Log": 2.0, "Tanh": 2.0, "Sigmoid": 2.0, "Erf": 2.0, "Gelu": 2.0, "Pow": 2.0, "Sqrt": 2.0,
}
PRODUCTS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "FusedMatMul", "GRU", "LSTM"})
# Gradients that are products again, as many operations as the forward product they differentiate:
# op type -> (forward op, positions of its two operands among the gradient's inputs, position of dY).
GRADIENT_PRODUCTS = {
    "ConvInputGrad": ("Conv", 2, 1, 0), "ConvWeightGrad": ("Conv", 1, 2, 0),  # (dY, W, X), (dY, X, W)
    "ConvTransposeInputGrad": ("ConvTranspose", 2, 1, 0), "ConvTransposeWeightGrad": ("ConvTranspose", 1, 2, 0),
    "MatMulGradA": ("MatMul", 2, 1, 0), "MatMulGradB": ("MatMul", 0, 2, 1),  # (dY, B, A), (A, dY, B)
}


def _size(t: TensorType | None) -> int:
    if t is None or not t.is_static:
        return 1
    return t.size


def _typed(types: dict, names) -> list[TensorType | None]:
    return [types.get(n) if n else None for n in names]


def product_flops(node: Node, types: dict) -> float:
    """Operations (2 per multiply-add) of a product node, or of a gradient that is one (GRADIENT_PRODUCTS),
    at its bound shapes; 0 for any other node."""
    if node.op_type in GRADIENT_PRODUCTS:
        forward, x, w, dy = GRADIENT_PRODUCTS[node.op_type]
        if len(node.inputs) <= max(x, w, dy):
            return 0.0
        return product_flops(Node(forward, [node.inputs[x], node.inputs[w]], [node.inputs[dy]], node.attrs), types)
    if node.op_type not in PRODUCTS:
        return 0.0
    ins = _typed(types, node.inputs)
    out = types.get(node.outputs[0]) if node.outputs and node.outputs[0] else None
    if any(t is None or not t.is_static for t in ins[:2]) or out is None or not out.is_static:
        return 0.0
    a, b = ins[0].shape, ins[1].shape
    op = node.op_type
    if op == "Conv":  # weight [M, C/group, k...]: each output element reads C/group · k... inputs
        return 2.0 * out.size * math.prod(b[1:])
    if op == "ConvTranspose":  # weight [C, M/group, k...]: each input element writes M/group · k... outputs
        return 2.0 * ins[0].size * math.prod(b[1:])
    if op in ("GRU", "LSTM"):  # every step multiplies the input by W and the state by R
        recurrent = ins[2] if len(ins) > 2 and ins[2] is not None and ins[2].is_static else None
        rows = ins[0].size // max(a[-1], 1)  # steps · batch
        return 2.0 * rows * (ins[1].size + (recurrent.size if recurrent else 0))
    if op == "Gemm":
        inner = a[0] if node.attrs.get("transA", 0) else a[-1]
        return 2.0 * out.size * inner
    if op == "FusedMatMul":  # the product before any sum over broadcast axes, A read through permA
        perm = node.attrs.get("permA")
        a_seen = tuple(a[p] for p in perm) if perm is not None else tuple(a)
        inner = a_seen[-2] if node.attrs.get("transA", 0) else a_seen[-1]
        return 2.0 * math.prod(fused_matmul_shape(node, a, b)) * inner
    return 2.0 * math.prod(matmul_shape(node, a, b)) * (a[-1] if a else 1)  # MatMul


def _im2col(node: Node, ins: list, outs: list) -> float:
    """Input elements a Conv gathers: each output position reads its window of every input channel."""
    if node.op_type != "Conv" or not all(t is not None and t.is_static for t in (ins[0], ins[1], outs[0])):
        return 0.0
    weight, out = ins[1].shape, outs[0]
    return out.size / max(weight[0], 1) * ins[0].shape[1] * math.prod(weight[2:])


def node_cost(node: Node, types: dict) -> float:
    """The estimated work of running `node` once (see the module docstring for the unit)."""
    opdef = lookup(node)
    ins, outs = _typed(types, node.inputs), _typed(types, node.outputs)
    if node.outputs and is_view(opdef, ins, [t for t in outs if t is not None]):
        return 0.0
    touched = sum(_size(t) for i, t in enumerate(ins) if t is not None and i not in opdef.shape_only)
    touched += sum(_size(t) for t in outs if t is not None)
    if node.op_type in PRODUCTS:
        return touched + product_flops(node, types) / FLOPS_PER_ELEMENT + _im2col(node, ins, outs)
    if node.op_type in ("MaxPool", "AveragePool"):
        return touched + WINDOW_READ * _size(outs[0]) * math.prod(node.attrs.get("kernel_shape") or [1])
    return touched * PASSES.get(node.op_type, 1.0)
