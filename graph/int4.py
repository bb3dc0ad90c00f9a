"""Four-bit frozen weights: blockwise symmetric quantization and the packed storage ONNX's INT4 uses.

Quantization (`int4_blocks`): a 2-D weight W [R, C] is cut into blocks of `block` consecutive values along
`axis`, the axis the product sums over (the input axis); a block's last one may be shorter (ONNX's
⌈n / block⌉ rule). Each block has one float32 scale s = m / -8, m the block's value of largest magnitude
with its sign, and its values q = clip(rint(w / s), -8, 7): the largest value becomes -8 exactly, so the
16 levels span the block's range on its larger side (a scale may be negative; an all-zero block has s = 1).
dequant(W)[i, j] = q[i, j] · scale[i, j // block] (axis 1) or q[i, j] · scale[i // block, j] (axis 0), which
is ONNX's DequantizeLinear(q, scale, axis, block_size) without a zero point.

Why symmetric, 32 values a block, float32 scales (the errors of each rule and block size, and the dequantizing
speed, are in benchmarks/README.md, "Figures moved out of the code"): this rule loses less than the scale
max|w| / 7, which leaves a level unused; an asymmetric rule with a 4-bit zero point per block is the more
accurate, most on heavy-tailed weights, at the cost of a zero-point tensor (an eighth of a bit a weight more,
a third input in every model and kernel), while dequantizing runs at the same speed either way (the
unpacking dominates): this rule keeps the models' DequantizeLinear at two inputs. Blocks of 64 would save
half a bit a weight for visibly more error.
float16 scales would make DequantizeLinear's output float16 (ONNX gives it the scale's type) and need a Cast
after it. Bits a weight: 4 + 32 / 32 = 5.

Packing (`PackedInt4`): ONNX's order: the values in row-major order, two a byte, the first in the low
nibble, a last odd value with 0 in the high nibble. A PackedInt4 holds those bytes (`packed`, uint8) with the
tensor's logical shape and dtype (ml_dtypes' int4), so every place that asks for a parameter's shape, type
or bytes sees the 4-bit tensor; `np.asarray` unpacks it (one byte a value: for writers and tests only).

Everything here works a run of rows at a time, so quantizing a weight holds its float32 values, its packed
bytes and temporaries of at most ROW_ELEMENTS values.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

INT4_CODE = 22  # TensorProto.INT4
DEFAULT_BLOCK = 32
ROW_ELEMENTS = 1 << 20  # values converted at a time: temporaries stay small


def int4_dtype() -> np.dtype:
    """ml_dtypes' int4, as onnx gives it (imported only when a 4-bit tensor is met)."""
    from .onnx_wire import numpy_dtype

    return numpy_dtype(INT4_CODE)


