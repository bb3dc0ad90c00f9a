"""Frozen matrices kept in fewer bytes: int8 per output channel, 4-bit integers in blocks, or bfloat16.

`store_frozen(graph, frozen, dtype)` rewrites, in place and before the loss and gradients are built, each
frozen float32 weight of rank 2 or more that only these read: a matrix product (MatMul, Gemm) as its B,
directly or through Transpose(perm=[1, 0]); Gather as its data along axis 0 (an embedding); Conv as its
weight. Any other reader (an Add, a norm) leaves the weight float32.
- int8: the weight becomes q = rint(W / s) (within [-127, 127]; graph/qat.py's `symmetric_weight`, computed
  a block of rows at a time: `int8_per_channel`) with one float32 scale s = max|W| / 127 per output channel,
  the frozen parameter `<W>_frozen_scale`; its readers read DequantizeLinear(q, s, axis) (no zero point:
  symmetric, weight-only). The output channel is
  the axis that indexes the product's output columns (a weight read transposed: axis 0; read as B:
  the last axis), an embedding's rows (axis 0), a Conv's output channels (axis 0). A weight read
  both ways (a tied embedding: Gather and the vocabulary product through Transpose) takes its first
  reader's axis; both agree on axis 0 there.
- int4 (matrices only: a Conv's weight stays float32): the weight becomes signed 4-bit values in blocks of
  INT4_BLOCK along the input axis (the other axis than int8's), packed two a byte (graph/int4.py), with one
  float32 scale a block, the frozen parameter `<W>_frozen_scale` of the blocked shape; its readers read
  DequantizeLinear(q, s, axis=input axis, block_size=INT4_BLOCK).
- bfloat16: the weight becomes its nearest bfloat16 values (ties to even), read through Cast(to=FLOAT).
The weight keeps its name (its values in the checkpoint are the int8 or bfloat16 ones), so LoRA's
adapter names and export's merge find it. Both forms are standard ONNX; the training model's fusions
(graph/fusion.py `dequantized_pass`) then read each product's and Gather's weight through one op that
dequantizes it a panel at a time (graph/ops/dequantized.py); a Conv keeps the DequantizeLinear, which
runs just before it (graph/schedule.py `defer_constant_work`): one layer's float weight at a time.

`restore_frozen(graph, names)` undoes it on a graph whose parameters are initializers (the inference model):
each weight read through such a DequantizeLinear (two inputs, an int8 or int4 initializer) or Cast (from a
bfloat16 initializer) becomes float32 again (a `Dequantized`: computed when read, so that writing the model
holds one float32 weight at a time), with its readers reading it directly; it returns the names.
Export (odtrain.api) restores every weight for a float32 model; for an int8 or bfloat16 model only the
weights stored in the other type, which store_frozen then stores in the asked one.

`prepare` reads the model file through a mapping (graph/onnx_wire.py): once a weight is converted, the
file's pages of its float32 values are released (`release_mapped`), so they leave the process's RSS.

`frozen_bytes(arrays)` sums parameter bytes by element type, for the memory reports.
"""
from __future__ import annotations

import numpy as np

from .errors import ArgumentError
from .int4 import DEFAULT_BLOCK, PackedInt4, dequantize, int4_blocks
from .ir import DEFAULT_DOMAIN, Graph, NameScope, Node, TensorType
from .onnx_wire import numpy_dtype, release_mapped

FROZEN_DTYPES = ("float32", "bfloat16", "int8", "int4")
INT4_BLOCK = DEFAULT_BLOCK
SCALE_SUFFIX = "_frozen_scale"
BFLOAT16 = 16  # TensorProto.BFLOAT16
FLOAT = 1
PRODUCTS = (("", "MatMul"), ("", "Gemm"))


def check_frozen_dtype(value) -> str:
    """`value` when it names a frozen dtype, else an ArgumentError listing them."""
    if value not in FROZEN_DTYPES:
        raise ArgumentError(f"frozen_dtype {value!r} is not a type frozen weights are stored in; choose one of "
                            f"{', '.join(FROZEN_DTYPES)} (int8: per output channel with float32 scales; int4: in "
                            f"blocks of {INT4_BLOCK} along the input axis with float32 scales)")
    return value


def _product_axis(product: Node, reads_transposed: bool) -> int:
    """The axis of the stored weight that indexes a product's output columns."""
    flipped = product.key == ("", "Gemm") and bool(product.attrs.get("transB", 0))
    return 0 if reads_transposed != flipped else 1


def output_axis(graph: Graph, name: str, consumers) -> int | None:
    """The output-channel axis of weight `name` by its first reader, or None when a reader is not one that
    store_frozen handles (see the module docstring)."""
    axis = None
    for node in consumers.get(name, []):
        if node.key == ("", "Transpose") and [int(p) for p in node.attrs.get("perm", [1, 0])] == [1, 0]:
            readers = consumers.get(node.outputs[0], [])
            transposed = node.outputs[0]
            if not readers or any(r.key not in PRODUCTS or r.inputs[1] != transposed or r.inputs[0] == transposed
                                  for r in readers):
                return None
            found = _product_axis(readers[0], True)
        elif node.key in PRODUCTS and node.inputs[1] == name and node.inputs[0] != name:
            found = _product_axis(node, False)
        elif node.key == ("", "Gather") and node.inputs[0] == name and int(node.attrs.get("axis", 0)) == 0:
            found = 0
        elif node.key == ("", "Conv") and node.inputs[1] == name and node.inputs[0] != name:
            found = 0
        else:
            return None
        axis = found if axis is None else axis
    return axis


