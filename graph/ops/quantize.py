"""Quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, the integer products
(MatMulInteger, ConvInteger) and their requantizing forms (QLinearMatMul, QLinearConv).

Arithmetic (ONNX's, and onnxruntime's on the CPU):
- QuantizeLinear:   q = clamp(rint(x / s) + z, qmin, qmax), rint rounding half to even, the
  division in float32; [qmin, qmax] is the range of the quantized type (int8, uint8, int16,
  uint16). Saturation always applies to integer types (`saturate` concerns float8 only).
- DequantizeLinear: x = (q - z) · s, in float32.
- Scales and zero points apply per tensor (one value), per axis (a 1-D tensor along `axis`)
  or per block (`block_size` > 0: the scale has the input's rank and ⌈n / block_size⌉ entries
  along `axis`, each for block_size consecutive elements).
- Integer products accumulate (a - za) · (b - zb) in int32; the QLinear forms requantize
  the accumulator: q = clamp(rint(acc · (sa · sb / sy)) + zy), the multiplier in float32.
Not supported, and refused naming the node: float8, 4-bit and 2-bit types, float16 or
bfloat16 scales, and `precision` other than float.

Training (the straight-through estimator): a QuantizeLinear whose output feeds only
DequantizeLinear nodes with the same scale, zero point and axis is, in the training model,
the odtrain op FakeQuantize(x, s, z) = (clamp(rint(x / s) + z, qmin, qmax) - z) · s, the same
numbers in one pass (`fuse_quantize_pairs`). Its gradient passes the incoming gradient where
x lay inside the representable range [(qmin - z) · s, (qmax - z) · s] and is zero where x was
clipped: dx = dy · 1[(qmin - z)·s ≤ x ≤ (qmax - z)·s] (FakeQuantizeGrad). Rounding itself is
treated as the identity; scales and zero points receive no gradient.

Quantization-aware training (graph/qat.py) inserts FakeQuantizeWeight and FakeQuantizeRange,
described where they are registered below.

Memory: DequantizeLinear never folds to a constant, so an int8 weight stays int8 in memory
and is dequantized at each use into arena bytes that live only until its reader runs.
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError, UnsupportedOpError
from ..ir import ODTRAIN_DOMAIN, Graph, Node, TensorType
from ..onnx_wire import element_type_name, is_storage_dtype
from .registry import eval_form, grad, no_grad, op
from .conv import conv_output_shape
from .linalg import matmul_shape

# Quantized element types and their ranges; TensorProto codes of output_dtype.
QUANTIZED_RANGES = {np.dtype(np.uint8): (0, 255), np.dtype(np.int8): (-128, 127),
                    np.dtype(np.uint16): (0, 65535), np.dtype(np.int16): (-32768, 32767)}
TENSOR_TYPES = {2: np.dtype(np.uint8), 3: np.dtype(np.int8), 4: np.dtype(np.uint16), 5: np.dtype(np.int16),
                1: np.dtype(np.float32), 6: np.dtype(np.int32)}
FLOAT32 = np.dtype(np.float32)
INT32 = np.dtype(np.int32)
BYTE_TYPES = (np.dtype(np.uint8), np.dtype(np.int8))
INTEGER_NO_GRAD = "integer arithmetic on quantized tensors"


def _present(types, i: int) -> TensorType | None:
    return types[i] if i < len(types) else None


def _tensor_type_attr(node, name: str):
    """The numpy dtype of a TensorProto type attribute (output_dtype), None when absent or 0."""
    code = int(node.attrs.get(name, 0) or 0)
    if not code:
        return None
    if code not in TENSOR_TYPES:
        raise UnsupportedOpError(f"{node.describe()}: {name}={code} ({element_type_name(code)}) is a type odtrain "
                                 "does not quantize to "
                                 "(uint8, int8, uint16, int16 are supported; float8, 4-bit and 2-bit are not)")
    return TENSOR_TYPES[code]


def _require_scale(node, t: TensorType | None, what: str) -> None:
    if t is None:
        raise ModelError(f"{node.describe()}: its {what} is missing")
    if t.dtype != FLOAT32:
        raise UnsupportedOpError(f"{node.describe()}: its {what} is {t}; odtrain supports float32 scales only")


def _require_quantized(node, t: TensorType, what: str, allowed=tuple(QUANTIZED_RANGES)) -> None:
    if t.dtype not in allowed:
        names = ", ".join(np.dtype(d).name for d in allowed)
        raise UnsupportedOpError(f"{node.describe()}: its {what} is {t}; odtrain supports {names} here")


def check_groups(node, x_shape: tuple, scale: TensorType, zero: TensorType | None) -> None:
    """Refuse a scale (and zero point) whose shape is neither per tensor, per axis nor per block of x."""
    if zero is not None and zero.is_static and scale.is_static:
        if zero.size != scale.size or (zero.size > 1 and zero.shape != scale.shape):
            raise ModelError(f"{node.describe()}: zero point {zero} and scale {scale} differ in shape")
    if x_shape is None or scale.shape is None or scale.size == 1 and scale.is_static:
        return
    rank = len(x_shape)
    axis = int(node.attrs.get("axis", 1))
    if not -rank <= axis < rank:
        raise ModelError(f"{node.describe()}: axis={axis} is outside input rank {rank}")
    axis %= rank
    block = int(node.attrs.get("block_size", 0) or 0)
    if block < 0:
        raise ModelError(f"{node.describe()}: block_size={block} must be positive")
    if not block:
        if len(scale.shape) != 1 or scale.shape[0] != x_shape[axis]:
            raise ModelError(f"{node.describe()}: scale {scale} is neither one value nor one per index of axis "
                             f"{axis} ({x_shape[axis]})")
        return
    expected = tuple(-(-d // block) if a == axis and isinstance(d, int) else d for a, d in enumerate(x_shape))
    if tuple(scale.shape) != expected:
        raise ModelError(f"{node.describe()}: blocked scale {scale} does not match input {list(x_shape)} with "
                         f"block_size={block} along axis {axis} (expected {list(expected)})")


def quantized_type(node, types) -> np.dtype:
    """The element type QuantizeLinear produces: the zero point's, else output_dtype, else uint8."""
    zero = _present(types, 2)
    wanted = _tensor_type_attr(node, "output_dtype")
    dtype = zero.dtype if zero is not None else (wanted or np.dtype(np.uint8))
    if wanted is not None and zero is not None and wanted != zero.dtype:
        raise ModelError(f"{node.describe()}: output_dtype {wanted} differs from the zero point's type {zero.dtype}")
    if dtype not in QUANTIZED_RANGES:
        raise UnsupportedOpError(f"{node.describe()}: quantizing to {np.dtype(dtype).name} is not supported "
                                 "(uint8, int8, uint16, int16 are)")
    return np.dtype(dtype)


