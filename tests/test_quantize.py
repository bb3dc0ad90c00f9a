"""Quantized models: the quantization ops against ONNX's reference and onnxruntime, the models
onnxruntime's quantizer makes against onnxruntime, and refusals of what odtrain does not run.

Oracles: the ONNX backend node cases and `onnx.reference.ReferenceEvaluator` compute the integer
arithmetic exactly; onnxruntime runs the same graphs. Where onnxruntime's own kernels are not exact
on this CPU (uint8 x int8 products on AVX2 without VNNI saturate 16-bit pair sums: its
MatMulInteger and fused QLinearConv), the comparison is with its unoptimised graph or with models
it computes exactly (reduce_range, uint8 weights), and says so.
"""
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.backend.test.loader import load_model_tests
from onnx.reference import ReferenceEvaluator

import quantized_models
from quantized_models import feature_step, head_gradients, onnxruntime_outputs, with_output
from conftest import DATA
from odtrain import OdtrainError
from odtrain.graph.errors import ModelError
from odtrain.inference import InferenceSession
from oracles import make_model

QUANTIZE_CASES = re.compile(r"test_(quantizelinear|dequantizelinear|qlinear|matmulinteger|convinteger|"
                            r"dynamicquantizelinear)")
# Types odtrain does not quantize to (float8, float4, 4- and 2-bit integers), float16 scales, and the expanded
# forms (ops outside this family).
DECLINED = re.compile(r"^test_quantizelinear_.*(e4m3fn|e5m2|int4|uint4|int2|uint2|float4e2m1)|float16|"
                      r"^test_(de)?quantizelinear_.*_expanded")


def _reference(model, feeds):
    """ONNX's reference evaluator; it implements QuantizeLinear and DequantizeLinear from opset 19 on, which
    compute the same for the attributes older opsets have."""
    if model.opset_import[0].version < 19:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        model.opset_import[0].version = 19
    return ReferenceEvaluator(model).run(None, feeds)


def _node_cases():
    return [pytest.param(case, id=case.name) for case in load_model_tests(kind="node")
            if QUANTIZE_CASES.match(case.name) and case.data_sets]


@pytest.mark.parametrize("case", _node_cases())
def test_backend_node_case(case):
    inputs, outputs = case.data_sets[0]
    arrays = [numpy_helper.to_array(t) if isinstance(t, TensorProto) else np.asarray(t) for t in inputs]
    expected = [numpy_helper.to_array(t) if isinstance(t, TensorProto) else np.asarray(t) for t in outputs]
    feeds = dict(zip([i.name for i in case.model.graph.input], arrays))
    if DECLINED.search(case.name):
        with pytest.raises(OdtrainError):
            InferenceSession(case.model).run(None, feeds)
        return
    got = InferenceSession(case.model).run(None, feeds)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        if e.dtype.kind == "f":
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=0)
        else:
            np.testing.assert_array_equal(g, e)  # integer results are exact


# ---- QuantizeLinear and DequantizeLinear at each opset, against the reference and onnxruntime ---------


def _on_ties(shape, scale, seed):
    """Values on and near half steps of `scale` (round half to even decides them), and far outside the range."""
    rng = np.random.default_rng(seed)
    steps = rng.integers(-300, 300, size=shape) + rng.choice([0.0, 0.5, -0.5, 0.25], size=shape)
    return (steps * scale).astype(np.float32)


Q_FORMS = [  # (opset, quantized dtype, per-axis, attributes)
    (10, np.uint8, False, {}), (10, np.int8, False, {}),
    (13, np.uint8, True, {"axis": 1}), (13, np.int8, True, {"axis": -1}),
    (19, np.int8, False, {"saturate": 1}), (19, np.uint8, True, {"axis": 0}),
    (21, np.int8, True, {"axis": 1}), (21, np.uint16, False, {}), (21, np.int16, True, {"axis": 2}),
]


@pytest.mark.parametrize("opset, dtype, per_axis, attrs", Q_FORMS)
def test_quantize_dequantize_forms(opset, dtype, per_axis, attrs):
    shape = (2, 3, 4)
    axis = attrs.get("axis", 1) % 3
    count = shape[axis] if per_axis else 1
    scale = np.linspace(0.02, 0.07, count).astype(np.float32).reshape((count,) if per_axis else ())
    info = np.iinfo(dtype)
    zero = np.linspace(info.min // 4 + (info.max - info.min) // 2 if info.min == 0 else -3, info.max // 3,
                       count).astype(dtype).reshape(scale.shape)
    x = _on_ties(shape, float(scale.reshape(-1)[0]), opset)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], **attrs),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], **{k: v for k, v in attrs.items()
                                                                          if k != "saturate"})]
    model = make_model(nodes, {"s": scale, "z": zero}, [("x", np.float32, shape)], ["q", "y"], opset=opset)
    got = InferenceSession(model).run(None, {"x": x})
    expected = _reference(model, {"x": x})
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    if dtype in (np.uint8, np.int8):  # onnxruntime's CPU kernels take 8-bit zero points here
        runtime = onnxruntime_outputs(model, {"x": x})
        np.testing.assert_array_equal(got[0], runtime[0])
        np.testing.assert_array_equal(got[1], runtime[1])


