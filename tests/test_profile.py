"""The step profile: its nodes are the bound step's calls, its times are positive and add up to its total,
its product operations are counted independently here, and `odtrain profile` prints the same report as
text or JSON with the command line's exit codes. No assertion is about how fast anything ran.

Oracles: a training step bound separately at the same batch size (its calls, grouped by node), the
convolution and product shapes of that step (operations counted here from the shapes), the ops each
phase may hold (the loss in forward, its gradient in backward, the optimizer by itself).
"""
import dataclasses
import json
import math

import numpy as np
import pytest

from odtrain.api import CheckpointState, Module
from odtrain.graph.cost import product_flops
from odtrain.graph.ir import ODTRAIN_DOMAIN, Node, TensorType
from odtrain.profile import PHASES, gemm_peak, profile_artifacts, timed_calls
from conftest import odtrain_main, reference_artifacts

BATCH, STEPS = 4, 2


@pytest.fixture(scope="module")
def cnn_artifacts(tmp_path_factory):
    return reference_artifacts("cnn", tmp_path_factory.mktemp("cnn_profile"))


@pytest.fixture(scope="module")
def profiled(cnn_artifacts):
    return profile_artifacts(cnn_artifacts, BATCH, steps=STEPS)


@pytest.fixture(scope="module")
def bound_step(cnn_artifacts):
    """The training step bound again, separately, at the profile's batch size."""
    state = CheckpointState.load_checkpoint(cnn_artifacts / "checkpoint")
    module = Module(cnn_artifacts / "training_model.onnx", state, cnn_artifacts / "eval_model.onnx")
    return module.executable_step_at(BATCH)


def test_the_nodes_are_the_bound_steps_calls(profiled, bound_step):
    expected = []  # (name, op type, calls) per node, in call order
    for node in bound_step.call_nodes:
        name = "(gradient accumulation)" if node is None else node.name
        if expected and expected[-1][0] == name:
            expected[-1][2] += 1
        else:
            expected.append([name, node.op_type if node else "Add", 1])
    kernel_nodes = [n for n in profiled.nodes if n.phase in ("forward", "backward")]
    assert [[n.name, n.op_type, n.calls] for n in kernel_nodes] == expected
    assert sum(n.calls for n in kernel_nodes) == len(bound_step.calls)
    assert [n.phase for n in profiled.nodes if n.phase not in ("forward", "backward")] == ["feeds", "optimizer"]


def test_times_are_positive_and_add_up(profiled):
    assert profiled.steps == STEPS and profiled.batch_size == BATCH
    assert all(n.seconds > 0 for n in profiled.nodes)
    assert profiled.step_seconds > 0
    assert math.isclose(sum(profiled.phases.values()), profiled.profiled_seconds, rel_tol=1e-9)
    assert math.isclose(sum(g.seconds for g in profiled.op_types), profiled.profiled_seconds, rel_tol=1e-9)
    assert sum(g.nodes for g in profiled.op_types) == len(profiled.nodes)
    assert set(profiled.peaks) >= {1} and all(v > 0 for v in profiled.peaks.values())


def test_phases_hold_what_they_should(profiled):
    phase = {n.op_type: n.phase for n in profiled.nodes}
    assert phase["Conv"] == "forward" and phase["SoftmaxCrossEntropyLoss"] == "forward"
    assert phase["ConvWeightGrad"] == "backward" and phase["SoftmaxCrossEntropyLossGrad"] == "backward"
    assert phase["AdamW"] == "optimizer"
    last_forward = max(i for i, n in enumerate(profiled.nodes) if n.phase == "forward")
    first_backward = min(i for i, n in enumerate(profiled.nodes) if n.phase == "backward")
    assert last_forward < first_backward


def conv_flops(x_shape, w_shape, y_shape) -> float:
    """2 per multiply-add: every output element sums C/group · kernel products."""
    return 2.0 * math.prod(y_shape) * math.prod(w_shape[1:])


