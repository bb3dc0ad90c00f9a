"""If, Loop and Scan: loading, typing, running and exporting models that hold bodies.

Forward results are checked against onnx.reference's evaluator; bodies read weights and values of
the outer graph, scan over several inputs along other axes and in reverse, and nest.
"""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from odtrain import OdtrainError
from odtrain.graph.control_flow import captured_names, fold_constant_ifs, onnx_inputs
from odtrain.graph.onnx_io import graph_to_proto, load_graph, save_graph
from odtrain.inference import InferenceSession

F = TensorProto.FLOAT
RNG = np.random.default_rng(7)


def tensor(name, shape=None, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "cf", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def weight(name, shape):
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32) * 0.5, name)


def if_model(opset=17):
    """y = cond ? tanh(x @ W) : x * w2 + x, the branches reading x, W and w2 from outside."""
    then_branch = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["xw"]),
                                     helper.make_node("Tanh", ["xw"], ["t_out"])], "then", [], [tensor("t_out")])
    else_branch = helper.make_graph([helper.make_node("Mul", ["x", "w2"], ["xm"]),
                                     helper.make_node("Add", ["xm", "x"], ["e_out"])], "else", [], [tensor("e_out")])
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch, name="choose")]
    return model(nodes, [tensor("cond", [], TensorProto.BOOL), tensor("x", [3, 4])], [tensor("y", [3, 4])],
                 [weight("W", (4, 4)), weight("w2", (4,))], opset)


def scan_model(opset=16):
    """Two carried values, two scan inputs (one along axis 1, one in reverse), two scan outputs (one
    stacked along axis 1, one in reverse), the body reading the weight W from outside."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h_in", "W"], ["hw"]),
         helper.make_node("Add", ["hw", "a_t"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["h_out"]),
         helper.make_node("Mul", ["b_t", "h_out"], ["y1"]),
         helper.make_node("Add", ["c_in", "y1"], ["c_out"]),
         helper.make_node("Sigmoid", ["c_out"], ["y2"])],
        "body", [tensor("h_in", [2, 3]), tensor("c_in", [2, 3]), tensor("a_t", [2, 3]), tensor("b_t", [2, 3])],
        [tensor("h_out", [2, 3]), tensor("c_out", [2, 3]), tensor("y1", [2, 3]), tensor("y2", [2, 3])])
    node = helper.make_node("Scan", ["h0", "c0", "a", "b"], ["h", "c", "ys1", "ys2"], body=body, num_scan_inputs=2,
                            scan_input_axes=[1, 0], scan_input_directions=[0, 1], scan_output_axes=[1, 0],
                            scan_output_directions=[0, 1], name="scan")
    return model([node], [tensor("h0", [2, 3]), tensor("c0", [2, 3]), tensor("a", [2, 5, 3]), tensor("b", [5, 2, 3])],
                 [tensor("h"), tensor("c"), tensor("ys1"), tensor("ys2")], [weight("W", (3, 3))], opset)


def loop_model(opset=17):
    """A loop of trip count 4 (an initializer) with a condition that stays true: h = tanh(h @ W + i),
    the iteration number cast to float; the scan output stacks each h."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Cast", ["i"], ["fi"], to=F),
         helper.make_node("MatMul", ["h_in", "W"], ["hw"]),
         helper.make_node("Add", ["hw", "fi"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["h_out"]),
         helper.make_node("Identity", ["h_out"], ["scan_h"])],
        "body", [tensor("i", [], TensorProto.INT64), tensor("cond_in", [], TensorProto.BOOL), tensor("h_in", [2, 3])],
        [tensor("cond_out", [], TensorProto.BOOL), tensor("h_out", [2, 3]), tensor("scan_h", [2, 3])])
    node = helper.make_node("Loop", ["trip", "", "h0"], ["h", "hs"], body=body, name="loop")
    return model([node], [tensor("h0", [2, 3])], [tensor("h"), tensor("hs")],
                 [weight("W", (3, 3)), numpy_helper.from_array(np.array(4, np.int64), "trip")], opset)


def while_model():
    """A loop whose condition depends on the data: double x until its sum passes 100 (at most 50 times)."""
    body = helper.make_graph(
        [helper.make_node("Add", ["x_in", "x_in"], ["x_out"]),
         helper.make_node("ReduceSum", ["x_out"], ["total"], keepdims=0),
         helper.make_node("Less", ["total", "limit"], ["cond_out"])],
        "body", [tensor("i", [], TensorProto.INT64), tensor("cond_in", [], TensorProto.BOOL), tensor("x_in", [3])],
        [tensor("cond_out", [], TensorProto.BOOL), tensor("x_out", [3])])
    node = helper.make_node("Loop", ["trip", "go", "x"], ["y"], body=body, name="doubling")
    return model([node], [tensor("x", [3])], [tensor("y")],
                 [numpy_helper.from_array(np.array(100.0, np.float32), "limit"),
                  numpy_helper.from_array(np.array(True), "go"),
                  numpy_helper.from_array(np.array(50, np.int64), "trip")])


def nested_model():
    """A Scan whose body holds an If on the sign of the slice's sum; the branches read the outer W."""
    then_branch = helper.make_graph([helper.make_node("MatMul", ["s_in", "W"], ["t"])], "then", [], [tensor("t")])
    else_branch = helper.make_graph([helper.make_node("Sub", ["s_in", "x_t"], ["e"])], "else", [], [tensor("e")])
    body = helper.make_graph(
        [helper.make_node("ReduceSum", ["x_t"], ["total"], keepdims=0),
         helper.make_node("Greater", ["total", "zero"], ["positive"]),
         helper.make_node("If", ["positive"], ["chosen"], then_branch=then_branch, else_branch=else_branch),
         helper.make_node("Add", ["chosen", "x_t"], ["s_out"])],
        "body", [tensor("s_in", [3]), tensor("x_t", [3])], [tensor("s_out", [3]), tensor("chosen", [3])])
    node = helper.make_node("Scan", ["s0", "x"], ["s", "ys"], body=body, num_scan_inputs=1, name="outer")
    return model([node], [tensor("s0", [3]), tensor("x", [6, 3])], [tensor("s"), tensor("ys")],
                 [weight("W", (3, 3)), numpy_helper.from_array(np.array(0.0, np.float32), "zero")])


def random_feeds(proto, **given):
    feeds = dict(given)
    for value in proto.graph.input:
        if value.name in feeds:
            continue
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = RNG.standard_normal(shape).astype(np.float32)
    return feeds


def onnxruntime_run(proto, feeds):
    import onnxruntime

    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def oracle(proto, feeds):
    """onnx.reference's outputs; onnxruntime's for what the reference does not implement (Scan's reverse
    directions, Loop's scan outputs without a condition input)."""
    try:
        return ReferenceEvaluator(proto).run(None, feeds)
    except (RuntimeError, ValueError):
        return onnxruntime_run(proto, feeds)