def test_quantize_without_zero_point_gives_uint8_or_output_dtype():
    x = _on_ties((5, 4), 0.1, 1)
    scale = np.float32(0.1)
    plain = make_model([helper.make_node("QuantizeLinear", ["x", "s"], ["y"])], {"s": scale}, [("x", np.float32, (5, 4))])
    typed = make_model([helper.make_node("QuantizeLinear", ["x", "s"], ["y"], output_dtype=TensorProto.INT8)],
                       {"s": scale}, [("x", np.float32, (5, 4))], opset=21)
    for model, dtype in ((plain, np.uint8), (typed, np.int8)):
        got = InferenceSession(model).run(None, {"x": x})[0]
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, _reference(model, {"x": x})[0])


def test_blocked_quantization_with_a_partial_last_block():
    x = _on_ties((3, 10), 0.05, 2)
    scale = np.array([[0.05, 0.1, 0.2]] * 3, np.float32)  # blocks of 4 along axis 1: 4 + 4 + 2
    zero = np.array([[1, -2, 3]] * 3, np.int8)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=1, block_size=4),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=1, block_size=4)]
    model = make_model(nodes, {"s": scale, "z": zero}, [("x", np.float32, (3, 10))], ["q", "y"], opset=21)
    got, expected = InferenceSession(model).run(None, {"x": x}), ReferenceEvaluator(model).run(None, {"x": x})
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


def test_int32_bias_dequantizes_exactly():
    bias = np.array([-2**20 - 7, 0, 123456, 2**22 + 1], np.int32)
    model = make_model([helper.make_node("DequantizeLinear", ["b", "s"], ["y"])], {"s": np.float32(0.001)},
                       [("b", np.int32, (4,))])
    got = InferenceSession(model).run(None, {"b": bias})[0]
    np.testing.assert_array_equal(got, onnxruntime_outputs(model, {"b": bias})[0])


# ---- integer products ----------------------------------------------------------------------------------------


def _random(dtype, shape, seed):
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(info.min, info.max + 1, size=shape).astype(dtype)


def _centred(values, zero, axis):
    """values - zero in int64, the zero point per tensor or per index of `axis`."""
    zero = np.asarray(zero, np.int64)
    if zero.size > 1:
        zero = zero.reshape([-1 if a == axis % values.ndim else 1 for a in range(values.ndim)])
    return values.astype(np.int64) - zero


def _requantized(acc, multiplier, zero, dtype):
    """ONNX's requantization, in float64 (the reference's): clamp(rint(acc · multiplier) + zero)."""
    info = np.iinfo(dtype)
    return np.clip(np.rint(acc * multiplier.astype(np.float64)) + int(zero), info.min, info.max).astype(dtype)


@pytest.mark.parametrize("a_type, b_type", [(np.uint8, np.int8), (np.int8, np.int8), (np.uint8, np.uint8)])
@pytest.mark.parametrize("zero_points", ["scalar", "per row and column", "none"])
def test_matmul_integer(a_type, b_type, zero_points):
    a, b = _random(a_type, (2, 5, 300), 1), _random(b_type, (300, 7), 2)  # sums over 300 products
    inputs, initializers = ["a", "b"], {"b": b}
    za, zb = 0, 0
    if zero_points != "none":
        per = zero_points != "scalar"
        za = initializers["za"] = _random(a_type, (5,) if per else (), 3)
        zb = initializers["zb"] = _random(b_type, (7,) if per else (), 4)
        inputs += ["za", "zb"]
    model = make_model([helper.make_node("MatMulInteger", inputs, ["y"])], initializers, [("a", a_type, a.shape)])
    got = InferenceSession(model).run(None, {"a": a})[0]
    assert got.dtype == np.int32
    # per row of A and per column of B, as ONNX specifies (the reference evaluator broadcasts a 1-D zero point
    # of A along its last axis instead): the oracle is integer numpy
    np.testing.assert_array_equal(got, np.matmul(_centred(a, za, 1), _centred(b, zb, 1)))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("per_row_and_column", [False, True])
