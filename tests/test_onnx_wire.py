"""The wire reader against onnx itself: every model decodes as onnx reads it, damaged files are
refused by name, and training from saved artifacts never imports onnx."""
import dataclasses
import json
import os
import struct
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper

from odtrain import artifacts
from odtrain.graph import onnx_io, onnx_wire
from odtrain.graph.errors import ModelError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
MODELS = sorted(n for n in os.listdir(DATA) if os.path.isfile(os.path.join(DATA, n, "forward.onnx")))
ARTIFACTS = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx")
# TensorProto element types whose values odtrain decodes: float, int and bool (not strings, complex,
# bfloat16 or the float8/int4 families, which numpy does not hold natively).
DECODED_TYPES = {1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13}


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """Paths of the reference forward models and of the artifacts odtrain generates from each."""
    paths = []
    for name in MODELS:
        forward = os.path.join(DATA, name, "forward.onnx")
        with open(os.path.join(DATA, name, "meta.json")) as f:
            meta = json.load(f)
        directory = tmp_path_factory.mktemp(name)
        artifacts.generate_artifacts(forward, requires_grad=meta["requires_grad"], frozen_params=meta["frozen_params"],
                                     loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                     artifact_directory=directory)
        paths += [forward] + [str(directory / a) for a in ARTIFACTS]
    return paths


@pytest.fixture(scope="module")
def node_test_models():
    """(name, serialized model) of every ONNX backend node test."""
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators of some cases overflow on purpose
        cases = load_model_tests(kind="node")
    return [(case.name, case.model.SerializeToString()) for case in cases]


def plain(value):
    """Values of the IR and of onnx_wire as nested tuples that == compares exactly: arrays by dtype,
    shape and bytes, floats by their bits (NaN equals itself), protobuf messages by their encoding."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, np.dtype):
        return ("dtype", value.str)
    if isinstance(value, float):
        return ("float", struct.pack("<d", value))
    if isinstance(value, (list, tuple)):
        return tuple(plain(v) for v in value)
    if isinstance(value, dict):
        return ("dict",) + tuple((k, plain(v)) for k, v in value.items())
    if dataclasses.is_dataclass(value):
        return (type(value).__name__,) + tuple((f.name, plain(getattr(value, f.name))) for f in dataclasses.fields(value))
    if hasattr(value, "SerializeToString"):
        return value.SerializeToString()
    return value


def outcome(build):
    """The graph a loader builds, or the error it raises."""
    try:
        return plain(build())
    except Exception as error:
        return (type(error).__name__, str(error))


def proto_tensors(proto):
    yield from proto.graph.initializer
    for node in proto.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            elif attr.type == onnx.AttributeProto.TENSORS:
                yield from attr.tensors


def wire_tensors(model):
    yield from model.graph.initializers
    for node in model.graph.nodes:
        for attr in node.attributes:
            if attr.type == onnx_wire.AttributeType.TENSOR:
                yield attr.value
            elif attr.type == onnx_wire.AttributeType.TENSORS:
                yield from attr.value


def marked(proto):
    """A copy carrying the mark of models odtrain saved, so that onnx's path runs no shape inference."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    if not any(p.key == onnx_io.SHAPES_INFERRED for p in copy.metadata_props):
        copy.metadata_props.add(key=onnx_io.SHAPES_INFERRED, value=onnx.__version__)
    return copy


def mismatches(data: bytes, source: str) -> list[str]:
    """Where the wire reader reads `data` otherwise than onnx: its data, its tensors, the graph."""
    proto = onnx.ModelProto.FromString(data)
    wire = onnx_wire.parse_model(data, source)
    found = []
    if plain(wire) != plain(onnx_io.model_from_proto(proto)):
        found.append(f"{source}: the model's fields differ")
    for tensor, read in zip(proto_tensors(proto), wire_tensors(wire), strict=True):
        try:
            expected = numpy_helper.to_array(tensor)
        except Exception:
            expected = None
        if expected is not None and tensor.data_type in DECODED_TYPES:
            if outcome(read.to_array) != plain(expected):
                found.append(f"{source}: tensor '{tensor.name}' decodes otherwise than numpy_helper.to_array")
        elif outcome(read.to_array)[0] != "ModelError":
            found.append(f"{source}: tensor '{tensor.name}' of type {tensor.data_type} is not refused")
    if outcome(lambda: onnx_io.graph_from_model(wire, source)) != outcome(
            lambda: onnx_io.graph_from_proto(marked(proto), source)):
        found.append(f"{source}: the graph differs")
    return found


