"""ONNX import and export: the only place where protobufs meet the IR.

Two readers give the same plain data (`onnx_wire.ModelData`), from which one builder makes the IR:
- A file odtrain saved is read by `onnx_wire`, which decodes the protobuf wire format itself: a
  device that trains needs only these files, and `import onnx` would add its op-schema registry
  to the process's memory and start-up (`bench_memory.RuntimeFloor`). Such files carry a metadata mark (SHAPES_INFERRED): their
  value_info already holds ONNX's inferred types, so no shape inference runs.
- Any other model (a ModelProto, a forward model from an exporter, a file with external data)
  goes through onnx, and ONNX shape inference runs first so that gradient rules can ask for
  ranks; values whose types stay unknown are typed when shapes are bound.
The checks, the tensor decoding and the IR building are the same for both; a node of an older opset
is rewritten by the upgrades its op registers (graph/ops, `upgrade`: DFT's axis, Softmax's); a node of a
standard op with an attribute its op does not define is refused by name (graph/onnx_attributes.py).
A file's external data (`.onnx.data`) is never read whole: `read_graph` maps each external initializer
copy-on-write from its file (after checking that it sits in the model's folder and inside the file), so
a frozen weight costs page cache the kernel can drop, not memory of its own.
Export stamps the lowest IR version the opsets allow, so older runtimes load what odtrain writes.
onnx is imported inside the functions that use it, never when this module loads.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import TYPE_CHECKING

import numpy as np

from .errors import ArtifactNotFoundError, ModelError, UnsupportedOpError
from .int4 import PackedInt4, at_blocked_opset
from .control_flow import onnx_inputs, walk, with_captures
from .loop_sequences import appended_sequences_as_scan_outputs, split_sequences_as_slices
from .onnx_attributes import ATTRIBUTES, unknown_attributes
from .ir import DEFAULT_DOMAIN, ODTRAIN_DOMAIN, Graph, Node, TensorType
from .onnx_wire import (EXTERNAL, LIGHT_BYTES, SCOPE_KEY, AttributeData, AttributeType, GraphData, ModelData,
                        NodeData, TensorData, ValueInfoData, element_type, element_type_name, encode_model,
                        external_initializer_field, initializer_field, is_storage_dtype, map_model,
                        minimum_ir_version, node_scope, numpy_dtype, tensor_data, without_weights)
from .ops import upgrade_legacy_nodes

if TYPE_CHECKING:
    import onnx

ODTRAIN_OPSET = 1
# Metadata key of models odtrain wrote with ONNX's inferred types inside: loading them skips the
# inference, which would give the same types and loads ONNX's op-schema registry.
SHAPES_INFERRED = "odtrain.shapes_inferred"
MIN_DEFAULT_OPSET = 9


def load_graph(model, what: str = "model") -> Graph:
    """The IR of a ModelProto or an ONNX file. A file odtrain saved (marked SHAPES_INFERRED, without
    external data) is read without importing onnx; anything else is read through onnx."""
    if isinstance(model, (str, os.PathLike)):
        path = _existing_file(model, what)
        data, _ = map_model(path, what)
        if SHAPES_INFERRED in data.metadata and not data.uses_external_data():
            return graph_from_model(data, path)
    return read_graph(model, what)[0]


def read_graph(model, what: str = "model") -> tuple[Graph, str | None]:
    """The IR of a ModelProto or an ONNX file, and the file's path. A file is mapped: its initializers
    are views of the mapping, its external data maps from its own files, and onnx (shape inference)
    sees a copy without the weights."""
    if not isinstance(model, (str, os.PathLike)):
        return graph_from_proto(read_model_proto(model, what)[0], what), None
    import onnx

    path = _existing_file(model, what)
    data, mapping = map_model(path, what)
    try:
        light = onnx.load_from_string(without_weights(mapping))
    except Exception as error:  # protobuf DecodeError and the like
        raise ModelError(f"{what} file '{path}' is not a readable ONNX model ({type(error).__name__}: {error})") from None
    folder = os.path.dirname(os.path.abspath(path))
    check_external_data(light, folder, path)
    return graph_from_proto(light, path, folder, data.graph.initializers), path


def _existing_file(model, what: str) -> str:
    path = os.fspath(model)
    if not os.path.isfile(path):
        raise ArtifactNotFoundError(f"{what} file '{path}' does not exist")
    return path


def _external_tensors(proto: onnx.ModelProto):
    for tensor in proto.graph.initializer:
        if tensor.data_location == EXTERNAL:
            yield tensor
    for node in proto.graph.node:
        for attr in node.attribute:
            if attr.HasField("t") and attr.t.data_location == EXTERNAL:
                yield attr.t


def check_external_data(proto: onnx.ModelProto, folder: str, path: str) -> None:
    """Refuse external-data locations that leave the model's folder (absolute, '..', or via links)."""
    root = os.path.realpath(folder)
    for tensor in _external_tensors(proto):
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        target = os.path.realpath(os.path.join(root, location))
        if not location or os.path.isabs(location) or os.path.commonpath([root, target]) != root:
            raise ModelError(f"model file '{path}': tensor '{tensor.name}' keeps its data at '{location}', outside "
                             f"the model's folder '{root}'; external data must sit beside the model")
        if not os.path.isfile(target):
            raise ArtifactNotFoundError(f"model file '{path}': the external data file '{location}' of tensor "
                                        f"'{tensor.name}' does not exist in '{root}'")


