"""Cost model: how much work running a node once takes, estimated from its op's registration and bound shapes.

Used to choose what to recompute under a memory budget (`graph/recompute.py`), where only the
relative cost of nodes matters. The unit is the time a memory-bound loop takes to read or write
one element. The facts about an op come from its registration (`graph/ops`, `@op(...)`); this
module holds only the two constants that weigh them (FLOPS_PER_ELEMENT, WINDOW_READ, timed as said
at the end):
- Every op touches each element of its inputs and outputs once (inputs read for their shape
  only do not count), times its `passes` for ops that go over their data more than once
  (normalizations, softmax) or evaluate a transcendental function per element.
- Products (ops registered with `flops`: Conv, ConvTranspose, Gemm, MatMul, FusedMatMul, GRU,
  LSTM) add their operations, 2 per multiply-add, FLOPS_PER_ELEMENT of them per unit.
- Ops over sliding windows (registered with `window_reads`) add the input elements their windows
  read: a product gathers each once into its im2col buffer (one unit each), which is what
  dominates a depthwise Conv; an op that computes on every window element (MaxPool,
  AveragePool) takes WINDOW_READ units for each.
- `product_flops` also counts the gradients that are products again (registered with
  `gradient_product`: a Conv's input and weight gradients, MatMul's), as the step profile
  (`odtrain.profile`) reports them; `node_cost` does not.
- Views (Reshape, Flatten, ...) cost nothing.
Values without a static type count as one element. The constants come from timing each forward
node of MobileNetV2, a ResNet-style CNN and a transformer encoder on one x86-64 core (`odtrain
profile --threads 1`): with them most ops, products included, take about the same time per unit,
within a small factor; pooling and reductions over small outputs are slower per unit, which only
matters where they are cheap anyway.
"""
from __future__ import annotations

from .ir import Node, TensorType
from .ops import is_view, lookup

# Operations of a blocked product in the time a memory-bound loop moves one element.
FLOPS_PER_ELEMENT = 8.0
WINDOW_READ = 4.0


def _size(t: TensorType | None) -> int:
    if t is None or not t.is_static:
        return 1
    return t.size


def _typed(types: dict, names) -> list[TensorType | None]:
    return [types.get(n) if n else None for n in names]


def _at_static_shapes(count, node: Node, types: dict) -> float:
    """`count(node, input types, output type)` (a registered `flops` or `window_reads`), or 0 when the op
    registers none or its first two inputs or its output have no static type."""
    ins = _typed(types, node.inputs)
    out = types.get(node.outputs[0]) if node.outputs and node.outputs[0] else None
    if count is None or any(t is None or not t.is_static for t in ins[:2]) or out is None or not out.is_static:
        return 0.0
    return count(node, ins, out)


def product_flops(node: Node, types: dict) -> float:
    """Operations (2 per multiply-add) of a product node, or of a gradient that is one (registered with
    `gradient_product`), at its bound shapes; 0 for any other node."""
    opdef = lookup(node)
    if opdef.gradient_product is not None:
        forward, x, w, dy = opdef.gradient_product
        if len(node.inputs) <= max(x, w, dy):
            return 0.0
        return product_flops(Node(forward, [node.inputs[x], node.inputs[w]], [node.inputs[dy]], node.attrs), types)
    return _at_static_shapes(opdef.flops, node, types)


def node_cost(node: Node, types: dict) -> float:
    """The estimated work of running `node` once (see the module docstring for the unit)."""
    opdef = lookup(node)
    ins, outs = _typed(types, node.inputs), _typed(types, node.outputs)
    if node.outputs and is_view(opdef, ins, [t for t in outs if t is not None]):
        return 0.0
    touched = sum(_size(t) for i, t in enumerate(ins) if t is not None and i not in opdef.shape_only)
    touched += sum(_size(t) for t in outs if t is not None)
    window_read = 1.0 if opdef.flops is not None else WINDOW_READ
    return (touched * opdef.passes + _at_static_shapes(opdef.flops, node, types) / FLOPS_PER_ELEMENT
            + window_read * _at_static_shapes(opdef.window_reads, node, types))