@op("QuantizeLinear")
def _quantize_rule(node, types, consts):
    x, scale, zero = types[0], _present(types, 1), _present(types, 2)
    if x.dtype not in (FLOAT32, INT32):
        raise UnsupportedOpError(f"{node.describe()}: its input is {x}; odtrain quantizes float32 (and int32)")
    _require_scale(node, scale, "scale")
    precision = int(node.attrs.get("precision", 0) or 0)
    if precision not in (0, 1):
        raise UnsupportedOpError(f"{node.describe()}: precision={precision}; odtrain computes in float32 only")
    dtype = quantized_type(node, types)
    check_groups(node, x.shape, scale, zero)
    return [TensorType(dtype, x.shape)]


@op("DequantizeLinear")
def _dequantize_rule(node, types, consts):
    x, scale, zero = types[0], _present(types, 1), _present(types, 2)
    if not is_storage_dtype(x.dtype):  # float8, float4, int4, int2: read through Cast's conversion
        _require_quantized(node, x, "input", tuple(QUANTIZED_RANGES) + (INT32,))
    _require_scale(node, scale, "scale")
    if zero is not None and zero.dtype != x.dtype:
        raise ModelError(f"{node.describe()}: zero point {zero} and input {x} differ in type")
    wanted = _tensor_type_attr(node, "output_dtype")
    if wanted is not None and wanted != FLOAT32:
        raise UnsupportedOpError(f"{node.describe()}: output_dtype {wanted}; odtrain dequantizes to float32")
    check_groups(node, x.shape, scale, zero)
    return [TensorType(FLOAT32, x.shape)]


