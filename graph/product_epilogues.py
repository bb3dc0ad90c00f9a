"""Product epilogues: an activation after a matrix product folded into the product's node.

Applied to the training graph after graph/fusion.py's passes and before differentiation, so that a
layer's product, bias and activation are one node, forward and backward:

    Relu(Gemm(A, W, c))            (transA = 0, beta = 1, c of the output's last axis or absent)
    Relu(FusedMatMul(A, W[, "", c]))   (no perms, no `like`, transA = 0, W of rank 2)
    Relu(MatMul(A, W))             (A of rank 2 or more, W of rank 2)
  → ai.odtrain FusedMatMul(A, W, "", c, transB, alpha, activation="Relu")          outputs [Y]
    Gelu(...) (ai.odtrain's, or ONNX's with approximate="none") of the same products
  → ai.odtrain FusedMatMul(..., activation="Gelu")                                   outputs [Y, P]
    (only when asked for: FOLDED says why GELU is not folded by default)

The kernel (kernels/linalg.py, _product_epilogue) runs the product in panels of rows sized to the cache and
applies the bias and the activation to each panel right after its BLAS call, while it is in the cache:
the activation's own pass over memory, which read the product back, disappears. For Relu the gradient
rule (graph/ops/linalg.py) emits one ai.odtrain ActivationBiasGrad that turns dY into the product's
gradient and sums the bias gradient in the same pass, where the unfused graph ran ReluGrad and then a
SumToShape reading it again; GELU's gradient stays GeluGrad and SumToShape (ONE_PASS_GRADIENTS there
says why).

Invariants:
- A fold happens only when the product's output is read by the activation alone and is not a graph
  output. Relu's gradient reads its output Y (0 < Y), so the product's value P is gone; GELU's reads
  P, which the fused node keeps as its second output (the backward needs it, so it stays; the pass
  writes it from the cache, where the unfused graph wrote it and read it back).
- The fused node keeps the activation's output name and the product's node name: the readers of Y
  are untouched.
- Only the training graph is folded: eval and inference models keep the exporter's ops, standard ONNX.
"""
from __future__ import annotations

from .ir import ODTRAIN_DOMAIN, Graph, Node

# activation node key -> the epilogue named on the product
ACTIVATIONS = {("", "Relu"): "Relu", ("", "Gelu"): "Gelu", (ODTRAIN_DOMAIN, "Gelu"): "Gelu"}
# The epilogues folded by default. GELU's is not: unfused, the planner recomputes GELU's output from P in the
# backward (graph/recompute.py, cheap_kept) and saves P alone; folded, the output comes from a product, which is
# not recomputed, so both stay: the transformer's arena grew from 15.2 to 17.8 MB for 0.7 ms of its 34 ms step
# (odtrain profile --clock cpu, batch 16). Relu's gradient reads its output only, so its fold keeps one value too.
FOLDED = {"Relu"}
# epilogues whose gradient reads the product's value P (kept as the fused node's second output)
READS_PRODUCT = {"Gelu"}


def _static_shape(graph: Graph, name: str):
    if name in graph.initializers:
        return tuple(graph.initializers[name].shape)
    known = graph.value_types.get(name)
    return None if known is None or known.shape is None else tuple(known.shape)


def _column_bias(graph: Graph, bias: str, columns) -> bool:
    """Whether `bias` is one value per output column (shape [n], [1, n] and the like) or absent."""
    if not bias:
        return True
    shape = _static_shape(graph, bias)
    return shape is not None and len(shape) >= 1 and shape[-1] == columns and isinstance(columns, int) and \
        all(d == 1 for d in shape[:-1])


def _as_product(graph: Graph, node: Node) -> tuple[list[str], dict] | None:
    """(inputs, attributes) of the FusedMatMul an epilogue can be folded into, or None."""
    weight_shape = _static_shape(graph, node.inputs[1]) if len(node.inputs) > 1 else None
    if weight_shape is None or len(weight_shape) != 2:
        return None
    if node.key == ("", "Gemm"):
        attrs = node.attrs
        if attrs.get("transA", 0) or (len(node.inputs) > 2 and node.inputs[2] and float(attrs.get("beta", 1.0)) != 1.0):
            return None
        bias = node.inputs[2] if len(node.inputs) > 2 else ""
        trans_b = int(attrs.get("transB", 0))
        inputs = [node.inputs[0], node.inputs[1], "", bias] if bias else node.inputs[:2]
        return inputs, {"transB": trans_b, "alpha": float(attrs.get("alpha", 1.0))}
    if node.key == ("", "MatMul"):
        known = _static_shape(graph, node.inputs[0])
        return (list(node.inputs), {"transB": 0, "alpha": 1.0}) if known is not None and len(known) >= 2 else None
    if node.key == (ODTRAIN_DOMAIN, "FusedMatMul"):
        attrs = node.attrs
        if any(key in attrs for key in ("permA", "permB", "permY", "activation")) or attrs.get("transA", 0) or \
                (len(node.inputs) > 2 and node.inputs[2]):
            return None
        bias = node.inputs[3] if len(node.inputs) > 3 else ""
        return (list(node.inputs[:2]) + (["", bias] if bias else []),
                {"transB": int(attrs.get("transB", 0)), "alpha": float(attrs.get("alpha", 1.0))})
    return None


def fold_product_epilogues(graph: Graph, epilogues=None) -> None:
    """Fold each activation (of the `epilogues` named, FOLDED by default) that alone reads a product's output
    into that product, in place."""
    epilogues = FOLDED if epilogues is None else epilogues
    producers, consumers, outputs = graph.producers(), graph.consumers(), set(graph.outputs)
    replaced: dict[int, Node] = {}  # id of an activation -> the fused product taking its place
    folded: set[int] = set()  # ids of the products folded away
    for activation in graph.nodes:
        epilogue = ACTIVATIONS.get(activation.key)
        if epilogue not in epilogues or (epilogue == "Gelu" and activation.attrs.get("approximate", "none") != "none"):
            continue
        value = activation.inputs[0]
        product = producers.get(value)
        if product is None or id(product) in folded or value in outputs or consumers.get(value) != [activation]:
            continue
        found = _as_product(graph, product)
        if found is None:
            continue
        inputs, attrs = found
        weight_shape = _static_shape(graph, inputs[1])
        columns = weight_shape[0] if attrs["transB"] else weight_shape[1]
        if not _column_bias(graph, inputs[3] if len(inputs) > 3 else "", columns):
            continue
        attrs["activation"] = epilogue
        fused_outputs = [activation.outputs[0]] + ([value] if epilogue in READS_PRODUCT else [])
        replaced[id(activation)] = Node("FusedMatMul", inputs, fused_outputs, attrs, product.name, ODTRAIN_DOMAIN,
                                        product.scope)
        folded.add(id(product))
    graph.nodes = [replaced.get(id(n), n) for n in graph.nodes if id(n) not in folded]
