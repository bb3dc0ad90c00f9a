"""README's "Adding an op" and "Adding an optimizer", done in a test: a toy element-wise op and a toy optimizer
are added to the registries for the length of a test (then removed) through exactly what README lists, and
trained with end to end; no file of the repository changes.

- The op, `ToyCube` (y = x³, odtrain's domain): its type rule and gradient (dX = 3·dY·X², built from graph ops)
  registered with `op` and `grad` as a graph/ops family module does, its kernel with `binding` as a kernels/
  family does. Oracles: numpy for the forward, float64 central differences for the weight's gradient.
- The optimizer, `ToyAdagrad` (s += g²; w -= lr·g / (√s + ε)): its record (`@optimizer` as in
  graph/optimizers.py), its kernel and twin (as in kernels/optim.py) and its row of UPDATES. Oracle: the same
  update in float64 numpy, step after step, through `odtrain prepare`, a checkpoint saved and loaded, and the
  parallel parts against the serial loop.

Tolerance: one float32 Adagrad step against float64 differs by a few float32 ulps of w (1e-6 relative); the
central differences in float64 (h = 1e-6) agree with float32 gradients of values ~1 to 1e-4 relative.
"""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from odtrain import artifacts, cli, onnxblock, optimizer_update
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.graph import optimizers as graph_optimizers
from odtrain.graph.ir import ODTRAIN_DOMAIN
from odtrain.graph.onnx_io import load_graph
from odtrain.graph.ops import registry as graph_registry
from odtrain.kernels import parallel_split
from odtrain.kernels import registry as kernel_registry
from odtrain.kernels.jit import njit, prange  # noqa: F401 (prange: the loop of the written twin)
from odtrain.kernels.layout import flat

README = Path(__file__).resolve().parents[1] / "README.md"
RATE, EPS = 0.05, 1e-7


@contextlib.contextmanager
def temporary_registries():
    """Every registry the toys write, restored to what it held whatever the test did."""
    tables = (graph_registry.OPS, kernel_registry.BINDINGS, kernel_registry.SCRATCH, graph_optimizers.OPTIMIZERS,
              optimizer_update.UPDATES, parallel_split.TWINS)
    from odtrain.kernels import fused_elementwise

    tables += (fused_elementwise._MADE, fused_elementwise.SOURCES)  # fused chains the toys' steps made
    saved = [dict(table) for table in tables]
    parallel = set(kernel_registry.PARALLEL)
    generated = set(vars(fused_elementwise))
    try:
        yield
    finally:
        for table, before in zip(tables, saved):
            table.clear()
            table.update(before)
        kernel_registry.PARALLEL.clear()
        kernel_registry.PARALLEL.update(parallel)
        for name in set(vars(fused_elementwise)) - generated:  # their kernels and twins, gone with the twins' records
            delattr(fused_elementwise, name)


# ---- the toy op: README's "Adding an op", items 1 and 2 --------------------------------------------------------


@njit(cache=True, error_model="numpy")
def _cube(x, out):
    """out = x³."""
    for i in range(out.size):
        out[i] = x[i] * x[i] * x[i]


def add_toy_op() -> None:
    graph_registry.op("ToyCube", ODTRAIN_DOMAIN, passes=1.0)(graph_registry.same_as_input(0))

    @graph_registry.grad("ToyCube", ODTRAIN_DOMAIN)
    def _cube_grad(g):  # dX = dY · 3X²
        square = g.emit("Mul", [g.I(0), g.I(0)])
        g.set_grad(0, g.emit("Mul", [g.GO(0), g.emit("Mul", [square, g.constant(np.float32(3.0), "three")])]))

    @kernel_registry.binding("ToyCube", ODTRAIN_DOMAIN)
    def ToyCube(inputs, outputs):
        return [(_cube, (flat(inputs[0]), flat(outputs[0])))]


# ---- the toy optimizer: README's "Adding an optimizer", items 1 to 3 ---------------------------------------------


@njit(cache=True, error_model="numpy")
def toy_adagrad_update(w, g, s, lr, eps):
    """s += g²;  w -= lr·g / (√s + ε)."""
    rate, epsilon = np.float32(lr), np.float32(eps)
    for i in range(w.size):
        s[i] += g[i] * g[i]
        w[i] -= rate * g[i] / (np.sqrt(s[i]) + epsilon)