def assert_matches_reference(proto, feeds, rtol=1e-5):
    expected = oracle(proto, feeds)
    got = InferenceSession(proto).run(None, feeds)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=rtol, atol=1e-6)
    return got


@pytest.mark.parametrize("opset", [9, 11, 13, 16, 19])
@pytest.mark.parametrize("cond", [True, False])
def test_if_runs_the_branch_its_condition_picks(cond, opset):
    proto = if_model(opset)
    assert_matches_reference(proto, random_feeds(proto, cond=np.array(cond)))


def test_a_body_reads_outer_values_through_captured_inputs_that_export_drops():
    graph = load_graph(if_model())
    node = graph.nodes[0]
    assert captured_names(node) == ["x", "W", "w2"]
    assert node.inputs == ["cond", "x", "W", "w2"] and onnx_inputs(node) == ["cond"]
    assert list(graph_to_proto(graph).graph.node[0].input) == ["cond"]


@pytest.mark.parametrize("opset", [9, 11, 16])
def test_scan_with_axes_and_directions_matches_the_reference(opset):
    proto = scan_model(opset)
    assert_matches_reference(proto, random_feeds(proto))


@pytest.mark.parametrize("opset", [9, 11, 13, 16, 19])
def test_loop_with_a_trip_count_matches_the_reference(opset):
    proto = loop_model(opset)
    assert_matches_reference(proto, random_feeds(proto))


def test_loop_whose_condition_depends_on_the_data_stops_when_it_turns_false():
    proto = while_model()
    for x in ([1.0, 2.0, 3.0], [40.0, 30.0, 35.0], [-1.0, -2.0, -3.0]):
        got = assert_matches_reference(proto, {"x": np.array(x, np.float32)})
    assert got[0][0] == -1.0 * 2 ** 50  # the trip count stops a condition that never turns false


def test_nested_control_flow_reads_values_two_scopes_out():
    proto = nested_model()
    graph = load_graph(proto)
    assert "W" in graph.nodes[0].inputs  # the inner If's capture is the Scan's too
    x = RNG.standard_normal((6, 3)).astype(np.float32)
    x[::2] = np.abs(x[::2])  # both branches taken
    x[1::2] = -np.abs(x[1::2])
    assert_matches_reference(proto, random_feeds(proto, x=x))


@pytest.mark.parametrize("make", [if_model, scan_model, loop_model, nested_model])
def test_saved_models_keep_their_bodies_and_onnxruntime_runs_the_export(make, tmp_path):
    """A graph saved with onnx (save_graph) and read back without it (the wire reader) runs the same;
    the exported ModelProto is standard ONNX that onnxruntime runs."""
    proto = make()
    feeds = random_feeds(proto, **({"cond": np.array(True)} if make is if_model else {}))
    expected = oracle(proto, feeds)
    path = tmp_path / "saved.onnx"
    save_graph(load_graph(proto), path)
    for g, e in zip(InferenceSession(str(path)).run(None, feeds), expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    exported = graph_to_proto(load_graph(proto))
    for g, e in zip(onnxruntime_run(exported, feeds), expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_a_constant_condition_folds_the_if_into_the_branch_it_takes():
    proto = if_model()
    proto.graph.initializer.append(numpy_helper.from_array(np.array(False), "cond"))
    del proto.graph.input[0]
    graph = fold_constant_ifs(load_graph(proto))
    assert [n.op_type for n in graph.nodes] == ["Mul", "Add"] and graph.nodes[-1].outputs == ["y"]
    feeds = random_feeds(proto)
    expected = ReferenceEvaluator(proto).run(None, feeds)
    np.testing.assert_allclose(InferenceSession(graph_to_proto(graph)).run(None, feeds)[0], expected[0], rtol=1e-6)


def test_branches_of_different_shapes_on_a_fed_condition_are_refused_by_name():
    then_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [], [tensor("t")])
    else_branch = helper.make_graph([helper.make_node("Concat", ["x", "x"], ["e"], axis=0)], "else", [],
                                    [tensor("e")])
    proto = model([helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch,
                                    name="uneven")], [tensor("cond", [], TensorProto.BOOL), tensor("x", [2])],
                  [tensor("y")])
    with pytest.raises(OdtrainError, match="If node 'uneven'.*same type"):
        InferenceSession(proto).run(None, {"cond": np.array(True), "x": np.ones(2, np.float32)})


def test_a_sequence_op_in_a_body_is_refused_by_name():
    body = helper.make_graph([helper.make_node("Identity", ["c"], ["c_out"]),
                              helper.make_node("SequenceInsert", ["s_in", "x"], ["s_out"])], "body",
                             [tensor("i", [], TensorProto.INT64), tensor("c", [], TensorProto.BOOL),
                              helper.make_tensor_sequence_value_info("s_in", F, None)],
                             [tensor("c_out", [], TensorProto.BOOL), helper.make_tensor_sequence_value_info("s_out", F, None)])
    proto = model([helper.make_node("SequenceEmpty", [], ["s0"]),
                   helper.make_node("Loop", ["trip", "", "s0"], ["s"], body=body, name="collect")],
                  [tensor("x", [2])], [helper.make_tensor_sequence_value_info("s", F, None)],
                  [numpy_helper.from_array(np.array(3, np.int64), "trip")])
    with pytest.raises(OdtrainError, match="Sequence"):
        InferenceSession(proto).run(None, {"x": np.ones(2, np.float32)})



# ---- Sequences: a Loop's carried values and an If's outputs, expanded when shapes bind -------------------
SEQUENCE_CASES = ("test_loop13_seq", "test_if_seq", "test_loop16_seq_none",
                  "test_identity_sequence", "test_identity_opt")  # the last two: a sequence fed and returned


@pytest.mark.parametrize("name", SEQUENCE_CASES)
def test_sequences_carried_by_a_loop_or_given_by_an_if_match_the_backend_cases(name):
    import pathlib
    import sys
    import warnings

    from onnx.backend.test.loader import load_model_tests

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
    from conformance import _odtrain_run, check

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (case,) = [c for c in load_model_tests(kind="node") if c.name == name]
    assert check(case, _odtrain_run) is None


