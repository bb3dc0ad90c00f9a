"""ONNX model files read without the onnx package: the protobuf wire format, decoded by hand.

A device that trains reads only the models odtrain saved, and `import onnx` would add its op-schema
registry to the process's memory and start-up, more so on a Raspberry Pi. This module reads the parts
of onnx.proto that odtrain uses into plain dataclasses (`ModelData`, `GraphData`, `NodeData`,
`AttributeData`, `TensorData`, `ValueInfoData`). `onnx_io` converts a ModelProto into the same
dataclasses when onnx is at hand, and builds the IR from them, so both paths share one builder
and one tensor decoder. It also holds the table of ONNX element types that numpy has natively.

The wire format: a message is a run of fields, each a varint tag `field_number << 3 | wire_type`
and then its value:
- wire type 0, a varint: 7 bits a byte, low bits first, the high bit set on all bytes but the
  last; at most 10 bytes; a negative int32 or int64 is its 64-bit two's complement;
- wire type 1, 8 little-endian bytes (double); wire type 5, 4 (float);
- wire type 2, a varint length and that many bytes: text, bytes, a nested message, or a packed
  run of repeated numbers;
- wire types 3 and 4 open and close a group (a deprecated encoding), skipped whole.
Repeated numbers are read packed or one per field. A field whose number or wire type is not the
one expected is skipped, as protobuf keeps unknown fields aside. A singular field seen twice
keeps its last value; a singular message seen twice is the merge of both, which is the message
read across both encodings in turn (protobuf's rules). Field numbers are those of onnx/onnx.proto.

Invariant: a malformed file (a value running past the end of its message, a varint of more than
10 bytes, field number 0, wire type 6 or 7, an unbalanced group, text that is not UTF-8) raises
`ModelError` naming the file and the byte offset; no IndexError or struct.error escapes.
"""
from __future__ import annotations

import enum
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from .errors import ModelError

VARINT, FIXED64, LENGTH, START_GROUP, END_GROUP, FIXED32 = range(6)
EXTERNAL = 1  # TensorProto.DataLocation: the data sits in another file

# TensorProto.DataType, by code.
ELEMENT_TYPE_NAMES = (
    "UNDEFINED", "FLOAT", "UINT8", "INT8", "UINT16", "INT16", "INT32", "INT64", "STRING", "BOOL", "FLOAT16",
    "DOUBLE", "UINT32", "UINT64", "COMPLEX64", "COMPLEX128", "BFLOAT16", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ",
    "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "UINT4", "INT4", "FLOAT4E2M1", "FLOAT8E8M0", "UINT2", "INT2", "FLOAT6E2M3",
    "FLOAT6E3M2",
)
# The element types numpy holds natively; the others (bfloat16, float8, int4...) need ml_dtypes.
ELEMENT_DTYPES = {code: np.dtype(t) for code, t in {
    1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64, 8: object,
    9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64, 14: np.complex64, 15: np.complex128,
}.items()}
_ELEMENT_TYPES = {dtype: code for code, dtype in ELEMENT_DTYPES.items()}
# The typed field that holds a tensor's values when it has no raw_data, for the types odtrain computes
# with; int32_data carries the 8- and 16-bit types and bool in the low bits of each entry.
_STORAGE = {1: "float_data", 2: "int32_data", 3: "int32_data", 4: "int32_data", 5: "int32_data", 6: "int32_data",
            7: "int64_data", 9: "int32_data", 10: "int32_data", 11: "double_data", 12: "uint64_data",
            13: "uint64_data"}


# The element types numpy lacks that odtrain's Cast converts to and from: bfloat16, the float8 types,
# float4 and the 4- and 2-bit integers, one byte or two per element (ml_dtypes' arrays, as
# onnx.numpy_helper gives them), by code and ml_dtypes' name. Other ops refuse them.
STORAGE_DTYPE_NAMES = {16: "bfloat16", 17: "float8_e4m3fn", 18: "float8_e4m3fnuz", 19: "float8_e5m2",
                       20: "float8_e5m2fnuz", 21: "uint4", 22: "int4", 23: "float4_e2m1fn", 25: "uint2", 26: "int2"}
STORAGE_TYPES = tuple(STORAGE_DTYPE_NAMES)
STORAGE_NAMES = frozenset(STORAGE_DTYPE_NAMES.values())