def read_model_proto(model, what: str = "model", load_external_data: bool = True) -> tuple[onnx.ModelProto, str | None]:
    """A ModelProto from a ModelProto or a path, with clear errors for missing or unreadable files; without
    `load_external_data`, external tensors stay references (checked to sit in the model's folder)."""
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model, None
    path = _existing_file(model, what)
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as error:  # protobuf DecodeError and the like
        raise ModelError(f"{what} file '{path}' is not a readable ONNX model ({type(error).__name__}: {error})") from None
    folder = os.path.dirname(os.path.abspath(path))
    check_external_data(proto, folder, path)
    if not load_external_data:
        return proto, path
    try:
        onnx.load_external_data_for_model(proto, folder)
    except Exception as error:
        raise ModelError(f"{what} file '{path}': its external data cannot be read ({error})") from None
    return proto, path


def graph_from_proto(proto: onnx.ModelProto, source: str = "model", folder: str | None = None,
                     initializers: list[TensorData] | None = None) -> Graph:
    """The IR of a ModelProto, after ONNX shape inference unless odtrain saved it with its types; external
    initializers are mapped from their files in `folder` (checked by `check_external_data`);
    `initializers`, when given, replace the proto's (a light copy's, without their data)."""
    import onnx.defs

    opsets = _opsets((o.domain, o.version) for o in proto.opset_import)
    _check_opsets(opsets, proto.graph.node, source)
    # Only this path compares the opset with the newest the onnx package knows. The files the wire
    # path reads were saved by odtrain from graphs that passed this check when first loaded, and
    # what runs on a device is decided by odtrain's own op rules, not by onnx's schemas.
    newest = onnx.defs.onnx_opset_version()
    if opsets.get(DEFAULT_DOMAIN, 0) > newest:
        raise ModelError(f"{source}: opset {opsets[DEFAULT_DOMAIN]} is newer than the newest this installation "
                         f"knows ({newest}); re-export with opset {newest} or older, or upgrade the onnx package")
    if not any(p.key == SHAPES_INFERRED for p in proto.metadata_props):
        proto = _with_inferred_shapes(proto)
    model = model_from_proto(proto)
    if initializers is not None:
        model.graph.initializers = initializers
    # sequence ops exporters write around tensors become tensor ops (graph/loop_sequences.py): a scripted loop's
    # list appends the Loop's scan output, torch.chunk's SequenceAt reads Slices
    graph = split_sequences_as_slices(_build_graph(model, opsets, source, folder))
    return appended_sequences_as_scan_outputs(graph)


def graph_from_model(model: ModelData, source: str = "model") -> Graph:
    """The IR of a model as `onnx_wire` reads it; its value types are the ones it holds (no inference)."""
    opsets = _opsets(model.opset_import)
    _check_opsets(opsets, model.graph.nodes, source)
    return _build_graph(model, opsets, source)