def test_qlinear_matmul(dtype, per_row_and_column):
    a, b = _random(dtype, (3, 4, 64), 5), _random(dtype, (64, 6), 6)
    rows, columns = ((4,), (6,)) if per_row_and_column else ((), ())
    scales = {"sa": (0.02 * np.linspace(1, 2, 4 if rows else 1)).astype(np.float32).reshape(rows),
              "sb": np.full(columns, 0.01, np.float32), "sy": np.float32(0.9)}
    zeros = {"za": _random(dtype, rows, 7), "zb": _random(dtype, columns, 8), "zy": _random(dtype, (), 9)}
    model = make_model([helper.make_node("QLinearMatMul", ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"], ["y"])],
                       {**scales, **zeros, "b": b}, [("a", dtype, a.shape)], opset=21)
    got = InferenceSession(model).run(None, {"a": a})[0]
    acc = np.matmul(_centred(a, zeros["za"], 1), _centred(b, zeros["zb"], 1))
    multiplier = (scales["sa"].reshape(-1, 1) if rows else scales["sa"]) * scales["sb"] / scales["sy"]
    assert got.dtype == dtype
    # the oracle requantizes in float64, odtrain (as onnxruntime) in float32: a tie may land one step apart
    assert np.abs(got.astype(int) - _requantized(acc, multiplier, zeros["zy"], dtype).astype(int)).max() <= 1
    if not per_row_and_column:
        np.testing.assert_array_equal(got, onnxruntime_outputs(model, {"a": a})[0])


CONV_FORMS = [  # (x shape, w shape, attributes)
    ((2, 3, 9, 9), (4, 3, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ((2, 6, 8, 8), (6, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 6}),  # depthwise
    ((1, 4, 6, 6), (8, 2, 1, 1), {"group": 2}),
    ((2, 3, 11), (5, 3, 4), {"dilations": [2], "pads": [0, 3]}),
]


def _integer_conv(x, w, attrs):
    """The exact convolution of integer tensors (float64 reference Conv of exactly representable values)."""
    model = make_model([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], {"w": w.astype(np.float64)},
                       [("x", np.float64, x.shape)])
    return ReferenceEvaluator(model).run(None, {"x": x.astype(np.float64)})[0].astype(np.int64)


@pytest.mark.parametrize("x_shape, w_shape, attrs", CONV_FORMS)
def test_conv_integer(x_shape, w_shape, attrs):
    x, w = _random(np.uint8, x_shape, 10), _random(np.uint8, w_shape, 11)
    zeros = {"zx": np.uint8(128), "zw": _random(np.uint8, (w_shape[0],), 12)}  # the weight's: one per output channel
    model = make_model([helper.make_node("ConvInteger", ["x", "w", "zx", "zw"], ["y"], **attrs)], {"w": w, **zeros},
                       [("x", np.uint8, x_shape)])
    got = InferenceSession(model).run(None, {"x": x})[0]
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, _integer_conv(_centred(x, 128, 1), _centred(w, zeros["zw"], 0), attrs))


@pytest.mark.parametrize("x_shape, w_shape, attrs", CONV_FORMS)
def test_qlinear_conv_per_channel(x_shape, w_shape, attrs):
    # inputs below 128: onnxruntime's AVX2 uint8 x int8 products then never saturate, and it is exact
    x, w = np.random.default_rng(13).integers(0, 128, size=x_shape).astype(np.uint8), _random(np.int8, w_shape, 14)
    bias = np.random.default_rng(15).integers(-5000, 5000, size=w_shape[0]).astype(np.int32)
    initializers = {"sx": np.float32(0.02), "zx": np.uint8(60), "w": w,
                    "sw": np.linspace(0.001, 0.004, w_shape[0]).astype(np.float32), "zw": np.zeros(w_shape[0], np.int8),
                    "sy": np.float32(0.3), "zy": np.uint8(100), "b": bias}
    model = make_model([helper.make_node("QLinearConv", ["x", "sx", "zx", "w", "sw", "zw", "sy", "zy", "b"], ["y"],
                                         **attrs)], initializers, [("x", np.uint8, x_shape)])
    got = InferenceSession(model).run(None, {"x": x})[0]
    assert got.dtype == np.uint8
    acc = _integer_conv(_centred(x, 60, 1), w, attrs) + bias.reshape([-1] + [1] * (len(x_shape) - 2))
    multiplier = (initializers["sx"] * initializers["sw"] / initializers["sy"]).reshape([-1] + [1] * (len(x_shape) - 2))
    assert np.abs(got.astype(int) - _requantized(acc, multiplier, 100, np.uint8).astype(int)).max() <= 1
    np.testing.assert_array_equal(got, onnxruntime_outputs(model, {"x": x})[0])


def test_dynamic_quantize_linear_against_onnxruntime():
    x = np.random.default_rng(16).normal(size=(4, 33)).astype(np.float32)
    model = make_model([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])], {},
                       [("x", np.float32, x.shape)], ["y", "s", "z"])
    for g, e in zip(InferenceSession(model).run(None, {"x": x}), onnxruntime_outputs(model, {"x": x})):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_array_equal(g, e)


# ---- refusals -------------------------------------------------------------------------------------------------


def test_ops_of_other_domains_are_refused_by_node():
    nodes = [helper.make_node("QLinearAdd", ["a", "s", "z", "a", "s", "z", "s", "z"], ["b"], name="add1",
                              domain="com.microsoft"),
             helper.make_node("QLinearGlobalAveragePool", ["b", "s", "z", "s", "z"], ["y"], name="pool1",
                              domain="com.microsoft")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 2, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, None)],
                              [numpy_helper.from_array(np.float32(0.1), "s"), numpy_helper.from_array(np.uint8(3), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(ModelError) as error:
        InferenceSession(model)
    for text in ("QLinearAdd node 'add1' of domain 'com.microsoft'",
                 "QLinearGlobalAveragePool node 'pool1' of domain 'com.microsoft'"):
        assert text in str(error.value)


def test_float8_quantization_is_refused_naming_the_node():
    node = helper.make_node("QuantizeLinear", ["x", "s"], ["y"], name="to_fp8", output_dtype=TensorProto.FLOAT8E4M3FN)
    model = make_model([node], {"s": np.float32(1.0)}, [("x", np.float32, (2,))], opset=21)
    with pytest.raises(ModelError, match="FLOAT8E4M3FN"):
        InferenceSession(model).run(None, {"x": np.zeros(2, np.float32)})


# ---- models from onnxruntime's quantizer ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def quantized(tmp_path_factory):
    """Paths of the quantized reference models, made once per session by onnxruntime's quantizer."""
    folder = tmp_path_factory.mktemp("quantized_models")
    made = {}

    def get(name):
        if name not in made:
            path = folder / f"{name}.onnx"
            made[name] = {"qdq": lambda: quantized_models.qdq_mobilenetv2(path),
                          "qdq_inference": lambda: quantized_models.qdq_mobilenetv2(path, inference_form=True),
                          "dynamic_mlp": lambda: quantized_models.dynamic_mlp(path)}[name]()
        return made[name]

    return get


def test_qdq_mobilenetv2_inference_form_agrees_with_onnxruntime(quantized):
    """Running statistics (the model an application ships): on the four golden batches every pooled feature
    is within one quantization step of onnxruntime's, the logits within one step on every feature of the
    head, and the top-1 is onnxruntime's."""
    model = with_output(quantized("qdq_inference"), quantized_models.FEATURES)
    session = InferenceSession(model)
    step = feature_step(model)
    head = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "classifier.weight"))
    for x in quantized_models.golden_batches():
        logits, features = session.run(None, {"input": x})
        expected_logits, expected_features = onnxruntime_outputs(model, {"input": x})
        # measured: 4% of the features one step apart (rounding ties after differently ordered sums and
        # onnxruntime's fused integer kernels), none further; logits within 2e-4 of a range of 0.02
        assert np.abs(features - expected_features).max() <= 1.01 * step
        assert np.abs(logits - expected_logits).max() <= 1.01 * step * np.abs(head).sum(axis=1).max()
        np.testing.assert_array_equal(logits.argmax(1), expected_logits.argmax(1))


