"""Memory: recomputation under a budget gives identical results, recomputes cheap ops rather than
products, never random ones; impossible budgets say what works."""
import re
from collections import Counter
from functools import partial

import numpy as np
import pytest
from onnx import helper

from odtrain import MemoryBudgetError, artifacts
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.graph.cost import node_cost
from odtrain.graph.ir import Node, TensorType
from odtrain.graph import recompute
from odtrain.graph.recompute import RECOMPUTE_SUFFIX
from oracles import make_model

WIDTH, DEPTH, BATCH = 64, 24, 32


@pytest.fixture(autouse=True)
def per_op_nodes(monkeypatch):
    """The recomputation choices are read from the plan's nodes, their op types and names: planned without the
    element-wise fusion, which would merge a recomputed Mul and Relu into one node (tests/test_elementwise_fusion.py
    holds a fused step to its budget)."""
    monkeypatch.setenv("ODTRAIN_ELEMENTWISE_FUSION", "0")


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


def train_keeping_every_activation(directory, x, y, **options):
    """`train` with no node cheap enough to be recomputed by default: every saved activation kept."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recompute, "CHEAP_UNITS", -1.0)
        return train(directory, x, y, **options)


def test_half_the_arena_trains_identically(deep_mlp):
    directory, x, y = deep_mlp
    losses, params, free = train(directory, x, y)
    budget = free.plan.arena_bytes // 2
    budget_losses, budget_params, tight = train(directory, x, y, memory_budget=budget)
    assert tight.plan.arena_bytes <= budget and tight.recomputed > 0
    tight.plan.verify()
    assert budget_losses == losses
    np.testing.assert_array_equal(budget_params, params)


def recomputed_ops(bound) -> Counter:
    return Counter(node.op_type for node in bound.plan.order if node.name.endswith(RECOMPUTE_SUFFIX))


@pytest.fixture(scope="module")
def scaled_mlp(tmp_path_factory):
    """MatMul -> Mul by a trained scale -> Relu, 8 times (then Dropout, then a last MatMul).

    The scale's gradient reads the MatMul's output and the next MatMul's weight gradient reads
    the Relu's, so both are saved, of equal size: dropping a Relu output costs a Mul and a Relu
    again, dropping a MatMul output a matrix product. Dropout's output and mask are saved too."""
    rng = np.random.default_rng(5)
    nodes, params, previous = [], {}, "x"
    for layer in range(8):
        params[f"w{layer}"] = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        params[f"s{layer}"] = (1 + 0.1 * rng.standard_normal(WIDTH)).astype(np.float32)
        nodes += [helper.make_node("MatMul", [previous, f"w{layer}"], [f"h{layer}"], name=f"fc{layer}"),
                  helper.make_node("Mul", [f"h{layer}", f"s{layer}"], [f"g{layer}"], name=f"scale{layer}"),
                  helper.make_node("Relu", [f"g{layer}"], [f"a{layer}"], name=f"act{layer}")]
        previous = f"a{layer}"
    params["head"] = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
    params["ratio"], params["training"] = np.array(0.25, np.float32), np.array(True)
    nodes += [helper.make_node("Dropout", [previous, "ratio", "training"], ["dropped"], name="drop"),
              helper.make_node("MatMul", ["dropped", "head"], ["out"], name="head")]
    model = make_model(nodes, params, inputs=[("x", np.float32, ["batch", WIDTH])],
                       outputs=[("out", np.float32, ["batch", WIDTH])])
    directory = tmp_path_factory.mktemp("scaled")
    trained = [k for k in params if k not in ("ratio", "training")]
    artifacts.generate_artifacts(model, requires_grad=trained,
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=directory)
    x = rng.standard_normal((4, 2 * BATCH, WIDTH)).astype(np.float32)
    y = rng.standard_normal((4, 2 * BATCH, WIDTH)).astype(np.float32)
    return directory, x, y