def test_saved_models_and_their_artifacts_read_as_onnx_reads_them(saved_models):
    found = []
    for path in saved_models:
        with open(path, "rb") as f:
            found += mismatches(f.read(), path)
    assert found == []


def test_artifacts_load_without_onnx_into_the_graph_the_onnx_path_builds(saved_models, monkeypatch):
    artifact_paths = [p for p in saved_models if os.path.basename(p) in ARTIFACTS]
    expected = [plain(onnx_io.graph_from_proto(onnx.load(path), path)) for path in artifact_paths]

    def through_onnx(*args, **kwargs):
        raise AssertionError("an artifact odtrain saved was read through onnx")

    monkeypatch.setattr(onnx_io, "read_model_proto", through_onnx)
    assert [plain(onnx_io.load_graph(path)) for path in artifact_paths] == expected


def test_every_onnx_backend_node_test_model_reads_as_onnx_reads_it(node_test_models):
    found = []
    for name, data in node_test_models:
        found += mismatches(data, name)
    assert found == []
    assert len(node_test_models) > 1000


def test_values_are_decoded_packed_or_not_and_from_every_typed_field():
    arrays = {"f32": np.array([1.5, -0.0, np.inf], np.float32), "f64": np.array([[2.25, -1e300]], np.float64),
              "f16": np.array([0.5, -2.0], np.float16), "i8": np.array([-128, 127], np.int8),
              "u8": np.array([0, 255], np.uint8), "i16": np.array([-32768, 7], np.int16),
              "u16": np.array([65535, 1], np.uint16), "i32": np.array([-(2 ** 31), 5], np.int32),
              "i64": np.array([-(2 ** 63), 2 ** 62], np.int64), "u32": np.array([2 ** 32 - 1], np.uint32),
              "u64": np.array([2 ** 64 - 1, 3], np.uint64), "b": np.array([True, False, True])}
    typed = [helper.make_tensor(f"{name}_typed", helper.np_dtype_to_tensor_dtype(a.dtype), a.shape, a.ravel().tolist())
             for name, a in arrays.items()]
    raw = [numpy_helper.from_array(a, f"{name}_raw") for name, a in arrays.items()]
    nodes = [helper.make_node("Constant", [], ["c"], value_floats=[0.25, -3.0]),
             helper.make_node("Constant", [], ["d"], value_ints=[-1, 2 ** 40])]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [2]),
                                               helper.make_tensor_value_info("d", onnx.TensorProto.INT64, [2])],
                              typed + raw)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    data = model.SerializeToString()
    assert mismatches(data, "packed") == []
    read = {t.name: t.to_array() for t in onnx_wire.parse_model(data).graph.initializers}
    for name, a in arrays.items():
        for kind in ("typed", "raw"):
            assert plain(read[f"{name}_{kind}"]) == plain(a), (name, kind)
    unpacked = _unpacked(model)
    assert onnx.ModelProto.FromString(unpacked) == model and unpacked != data
    assert mismatches(unpacked, "unpacked") == []


def _unpacked(model) -> bytes:
    """`model` encoded by hand with every repeated number in a field of its own (protobuf packs them)."""
    graph = bytearray()
    for node in model.graph.node:
        body = b"".join(_field(2, o.encode()) for o in node.output) + _field(4, node.op_type.encode())
        for attr in node.attribute:
            encoded = _field(1, attr.name.encode()) + _tag(20, 0) + _varint(attr.type)
            encoded += b"".join(_tag(7, 5) + struct.pack("<f", v) for v in attr.floats)
            encoded += b"".join(_tag(8, 0) + _varint(v) for v in attr.ints)
            body += _field(5, encoded)
        graph += _field(1, body)
    graph += _field(2, model.graph.name.encode())
    for tensor in model.graph.initializer:
        body = b"".join(_tag(1, 0) + _varint(d) for d in tensor.dims) + _tag(2, 0) + _varint(tensor.data_type)
        body += b"".join(_tag(4, 5) + struct.pack("<f", v) for v in tensor.float_data)
        body += b"".join(_tag(5, 0) + _varint(v) for v in tensor.int32_data)
        body += b"".join(_tag(7, 0) + _varint(v) for v in tensor.int64_data)
        body += _field(8, tensor.name.encode())
        body += _field(9, tensor.raw_data) if tensor.HasField("raw_data") else b""
        body += b"".join(_tag(10, 1) + struct.pack("<d", v) for v in tensor.double_data)
        body += b"".join(_tag(11, 0) + _varint(v) for v in tensor.uint64_data)
        graph += _field(5, body)
    for info in model.graph.output:
        graph += _field(12, info.SerializeToString())
    opsets = b"".join(_field(8, o.SerializeToString()) for o in model.opset_import)
    return _tag(1, 0) + _varint(model.ir_version) + _field(7, bytes(graph)) + opsets


