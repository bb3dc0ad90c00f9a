"""Forward kernels against the ONNX backend node tests (built in memory) for every supported op.

A case the runtime declines must decline with an odtrain error that says why (an attribute or
shape it does not support); any other exception, or a wrong number, fails.
"""
import numpy as np
import pytest
from onnx import TensorProto, numpy_helper
from onnx.backend.test.loader import load_model_tests

from odtrain import OdtrainError
from odtrain.graph.ops import OPS
from odtrain.inference import InferenceSession

SUPPORTED = {op for domain, op in OPS if domain == ""}
DTYPES = {np.dtype(np.float32), np.dtype(np.int64)}
# Cases whose expected outputs ONNX prints rounded to 4 decimals: compared at that precision.
ROUNDED = {"test_averagepool_2d_ceil_last_window_starts_on_pad": 1e-3}


def _cases():
    cases = []
    for case in load_model_tests(kind="node"):
        model = case.model
        ops = {n.op_type for n in model.graph.node}
        if not ops <= SUPPORTED or any(n.domain not in ("", "ai.onnx") for n in model.graph.node):
            continue
        if not case.data_sets:
            continue
        cases.append(pytest.param(case, id=case.name))
    return cases


CASES = _cases()


def test_the_suite_covers_each_op_family():
    covered = {n.op_type for case in CASES for n in case.values[0].model.graph.node}
    assert {"Add", "Gemm", "MatMul", "Relu", "ReduceSum", "ReduceMean", "SoftmaxCrossEntropyLoss", "Reshape",
            "Transpose", "Flatten", "Sigmoid", "Tanh", "Exp", "Log"} <= covered


@pytest.mark.parametrize("case", CASES)
def test_backend_node_case(case):
    inputs, outputs = case.data_sets[0]
    if any(isinstance(t, (list, tuple)) or t is None for t in list(inputs) + list(outputs)):
        pytest.skip("sequence and optional values are not tensors")
    arrays = [numpy_helper.to_array(t) if isinstance(t, TensorProto) else np.asarray(t) for t in inputs]
    expected = [numpy_helper.to_array(t) if isinstance(t, TensorProto) else np.asarray(t) for t in outputs]
    if any(a.dtype not in DTYPES for a in arrays + expected):
        pytest.skip("only float32 and int64 tensors are trained on")
    graph_inputs = [i.name for i in case.model.graph.input]
    try:
        session = InferenceSession(case.model)
        got = session.run(None, dict(zip(graph_inputs, arrays)))
    except OdtrainError as error:
        pytest.skip(f"declined clearly: {error}")
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=ROUNDED.get(case.name, 1e-4), atol=1e-5)