def _mapped(tensor: TensorData, folder: str) -> np.ndarray:
    """An external tensor's values: a copy-on-write map of its bytes in its file (a copy when the offset
    does not suit the element type's alignment, or the tensor is empty)."""
    dtype = numpy_dtype(tensor.data_type)
    if dtype is None or dtype == object or tensor.segmented:
        raise ModelError(f"its element type {element_type_name(tensor.data_type)} is not supported externally")
    path = os.path.join(folder, tensor.external_data.get("location", ""))
    size = os.path.getsize(path)
    try:
        offset = int(tensor.external_data.get("offset", 0))
        length = int(tensor.external_data.get("length", size - offset))
    except ValueError:
        raise ModelError(f"its external offset or length is not a number: {tensor.external_data}") from None
    count = int(np.prod(tensor.dims, dtype=np.int64))
    packed = dtype.name == "int4"  # ONNX's packing, two values a byte, held packed (graph/int4.py)
    needed = (count + 1) // 2 if packed else count * dtype.itemsize
    if needed != length or offset < 0 or offset + length > size:
        raise ModelError(f"its dims {list(tensor.dims)} need {needed} bytes; its external data "
                         f"gives {length} at offset {offset} of '{path}', a file of {size} bytes")
    if packed:
        return PackedInt4(np.memmap(path, np.uint8, "c", offset, (length,)).view(np.ndarray), tensor.dims, dtype)
    if count == 0 or offset % dtype.itemsize:
        return np.fromfile(path, dtype.newbyteorder("<"), count, offset=offset).astype(dtype).reshape(tensor.dims)
    return np.memmap(path, dtype.newbyteorder("<"), "c", offset, tuple(tensor.dims)).view(np.ndarray)


def _opsets(opset_import) -> dict[str, int]:
    return {(DEFAULT_DOMAIN if domain == "ai.onnx" else domain): int(version) for domain, version in opset_import}


def _unchanged_since(op_types, opset: int) -> bool:
    """Whether each standard op type means at MIN_DEFAULT_OPSET what it means at an older `opset` (And,
    Or, Not... have not changed since): a model of such ops is read as it is."""
    import onnx.defs  # only for models older than MIN_DEFAULT_OPSET

    def version(op: str, at: int) -> int:
        return onnx.defs.get_schema(op, at).since_version

    try:
        return all(version(op, opset) == version(op, MIN_DEFAULT_OPSET) for op in op_types)
    except onnx.defs.SchemaError:
        return False


def _check_opsets(opsets: dict[str, int], nodes, source: str) -> None:
    """What every model must pass, whichever reader read it: a recent enough opset (or older ops that have
    not changed since), standard ops only. `nodes` are NodeProtos or NodeData (op_type, name, domain)."""
    opset = opsets.get(DEFAULT_DOMAIN, MIN_DEFAULT_OPSET)
    standard = {n.op_type for n in nodes if n.domain in (DEFAULT_DOMAIN, "ai.onnx")}
    if opset < MIN_DEFAULT_OPSET and not _unchanged_since(standard, opset):
        raise ModelError(f"{source}: opset {opset} is older than {MIN_DEFAULT_OPSET}; "
                         "re-export it with a newer opset (torch.onnx.export(..., opset_version=17))")
    known = (DEFAULT_DOMAIN, "ai.onnx", ODTRAIN_DOMAIN, "ai.onnx.ml", "ai.onnx.preview.training")
    foreign = [(index, n) for index, n in enumerate(nodes) if n.domain not in known]
    if foreign:
        shown = [f"{n.op_type} node '{_node_name(n, index)}' of domain '{n.domain}'" for index, n in foreign[:10]]
        more = f"; and {len(foreign) - 10} more" if len(foreign) > 10 else ""
        domains = sorted({n.domain for _, n in foreign})
        raise UnsupportedOpError(f"{source}: odtrain implements no ops of the domain{'s' * (len(domains) > 1)} "
                                 f"{', '.join(domains)}: {'; '.join(shown)}{more}; export the model with standard "
                                 "ONNX ops only (onnxruntime's quantizer writes them with quant_format=QuantFormat.QDQ)")


def _node_name(node, index: int) -> str:
    """A node's name, or `<op type>_<index in the graph>` for an unnamed one."""
    return node.name or f"{node.op_type}_{index}"