def _tag(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


_varint = onnx_wire._varint_bytes  # the writer's varints (checked against onnx's serialisation below)


def _field(number: int, payload: bytes) -> bytes:
    return _tag(number, 2) + _varint(len(payload)) + payload


def test_unknown_fields_groups_and_repeated_singular_messages_read_as_protobuf_reads_them():
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                                [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 3])],
                                                [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)]),
                              opset_imports=[helper.make_opsetid("", 17)])
    data = model.SerializeToString()
    extra = (_tag(999, 0) + _varint(-5) + _tag(1000, 1) + b"\0" * 8 + _tag(1001, 5) + b"\0" * 4
             + _field(1002, b"anything") + _tag(1003, 3) + _tag(1, 0) + _varint(1) + _tag(1004, 3)
             + _tag(1004, 4) + _tag(1003, 4))
    second_graph = _field(7, _field(2, b"renamed") + _field(1, helper.make_node("Neg", ["y"], ["z"]).SerializeToString()))
    for variant in (extra + data, data + extra, data + second_graph):
        assert mismatches(variant, "variant") == []
    assert onnx_wire.parse_model(data + second_graph).graph.name == "renamed"


def source_named(source: str):
    return pytest.raises(ModelError, match=f"'{source}' is not a readable ONNX model")


@pytest.mark.parametrize("data, reason", [
    (_tag(1, 0) + b"\xff" * 20, "longer than 10 bytes"),
    (_tag(1, 0) + b"\xff\xff", "runs past the end"),
    (_tag(7, 2) + _varint(16) + b"\x00" * 3, "runs past the end"),
    (_tag(7, 2) + _varint(2 ** 63) + b"\x00", "runs past the end"),
    (b"\x00\x01", "field number 0"),
    (_tag(3, 7), "wire type 7"),
    (_tag(3, 3) + _tag(1, 0) + b"\x01", "a number runs past the end"),
    (_tag(3, 3) + _tag(4, 4), "closes where another is open"),
    (_tag(3, 4), "never opened"),
    (_field(7, _field(5, _tag(4, 2) + _varint(3) + b"\x00\x00\x00")), "packed run of 4-byte numbers"),
    (_field(14, _field(1, b"\xff\xfe")), "not UTF-8"),
    (_field(7, _field(1, _field(9, b"fc1.weight"))), "wire type 6"),  # a node's metadata entry, as onnx reads it
    (_field(7, _field(16, b"fc1.weight")), "wire type 6"),  # the graph's
    (_field(7, _field(11, _field(3, b"fc1.weight"))), "wire type 6"),  # an input's
], ids=["varint-never-ends", "varint-truncated", "length-beyond-end", "huge-length", "field-0", "wire-type-7",
        "unclosed-group", "mismatched-group", "unopened-group", "packed-floats", "bad-utf8", "node-metadata",
        "graph-metadata", "input-metadata"])
def test_malformed_files_are_refused_naming_the_file(tmp_path, data, reason):
    path = str(tmp_path / "damaged.onnx")
    with open(path, "wb") as f:
        f.write(data)
    with source_named(path) as refused:
        onnx_io.load_graph(path)
    assert reason in str(refused.value)