def numpy_dtype(code: int) -> np.dtype | None:
    """The numpy dtype of an ONNX element type (ml_dtypes' for STORAGE_TYPES, imported only then), None
    for the types odtrain does not hold. ml_dtypes is what onnx itself maps these codes to; it is asked
    directly because `import onnx` would add some 28 MiB to a training process that reads an int4 or
    bfloat16 model (onnx's schemas and protobuf), against ml_dtypes' 3."""
    if code in STORAGE_DTYPE_NAMES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, STORAGE_DTYPE_NAMES[code]))
    return ELEMENT_DTYPES.get(code)


def is_storage_dtype(dtype) -> bool:
    """Whether a dtype is one of STORAGE_TYPES' (numpy's own dtypes never are)."""
    return np.dtype(dtype).name in STORAGE_NAMES



def element_type(dtype) -> int:
    """The ONNX element type of a numpy dtype."""
    dtype = np.dtype(dtype)
    if dtype.name in STORAGE_NAMES:
        return next(code for code, name in STORAGE_DTYPE_NAMES.items() if name == dtype.name)
    return _ELEMENT_TYPES[dtype]


def element_type_name(code: int) -> str:
    return ELEMENT_TYPE_NAMES[code] if 0 <= code < len(ELEMENT_TYPE_NAMES) else f"of code {code}"


class AttributeType(enum.IntEnum):
    """AttributeProto.AttributeType."""

    UNDEFINED = 0
    FLOAT = 1
    INT = 2
    STRING = 3
    TENSOR = 4
    GRAPH = 5
    FLOATS = 6
    INTS = 7
    STRINGS = 8
    TENSORS = 9
    GRAPHS = 10
    SPARSE_TENSOR = 11
    SPARSE_TENSORS = 12
    TYPE_PROTO = 13
    TYPE_PROTOS = 14


def _empty(dtype):
    return field(default_factory=lambda: np.zeros(0, dtype))


@dataclass
class TensorData:
    """A TensorProto with its values still encoded; `to_array` decodes them.

    `raw_data` is None when the field is absent, which is not the same as present and empty.
    """

    name: str = ""
    dims: list[int] = field(default_factory=list)
    data_type: int = 0
    raw_data: bytes | None = None
    float_data: np.ndarray = _empty(np.float32)
    int32_data: np.ndarray = _empty(np.int32)
    int64_data: np.ndarray = _empty(np.int64)
    double_data: np.ndarray = _empty(np.float64)
    uint64_data: np.ndarray = _empty(np.uint64)
    string_data: list[bytes] = field(default_factory=list)
    data_location: int = 0
    external_data: dict[str, str] = field(default_factory=dict)
    segmented: bool = False

    def to_array(self) -> np.ndarray:
        """The values as `onnx.numpy_helper.to_array` gives them, for float, int and bool tensors:
        from raw_data when present (little-endian), else from the typed field of the element type."""
        if self.segmented:
            raise ModelError("it is one segment of a larger tensor, which odtrain does not read")
        if self.data_location == EXTERNAL:
            raise ModelError("its data is kept in an external file")
        storage = _STORAGE.get(self.data_type)
        if storage is None:
            raise ModelError(f"its element type {element_type_name(self.data_type)} is not supported "
                             "(float, int and bool are)")
        dtype = ELEMENT_DTYPES[self.data_type]
        if self.raw_data is not None:
            if len(self.raw_data) % dtype.itemsize:
                raise ModelError(f"its raw data of {len(self.raw_data)} bytes is not a whole number of "
                                 f"{dtype.name} values")
            values = np.frombuffer(self.raw_data, dtype.newbyteorder("<")).astype(dtype, copy=False)
        elif storage == "int32_data":
            values = self.int32_data.view(np.uint32).astype(f"u{dtype.itemsize}").view(dtype)
        else:
            values = getattr(self, storage).astype(dtype)
        try:
            return values.reshape(self.dims)
        except (ValueError, OverflowError):  # OverflowError: a dim beyond a 32-bit platform's sizes
            raise ModelError(f"its {values.size} values do not fill its dims {list(self.dims)}") from None


@dataclass
class ValueInfoData:
    """A ValueInfoProto: `elem_type` 0 when the type is unknown or not a tensor's; `shape` None when the
    rank is unknown, else one entry per axis: an int, a symbol (str), or None for an unnamed unknown."""

    name: str
    elem_type: int = 0
    shape: tuple | None = None


