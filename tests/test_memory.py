"""Memory: recomputation under a budget gives identical results; impossible budgets say what works."""
import numpy as np
import pytest
from onnx import helper

from odtrain import MemoryBudgetError, artifacts
from odtrain.api import CheckpointState, Module, Optimizer
from oracles import make_model

WIDTH, DEPTH, BATCH = 64, 24, 32


@pytest.fixture(scope="module")
def deep_mlp(tmp_path_factory):
    """A deep tanh MLP: its saved activations dominate the arena, as in a real network."""
    rng = np.random.default_rng(3)
    nodes, params, previous = [], {}, "x"
    for layer in range(DEPTH):
        params[f"w{layer}"] = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        params[f"b{layer}"] = np.zeros(WIDTH, np.float32)
        nodes += [helper.make_node("Gemm", [previous, f"w{layer}", f"b{layer}"], [f"h{layer}"], name=f"fc{layer}"),
                  helper.make_node("Tanh", [f"h{layer}"], [f"a{layer}"], name=f"act{layer}")]
        previous = f"a{layer}"
    model = make_model(nodes, params, inputs=[("x", np.float32, ["batch", WIDTH])],
                       outputs=[(previous, np.float32, ["batch", WIDTH])])
    directory = tmp_path_factory.mktemp("deep")
    artifacts.generate_artifacts(model, requires_grad=list(params), loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=directory)
    x = rng.standard_normal((5, BATCH, WIDTH)).astype(np.float32)
    y = rng.standard_normal((5, BATCH, WIDTH)).astype(np.float32)
    return directory, x, y


def train(directory, x, y, **options):
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, **options)
    optimizer = Optimizer(directory / "optimizer_model.onnx", module)
    losses = []
    for step in range(len(x)):
        losses.append(float(module(x[step], y[step])))
        optimizer.step()
        module.lazy_reset_grad()
    bound = next(iter(module._train.plans.values()))
    return losses, module.get_contiguous_parameters(), bound


def test_half_the_arena_trains_identically(deep_mlp):
    directory, x, y = deep_mlp
    losses, params, free = train(directory, x, y)
    budget = free.plan.arena_bytes // 2
    budget_losses, budget_params, tight = train(directory, x, y, memory_budget=budget)
    assert tight.plan.arena_bytes <= budget and tight.recomputed > 0
    tight.plan.verify()
    assert budget_losses == losses
    np.testing.assert_array_equal(budget_params, params)


def test_an_impossible_budget_names_the_smallest_that_works(deep_mlp):
    directory, x, y = deep_mlp
    with pytest.raises(MemoryBudgetError, match="at least") as info:
        train(directory, x, y, memory_budget=1000)
    smallest = int(str(info.value).split("at least ")[1].split(" ")[0].replace(",", ""))
    _, _, bound = train(directory, x, y, memory_budget=smallest)
    assert bound.plan.arena_bytes <= smallest


@pytest.mark.parametrize("kind", [artifacts.OptimType.SGD, artifacts.OptimType.AdamW])
def test_fused_updates_give_identical_parameters(kind, mlp_reference, tmp_path):
    path, meta, golden = mlp_reference
    artifacts.generate_artifacts(str(path), requires_grad=meta["requires_grad"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=kind, artifact_directory=tmp_path)
    results = []
    for fused in (False, True):
        state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
        module = Module(tmp_path / "training_model.onnx", state)
        optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module, fuse_with_backward=fused)
        optimizer.set_learning_rate(0.01)
        losses = []
        for step in range(6):
            losses.append(float(module(golden["x"][step], golden["y"][step])))
            optimizer.step()
            module.lazy_reset_grad()
        bound = next(iter(module._train.plans.values()))
        results.append((losses, module.get_contiguous_parameters(), state._optimizer.step, bound.plan.arena_bytes))
    (plain_losses, plain_params, plain_steps, plain_arena), (fused_losses, fused_params, fused_steps, fused_arena) = results
    assert fused_losses == plain_losses and fused_steps == plain_steps == 6
    np.testing.assert_array_equal(fused_params, plain_params)
    # no gradient buffer is touched: gradients live in the arena only until their update
    assert fused_arena < plain_arena + 500 * 784 * 4


def test_the_report_states_the_plans_and_buffers(mlp_artifacts, mlp_reference):
    from odtrain.memory import report

    golden = mlp_reference[2]
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", state, mlp_artifacts / "eval_model.onnx")
    Optimizer(mlp_artifacts / "optimizer_model.onnx", module)
    module(golden["x"][0], golden["y"][0])
    module.eval()
    module(golden["x"][0][:5], golden["y"][0][:5])
    result = report(module)
    train_plan, eval_plan = next(iter(module._train.plans.values())), next(iter(module._eval.plans.values()))
    assert [(p.mode, p.arena_bytes, p.lower_bound) for p in result.plans] == [
        ("train", train_plan.plan.arena_bytes, train_plan.plan.lower_bound),
        ("eval", eval_plan.plan.arena_bytes, eval_plan.plan.lower_bound)]
    assert result.plans[1].shapes == (("input", (5, 784)), ("labels", (5,)))
    assert result.gradient_bytes == state._store.grad_flat.nbytes == 397510 * 4
    assert result.optimizer_bytes == 2 * 397510 * 4 and result.parameter_bytes == 397510 * 4
    assert result.training_bytes == (result.gradient_bytes + result.optimizer_bytes + result.arena_bytes
                                     + sum(p.constant_bytes for p in result.plans))
    assert "training adds" in result.render() and "lower bound" in result.render()