def _build_graph(model: ModelData, opsets: dict[str, int], source: str, folder: str | None = None) -> Graph:
    """The IR of a model whose opsets passed `_check_opsets`, from either reader's data."""
    def to_array(tensor: TensorData) -> np.ndarray:
        external = folder is not None and tensor.data_location == EXTERNAL
        return _mapped(tensor, folder) if external else tensor.to_array()

    graph = _build_scope(model.graph, opsets, source, to_array)
    # the top level only: a body reads values of the scope around it by name
    _check_names(graph.nodes, graph.inputs, graph.initializers, graph.outputs, source)
    graph.inputs = [name for name in graph.inputs if name not in graph.initializers]
    return graph


def _build_scope(g: GraphData, opsets: dict[str, int], source: str, to_array, scope: str = "") -> Graph:
    """The IR of a graph or of a subgraph (a body of If, Loop or Scan: built the same way, its nodes' own
    bodies first, and each control-flow node given its captured inputs: graph/control_flow.py)."""
    initializers = {}
    for tensor in g.initializers:
        try:
            initializers[tensor.name] = to_array(tensor)
        except ModelError as error:
            raise ModelError(f"{source}: {scope}initializer '{tensor.name}' cannot be read: {error}") from None
    value_types: dict[str, TensorType] = {}
    for info in g.inputs + g.outputs + g.value_info:
        t = _value_type(info, source)
        if t is not None:
            value_types[info.name] = t
    for name, array in initializers.items():
        value_types[name] = TensorType(array.dtype, tuple(array.shape))
    nodes = []
    for index, n in enumerate(g.nodes):
        name = _node_name(n, index)

        def subgraph(data: GraphData, key: str) -> Graph:
            return _build_scope(data, opsets, source, to_array, f"{scope}{n.op_type} node '{name}', {key}: ")

        try:
            attrs = {a.name: _attr_value(a, to_array, subgraph) for a in n.attributes}
        except ModelError as error:
            if str(error).startswith(source):
                raise
            raise ModelError(f"{source}: {scope}node '{n.name or index}' ({n.op_type}): {error}") from None
        unknown = unknown_attributes(n.op_type, attrs) if n.domain in (DEFAULT_DOMAIN, "ai.onnx") else []
        if unknown:
            raise ModelError(f"{source}: {scope}node '{name}' ({n.op_type}) has attribute"
                             f"{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}, which {n.op_type} does "
                             f"not define (its attributes: {', '.join(ATTRIBUTES[n.op_type]) or 'none'}); the file "
                             "is damaged, or its writer has a bug: export the model again")
        nodes.append(with_captures(Node(n.op_type, list(n.inputs), list(n.outputs), attrs, name, n.domain, n.scope)))
    upgrade_legacy_nodes(nodes, opsets, value_types, source)  # each op's own upgrades (graph/ops, `upgrade`)
    return Graph(nodes, [i.name for i in g.inputs], [o.name for o in g.outputs], initializers, value_types,
                 opsets, g.name or "graph")


def _check_names(nodes, inputs, initializers, outputs, source: str) -> None:
    """Every value a node reads and every output of the graph is an input, an initializer or a node's output: a
    damaged name (a flipped byte) would otherwise surface as a missing key when a step is planned."""
    known = set(inputs) | set(initializers) | {o for n in nodes for o in n.outputs if o}
    for node in nodes:
        unknown = [name for name in node.inputs if name and name not in known]
        if unknown:
            raise ModelError(f"{source}: {node.describe()} reads {', '.join(map(repr, unknown))}, which no node "
                             "computes and the graph neither takes nor holds: the file is damaged, or its writer "
                             "has a bug; export the model again")
    unknown = [name for name in outputs if name not in known]
    if unknown:
        raise ModelError(f"{source}: the graph outputs {', '.join(map(repr, unknown))}, which no node computes and "
                         "the graph neither takes nor holds: the file is damaged, or its writer has a bug; export "
                         "the model again")