def sequence_loop_model(trip=3):
    """s = [x * 1, x * 2, ...]: a Loop carrying a sequence fed empty, each iteration inserting a row."""
    body = helper.make_graph([helper.make_node("Identity", ["c"], ["c_out"]),
                              helper.make_node("Cast", ["i"], ["fi"], to=F),
                              helper.make_node("Add", ["fi", "one"], ["k"]),
                              helper.make_node("Mul", ["x", "k"], ["row"]),
                              helper.make_node("SequenceInsert", ["s_in", "row"], ["s_out"])], "body",
                             [tensor("i", [], TensorProto.INT64), tensor("c", [], TensorProto.BOOL),
                              helper.make_tensor_sequence_value_info("s_in", F, None)],
                             [tensor("c_out", [], TensorProto.BOOL), helper.make_tensor_sequence_value_info("s_out", F, None)])
    return model([helper.make_node("Loop", ["trip", "", "s0"], ["s"], body=body, name="collect")],
                 [tensor("x", [2]), helper.make_tensor_sequence_value_info("s0", F, None)],
                 [helper.make_tensor_sequence_value_info("s", F, None)],
                 [numpy_helper.from_array(np.array(trip, np.int64), "trip"),
                  numpy_helper.from_array(np.array(1, np.float32), "one")])


def test_a_loop_carrying_a_sequence_extends_the_sequence_it_is_fed():
    x = np.array([1.5, -2.0], np.float32)
    start = [np.full(3, 7, np.float32)]
    got = InferenceSession(sequence_loop_model()).run(None, {"x": x, "s0": start})[0]
    # onnxruntime as the oracle: onnx.reference's Loop stops at once when its condition input is omitted
    import onnxruntime

    session = onnxruntime.InferenceSession(sequence_loop_model().SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"x": x, "s0": start})[0]
    assert len(got) == len(expected) == 4
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


def test_a_sequence_op_outside_every_body_is_refused_in_one_line_naming_it(tmp_path):
    from odtrain import cli

    proto = model([helper.make_node("SequenceConstruct", ["x", "x"], ["s"], name="pair"),
                   helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0, name="join")],
                  [tensor("x", [2])], [tensor("y", [4])])
    with pytest.raises(OdtrainError, match="SequenceConstruct node 'pair' works on a sequence outside"):
        InferenceSession(proto)
    path = tmp_path / "joined.onnx"
    path.write_bytes(proto.SerializeToString())
    assert cli.main(["prepare", str(path), "-o", str(tmp_path / "art")]) == 2



# ---- Random ops in a body: a fresh Dropout mask each iteration, the same one in the backward ---------------
def dropout_scan_model(length, reverse):
    """h_t = h_{t-1} + Dropout(x_t · w) in training mode, the rows of x walked forward or in reverse."""
    n = 16
    body = helper.make_graph([helper.make_node("Mul", ["x_t", "w"], ["xw"]),
                              helper.make_node("Dropout", ["xw", "ratio", "training"], ["y_t"], name="drop"),
                              helper.make_node("Add", ["h_in", "y_t"], ["h_out"])], "body",
                             [tensor("h_in", [n]), tensor("x_t", [n])], [tensor("h_out", [n]), tensor("y_t", [n])])
    node = helper.make_node("Scan", ["h0", "x"], ["h", "ys"], body=body, num_scan_inputs=1, name="scan",
                            scan_input_directions=[int(reverse)])
    return model([node], [tensor("x", [length, n])], [tensor("h", [n]), tensor("ys", [length, n])],
                 [numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
                  numpy_helper.from_array(np.array(True), "training"),
                  numpy_helper.from_array(np.zeros(n, np.float32), "h0"),
                  numpy_helper.from_array(np.array(1.5, np.float32), "w")])