def test_products_count_their_operations(profiled, bound_step):
    types = bound_step.types
    expected = {}
    for node in bound_step.order:
        if node.op_type == "Conv":
            x, w, y = (types[v].shape for v in (node.inputs[0], node.inputs[1], node.outputs[0]))
            expected[node.name] = conv_flops(x, w, y)
        elif node.op_type in ("ConvInputGrad", "ConvWeightGrad"):  # (dY, W, X) and (dY, X, W): the forward's work
            dy, w = types[node.inputs[0]].shape, types[node.inputs[1 if node.op_type == "ConvInputGrad" else 2]].shape
            expected[node.name] = conv_flops(None, w, dy)
        elif node.op_type == "Gemm":
            a, out = types[node.inputs[0]].shape, types[node.outputs[0]].shape
            expected[node.name] = 2.0 * math.prod(out) * (a[0] if node.attrs.get("transA") else a[1])
    counted = {n.name: n.flops for n in profiled.nodes if n.flops}
    assert counted == pytest.approx(expected)
    assert profiled.product_flops == pytest.approx(sum(expected.values()))
    assert all(n.gflops_per_second > 0 for n in profiled.nodes if n.flops)


def test_matmul_gradients_count_the_forward_products_operations():
    f32 = np.dtype(np.float32)
    types = {"a": TensorType(f32, (3, 5, 7)), "b": TensorType(f32, (7, 2)), "y": TensorType(f32, (3, 5, 2))}
    forward = product_flops(Node("MatMul", ["a", "b"], ["y"]), types)
    assert forward == 2.0 * 3 * 5 * 2 * 7
    # the gradient ops of odtrain's domain, as autodiff writes them (their registrations say they are products)
    assert product_flops(Node("MatMulGradA", ["y", "b", "a"], ["da"], domain=ODTRAIN_DOMAIN), types) == forward
    assert product_flops(Node("MatMulGradB", ["a", "y", "b"], ["db"], domain=ODTRAIN_DOMAIN), types) == forward
    assert product_flops(Node("Relu", ["a"], ["r"]), types) == 0.0


def test_the_timed_loop_runs_each_call_once():
    ran = []
    calls = [(ran.append, (index,)) for index in range(5)]
    elapsed = np.full(len(calls), -1.0)
    timed_calls(calls, elapsed)
    assert ran == list(range(5)) and (elapsed >= 0).all()


def test_the_peak_is_measured_once_per_process():
    first = gemm_peak(1)
    assert first > 0 and gemm_peak(1) == first


def test_the_first_line_is_the_whole_step_against_the_gemm_peak(profiled):
    """Training FLOPs over the untimed step's time over the peak: what is left between the products counts."""
    rate = profiled.product_flops / profiled.step_seconds / 1e9
    first = profiled.render().splitlines()[0]
    assert first.startswith(f"whole step: {100 * rate / profiled.peak:.0f}% of the float32 GEMM peak ({rate:.1f} of "
                            f"{profiled.peak:.1f} GF/s"), first
    step = profiled.to_dict()["step"]
    assert step["gflops_per_second"] == pytest.approx(rate) and step["of_peak"] == pytest.approx(rate / profiled.peak)


def test_no_share_exceeds_a_peak_that_a_busy_machine_slowed(profiled):
    """Measured while other work ran, the peak may fall below a product's rate: the shares are then of that
    product's rate, and the report says so."""
    fastest = profiled.fastest_product
    slowed = dataclasses.replace(profiled, peaks={k: fastest.gflops_per_second / 2 for k in profiled.peaks})
    assert slowed.peak == fastest.gflops_per_second and slowed.peak_source == f"node {fastest.name}"
    rates = [n.gflops_per_second for n in slowed.nodes] + [g.gflops_per_second for g in slowed.op_types]
    assert max(slowed._of_peak(r) for r in rates if r) == pytest.approx(1.0)
    assert f"reached by node {fastest.name}: faster than the GEMM peak measured here" in slowed.render()
    calm = dataclasses.replace(profiled, peaks={k: fastest.gflops_per_second * 2 for k in profiled.peaks})
    assert calm.peak_source == "measured" and "reached by" not in calm.render()
    assert calm.to_dict()["of_peak_against"] == {"gflops_per_second": calm.peak, "source": "measured"}