def test_the_cost_model_prices_products_far_above_elementwise_ops():
    f32 = np.dtype(np.float32)
    types = {"x": TensorType(f32, (8, 32, 28, 28)), "w": TensorType(f32, (32, 32, 3, 3)),
             "c": TensorType(f32, (32,)), "y": TensorType(f32, (8, 32, 28, 28)),
             "a": TensorType(f32, (256, 256)), "b": TensorType(f32, (256, 256)),
             "shape": TensorType(np.dtype(np.int64), (2,))}
    cost = {
        "Conv": node_cost(Node("Conv", ["x", "w"], ["y"], {"pads": [1, 1, 1, 1]}), types),
        "Relu": node_cost(Node("Relu", ["x"], ["y"]), types),
        "Add": node_cost(Node("Add", ["x", "x"], ["y"]), types),
        "BatchNormalization": node_cost(Node("BatchNormalization", ["x", "c", "c", "c", "c"], ["y"]), types),
        "MatMul": node_cost(Node("MatMul", ["a", "b"], ["y2"]), {**types, "y2": types["a"]}),
        "Gemm": node_cost(Node("Gemm", ["a", "b"], ["y2"]), {**types, "y2": types["a"]}),
        "Relu on the product": node_cost(Node("Relu", ["a"], ["y2"]), {**types, "y2": types["a"]}),
        "Reshape": node_cost(Node("Reshape", ["x", "shape"], ["y3"]), {**types, "y3": TensorType(f32, (8, 25088))}),
    }
    assert cost["Conv"] > 10 * max(cost["Relu"], cost["Add"], cost["BatchNormalization"])  # same shapes
    assert min(cost["MatMul"], cost["Gemm"]) > 10 * cost["Relu on the product"]
    assert cost["Relu"] <= cost["Add"] < cost["BatchNormalization"]  # one pass over two tensors, then three passes
    assert cost["Reshape"] == 0


def test_the_budget_recomputes_cheap_ops_not_products(scaled_mlp):
    directory, x, y = scaled_mlp
    losses, params, free = train_keeping_every_activation(directory, x, y)
    budget_losses, budget_params, tight = train(directory, x, y, memory_budget=int(free.plan.arena_bytes * 0.7))
    assert tight.plan.arena_bytes <= free.plan.arena_bytes * 0.7
    ops = recomputed_ops(tight)
    assert ops["Relu"] >= 4 and set(ops) <= {"Mul", "Relu"}, ops  # keeping every other activation would rerun MatMuls
    assert budget_losses == losses
    np.testing.assert_array_equal(budget_params, params)


def test_cheap_ops_are_recomputed_by_default_when_that_shrinks_the_arena(scaled_mlp):
    directory, x, y = scaled_mlp
    losses, params, kept = train_keeping_every_activation(directory, x, y)
    default_losses, default_params, default = train(directory, x, y)
    assert kept.recomputed == 0 and default.plan.arena_bytes < kept.plan.arena_bytes
    ops = recomputed_ops(default)  # the Relu outputs, from the MatMul outputs the scales' gradients keep anyway
    assert ops["Relu"] >= 4 and set(ops) <= {"Mul", "Relu"}, ops
    assert default_losses == losses
    np.testing.assert_array_equal(default_params, params)


@pytest.mark.parametrize("fraction", [0.8, 0.6, 0.5])
def test_random_ops_are_never_recomputed(scaled_mlp, fraction):
    directory, x, y = scaled_mlp
    losses, params, free = train_keeping_every_activation(directory, x, y)
    budget_losses, budget_params, tight = train(directory, x, y, memory_budget=int(free.plan.arena_bytes * fraction))
    assert tight.recomputed > 0 and recomputed_ops(tight)["Dropout"] == 0
    assert budget_losses == losses
    np.testing.assert_array_equal(budget_params, params)


def named_smallest(directory, x, y, budget: int) -> int:
    with pytest.raises(MemoryBudgetError, match="at least") as info:
        train(directory, x, y, memory_budget=budget)
    return int(str(info.value).split("at least ")[1].split(" ")[0].replace(",", ""))