def test_qdq_mobilenetv2_with_batch_statistics_differs_from_onnxruntime_as_onnxruntime_does(quantized):
    """As quantized from the training export: BatchNormalization normalises with the batch's statistics,
    which turns a one-step rounding difference early on into many steps later. odtrain's logits differ
    from onnxruntime's by no more than onnxruntime's own two graphs (optimised or not) differ from each
    other (measured: at most 1.09 times as much; 30 of 32 top-1 equal, the two others with margins below
    0.01 in logits that differ by 0.07 between onnxruntime's graphs)."""
    path = quantized("qdq")
    session = InferenceSession(path)
    for x in quantized_models.golden_batches():
        logits = session.run(None, {"input": x})[0]
        optimized = onnxruntime_outputs(path, {"input": x})[0]
        literal = onnxruntime_outputs(path, {"input": x}, optimized=False)[0]
        assert np.abs(logits - optimized).max() <= 1.5 * np.abs(literal - optimized).max()


def test_dynamically_quantized_mlp(quantized, tmp_path):
    x = np.load(DATA / "mlp" / "golden.npz")["x"][0].astype(np.float32)
    path = quantized("dynamic_mlp")
    got = InferenceSession(path).run(None, {"input": x})[0]
    # onnxruntime's uint8 x int8 MatMulInteger saturates on this CPU (AVX2): the reference is the oracle here
    np.testing.assert_array_equal(got, ReferenceEvaluator(onnx.load(path)).run(None, {"input": x})[0])
    from onnxruntime.quantization import quantize_dynamic

    exact = tmp_path / "mlp_reduce_range.onnx"  # 7-bit weights: onnxruntime's products stay exact
    quantize_dynamic(str(DATA / "mlp" / "forward.onnx"), str(exact), reduce_range=True)
    np.testing.assert_array_equal(InferenceSession(str(exact)).run(None, {"input": x})[0],
                                  onnxruntime_outputs(exact, {"input": x})[0])


# ---- gradients: the straight-through estimator -------------------------------------------------------------