def _value_type(info: ValueInfoData, source: str) -> TensorType | None:
    if info.elem_type == 0:
        return None
    dtype = numpy_dtype(info.elem_type)
    if dtype is None:
        raise ModelError(f"{source}: value '{info.name}' has the element type {element_type_name(info.elem_type)}, "
                         "which odtrain does not support (float, int and bool are)")
    if info.shape is None:
        return TensorType(dtype, None)
    # An unknown dim without a name gets a symbol of its own, so that it equals no other dim.
    return TensorType(dtype, tuple(f"unk_{info.name}_{axis}" if dim is None else dim
                                   for axis, dim in enumerate(info.shape)))


def _attr_value(attr: AttributeData, to_array=TensorData.to_array, subgraph=None):
    """A plain value for the IR: str for text, numpy arrays for tensors (read by `to_array`), Graphs for
    subgraphs (built by `subgraph(data, attribute name)`); kinds odtrain cannot run are refused."""
    kind, value = attr.type, attr.value
    try:
        if kind == AttributeType.STRING:
            return value.decode("utf-8")
        if kind == AttributeType.STRINGS:
            return [v.decode("utf-8") for v in value]
        if kind == AttributeType.TENSOR:
            return to_array(value)
        if kind == AttributeType.TENSORS:
            return [to_array(t) for t in value]
    except UnicodeDecodeError:
        raise ModelError(f"attribute '{attr.name}' holds text that is not UTF-8") from None
    except ModelError as error:
        raise ModelError(f"attribute '{attr.name}': {error}") from None
    if kind == AttributeType.GRAPH and subgraph is not None:
        return subgraph(value, attr.name)
    if kind == AttributeType.GRAPH or (kind == AttributeType.GRAPHS and value):
        raise ModelError(f"attribute '{attr.name}' holds a list of subgraphs, which no op odtrain runs takes")
    if kind in (AttributeType.SPARSE_TENSOR, AttributeType.TYPE_PROTO) or (
            kind in (AttributeType.SPARSE_TENSORS, AttributeType.TYPE_PROTOS) and value):
        held = "a sparse tensor" if kind in (AttributeType.SPARSE_TENSOR, AttributeType.SPARSE_TENSORS) else "a type"
        raise ModelError(f"attribute '{attr.name}' holds {held}, which odtrain does not read")
    return value  # a float, an int, a list of them, [] or None


def model_from_proto(proto: onnx.ModelProto) -> ModelData:
    """The plain data `onnx_wire` reads from a file, taken from a ModelProto's fields."""
    return ModelData(proto.ir_version, [(o.domain, o.version) for o in proto.opset_import], _graph_data(proto.graph),
                     {p.key: p.value for p in proto.metadata_props})


def _graph_data(g) -> GraphData:
    """A GraphProto (a model's graph, or a subgraph) as GraphData."""
    return GraphData(g.name, [_node_data(n) for n in g.node], [_tensor_data(t) for t in g.initializer],
                     [_value_info_data(v) for v in g.input], [_value_info_data(v) for v in g.output],
                     [_value_info_data(v) for v in g.value_info])


def _node_data(node) -> NodeData:
    scope = next((node_scope(p.value) for p in node.metadata_props if p.key == SCOPE_KEY), "")
    return NodeData(node.op_type, list(node.input), list(node.output), node.name, node.domain,
                    [_attribute_data(a) for a in node.attribute], scope)


# The AttributeProto field that holds the value of each type, as onnx.helper.get_attribute_value reads it.
_ATTRIBUTE_FIELDS = {AttributeType.FLOAT: "f", AttributeType.INT: "i", AttributeType.STRING: "s",
                     AttributeType.TENSOR: "t", AttributeType.GRAPH: "g", AttributeType.FLOATS: "floats",
                     AttributeType.INTS: "ints", AttributeType.STRINGS: "strings", AttributeType.TENSORS: "tensors",
                     AttributeType.GRAPHS: "graphs", AttributeType.SPARSE_TENSOR: "sparse_tensor",
                     AttributeType.SPARSE_TENSORS: "sparse_tensors", AttributeType.TYPE_PROTO: "tp",
                     AttributeType.TYPE_PROTOS: "type_protos"}
_LIST_KINDS = {AttributeType.FLOATS, AttributeType.INTS, AttributeType.STRINGS, AttributeType.GRAPHS,
          AttributeType.SPARSE_TENSORS, AttributeType.TYPE_PROTOS}


