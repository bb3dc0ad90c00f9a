"""Every unary op of the graph layer's table (graph/ops/elementwise.py, UNARY): its constant fold and its
kernel agree with ONNX's reference evaluator. A row added to the table is checked here without more."""
import numpy as np
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from odtrain.graph.ops.elementwise import UNARY
from odtrain.inference import InferenceSession

X = np.random.default_rng(5).uniform(-3, 3, 1000).astype(np.float32)
INPUTS = {"Not": X > 0, "Log": np.abs(X) + 0.1, "Sqrt": np.abs(X) + 0.1}  # inside each op's domain
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
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    folded, computed = InferenceSession(model).run(None, {"x": x})
    for name, got in (("fold", folded), ("kernel", computed)):
        assert got.dtype == expected.dtype, name
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=0, err_msg=name)