def test_truncated_and_random_files_are_refused_by_name_unless_protobuf_reads_them(saved_models):
    rng = np.random.default_rng(0)
    samples = []
    for path in saved_models:
        if path.endswith(("mlp/forward.onnx", "training_model.onnx")):
            with open(path, "rb") as f:
                data = f.read()
            ends = set(range(min(len(data), 200))) | set(rng.integers(0, len(data), 150).tolist())
            samples += [data[:end] for end in sorted(ends)]
            flipped = bytearray(data)
            for at in rng.integers(0, len(data), 40).tolist():
                flipped[at] ^= 0xFF
                samples.append(bytes(flipped))
    samples += [rng.bytes(int(n)) for n in rng.integers(1, 300, 200)]
    read_alike = refused = 0
    for data in samples:
        try:
            proto = onnx.ModelProto.FromString(data)
        except DecodeError:
            proto = None
        try:
            wire = onnx_wire.parse_model(data, "model file 'sample.onnx'")
        except ModelError as error:
            assert "model file 'sample.onnx' is not a readable ONNX model" in str(error)
            assert proto is None or "not UTF-8" in str(error), str(error)  # protobuf lets bad text through
            refused += 1
            continue
        assert proto is not None, data[:80]
        assert plain(wire) == plain(onnx_io.model_from_proto(proto))
        read_alike += 1
    assert refused > 100 and read_alike > 5


