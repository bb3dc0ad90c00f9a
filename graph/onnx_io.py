"""ONNX import and export: the only place where protobufs meet the IR.

Loading runs ONNX shape inference first so that gradient rules can ask for
ranks; values whose types stay unknown are typed when shapes are bound.
Models odtrain saves carry those inferred types and a metadata mark, so the
training phase loads them without running the inference again.
Export stamps the lowest IR version the opsets allow, so older runtimes
load what odtrain writes.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import ArtifactNotFoundError, ModelError
from .ir import DEFAULT_DOMAIN, ODTRAIN_DOMAIN, Graph, Node, TensorType

ODTRAIN_OPSET = 1
# Metadata key of models odtrain wrote with ONNX's inferred types inside: loading them skips the
# inference, which would give the same types and costs ~8 MiB (ONNX's op-schema registry) and time.
SHAPES_INFERRED = "odtrain.shapes_inferred"
MIN_DEFAULT_OPSET = 9


def _type_from_proto(type_proto) -> TensorType | None:
    if not type_proto.HasField("tensor_type"):
        return None
    tensor = type_proto.tensor_type
    if tensor.elem_type == 0:
        return None
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type))
    if not tensor.HasField("shape"):
        return TensorType(dtype, None)
    dims = []
    for i, dim in enumerate(tensor.shape.dim):
        if dim.HasField("dim_value"):
            dims.append(int(dim.dim_value))
        else:
            dims.append(dim.dim_param or f"unk_{id(tensor)}_{i}")
    return TensorType(dtype, tuple(dims))


def _attr_value(attr):
    value = helper.get_attribute_value(attr)
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8") for v in value]
    if isinstance(value, (onnx.GraphProto, list)) and value and isinstance(value[0] if isinstance(value, list) else value, onnx.GraphProto):
        raise ModelError(f"attribute '{attr.name}' holds a subgraph; control flow (If, Loop, Scan) is not supported")
    return value


def _external_tensors(proto: onnx.ModelProto):
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor
    for node in proto.graph.node:
        for attr in node.attribute:
            if attr.HasField("t") and attr.t.data_location == onnx.TensorProto.EXTERNAL:
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


def read_model_proto(model, what: str = "model") -> tuple[onnx.ModelProto, str | None]:
    """A ModelProto from a ModelProto or a path, with clear errors for missing or unreadable files."""
    if isinstance(model, onnx.ModelProto):
        return model, None
    path = os.fspath(model)
    if not os.path.isfile(path):
        raise ArtifactNotFoundError(f"{what} file '{path}' does not exist")
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as error:  # protobuf DecodeError and the like
        raise ModelError(f"{what} file '{path}' is not a readable ONNX model ({type(error).__name__}: {error})") from None
    folder = os.path.dirname(os.path.abspath(path))
    check_external_data(proto, folder, path)
    try:
        onnx.load_external_data_for_model(proto, folder)
    except Exception as error:
        raise ModelError(f"{what} file '{path}': its external data cannot be read ({error})") from None
    return proto, path


def graph_from_proto(proto: onnx.ModelProto, source: str = "model") -> Graph:
    """Convert a ModelProto into the IR, after ONNX shape inference."""
    opsets = {(DEFAULT_DOMAIN if o.domain == "ai.onnx" else o.domain): int(o.version) for o in proto.opset_import}
    if opsets.get(DEFAULT_DOMAIN, MIN_DEFAULT_OPSET) < MIN_DEFAULT_OPSET:
        raise ModelError(f"{source}: opset {opsets[DEFAULT_DOMAIN]} is older than {MIN_DEFAULT_OPSET}; "
                         "re-export it with a newer opset (torch.onnx.export(..., opset_version=17))")
    newest = onnx.defs.onnx_opset_version()
    if opsets.get(DEFAULT_DOMAIN, 0) > newest:
        raise ModelError(f"{source}: opset {opsets[DEFAULT_DOMAIN]} is newer than the newest this installation "
                         f"knows ({newest}); re-export with opset {newest} or older, or upgrade the onnx package")
    foreign = sorted(d for d in opsets if d not in (DEFAULT_DOMAIN, ODTRAIN_DOMAIN, "ai.onnx.ml", "ai.onnx.preview.training"))
    used = {n.domain for n in proto.graph.node}
    if any(d in used for d in foreign):
        raise ModelError(f"{source}: it uses ops of the domains {[d for d in foreign if d in used]}, which odtrain "
                         "does not implement; export the model with standard ONNX ops only")
    if not any(p.key == SHAPES_INFERRED for p in proto.metadata_props):
        proto = _with_inferred_shapes(proto)
    g = proto.graph
    initializers = {}
    for tensor in g.initializer:
        try:
            initializers[tensor.name] = numpy_helper.to_array(tensor)
        except Exception as error:
            raise ModelError(f"{source}: initializer '{tensor.name}' cannot be read: {error}") from None
    value_types: dict[str, TensorType] = {}
    for info in list(g.input) + list(g.output) + list(g.value_info):
        t = _type_from_proto(info.type)
        if t is not None:
            value_types[info.name] = t
    for name, array in initializers.items():
        value_types[name] = TensorType(array.dtype, tuple(array.shape))
    nodes = []
    for index, n in enumerate(g.node):
        try:
            attrs = {a.name: _attr_value(a) for a in n.attribute}
        except ModelError as error:
            raise ModelError(f"{source}: node '{n.name or index}' ({n.op_type}): {error}") from None
        nodes.append(Node(n.op_type, list(n.input), list(n.output), attrs, n.name or f"{n.op_type}_{index}", n.domain))
    _pin_legacy_softmax_axis(nodes, opsets.get(DEFAULT_DOMAIN, 0), value_types, source)
    inputs = [i.name for i in g.input if i.name not in initializers]
    return Graph(nodes, inputs, [o.name for o in g.output], initializers, value_types, opsets, g.name or "graph")


def _pin_legacy_softmax_axis(nodes, opset: int, value_types, source: str) -> None:
    """Before opset 13, Softmax/LogSoftmax flattened the input to 2-D at `axis` (default 1) and
    normalised over everything after it. Where that is the last axis alone, pin `axis=-1` (the
    meaning odtrain's kernels implement); otherwise refuse rather than compute something else."""
    if opset >= 13:
        return
    for node in nodes:
        if node.op_type not in ("Softmax", "LogSoftmax") or node.domain not in ("", "ai.onnx"):
            continue
        t = value_types.get(node.inputs[0])
        axis = int(node.attrs.get("axis", 1))
        rank = None if t is None or t.shape is None else len(t.shape)
        if rank is not None and axis % rank == rank - 1:
            node.attrs["axis"] = -1
        else:
            raise ModelError(f"{source}: {node.describe()} (opset {opset}) normalises over the axes from "
                             f"{axis} on, flattened{'' if rank else ', for an input of unknown rank'}; odtrain "
                             "implements opset 13's single-axis Softmax: re-export with opset 13 or newer")


def load_graph(model, what: str = "model") -> Graph:
    proto, path = read_model_proto(model, what)
    return graph_from_proto(proto, path or what)


def _value_info(name: str, t: TensorType | None):
    if t is None:
        return helper.make_empty_tensor_value_info(name)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))
    return helper.make_tensor_value_info(name, elem, None if t.shape is None else list(t.shape))