@op("DynamicQuantizeLinear")
def _dynamic_quantize_rule(node, types, consts):
    x = types[0]
    if x.dtype != FLOAT32:
        raise UnsupportedOpError(f"{node.describe()}: its input is {x}; odtrain quantizes float32")
    return [TensorType(np.dtype(np.uint8), x.shape), TensorType(FLOAT32, ()), TensorType(np.dtype(np.uint8), ())]


def _integer_operands(node, types, operands, zero_points, names) -> tuple[TensorType, TensorType]:
    """The two 8-bit operands of an integer product (at indices `operands`), checked with their zero points."""
    pair = tuple(types[i] for i in operands)
    for operand, zero_index, name in zip(pair, zero_points, names):
        _require_quantized(node, operand, name, BYTE_TYPES)
        zero = _present(types, zero_index)
        if zero is not None and zero.dtype != operand.dtype:
            raise ModelError(f"{node.describe()}: the zero point {zero} of its {name} {operand} differs in type")
    return pair


def _requantized(node, types, operand: TensorType, shape) -> TensorType:
    """A QLinear op's output (scales at inputs 1, 4, 6): y_zero_point's type, else its first operand's."""
    for index, what in ((1, "first scale"), (4, "second scale"), (6, "y_scale")):
        _require_scale(node, types[index], what)
    zero = _present(types, 7)
    dtype = zero.dtype if zero is not None else operand.dtype
    _require_quantized(node, TensorType(dtype, ()), "output", BYTE_TYPES)
    return TensorType(dtype, shape)


@op("MatMulInteger")
def _matmul_integer_rule(node, types, consts):
    a, b = _integer_operands(node, types, (0, 1), (2, 3), ("input A", "input B"))
    return [TensorType(INT32, matmul_shape(node, a.shape, b.shape))]


@op("QLinearMatMul")
def _qlinear_matmul_rule(node, types, consts):
    a, b = _integer_operands(node, types, (0, 3), (2, 5), ("input a", "input b"))
    return [_requantized(node, types, a, matmul_shape(node, a.shape, b.shape))]


@op("ConvInteger")
def _conv_integer_rule(node, types, consts):
    x, w = _integer_operands(node, types, (0, 1), (2, 3), ("input", "weight"))
    return [TensorType(INT32, conv_output_shape(node, x, w))]


@op("QLinearConv")
def _qlinear_conv_rule(node, types, consts):
    x, w = _integer_operands(node, types, (0, 3), (2, 5), ("input", "weight"))
    bias = _present(types, 8)
    if bias is not None and bias.dtype != INT32:
        raise ModelError(f"{node.describe()}: its bias is {bias}; QLinearConv takes an int32 bias")
    return [_requantized(node, types, x, conv_output_shape(node, x, w))]


no_grad("QuantizeLinear", "its output is an integer tensor; a QuantizeLinear feeding DequantizeLinear nodes with "
        "the same scale and zero point is differentiated as one fake quantization (straight-through estimator)")
no_grad("DequantizeLinear", "its input is an integer tensor")
for _op_type in ("DynamicQuantizeLinear", "MatMulInteger", "QLinearMatMul", "ConvInteger", "QLinearConv"):
    no_grad(_op_type, INTEGER_NO_GRAD)


# ---- fake quantization: the training model's QuantizeLinear → DequantizeLinear ---------------------


# FakeQuantize(x, scale, zero_point?; axis, block_size, qmin, qmax) = (clamp(rint(x / s) + z) - z) · s
@op("FakeQuantize", ODTRAIN_DOMAIN, inplace=((0, 0),))
def _fake_quantize_rule(node, types, consts):
    x, scale, zero = types[0], _present(types, 1), _present(types, 2)
    _require_scale(node, scale, "scale")
    check_groups(node, x.shape, scale, zero)
    return [x]