def _clipped_identity_nodes(value, output, low, high):
    """Max(Min(value, high), low): the function whose derivative the straight-through estimator uses."""
    return [helper.make_node("Min", [value, high], [f"{output}_min"]),
            helper.make_node("Max", [f"{output}_min", low], [output])]


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
@pytest.mark.parametrize("per_axis", [False, True])
@pytest.mark.parametrize("where", ["weight", "activation"])
def test_straight_through_estimator(dtype, per_axis, where, tmp_path):
    """d/dv of DequantizeLinear(QuantizeLinear(v)) is 1 where (qmin - z)·s <= v <= (qmax - z)·s and 0 where v
    was clipped: finite differences of the clipped identity Max(Min(v, hi), lo) give the same gradient."""
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module
    from oracles import numeric_gradient

    rng = np.random.default_rng(17)
    info = np.iinfo(dtype)
    scale = np.array([0.01, 0.02, 0.015], np.float32) if per_axis else np.float32(0.02)
    zero = np.array([3, -5, 0] if dtype == np.int8 else [128, 100, 140], dtype) if per_axis else dtype(7 if dtype == np.int8 else 120)
    shape = (3, 4)
    low = ((info.min - zero.astype(np.float64)) * scale).reshape(-1, 1) if per_axis else (info.min - float(zero)) * float(scale)
    high = ((info.max - zero.astype(np.float64)) * scale).reshape(-1, 1) if per_axis else (info.max - float(zero)) * float(scale)
    # half of the values inside the range, half beyond an end by at least a step
    inside = rng.uniform(0.1, 0.9, shape) * (high - low) + low
    outside = np.where(rng.random(shape) < 0.5, low - rng.uniform(0.05, 0.5, shape), high + rng.uniform(0.05, 0.5, shape))
    value = np.where(rng.random(shape) < 0.5, inside, outside).astype(np.float32)
    weights = rng.standard_normal(shape).astype(np.float32)
    if where == "weight":
        params, constants, quantized = {"w": value}, {}, "w"
        before = []
    else:  # v = x · w with x fixed: the gradient reaches w through the quantized activation
        x = np.eye(3, dtype=np.float32) * 2.0
        params, constants, quantized = {"w": (value / 2.0).astype(np.float32)}, {"x": x}, "v"
        before = [helper.make_node("MatMul", ["x", "w"], ["v"])]
    after = [helper.make_node("Mul", ["d", "r"], ["m"]), helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    quantize = [helper.make_node("QuantizeLinear", [quantized, "s", "z"], ["q"], axis=0),
                helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], axis=0)]
    model = make_model(before + quantize + after, {**params, **constants, "s": scale, "z": zero, "r": weights},
                       outputs=[("loss", np.float32, [])], opset=13)
    artifacts.generate_artifacts(model, requires_grad=["w"], loss=None, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    training = onnx.load(tmp_path / "training_model.onnx")
    assert "FakeQuantize" in {n.op_type for n in training.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in onnx.load(tmp_path / "eval_model.onnx").graph.node}
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    loss = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")()
    # float32 sums of 12 terms: within a few ulps of the sum of their magnitudes
    np.testing.assert_allclose(loss, _reference(model, {})[0], rtol=0,
                               atol=1e-6 * np.abs(weights).sum() * np.abs(value).max())

    clipped = make_model(before + _clipped_identity_nodes(quantized, "d", "lo", "hi") + after,
                         {**{k: v.astype(np.float64) for k, v in {**params, **constants}.items()},
                          "lo": np.asarray(low, np.float64), "hi": np.asarray(high, np.float64),
                          "r": weights.astype(np.float64)}, outputs=["loss"])

    def loss64(values):
        return float(ReferenceEvaluator(_replaced(clipped, values)).run(None, {})[0])

    numeric = numeric_gradient(loss64, {"w": params["w"].astype(np.float64)}, "w")
    assert np.count_nonzero(numeric) not in (0, numeric.size)  # both kinds of element are there
    np.testing.assert_allclose(state.parameters["w"].grad, numeric, rtol=1e-5, atol=1e-7)


def _replaced(model, values):
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for tensor in model.graph.initializer:
        if tensor.name in values:
            tensor.CopyFrom(numpy_helper.from_array(values[tensor.name], name=tensor.name))
    return model


# ---- int8 frozen backbones: personalising the QDQ MobileNetV2's float head ---------------------------------


def _personalised(quantized, name, directory):
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module

    path = quantized(name)
    trainable, frozen = quantized_models.personalize_parameters(path)
    artifacts.generate_artifacts(path, requires_grad=trainable, frozen_params=frozen,
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=directory)
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    return path, state, Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")


def test_personalising_a_quantized_backbone(quantized, tmp_path):
    """Step-0 head gradients on the int8 backbone equal those from onnxruntime's features; the frozen
    weights stay int8 in the checkpoint (with scales and zero points) and in memory."""
    import safetensors.numpy

    import odtrain.memory

    path, state, module = _personalised(quantized, "qdq_inference", tmp_path)
    golden = np.load(DATA / "mobilenetv2_personalize" / "golden.npz")
    x, y = golden["x"][0].astype(np.float32), golden["y"][0]
    module(x, y)

    model = with_output(path, quantized_models.FEATURES)
    features = onnxruntime_outputs(model, {"input": x})[1]
    own = InferenceSession(model).run(None, {"input": x})[1]  # the training step's features (FakeQuantize)
    # measured: 4% of the features one step apart (rounding ties after differently ordered sums), none further
    assert np.abs(own - features).max() <= 1.01 * feature_step(model)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    head = weights["classifier.weight"], weights["classifier.bias"]
    expected, from_own = head_gradients(features, *head, y), head_gradients(own, *head, y)
    for got, want, own_want in zip((state.parameters[n].grad for n in ("classifier.weight", "classifier.bias")),
                                   expected, from_own):
        # equal but for what those one-step differences change, and float32 sums (1e-5 of the largest)
        allowed = np.abs(own_want - want) + 1e-5 * np.abs(want).max()
        assert (np.abs(got - want) <= allowed).all()

    stored = safetensors.numpy.load_file(str(tmp_path / "checkpoint"))
    quantized_weights = [t.name for t in model.graph.initializer if t.name.endswith("_quantized")]
    for name in quantized_weights:
        assert stored[f"param/{name}"].dtype == weights[name].dtype  # int8 weights, int32 biases
        np.testing.assert_array_equal(state.parameters[name].data, weights[name])
        node = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == name)
        assert all(f"param/{companion}" in stored for companion in node.input[1:])  # its scale and zero point

    report = odtrain.memory.report(module)
    frozen_bytes = sum(weights[n].nbytes for n in state.parameters if not state.parameters[n].requires_grad)
    assert report.frozen_parameter_bytes == frozen_bytes  # int8 weights counted at one byte
    float_frozen = sum(_float_frozen_bytes())
    assert 0.2 < frozen_bytes / float_frozen < 0.3  # measured 0.267: int8 weights, float BN statistics


