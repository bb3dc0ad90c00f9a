"""The memory report: its numbers are the plans' and the buffers', its timeline sums to the live groups,
`odtrain memory` prints the same numbers as the Python API, a budget recomputes, and --plot draws a PNG.

Oracles: the plan's own groups and types (summed here, not by the code under test), a Module that ran a
real step at the same batch size, and the parameter sizes read back from the checkpoint file.
"""
import json
import sys

import numpy as np
import pytest

from odtrain import MemoryBudgetError, artifacts
from odtrain import checkpoint as checkpoint_file
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.demo import build_classifier
from odtrain.graph.errors import ArtifactNotFoundError
from odtrain.graph.ir import Node, TensorType
from odtrain.graph.planner import ALIGNMENT, CATEGORIES, plan_memory
from odtrain.memory import from_artifacts, report
from conftest import odtrain_main, reference_artifacts

BATCH = 16


@pytest.fixture(scope="module")
def cnn_artifacts(tmp_path_factory):
    """SGD artifacts of the reference CNN (convolutions with scratch, batch norms with frozen statistics)."""
    return reference_artifacts("cnn", tmp_path_factory.mktemp("cnn_artifacts"), "SGD")


def live_group_bytes(plan) -> np.ndarray:
    """Bytes of the groups live at each step 0..steps+1, summed from the plan's groups."""
    return np.array([sum(g.nbytes for g in plan.groups if g.start <= step <= g.end) for step in range(plan.steps + 2)])


