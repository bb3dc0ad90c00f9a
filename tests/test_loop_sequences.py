"""Sequence ops exporters write around tensors become tensor ops (graph/loop_sequences.py), with the same
outputs as onnx.reference: a Loop appending to a sequence stacked after it (a scripted `ys.append(y)`, then
`torch.stack(ys, a)`) a Loop with a scan output; `SplitToSequence` read by `SequenceAt` at constant positions
(`torch.chunk` from the dynamo exporter without its optimizer) Slices. A sequence used otherwise is still
refused by name."""
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
    with pytest.raises(OdtrainError, match="Sequence(Empty|Length) node"):
        InferenceSession(appending_loop(1, read_length=True))


def chunks(split, keepdims=1, positions=(0, 2, 1), in_body=True):
    """y = the chunks (k+1)·SequenceAt(SplitToSequence(tanh(x), split, axis=1), position_k) side by side, x
    [2, 7], inside a Scan body over a leading axis of 3 when `in_body`."""
    nodes = [helper.make_node("Tanh", ["x_t"], ["t"]),
             helper.make_node("SplitToSequence", ["t"] + (["split"] if split is not None else []), ["seq"], axis=1,
                              keepdims=keepdims)]
    for k, position in enumerate(positions):
        nodes += [helper.make_node("Constant", [], [f"p{k}"], value=numpy_helper.from_array(np.array(position))),
                  helper.make_node("SequenceAt", ["seq", f"p{k}"], [f"c{k}"]),
                  helper.make_node("Mul", [f"c{k}", f"w{k}"], [f"m{k}"])]
    nodes.append(helper.make_node("Concat", [f"m{k}" for k in range(len(positions))], ["y_t"], axis=-1))
    weights = [numpy_helper.from_array(np.array(k + 1, np.float32), f"w{k}") for k in range(len(positions))]
    if split is not None:
        weights.append(numpy_helper.from_array(np.array(split, np.int64), "split"))
    if not in_body:
        graph = helper.make_graph(nodes, "chunks", [helper.make_tensor_value_info("x_t", F, [2, 7])],
                                  [helper.make_tensor_value_info("y_t", F, None)], weights)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    body = helper.make_graph(nodes, "body", [helper.make_tensor_value_info("x_t", F, [2, 7])],
                             [helper.make_tensor_value_info("y_t", F, None)])
    scan = helper.make_node("Scan", ["x"], ["y"], body=body, num_scan_inputs=1)
    graph = helper.make_graph([scan], "chunks", [helper.make_tensor_value_info("x", F, [3, 2, 7])],
                              [helper.make_tensor_value_info("y", F, None)], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("split, keepdims, positions", [(3, 1, (0, 2, 1)), ([2, 4, 1], 1, (2, 0, 1)),
                                                        (None, 0, (6, 0, 3)), (None, 1, (1, 5, 2))],
                         ids=["chunks of 3, the last shorter", "sizes", "rows", "rows kept"])
@pytest.mark.parametrize("in_body", [True, False], ids=["in a body", "outside"])
def test_split_to_sequence_read_at_constant_positions_becomes_slices(split, keepdims, positions, in_body):
    proto = chunks(split, keepdims, positions, in_body)
    name = "x" if in_body else "x_t"
    x = np.random.default_rng(5).standard_normal((3, 2, 7) if in_body else (2, 7)).astype(np.float32)
    (expected,) = ReferenceEvaluator(proto).run(None, {name: x})
    (got,) = InferenceSession(proto).run(None, {name: x})
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_a_split_read_at_a_position_from_the_end_stays_refused_by_name():
    with pytest.raises(OdtrainError, match="SplitToSequence"):
        InferenceSession(chunks(3, positions=(0, -1), in_body=False))