def _float_frozen_bytes():
    import json

    meta = json.loads((DATA / "mobilenetv2_personalize" / "meta.json").read_text())
    model = onnx.load(str(DATA / "mobilenetv2_personalize" / "forward.onnx"))
    frozen = set(meta["frozen_params"])
    return [numpy_helper.to_array(t).nbytes for t in model.graph.initializer if t.name in frozen]


def test_personalising_with_batch_statistics_matches_odtrains_inference(quantized, tmp_path):
    """The quantized training export (BatchNormalization on batch statistics): the training step's head
    gradients are those of the features odtrain's InferenceSession computes (onnxruntime's differ by many
    steps: rounding differences amplified by the batch statistics, as between its own optimisation levels)."""
    path, state, module = _personalised(quantized, "qdq", tmp_path)
    golden = np.load(DATA / "mobilenetv2_personalize" / "golden.npz")
    x, y = golden["x"][0].astype(np.float32), golden["y"][0]
    module(x, y)
    model = with_output(path, quantized_models.FEATURES)
    features = InferenceSession(model).run(None, {"input": x})[1]
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    grad_w, grad_b = head_gradients(features, weights["classifier.weight"], weights["classifier.bias"], y)
    np.testing.assert_allclose(state.parameters["classifier.weight"].grad, grad_w, rtol=1e-4,
                               atol=1e-5 * np.abs(grad_w).max())
    np.testing.assert_allclose(state.parameters["classifier.bias"].grad, grad_b, rtol=1e-4, atol=1e-7)


# ---- quantization-aware training -----------------------------------------------------------------------


def _fake_quantized(values, scale, zero, qmin, qmax):
    """(clamp(rint(v / s) + z) - z) · s, in float32 as ONNX's QuantizeLinear → DequantizeLinear."""
    values, scale = np.asarray(values, np.float32), np.asarray(scale, np.float32)
    return ((np.clip(np.rint(values / scale) + zero, qmin, qmax) - zero) * scale).astype(np.float32)


def _symmetric(weight):
    """A weight fake-quantized as QAT does: int8, symmetric, one scale per row (output channel)."""
    from odtrain.graph.qat import symmetric_weight

    values, scale = symmetric_weight(weight.astype(np.float32), 0)
    return values.astype(np.float64) * scale.astype(np.float64)[:, None]