def graph_to_proto(graph: Graph, extra_inputs: list[str] = (), producer: str = "odtrain") -> onnx.ModelProto:
    """Build a ModelProto; `extra_inputs` (e.g. parameters held in a checkpoint) become graph inputs."""
    nodes = []
    for node in graph.nodes:
        attrs = {k: (numpy_helper.from_array(np.asarray(v)) if isinstance(v, np.ndarray) else v)
                 for k, v in node.attrs.items()}
        nodes.append(helper.make_node(node.op_type, node.inputs, node.outputs, name=node.name, domain=node.domain, **attrs))
    inputs = [_value_info(n, graph.value_types.get(n)) for n in list(graph.inputs) + list(extra_inputs)]
    outputs = [_value_info(n, graph.value_types.get(n)) for n in graph.outputs]
    initializers = [numpy_helper.from_array(np.asarray(v), name=k) for k, v in graph.initializers.items()]
    g = helper.make_graph(nodes, graph.name, inputs, outputs, initializers)
    opsets = dict(graph.opsets)
    if any(n.domain == ODTRAIN_DOMAIN for n in graph.nodes):
        opsets[ODTRAIN_DOMAIN] = ODTRAIN_OPSET
    opset_imports = [helper.make_opsetid(d, v) for d, v in opsets.items()]
    ir_version = helper.find_min_ir_version_for(opset_imports, ignore_unknown=True)
    return helper.make_model(g, opset_imports=opset_imports, producer_name=producer, ir_version=ir_version)


def save_graph(graph: Graph, path, extra_inputs: list[str] = ()) -> None:
    """Write `graph` with ONNX's inferred value types inside, so that loading it runs no inference."""
    proto = _with_inferred_shapes(graph_to_proto(graph, extra_inputs))
    proto.metadata_props.add(key=SHAPES_INFERRED, value=onnx.__version__)
    onnx.save(proto, os.fspath(path))


def _with_inferred_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(proto)
    except Exception:
        return proto  # types stay partly unknown; they are computed when shapes are bound