def add_toy_optimizer():
    @graph_optimizers.optimizer(state=("sum_of_squares",), command="toy-adagrad")
    class ToyAdagrad:
        """Adagrad: s += g²;  w -= lr·g / (√s + ε)."""

        eps: float = 1e-10

    if toy_adagrad_update not in parallel_split.TWINS:
        parallel_split.parallel_twin(toy_adagrad_update, sliced=("w", "g", "s"))

    def _toy_adagrad(config, weights, grads, moments, learning_rate, step, blocks):
        return toy_adagrad_update, (weights, grads, moments["sum_of_squares"], float(learning_rate),
                                    float(config.eps))

    optimizer_update.UPDATES[("ToyAdagrad", "float32")] = _toy_adagrad
    return ToyAdagrad


def adagrad(w, g, s, lr=RATE, eps=EPS):
    """The float64 reference of one step: (w, s)."""
    s = s + g.astype(np.float64) ** 2
    return w - lr * g / (np.sqrt(s) + np.float32(eps)), s


# ---- a model with the toy op --------------------------------------------------------------------------------------


def cube_model() -> onnx.ModelProto:
    """y = (x · W)³ for x [batch, 4], W [4, 3]."""
    weight = np.random.default_rng(0).uniform(-0.6, 0.6, (4, 3)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("ToyCube", ["h"], ["y"], domain=ODTRAIN_DOMAIN)]
    graph = helper.make_graph(nodes, "cube", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
                              [numpy_helper.from_array(weight, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ODTRAIN_DOMAIN, 1)])


def data(batch=5, seed=1):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, (batch, 4)).astype(np.float32), rng.uniform(-0.5, 0.5, (batch, 3)).astype(np.float32)


def mse(weight, x, target) -> float:
    return float(np.mean(((x.astype(np.float64) @ weight) ** 3 - target) ** 2))


def test_readme_lists_the_files_these_toys_need():
    """The sections name the files whose registries the toys extend, and no other file of the repository."""
    text = README.read_text()
    sections = {}
    for title in ("Adding an op", "Adding an optimizer"):
        start = text.index(f"### {title}\n")
        sections[title] = text[start:text.index("\n#", start + 4)]
    paths = {title: set(re.findall(r"`((?:graph|kernels|odtrain|tests|benchmarks)/[\w/<>.]+)`", section))
             for title, section in sections.items()}
    assert {"graph/optimizers.py", "kernels/optim.py", "odtrain/optimizer_update.py"} == {
        p for p in paths["Adding an optimizer"] if not p.startswith(("tests/", "benchmarks/"))}
    assert {"graph/ops/<family>.py", "kernels/<family>.py"} <= paths["Adding an op"]
    # the registries extended here are those files' tables
    assert graph_optimizers.__file__.endswith("graph/optimizers.py")
    assert optimizer_update.__file__.endswith("odtrain/optimizer_update.py")
    for decorator in ("@optimizer(", "parallel_twin(", "UPDATES"):
        assert decorator in sections["Adding an optimizer"]
    for decorator in ('@op("Name"', '@grad("Name")', '@binding("Name")'):
        assert decorator in sections["Adding an op"]


def test_a_toy_op_trains_through_its_rule_gradient_and_kernel(tmp_path):
    with temporary_registries():
        add_toy_op()
        generated = artifacts.generate_artifacts(cube_model(), loss=artifacts.LossType.MSELoss,
                                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path,
                                                 eval_output_names=["y"])
        assert generated.trainable == ["W"]
        state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
        module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx", num_threads=1)
        optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
        x, target = data()
        weight = state.parameters["W"].data.astype(np.float64)

        module.eval()
        loss, y = module(x, target)
        np.testing.assert_allclose(y, (x @ state.parameters["W"].data) ** 3, rtol=1e-6, atol=1e-7)
        assert loss == pytest.approx(mse(weight, x, target), rel=1e-5)

        module.train()
        module(x, target)
        gradient = state.parameters["W"].grad
        h, expected = 1e-6, np.zeros_like(weight)
        for index in np.ndindex(weight.shape):
            step = np.zeros_like(weight)
            step[index] = h
            expected[index] = (mse(weight + step, x, target) - mse(weight - step, x, target)) / (2 * h)
        np.testing.assert_allclose(gradient, expected, rtol=1e-4, atol=1e-7)

        optimizer.set_learning_rate(0.2)
        losses = []
        for _ in range(20):
            module.lazy_reset_grad()
            losses.append(float(module(x, target)))
            optimizer.step()
        assert all(later < earlier for earlier, later in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0]
    assert (ODTRAIN_DOMAIN, "ToyCube") not in graph_registry.OPS
    assert (ODTRAIN_DOMAIN, "ToyCube") not in kernel_registry.BINDINGS


