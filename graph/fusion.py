"""Fusions of exported op patterns, applied to the forward graph before it is differentiated.

Only the training model is fused: the eval and inference models keep the exporter's ops, so
they stay standard ONNX that any runtime reads. Each fusion replaces a chain whose
intermediate values nobody else reads (and that are not graph outputs) by one op that keeps
the chain's output name, so the rest of the graph is untouched:

- Erf GELU, as PyTorch exports F.gelu before opset 20:
      Mul(Mul(x, Add(Erf(Div(x, √2)), 1)), 0.5)      (operands in either order; Mul by 1/√2 too)
  → ai.odtrain Gelu(x): forward one pass instead of five, backward one instead of about six.
- A weight transposed for a product, as exported nn.Linear (do_constant_folding=False):
      MatMul(A, Transpose(W, perm=[1, 0]))  → ai.odtrain FusedMatMul(A, W, transB=1)
  and a product scaled by a scalar constant (attention's 1/√d):
      Mul(MatMul(A, B), c)                  → FusedMatMul(A, B, alpha=c)
  BLAS takes the transpose and the scale as arguments; neither is a pass over memory, forward
  or backward, and the weight's gradient comes out untransposed.
- A bias added to a product (nn.Linear on more than two axes exports MatMul, then Add):
      Add(FusedMatMul(A, B), bias)          → FusedMatMul(A, B, "", bias)
  when the bias broadcasts to the product's shape without enlarging it: the output starts as
  the broadcast bias and BLAS adds the product to it (beta = 1), one pass over the output fewer.
- Attention's head transposes: a product whose operand is Transpose(x, perm) or whose only
  reader is Transpose(y, perm), with one of the last two axes left contiguous
      MatMul(Transpose(Reshape(q)), Transpose(Reshape(k)))     → FusedMatMul(permA, permB)
      Transpose(MatMul(p, Transpose(Reshape(v))), [0, 2, 1, 3]) → FusedMatMul(permB, permY)
  BLAS reads the heads in place through their row stride and writes the merged heads
  directly; the gradients do the same, so neither pass has a transposed copy.
"""
from __future__ import annotations

import numpy as np

from .ir import ODTRAIN_DOMAIN, Graph, Node
from .ops.linalg import adds_into, fused_matmul_shape