class PackedInt4:
    """A signed 4-bit tensor in ONNX's packed layout (see the module docstring). Invariant: `packed` is a
    1-D uint8 array of ⌈size / 2⌉ bytes."""

    def __init__(self, packed: np.ndarray, shape, dtype: np.dtype | None = None):
        """`dtype`: ml_dtypes' int4 when the caller has it (a device that trains imports no onnx), else found
        through onnx."""
        self.shape = tuple(int(d) for d in shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        if packed.dtype != np.uint8 or packed.ndim != 1 or packed.size != (self.size + 1) // 2:
            raise ValueError(f"{self.size} 4-bit values are {(self.size + 1) // 2} packed bytes; got {packed.dtype} "
                             f"{packed.shape}")
        self.packed = packed
        self.ndim = len(self.shape)
        self.dtype = dtype if dtype is not None else int4_dtype()
        self.nbytes = int(packed.nbytes)

    @classmethod
    def from_values(cls, values: np.ndarray) -> "PackedInt4":
        """Pack integers in [-8, 7] (any integer dtype)."""
        packed = np.empty((values.size + 1) // 2, np.uint8)
        flat = values.reshape(-1)
        for start in range(0, flat.size, ROW_ELEMENTS):  # ROW_ELEMENTS is even: runs start on a byte
            pack_into(flat[start:start + ROW_ELEMENTS], packed[start // 2:])
        return cls(packed, values.shape)

    def values(self) -> np.ndarray:
        """The values as int8, in the tensor's shape."""
        return unpack(self.packed, self.size).reshape(self.shape)

    def copy(self) -> "PackedInt4":
        return PackedInt4(self.packed.copy(), self.shape, self.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        result = self.values().astype(self.dtype)
        return result if dtype is None else result.astype(dtype)

    def __repr__(self) -> str:
        return f"PackedInt4(shape={self.shape}, {self.nbytes} bytes)"


def pack_into(values: np.ndarray, out: np.ndarray) -> None:
    """out[:⌈n / 2⌉] = values (n of them, in [-8, 7]) packed two a byte, the first in the low nibble."""
    nibbles = values.astype(np.uint8) & np.uint8(15)
    pairs = nibbles.size // 2
    out[:pairs] = nibbles[0:2 * pairs:2] | (nibbles[1:2 * pairs:2] << np.uint8(4))
    if nibbles.size % 2:
        out[pairs] = nibbles[-1]


def unpack(packed: np.ndarray, count: int) -> np.ndarray:
    """The first `count` signed values of packed bytes, as int8."""
    values = np.empty(2 * packed.size, np.int8)
    values[0::2] = (packed & np.uint8(15)).view(np.int8)
    values[1::2] = (packed >> np.uint8(4)).view(np.int8)
    values = values[:count]
    values[values > 7] -= 16
    return values


def blocked_shape(shape: tuple, axis: int, block: int) -> tuple:
    """The scale's shape: `shape` with ⌈n / block⌉ along `axis`."""
    return tuple(-(-d // block) if a == axis else d for a, d in enumerate(shape))


def _quantize_rows(rows: np.ndarray, axis: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values, float32 scales) of a run of whole rows (of whole blocks of rows for axis 0)."""
    matrix = rows if axis == 1 else rows.T
    count, width = matrix.shape
    blocks = -(-width // block)
    padded = np.zeros((count, blocks * block), np.float32)
    padded[:, :width] = matrix
    grouped = padded.reshape(count, blocks, block)
    largest = np.take_along_axis(grouped, np.abs(grouped).argmax(axis=2)[..., None], axis=2)[..., 0]
    scale = np.where(largest != 0, largest / np.float32(-8), np.float32(1)).astype(np.float32)
    values = np.clip(np.rint(grouped / scale[..., None]), -8, 7).astype(np.int8).reshape(count, -1)[:, :width]
    return (values, scale) if axis == 1 else (values.T, scale.T)


def int4_blocks(weight: np.ndarray, axis: int, block: int = DEFAULT_BLOCK) -> tuple[PackedInt4, np.ndarray]:
    """(the packed 4-bit values, the float32 scales) of a 2-D float32 weight, blocks of `block` along `axis`
    (see the module docstring), computed a run of rows at a time."""
    if weight.ndim != 2 or axis not in (0, 1) or block < 1:
        raise ValueError(f"4-bit blocks need a 2-D weight, axis 0 or 1 and a positive block, got {weight.shape}, "
                         f"axis {axis}, block {block}")
    rows, columns = weight.shape
    scale = np.empty(blocked_shape(weight.shape, axis, block), np.float32)
    packed = np.empty((weight.size + 1) // 2, np.uint8)
    # A run is whole blocks of rows (axis 0) and, with an odd column count, an even count of rows, so that
    # every run starts on a block and on a byte: a multiple of the least common multiple of the two.
    unit = block if axis == 0 else 1
    unit = unit * 2 // math.gcd(unit, 2) if columns % 2 else unit
    step = max(1, ROW_ELEMENTS // max(columns, 1))
    step = max(unit, step // unit * unit)
    for first in range(0, rows, step):
        last = min(rows, first + step)
        values, scales = _quantize_rows(np.asarray(weight[first:last], np.float32), axis, block)
        if axis == 1:
            scale[first:last] = scales
        else:
            scale[first // block:-(-last // block)] = scales
        pack_into(values.reshape(-1), packed[first * columns // 2:])
    return PackedInt4(packed, weight.shape), scale


def dequantize(values: PackedInt4, scale: np.ndarray, axis: int, block: int) -> np.ndarray:
    """The float32 values of a blocked 4-bit weight (ONNX's DequantizeLinear), for writers and tests."""
    q = values.values().astype(np.float32)
    return q * np.repeat(scale, block, axis=axis)[:q.shape[0], :q.shape[1]]


# ---- the opset a model holding 4-bit weights is written at ----------------------------------------------
# INT4 and DequantizeLinear's block_size are opset 21's. A model exported at an older opset is written at 21
# with the ops whose form changed since rewritten: the reductions' axes (an attribute until 18, an input
# since). Ops whose meaning changed otherwise (GridSample's mode names and DFT's axis at 20,
# GroupNormalization's scale at 21) are refused with the advice to export at opset 21.
BLOCKED_OPSET = 21
_AXES_BECAME_INPUT = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
                      "ReduceMin", "ReduceProd", "ReduceSumSquare")  # at opset 18
_CHANGED = {"GridSample": 20, "DFT": 20, "GroupNormalization": 21}


def holds_int4(graph) -> bool:
    """Whether a graph reads 4-bit values (an initializer, or a value typed int4)."""
    return any(isinstance(v, PackedInt4) for v in graph.initializers.values()) or \
        any(t is not None and t.dtype is not None and np.dtype(t.dtype).name == "int4"
            for t in graph.value_types.values())


def at_blocked_opset(graph):
    """`graph` itself when its default opset is 21 or newer or it holds no 4-bit values, else a copy at opset 21
    (see above); the caller's graph is not changed."""
    from .errors import ModelError
    from .ir import Node, TensorType

    opset = graph.opsets.get("", graph.opsets.get("ai.onnx", 1))
    if opset >= BLOCKED_OPSET or not holds_int4(graph):
        return graph
    nodes, initializers, types = [], dict(graph.initializers), dict(graph.value_types)
    for node in graph.nodes:
        if node.domain in ("", "ai.onnx") and opset < _CHANGED.get(node.op_type, 0):
            raise ModelError(f"{node.describe()}: a model with 4-bit weights is written at opset {BLOCKED_OPSET}, "
                             f"where {node.op_type} differs from opset {opset}'s; export the model at opset "
                             f"{BLOCKED_OPSET} (torch.onnx.export(..., opset_version={BLOCKED_OPSET}))")
        if node.domain in ("", "ai.onnx") and node.op_type in _AXES_BECAME_INPUT and "axes" in node.attrs:
            attrs = {k: v for k, v in node.attrs.items() if k != "axes"}
            name = f"{node.name or node.outputs[0]}_axes"
            while name in initializers or name in types:
                name += "_"
            initializers[name] = np.asarray(node.attrs["axes"], np.int64).reshape(-1)
            types[name] = TensorType(np.dtype(np.int64), initializers[name].shape)
            node = Node(node.op_type, [node.inputs[0], name], list(node.outputs), attrs, node.name, node.domain,
                        node.scope)
        nodes.append(node)
    opsets = {k: v for k, v in graph.opsets.items() if k != "ai.onnx"}
    opsets[""] = BLOCKED_OPSET
    return dataclasses.replace(graph, nodes=nodes, initializers=initializers, value_types=types, opsets=opsets)