def test_qat_gradients_are_straight_through(tmp_path):
    """A 6-5-3 MLP with fake quantization: its gradients at a second batch, whose hidden values partly
    exceed the range the first batch set, equal finite differences of the same network in float64 with
    each fake quantization replaced by the clipped identity plus a constant (its rounding at that point)."""
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module
    from odtrain.graph.qat import range_parameters
    from oracles import numeric_gradient

    rng = np.random.default_rng(21)
    params = {"w1": rng.uniform(-1, 1, (5, 6)).astype(np.float32), "b1": rng.uniform(-0.5, 0.5, 5).astype(np.float32),
              "w2": rng.uniform(-1, 1, (3, 5)).astype(np.float32), "b2": rng.uniform(-0.5, 0.5, 3).astype(np.float32)}
    r = rng.standard_normal((4, 3)).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("Gemm", ["a", "w2", "b2"], ["y"], transB=1),
             helper.make_node("Mul", ["y", "r"], ["m"]), helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    model = make_model(nodes, {**params, "r": r}, [("x", np.float32, (4, 6))], [("loss", np.float32, [])])
    artifacts.generate_artifacts(model, requires_grad=list(params), loss=None, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path, qat=artifacts.QatConfig())
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    module(rng.uniform(-1, 1, (4, 6)).astype(np.float32))  # sets the ranges
    module.lazy_reset_grad()
    x = rng.uniform(-3, 3, (4, 6)).astype(np.float32)  # a wider batch: some values beyond the ranges
    module(x)
    ranges = {name: state.parameters[name].data for name in state.parameters if name.endswith("_qat_range")}
    assert set(ranges) == {"x_qat_range", "a_qat_range"}

    def quantized_input(values, name):
        scale, zero = range_parameters(ranges[name], 0, 255)
        low, high = (0 - zero) * float(scale), (255 - zero) * float(scale)
        return _fake_quantized(values, scale, zero, 0, 255), low, high

    def forward(p, offsets=None):
        """float64 forward; with `offsets`, each fake quantization is clip(v) + its offset there."""
        xq, _, _ = quantized_input(x, "x_qat_range")
        if offsets is None:
            w1q, w2q = (_symmetric(p[n]) for n in ("w1", "w2"))
            a = np.maximum(xq.astype(np.float64) @ w1q.T + p["b1"], 0)
            aq, low_a, high_a = quantized_input(a.astype(np.float32), "a_qat_range")
            return {"w1": w1q - p["w1"], "w2": w2q - p["w2"], "a": aq - np.clip(a, low_a, high_a),
                    "bounds": (low_a, high_a), "hidden": a}
        a = np.maximum(xq.astype(np.float64) @ (p["w1"] + offsets["w1"]).T + p["b1"], 0)
        aq = np.clip(a, *offsets["bounds"]) + offsets["a"]
        return float(np.sum(r * (aq @ (p["w2"] + offsets["w2"]).T + p["b2"])))

    params64 = {k: v.astype(np.float64) for k, v in params.items()}
    offsets = forward(params64)
    assert (offsets["hidden"] > offsets["bounds"][1]).any()  # the mask has zeros
    for name in params:
        numeric = numeric_gradient(lambda values: forward(values, offsets), params64, name)
        np.testing.assert_allclose(state.parameters[name].grad, numeric, rtol=1e-4,
                                   atol=1e-5 * max(np.abs(numeric).max(), 1), err_msg=name)


def test_qat_digits_classifier_exports_an_int8_model_onnxruntime_runs(tmp_path):
    """The demo classifier trained with and without fake quantization (same data, seed and epochs): the
    exported QDQ model has int8 weights, onnxruntime runs it, and its held-out accuracy is within 3 points
    of the float model's."""
    from odtrain import artifacts
    from odtrain.api import CheckpointState

    accuracy = {}
    for name, qat in (("float", None), ("qat", artifacts.QatConfig())):
        folder = tmp_path / name
        test_x, test_y, logits = quantized_models.train_digits(folder, qat)
        exported = onnx.load(folder / "inference.onnx")
        runtime = onnxruntime_outputs(exported, {"input": test_x})[0]
        accuracy[name] = float((runtime.argmax(1) == test_y).mean())
        if qat is None:
            continue
        ranges = CheckpointState.load_checkpoint(folder / "checkpoint").parameters
        assert all(ranges[n].data[1] > 0 for n in ("input_qat_range", "hidden_relu_qat_range"))  # tracked, saved
        assert {n.domain for n in exported.graph.node} <= {""}
        assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in exported.graph.node}
        weights = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
        assert weights["fc1.weight_quantized"].dtype == np.int8 and weights["fc2.weight_quantized"].dtype == np.int8
        assert not {"fc1.weight", "fc2.weight"} & set(weights)  # no float copy of the weights
        # onnxruntime's graph as written computes odtrain's eval numbers but for the int32 biases' rounding; its
        # fused integer kernels (u8 x s8 on AVX2) may not, hence accuracy, not logits, against the float model
        literal = onnxruntime_outputs(exported, {"input": test_x}, optimized=False)[0]
        assert (np.abs(literal - logits) <= _last_product_bound(exported) + 1e-5 * np.abs(logits).max()).all()
    assert accuracy["qat"] >= accuracy["float"] - 0.03, accuracy  # measured 95.5% against 95.3%


def _last_product_bound(model) -> np.ndarray:
    """How far a QDQ model's outputs may move when each value entering its last Gemm moves by one quantization
    step and the Gemm's int32 bias by half of its own: s_x · Σ_k |w_jk| + s_b / 2, per output."""
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producer = {output: node for node in model.graph.node for output in node.output}
    gemm = [node for node in model.graph.node if node.op_type == "Gemm"][-1]
    x, weight, bias = (producer[name] for name in gemm.input)
    weight_values = initializers[weight.input[0]].astype(np.float64) * initializers[weight.input[1]][:, None]
    return initializers[x.input[1]] * np.abs(weight_values).sum(axis=1) + initializers[bias.input[1]] / 2