def _attribute_data(attr) -> AttributeData:
    kind = AttributeType(attr.type)
    value = None if kind == AttributeType.UNDEFINED else getattr(attr, _ATTRIBUTE_FIELDS[kind])
    if kind == AttributeType.TENSOR:
        value = _tensor_data(value)
    elif kind == AttributeType.GRAPH:
        value = _graph_data(value)
    elif kind == AttributeType.GRAPHS:
        value = [_graph_data(g) for g in value]
    elif kind == AttributeType.TENSORS:
        value = [_tensor_data(t) for t in value]
    elif kind in _LIST_KINDS:
        value = list(value)
    return AttributeData(attr.name, kind, value)


def _tensor_data(tensor) -> TensorData:
    return TensorData(tensor.name, list(tensor.dims), tensor.data_type,
                      tensor.raw_data if tensor.HasField("raw_data") else None,
                      np.array(tensor.float_data, np.float32), np.array(tensor.int32_data, np.int32),
                      np.array(tensor.int64_data, np.int64), np.array(tensor.double_data, np.float64),
                      np.array(tensor.uint64_data, np.uint64), list(tensor.string_data), tensor.data_location,
                      {e.key: e.value for e in tensor.external_data}, tensor.HasField("segment"))


def _value_info_data(info) -> ValueInfoData:
    if not info.type.HasField("tensor_type"):
        return ValueInfoData(info.name)
    tensor = info.type.tensor_type
    shape = None
    if tensor.HasField("shape"):
        shape = tuple(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
    return ValueInfoData(info.name, tensor.elem_type, shape)


def _value_info(name: str, t: TensorType | None):
    from onnx import helper

    if t is None:
        return helper.make_empty_tensor_value_info(name)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))
    return helper.make_tensor_value_info(name, elem, None if t.shape is None else list(t.shape))


def _attribute(node, key: str, value):
    """An AttributeProto; an empty list carries no type of its own, so the op's schema gives it (a Constant's
    `value_ints: []` stays ints)."""
    from onnx import AttributeProto, defs, helper, numpy_helper

    if isinstance(value, np.ndarray):
        return helper.make_attribute(key, numpy_helper.from_array(value))
    if isinstance(value, Graph):
        return helper.make_attribute(key, _subgraph_proto(value))
    if isinstance(value, (list, tuple)) and not value:
        kind = AttributeProto.INTS
        if node.domain in ("", "ai.onnx") and defs.has(node.op_type):
            declared = defs.get_schema(node.op_type).attributes.get(key)
            kind = declared.type if declared is not None else kind
        return helper.make_attribute(key, [], attr_type=kind)
    return helper.make_attribute(key, value)


def _initializer_proto(name: str, value) -> onnx.TensorProto:
    """An initializer's TensorProto; a PackedInt4's bytes are already ONNX's raw data."""
    from onnx import helper, numpy_helper

    if isinstance(value, PackedInt4):
        return helper.make_tensor(name, element_type(value.dtype), value.shape, value.packed.tobytes(), raw=True)
    return numpy_helper.from_array(np.asarray(value), name=name)


def _node_protos(graph: Graph) -> list:
    """The NodeProtos of a graph's nodes: ONNX inputs only (captured ones dropped), subgraphs as GraphProtos."""
    from onnx import helper

    nodes = []
    for node in graph.nodes:
        made = helper.make_node(node.op_type, onnx_inputs(node), node.outputs, name=node.name, domain=node.domain)
        made.attribute.extend(_attribute(node, key, value) for key, value in sorted(node.attrs.items()))
        nodes.append(made)
    return nodes


def _subgraph_proto(body: Graph):
    """A body's GraphProto: its inputs and outputs typed as far as they are known."""
    from onnx import helper

    inputs = [_value_info(n, body.value_types.get(n)) for n in body.inputs]
    outputs = [_value_info(n, body.value_types.get(n)) for n in body.outputs]
    return helper.make_graph(_node_protos(body), body.name, inputs, outputs,
                             [_initializer_proto(k, v) for k, v in body.initializers.items()])


