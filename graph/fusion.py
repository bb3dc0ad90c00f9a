"""Fusions of exported op patterns, applied to the forward graph before it is differentiated.

Only the training model is fused: the eval and inference models keep the exporter's ops, so
they stay standard ONNX that any runtime reads. Each fusion replaces a chain whose
intermediate values nobody else reads (and that are not graph outputs) by one op that keeps
the chain's output name, so the rest of the graph is untouched:

- Erf GELU, as PyTorch exports F.gelu before opset 20:
      Mul(Mul(x, Add(Erf(Div(x, √2)), 1)), 0.5)      (operands in either order; Mul by 1/√2 too)
  → ai.odtrain Gelu(x): forward one pass instead of five, backward one instead of about six.
- SiLU as exporters write it before opset 24 (nn.SiLU, the gate of a Llama or Qwen2 MLP):
      Mul(x, Sigmoid(x))      (operands in either order; float32 x)
  → ai.odtrain Swish(x, alpha=1): one pass forward instead of two, and one backward (SwishGrad from x)
  instead of the Mul's two gradients, SigmoidGrad and their Sum. The Sigmoid must have no other reader.
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
- RMSNorm as exporters write it (LlamaRMSNorm; a same-type Cast may sit before the weight):
      Mul(W, Mul(x, Div(1, Sqrt(Add(ReduceMean(Pow(x, 2), [-1]), ε)))))   (Reciprocal for the Div too)
  → ai.odtrain RMSNormalization(x, W, axis=-1, epsilon=ε): one pass forward, one backward.
- Rotary embeddings as exporters write `x·cos + rotate_half(x)·sin`, x [batch, heads, seq, head]:
      Add(Mul(x, cos), Mul(Concat(Neg(Slice(x, h, end)), Slice(x, 0, h), axis=-1), sin))
  → ai.odtrain RotaryEmbedding(x, cos, sin, h): caches of the full head width broadcast to x, as
  the decomposed ops read them; h is the Slices' shared boundary (the TorchScript exporter computes
  it from x's shape, known when the step is bound). Nothing is assumed of the caches' halves or of
  h. Six passes become one.
- A language model's vocabulary product scored by the class-last cross-entropy (graph/losses.py):
      SoftmaxCrossEntropyLoss(Reshape(FusedMatMul(h, W, transB) or MatMul(h, W), [-1, V]), labels)
  → ai.odtrain LinearCrossEntropy(h, W, labels, transB): the [tokens, V] logits and their gradient
  never exist whole; the kernels hold one chunk of rows of them at a time (kernels/training.py).
  A stored weight's DequantizedMatMul (below; that pass runs first) fuses alike, with its scale and axis.
  Only when nothing else reads the logits: a model that also outputs them keeps the product.
- A frozen weight stored as int8, int4 or bfloat16 (graph/frozen.py) read by products and embeddings:
      MatMul(A, DequantizeLinear(W, s, axis)) or FusedMatMul(.., transB) or Gemm → ai.odtrain DequantizedMatMul
      Gather(DequantizeLinear(W, s, axis), ids)                                → ai.odtrain DequantizedGather
  (Cast(W, to=FLOAT) for bfloat16), when every reader of the dequantized weight is one of these: the
  kernels dequantize it a panel at a time (graph/ops/dequantized.py), never whole.
Values computed from constants alone (a Slice's starts through Unsqueeze and Cast, say) are
folded by the ops' own type rules when a pattern needs them.
"""
from __future__ import annotations

import numpy as np

from .frozen import reads_stored
from .ir import ODTRAIN_DOMAIN, Graph, Node, TensorType
from .ops import OPS
from .ops.linalg import adds_into, fused_matmul_shape

FOLD_LIMIT = 1024  # values folded for matching hold at most this many elements


def _fold_small_constants(graph: Graph) -> dict[str, np.ndarray]:
    """Values computed from small constants alone, by the ops' own type rules (which fold what they can)."""
    values = {name: np.asarray(value) for name, value in graph.initializers.items()}
    for node in graph.nodes:
        opdef = OPS.get(node.key)
        inputs = [values.get(name) if name else None for name in node.inputs]
        if opdef is None or opdef.random or any(name and (value is None or value.size > FOLD_LIMIT)
                                                for name, value in zip(node.inputs, inputs)):
            continue
        try:
            result = opdef.infer(node, [TensorType(v.dtype, v.shape) if v is not None else None for v in inputs], inputs)
        except Exception:  # a rule that cannot fold these values: the pattern will not match
            continue
        if isinstance(result, tuple):
            values.update((name, np.asarray(value)) for name, value in zip(node.outputs, result[1]) if name)
    return values