def test_an_impossible_budget_names_the_smallest_that_works(deep_mlp):
    directory, x, y = deep_mlp
    smallest = named_smallest(directory, x, y, 1000)
    # just below it the cost-based choice runs and fails too, and the same, budget-independent size is named
    assert named_smallest(directory, x, y, smallest * 98 // 100) == smallest
    _, _, bound = train(directory, x, y, memory_budget=smallest)
    assert bound.plan.arena_bytes <= smallest


def test_when_nothing_fits_the_covering_aims_below_the_evenly_spaced_choices_whatever_the_budget(deep_mlp,
                                                                                                monkeypatch):
    """The last pass covers the peaks aiming at LADDER shares of the evenly spaced choices' smallest arena: aims
    that do not depend on the budget, so the smallest arena they reach can be named as one a budget meets."""
    directory, x, y = deep_mlp
    covered = recompute._greedy
    aims, reached = [], []

    def recording(*args, aim, budget, modes=(False, True)):
        kept, size = covered(*args, aim=aim, budget=budget, modes=modes)
        aims.append(aim)
        reached.append(size)
        return kept, size

    monkeypatch.setattr(recompute, "_greedy", recording)
    named, ladders = {}, {}
    for budget in (1000, 2000):
        aims.clear(), reached.clear()
        named[budget] = named_smallest(directory, x, y, budget)
        assert aims[0] == budget and len(aims) == 1 + len(recompute.LADDER)
        ladders[budget] = ladder = aims[1:]
        assert named[budget] <= min(reached[1:])
    assert named[1000] == named[2000] and ladders[1000] == ladders[2000]
    evenly_spaced = ladder[0] / recompute.LADDER[0]  # aims are whole bytes: within one of their shares
    assert all(abs(aim - evenly_spaced * share) <= 1 and aim < evenly_spaced
               for aim, share in zip(ladder, recompute.LADDER))


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


def test_train_and_eval_at_every_batch_size_share_one_arena(deep_mlp):
    """Steps of one Module take turns over one arena buffer, as large as the largest plan, and compute
    exactly what a fresh Module computes for each of them, whatever ran before."""
    directory, x, y = deep_mlp

    def fresh():
        return Module(directory / "training_model.onnx", CheckpointState.load_checkpoint(directory / "checkpoint"),
                      directory / "eval_model.onnx")

    def step(module, mode, batch):
        module.train(mode == "train")
        loss = float(module(x[0][:batch], y[0][:batch]))
        grads = module._state._store.grad_flat.copy()
        module.lazy_reset_grad()
        return loss, grads

    # small first, then larger ones: the buffer grows and the earlier plans move onto it
    sequence = [("train", 3), ("eval", 3), ("train", BATCH), ("eval", BATCH), ("train", 7), ("train", 3), ("eval", 3)]
    shared = fresh()
    for mode, batch in sequence:
        loss, grads = step(shared, mode, batch)
        expected_loss, expected_grads = step(fresh(), mode, batch)
        assert loss == expected_loss, (mode, batch)
        if mode == "train":
            np.testing.assert_array_equal(grads, expected_grads)
    bound = list(shared._train.plans.values()) + list(shared._eval.plans.values())
    assert len(bound) == 5
    assert shared._arena.nbytes == max(b.plan.arena_bytes for b in bound) < sum(b.plan.arena_bytes for b in bound)
    assert all(b.arena.base is shared._arena.buffer.base and b.arena.ctypes.data == shared._arena.buffer.ctypes.data
               for b in bound)
    from odtrain.memory import report
    assert report(shared).arena_bytes == shared._arena.nbytes


def _machine_with(monkeypatch, nbytes: int) -> list[int]:
    """Pretend the process can hold `nbytes`; returns the sizes of the arena buffers allocated from now on."""
    from odtrain import allocation

    monkeypatch.setattr(allocation, "memory_limit", lambda: (nbytes, "a test's limit"))
    requested, allocate = [], allocation.aligned_buffer
    monkeypatch.setattr(allocation, "aligned_buffer", lambda n: requested.append(n) or allocate(n))
    return requested


def test_an_arena_beyond_the_machine_is_refused_naming_the_budget_that_fits(deep_mlp, monkeypatch):
    """Refused before allocating, with the plan's size and its largest values and their nodes; the
    memory_budget it names trains in an arena within the limit, exactly as the unconstrained step."""
    from odtrain.memory import format_bytes

    directory, x, y = deep_mlp
    losses, params, free = train(directory, x, y)
    arena, limit = free.plan.arena_bytes, free.plan.arena_bytes * 3 // 4
    requested = _machine_with(monkeypatch, limit)
    with pytest.raises(MemoryBudgetError) as refusal:
        train(directory, x, y)
    message = str(refusal.value)
    assert isinstance(refusal.value, MemoryError) and max(requested, default=0) <= limit
    assert f"needs an arena of {format_bytes(arena)} ({arena:,} bytes), more than a test's limit" in message
    values = re.search(r"its largest values: (.*)\. ", message).group(1).split("; ")
    assert len(values) == 3 and all(re.fullmatch(r"'\w+' float32\[32x64\] \(8.00 KiB, (an input|written by [\w:]+ node "
                                                 r"'\w+')\)", value) for value in values), values
    budget = int(re.search(r"memory_budget=([\d,]+) fits", message).group(1).replace(",", ""))
    assert budget == limit
    budget_losses, budget_params, tight = train(directory, x, y, memory_budget=budget)
    assert tight.plan.arena_bytes <= limit and tight.recomputed > 0 and max(requested) <= limit
    assert budget_losses == losses
    np.testing.assert_array_equal(budget_params, params)


def test_a_machine_no_budget_fits_is_named(deep_mlp, monkeypatch):
    directory, x, y = deep_mlp
    _, _, free = train(directory, x, y)
    limit = max(g.nbytes for g in free.plan.groups) + 64  # every value fits, two at once do not
    _machine_with(monkeypatch, limit)
    with pytest.raises(MemoryBudgetError, match="No memory_budget fits: recomputing activations, the smallest arena "
                                                "odtrain can plan is [\\d,]+ bytes; use smaller inputs"):
        train(directory, x, y)
    _machine_with(monkeypatch, limit - 128)
    with pytest.raises(MemoryBudgetError, match="No memory_budget can help: recomputation does not split a value"):
        train(directory, x, y)


def test_a_failed_allocation_becomes_a_memory_budget_error(deep_mlp, monkeypatch):
    """Below the machine's limit the allocation is tried; numpy's MemoryError (memory others hold) is refused
    the same way, naming the plan."""
    from odtrain import allocation

    def refuse(nbytes):
        if nbytes:
            raise MemoryError(f"Unable to allocate {nbytes} bytes")
        return np.empty(0, np.uint8)

    monkeypatch.setattr(allocation, "aligned_buffer", refuse)
    directory, x, y = deep_mlp
    with pytest.raises(MemoryBudgetError, match="the memory plan needs an arena of .*, more than could be allocated "
                                                ".*; its largest values: '"):
        train(directory, x, y)


@pytest.mark.parametrize("ratio, training, inert", [(0.0, True, True), (0.25, False, True), (0.25, True, False)])
def test_a_dropout_that_passes_its_input_through_becomes_a_view(ratio, training, inert):
    from odtrain.graph.ops.nn import inert_dropouts

    order = [Node("Dropout", ["x", "ratio", "training"], ["y", "mask"], {}, "drop"),
             Node("DropoutGrad", ["dy", "mask", "ratio", "training"], ["dx"], {}, "drop_grad", "ai.odtrain")]
    folded = {"ratio": np.array(ratio, np.float32), "training": np.array(training)}
    result = inert_dropouts(order, folded, {"y"})
    assert [(n.op_type, n.inputs, n.outputs) for n in result] == (
        [("Identity", ["x"], ["y"]), ("Identity", ["dy"], ["dx"])] if inert else [(n.op_type, n.inputs, n.outputs)
                                                                                  for n in order])
    assert inert_dropouts(order, folded, {"mask"})[0].op_type == "Dropout"  # a mask the caller reads stays


def _small_model(tmp_path, name, nodes, params, trained, out="out", frozen=()):
    rng = np.random.default_rng(8)
    model = make_model(nodes, params, inputs=[("x", np.float32, ["batch", WIDTH])],
                       outputs=[(out, np.float32, ["batch", WIDTH])])
    directory = tmp_path / name
    artifacts.generate_artifacts(model, requires_grad=trained, frozen_params=list(frozen),
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=directory)
    x = rng.standard_normal((3, BATCH, WIDTH)).astype(np.float32)
    y = rng.standard_normal((3, BATCH, WIDTH)).astype(np.float32)
    return directory, x, y


def _weights(*shapes, seed=9):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32) for shape in shapes]