def no_reuse(plan) -> int:
    return sum(-(-plan.types[name].nbytes // ALIGNMENT) * ALIGNMENT for g in plan.groups for name in g.values)


def parameter_bytes(directory) -> tuple[int, int]:
    """(trainable, frozen) bytes of the checkpoint's parameters."""
    contents = checkpoint_file.load(directory / "checkpoint")
    trainable = sum(a.nbytes for n, a in contents.parameters.items() if n in contents.trainable)
    return trainable, sum(a.nbytes for a in contents.parameters.values()) - trainable


# ---- the numbers ------------------------------------------------------------------------------------------


def test_the_report_holds_the_plans_numbers(cnn_artifacts):
    result = from_artifacts(cnn_artifacts, BATCH)
    assert [p.mode for p in result.plans] == ["train", "eval"]
    for memory in result.plans:
        plan = memory.plan
        plan.verify()
        assert memory.shapes == (("input", (BATCH, 3, 32, 32)), ("labels", (BATCH,)))
        assert (memory.arena_bytes, memory.lower_bound) == (plan.arena_bytes, plan.lower_bound)
        assert memory.no_reuse_bytes == no_reuse(plan) > memory.arena_bytes >= memory.lower_bound
        assert memory.recomputed_nodes == 0
    trainable, frozen = parameter_bytes(cnn_artifacts)
    assert frozen > 0 and (result.trainable_parameter_bytes, result.frozen_parameter_bytes) == (trainable, frozen)
    assert result.gradient_bytes == trainable and result.optimizer_bytes == 0  # SGD keeps no state
    assert result.arena_bytes == max(p.arena_bytes for p in result.plans)
    assert result.training_bytes == (result.gradient_bytes + result.optimizer_bytes + result.arena_bytes
                                     + sum(p.constant_bytes for p in result.plans))
    assert result.peak_bytes == trainable + frozen + result.training_bytes


def test_binding_without_a_step_predicts_what_a_step_binds(mlp_artifacts, mlp_reference):
    golden = mlp_reference[2]
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", state, mlp_artifacts / "eval_model.onnx")
    Optimizer(mlp_artifacts / "optimizer_model.onnx", module)
    module(golden["x"][0][:BATCH], golden["y"][0][:BATCH])
    module.eval()
    module(golden["x"][0][:BATCH], golden["y"][0][:BATCH])
    assert report(module).to_dict() == from_artifacts(mlp_artifacts, BATCH).to_dict()


@pytest.mark.parametrize("optimizer, moments", [(artifacts.AdamW(), 2), (artifacts.SGD(), 0),
                                                (artifacts.SGDMomentum(momentum=0.9), 1)])
def test_optimizer_state_is_what_the_optimizer_model_keeps(tmp_path, optimizer, moments):
    artifacts.generate_artifacts(build_classifier()[0], requires_grad=["fc2.weight", "fc2.bias"],
                                 frozen_params=["fc1.weight", "fc1.bias"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=optimizer, artifact_directory=tmp_path)
    trainable, frozen = parameter_bytes(tmp_path)
    result = from_artifacts(tmp_path, 8)
    assert (trainable, frozen) == (330 * 4, 2080 * 4)
    assert (result.trainable_parameter_bytes, result.frozen_parameter_bytes) == (trainable, frozen)
    assert result.optimizer_bytes == moments * trainable and len(result.optimizer_states) == moments
    assert result.optimizer_kind == optimizer.kind
    (tmp_path / "optimizer_model.onnx").unlink()  # without an optimizer model: no optimizer state
    assert from_artifacts(tmp_path, 8).optimizer_bytes == 0


# ---- the timeline ------------------------------------------------------------------------------------------


def test_the_timeline_sums_to_the_live_groups_and_peaks_at_the_lower_bound(cnn_artifacts):
    for memory in from_artifacts(cnn_artifacts, BATCH).plans:
        plan = memory.plan
        rows = memory.timeline()
        assert list(rows) == list(CATEGORIES)
        total = sum(rows.values())
        np.testing.assert_array_equal(total, live_group_bytes(plan))
        assert total.max() == plan.lower_bound
        scratch = [g for g in plan.groups if g.values[0].endswith("::scratch")]
        assert scratch and all(len(g.values) == 1 for g in scratch)
        np.testing.assert_array_equal(rows["scratch"], [sum(g.nbytes for g in scratch if g.start <= step <= g.end)
                                                        for step in range(plan.steps + 2)])
        feeds = sum(plan.groups[plan.group_of[name]].nbytes for name in ("input", "labels"))
        assert rows["inputs"][0] == total[0] == feeds  # step 0: the feeds, written before the first node
        if memory.mode == "train":  # the loss ends the forward pass; the backward pass holds gradients after it
            assert rows["saved for backward"].max() > 0 and rows["backward"][:memory.loss_step + 1].max() == 0
            assert rows["backward"][memory.loss_step + 1:].max() > 0 and rows["recomputed"].max() == 0
        else:
            assert rows["saved for backward"].max() == rows["backward"].max() == 0


def test_a_group_counts_under_the_value_it_holds_at_each_step():
    t = TensorType(np.dtype(np.float32), (100,))
    nodes = [Node("Relu", ["x"], ["a"]), Node("Relu", ["a"], ["b"]), Node("Neg", ["b"], ["c"])]
    plan = plan_memory(nodes, {name: t for name in "xabc"}, set("xabc"), ["x"], ["c"])
    assert plan.group_of["x"] == plan.group_of["a"] == plan.group_of["b"] == plan.group_of["c"]  # all in place
    rows = plan.live_bytes(lambda name: name)
    size = plan.groups[0].nbytes
    assert {name: list(row) for name, row in rows.items()} == {
        "x": [size, 0, 0, 0, 0], "a": [0, size, 0, 0, 0], "b": [0, 0, size, 0, 0], "c": [0, 0, 0, size, size]}
    assert plan.no_reuse_bytes == 4 * size and plan.arena_bytes == size


# ---- the command line ---------------------------------------------------------------------------------------


def test_the_command_prints_the_python_api_numbers(mlp_artifacts, capsys):
    code, out, err = odtrain_main(capsys, "memory", mlp_artifacts, "--batch-size", BATCH, "--json")
    assert code == 0 and not err
    printed = json.loads(out)
    expected = from_artifacts(mlp_artifacts, BATCH).to_dict()
    assert {k: printed[k] for k in expected} == json.loads(json.dumps(expected))
    assert (printed["batch_size"], printed["budget_bytes"]) == (BATCH, None)
    assert isinstance(printed["plans"][0]["arena_bytes"], int) and printed["optimizer"]["kind"] == "AdamW"

    code, out, err = odtrain_main(capsys, "memory", mlp_artifacts, "--batch-size", BATCH)
    assert code == 0 and not err
    train = expected["plans"][0]
    for text in ("training step (input[16, 784], labels[16]", "eval step", "lower bound", "without reuse",
                 "recomputed nodes", "training adds", "predicted peak", "runtime floor", "AdamW: momentum0, momentum1",
                 f"{train['arena_bytes'] / train['lower_bound_bytes']:.2f}x its lower bound"):
        assert text in out, text


def test_a_budget_recomputes_and_shrinks_the_arena(cnn_artifacts, capsys):
    free = from_artifacts(cnn_artifacts, BATCH).plans[0]
    budget = int(free.arena_bytes * 0.75)
    code, out, err = odtrain_main(capsys, "memory", cnn_artifacts, "--batch-size", BATCH, "--budget", budget, "--json")
    assert code == 0 and not err
    printed = json.loads(out)
    tight = from_artifacts(cnn_artifacts, BATCH, memory_budget=budget)
    assert {k: printed[k] for k in ("plans", "training_bytes")} == json.loads(json.dumps(
        {k: tight.to_dict()[k] for k in ("plans", "training_bytes")}))
    train = tight.plans[0]
    assert printed["budget_bytes"] == budget and train.arena_bytes <= budget < free.arena_bytes
    assert train.recomputed_nodes == sum(1 for n in train.plan.order if n.name.endswith("::recomputed")) > 0
    assert train.timeline()["recomputed"].max() > 0
    assert tight.plans[1].arena_bytes == from_artifacts(cnn_artifacts, BATCH).plans[1].arena_bytes  # eval: no budget


def test_an_unmeetable_budget_is_one_clear_error(cnn_artifacts, capsys):
    code, out, err = odtrain_main(capsys, "memory", cnn_artifacts, "--batch-size", BATCH, "--budget", "1KB")
    assert code == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("odtrain memory: error: a memory budget of 1,000 bytes")
    assert "at least" in lines[0]
    with pytest.raises(MemoryBudgetError, match="at least"):
        from_artifacts(cnn_artifacts, BATCH, memory_budget=1000)


def test_wrong_arguments_fail_with_one_line(tmp_path, capsys):
    code, _, err = odtrain_main(capsys, "memory", tmp_path / "nowhere", "--batch-size", 4)
    assert code == 2 and "is not an artifact folder" in err and len(err.strip().splitlines()) == 1
    code, _, err = odtrain_main(capsys, "memory", tmp_path, "--batch-size", 0)
    assert code == 2 and "--batch-size" in err
    code, _, err = odtrain_main(capsys, "memory", tmp_path, "--batch-size", 4, "--budget", "lots")
    assert code == 2 and "is not a size" in err
    with pytest.raises(ArtifactNotFoundError):
        from_artifacts(tmp_path, 4)
    code, out, _ = odtrain_main(capsys, "memory", "--help")
    assert code == 0 and out.startswith("usage: odtrain memory")


# ---- the plot -----------------------------------------------------------------------------------------------


def test_plot_writes_a_png(mlp_artifacts, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    target = tmp_path / "memory.png"
    code, out, err = odtrain_main(capsys, "memory", mlp_artifacts, "--batch-size", BATCH, "--budget", "10MB",
                                  "--plot", target)
    assert code == 0 and not err and f"written to {target}" in out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and target.stat().st_size > 10_000


def test_plot_without_matplotlib_says_what_to_install(mlp_artifacts, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    code, out, err = odtrain_main(capsys, "memory", mlp_artifacts, "--batch-size", BATCH, "--plot", tmp_path / "m.png")
    assert code == 2 and not out and 'pip install matplotlib' in err
    assert not (tmp_path / "m.png").exists()