BLOCK_ELEMENTS = 1 << 20  # a weight is converted this many values at a time: temporaries stay small


def _row_blocks(matrix: np.ndarray):
    step = max(1, BLOCK_ELEMENTS // max(matrix.shape[1], 1))
    for first in range(0, matrix.shape[0], step):
        yield slice(first, first + step)


def int8_per_channel(weight: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """qat.symmetric_weight's (int8 values, float32 scales) of `weight` along `axis` (0, or the last for a
    matrix), computed a block of rows at a time."""
    matrix = weight.reshape(weight.shape[0], -1) if axis == 0 else weight.reshape(-1, weight.shape[-1])
    rows = list(_row_blocks(matrix))
    if axis == 0:
        largest = np.concatenate([np.abs(matrix[r]).max(axis=1, initial=0) for r in rows])
    else:
        largest = np.zeros(matrix.shape[1], np.float32)
        for r in rows:
            np.maximum(largest, np.abs(matrix[r]).max(axis=0, initial=0), out=largest)
    scale = np.where(largest > 0, largest / np.float32(127), np.float32(1.0)).astype(np.float32)
    values = np.empty(matrix.shape, np.int8)
    for r in rows:
        divisor = scale[r, None] if axis == 0 else scale
        values[r] = np.clip(np.rint(matrix[r] / divisor), -128, 127)
    return values.reshape(weight.shape), scale


def bfloat16_values(weight: np.ndarray) -> np.ndarray:
    """The nearest bfloat16 values of `weight` (ties to even), a block of rows at a time."""
    matrix = weight.reshape(weight.shape[0], -1)
    values = np.empty(matrix.shape, numpy_dtype(BFLOAT16))
    for r in _row_blocks(matrix):
        values[r] = matrix[r].astype(values.dtype)
    return values.reshape(weight.shape)


def store_frozen(graph: Graph, frozen, dtype: str) -> list[str]:
    """In place: the frozen float32 weights among `frozen` stored as `dtype` (see the module docstring);
    returns the names of the scales added (frozen parameters to keep in the checkpoint with their weights)."""
    check_frozen_dtype(dtype)
    if dtype == "float32":
        return []
    consumers = graph.consumers()
    names = NameScope(graph)
    scales: list[str] = []
    first_reader = {}
    for position, node in enumerate(graph.nodes):
        for name in node.inputs:
            first_reader.setdefault(name, position)
    inserted: dict[int, list[Node]] = {}
    for weight in frozen:
        if weight not in graph.initializers:
            continue
        value = np.asarray(graph.initializers[weight])  # computed here when it is a Dequantized
        if value.dtype != np.float32 or value.ndim < 2 or (dtype == "int4" and value.ndim != 2):
            continue
        axis = output_axis(graph, weight, consumers)
        if axis is None:
            continue
        read = names.fresh(f"{weight}_dequantized")
        if dtype == "int4":
            values, scale = int4_blocks(value, 1 - axis, INT4_BLOCK)  # blocks along the input axis
            scale_name = names.fresh(weight + SCALE_SUFFIX)
            graph.initializers[scale_name] = scale
            graph.value_types[scale_name] = TensorType(scale.dtype, scale.shape)
            scales.append(scale_name)
            node = Node("DequantizeLinear", [weight, scale_name], [read], {"axis": 1 - axis, "block_size": INT4_BLOCK},
                        names.fresh(f"{weight}_dequantize"))
        elif dtype == "int8":
            values, scale = int8_per_channel(value, axis)
            scale_name = names.fresh(weight + SCALE_SUFFIX)
            graph.initializers[scale_name] = scale
            graph.value_types[scale_name] = TensorType(scale.dtype, scale.shape)
            scales.append(scale_name)
            node = Node("DequantizeLinear", [weight, scale_name], [read], {"axis": axis},
                        names.fresh(f"{weight}_dequantize"))
        else:
            values = bfloat16_values(value)
            node = Node("Cast", [weight], [read], {"to": FLOAT}, names.fresh(f"{weight}_to_float"))
        for reader in consumers[weight]:
            reader.inputs = [read if i == weight else i for i in reader.inputs]
        release_mapped(value)  # the float32 values, read once: their file pages may go
        graph.initializers[weight] = values
        graph.value_types[weight] = TensorType(values.dtype, values.shape)
        graph.value_types[read] = TensorType(np.dtype(np.float32), values.shape)
        inserted.setdefault(first_reader[weight], []).append(node)
    nodes = []
    for position, node in enumerate(graph.nodes):
        nodes.extend(inserted.get(position, ()))
        nodes.append(node)
    graph.nodes = nodes
    return scales


def reads_stored(node: Node, dtype_of) -> str | None:
    """The weight that `node` turns into float32 the way store_frozen writes it (DequantizeLinear of int8 without
    zero point or blocks, of int4 in blocks without zero point, or Cast to float of bfloat16), or None;
    `dtype_of(name)` gives a value's dtype or None."""
    source = node.inputs[0] if node.inputs else ""
    dtype = dtype_of(source) if source else None
    if dtype is None:
        return None
    if node.key == (DEFAULT_DOMAIN, "DequantizeLinear") and len(node.inputs) == 2 and all(node.inputs) and \
            dtype == np.int8 and not node.attrs.get("block_size", 0):
        return source
    if node.key == (DEFAULT_DOMAIN, "DequantizeLinear") and len(node.inputs) == 2 and all(node.inputs) and \
            dtype.name == "int4" and int(node.attrs.get("block_size", 0)) > 0:
        return source
    if node.key == (DEFAULT_DOMAIN, "Cast") and int(node.attrs.get("to", 0)) == FLOAT and dtype.name == "bfloat16":
        return source
    return None


def _stored_weight(graph: Graph, node: Node) -> str | None:
    """The int8, int4 or bfloat16 initializer (with an initializer scale) that `node` turns into float32, or
    None."""
    weight = reads_stored(node, lambda name: _dtype(graph.initializers[name]) if name in graph.initializers else None)
    return weight if weight is not None and all(i in graph.initializers for i in node.inputs) else None


def _dtype(value) -> np.dtype:
    """An initializer's element type, without unpacking a PackedInt4 or computing a Dequantized."""
    return value.dtype if isinstance(value, (PackedInt4, Dequantized)) else np.asarray(value).dtype


class Dequantized:
    """The float32 values of a stored weight, computed each time they are read (np.asarray): a model written
    from such values holds one float32 weight at a time. Its shape, dtype and nbytes are known unread."""

    def __init__(self, values, scale: np.ndarray | None, axis: int, block: int = 0):
        self.values, self.scale, self.axis, self.block = values, scale, axis, block
        self.shape, self.ndim, self.size = values.shape, values.ndim, values.size
        self.dtype = np.dtype(np.float32)
        self.nbytes = 4 * values.size

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if isinstance(self.values, PackedInt4):
            result = dequantize(self.values, self.scale, self.axis, self.block)
            return result if dtype is None else result.astype(dtype)
        result = self.values.astype(np.float32)
        if self.scale is not None:
            shape = [1] * self.ndim
            if self.scale.ndim == 1:
                shape[self.axis % self.ndim] = -1
            result *= self.scale.reshape(shape)
        return result if dtype is None else result.astype(dtype)


def dequantized(graph: Graph, node: Node) -> Dequantized:
    """The float32 values of the weight a store_frozen node (DequantizeLinear or Cast) reads, as they are read."""
    values = graph.initializers[node.inputs[0]]
    values = values if isinstance(values, PackedInt4) else np.asarray(values)
    scale = np.asarray(graph.initializers[node.inputs[1]], np.float32) if node.op_type != "Cast" else None
    return Dequantized(values, scale, int(node.attrs.get("axis", 1)), int(node.attrs.get("block_size", 0)))


def stored_weights(graph: Graph) -> dict[str, str]:
    """{weight: its element type name} for the weights that store_frozen's nodes read, in a graph whose
    parameters are initializers."""
    weights = [_stored_weight(graph, node) for node in graph.nodes]
    return {w: _dtype(graph.initializers[w]).name for w in weights if w is not None}


def restore_frozen(graph: Graph, names=None) -> list[str]:
    """In place: the weights stored by store_frozen (those among `names`, when given) as float32
    initializers again (see the module docstring); returns their names."""
    restored, renamed, kept, scales = [], {}, [], set()
    for node in graph.nodes:
        weight = _stored_weight(graph, node)
        if weight is None or (names is not None and weight not in names):
            kept.append(node)
            continue
        graph.initializers[weight] = dequantized(graph, node)
        graph.value_types[weight] = TensorType(np.dtype(np.float32), graph.initializers[weight].shape)
        renamed[node.outputs[0]] = weight
        scales.update(node.inputs[1:])
        restored.append(weight)
    if not restored:
        return []
    for node in kept:
        node.inputs = [renamed.get(i, i) for i in node.inputs]
    graph.outputs = [renamed.get(o, o) for o in graph.outputs]
    graph.nodes = kept
    read = {i for node in kept for i in node.inputs}
    for name in scales - read:
        graph.initializers.pop(name, None)
    return restored


def frozen_bytes(arrays: dict) -> dict[str, int]:
    """Bytes of `arrays` ({name: array}) by element type name, largest first."""
    totals: dict[str, int] = {}
    for value in arrays.values():
        value = value if isinstance(value, PackedInt4) else np.asarray(value)
        totals[value.dtype.name] = totals.get(value.dtype.name, 0) + int(value.nbytes)
    return dict(sorted(totals.items(), key=lambda item: -item[1]))