def test_a_toy_optimizer_from_its_record_kernel_and_update_row(tmp_path):
    with temporary_registries():
        add_toy_op()
        ToyAdagrad = add_toy_optimizer()
        # what the record gives: the classes of odtrain.artifacts and onnxblock, and the command line's choice
        assert artifacts.ToyAdagrad is ToyAdagrad and onnxblock.optim.ToyAdagrad is onnxblock.optim.ToyAdagrad
        block = onnxblock.optim.ToyAdagrad(eps=EPS).to_model_proto(["W"])
        (node,) = block.graph.node
        assert (node.domain, node.op_type, list(node.input)[-1]) == (ODTRAIN_DOMAIN, "ToyAdagrad", "sum_of_squaress")
        model = tmp_path / "cube.onnx"
        onnx.save(cube_model(), model)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli.main(["prepare", str(model), "-o", str(tmp_path / "a"), "--loss", "mse", "--optimizer",
                             "toy-adagrad", "--lr", str(RATE)])
        assert code == 0, out.getvalue()
        config, parameters = graph_optimizers.read_optimizer_graph(
            load_graph(tmp_path / "a" / "optimizer_model.onnx"), "optimizer model")
        assert type(config) is ToyAdagrad and parameters == ["W"]
        assert config.eps == pytest.approx(ToyAdagrad().eps, rel=1e-7)  # a float attribute: float32
        artifacts.generate_artifacts(model, loss=artifacts.LossType.MSELoss, optimizer=ToyAdagrad(eps=EPS),
                                     artifact_directory=tmp_path / "b")

        folder = tmp_path / "b"
        state = CheckpointState.load_checkpoint(folder / "checkpoint")
        module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx", num_threads=1)
        optimizer = Optimizer(folder / "optimizer_model.onnx", module)
        optimizer.set_learning_rate(RATE)
        x, target = data()
        weight = state.parameters["W"].data.astype(np.float64)
        squares = np.zeros_like(weight)
        for step in range(3):
            if step == 2:  # the state goes through a checkpoint: saved, loaded, and the next step continues it
                CheckpointState.save_checkpoint(state, folder / "checkpoint", include_optimizer_state=True)
                state = CheckpointState.load_checkpoint(folder / "checkpoint")
                assert state.optimizer_state.kind == "ToyAdagrad"
                module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx", num_threads=1)
                optimizer = Optimizer(folder / "optimizer_model.onnx", module)
                optimizer.set_learning_rate(RATE)
            module.lazy_reset_grad()
            module(x, target)
            gradient = state.parameters["W"].grad.copy()
            optimizer.step()
            weight, squares = adagrad(weight, gradient, squares)
            np.testing.assert_allclose(state.parameters["W"].data, weight, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(optimizer.state.moments["sum_of_squares"], squares.reshape(-1), rtol=1e-6)


def test_the_toy_optimizers_parts_give_the_serial_bits():
    """A block large enough to split runs the written twin on parts: the same bits as one loop."""
    with temporary_registries():
        ToyAdagrad = add_toy_optimizer()
        rng = np.random.default_rng(2)
        w, g = rng.standard_normal(100_003).astype(np.float32), rng.standard_normal(100_003).astype(np.float32)
        runs = []
        for threads in (1, 2):
            weights, moments = w.copy(), {"sum_of_squares": np.full(w.size, 0.5, np.float32)}
            call, parts = optimizer_update.update_calls(ToyAdagrad(), weights, g, moments, RATE, 1, threads, None)
            assert (parts is call) == (threads == 1)
            optimizer_update.apply_update(ToyAdagrad(), weights, g, moments, RATE, 1, threads)
            runs.append((weights, moments["sum_of_squares"]))
        np.testing.assert_array_equal(runs[0][0], runs[1][0])
        np.testing.assert_array_equal(runs[0][1], runs[1][1])
        expected, _ = adagrad(w.astype(np.float64), g, np.full(w.size, 0.5), eps=1e-10)
        np.testing.assert_allclose(runs[0][0], expected, rtol=1e-6, atol=1e-7)