@dataclass
class AttributeData:
    """An AttributeProto: its value by `type`: float, int, bytes, TensorData, GraphData (a subgraph), lists
    of them; the encoded messages of the kinds odtrain does not read (sparse tensors, types); None when
    undefined."""

    name: str
    type: AttributeType
    value: Any


@dataclass
class NodeData:
    op_type: str
    inputs: list[str]
    outputs: list[str]
    name: str = ""
    domain: str = ""
    attributes: list[AttributeData] = field(default_factory=list)
    scope: str = ""  # the exporter's module path (SCOPE_KEY metadata), e.g. for LoRA targets


# The metadata entry in which the dynamo exporter records a node's module path, e.g.
# "['', 'model', 'model.layers.0', ..., 'model.layers.0.self_attn.q_proj', 'linear']".
SCOPE_KEY = "pkg.torch.onnx.name_scopes"


def node_scope(value: str) -> str:
    """SCOPE_KEY's list as the innermost module and the op: 'model.layers.0.self_attn.q_proj/linear' (each
    entry of the list extends the one before it)."""
    parts = [p.strip().strip("'\"") for p in value.strip().strip("[]").split(",")]
    return "/".join([p for p in parts if p][-2:])


@dataclass
class GraphData:
    name: str = ""
    nodes: list[NodeData] = field(default_factory=list)
    initializers: list[TensorData] = field(default_factory=list)
    inputs: list[ValueInfoData] = field(default_factory=list)
    outputs: list[ValueInfoData] = field(default_factory=list)
    value_info: list[ValueInfoData] = field(default_factory=list)


@dataclass
class ModelData:
    """A ModelProto: `opset_import` as (domain, version) pairs, `metadata` its metadata_props."""

    ir_version: int = 0
    opset_import: list[tuple[str, int]] = field(default_factory=list)
    graph: GraphData = field(default_factory=GraphData)
    metadata: dict[str, str] = field(default_factory=dict)

    def uses_external_data(self) -> bool:
        tensors = list(self.graph.initializers)
        for node in self.graph.nodes:
            for attr in node.attributes:
                if attr.type == AttributeType.TENSOR:
                    tensors.append(attr.value)
                elif attr.type == AttributeType.TENSORS:
                    tensors.extend(attr.value)
        return any(t.data_location == EXTERNAL for t in tensors)


def map_model(path: str, what: str = "model") -> tuple[ModelData, memoryview]:
    """Read an ONNX file through a copy-on-write mapping of it, and that mapping's bytes: the raw data of
    its tensors are views of the mapping (file pages the kernel can drop), not copies."""
    try:
        if os.path.getsize(path) == 0:
            return parse_model(b"", f"{what} file '{path}'"), memoryview(b"")
        data = memoryview(np.memmap(path, np.uint8, "c"))
    except OSError as error:
        raise ModelError(f"{what} file '{path}' cannot be read ({error})") from None
    return parse_model(data, f"{what} file '{path}'"), data