def test_qat_export_quantizes_biases_to_int32(tmp_path):
    """A Conv → Relu → Gemm network trained with QAT: the export reads each bias as int32 through
    DequantizeLinear with scale input_scale × weight_scale (per channel) and zero point 0, as onnxruntime's
    quantizer writes it. onnxruntime runs it; its outputs are the fake-quantized eval model's but for one
    quantization step of the values entering the Gemm (the Conv bias's rounding, at most half of a step far
    smaller than theirs, may move one across a rounding boundary) and half a step of the Gemm's bias."""
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module, Optimizer

    rng = np.random.default_rng(31)
    params = {"conv.weight": rng.normal(0, 0.3, (3, 2, 3, 3)).astype(np.float32),
              "conv.bias": rng.normal(0, 0.2, 3).astype(np.float32),
              "fc.weight": rng.normal(0, 0.1, (5, 108)).astype(np.float32),
              "fc.bias": rng.normal(0, 0.2, 5).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["input", "conv.weight", "conv.bias"], ["conv"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["conv"], ["relu"]), helper.make_node("Flatten", ["relu"], ["flat"]),
             helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["output"], transB=1)]
    model = make_model(nodes, params, [("input", np.float32, ("batch", 2, 6, 6))],
                       [("output", np.float32, ("batch", 5))])
    artifacts.generate_artifacts(model, requires_grad=list(params), loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path,
                                 additional_output_names=["output"], qat=artifacts.QatConfig())
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    x = rng.normal(0, 1, (64, 2, 6, 6)).astype(np.float32)
    y = rng.integers(0, 5, 64)
    for start in range(0, 64, 16):
        module(x[start:start + 16], y[start:start + 16])
        optimizer.step()
        module.lazy_reset_grad()
    module.eval()
    _, logits = module(x, y)
    module.export_model_for_inferencing(tmp_path / "inference.onnx", ["output"])
    exported = onnx.load(tmp_path / "inference.onnx")

    initializers = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    producer = {output: node for node in exported.graph.node for output in node.output}
    steps = {}
    for product in (n for n in exported.graph.node if n.op_type in ("Conv", "Gemm")):
        x_dq, weight_dq, bias_dq = (producer[name] for name in product.input)
        assert bias_dq.op_type == "DequantizeLinear" and helper.get_attribute_value(bias_dq.attribute[0]) == 0
        values, scale, zero = (initializers[name] for name in bias_dq.input)
        assert values.dtype == np.int32 and zero.dtype == np.int32 and not zero.any()
        input_scale, weight_scale = initializers[x_dq.input[1]], initializers[weight_dq.input[1]]
        np.testing.assert_array_equal(scale, input_scale * weight_scale)  # float32, as onnxruntime's quantizer
        bias = state.parameters[{"Conv": "conv.bias", "Gemm": "fc.bias"}[product.op_type]].data
        np.testing.assert_array_equal(values, np.rint(bias / scale))
        steps[product.op_type] = input_scale, scale
    # the Conv bias's rounding moves a Gemm input by far less than a step
    assert steps["Conv"][1].max() / 2 < steps["Gemm"][0] / 10
    assert not {"conv.bias", "fc.bias"} & set(initializers)  # no float copy of the biases

    literal = onnxruntime_outputs(exported, {"input": x}, optimized=False)[0]
    assert onnxruntime_outputs(exported, {"input": x})[0].shape == literal.shape  # and its optimised session runs it
    np.testing.assert_allclose(InferenceSession(exported).run(None, {"input": x})[0], literal, rtol=1e-5, atol=1e-6)
    assert (np.abs(literal - logits) <= _last_product_bound(exported) + 1e-5 * np.abs(logits).max()).all()


def test_prepare_with_qat_from_the_command_line(tmp_path, capsys):
    from conftest import odtrain_main
    from odtrain.datasets import load_digits, train_test_split
    from odtrain.demo import build_classifier

    images, labels = load_digits()
    train_x, test_x, train_y, test_y = train_test_split(images, labels, test_fraction=0.2, seed=0)
    np.savez(tmp_path / "train.npz", input=train_x, labels=train_y)
    onnx.save(build_classifier()[0], tmp_path / "digits.onnx")
    artifacts = tmp_path / "artifacts"
    code, out, err = odtrain_main(capsys, "prepare", tmp_path / "digits.onnx", "-o", artifacts, "--qat", "--lr", "0.01")
    assert code == 0, err
    assert "quantization-aware training: int8 weights per channel, uint8 activations" in out
    code, _, err = odtrain_main(capsys, "train", artifacts, "--data", tmp_path / "train.npz", "--epochs", "3")
    assert code == 0, err
    code, _, err = odtrain_main(capsys, "export", artifacts, "-o", tmp_path / "digits-int8.onnx")
    assert code == 0, err
    exported = onnx.load(tmp_path / "digits-int8.onnx")
    assert {t.name for t in exported.graph.initializer if t.data_type == TensorProto.INT8} >= {
        "fc1.weight_quantized", "fc2.weight_quantized"}
    predictions = onnxruntime_outputs(exported, {"input": test_x})[0].argmax(1)
    assert (predictions == test_y).mean() > 0.8  # 3 epochs


# The straight-through gradients of the fake-quantization ops, each against finite differences of the clipped
# identity in the test named (tests/test_registry.py reads this table).
GRADIENT_ORACLES = {"FakeQuantize": test_straight_through_estimator,
                    "FakeQuantizeWeight": test_qat_gradients_are_straight_through,
                    "FakeQuantizeRange": test_qat_gradients_are_straight_through}