@grad("FakeQuantize", ODTRAIN_DOMAIN)
def _fake_quantize_grad(ctx):  # dx = dy where (qmin - z)·s ≤ x ≤ (qmax - z)·s, else 0
    if ctx.needs(0):
        attrs = {k: ctx.attr(k) for k in ("axis", "block_size", "qmin", "qmax") if ctx.attr(k) is not None}
        ctx.set_grad(0, ctx.odtrain("FakeQuantizeGrad", [ctx.GO(0), ctx.I(0), ctx.I(1), ctx.I(2)], attrs))


@op("FakeQuantizeGrad", ODTRAIN_DOMAIN, inplace=((0, 0),))
def _fake_quantize_grad_rule(node, types, consts):
    return [types[0]]


def fake_quantize_node(quantize: Node, dequantize: Node, qmin: int, qmax: int) -> Node:
    """The FakeQuantize node standing for `quantize` followed by `dequantize` (writing its output)."""
    attrs = {"axis": int(quantize.attrs.get("axis", 1)), "block_size": int(quantize.attrs.get("block_size", 0) or 0),
             "qmin": int(qmin), "qmax": int(qmax)}
    zero = quantize.inputs[2] if len(quantize.inputs) > 2 else ""
    return Node("FakeQuantize", [quantize.inputs[0], quantize.inputs[1], zero], list(dequantize.outputs[:1]), attrs,
                f"{dequantize.name}::fake_quantize", ODTRAIN_DOMAIN)


def _same_parameters(graph: Graph, quantize: Node, dequantize: Node) -> bool:
    """Whether a DequantizeLinear undoes a QuantizeLinear: same scale, zero point, axis and block size."""
    def constant(name):
        return graph.initializers.get(name) if name else None

    for index in (1, 2):
        q = quantize.inputs[index] if index < len(quantize.inputs) else ""
        d = dequantize.inputs[index] if index < len(dequantize.inputs) else ""
        if q == d:
            continue
        qv, dv = constant(q), constant(d)
        if qv is None or dv is None or qv.dtype != dv.dtype or not np.array_equal(qv, dv):
            return False
    for name, default in (("axis", 1), ("block_size", 0)):
        if int(quantize.attrs.get(name, default) or 0) != int(dequantize.attrs.get(name, default) or 0):
            scale = constant(quantize.inputs[1])
            if scale is None or scale.size != 1:  # per tensor, axis and block size do not matter
                return False
    return True


def _quantized_dtype_of(graph: Graph, quantize: Node):
    """The quantized element type a QuantizeLinear node of `graph` produces, or None if unknown."""
    zero = quantize.inputs[2] if len(quantize.inputs) > 2 else ""
    if zero:
        if zero in graph.initializers:
            return np.dtype(graph.initializers[zero].dtype)
        t = graph.value_types.get(zero)
        return None if t is None else np.dtype(t.dtype)
    code = int(quantize.attrs.get("output_dtype", 0) or 0)
    return TENSOR_TYPES.get(code) if code else np.dtype(np.uint8)


def fuse_quantize_pairs(graph: Graph) -> Graph:
    """In place: every QuantizeLinear whose output is read only by DequantizeLinear nodes that undo it
    becomes one FakeQuantize per reader (same output names); returns the graph."""
    consumers = graph.consumers()
    outputs = set(graph.outputs)
    replaced: dict[int, Node] = {}
    removed: set[int] = set()
    for node in graph.nodes:
        if node.key != ("", "QuantizeLinear") or node.outputs[0] in outputs:
            continue
        readers = consumers.get(node.outputs[0], [])
        dtype = _quantized_dtype_of(graph, node)
        if (not readers or dtype not in QUANTIZED_RANGES
                or not all(r.key == ("", "DequantizeLinear") and r.inputs[0] == node.outputs[0]
                           and _same_parameters(graph, node, r) for r in readers)):
            continue
        qmin, qmax = QUANTIZED_RANGES[dtype]
        for reader in readers:
            replaced[id(reader)] = fake_quantize_node(node, reader, qmin, qmax)
        removed.add(id(node))
    graph.nodes = [replaced.get(id(n), n) for n in graph.nodes if id(n) not in removed]
    return graph