def graph_to_proto(graph: Graph, extra_inputs: list[str] = (), producer: str = "odtrain") -> onnx.ModelProto:
    """Build a ModelProto; `extra_inputs` (e.g. parameters held in a checkpoint) become graph inputs."""
    from onnx import helper

    nodes = _node_protos(graph)
    inputs = [_value_info(n, graph.value_types.get(n)) for n in list(graph.inputs) + list(extra_inputs)]
    outputs = [_value_info(n, graph.value_types.get(n)) for n in graph.outputs]
    initializers = [_initializer_proto(k, v) for k, v in graph.initializers.items()]
    g = helper.make_graph(nodes, graph.name, inputs, outputs, initializers)
    opsets = dict(graph.opsets)
    if any(n.domain == ODTRAIN_DOMAIN for n in walk(graph)):  # bodies' gradient ops too
        opsets[ODTRAIN_DOMAIN] = ODTRAIN_OPSET
    opset_imports = [helper.make_opsetid(d, v) for d, v in opsets.items()]
    ir_version = helper.find_min_ir_version_for(opset_imports, ignore_unknown=True)
    return helper.make_model(g, opset_imports=opset_imports, producer_name=producer, ir_version=ir_version)


def _attribute_of(key: str, value) -> AttributeData:
    """An attribute's AttributeData, its type from its Python value (an empty list: ints)."""
    if isinstance(value, np.ndarray):
        return AttributeData(key, AttributeType.TENSOR, tensor_data("", value))
    if isinstance(value, Graph):
        return AttributeData(key, AttributeType.GRAPH, _body_data(value))
    if isinstance(value, (bool, int, np.integer)):
        return AttributeData(key, AttributeType.INT, int(value))
    if isinstance(value, (float, np.floating)):
        return AttributeData(key, AttributeType.FLOAT, float(value))
    if isinstance(value, (str, bytes)):
        return AttributeData(key, AttributeType.STRING, value)
    values = list(value)
    if values and all(isinstance(v, (str, bytes)) for v in values):
        return AttributeData(key, AttributeType.STRINGS, values)
    if any(isinstance(v, (float, np.floating)) for v in values):
        return AttributeData(key, AttributeType.FLOATS, [float(v) for v in values])
    return AttributeData(key, AttributeType.INTS, [int(v) for v in values])


def _value_info_of(name: str, t: TensorType | None) -> ValueInfoData:
    if t is None:
        return ValueInfoData(name)
    return ValueInfoData(name, element_type(t.dtype), None if t.shape is None else tuple(t.shape))


def _nodes_data(graph: Graph) -> list[NodeData]:
    return [NodeData(n.op_type, onnx_inputs(n), list(n.outputs), n.name, n.domain,
                     [_attribute_of(k, v) for k, v in sorted(n.attrs.items())]) for n in graph.nodes]


def _body_data(body: Graph) -> GraphData:
    """A subgraph's GraphData, with every value type it knows."""
    named = set(body.inputs) | set(body.outputs) | set(body.initializers)
    return GraphData(body.name, _nodes_data(body), [tensor_data(k, v) for k, v in body.initializers.items()],
                     [_value_info_of(n, body.value_types.get(n)) for n in body.inputs],
                     [_value_info_of(n, body.value_types.get(n)) for n in body.outputs],
                     [_value_info_of(n, t) for n, t in body.value_types.items() if n not in named and t is not None])


def graph_data(graph: Graph, extra_inputs: list[str] = ()) -> ModelData:
    """The ModelData of `graph` (what graph_to_proto builds, without onnx), with every known value type as
    value_info, so that loading it runs no inference."""
    nodes = _nodes_data(graph)
    inputs = [_value_info_of(n, graph.value_types.get(n)) for n in list(graph.inputs) + list(extra_inputs)]
    outputs = [_value_info_of(n, graph.value_types.get(n)) for n in graph.outputs]
    named = set(graph.inputs) | set(extra_inputs) | set(graph.outputs) | set(graph.initializers)
    value_info = [_value_info_of(n, t) for n, t in graph.value_types.items() if n not in named and t is not None]
    initializers = [tensor_data(k, v) for k, v in graph.initializers.items()]
    opsets = dict(graph.opsets)
    if any(n.domain == ODTRAIN_DOMAIN for n in walk(graph)):  # bodies' gradient ops too
        opsets[ODTRAIN_DOMAIN] = ODTRAIN_OPSET
    return ModelData(minimum_ir_version(opsets.items()), list(opsets.items()),
                     GraphData(graph.name, nodes, initializers, inputs, outputs, value_info))