def release_mapped(array: np.ndarray) -> None:
    """Let the kernel drop the file pages under `array` when it is a view of map_model's mapping (of a file's
    tensor that nothing reads any more): its RSS goes, and a later read would fetch the pages again."""
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    if base is None or not hasattr(base, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or array.size == 0:
        return
    start = array.__array_interface__["data"][0] - np.frombuffer(base, np.uint8, 1).__array_interface__["data"][0]
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if 0 <= first < end <= len(base):
        base.madvise(mmap.MADV_DONTNEED, first, end - first)


def parse_model(data, source: str = "model") -> ModelData:
    """Decode a serialized ModelProto (bytes, or a memoryview whose tensors' raw data stay views of it);
    `source` names it in errors."""
    try:
        return _model(data if isinstance(data, memoryview) else bytes(data), [(0, len(data))])
    except _Damaged as damage:
        raise ModelError(f"{source} is not a readable ONNX model ({damage.args[0]} at byte {damage.args[1]}); "
                         "the file is damaged or not an ONNX model") from None


# --- The wire format ---------------------------------------------------------------------------

class _Damaged(Exception):
    """(what is wrong, byte offset): turned into a ModelError naming the file by `parse_model`."""


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value as an unsigned 64-bit int, position after it)."""
    if pos < end and data[pos] < 0x80:  # most tags, lengths and numbers in a model fit in one byte
        return data[pos], pos + 1
    result = shift = 0
    start = pos
    while True:
        if pos >= end:
            raise _Damaged("a number runs past the end of its message", start)
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7
        if shift >= 70:
            raise _Damaged("a number is longer than 10 bytes", start)


def _fields(data: bytes, spans: list[tuple[int, int]]) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of every field in the spans of one message, in order. The value
    is an int for a varint, else the (start, end) span of its bytes; groups are skipped."""
    for pos, end in spans:
        while pos < end:
            tag, after = _varint(data, pos, end)
            number, wire = tag >> 3, tag & 7
            if number == 0 or tag >> 32:
                raise _Damaged(f"field number {number} is not valid", pos)
            if wire == VARINT:
                value, after = _varint(data, after, end)
            elif wire in (FIXED64, FIXED32):
                value = (after, after + (8 if wire == FIXED64 else 4))
                after = value[1]
            elif wire == LENGTH:
                length, after = _varint(data, after, end)
                value = (after, after + length)
                after = value[1]
            elif wire == START_GROUP:
                pos = _skip_group(data, after, end, number)
                continue
            elif wire == END_GROUP:
                raise _Damaged("a group closes that never opened", pos)
            else:
                raise _Damaged(f"wire type {wire} is not valid", pos)
            if after > end:
                raise _Damaged(f"field {number} runs past the end of its message", pos)
            yield number, wire, value
            pos = after


def _skip_group(data: bytes, pos: int, end: int, number: int) -> int:
    """The position after the END_GROUP that closes group `number` (groups may nest)."""
    open_groups = [number]
    while open_groups:
        tag, pos = _varint(data, pos, end)
        inner, wire = tag >> 3, tag & 7
        if wire == START_GROUP:
            open_groups.append(inner)
        elif wire == END_GROUP:
            if open_groups.pop() != inner:
                raise _Damaged(f"group {inner} closes where another is open", pos)
        elif wire == VARINT:
            _, pos = _varint(data, pos, end)
        elif wire in (FIXED64, FIXED32):
            pos += 8 if wire == FIXED64 else 4
        elif wire == LENGTH:
            length, pos = _varint(data, pos, end)
            pos += length
        else:
            raise _Damaged(f"wire type {wire} is not valid", pos)
        if pos > end:
            raise _Damaged(f"group {number} runs past the end of its message", pos)
    return pos


def _int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >> 31 else value


