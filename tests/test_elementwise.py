"""Every unary op of the graph layer's table (graph/ops/elementwise.py, UNARY), and the float classes
(IsNaN, IsInf on NaN, both infinities, signed zeros, in float32 and float64): their constant fold and
their kernel agree with ONNX's reference evaluator. A row added to the table is checked here without more."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from odtrain import OdtrainError
from odtrain.graph.ops.elementwise import UNARY
from odtrain.inference import InferenceSession

X = np.random.default_rng(5).uniform(-3, 3, 1000).astype(np.float32)
INSIDE_ONE = X / 3.01
INPUTS = {"Not": X > 0, "Log": np.abs(X) + 0.1, "Sqrt": np.abs(X) + 0.1, "Asin": INSIDE_ONE, "Acos": INSIDE_ONE,
          "Atanh": INSIDE_ONE, "Acosh": np.abs(X) + 1, "Tan": X / 2.1,  # inside each op's domain
          "Round": np.round(X * 2) / 2 + np.float32(0.001) * (X > 0)}  # halves, and numbers near them
# Measured largest relative difference from the reference: 3.0e-7 (Erf's polynomial; libm's exp, log, tanh,
# sin, cos 1.2-2.4e-7), i.e. 2.5 float32 ulps; the bound is 4 ulps.
RTOL = 4 * np.finfo(np.float32).eps


@pytest.mark.parametrize("op", list(UNARY))
def test_fold_and_kernel_match_the_reference(op):
    x = INPUTS.get(op, X)
    value_type = helper.np_dtype_to_tensor_dtype(x.dtype)
    graph = helper.make_graph(
        [helper.make_node(op, ["constant"], ["folded"]), helper.make_node(op, ["x"], ["computed"])], "unary",
        [helper.make_tensor_value_info("x", value_type, list(x.shape))],
        [helper.make_tensor_value_info(name, value_type, None) for name in ("folded", "computed")],
        [numpy_helper.from_array(x, "constant")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    _assert_fold_and_kernel_match(model, x, RTOL)


# Ops ONNX's reference evaluator does not run: their definition from the ONNX spec, in float64.
DEFINITIONS = {"Mish": lambda x: (x * np.tanh(np.log1p(np.exp(x.astype(np.float64))))).astype(x.dtype)}


def _assert_fold_and_kernel_match(model, x, rtol):
    op = model.graph.node[0].op_type
    expected = DEFINITIONS[op](x) if op in DEFINITIONS else ReferenceEvaluator(model).run(None, {"x": x})[0]
    folded, computed = InferenceSession(model).run(None, {"x": x})
    for name, got in (("fold", folded), ("kernel", computed)):
        assert got.dtype == expected.dtype, name
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=0, err_msg=name)


SPECIAL = np.array([0.0, -1.5, np.nan, np.inf, -np.inf, -np.nan, 3e38, -0.0])
CLASSES = [("IsNaN", {}), ("IsInf", {}), ("IsInf", {"detect_positive": 0}), ("IsInf", {"detect_negative": 0}),
           ("IsInf", {"detect_positive": 0, "detect_negative": 0})]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op,attrs", CLASSES, ids=[f"{op}{sorted(attrs.items())}" for op, attrs in CLASSES])
def test_float_classes_fold_and_kernel_match_the_reference(op, attrs, dtype):
    x = SPECIAL.astype(dtype).reshape(2, 4)
    graph = helper.make_graph(
        [helper.make_node(op, ["constant"], ["folded"], **attrs), helper.make_node(op, ["x"], ["computed"], **attrs)],
        "classes", [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype), list(x.shape))],
        [helper.make_tensor_value_info(name, TensorProto.BOOL, None) for name in ("folded", "computed")],
        [numpy_helper.from_array(x, "constant")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
    _assert_fold_and_kernel_match(model, x, 0)


def test_float_classes_refuse_integers_naming_the_node():
    graph = helper.make_graph([helper.make_node("IsNaN", ["x"], ["y"], name="check")], "classes",
                              [helper.make_tensor_value_info("x", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.BOOL, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
    with pytest.raises(OdtrainError, match="'check'.*takes a float tensor"):
        InferenceSession(model).run(None, {"x": np.arange(3)})