@pytest.mark.parametrize("reverse", [False, True])
def test_dropout_in_a_body_draws_a_mask_per_iteration_that_its_gradient_applies(reverse, tmp_path):
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module

    x = np.random.default_rng(3).uniform(1, 2, (6, 16)).astype(np.float32)
    _, ys = InferenceSession(dropout_scan_model(6, reverse)).run(None, {"x": x})
    masks = ys != 0
    assert len({m.tobytes() for m in masks}) == len(masks)  # a fresh mask each iteration
    weights = [np.zeros(16, np.float32), np.random.default_rng(4).standard_normal((6, 16)).astype(np.float32)]
    artifacts.generate_artifacts(with_loss(dropout_scan_model(6, reverse), weights), requires_grad=["w"], loss=None,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    losses, gradients = [], []
    for _ in range(2):  # the same seed draws the same masks
        state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
        state.random_seed = 5
        module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
        module.train()
        losses.append(float(np.asarray(module(x))))
        gradients.append(float(np.asarray(state.parameters["w"].grad)))
    assert losses[0] == losses[1] and gradients[0] == gradients[1]
    # the loss is linear in w (w · Σ weight · mask · x / (1 - ratio)): its gradient is loss / w exactly when the
    # backward applies the masks the forward drew; float32 sums in two orders: a few ulps of the loss
    np.testing.assert_allclose(gradients[0] * 1.5, losses[0], rtol=1e-5)



def test_batch_normalization_in_a_body_updates_its_running_statistics_each_iteration_as_pytorch(tmp_path):
    """A PyTorch BatchNorm1d called once per step of a loop normalises each call by that call's batch and
    moves its running statistics once per call; the same layer in a Scan body trains so, its running
    statistics state (never trained) under the default selection of parameters."""
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module

    length, batch, channels = 4, 5, 3
    body = helper.make_graph([helper.make_node("BatchNormalization", ["x_t", "gamma", "beta", "mean", "var"],
                                               ["y_t", "mean_out", "var_out"], training_mode=1, momentum=0.9),
                              helper.make_node("Add", ["h_in", "y_t"], ["h_out"])], "body",
                             [tensor("h_in", [batch, channels]), tensor("x_t", [batch, channels])],
                             [tensor("h_out", [batch, channels]), tensor("y_t", [batch, channels])])
    proto = model([helper.make_node("Scan", ["h0", "x"], ["h", "ys"], body=body, num_scan_inputs=1, name="scan")],
                  [tensor("x", [length, batch, channels])], [tensor("h"), tensor("ys")],
                  [numpy_helper.from_array(np.ones(channels, np.float32), "gamma"),
                   numpy_helper.from_array(np.zeros(channels, np.float32), "beta"),
                   numpy_helper.from_array(np.zeros(channels, np.float32), "mean"),
                   numpy_helper.from_array(np.ones(channels, np.float32), "var"),
                   numpy_helper.from_array(np.zeros((batch, channels), np.float32), "h0")], opset=15)
    x = (RNG.standard_normal((length, batch, channels)) + 3).astype(np.float32)
    weights = [np.ones((batch, channels), np.float32), RNG.standard_normal((length, batch, channels)).astype(np.float32)]
    artifacts.generate_artifacts(with_loss(proto, weights), loss=None, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    assert not state.parameters["mean"].requires_grad and not state.parameters["var"].requires_grad
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    module.train()
    module(x)
    # torch.nn.BatchNorm1d(momentum=0.1) in training mode, called once per step, in float64: each call moves
    # running = 0.9 · running + 0.1 · batch statistic, the variance unbiased (PyTorch's documented update)
    mean, var = np.zeros(channels), np.ones(channels)
    for t in range(length):
        mean = 0.9 * mean + 0.1 * x[t].mean(0, dtype=np.float64)
        var = 0.9 * var + 0.1 * x[t].astype(np.float64).var(0, ddof=1)
    # float32 batch statistics against float64 ones over 5 rows of values near 3: well inside 1e-5
    np.testing.assert_allclose(np.asarray(state.parameters["mean"].data), mean, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state.parameters["var"].data), var, rtol=1e-5)



def test_the_memory_report_shows_each_loops_body_arena_and_the_iterations_it_saves(tmp_path):
    from odtrain import artifacts, memory

    proto = scan_model()
    values = random_feeds(proto)
    proto = as_initializers(proto, ["h0", "c0"], values)
    weights = [np.ones(np.shape(o), np.float32) for o in oracle(proto, {k: values[k] for k in ("a", "b")})]
    artifacts.generate_artifacts(with_loss(proto, weights), requires_grad=["W"], loss=None,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    result = memory.from_artifacts(tmp_path, 2)
    train = next(p for p in result.plans if p.mode == "train")
    forward, backward = train.loops
    assert (forward.node, forward.iterations, backward.iterations) == ("Scan node 'scan'", 5, 5)
    assert forward.saved_bytes == 5 * 2 * (2 * 3 * 4)  # two [2, 3] float32 states each of 5 iterations
    assert backward.saved_bytes == 0
    for loop in train.loops:  # each body planned at its lower bound, as the step is
        assert 0 < loop.body_arena_bytes <= 1.10 * loop.body_lower_bound
    assert train.arena_bytes <= 1.10 * train.lower_bound
    assert train.timeline()["saved iterations"].max() >= forward.saved_bytes
    assert result.training_bytes >= result.arena_bytes + forward.body_arena_bytes + backward.body_arena_bytes
    text = result.render()
    assert "saved iterations" in text and "loop body" in text and "Scan node 'scan'" in text



def test_a_memory_budget_checkpoints_a_scans_iterations_with_the_same_gradient_bits(tmp_path):
    """h_t = tanh(h_{t-1} · W + x_t) over 36 steps saves 36 states of [4, 32] for the backward; under a budget
    below that the plan keeps every 6th and recomputes the others segment by segment."""
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module

    length, batch, width = 36, 4, 32
    body = helper.make_graph([helper.make_node("MatMul", ["h_in", "W"], ["hw"]),
                              helper.make_node("Add", ["hw", "x_t"], ["pre"]),
                              helper.make_node("Tanh", ["pre"], ["h_out"])], "body",
                             [tensor("h_in", [batch, width]), tensor("x_t", [batch, width])],
                             [tensor("h_out", [batch, width])])
    proto = model([helper.make_node("Scan", ["h0", "x"], ["h"], body=body, num_scan_inputs=1, name="scan")],
                  [tensor("x", [length, batch, width])], [tensor("h", [batch, width])],
                  [weight("W", (width, width)), numpy_helper.from_array(np.zeros((batch, width), np.float32), "h0")])
    artifacts.generate_artifacts(with_loss(proto, [RNG.standard_normal((batch, width)).astype(np.float32)]),
                                 requires_grad=["W"], loss=None, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    x = RNG.standard_normal((length, batch, width)).astype(np.float32)
    runs = []
    for budget in (None, 25_000):  # every state (about 37 KB of arena with x) / states at 6 checkpoints
        state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
        module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx", memory_budget=budget)
        loss = np.asarray(module(x)).copy()
        (bound,) = module.bound_steps()
        runs.append((loss, np.asarray(state.parameters["W"].grad).copy(), bound))
    (loss, gradient, whole), (loss_checkpointed, gradient_checkpointed, checkpointed) = runs
    assert loss.tobytes() == loss_checkpointed.tobytes() and gradient.tobytes() == gradient_checkpointed.tobytes()
    assert checkpointed.arena_bytes <= 25_000 < whole.arena_bytes
    assert checkpointed.arena_bytes <= 1.10 * checkpointed.lower_bound
    every, kept = whole.loops[0], checkpointed.loops[0]
    assert (every.iterations, every.saved_bytes) == (36, 36 * batch * width * 4)
    assert (kept.iterations, kept.saved_bytes) == (6, 6 * batch * width * 4)  # 6 segments of 6 iterations


# ---- Gradients: float64 central differences of the same model --------------------------------------
# onnx.reference has no reverse Scan directions, so the float64 oracle falls back to onnxruntime there.
GRADIENT_ORACLES = {"If": "test_if_gradients_match_finite_differences_on_both_branches",
                    "Scan": "test_scan_gradients_match_finite_differences",
                    "Loop": "test_loop_gradients_match_finite_differences"}


def widened(proto):
    """A float64 copy of `proto`: float initializers, constants, casts and the declared types of every
    graph and body."""
    import onnx

    proto = onnx.ModelProto.FromString(proto.SerializeToString())

    def widen(graph):
        for tensor in graph.initializer:
            array = numpy_helper.to_array(tensor)
            if array.dtype == np.float32:
                tensor.CopyFrom(numpy_helper.from_array(array.astype(np.float64), tensor.name))
        for info in list(graph.input) + list(graph.output) + list(graph.value_info):
            if info.type.tensor_type.elem_type == F:
                info.type.tensor_type.elem_type = TensorProto.DOUBLE
        for n in graph.node:
            for a in n.attribute:
                if n.op_type == "Cast" and a.name == "to" and a.i == F:
                    a.i = TensorProto.DOUBLE
                if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == F:
                    a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
                if a.type == onnx.AttributeProto.GRAPH:
                    widen(a.g)

    widen(proto.graph)
    return proto


def with_loss(proto, weights: list):
    """`proto` whose first output is loss = Σ_k sum(output_k · weights_k) over its outputs."""
    import onnx

    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    graph = proto.graph
    parts = []
    for k, (out, w) in enumerate(zip([o.name for o in graph.output], weights)):
        graph.initializer.append(numpy_helper.from_array(w, f"loss_weight{k}"))
        graph.node.extend([helper.make_node("Mul", [out, f"loss_weight{k}"], [f"weighted{k}"]),
                           helper.make_node("ReduceSum", [f"weighted{k}"], [f"part{k}"], keepdims=0)])
        parts.append(f"part{k}")
    graph.node.append(helper.make_node("Sum", parts, ["loss"]))
    del graph.output[:]
    graph.output.append(tensor("loss", []))
    return proto


def check_gradients(proto, params: list[str], feeds: dict, tmp_path, step=1e-6, rtol=2e-3):
    """odtrain's gradients (generate_artifacts, Module, float32 kernels) of a weighted sum of every output
    of `proto` with respect to the initializers `params` against float64 central differences."""
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module

    rng = np.random.default_rng(11)
    weights = [rng.standard_normal(np.shape(o)).astype(np.float32) for o in oracle(proto, feeds)]
    lossy = with_loss(proto, weights)
    artifacts.generate_artifacts(lossy, requires_grad=params, loss=None, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    loss32 = module(*[feeds[i.name] for i in proto.graph.input])
    model64 = widened(lossy)
    feeds64 = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
    values = {t.name: numpy_helper.to_array(t) for t in model64.graph.initializer if t.name in params}

    def loss64(changed):
        for t in model64.graph.initializer:
            if t.name in changed:
                t.CopyFrom(numpy_helper.from_array(changed[t.name], t.name))
        return float(oracle(model64, feeds64)[0])

    np.testing.assert_allclose(float(np.asarray(loss32).reshape(-1)[0]), loss64(values), rtol=1e-4, atol=1e-5)
    for name in params:
        numeric = np.zeros_like(values[name])
        for index in np.ndindex(numeric.shape):
            for sign in (1, -1):
                shifted = values[name].copy()
                shifted[index] += sign * step
                numeric[index] += sign * loss64({name: shifted}) / (2 * step)
        loss64(values)
        scale = max(np.abs(numeric).max(), 1e-3)
        np.testing.assert_allclose(state.parameters[name].grad, numeric, rtol=rtol, atol=2e-3 * scale,
                                   err_msg=f"gradient of '{name}'")


def as_initializers(proto, names, feeds):
    """`proto` with the inputs `names` made initializers of the values in `feeds` (trainable parameters)."""
    import onnx

    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    for value in list(proto.graph.input):
        if value.name in names:
            proto.graph.initializer.append(numpy_helper.from_array(feeds[value.name], value.name))
            proto.graph.input.remove(value)
    return proto


@pytest.mark.parametrize("cond", [True, False])
def test_if_gradients_match_finite_differences_on_both_branches(cond, tmp_path):
    proto = as_initializers(if_model(), ["x"], {"x": RNG.standard_normal((3, 4)).astype(np.float32)})
    check_gradients(proto, ["x", "W", "w2"], {"cond": np.array(cond)}, tmp_path)


def test_scan_gradients_match_finite_differences(tmp_path):
    """Two states, two scan inputs (axis 1 forward, axis 0 reverse), two scan outputs (axis 1, reverse),
    the outer weight W: gradients of every one of them."""
    proto = scan_model()
    values = random_feeds(proto)
    proto = as_initializers(proto, list(values), values)
    check_gradients(proto, ["W", "h0", "c0", "a", "b"], {}, tmp_path)


def test_loop_gradients_match_finite_differences(tmp_path):
    proto = loop_model()
    values = random_feeds(proto)
    proto = as_initializers(proto, ["h0"], values)
    check_gradients(proto, ["W", "h0"], {}, tmp_path)


def test_nested_control_flow_gradients_match_finite_differences(tmp_path):
    proto = nested_model()
    x = RNG.standard_normal((6, 3)).astype(np.float32)
    x[::2], x[1::2] = np.abs(x[::2]) + 0.1, -np.abs(x[1::2]) - 0.1  # both branches, away from the switch
    proto = as_initializers(proto, ["x", "s0"], {"x": x, "s0": RNG.standard_normal(3).astype(np.float32)})
    check_gradients(proto, ["W", "x", "s0"], {}, tmp_path)


def scaled_scan(n: int):
    """h' = tanh(h · c + x_t · w) over x's rows, the body reading the constant c [n] and the weight w [1]."""
    body = helper.make_graph([helper.make_node("Mul", ["h_in", "c"], ["hc"]), helper.make_node("Mul", ["x_t", "w"], ["xw"]),
                              helper.make_node("Add", ["hc", "xw"], ["pre"]), helper.make_node("Tanh", ["pre"], ["h_out"]),
                              helper.make_node("Identity", ["h_out"], ["y_t"])], "body",
                             [tensor("h_in", [n]), tensor("x_t", [n])], [tensor("h_out", [n]), tensor("y_t", [n])])
    node = helper.make_node("Scan", ["h0", "x"], ["h", "ys"], body=body, num_scan_inputs=1, name="scan")
    return model([node], [tensor("x", [3, n])], [tensor("h"), tensor("ys")],
                 [numpy_helper.from_array(RNG.uniform(0.5, 1, n).astype(np.float32), "c"),
                  numpy_helper.from_array(np.zeros(n, np.float32), "h0"),
                  numpy_helper.from_array(np.array([0.7], np.float32), "w")])


def test_outer_constants_either_side_of_the_copied_size_give_the_same_gradients(tmp_path):
    """A gradient body copies the outer constants it reads of at most SMALL_CONSTANT elements
    (graph/ops/control_gradients.py) and reads larger ones from the enclosing graph: both match finite
    differences."""
    import onnx

    from odtrain.graph.ops.control_gradients import SMALL_CONSTANT

    for n, copied in ((SMALL_CONSTANT, True), (SMALL_CONSTANT + 1, False)):
        x = RNG.standard_normal((3, n)).astype(np.float32)
        check_gradients(scaled_scan(n), ["w"], {"x": x}, tmp_path / str(n))
        trained = onnx.load(str(tmp_path / str(n) / "training_model.onnx"))
        bodies = [a.g for node in trained.graph.node if node.op_type == "Scan" for a in node.attribute if a.g.node]
        assert any("c" in {t.name for t in body.initializer} for body in bodies) == copied, n


def test_a_loop_whose_condition_depends_on_the_data_is_refused_a_gradient_by_name(tmp_path):
    from odtrain import artifacts

    proto = while_model()
    proto.graph.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), "scale"))
    body = proto.graph.node[0].attribute[0].g
    body.node[0].input[1] = "scale"  # x_out = x_in + scale: the loop reads a weight
    lossy = with_loss(proto, [np.ones(3, np.float32)])
    lossy = as_initializers(lossy, ["x"], {"x": np.ones(3, np.float32)})
    with pytest.raises(OdtrainError, match="Loop node 'doubling'.*condition depends on the data"):
        artifacts.generate_artifacts(lossy, requires_grad=["scale"], loss=None, optimizer=artifacts.OptimType.SGD,
                                     artifact_directory=tmp_path)


# ---- Training end to end: a GRU cell written as a Scan ------------------------------------------------
# The oracle is the same model with ONNX's GRU op (its own kernels and gradient rule, checked against
# PyTorch elsewhere): the parameters are shared by name and shape, so equal gradients give equal losses
# step after step under SGD and AdamW, whose updates act element by element.
T, BATCH, INPUT, HIDDEN = 6, 2, 3, 4


def gru_parameters(rng):
    scale = 0.5
    return {"Wt": rng.standard_normal((INPUT, 3 * HIDDEN)).astype(np.float32) * scale,
            "Rt": rng.standard_normal((HIDDEN, 3 * HIDDEN)).astype(np.float32) * scale,
            "Wb": rng.standard_normal(3 * HIDDEN).astype(np.float32) * scale,
            "Rb": rng.standard_normal(3 * HIDDEN).astype(np.float32) * scale,
            "V": rng.standard_normal((HIDDEN, 2)).astype(np.float32) * scale}


def gru_as_scan(params):
    """h' = n + z·(h − n), z = σ(xWz + hRz), r = σ(xWr + hRr), n = tanh(xWh + r·(hRh + Rbh)) (PyTorch's
    GRU cell, ONNX's linear_before_reset=1), written as a Scan body over X's first axis."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["x_t", "Wt"], ["xw"]), helper.make_node("Add", ["xw", "Wb"], ["gx"]),
         helper.make_node("MatMul", ["h", "Rt"], ["hr"]), helper.make_node("Add", ["hr", "Rb"], ["gh"]),
         helper.make_node("Split", ["gx", "thirds"], ["xz", "xr", "xn"], axis=1),
         helper.make_node("Split", ["gh", "thirds"], ["hz", "hrr", "hn"], axis=1),
         helper.make_node("Add", ["xz", "hz"], ["z_pre"]), helper.make_node("Sigmoid", ["z_pre"], ["z"]),
         helper.make_node("Add", ["xr", "hrr"], ["r_pre"]), helper.make_node("Sigmoid", ["r_pre"], ["r"]),
         helper.make_node("Mul", ["r", "hn"], ["rhn"]), helper.make_node("Add", ["xn", "rhn"], ["n_pre"]),
         helper.make_node("Tanh", ["n_pre"], ["n"]), helper.make_node("Sub", ["h", "n"], ["h_minus_n"]),
         helper.make_node("Mul", ["z", "h_minus_n"], ["zd"]), helper.make_node("Add", ["n", "zd"], ["h_next"]),
         helper.make_node("Identity", ["h_next"], ["y_t"])],
        "gru_cell", [tensor("h", [BATCH, HIDDEN]), tensor("x_t", [BATCH, INPUT])],
        [tensor("h_next", [BATCH, HIDDEN]), tensor("y_t", [BATCH, HIDDEN])])
    nodes = [helper.make_node("Scan", ["h0", "X"], ["hT", "Y"], body=body, num_scan_inputs=1, name="gru_scan"),
             helper.make_node("MatMul", ["hT", "V"], ["logits"])]
    return model(nodes, [tensor("X", [T, BATCH, INPUT])], [tensor("logits", [BATCH, 2])],
                 [numpy_helper.from_array(v, k) for k, v in params.items()] +
                 [numpy_helper.from_array(np.zeros((BATCH, HIDDEN), np.float32), "h0"),
                  numpy_helper.from_array(np.array([HIDDEN] * 3, np.int64), "thirds")])


def gru_as_op(params):
    """The same model with ONNX's GRU op, its weights laid out from the same parameters."""
    nodes = [helper.make_node("Transpose", ["Wt"], ["W2"]), helper.make_node("Unsqueeze", ["W2", "zero"], ["W"]),
             helper.make_node("Transpose", ["Rt"], ["R2"]), helper.make_node("Unsqueeze", ["R2", "zero"], ["R"]),
             helper.make_node("Concat", ["Wb", "Rb"], ["B1"], axis=0), helper.make_node("Unsqueeze", ["B1", "zero"], ["B"]),
             helper.make_node("GRU", ["X", "W", "R", "B", "", "h0"], ["", "hT3"], hidden_size=HIDDEN,
                              linear_before_reset=1),
             helper.make_node("Squeeze", ["hT3", "zero"], ["hT"]), helper.make_node("MatMul", ["hT", "V"], ["logits"])]
    return model(nodes, [tensor("X", [T, BATCH, INPUT])], [tensor("logits", [BATCH, 2])],
                 [numpy_helper.from_array(v, k) for k, v in params.items()] +
                 [numpy_helper.from_array(np.zeros((1, BATCH, HIDDEN), np.float32), "h0"),
                  numpy_helper.from_array(np.array([0], np.int64), "zero")])


def train(proto, folder, optimizer, batches):
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module, Optimizer

    artifacts.generate_artifacts(proto, requires_grad=["Wt", "Rt", "Wb", "Rb", "V"], loss=artifacts.LossType.MSELoss,
                                 optimizer=optimizer, artifact_directory=folder)
    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx")
    step = Optimizer(folder / "optimizer_model.onnx", module)
    losses = []
    for x, target in batches:
        module.train()
        losses.append(float(module(x, target)))
        step.step()
        module.lazy_reset_grad()
    return losses, module


@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_a_gru_cell_written_as_a_scan_trains_as_the_gru_op_does(optimizer, tmp_path):
    from odtrain import artifacts

    rng = np.random.default_rng(5)
    params = gru_parameters(rng)
    batches = [(rng.standard_normal((T, BATCH, INPUT)).astype(np.float32),
                rng.standard_normal((BATCH, 2)).astype(np.float32))] * 5  # one batch: the loss must fall
    kind = getattr(artifacts.OptimType, optimizer)
    scan_proto = gru_as_scan(params)
    first = ReferenceEvaluator(scan_proto).run(None, {"X": batches[0][0]})[0]
    np.testing.assert_allclose(first, ReferenceEvaluator(gru_as_op(params)).run(None, {"X": batches[0][0]})[0],
                               rtol=1e-5, atol=1e-6)  # the two models are one function
    scanned, module = train(scan_proto, tmp_path / "scan", kind, batches)
    reference, _ = train(gru_as_op(params), tmp_path / "op", kind, batches)
    np.testing.assert_allclose(scanned[0], float(np.mean((first - batches[0][1]) ** 2)), rtol=1e-5)
    np.testing.assert_allclose(scanned, reference, rtol=1e-4)
    assert scanned[-1] < scanned[0]
    # the trained model exports with its Scan, and onnxruntime runs it
    import onnx

    module.export_model_for_inferencing(str(tmp_path / "inference.onnx"), ["logits"])
    exported = onnx.load(str(tmp_path / "inference.onnx"))
    assert [n.op_type for n in exported.graph.node if n.op_type == "Scan"] == ["Scan"]
    x = batches[0][0]
    module.eval()
    expected = InferenceSession(str(tmp_path / "inference.onnx")).run(None, {"X": x})[0]
    np.testing.assert_allclose(onnxruntime_run(exported, {"X": x})[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make,compiles", [(lambda: gru_as_scan(gru_parameters(np.random.default_rng(2))), True),
                                           (loop_model, True), (scan_model, False)], ids=["gru", "loop", "axis 1"])
def test_a_loop_compiled_into_one_function_gives_what_the_python_loop_gives(make, compiles, monkeypatch):
    """Long loops run as one generated Numba function (odtrain/loop_compiler.py): here every loop is, but
    a scan along another axis than 0 (not contiguous slices), which keeps the Python loop."""
    import odtrain.loop_compiler
    from odtrain import loops

    made = []
    original = odtrain.loop_compiler.compile_loop
    monkeypatch.setattr(loops, "COMPILE_FROM", 0)
    monkeypatch.setattr(loops, "compile_loop", lambda spec, trip: made.append(original(spec, trip)) or made[-1])
    proto = make()
    assert_matches_reference(proto, random_feeds(proto))
    assert made and all((run is not None) == compiles for run in made)


def selective_scan(form: str, steps=40, width=8, state=4):
    """benchmarks/loops.py's Mamba-style selective scan, small."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "loops.py"
    spec = importlib.util.spec_from_file_location("selective_scan_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.selective_scan_model(steps, width, state, form)


@pytest.mark.parametrize("form", ["scan", "loop"])
def test_an_element_wise_body_runs_as_one_fused_loop_nest(form, monkeypatch):
    """The selective scan's step (element-wise over [width, state], a sum over state, the Loop's rows
    gathered by the iteration number) fuses (odtrain/body_fusion.py) and gives onnxruntime's outputs."""
    from odtrain import body_fusion, loops

    fused = []
    monkeypatch.setattr(loops, "COMPILE_FROM", 0)
    monkeypatch.setattr(loops, "fused_body", lambda *a: fused.append(body_fusion.fused_body(*a)) or fused[-1])
    proto = selective_scan(form)
    x = RNG.standard_normal((40, 8)).astype(np.float32)
    got = InferenceSession(proto).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, onnxruntime_run(proto, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert fused and all(lines is not None for lines in fused)


@pytest.mark.parametrize("form", ["scan", "loop"])
def test_selective_scan_gradients_match_finite_differences(form, tmp_path):
    """The Mamba-style step (input-dependent Δ, B, C; A = −exp(A_log)) as a Scan and as a Loop that
    gathers row i: gradients of every weight, the projections before and after the recurrence included."""
    proto = selective_scan(form, steps=5, width=3, state=2)
    x = RNG.standard_normal((5, 3)).astype(np.float32)
    check_gradients(proto, ["W_dt", "b_dt", "W_B", "W_C", "W_out", "A_log"], {"x": x}, tmp_path)


@pytest.mark.parametrize("form", ["scan", "loop"])
def test_the_selective_scans_reverse_body_fuses_and_gives_the_gradients_of_its_kernels(form, tmp_path, monkeypatch):
    """The reverse Scan of the selective scan (its forward recomputed, ReduceGrad's broadcast, SumToShape's sums
    over either axis, a Sum of two sums after them) runs as one fused nest: its gradients match finite
    differences, and the body run kernel by kernel within float32 rounding (the sums' order differs)."""
    from odtrain import body_fusion, loops

    monkeypatch.setattr(loops, "COMPILE_FROM", 0)
    proto = selective_scan(form, steps=5, width=3, state=2)
    x = RNG.standard_normal((5, 3)).astype(np.float32)
    params = ["W_dt", "b_dt", "W_B", "W_C", "W_out", "A_log"]
    fused = []
    monkeypatch.setattr(loops, "fused_body", lambda *a: fused.append(body_fusion.fused_body(*a)) or fused[-1])
    check_gradients(proto, params, {"x": x}, tmp_path / "fused")
    assert len(fused) >= 2 and all(lines is not None for lines in fused)  # the forward and the reverse
    gradients, feeds = {}, {"x": RNG.standard_normal((40, 8)).astype(np.float32)}
    for fuses in (True, False):
        monkeypatch.setattr(loops, "fused_body", body_fusion.fused_body if fuses else lambda *a: None)
        gradients[fuses] = parameter_gradients(selective_scan(form, steps=40, width=8, state=4), params, feeds,
                                               tmp_path / str(fuses))
    for name in params:
        np.testing.assert_allclose(gradients[True][name], gradients[False][name], rtol=1e-5, atol=1e-6,
                                   err_msg=f"gradient of '{name}'")


def test_a_training_step_runs_a_scan_once_without_a_budget(tmp_path):
    """The states a Scan stacks for its backward are kept: rerunning the Scan is its body's work T times, which
    the cheap recomputation (graph/recompute.py's `cheap`) does not see in the bytes the node writes."""
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module
    from odtrain.graph.recompute import RECOMPUTE_SUFFIX

    proto = selective_scan("scan", steps=40, width=8, state=4)
    artifacts.generate_artifacts(proto, requires_grad=["W_dt", "W_out", "A_log"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    module = Module(tmp_path / "training_model.onnx", CheckpointState.load_checkpoint(tmp_path / "checkpoint"))
    module(RNG.standard_normal((40, 8)).astype(np.float32), np.zeros((40, 8), np.float32))
    order = next(iter(module._train.plans.values())).plan.order
    assert [n.op_type for n in order].count("Scan") == 2  # the forward and its reverse
    assert not [n.name for n in order if n.op_type == "Scan" and n.name.endswith(RECOMPUTE_SUFFIX)]


def parameter_gradients(proto, params: list[str], feeds: dict, folder) -> dict:
    """The gradients of `params` from one training step (MSE loss against zeros) on `feeds`."""
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module

    artifacts.generate_artifacts(proto, requires_grad=params, loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=folder)
    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx")
    outputs = oracle(proto, {k: v.astype(np.float32) for k, v in feeds.items()})
    module(*[feeds[i.name] for i in proto.graph.input], np.zeros_like(outputs[0]))
    return {name: np.array(state.parameters[name].grad) for name in params}


def test_recording_a_step_records_the_kernels_of_its_bodies():
    """A kernel library is built from the calls steps record (odtrain compile): a loop's body kernels are
    among them, nested bodies' too, so a library can hold what a device runs inside loops."""
    from odtrain.executor import record_calls
    from odtrain.kernel_library import kernel_name

    proto = nested_model()
    session = InferenceSession(proto)
    with record_calls() as calls:
        session.run(None, random_feeds(proto))
    names = {kernel_name(kernel) for kernel, _ in calls}
    assert "odtrain.kernels.linalg:_gemm_batched" in names, names  # the inner If's MatMul
    assert any(name and "sum" in name.lower() for name in names), names  # the Scan body's ReduceSum


def test_a_loop_over_rows_becomes_a_scan_when_artifacts_are_prepared(tmp_path):
    """The selective scan's Loop reads x[i], Δ[i], B[i], C[i] over a constant trip count: it becomes a Scan
    over those rows, which computes the same, and its gradient stacks rows instead of summing a dense
    tensor each iteration."""
    from odtrain import artifacts
    from odtrain.graph.control_flow import loops_as_scans

    proto = selective_scan("loop", steps=6, width=3, state=2)
    graph = load_graph(proto)
    converted = loops_as_scans(graph)
    assert [n.op_type for n in graph.nodes if n.op_type in ("Loop", "Scan")] == ["Loop"]
    assert [n.op_type for n in converted.nodes if n.op_type in ("Loop", "Scan")] == ["Scan"]
    x = RNG.standard_normal((6, 3)).astype(np.float32)
    np.testing.assert_allclose(InferenceSession(graph_to_proto(converted)).run(None, {"x": x})[0],
                               onnxruntime_run(proto, {"x": x})[0], rtol=1e-5, atol=1e-6)
    artifacts.generate_artifacts(proto, requires_grad=["W_dt"], loss=artifacts.LossType.MSELoss,
                                 artifact_directory=tmp_path)
    import onnx

    trained = {n.op_type for n in onnx.load(str(tmp_path / "training_model.onnx")).graph.node}
    assert "Scan" in trained and "Loop" not in trained


DEVICE_STEPS = """
import importlib.abc, os, sys
class NotInstalled(importlib.abc.MetaPathFinder):  # the device: the compiler's modules are not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("numba", "llvmlite", "scipy", "onnx") and "--device" in sys.argv:
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
sys.meta_path.insert(0, NotInstalled())
import numpy as np
from odtrain.api import CheckpointState, Module, Optimizer
folder = sys.argv[1]
state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
module = Module(os.path.join(folder, "training_model.onnx"), state, os.path.join(folder, "eval_model.onnx"))
optimizer = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
rng = np.random.default_rng(0)
x, y = rng.standard_normal((%d, %d, %d)).astype(np.float32), rng.standard_normal((%d, 2)).astype(np.float32)
losses = []
for _ in range(3):
    losses.append(float(module(x, y)))
    optimizer.step()
    module.lazy_reset_grad()
module.eval()
losses.append(float(module(x, y)))
print(module.kernel_library is not None, "numba" in sys.modules, [loss.hex() for loss in losses])
""" % (T, BATCH, INPUT, BATCH)


def test_a_scan_model_trains_on_the_device_route_with_the_jits_bits(tmp_path):
    """`odtrain compile` records the Scan body's kernels with the step's, so a device with numpy and odtrain
    only (numba, llvmlite, scipy and onnx not importable) trains the GRU-as-Scan model with the library,
    its losses those of the JIT's kernels bit for bit."""
    import os
    import subprocess
    import sys

    from odtrain import artifacts
    from odtrain.library_build import compile_artifacts

    artifacts.generate_artifacts(gru_as_scan(gru_parameters(np.random.default_rng(5))),
                                 requires_grad=["Wt", "Rt", "Wb", "Rb", "V"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    compile_artifacts(tmp_path, thread_counts=(1,), input_shapes={"X": [T, BATCH, INPUT], "target": [BATCH, 2]},
                      out=lambda *a: None)
    script = tmp_path / "steps.py"
    script.write_text(DEVICE_STEPS)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "ODTRAIN_NUM_THREADS": "1", "PYTHONPATH": root}  # this checkout's odtrain

    def run(*flags):
        done = subprocess.run([sys.executable, str(script), str(tmp_path), *flags], capture_output=True, text=True,
                              env=env, cwd=root, timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1]

    device = run("--device")
    assert device.startswith("True False"), device  # the library ran, numba never loaded
    os.rename(tmp_path / "kernels", tmp_path / "kernels.off")
    jit = run()
    assert jit.startswith("False True"), jit
    assert device.split(" ", 2)[2] == jit.split(" ", 2)[2]


def test_a_frozen_loop_whose_condition_depends_on_the_data_trains_the_head_after_it(tmp_path):
    """No gradient has to cross a frozen encoder: a while loop (its gradient refused) under a trainable
    head trains, the loop's weight left as it was."""
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module, Optimizer

    proto = while_model()
    proto.graph.initializer.append(numpy_helper.from_array(np.full(3, 0.5, np.float32), "scale"))
    proto.graph.initializer.append(weight("head", (3, 2)))
    proto.graph.node[0].attribute[0].g.node[0].input[1] = "scale"  # x_out = x_in + scale: a frozen weight
    proto.graph.node.extend([helper.make_node("Unsqueeze", ["y", "row_axis"], ["y_row"]),
                             helper.make_node("MatMul", ["y_row", "head"], ["logits"])])
    proto.graph.initializer.append(numpy_helper.from_array(np.array([0], np.int64), "row_axis"))
    del proto.graph.output[:]
    proto.graph.output.append(tensor("logits", [1, 2]))
    artifacts.generate_artifacts(proto, requires_grad=["head"], frozen_params=["scale"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    x, target = np.array([0.1, 0.2, 0.3], np.float32), np.array([[1.0, -1.0]], np.float32)
    losses = []
    for _ in range(5):
        losses.append(float(module(x, target)))
        optimizer.step()
        module.lazy_reset_grad()
    assert losses[-1] < losses[0]
    np.testing.assert_array_equal(state.parameters["scale"].data, np.full(3, 0.5, np.float32))


def test_the_eval_model_runs_the_nodes_of_bodies_in_their_eval_form(tmp_path):
    """A Dropout in training mode inside a Scan body drops in the training model and passes its input in
    the eval model, as at the top level."""
    import onnx

    from odtrain import artifacts

    body = helper.make_graph([helper.make_node("Dropout", ["x_t", "ratio", "training"], ["dropped"]),
                              helper.make_node("Mul", ["dropped", "w"], ["s_out"]),
                              helper.make_node("Identity", ["s_out"], ["y_t"])], "body",
                             [tensor("s_in", [4]), tensor("x_t", [4])], [tensor("s_out", [4]), tensor("y_t", [4])])
    proto = model([helper.make_node("Scan", ["s0", "x"], ["s", "ys"], body=body, num_scan_inputs=1, name="scan")],
                  [tensor("x", [3, 4])], [tensor("ys", [3, 4])],
                  [weight("w", (4,)), numpy_helper.from_array(np.zeros(4, np.float32), "s0"),
                   numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
                   numpy_helper.from_array(np.array(True), "training")])
    artifacts.generate_artifacts(proto, requires_grad=["w"], loss=artifacts.LossType.MSELoss,
                                 artifact_directory=tmp_path)
    evaluated = onnx.load(str(tmp_path / "eval_model.onnx"))
    inner = [n.op_type for n in evaluated.graph.node[0].attribute[0].g.node]
    assert "Dropout" not in inner and "Identity" in inner
    trained = onnx.load(str(tmp_path / "training_model.onnx"))
    scan = next(n for n in trained.graph.node if n.op_type == "Scan")
    assert "Dropout" in [n.op_type for n in scan.attribute[0].g.node]