def _int64(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


def _text(data: bytes, span) -> str:
    try:
        return str(data[span[0]:span[1]], "utf-8")
    except UnicodeDecodeError:
        raise _Damaged("a text field is not UTF-8", span[0]) from None


def _bytes(data: bytes, span) -> bytes:
    return bytes(data[span[0]:span[1]])


def _varints(data: bytes, wire: int, value) -> list[int]:
    """The values of a repeated varint field: one, or a packed run."""
    if wire == VARINT:
        return [value]
    values, (pos, end) = [], value
    while pos < end:
        number, pos = _varint(data, pos, end)
        values.append(number)
    return values


def _fixed(data: bytes, span, size: int) -> bytes:
    """The bytes of a repeated fixed-size field: one value, or a packed run of them."""
    if (span[1] - span[0]) % size:
        raise _Damaged(f"a packed run of {size}-byte numbers has {span[1] - span[0]} bytes", span[0])
    return bytes(data[span[0]:span[1]])


def _entry(data: bytes, span) -> tuple[str, str]:
    """A StringStringEntryProto: (key, value)."""
    key = value = ""
    for number, wire, v in _fields(data, [span]):
        if number == 1 and wire == LENGTH:
            key = _text(data, v)
        elif number == 2 and wire == LENGTH:
            value = _text(data, v)
    return key, value


# --- The messages of onnx.proto ----------------------------------------------------------------

def _model(data: bytes, spans) -> ModelData:
    model, graph = ModelData(), []
    for number, wire, value in _fields(data, spans):
        if number == 1 and wire == VARINT:
            model.ir_version = _int64(value)
        elif number == 7 and wire == LENGTH:
            graph.append(value)
        elif number == 8 and wire == LENGTH:
            model.opset_import.append(_opset(data, value))
        elif number == 14 and wire == LENGTH:
            key, text = _entry(data, value)
            model.metadata[key] = text
    model.graph = _graph(data, graph)
    return model


def _opset(data: bytes, span) -> tuple[str, int]:
    domain, version = "", 0
    for number, wire, value in _fields(data, [span]):
        if number == 1 and wire == LENGTH:
            domain = _text(data, value)
        elif number == 2 and wire == VARINT:
            version = _int64(value)
    return domain, version


def _graph(data: bytes, spans) -> GraphData:
    graph = GraphData()
    for number, wire, value in _fields(data, spans):
        if wire != LENGTH:
            continue
        if number == 1:
            graph.nodes.append(_node(data, value))
        elif number == 2:
            graph.name = _text(data, value)
        elif number == 5:
            graph.initializers.append(_tensor(data, [value]))
        elif number in (11, 12, 13):
            (graph.inputs, graph.outputs, graph.value_info)[number - 11].append(_value_info(data, value))
        elif number == 16:  # metadata_props, read only to refuse a damaged entry
            _entry(data, value)
    return graph


def _node(data: bytes, span) -> NodeData:
    node = NodeData("", [], [])
    for number, wire, value in _fields(data, [span]):
        if wire != LENGTH:
            continue
        if number == 1:
            node.inputs.append(_text(data, value))
        elif number == 2:
            node.outputs.append(_text(data, value))
        elif number == 3:
            node.name = _text(data, value)
        elif number == 4:
            node.op_type = _text(data, value)
        elif number == 5:
            node.attributes.append(_attribute(data, value))
        elif number == 7:
            node.domain = _text(data, value)
        elif number == 9:  # metadata_props: only the module path is kept; every entry is read, so that a damaged
            key, text = _entry(data, value)  # one is refused as onnx refuses it
            if key == SCOPE_KEY:
                node.scope = node_scope(text)
    return node


# The field that holds an attribute's value, by its type.
_VALUE_FIELDS = {AttributeType.FLOAT: 2, AttributeType.INT: 3, AttributeType.STRING: 4, AttributeType.TENSOR: 5,
                 AttributeType.GRAPH: 6, AttributeType.FLOATS: 7, AttributeType.INTS: 8, AttributeType.STRINGS: 9,
                 AttributeType.TENSORS: 10, AttributeType.GRAPHS: 11, AttributeType.TYPE_PROTO: 14,
                 AttributeType.TYPE_PROTOS: 15, AttributeType.SPARSE_TENSOR: 22, AttributeType.SPARSE_TENSORS: 23}
_UNREAD_MESSAGES = {AttributeType.TYPE_PROTO, AttributeType.SPARSE_TENSOR}
_TENSOR_FIELDS = {5, 10}  # an attribute's t and tensors
_MESSAGE_FIELDS = {6, 11, 14, 15, 22, 23}  # its g, graphs, tp, type_protos, sparse_tensor, sparse_tensors


def _attribute(data: bytes, span) -> AttributeData:
    """Only the field of the attribute's type is decoded, as onnx.helper.get_attribute_value reads it."""
    name, kind, fields = "", AttributeType.UNDEFINED, []
    for number, wire, value in _fields(data, [span]):
        if number == 1 and wire == LENGTH:
            name = _text(data, value)
        elif number == 20 and wire == VARINT and value < len(AttributeType):  # a closed enum: others are unknown
            kind = AttributeType(value)
        else:
            fields.append((number, wire, value))
    wanted = _VALUE_FIELDS.get(kind)
    for number, wire, value in fields:  # the message fields of other types are read as ONNX would parse them
        if number == wanted or wire != LENGTH:
            continue
        if number in _TENSOR_FIELDS:
            _tensor(data, [value])
        elif number in _MESSAGE_FIELDS:
            for _ in _fields(data, [value]):
                pass
    runs = [(wire, value) for number, wire, value in fields if number == wanted]
    scalar_wire = {AttributeType.FLOAT: FIXED32, AttributeType.INT: VARINT}.get(kind, LENGTH)
    scalar = [value for wire, value in runs if wire == scalar_wire]
    if kind == AttributeType.FLOAT:
        value = struct.unpack_from("<f", data, scalar[-1][0])[0] if scalar else 0.0
    elif kind == AttributeType.INT:
        value = _int64(scalar[-1]) if scalar else 0
    elif kind == AttributeType.STRING:
        value = _bytes(data, scalar[-1]) if scalar else b""
    elif kind == AttributeType.TENSOR:
        value = _tensor(data, scalar)
    elif kind == AttributeType.GRAPH:  # a body of If, Loop or Scan
        value = _graph(data, scalar)
    elif kind == AttributeType.GRAPHS:
        value = [_graph(data, [s]) for s in scalar]
    elif kind in _UNREAD_MESSAGES:
        value = b"".join(_bytes(data, s) for s in scalar)
    elif kind == AttributeType.FLOATS:
        floats = b"".join(_fixed(data, v, 4) for wire, v in runs if wire in (FIXED32, LENGTH))
        value = np.frombuffer(floats, "<f4").tolist()
    elif kind == AttributeType.INTS:
        value = [_int64(v) for wire, v in runs if wire in (VARINT, LENGTH) for v in _varints(data, wire, v)]
    elif kind == AttributeType.TENSORS:
        value = [_tensor(data, [s]) for s in scalar]
    elif kind == AttributeType.UNDEFINED:
        value = None
    else:  # STRINGS, and the lists of messages odtrain does not read
        value = [_bytes(data, s) for s in scalar]
    return AttributeData(name, kind, value)


def _tensor(data: bytes, spans) -> TensorData:
    tensor = TensorData()
    floats, doubles, int32s, int64s, uint64s = [], [], [], [], []
    for number, wire, value in _fields(data, spans):
        if number == 1 and wire in (VARINT, LENGTH):
            tensor.dims += [_int64(v) for v in _varints(data, wire, value)]
        elif number == 2 and wire == VARINT:
            tensor.data_type = _int32(value)
        elif number == 3 and wire == LENGTH:
            tensor.segmented = True
        elif number == 4 and wire in (FIXED32, LENGTH):
            floats.append(_fixed(data, value, 4))
        elif number == 5 and wire in (VARINT, LENGTH):
            int32s += _varints(data, wire, value)
        elif number == 6 and wire == LENGTH:
            tensor.string_data.append(_bytes(data, value))
        elif number == 7 and wire in (VARINT, LENGTH):
            int64s += _varints(data, wire, value)
        elif number == 8 and wire == LENGTH:
            tensor.name = _text(data, value)
        elif number == 9 and wire == LENGTH:
            tensor.raw_data = data[value[0]:value[1]]  # a view when `data` is a mapping's memoryview
        elif number == 10 and wire in (FIXED64, LENGTH):
            doubles.append(_fixed(data, value, 8))
        elif number == 11 and wire in (VARINT, LENGTH):
            uint64s += _varints(data, wire, value)
        elif number == 13 and wire == LENGTH:
            key, text = _entry(data, value)
            tensor.external_data[key] = text
        elif number == 14 and wire == VARINT and value in (0, EXTERNAL):  # a closed enum: others are unknown
            tensor.data_location = value
    tensor.float_data = np.frombuffer(b"".join(floats), "<f4").astype(np.float32)
    tensor.double_data = np.frombuffer(b"".join(doubles), "<f8").astype(np.float64)
    tensor.int32_data = np.array(int32s, np.uint64).astype(np.uint32).view(np.int32)  # int32 keeps the low bits
    tensor.int64_data = np.array(int64s, np.uint64).view(np.int64)
    tensor.uint64_data = np.array(uint64s, np.uint64)
    return tensor


def _value_info(data: bytes, span) -> ValueInfoData:
    info, types = ValueInfoData(""), []
    for number, wire, value in _fields(data, [span]):
        if number == 1 and wire == LENGTH:
            info.name = _text(data, value)
        elif number == 2 and wire == LENGTH:
            types.append(value)
        elif number == 3 and wire == LENGTH:  # metadata_props, read only to refuse a damaged entry
            _entry(data, value)
    tensor_type = None  # the spans of TypeProto.tensor_type, while it is the member of the oneof set last
    for number, wire, value in _fields(data, types):
        if wire != LENGTH:
            continue
        if number == 1:
            tensor_type = (tensor_type or []) + [value]
        elif number in (4, 5, 7, 8, 9):  # sequence, map, opaque, sparse tensor, optional: replaces tensor_type
            tensor_type = None
    if tensor_type is None:
        return info
    shape = None
    for number, wire, value in _fields(data, tensor_type):
        if number == 1 and wire == VARINT:
            info.elem_type = _int32(value)
        elif number == 2 and wire == LENGTH:
            shape = (shape or []) + [value]
    if shape is not None:
        info.shape = tuple(_dimension(data, span) for number, wire, span in _fields(data, shape)
                           if number == 1 and wire == LENGTH)
    return info


def _dimension(data: bytes, span) -> int | str | None:
    """TensorShapeProto.Dimension: dim_value, else dim_param when not empty, else None."""
    dim = None
    for number, wire, value in _fields(data, [span]):
        if number == 1 and wire == VARINT:
            dim = _int64(value)
        elif number == 2 and wire == LENGTH:
            dim = _text(data, value)
    return None if dim == "" else dim


# --- A light copy for shape inference --------------------------------------------------------------

LIGHT_BYTES = 1024  # initializers' raw data of at least this many bytes are left out of a light copy


def without_weights(data) -> bytes:
    """A serialized ModelProto (already parsed whole) re-encoded without the raw data of its large
    initializers (they keep name, type and dims): what ONNX shape inference needs, without the weights.
    Groups (a deprecated encoding) are dropped."""
    model = bytearray()
    for number, wire, value in _fields(data, [(0, len(data))]):
        if number == 7 and wire == LENGTH:  # ModelProto.graph
            graph = bytearray()
            for n, w, v in _fields(data, [value]):
                if n == 5 and w == LENGTH:  # GraphProto.initializer
                    kept = [_encode(tn, tw, tv, data) for tn, tw, tv in _fields(data, [v])
                            if not (tn == 9 and tw == LENGTH and tv[1] - tv[0] >= LIGHT_BYTES)]
                    graph += _encode(n, w, b"".join(kept))
                else:
                    graph += _encode(n, w, v, data)
            model += _encode(number, wire, bytes(graph))
        else:
            model += _encode(number, wire, value, data)
    return bytes(model)


def initializer_field(name: str, data_type: int, dims, nbytes: int) -> bytes:
    """The bytes of a ModelProto's `graph` field holding one initializer, up to its raw data (`nbytes`
    bytes that the caller writes next)."""
    header = (b"".join(_number(1, d) for d in dims) + _number(2, data_type) + _length(8, name)
              + _varint_bytes(9 << 3 | LENGTH) + _varint_bytes(nbytes))
    tensor = _varint_bytes(5 << 3 | LENGTH) + _varint_bytes(len(header) + nbytes) + header
    return _varint_bytes(7 << 3 | LENGTH) + _varint_bytes(len(tensor) + nbytes) + tensor


def external_initializer_field(name: str, data_type: int, dims, location: str, offset: int, length: int) -> bytes:
    """The bytes of a ModelProto's `graph` field holding one initializer whose `length` bytes sit at `offset` of
    the file `location` (beside the model, ONNX's external data)."""
    entries = b"".join(_length(13, _length(1, key) + _length(2, str(value)))
                       for key, value in (("location", location), ("offset", offset), ("length", length)))
    tensor = b"".join(_number(1, d) for d in dims) + _number(2, data_type) + _length(8, name) + entries + \
        _number(14, EXTERNAL)
    tensor = _varint_bytes(5 << 3 | LENGTH) + _varint_bytes(len(tensor)) + tensor
    return _varint_bytes(7 << 3 | LENGTH) + _varint_bytes(len(tensor)) + tensor


def _encode(number: int, wire: int, value, data=None) -> bytes:
    """One field as read by _fields: `value` an int (varint), bytes, or the span of its bytes in `data`."""
    if wire == VARINT:
        return _number(number, value)
    content = value if isinstance(value, (bytes, bytearray)) else bytes(data[value[0]:value[1]])
    return _length(number, content) if wire == LENGTH else _varint_bytes(number << 3 | wire) + content


# ---- writing: the same messages encoded, for saving a model where onnx is not loaded ----
# The lowest IR version that carries each default-domain opset (onnx.helper.VERSION_TABLE's facts).
_IR_FOR_OPSET = ((8, 3), (9, 4), (10, 5), (11, 6), (14, 7), (18, 8), (20, 9), (22, 10), (23, 11), (24, 12),
                 (27, 13), (10 ** 9, 14))


def minimum_ir_version(opset_import) -> int:
    """The lowest IR version that a model importing these (domain, version) opsets may declare."""
    version = dict(opset_import).get("", dict(opset_import).get("ai.onnx", 1))
    return next(ir for last, ir in _IR_FOR_OPSET if version <= last)


def _varint_bytes(value: int) -> bytes:
    value &= (1 << 64) - 1  # a negative int32 or int64 as its 64-bit two's complement
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _number(field_number: int, value: int) -> bytes:
    return _varint_bytes(field_number << 3 | VARINT) + _varint_bytes(int(value))


def _length(field_number: int, payload) -> bytes:
    payload = payload.encode() if isinstance(payload, str) else bytes(payload)
    return _varint_bytes(field_number << 3 | LENGTH) + _varint_bytes(len(payload)) + payload


def _encode_tensor(tensor: TensorData) -> bytes:
    out = b"".join(_number(1, d) for d in tensor.dims) + _number(2, tensor.data_type)
    return out + _length(8, tensor.name) + _length(9, tensor.raw_data or b"")


def tensor_data(name: str, array: np.ndarray) -> TensorData:
    """A float, int or bool array as a TensorData with little-endian raw_data (a PackedInt4's packed bytes)."""
    packed = getattr(array, "packed", None)
    if packed is not None:
        return TensorData(name, list(array.shape), element_type(array.dtype), packed.tobytes())
    array = np.asarray(array)
    return TensorData(name, list(array.shape), element_type(array.dtype),
                      np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes())


def _encode_attribute(attribute: AttributeData) -> bytes:
    kind, value = AttributeType(attribute.type), attribute.value
    out = _length(1, attribute.name)
    if kind == AttributeType.FLOAT:
        out += _varint_bytes(2 << 3 | FIXED32) + struct.pack("<f", value)
    elif kind == AttributeType.INT:
        out += _number(3, value)
    elif kind == AttributeType.STRING:
        out += _length(4, value)
    elif kind == AttributeType.TENSOR:
        out += _length(5, _encode_tensor(value))
    elif kind == AttributeType.GRAPH:
        out += _length(6, _encode_graph(value))
    elif kind == AttributeType.FLOATS:
        out += _length(7, struct.pack(f"<{len(value)}f", *value))
    elif kind == AttributeType.INTS:
        out += _length(8, b"".join(_varint_bytes(int(v)) for v in value))
    elif kind == AttributeType.STRINGS:
        out += b"".join(_length(9, v) for v in value)
    else:
        raise ModelError(f"attribute '{attribute.name}': writing {kind.name} attributes needs the onnx package")
    return out + _number(20, kind)


def _encode_value_info(info: ValueInfoData) -> bytes:
    tensor = _number(1, info.elem_type) if info.elem_type else b""
    if info.shape is not None:
        dims = [_number(1, d) if isinstance(d, int) else _length(2, d) if isinstance(d, str) else b""
                for d in info.shape]
        tensor += _length(2, b"".join(_length(1, d) for d in dims))
    return _length(1, info.name) + (_length(2, _length(1, tensor)) if info.elem_type else b"")


def _encode_node(node: NodeData) -> bytes:
    out = b"".join(_length(1, name) for name in node.inputs) + b"".join(_length(2, name) for name in node.outputs)
    out += _length(3, node.name) + _length(4, node.op_type)
    out += b"".join(_length(5, _encode_attribute(a)) for a in node.attributes)
    return out + (_length(7, node.domain) if node.domain else b"")


def _encode_graph(graph: GraphData) -> bytes:
    body = b"".join(_length(1, _encode_node(n)) for n in graph.nodes) + _length(2, graph.name)
    body += b"".join(_length(5, _encode_tensor(t)) for t in graph.initializers)
    body += b"".join(_length(11, _encode_value_info(v)) for v in graph.inputs)
    body += b"".join(_length(12, _encode_value_info(v)) for v in graph.outputs)
    return body + b"".join(_length(13, _encode_value_info(v)) for v in graph.value_info)


def encode_model(model: ModelData, producer: str = "odtrain") -> bytes:
    """The ModelProto bytes of `model` (tensors as raw_data; attributes of the kinds AttributeData reads)."""
    out = _number(1, model.ir_version) + _length(2, producer) + _length(7, _encode_graph(model.graph))
    out += b"".join(_length(8, _length(1, domain) + _number(2, version)) for domain, version in model.opset_import)
    return out + b"".join(_length(14, _length(1, k) + _length(2, v)) for k, v in model.metadata.items())