# ---- the command line -------------------------------------------------------------------------------------


def test_cli_prints_the_report(cnn_artifacts, capsys):
    code, out, err = odtrain_main(capsys, "profile", cnn_artifacts, "--batch-size", BATCH, "--steps", 1, "--top", 3)
    assert code == 0 and not err
    assert f"training step at batch size {BATCH}" in out and "by op type:" in out
    assert "the 3 slowest of" in out and "products (BLAS)" in out


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_cli_json_has_every_node_and_op_type(cnn_artifacts, capsys, clock):
    code, out, _ = odtrain_main(capsys, "profile", cnn_artifacts, "--batch-size", BATCH, "--steps", 1, "--json",
                                "--clock", clock)
    assert code == 0
    report = json.loads(out)
    assert {"artifacts", "batch_size", "steps", "threads", "numba_threads", "clock", "step_ms", "profiled_ms", "phases_ms", "products",
            "gemm_peak_gflops_per_second", "op_types", "nodes"} <= set(report)
    assert list(report["phases_ms"]) == list(PHASES)
    assert report["batch_size"] == BATCH and report["steps"] == 1 and report["clock"] == clock
    for row in report["nodes"]:
        assert set(row) == {"name", "op_type", "phase", "calls", "ms", "gflop", "gflops_per_second"}
        assert row["phase"] in PHASES and (row["ms"] > 0 or clock == "cpu")  # a CPU clock may tick coarsely
    assert sum(row["ms"] for row in report["nodes"]) == pytest.approx(report["profiled_ms"])
    assert sum(row["nodes"] for row in report["op_types"]) == len(report["nodes"])
    assert set(report["products"]) == {"ms", "gflop", "gflops_per_second", "of_peak"}


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "batch size must be an integer of at least 1"),
    (["--batch-size", "2", "--steps", "0"], "steps must be an integer of at least 1"),
    (["--batch-size", "2", "--threads", "0"], "--threads must be a positive whole number of threads"),
])
def test_cli_refuses_bad_numbers(cnn_artifacts, capsys, argv, message):
    code, out, err = odtrain_main(capsys, "profile", cnn_artifacts, *argv)
    assert code == 2 and not out and message in err and len(err.strip().splitlines()) == 1


def test_cli_names_a_missing_folder(tmp_path, capsys):
    code, _, err = odtrain_main(capsys, "profile", tmp_path / "nowhere", "--batch-size", "2")
    assert code == 2 and "does not exist" in err and "odtrain prepare" in err


def test_cli_needs_a_batch_size(cnn_artifacts, capsys):
    code, _, err = odtrain_main(capsys, "profile", cnn_artifacts)
    assert code == 2 and "--batch-size" in err


def test_cli_profiles_a_language_model_at_a_sequence_length(tmp_path, capsys):
    """Inputs [batch, seq]: --seq-len binds the sequence axis; without it the command says what to give."""
    from onnx import helper

    from odtrain import artifacts
    from oracles import make_model

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["embed", "ids"], ["h"]), helper.make_node("MatMul", ["h", "head"], ["logits"])]
    model = make_model(nodes, {"embed": rng.standard_normal((7, 4)).astype(np.float32),
                               "head": rng.standard_normal((4, 7)).astype(np.float32)},
                       inputs=[("ids", np.int64, ["batch", "seq"])], outputs=[("logits", np.float32, ["batch", "seq", 7])])
    artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, class_axis=-1,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path)
    code, out, err = odtrain_main(capsys, "profile", tmp_path, "--batch-size", 2, "--seq-len", 5, "--steps", 1,
                                  "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["sequence_length"] == 5 and {row["op_type"] for row in report["nodes"]} >= {"Gather", "LinearCrossEntropy"}
    code, _, err = odtrain_main(capsys, "profile", tmp_path, "--batch-size", 2, "--steps", 1)
    assert code == 2 and "--seq-len N" in err