def save_graph(graph: Graph, path, extra_inputs: list[str] = ()) -> None:
    """Write `graph` with ONNX's inferred value types inside, so that loading it runs no inference.
    Where onnx is not loaded (a device that trains), the file is encoded by onnx_wire with the value types
    odtrain knows instead of importing onnx for it. Otherwise initializers of LIGHT_BYTES or more never enter
    protobuf: ONNX infers on the model with them as typed inputs, that model is written without them, and
    each is appended from its array as one more `graph` field holding one initializer (protobuf merges a
    message field seen twice, appending repeated ones)."""
    graph = at_blocked_opset(graph)  # 4-bit weights are opset 21's
    held = {k: v if hasattr(v, "nbytes") and hasattr(v, "dtype") else np.asarray(v)  # arrays, or values
            for k, v in graph.initializers.items()}  # computed when read (graph/frozen.py Dequantized)
    large = [k for k, v in held.items() if v.nbytes >= LIGHT_BYTES and (v.dtype.kind in "biuf" or
                                                                          is_storage_dtype(v.dtype))]
    if "onnx" not in sys.modules:
        data = graph_data(dataclasses.replace(graph, initializers={k: v for k, v in graph.initializers.items()
                                                                   if k not in large}), extra_inputs)
        data.metadata[SHAPES_INFERRED] = "odtrain"
        _write_appending(path, encode_model(data), graph, large)
        return
    import onnx

    light = dataclasses.replace(graph, inputs=list(graph.inputs) + large,
                                initializers={k: v for k, v in graph.initializers.items() if k not in large})
    proto = _with_inferred_shapes(graph_to_proto(light, extra_inputs))
    kept = [i for i in proto.graph.input if i.name not in set(large)]
    del proto.graph.input[:]
    proto.graph.input.extend(kept)
    proto.metadata_props.add(key=SHAPES_INFERRED, value=onnx.__version__)
    _write_appending(path, proto.SerializeToString(), graph, large)


# protobuf refuses a message of 2 GiB or more: a model whose weights would make it so keeps them beside it
PROTOBUF_LIMIT = 2 ** 31 - 2 ** 20  # less a margin for the fields' own bytes
EXTERNAL_ALIGNMENT = 4096  # each external tensor starts on a page, so that a reader can map it


def _write_appending(path, model: bytes, graph: Graph, large: list[str]) -> None:
    """Write a model's bytes, then each initializer of `large` from its array as one more `graph` field; or,
    when those would pass protobuf's 2 GiB, as fields that point into `<model file>.data` beside it (ONNX's
    external data), written there one after another."""
    path = os.fspath(path)
    external = len(model) + sum(int(graph.initializers[n].nbytes) for n in large) >= PROTOBUF_LIMIT
    location = os.path.basename(path) + ".data"
    data = open(os.path.join(os.path.dirname(path), location), "wb") if external else None
    try:
        with open(path, "wb") as f:
            f.write(model)
            for name in large:
                value = graph.initializers[name]
                array = value.packed if isinstance(value, PackedInt4) else np.ascontiguousarray(value)  # ONNX's
                if data is None:  # packing for 4 bits
                    f.write(initializer_field(name, element_type(value.dtype), value.shape, array.nbytes))
                    f.write(array.reshape(-1).view(np.uint8))
                    continue
                data.write(b"\0" * (-data.tell() % EXTERNAL_ALIGNMENT))
                f.write(external_initializer_field(name, element_type(value.dtype), value.shape, location, data.tell(),
                                                   array.nbytes))
                data.write(array.reshape(-1).view(np.uint8))
    finally:
        if data is not None:
            data.close()


def _with_inferred_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    import onnx.shape_inference

    try:
        return onnx.shape_inference.infer_shapes(proto)
    except Exception:
        return proto  # types stay partly unknown; they are computed when shapes are bound