@pytest.mark.parametrize("fraction", [None, 0.8])
def test_a_dropout_whose_output_a_clone_reads_is_not_recomputed(tmp_path, fraction):
    """Dropout's output is not itself saved here (an Add broadcasts it 4 times; a trained scale's gradient reads the
    Add's output), so recomputing the Add's output, by default or under a budget, reads it again: as it is, never
    from a second Dropout, which would draw another mask than the one the backward pass multiplies by."""
    nodes, previous, trained = [], "x", []
    params = {"axis": np.array([1], np.int64), "ratio": np.array(0.5, np.float32), "training": np.array(True)}
    for layer in range(4):  # MatMul, Dropout, broadcast 4 times, scale, mean: the 4-times outputs dominate
        params[f"w{layer}"], params[f"c{layer}"] = _weights((WIDTH, WIDTH), (4, WIDTH), seed=layer)
        params[f"s{layer}"] = np.full(WIDTH, 0.5, np.float32)
        nodes += [helper.make_node("MatMul", [previous, f"w{layer}"], [f"h{layer}"]),
                  helper.make_node("Dropout", [f"h{layer}", "ratio", "training"], [f"d{layer}"], name=f"drop{layer}"),
                  helper.make_node("Unsqueeze", [f"d{layer}", "axis"], [f"u{layer}"]),
                  helper.make_node("Add", [f"u{layer}", f"c{layer}"], [f"a{layer}"]),
                  helper.make_node("Mul", [f"a{layer}", f"s{layer}"], [f"m{layer}"]),
                  helper.make_node("ReduceMean", [f"m{layer}", "axis"], [f"r{layer}"], keepdims=0)]
        previous = f"r{layer}"
        trained += [f"w{layer}", f"s{layer}"]
    nodes.append(helper.make_node("Identity", [previous], ["out"]))
    directory, x, y = _small_model(tmp_path, "dropout", nodes, params, trained)
    losses, kept_params, kept = train_keeping_every_activation(directory, x, y)
    options = {} if fraction is None else {"memory_budget": int(kept.plan.arena_bytes * fraction)}
    other_losses, other_params, other = train(directory, x, y, **options)
    assert other.recomputed > 0 and recomputed_ops(other)["Add"] > 0
    assert recomputed_ops(other)["Dropout"] == 0
    assert other_losses == losses
    np.testing.assert_array_equal(other_params, kept_params)


