"""LoRA adapters: low-rank updates of frozen weights, added to the forward graph and merged back for export.

For each targeted weight W (2-D, feeding MatMul or Gemm as its second operand, directly or through
Transpose(perm=[1, 0])), with M the [in_features, out_features] matrix the product uses (W, or Wᵀ for
an exported nn.Linear), `add_adapters` adds
    W.lora_A [in_features, rank]  (graph/lora_init.py: Kaiming-uniform, seeded)
    W.lora_B [rank, out_features] (zeros)
and after every product y = x·M (+ bias) it writes
    y = y_base + (alpha/rank)·((x·A)·B)
which equals x·(M + (alpha/rank)·A·B) without forming the matrix: backward needs x·A's and the
output's gradients (rank-wide products), never a full [in, out] weight gradient. The nodes are named
`<W>.lora/<k>/{down,up,scale,add}`, so that `merge_adapters` finds them again and writes
M + (alpha/rank)·A·B into W (transposed back when W was used transposed), leaving the model as
exported: any runtime runs it.
"""
from __future__ import annotations

import numpy as np

from .errors import ModelError
from .ir import Graph, Node, TensorType
from .lora_init import lora_a, lora_b

SUFFIX_A, SUFFIX_B, SUFFIX_SCALE, NODE_MARK = ".lora_A", ".lora_B", ".lora_scale", ".lora/"
PRODUCTS = (("", "MatMul"), ("", "Gemm"))


def reads_transposed(product: Node, weight: str) -> bool:
    """Whether `product` multiplies by Wᵀ: it reads W (or Transpose(W)) as B, and Gemm's transB flips it."""
    flipped = product.key == ("", "Gemm") and bool(product.attrs.get("transB", 0))
    return (product.inputs[1] == weight) == flipped


def _uses(graph: Graph, name: str, consumers) -> list[Node] | str:
    """The products reading weight `name` as their B (directly or through Transpose), or why it cannot be adapted."""
    uses = []
    for node in consumers.get(name, []):
        if node.key == ("", "Transpose") and list(node.attrs.get("perm", [1, 0])) == [1, 0]:
            readers = consumers.get(node.outputs[0], [])
            if not readers or any(r.key not in PRODUCTS or r.inputs[1] != node.outputs[0] for r in readers):
                return f"its transpose feeds {', '.join(r.describe() for r in readers)}, not only a product's B"
            uses += readers
        elif node.key in PRODUCTS and node.inputs[1] == name and node.inputs[0] != name:
            uses.append(node)
        else:
            return f"it feeds {node.describe()}, which is not a MatMul or Gemm reading it as B"
    for use in uses:
        if use.key == ("", "Gemm") and use.attrs.get("transA", 0):
            return f"{use.describe()} transposes its A operand"
    return uses if uses else "no product reads it"


def matrices(graph: Graph) -> list[str]:
    """The 2-D floating-point initializers: what LoRA may target."""
    return [n for n, v in graph.initializers.items() if np.asarray(v).ndim == 2 and
            np.issubdtype(np.asarray(v).dtype, np.floating)]


def reading_nodes(graph: Graph, names) -> dict[str, list[str]]:
    """For each weight name: the names and module paths (Node.scope) of the nodes that read it, directly or
    through a Transpose, so that a weight the exporter renamed, such as the dynamo exporter's `val_N`, is
    found by its layer ('/model/layers.0/self_attn/q_proj/MatMul', 'model.layers.0.self_attn.q_proj/linear',
    'model.layers.0.self_attn.q_proj')."""
    consumers = graph.consumers()
    found = {}
    for name in names:
        direct = consumers.get(name, [])
        nodes = direct + [r for n in direct if n.key == ("", "Transpose") for r in consumers.get(n.outputs[0], [])]
        # a scope is 'module path/op': the module path alone names the layer too, as PyTorch names it
        found[name] = ([n.name for n in nodes] + [n.scope for n in nodes if n.scope]
                       + [n.scope.rsplit("/", 1)[0] for n in nodes if "/" in n.scope])
    return found


def adaptable(graph: Graph, names) -> dict[str, list[Node] | str]:
    """For each weight name: the products that read it, or why it cannot be adapted."""
    consumers = graph.consumers()
    return {name: _uses(graph, name, consumers) for name in names}