def quantization_inputs(graph: Graph) -> set[str]:
    """Initializers that are scales or zero points of QuantizeLinear and DequantizeLinear nodes: they
    configure the quantization and never train (they may be frozen with their weights)."""
    return {name for node in graph.nodes if node.key in (("", "QuantizeLinear"), ("", "DequantizeLinear"))
            for name in node.inputs[1:3] if name in graph.initializers}


def dequantized_weights(graph: Graph) -> dict[str, list[str]]:
    """Integer initializers that DequantizeLinear nodes read, each with the initializers that go with it
    (its scales and zero points): a frozen quantized weight and its parameters."""
    weights: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.key != ("", "DequantizeLinear") or node.inputs[0] not in graph.initializers:
            continue
        companions = weights.setdefault(node.inputs[0], [])
        companions.extend(n for n in node.inputs[1:] if n in graph.initializers and n not in companions)
    return weights


# ---- quantization-aware training (graph/qat.py inserts these) --------------------------------------


# FakeQuantizeWeight(w; axis, qmax) = FakeQuantize(w, s, 0) with symmetric scales s = max|w| / qmax per index
# of `axis` (axis = -1 for one scale over the tensor), recomputed from the weight at every step. No value is
# clipped (|w / s| <= qmax), so the straight-through gradient is the identity.
@op("FakeQuantizeWeight", ODTRAIN_DOMAIN)
def _fake_quantize_weight_rule(node, types, consts):
    if types[0].dtype != FLOAT32:
        raise UnsupportedOpError(f"{node.describe()}: its weight is {types[0]}; odtrain quantizes float32")
    return [types[0]]


@grad("FakeQuantizeWeight", ODTRAIN_DOMAIN)
def _fake_quantize_weight_grad(ctx):  # dw = dy: the symmetric range holds every value
    ctx.set_grad(0, ctx.GO(0))


# FakeQuantizeRange(x, range; qmin, qmax, averaging, training_mode) -> (y, range_out, scale, zero_point):
# activations quantized per tensor with the range [min, max] that training tracks: in training mode the
# batch's min and max update it (the first batch sets it: a range of [0, 0] is unset; then
# range += averaging · (batch - range)), written over the range parameter in the checkpoint; then
# s = (max' - min') / (qmax - qmin) and z = rint(clamp(qmin - min' / s)), where min' = min(min, 0) and
# max' = max(max, 0), and y = FakeQuantize(x, s, z). The eval form reads the range without updating it.
@op("FakeQuantizeRange", ODTRAIN_DOMAIN, inplace=((0, 0),), updates=((1, 1),))
def _fake_quantize_range_rule(node, types, consts):
    x, stored = types[0], types[1]
    if x.dtype != FLOAT32:
        raise UnsupportedOpError(f"{node.describe()}: its input is {x}; odtrain quantizes float32")
    if stored.dtype != FLOAT32 or stored.shape != (2,):
        raise ModelError(f"{node.describe()}: its range {stored} must be float32[2] (min, max)")
    scalar = TensorType(FLOAT32, (1,))
    return [x, stored, scalar, scalar][:len(node.outputs)]


@eval_form("FakeQuantizeRange", ODTRAIN_DOMAIN)
def _fake_quantize_range_eval(node):
    return Node(node.op_type, list(node.inputs), node.outputs[:1], {**node.attrs, "training_mode": 0}, node.name,
                node.domain)


@grad("FakeQuantizeRange", ODTRAIN_DOMAIN)
def _fake_quantize_range_grad(ctx):  # dx = dy where x lay inside the range, as FakeQuantize
    if ctx.needs(0):
        scale, zero = ctx.forward_output(2, "scale"), ctx.forward_output(3, "zero_point")
        attrs = {"qmin": ctx.attr("qmin"), "qmax": ctx.attr("qmax")}
        ctx.set_grad(0, ctx.odtrain("FakeQuantizeGrad", [ctx.GO(0), ctx.I(0), scale, zero], attrs))