class _Index:
    """Producers, consumers and constant values of a graph, for pattern matching."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.producer = graph.producers()
        self.consumers = graph.consumers()
        self.outputs = set(graph.outputs)
        self._constants = None

    def const(self, name: str):
        """The value of `name` when constants alone compute it (initializers, Constant nodes, small folds)."""
        if name in self.graph.initializers:
            return np.asarray(self.graph.initializers[name])
        if self._constants is None:
            self._constants = _fold_small_constants(self.graph)
        return self._constants.get(name)

    def ints(self, name: str) -> list[int] | None:
        value = self.const(name) if name else None
        return None if value is None or not np.issubdtype(value.dtype, np.integer) else \
            [int(v) for v in value.reshape(-1)]

    def shape(self, name: str):
        t = self.graph.value_types.get(name)
        return None if t is None else t.shape

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


def _match_silu(index: _Index, node: Node):
    """Mul(x, Sigmoid(x)) → Swish(x, alpha=1), when nothing else reads the Sigmoid."""
    if node.key != ("", "Mul"):
        return None
    for sigmoid_name in node.inputs:
        sigmoid = index.made_by(sigmoid_name, "Sigmoid")
        x = sigmoid.inputs[0] if sigmoid is not None else None
        x_type = index.graph.value_types.get(x)
        if sigmoid is None or not index.private(sigmoid_name) or _other(node, sigmoid_name) != x or \
                x_type is None or x_type.dtype != np.float32:
            continue
        return [sigmoid, node], Node("Swish", [x], list(node.outputs), {"alpha": 1.0}, node.name, ODTRAIN_DOMAIN)
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


def _through_same_type_cast(index: _Index, name: str) -> str:
    """The input of a private Cast that changes nothing (float32 to float32), else `name` itself."""
    cast = index.made_by(name, "Cast")
    if cast is None or not index.private(name):
        return name
    before, after = index.graph.value_types.get(cast.inputs[0]), index.graph.value_types.get(name)
    return cast.inputs[0] if before is not None and after is not None and before.dtype == after.dtype else name


def _match_rms_norm(index: _Index, last: Node):
    """The nodes of a decomposed RMSNorm ending at `last` (the weight's Mul), and the fused node, or None."""
    if last.key != ("", "Mul"):
        return None
    for scaled_name in last.inputs:
        weight = _other(last, scaled_name)
        weight_shape = index.shape(weight)
        if weight_shape is None or len(weight_shape) != 1 or not index.private(scaled_name):
            continue
        normed_name = _through_same_type_cast(index, scaled_name)
        normed = index.made_by(normed_name, "Mul")
        if normed is None or (normed_name != scaled_name and not index.private(normed_name)):
            continue
        for inverse_name in normed.inputs:
            x, inverse = _other(normed, inverse_name), index.producer.get(inverse_name)
            x_shape = index.shape(x)
            if inverse is None or not index.private(inverse_name) or x_shape is None or not x_shape or \
                    weight_shape[0] not in (1, x_shape[-1]):
                continue
            if inverse.key == ("", "Div") and _near(index.scalar(inverse.inputs[0]), 1.0):
                root_name = inverse.inputs[1]
            elif inverse.key == ("", "Reciprocal"):
                root_name = inverse.inputs[0]
            else:
                continue
            root = index.made_by(root_name, "Sqrt")
            shifted = index.made_by(root.inputs[0], "Add") if root is not None and index.private(root_name) else None
            if shifted is None or not index.private(root.inputs[0]):
                continue
            for mean_name in shifted.inputs:
                epsilon = index.scalar(_other(shifted, mean_name))
                mean = index.made_by(mean_name, "ReduceMean")
                if epsilon is None or mean is None or not index.private(mean_name):
                    continue
                axes = mean.attrs.get("axes") or index.ints(mean.inputs[1] if len(mean.inputs) > 1 else "")
                if axes is None or [a % len(x_shape) for a in axes] != [len(x_shape) - 1] or \
                        mean.attrs.get("keepdims", 1) != 1 or not index.private(mean.inputs[0]):
                    continue
                square = index.producer.get(mean.inputs[0])
                if square is None or not ((square.key == ("", "Pow") and square.inputs[0] == x and
                                           _near(index.scalar(square.inputs[1]), 2.0)) or
                                          (square.key == ("", "Mul") and square.inputs == [x, x])):
                    continue
                chain = [square, mean, shifted, root, inverse, normed] + \
                    ([index.producer[scaled_name]] if normed_name != scaled_name else []) + [last]
                return chain, Node("RMSNormalization", [x, weight], list(last.outputs),
                                   {"axis": -1, "epsilon": epsilon}, normed.name, ODTRAIN_DOMAIN)
    return None


def _same_value(index: _Index, a: str, b: str, depth: int = 4) -> bool:
    """Whether two values are equal by construction: one name, equal constants, or the same reshaping of
    equal values (exporters unsqueeze one scalar twice for a Slice's end and the next Slice's start)."""
    if a == b:
        return True
    ints_a, ints_b = index.ints(a), index.ints(b)
    if ints_a is not None or ints_b is not None:
        return ints_a is not None and ints_a == ints_b
    node_a, node_b = index.producer.get(a), index.producer.get(b)
    return depth > 0 and node_a is not None and node_b is not None and node_a.key == node_b.key and \
        node_a.op_type in ("Unsqueeze", "Squeeze", "Reshape", "Cast", "Identity") and node_a.attrs == node_b.attrs \
        and len(node_a.inputs) == len(node_b.inputs) and \
        all(_same_value(index, i, j, depth - 1) for i, j in zip(node_a.inputs, node_b.inputs))


def _slice_of_last_axis(index: _Index, name: str, rank: int):
    """The private Slice making `name` from the last axis of its input with step 1, or None."""
    node = index.made_by(name, "Slice")
    if node is None or not index.private(name) or len(node.inputs) < 4:
        return None
    axes = index.ints(node.inputs[3])
    steps = index.ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else [1]
    if axes is None or len(axes) != 1 or axes[0] % rank != rank - 1 or steps != [1]:
        return None
    return node


def _match_rotary(index: _Index, last: Node):
    """The nodes of `x·cos + rotate_half(x)·sin` ending at `last` (the Add), and the fused node, or None."""
    if last.key != ("", "Add"):
        return None
    for direct_name in last.inputs:
        turned_name = _other(last, direct_name)
        direct, turned = index.made_by(direct_name, "Mul"), index.made_by(turned_name, "Mul")
        if direct is None or turned is None or not index.private(direct_name) or not index.private(turned_name):
            continue
        for rotated_name in turned.inputs:
            sin, concat = _other(turned, rotated_name), index.made_by(rotated_name, "Concat")
            if concat is None or not index.private(rotated_name) or len(concat.inputs) != 2 or \
                    int(concat.attrs.get("axis", 0)) not in (-1, 3):
                continue
            negated = index.made_by(concat.inputs[0], "Neg")
            high = _slice_of_last_axis(index, negated.inputs[0], 4) if negated is not None else None
            low = _slice_of_last_axis(index, concat.inputs[1], 4)
            if high is None or low is None or not index.private(concat.inputs[0]):
                continue
            x = low.inputs[0]
            x_shape, cos = index.shape(x), _other(direct, x)
            caches = [index.shape(cos), index.shape(sin)]
            width = caches[0][-1] if caches[0] else None
            if high.inputs[0] != x or x not in direct.inputs or x_shape is None or len(x_shape) != 4 or \
                    not isinstance(width, int) or any(c is None or len(c) > 4 or c[-1] != width for c in caches):
                continue
            end = index.ints(high.inputs[2])
            if index.ints(low.inputs[1]) != [0] or not _same_value(index, low.inputs[2], high.inputs[1]) or \
                    end is None or end[0] < width:
                continue
            chain = [low, high, negated, concat, direct, turned, last]
            return chain, Node("RotaryEmbedding", [x, cos, sin, low.inputs[2]], list(last.outputs), {}, last.name,
                               ODTRAIN_DOMAIN)
    return None


def fuse_for_training(graph: Graph) -> Graph:
    """A copy of `graph` with the patterns above fused (the input is not modified)."""
    fused = graph.copy()
    for rewrite in TRAINING_PASSES:
        rewrite(fused)
    return fused


def vocabulary_loss_pass(graph: Graph) -> None:
    _rewrite_all(graph, _match_vocabulary_loss)


def _decoder_pass(graph: Graph) -> None:
    _rewrite_all(graph, lambda index, node: _match_rms_norm(index, node) or _match_rotary(index, node))


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


def _activation_pass(graph: Graph) -> None:
    def match(index, node):
        found = _match_gelu(index, node)
        if found is None:
            return _match_silu(index, node)
        chain, x = found
        return chain, Node("Gelu", [x], list(node.outputs), {}, chain[1].name, ODTRAIN_DOMAIN)

    _rewrite_all(graph, match)


def _match_vocabulary_loss(index: _Index, node: Node):
    """SoftmaxCrossEntropyLoss of a product's private logits [.., V] (through a private Reshape to [-1, V] or
    already [N, V]), by the mean or the sum, without class weights → LinearCrossEntropy, or None."""
    reduction = node.attrs.get("reduction", "mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if node.key != ("", "SoftmaxCrossEntropyLoss") or len(node.inputs) != 2 or \
            len([o for o in node.outputs if o]) != 1 or reduction not in ("mean", "sum"):
        return None
    removed, scores = [node], node.inputs[0]
    reshape = index.made_by(scores, "Reshape")
    if reshape is not None:
        target, logits = index.ints(reshape.inputs[1]), reshape.inputs[0]
        classes = (index.shape(logits) or (None,))[-1]
        if not index.private(scores) or target is None or len(target) != 2 or target[0] != -1 or \
                not isinstance(classes, int) or target[1] != classes:
            return None
        removed.append(reshape)
        scores = logits
    product = index.producer.get(scores)
    logits_type = index.graph.value_types.get(scores)
    if product is None or not index.private(scores) or logits_type is None or logits_type.dtype != np.float32:
        return None  # the kernels compute in float32
    hidden, weight = product.inputs[:2] if len(product.inputs) >= 2 else ("", "")
    hidden_shape, weight_shape = index.shape(hidden), index.shape(weight)
    if hidden_shape is None or weight_shape is None or len(hidden_shape) < 2 or len(weight_shape) != 2 or \
            (reshape is None and len(hidden_shape) != 2):
        return None
    attrs, stored = {"reduction": reduction}, []
    if product.key == ("", "MatMul"):
        attrs["transB"] = 0
    elif product.key == (ODTRAIN_DOMAIN, "FusedMatMul") and len(product.inputs) == 2 and \
            set(product.attrs) <= {"transB", "alpha", "transA"} and float(product.attrs.get("alpha", 1.0)) == 1.0 \
            and not product.attrs.get("transA", 0):
        attrs["transB"] = int(product.attrs.get("transB", 0))
    elif product.key == (ODTRAIN_DOMAIN, "DequantizedMatMul"):  # a stored weight, read a panel at a time
        attrs.update(transB=int(product.attrs.get("transB", 0)), axis=int(product.attrs.get("axis", 0)))
        if product.attrs.get("block_size", 0):
            attrs["block_size"] = int(product.attrs["block_size"])
        stored = list(product.inputs[2:3])
    else:
        return None
    if node.attrs.get("ignore_index") is not None:
        attrs["ignore_index"] = int(node.attrs["ignore_index"])
    return removed + [product], Node("LinearCrossEntropy", [hidden, weight, node.inputs[1]] + stored,
                                     list(node.outputs), attrs, node.name, ODTRAIN_DOMAIN)


def _stored_weight(graph: Graph, node: Node) -> tuple[list[str], int, int] | None:
    """([W] or [W, scale], axis, block_size) when `node` turns a 2-D int8 weight (DequantizeLinear without zero
    point, per tensor or per axis), int4 weight (the same in blocks) or bfloat16 weight (Cast to float) into
    float32, else None."""
    weight = reads_stored(node, lambda name: graph.value_types[name].dtype if name in graph.value_types else None)
    source = graph.value_types.get(weight) if weight is not None else None
    if source is None or source.shape is None or len(source.shape) != 2:
        return None
    if node.op_type == "Cast":
        return [weight], 0, 0
    scale = graph.value_types.get(node.inputs[1])
    axis = int(node.attrs.get("axis", 1)) % 2
    block = int(node.attrs.get("block_size", 0))
    expected = tuple(-(-d // block) if a == axis else d for a, d in enumerate(source.shape)) if block else None
    per_axis = scale is not None and scale.shape in ((), (1,), (source.shape[axis],))
    if scale is None or scale.shape is None or not (scale.shape == expected if block else per_axis):
        return None
    return list(node.inputs), axis, block


def _dequantized_reader(graph: Graph, reader: Node, weight: str, stored: list[str], axis: int, block: int,
                        flipped: int = 0) -> Node | None:
    """The DequantizedMatMul or DequantizedGather reading `stored` in place of `reader`'s `weight` (the weight
    transposed when `flipped`), or None."""
    inputs = reader.inputs
    blocks = {"block_size": block} if block else {}
    if reader.key == ("", "Gather") and inputs[0] == weight and inputs[1] != weight and not flipped and \
            int(reader.attrs.get("axis", 0)) == 0:
        return Node("DequantizedGather", [stored[0], inputs[1]] + stored[1:], list(reader.outputs),
                    {"axis": axis, **blocks}, reader.name, ODTRAIN_DOMAIN)
    if len(inputs) < 2 or inputs[1] != weight or inputs[0] == weight:
        return None
    if reader.key == ("", "MatMul") and len(inputs) == 2:
        transposed = 0
    elif reader.key == (ODTRAIN_DOMAIN, "FusedMatMul") and len(inputs) == 2 and \
            set(reader.attrs) <= {"transB", "alpha"} and float(reader.attrs.get("alpha", 1.0)) == 1.0:
        transposed = int(reader.attrs.get("transB", 0))
    elif reader.key == ("", "Gemm") and len([i for i in inputs if i]) == 2 and not reader.attrs.get("transA", 0) and \
            float(reader.attrs.get("alpha", 1.0)) == 1.0:
        transposed = int(reader.attrs.get("transB", 0))
    else:
        return None
    return Node("DequantizedMatMul", [inputs[0]] + stored, list(reader.outputs),
                {"transB": transposed ^ flipped, "axis": axis, **blocks}, reader.name, ODTRAIN_DOMAIN)


def dequantized_pass(graph: Graph) -> None:
    """Products and gathers of frozen int8 and bfloat16 weights read them in place (see the module docstring);
    a product reading the weight through Transpose(perm=[1, 0]) (an eval model, unfused) too."""
    consumers = graph.consumers()
    replaced: dict[int, Node] = {}
    removed: set[int] = set()
    for node in graph.nodes:
        found = _stored_weight(graph, node)
        readers = consumers.get(node.outputs[0], []) if found is not None else []
        if not readers or node.outputs[0] in graph.outputs:
            continue
        fused, transposes = [], []
        for reader in readers:
            if reader.key == ("", "Transpose") and [int(p) for p in reader.attrs.get("perm", [])] == [1, 0] and \
                    reader.outputs[0] not in graph.outputs and consumers.get(reader.outputs[0]):
                transposes.append(reader)
                fused += [(user, _dequantized_reader(graph, user, reader.outputs[0], *found, flipped=1))
                          for user in consumers[reader.outputs[0]]]
            else:
                fused.append((reader, _dequantized_reader(graph, reader, node.outputs[0], *found)))
        if all(f is not None for _, f in fused):
            removed.update(id(n) for n in [node] + transposes)
            replaced.update((id(reader), f) for reader, f in fused)
    graph.nodes = [replaced.get(id(n), n) for n in graph.nodes if id(n) not in removed]


def with_weights_read_in_place(graph: Graph) -> Graph:
    """What an eval model runs: `graph` itself, or a copy whose products read a transposed weight (a tied
    embedding as the output layer) through transB instead of a transposed copy, and whose products and
    gathers read frozen int8 and bfloat16 weights in place (dequantized_pass)."""
    made = {o for n in graph.nodes for o in n.outputs}
    transposed = [n for n in graph.nodes if n.key == ("", "Transpose") and n.inputs[0] not in made]
    if not transposed and not any(_stored_weight(graph, node) for node in graph.nodes):
        return graph
    fused = graph.copy()
    _rewrite_all(fused, _match_transposed_parameter)
    dequantized_pass(fused)
    return fused


def _match_transposed_parameter(index: _Index, node: Node):
    """_match_transposed_weight where the transposed value is made by no node (a parameter, held outside the
    arena, as training's products read it)."""
    transpose = index.made_by(node.inputs[1], "Transpose") if node.key == ("", "MatMul") else None
    if transpose is None or transpose.inputs[0] in index.producer:
        return None
    return _match_transposed_weight(index, node)


def _bias_pass(graph: Graph) -> None:
    _rewrite_all(graph, _match_bias)


def _matmul_pass(graph: Graph) -> None:
    _rewrite_all(graph, lambda index, node: _match_transposed_weight(index, node) or
                 _match_scaled_product(index, node) or _match_head_transposes(index, node))


# the second MatMul pass scales fused products; biases are added to products that are final;
# frozen int8 and bfloat16 weights are read in place by the products the MatMul passes made, whose biases stay Adds
TRAINING_PASSES = (_activation_pass, _decoder_pass, _matmul_pass, _matmul_pass, dequantized_pass, _bias_pass,
                   vocabulary_loss_pass)