def add_adapters(graph: Graph, weights: list[str], rank: int, scale: float, seed: int
                 ) -> tuple[Graph, dict[str, np.ndarray]]:
    """A copy of `graph` with rank-`rank` adapters scaled by `scale` on `weights`, and the adapters' initial
    values (A seeded by `seed`)."""
    adapted = graph.copy()
    found = adaptable(adapted, weights)
    for weight, uses in found.items():
        if isinstance(uses, str):
            raise ModelError(f"LoRA target '{weight}' cannot be adapted: {uses}")
    values: dict[str, np.ndarray] = {}
    nodes = list(adapted.nodes)
    for weight, uses in found.items():
        matrix = np.asarray(adapted.initializers[weight])
        orientations = {reads_transposed(p, weight) for p in uses}
        if len(orientations) > 1:
            raise ModelError(f"LoRA target '{weight}' is read both as itself and transposed; adapt it in one "
                             "orientation only")
        in_features, out_features = matrix.shape[::-1] if orientations.pop() else matrix.shape
        a_name, b_name, scale_name = weight + SUFFIX_A, weight + SUFFIX_B, weight + SUFFIX_SCALE
        for name, value in ((a_name, lora_a(weight, in_features, rank, seed)), (b_name, lora_b(rank, out_features))):
            values[name] = adapted.initializers[name] = value
            adapted.value_types[name] = TensorType(value.dtype, value.shape)
        adapted.initializers[scale_name] = np.array(scale, dtype=np.float32)
        for k, product in enumerate(uses):
            prefix = f"{weight}{NODE_MARK}{k}/"
            base, y = prefix + "base", product.outputs[0]
            product.outputs[0] = base
            x = product.inputs[0]
            lora_nodes = [Node(product.op_type, [x, a_name], [prefix + "down_out"], {}, prefix + "down"),
                          Node("MatMul", [prefix + "down_out", b_name], [prefix + "up_out"], {}, prefix + "up"),
                          Node("Mul", [prefix + "up_out", scale_name], [prefix + "scale_out"], {}, prefix + "scale"),
                          Node("Add", [base, prefix + "scale_out"], [y], {}, prefix + "add")]
            if y in adapted.value_types:
                adapted.value_types[base] = adapted.value_types[y]
            at = nodes.index(product) + 1
            nodes[at:at] = lora_nodes
    adapted.nodes = nodes
    return adapted, values


def merge_adapters(graph: Graph) -> Graph:
    """A copy of `graph` (adapters and weights as initializers) with each adapter merged into its weight:
    W ← W + s·A·B (or its transpose), and the adapter nodes and initializers gone."""
    merged = graph.copy()
    producers = merged.producers()
    removed: set[int] = set()
    done: set[str] = set()
    for node in merged.nodes:
        if NODE_MARK not in node.name or not node.name.endswith("/add"):
            continue
        weight = node.name.split(NODE_MARK)[0]
        prefix = node.name[:-len("add")]
        base = producers[node.inputs[0]]
        if weight not in done:  # one merge per weight, however many products read it
            a, b = merged.initializers[weight + SUFFIX_A], merged.initializers[weight + SUFFIX_B]
            scale = float(np.asarray(merged.initializers[weight + SUFFIX_SCALE]))
            update = scale * (a.astype(np.float64) @ b.astype(np.float64))
            matrix = np.asarray(merged.initializers[weight], dtype=np.float64)
            merged.initializers[weight] = (matrix + (update.T if reads_transposed(base, weight) else update)
                                           ).astype(np.float32)
            done.add(weight)
        base.outputs[0] = node.outputs[0]
        removed.update(id(n) for n in merged.nodes if n.name.startswith(prefix))
    if not done:
        return merged
    merged.nodes = [n for n in merged.nodes if id(n) not in removed]
    for weight in done:
        for suffix in (SUFFIX_A, SUFFIX_B, SUFFIX_SCALE):
            merged.initializers.pop(weight + suffix, None)
    return merged.prune(list(merged.outputs))



def scales(graph: Graph) -> dict[str, float]:
    """weight -> alpha/rank of the adapters a graph (training or eval model) holds."""
    return {name[:-len(SUFFIX_SCALE)]: float(np.asarray(value)) for name, value in graph.initializers.items()
            if name.endswith(SUFFIX_SCALE)}