class _Index:
    """Producers, consumers and constant values of a graph, for pattern matching."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.producer = graph.producers()
        self.consumers = graph.consumers()
        self.outputs = set(graph.outputs)

    def const(self, name: str):
        if name in self.graph.initializers:
            return np.asarray(self.graph.initializers[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and node.key == ("", "Constant"):
            from .ops.tensor import constant_value

            return constant_value(node)
        return None

    def scalar(self, name: str) -> float | None:
        value = self.const(name)
        if value is None or value.size != 1 or not np.issubdtype(value.dtype, np.floating):
            return None
        return float(value.reshape(()))

    def private(self, name: str) -> bool:
        """Read by exactly one node and not a graph output: safe to fold away."""
        return name not in self.outputs and len(self.consumers.get(name, [])) == 1

    def made_by(self, name: str, op_type: str) -> Node | None:
        node = self.producer.get(name)
        return node if node is not None and node.key == ("", op_type) else None


def _near(value: float | None, target: float, tolerance: float = 1e-4) -> bool:
    return value is not None and abs(value - target) <= tolerance * abs(target)


def _other(node: Node, name: str) -> str:
    """The other input of a binary node."""
    return node.inputs[1] if node.inputs[0] == name else node.inputs[0]


def _match_gelu(index: _Index, last: Node):
    """The nodes of an Erf GELU ending at `last` (the Mul by 0.5), and its input, or None."""
    if last.key != ("", "Mul"):
        return None
    for product_name in last.inputs:
        if not _near(index.scalar(_other(last, product_name)), 0.5):
            continue
        product = index.made_by(product_name, "Mul")
        if product is None or not index.private(product_name):
            continue
        for shifted_name in product.inputs:
            x = _other(product, shifted_name)
            shifted = index.made_by(shifted_name, "Add")
            if shifted is None or not index.private(shifted_name):
                continue
            for erf_name in shifted.inputs:
                erf = index.made_by(erf_name, "Erf")
                if erf is None or not index.private(erf_name) or not _near(index.scalar(_other(shifted, erf_name)), 1.0):
                    continue
                scaled = index.producer.get(erf.inputs[0])
                if scaled is None or not index.private(erf.inputs[0]) or scaled.inputs[0] != x:
                    continue
                factor = index.scalar(scaled.inputs[1])
                if (scaled.key == ("", "Div") and _near(factor, np.sqrt(2.0))) or \
                        (scaled.key == ("", "Mul") and _near(factor, 1 / np.sqrt(2.0))):
                    return [scaled, erf, shifted, product, last], x
    return None


def _match_transposed_weight(index: _Index, node: Node):
    """MatMul(A, Transpose(W, [1, 0])) → FusedMatMul(A, W, transB=1)."""
    if node.key != ("", "MatMul"):
        return None
    transpose = index.made_by(node.inputs[1], "Transpose")
    if transpose is None or not index.private(node.inputs[1]) or list(transpose.attrs.get("perm", [])) != [1, 0]:
        return None
    a_type = index.graph.value_types.get(node.inputs[0])
    if a_type is None or a_type.shape is None or len(a_type.shape) < 2:
        return None
    fused = Node("FusedMatMul", [node.inputs[0], transpose.inputs[0]], list(node.outputs), {"transB": 1},
                 node.name, ODTRAIN_DOMAIN)
    return [transpose, node], fused


def _match_scaled_product(index: _Index, node: Node):
    """Mul(MatMul(A, B) or FusedMatMul, scalar) → FusedMatMul(A, B, alpha=scalar)."""
    if node.key != ("", "Mul"):
        return None
    for product_name in node.inputs:
        alpha = index.scalar(_other(node, product_name))
        producer = index.producer.get(product_name)
        if alpha is None or producer is None or not index.private(product_name):
            continue
        if producer.key == ("", "MatMul"):
            ranks = [index.graph.value_types.get(i) for i in producer.inputs]
            if any(t is None or t.shape is None or len(t.shape) < 2 for t in ranks):
                continue
            attrs = {}
        elif producer.key == (ODTRAIN_DOMAIN, "FusedMatMul") and len(producer.inputs) == 2:
            attrs = dict(producer.attrs)
        else:
            continue
        attrs["alpha"] = float(attrs.get("alpha", 1.0)) * alpha
        fused = Node("FusedMatMul", list(producer.inputs[:2]), list(node.outputs), attrs, producer.name, ODTRAIN_DOMAIN)
        return [producer, node], fused
    return None


def _match_bias(index: _Index, node: Node):
    """Add(FusedMatMul(A, B), bias) → FusedMatMul(A, B, "", bias) for a product read and written in place
    (no perms), when the bias does not enlarge it."""
    if node.key != ("", "Add"):
        return None
    for product_name in node.inputs:
        product = index.producer.get(product_name)
        if product is None or product.key != (ODTRAIN_DOMAIN, "FusedMatMul") or len(product.inputs) != 2 or \
                any(key in product.attrs for key in ("permA", "permB", "permY")) or not index.private(product_name):
            continue
        a, b = (index.graph.value_types.get(i) for i in product.inputs)
        bias = index.graph.value_types.get(_other(node, product_name))
        if any(t is None or t.shape is None for t in (a, b, bias)) or bias.dtype != a.dtype:
            continue
        if not adds_into(bias.shape, fused_matmul_shape(product, a.shape, b.shape)):
            continue
        fused = Node("FusedMatMul", list(product.inputs) + ["", _other(node, product_name)], list(node.outputs),
                     dict(product.attrs), product.name, ODTRAIN_DOMAIN)
        return [product, node], fused
    return None


def _absorbable(perm) -> bool:
    """A transpose BLAS can read or write in place: one of the last two axes stays the contiguous one."""
    perm = [int(p) for p in perm]
    last = len(perm) - 1
    return len(perm) >= 2 and perm != list(range(len(perm))) and last in perm[-2:]


def _as_fused(index: _Index, node: Node) -> Node | None:
    """A MatMul (operands of rank 2 or more) or a 2-input FusedMatMul, as a FusedMatMul node."""
    if node.key == (ODTRAIN_DOMAIN, "FusedMatMul") and len(node.inputs) == 2:
        return Node("FusedMatMul", list(node.inputs), list(node.outputs), dict(node.attrs), node.name, ODTRAIN_DOMAIN)
    if node.key == ("", "MatMul"):
        ranks = [index.graph.value_types.get(i) for i in node.inputs]
        if all(t is not None and t.shape is not None and len(t.shape) >= 2 for t in ranks):
            return Node("FusedMatMul", list(node.inputs), list(node.outputs), {}, node.name, ODTRAIN_DOMAIN)
    return None


def _match_head_transposes(index: _Index, node: Node):
    """Transposes around a product (attention's head split and merge) → FusedMatMul permA/permB/permY."""
    fused = _as_fused(index, node)
    if fused is None:
        return None
    removed = [node]
    for i, key in ((0, "permA"), (1, "permB")):
        transpose = index.made_by(node.inputs[i], "Transpose")
        if transpose is None or key in fused.attrs or not index.private(node.inputs[i]) or \
                "perm" not in transpose.attrs or not _absorbable(transpose.attrs["perm"]):
            continue
        fused.inputs[i] = transpose.inputs[0]
        fused.attrs[key] = [int(p) for p in transpose.attrs["perm"]]
        removed.append(transpose)
    users = index.consumers.get(node.outputs[0], [])
    if "permY" not in fused.attrs and index.private(node.outputs[0]) and users[0].key == ("", "Transpose") and \
            "perm" in users[0].attrs and _absorbable(users[0].attrs["perm"]) and \
            int(users[0].attrs["perm"][-1]) == len(users[0].attrs["perm"]) - 1:
        fused.outputs = list(users[0].outputs)
        fused.attrs["permY"] = [int(p) for p in users[0].attrs["perm"]]
        removed.append(users[0])
    return (removed, fused) if len(removed) > 1 else None


def fuse_for_training(graph: Graph) -> Graph:
    """A copy of `graph` with the patterns above fused (the input is not modified)."""
    fused = graph.copy()
    for rewrite in (_gelu_pass, _matmul_pass, _matmul_pass, _bias_pass):  # the second MatMul pass scales
        rewrite(fused)  # fused products; biases are added to products that are final
    return fused


def _replace(graph: Graph, removed: list[Node], replacement: Node) -> None:
    """Put `replacement` where the last removed node was: its inputs are all computed by then, and the
    readers of its outputs (those of the last removed node, or of the product it replaced) come later."""
    ids = {id(n) for n in removed}
    position = max(i for i, n in enumerate(graph.nodes) if id(n) in ids)
    nodes = []
    for i, n in enumerate(graph.nodes):
        if i == position:
            nodes.append(replacement)
        elif id(n) not in ids:
            nodes.append(n)
    graph.nodes = nodes


def _rewrite_all(graph: Graph, match) -> None:
    """Apply `match(index, node)` everywhere; the index is rebuilt only after a rewrite, so a pass over
    a graph with few matches costs one index, not one per node."""
    index = _Index(graph)
    alive = {id(n) for n in graph.nodes}
    for node in list(graph.nodes):
        if id(node) not in alive:
            continue
        found = match(index, node)
        if found is not None:
            removed, replacement = found
            _replace(graph, removed, replacement)
            alive.difference_update(id(n) for n in removed)
            index = _Index(graph)


def _gelu_pass(graph: Graph) -> None:
    def match(index, node):
        found = _match_gelu(index, node)
        if found is None:
            return None
        chain, x = found
        return chain, Node("Gelu", [x], list(node.outputs), {}, chain[1].name, ODTRAIN_DOMAIN)

    _rewrite_all(graph, match)


def _bias_pass(graph: Graph) -> None:
    _rewrite_all(graph, _match_bias)


def _matmul_pass(graph: Graph) -> None:
    _rewrite_all(graph, lambda index, node: _match_transposed_weight(index, node) or
                 _match_scaled_product(index, node) or _match_head_transposes(index, node))