def test_a_damaged_initializer_is_refused_naming_the_file_and_the_tensor(tmp_path):
    short = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[4], raw_data=b"\0" * 12)
    bf16 = helper.make_tensor("h", onnx.TensorProto.BFLOAT16, [1], [1.0])
    for tensor, reason in ((short, "values do not fill its dims [4]"), (bf16, "element type BFLOAT16")):
        graph = helper.make_graph([helper.make_node("Identity", [tensor.name], ["y"])], "g", [],
                                  [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])], [tensor])
        model = marked(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
        path = str(tmp_path / "model.onnx")
        onnx.save(model, path)
        with pytest.raises(ModelError, match=f"{path}: initializer '{tensor.name}' cannot be read") as refused:
            onnx_io.load_graph(path)
        assert reason in str(refused.value)


PROBE = r"""
import json, sys
import numpy as np
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.graph.errors import ModelError
from odtrain.graph.onnx_io import load_graph

folder, data, damaged = sys.argv[1:4]
golden = np.load(data + "/golden.npz")
x = golden["x"][0].astype(json.load(open(data + "/meta.json"))["input_dtype"])
state = CheckpointState.load_checkpoint(folder + "/checkpoint")
module = Module(folder + "/training_model.onnx", state, folder + "/eval_model.onnx")
optimizer = Optimizer(folder + "/optimizer_model.onnx", module)
module.train()
loss = float(np.asarray(module(x, golden["y"][0])[0]))
optimizer.step()
module.lazy_reset_grad()
module.eval()
after = float(np.asarray(module(x, golden["y"][0])[0]))
try:
    load_graph(damaged)
    refusal = ""
except ModelError as error:
    refusal = str(error)
print(json.dumps({"onnx": sorted(m for m in sys.modules if m == "onnx" or m.startswith("onnx.")),
                  "losses": [loss, after], "refusal": refusal}))
"""


def test_training_from_saved_artifacts_never_imports_onnx(mlp_artifacts, tmp_path):
    damaged = str(tmp_path / "damaged.onnx")
    with open(mlp_artifacts / "training_model.onnx", "rb") as f:
        data = f.read()
    with open(damaged, "wb") as f:
        f.write(data[:len(data) // 2])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", PROBE, str(mlp_artifacts), os.path.join(DATA, "mlp"), damaged],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["onnx"] == []
    assert np.all(np.isfinite(result["losses"])) and result["losses"][1] < result["losses"][0]
    assert f"'{damaged}' is not a readable ONNX model" in result["refusal"]


def test_a_model_written_without_onnx_reads_back_as_onnx_writes_it():
    """encode_model (save_graph where onnx is not loaded) against onnx's own serialisation of the same graph."""
    from odtrain.graph.ir import Graph, Node, TensorType
    from odtrain.graph.onnx_io import graph_data, graph_to_proto
    from odtrain.graph.onnx_wire import encode_model

    weight = np.arange(6, dtype=np.float32).reshape(2, 3)
    graph = Graph([Node("Gemm", ["x", "w"], ["y"], {"alpha": 0.5, "transB": 1}, name="gemm"),
                   Node("Pad", ["y", "pads"], ["z"], {"mode": "reflect"}, name="pad"),
                   Node("Shrink", ["z"], ["s"], {"lambd": -1.5, "bias": 2.0}, name="shrink"),
                   Node("Resize", ["s"], ["r"], {"axes": [0, -1], "scales_like": [1.0, 2.5], "names": ["a", "b"],
                                                 "value": np.array([3], dtype=np.int64)}, name="resize")],
                  ["x"], ["r"], {"w": weight, "pads": np.array([0, 1, 0, 1], dtype=np.int64)},
                  {"x": TensorType(np.dtype(np.float32), ("batch", 3)), "y": TensorType(np.dtype(np.float32), ("batch", 2)),
                   "r": TensorType(np.dtype(np.float32), None)}, {"": 17}, "written")
    ours = onnx.load_from_string(encode_model(graph_data(graph)))
    theirs = graph_to_proto(graph)
    assert ours.ir_version == theirs.ir_version
    assert [(o.domain, o.version) for o in ours.opset_import] == [(o.domain, o.version) for o in theirs.opset_import]
    for mine, made in zip(ours.graph.node, theirs.graph.node):
        assert (mine.op_type, list(mine.input), list(mine.output), mine.name) == \
            (made.op_type, list(made.input), list(made.output), made.name)
        assert {a.name: onnx.helper.get_attribute_value(a) for a in mine.attribute}.keys() == \
            {a.name: onnx.helper.get_attribute_value(a) for a in made.attribute}.keys()
        for a, b in zip(mine.attribute, made.attribute):
            left, right = onnx.helper.get_attribute_value(a), onnx.helper.get_attribute_value(b)
            if a.type == onnx.AttributeProto.TENSOR:
                left, right = onnx.numpy_helper.to_array(left), onnx.numpy_helper.to_array(right)
            assert a.type == b.type and np.array_equal(left, right), a.name
    for mine, made in zip(ours.graph.initializer, theirs.graph.initializer):
        assert np.array_equal(onnx.numpy_helper.to_array(mine), onnx.numpy_helper.to_array(made))
    assert list(ours.graph.input) == list(theirs.graph.input)
    assert list(ours.graph.output) == list(theirs.graph.output)
    assert [v.name for v in ours.graph.value_info] == ["y"]  # the known intermediate type


def external_copy(source: str, folder) -> str:
    """`source` saved into `folder` with every tensor, Constant attributes included, in one `.onnx.data`."""
    model = onnx.load(source)
    path = os.path.join(folder, "model.onnx")
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data",
              size_threshold=0, convert_attribute=True)
    return path


def test_external_data_is_mapped_and_reads_as_onnx_reads_it(mlp_reference, tmp_path):
    import mmap

    forward = str(mlp_reference[0])
    path = external_copy(forward, tmp_path)
    graph, read_from = onnx_io.read_graph(path)
    expected = onnx_io.graph_from_proto(onnx.load(forward), forward)
    assert read_from == path and list(graph.initializers) == list(expected.initializers)
    for name, array in graph.initializers.items():
        np.testing.assert_array_equal(array, expected.initializers[name])
        assert array.dtype == expected.initializers[name].dtype
    largest = max(graph.initializers.values(), key=lambda a: a.nbytes)
    base = largest
    while not isinstance(base, mmap.mmap):
        base = base.base
    assert plain(graph) == plain(expected)


@pytest.mark.parametrize("entry, value, reason", [
    ("length", "5", "need 48 bytes; its external data gives 5"),
    ("offset", "1000000", "at offset 1000000 of"),
    ("offset", "ten", "not a number"),
])
def test_external_data_outside_its_file_is_refused(tmp_path, entry, value, reason):
    tensor = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    fields = {"location": "w.bin", "offset": "0", "length": "48", entry: value}
    for key, text in fields.items():
        tensor.external_data.add(key=key, value=text)
    (tmp_path / "w.bin").write_bytes(np.ones(12, np.float32).tobytes())
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, ["batch", 4])],
                              [helper.make_empty_tensor_value_info("y")], [tensor])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    with pytest.raises(ModelError, match=f"initializer 'w' cannot be read: .*{reason}"):
        onnx_io.read_graph(str(path))


