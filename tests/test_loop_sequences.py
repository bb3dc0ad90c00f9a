"""A Loop appending to a sequence stacked after it (a scripted `ys.append(y)`, then `torch.stack(ys, a)`)
becomes a Loop with a scan output (graph/loop_sequences.py): the same outputs as onnx.reference, and a
sequence used otherwise still refused by name."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from odtrain import OdtrainError
from odtrain.graph.onnx_io import load_graph
from odtrain.inference import InferenceSession

F = TensorProto.FLOAT
STEPS = 4


def appending_loop(axis: int, read_length: bool = False):
    """h = tanh(h·W + x[i]) for i < STEPS, each h appended to a sequence; ConcatFromSequence(axis, new_axis=1)
    after the loop. With `read_length`, the body also reads the sequence's length (not a plain append)."""
    body_nodes = [helper.make_node("Gather", ["x", "i"], ["x_i"], axis=0),
                  helper.make_node("MatMul", ["h_in", "W"], ["hw"]), helper.make_node("Add", ["hw", "x_i"], ["pre"]),
                  helper.make_node("Tanh", ["pre"], ["h_out"]),
                  helper.make_node("SequenceInsert", ["seq_in", "h_out"], ["seq_out"]),
                  helper.make_node("Identity", ["true"], ["cond_out"])]  # the TorchScript exporter's condition
    if read_length:
        body_nodes.append(helper.make_node("SequenceLength", ["seq_in"], ["length"]))
    seq = helper.make_tensor_sequence_value_info
    body = helper.make_graph(body_nodes, "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                              helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("h_in", F, None), seq("seq_in", F, None)],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("h_out", F, None), seq("seq_out", F, None)])
    nodes = [helper.make_node("SequenceEmpty", [], ["empty"], dtype=F),
             helper.make_node("Loop", ["trip", "true", "h0", "empty"], ["hT", "hs"], body=body, name="loop"),
             helper.make_node("ConcatFromSequence", ["hs"], ["stacked"], axis=axis, new_axis=1, name="stack")]
    rng = np.random.default_rng(3)
    initializers = [numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float32), "W"),
                    numpy_helper.from_array(np.zeros((2, 3), np.float32), "h0"),
                    numpy_helper.from_array(np.array(STEPS, np.int64), "trip"),
                    numpy_helper.from_array(np.array(True), "true")]
    graph = helper.make_graph(nodes, "appends", [helper.make_tensor_value_info("x", F, [STEPS, 2, 3])],
                              [helper.make_tensor_value_info("stacked", F, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_appends_stacked_after_a_loop_become_its_scan_output(axis):
    proto = appending_loop(axis)
    graph = load_graph(proto)
    assert not [n.op_type for n in graph.nodes if "Sequence" in n.op_type]
    x = np.random.default_rng(4).standard_normal((STEPS, 2, 3)).astype(np.float32)
    (expected,) = ReferenceEvaluator(proto).run(None, {"x": x})
    (got,) = InferenceSession(proto).run(None, {"x": x})
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_a_sequence_the_body_reads_otherwise_stays_refused_by_name():
    with pytest.raises(OdtrainError, match="SequenceLength"):
        InferenceSession(appending_loop(1, read_length=True))