def test_a_clone_reads_a_random_op_s_output_as_it_is_even_when_nothing_keeps_it():
    """`rewrite` with no activation kept (the every-k-th fallback of a tight budget keeps only the saved random
    outputs; a Dropout's output read only by forward nodes is not one): the Add recomputed for the backward pass
    reads the Dropout's output itself; the Dropout is never run a second time (another mask)."""
    forward = [Node("MatMul", ["x", "w"], ["h"], {}, "product"),
               Node("Dropout", ["h", "ratio", "training"], ["d", "mask"], {}, "drop"),
               Node("Add", ["d", "c"], ["a"], {}, "add"), Node("Mul", ["a", "s"], ["m"], {}, "scale")]
    backward = [Node("Mul", ["dm", "a"], ["ds_parts"], {}, "scale_grad"),
                Node("DropoutGrad", ["dd", "mask", "ratio", "training"], ["dh"], {}, "drop_grad", "ai.odtrain")]
    order = forward + backward
    rewritten = recompute.rewrite(order, {id(n) for n in backward}, set(), {"h", "d", "mask", "a", "m"})
    clones = [n for n in rewritten if n.name.endswith(RECOMPUTE_SUFFIX)]
    assert [n.op_type for n in clones] == ["Add"] and clones[0].inputs == ["d", "c"], clones
    (grad,) = [n for n in rewritten if n.name == "scale_grad"]
    assert grad.inputs == ["dm", clones[0].outputs[0]]


def test_a_lora_sized_product_is_not_recomputed_by_default(tmp_path):
    """A rank-4 adapter's second product costs 8 multiply-adds per output element, as cheap by that count as an
    elementwise op, and its input is 16 times smaller than its output; it is still a product (a kernel that
    reads a weight panel by panel), which the default recomputation leaves to a budget."""
    w, a, b = _weights((WIDTH, WIDTH), (WIDTH, 4), (4, WIDTH))
    nodes = [helper.make_node("MatMul", ["x", "a"], ["u"]), helper.make_node("MatMul", ["u", "b"], ["v"]),
             helper.make_node("Mul", ["v", "s"], ["scaled"]), helper.make_node("MatMul", ["x", "w"], ["base"]),
             helper.make_node("Add", ["base", "scaled"], ["out"])]
    params = {"w": w, "a": a, "b": b, "s": np.full(WIDTH, 0.5, np.float32)}
    directory, x, y = _small_model(tmp_path, "lora", nodes, params, ["a", "b", "s"])
    losses, kept_params, _ = train_keeping_every_activation(directory, x, y)
    default_losses, default_params, default = train(directory, x, y)
    assert recomputed_ops(default)["MatMul"] == 0, recomputed_ops(default)
    assert default_losses == losses
    np.testing.assert_array_equal(default_params, kept_params)