def test_external_tensors_of_mixed_element_sizes_read_whole_and_aligned(tmp_path):
    """One `.data` file of an int8, an int64, a float16 and a float32 tensor back to back: offsets 0, 4, 20 and 26;
    the int64's a multiple of 4, not of 8, the float32's a multiple of 2, not of 4. Each reads as written, aligned
    for its element type (the kernels, and a kernel library's signatures, take aligned arrays)."""
    values = {"i8": np.array([-3, 7, 127, 0], np.int8), "i64": np.array([2 ** 40 + 3, -5], np.int64),
              "f16": np.linspace(-1, 1, 3).astype(np.float16), "f32": np.arange(6, dtype=np.float32).reshape(2, 3) / 7}
    blob, tensors = b"", []
    for name, array in values.items():
        tensor = numpy_helper.from_array(array, name)
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, text in (("location", "m.onnx.data"), ("offset", str(len(blob))), ("length", str(array.nbytes))):
            tensor.external_data.add(key=key, value=text)
        blob += array.astype(array.dtype.newbyteorder("<")).tobytes()
        tensors.append(tensor)
    assert [int(t.external_data[1].value) for t in tensors] == [0, 4, 20, 26]
    (tmp_path / "m.onnx.data").write_bytes(blob)
    nodes = [helper.make_node("Identity", [name], [f"{name}_out"]) for name in values]
    graph = helper.make_graph(nodes, "g", [], [helper.make_empty_tensor_value_info(f"{n}_out") for n in values],
                              tensors)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    read, _ = onnx_io.read_graph(str(path))
    for name, array in values.items():
        got = read.initializers[name]
        assert got.dtype == array.dtype and got.flags.aligned, (name, got.dtype, got.flags.aligned)
        np.testing.assert_array_equal(got, array, err_msg=name)


READ_PEAK = """
import sys
from odtrain.graph import onnx_io

def status(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]) * 1024

import onnx, onnx.shape_inference  # imported before the measurement starts
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
before = status('VmRSS:')
graph, _ = onnx_io.read_graph(sys.argv[1])
print(status('VmHWM:') - before, float(graph.initializers['w'].sum()))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures peak RSS through Linux's /proc")
def test_reading_a_model_with_external_data_holds_no_copy_of_it(tmp_path):
    """A 64 MB weight in `.onnx.data`: reading the model raises the peak RSS by far less than the weight
    (onnx's own loading, which odtrain used before, held it twice)."""
    weight = np.ones((4096, 4096), np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, ["batch", 4096])],
                              [helper.make_tensor_value_info("y", 1, ["batch", 4096])],
                              [numpy_helper.from_array(weight, "w")])
    path = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path,
              save_as_external_data=True, location="m.onnx.data")
    del graph
    run = subprocess.run([sys.executable, "-c", READ_PEAK, path], capture_output=True, text=True, check=True)
    rise, total = run.stdout.split()
    assert float(total) == weight.size and int(rise) < weight.nbytes // 4, (int(rise), weight.nbytes)


def test_artifacts_of_a_model_with_external_data_equal_those_of_the_inline_model(mlp_reference, tmp_path):
    from odtrain import checkpoint as checkpoint_file

    forward, meta, _ = mlp_reference
    contents = []
    for model, name in ((str(forward), "inline"), (external_copy(str(forward), tmp_path), "external")):
        artifacts.generate_artifacts(model, requires_grad=meta["requires_grad"], frozen_params=meta["frozen_params"],
                                     loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path / name)
        contents.append(checkpoint_file.load(tmp_path / name / "checkpoint"))
    inline, external = contents
    assert list(inline.parameters) == list(external.parameters) and inline.trainable == external.trainable
    for name, array in inline.parameters.items():
        np.testing.assert_array_equal(external.parameters[name], array)


def test_the_light_copy_keeps_everything_but_the_large_initializers_data(mlp_reference):
    model = onnx.load(str(mlp_reference[0]))
    light = onnx.load_from_string(onnx_wire.without_weights(model.SerializeToString()))
    assert light.graph.node == model.graph.node and light.graph.input == model.graph.input
    for kept, tensor in zip(light.graph.initializer, model.graph.initializer, strict=True):
        assert (kept.name, kept.dims, kept.data_type) == (tensor.name, tensor.dims, tensor.data_type)
        large = len(tensor.raw_data) >= onnx_wire.LIGHT_BYTES
        assert kept.raw_data == (b"" if large else tensor.raw_data)
    assert any(len(t.raw_data) >= onnx_wire.LIGHT_BYTES for t in model.graph.initializer)