def test_a_recomputed_batch_normalization_updates_its_running_statistics_once_a_step(tmp_path):
    """BatchNormalization's output, read by a trained scale's gradient, is recomputed under a budget from its
    input (a cheap norm, kept for its own gradient); the clone must not move the running statistics a second time: after 3 steps they equal
    those of the run that keeps every activation, and (first layer, whose input does not train) PyTorch's
    momentum update from the batches' statistics."""
    nodes, params, previous, trained, frozen = [], {}, "x", [], []
    for layer in range(3):
        (params[f"w{layer}"],) = _weights((WIDTH, WIDTH), seed=layer)
        params.update({f"gamma{layer}": np.ones(WIDTH, np.float32), f"beta{layer}": np.zeros(WIDTH, np.float32),
                       f"mean{layer}": np.zeros(WIDTH, np.float32), f"var{layer}": np.ones(WIDTH, np.float32),
                       f"s{layer}": np.full(WIDTH, 0.5, np.float32)})
        nodes += [helper.make_node("MatMul", [previous, f"w{layer}"], [f"h{layer}"]),
                  helper.make_node("BatchNormalization", [f"h{layer}", f"gamma{layer}", f"beta{layer}",
                                                          f"mean{layer}", f"var{layer}"],
                                   [f"n{layer}", f"mean_out{layer}", f"var_out{layer}"],
                                   momentum=0.9, training_mode=1, name=f"norm{layer}"),
                  helper.make_node("Mul", [f"n{layer}", f"s{layer}"], [f"m{layer}"])]
        previous = f"m{layer}"
        trained += [f"gamma{layer}", f"beta{layer}", f"s{layer}"]
        frozen += [f"w{layer}", f"mean{layer}", f"var{layer}"]
    nodes.append(helper.make_node("Identity", [previous], ["out"]))
    directory, x, y = _small_model(tmp_path, "norm", nodes, params, trained, frozen=frozen)
    statistics = [name for name in frozen if not name.startswith("w")]

    def run(train_with):
        states = []
        original = CheckpointState.load_checkpoint.__func__
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(CheckpointState, "load_checkpoint",
                          classmethod(lambda cls, path: states.append(original(cls, path)) or states[-1]))
            _, _, bound = train_with(directory, x, y)
        return bound, {k: states[0].parameters[k].data.copy() for k in statistics}

    kept, kept_stats = run(train_keeping_every_activation)
    default, default_stats = run(partial(train, memory_budget=int(kept.plan.arena_bytes * 0.9)))
    assert kept.recomputed == 0 and recomputed_ops(default)["BatchNormalizationActivation"] > 0, recomputed_ops(default)
    for key in statistics:
        np.testing.assert_array_equal(default_stats[key], kept_stats[key], err_msg=key)
    mean, var = np.zeros(WIDTH), np.ones(WIDTH)
    for step in range(len(x)):  # the first layer's input and weight do not train
        h = x[step].astype(np.float64) @ params["w0"]
        mean = 0.9 * mean + 0.1 * h.mean(axis=0)
        var = 0.9 * var + 0.1 * h.var(axis=0, ddof=1)
    np.testing.assert_allclose(default_stats["mean0"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(default_stats["var0"], var, rtol=1e-5, atol=1e-6)


# ---- memory_budget="auto" -----------------------------------------------------------------------------------

def test_the_auto_budget_is_what_is_available_less_the_mapped_weights_and_a_reserve(tmp_path, monkeypatch):
    from odtrain import allocation

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemFree:         100000 kB\nMemAvailable:    3000000 kB\n")
    monkeypatch.setattr(allocation, "cgroup_memory", lambda: [])
    assert allocation.available_memory(str(meminfo)) == (3000000 * 1024, "MemAvailable")
    gib, mib = 2 ** 30, 2 ** 20
    # an eighth of what is available stays in reserve; the arena already held is the new plan's to use
    assert allocation.auto_budget(100 * mib, 10 * mib, (gib, "test")) == gib + 10 * mib - 100 * mib - gib // 8
    # at least RESERVE_FLOOR
    assert allocation.auto_budget(0, 0, (256 * mib, "test")) == 256 * mib - allocation.RESERVE_FLOOR
    with pytest.raises(MemoryBudgetError, match='"auto": 512.00 MiB available \\(test\\), of which the mapped '
                                                "parameters need 500.00 MiB resident and 64.00 MiB stay in reserve"):
        allocation.auto_budget(500 * mib, 0, (512 * mib, "test"))


def cgroup_tree(root, files: dict) -> None:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def test_the_memory_cgroups_are_the_process_own_and_its_ancestors(tmp_path, monkeypatch):
    """A systemd service's MemoryMax (cgroup v2) or a v1 memory cgroup below the hierarchy's root limits the
    process as a container's own limit does: each ancestor's limit is read, a limit of "max" is none, and the
    page cache no process maps is left out of the use (the kernel reclaims it first, as MemAvailable counts it)."""
    from odtrain import allocation

    mib = 2 ** 20
    cgroup_tree(tmp_path, {
        "system.slice/memory.max": "max\n", "system.slice/memory.current": "5000\n",
        "system.slice/train.service/memory.max": f"{1100 * mib}\n",
        "system.slice/train.service/memory.current": f"{300 * mib}\n",
        "system.slice/train.service/memory.stat": f"anon {100 * mib}\nfile {200 * mib}\nfile_mapped {20 * mib}\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": f"{8000 * mib}\n",
        "memory/lab/box/memory.limit_in_bytes": f"{2000 * mib}\n",
        "memory/lab/box/memory.usage_in_bytes": f"{500 * mib}\n",
        "memory/lab/box/memory.stat": f"cache {50 * mib}\nrss {450 * mib}\ntotal_cache {60 * mib}\n"
                                      f"total_mapped_file {10 * mib}\n"})
    proc = tmp_path / "cgroup"
    proc.write_text("12:memory:/lab/box\n3:cpu,cpuacct:/lab\n0::/system.slice/train.service\n")
    read = allocation.cgroup_memory
    found = read(str(proc), str(tmp_path))
    assert [(limit, use) for limit, use, _ in found] == [
        (2000 * mib, 450 * mib), (9223372036854771712, 8000 * mib), (1100 * mib, 120 * mib)]
    assert found[2][2] == str(tmp_path / "system.slice/train.service/memory.max")
    monkeypatch.setattr(allocation, "cgroup_memory", lambda: found)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:    8000000 kB\n")
    assert allocation.available_memory(str(meminfo)) == (980 * mib, f"this container's limit less its use ({found[2][2]})")
    # in a container with its own cgroup namespace the path is "/": the hierarchy's root is its cgroup
    proc.write_text("0::/\n")
    cgroup_tree(tmp_path, {"memory.max": f"{512 * mib}\n", "memory.current": f"{100 * mib}\n"})
    assert [(limit, use) for limit, use, _ in read(str(proc), str(tmp_path))] == [(512 * mib, 100 * mib)]


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_shared_memory_in_a_cgroup_is_not_counted_as_reclaimable_cache(tmp_path, monkeypatch, version):
    """A 1,024 MiB cgroup holding 800 MiB of tmpfs (shared memory, in the page cache but not reclaimable
    without swap) and 100 MiB of anonymous memory leaves 124 MiB, not 924: the auto budget reads that."""
    from odtrain import allocation

    mib = 2 ** 20
    if version == "v2":
        cgroup_tree(tmp_path, {"box/memory.max": f"{1024 * mib}\n", "box/memory.current": f"{900 * mib}\n",
                               "box/memory.stat": f"anon {100 * mib}\nfile {800 * mib}\nfile_mapped 0\n"
                                                  f"shmem {800 * mib}\n"})
        (tmp_path / "cgroup").write_text("0::/box\n")
    else:
        cgroup_tree(tmp_path, {"memory/box/memory.limit_in_bytes": f"{1024 * mib}\n",
                               "memory/box/memory.usage_in_bytes": f"{900 * mib}\n",
                               "memory/box/memory.stat": f"cache {800 * mib}\nrss {100 * mib}\nshmem {800 * mib}\n"
                                                         f"total_cache {800 * mib}\ntotal_rss {100 * mib}\n"
                                                         f"total_mapped_file 0\ntotal_shmem {800 * mib}\n"})
        (tmp_path / "cgroup").write_text("4:memory:/box\n")
    read = allocation.cgroup_memory
    found = read(str(tmp_path / "cgroup"), str(tmp_path))
    assert [(limit, use) for limit, use, _ in found] == [(1024 * mib, 900 * mib)]
    monkeypatch.setattr(allocation, "cgroup_memory", lambda: found)
    (tmp_path / "meminfo").write_text("MemAvailable:    8000000 kB\n")
    assert allocation.available_memory(str(tmp_path / "meminfo"))[0] == 124 * mib
    # the same cgroup with 800 MiB of ordinary unmapped file cache instead: the kernel reclaims it
    stat = tmp_path / ("box/memory.stat" if version == "v2" else "memory/box/memory.stat")
    stat.write_text(stat.read_text().replace(f"shmem {800 * mib}", "shmem 0"))
    assert [use for _, use, _ in read(str(tmp_path / "cgroup"), str(tmp_path))] == [100 * mib]


def test_a_cgroup_v2_limit_under_unified_on_a_hybrid_host_is_read(tmp_path):
    """A hybrid host mounts cgroup v2 at /sys/fs/cgroup/unified beside v1's controllers: a systemd service's
    MemoryMax there limits the process as a v1 memory limit does."""
    from odtrain import allocation

    mib = 2 ** 20
    cgroup_tree(tmp_path, {"unified/system.slice/train.service/memory.max": f"{700 * mib}\n",
                           "unified/system.slice/train.service/memory.current": f"{200 * mib}\n",
                           "memory/memory.limit_in_bytes": "9223372036854771712\n",
                           "memory/memory.usage_in_bytes": f"{900 * mib}\n"})
    (tmp_path / "cgroup").write_text("5:memory:/\n0::/system.slice/train.service\n")
    found = allocation.cgroup_memory(str(tmp_path / "cgroup"), str(tmp_path))
    assert (700 * mib, 200 * mib, str(tmp_path / "unified/system.slice/train.service/memory.max")) in found


def test_the_auto_budget_at_a_second_shape_counts_the_arena_already_held_as_its_own(deep_mlp, monkeypatch):
    """A Module plans its step again at a new input shape; the new plan replaces the shared arena, so the bytes
    that arena holds are the new plan's to use, not memory in use: the budget does not shrink by them."""
    from odtrain import allocation

    directory, x, y = deep_mlp
    available = 1 << 30
    monkeypatch.setattr(allocation, "available_memory", lambda: (available, "test"))
    module = Module(directory / "training_model.onnx", CheckpointState.load_checkpoint(directory / "checkpoint"))
    module(x[0], y[0])
    first, held = module.memory_budget_bytes, module._arena.nbytes
    assert first == available - available // allocation.RESERVE_SHARE and held > 0
    module(x[0][:7], y[0][:7])
    assert module.memory_budget_bytes == first + held


def test_an_auto_budget_no_plan_meets_says_what_is_available_not_to_raise_it(deep_mlp, monkeypatch):
    """With too little available for even the smallest plan, "auto" says so and what to do (free memory, a smaller
    batch, no budget), not the advice for a budget the user gave ("raise the budget to at least ...")."""
    from odtrain import allocation

    directory, x, y = deep_mlp
    monkeypatch.setattr(allocation, "available_memory", lambda: (allocation.RESERVE_FLOOR + 4096, "test"))
    module = Module(directory / "training_model.onnx", CheckpointState.load_checkpoint(directory / "checkpoint"))
    with pytest.raises(MemoryBudgetError) as refused:
        module(x[0], y[0])
    message = str(refused.value)
    assert message.startswith('memory_budget="auto": 4.00 KiB (4,096 bytes) of what is available is left for a '
                              "training step's arena, and the smallest arena odtrain can plan, recomputing "
                              "activations, is ") and "free memory, use a smaller batch" in message, message
    assert "raise the budget" not in message and refused.value.smallest_bytes > 4096


def test_memory_budget_auto_is_the_default(deep_mlp):
    """Module, fit and odtrain train plan under memory_budget="auto" unless told otherwise; None (or
    --memory-budget none) plans without a budget, as a number gives its own."""
    import inspect

    from odtrain.cli import build_parser
    from odtrain.cli.options import budget_size
    from odtrain.training import fit

    directory, x, y = deep_mlp
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state)
    module(x[0], y[0])
    assert module.memory_budget_bytes is not None and module.memory_budget_bytes > 0
    assert Module(directory / "training_model.onnx", state, memory_budget=None).memory_budget_bytes is None
    assert Module(directory / "training_model.onnx", state, memory_budget=10 ** 6).memory_budget_bytes == 10 ** 6
    assert inspect.signature(fit).parameters["memory_budget"].default == "auto"
    parser = build_parser()
    assert parser.parse_args(["train", str(directory), "--data", "data.npz"]).memory_budget == "auto"
    assert parser.parse_args(["train", str(directory), "--data", "data.npz", "--memory-budget", "none"]).memory_budget is None
    assert budget_size("None") is None and budget_size("1MiB") == 2 ** 20


def test_module_with_the_auto_budget_recomputes_when_little_is_available(deep_mlp, monkeypatch):
    """Module(memory_budget="auto") plans its training step under the budget the available memory gives: with
    half the free arena's bytes left above the reserve it recomputes activations and trains identically; with
    this machine's memory it keeps every activation of this small model."""
    from odtrain import allocation
    from odtrain.graph.errors import ArgumentError

    directory, x, y = deep_mlp
    losses, params, free = train(directory, x, y)
    half = free.plan.arena_bytes // 2
    monkeypatch.setattr(allocation, "available_memory", lambda: (half + allocation.RESERVE_FLOOR, "test"))
    auto_losses, auto_params, tight = train(directory, x, y, memory_budget="auto")
    assert tight.plan.arena_bytes <= half and tight.recomputed > 0
    assert auto_losses == losses
    np.testing.assert_array_equal(auto_params, params)
    monkeypatch.undo()
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, memory_budget="auto")
    assert module.memory_budget_bytes is None
    module(x[0], y[0])
    assert module.memory_budget_bytes > free.plan.arena_bytes
    assert next(iter(module._train.plans.values())).plan.arena_bytes == free.plan.arena_bytes
    with pytest.raises(ArgumentError, match='positive number of bytes or "auto"'):
        Module(directory / "training_model.onnx", state, memory_budget="some")


def test_train_takes_memory_budget_auto():
    from odtrain.cli.options import budget_size

    assert budget_size("auto") == "auto" and budget_size("40MB") == 40 * 10 ** 6
