"""Dropout's random streams: each node draws its own mask, runs are reproducible, a resumed run continues.

The oracle is the property, not a number: two Dropout layers of one shape in one step keep different units
(ONNX Runtime and PyTorch draw each layer's mask from its own stream; a stream seeded from the node's `seed`
attribute alone, 0 unless set, gives every layer the same mask); the same run seed gives the same masks;
another run seed other masks; a run saved after some steps and loaded again draws at its next step what the
run that never stopped draws.
"""
import numpy as np
import pytest
from onnx import helper

from oracles import make_model

from odtrain import artifacts
from odtrain.api import CheckpointState, Module, Optimizer

RATIO = 0.5
X = np.random.default_rng(3).uniform(0.5, 1.5, (8, 64)).astype(np.float32)


@pytest.fixture(scope="module")
def two_dropouts(tmp_path_factory):
    """Two Dropout layers of the same shape (no seed attribute, as exporters write them), both outputs returned."""
    nodes = [helper.make_node("Dropout", ["x", "ratio", "training"], ["a"], name="first"),
             helper.make_node("Dropout", ["a", "ratio", "training"], ["b"], name="second"),
             helper.make_node("Mul", ["b", "w"], ["bw"]),
             helper.make_node("ReduceSum", ["bw"], ["loss"], keepdims=0)]
    model = make_model(nodes, {"w": np.ones((8, 64), np.float32), "ratio": np.array(RATIO, np.float32),
                               "training": np.array(True)},
                       inputs=[("x", np.float32, [8, 64])], outputs=[("loss", np.float32, [])])
    directory = tmp_path_factory.mktemp("two_dropouts")
    artifacts.generate_artifacts(model, requires_grad=["w"], loss=None, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=directory, additional_output_names=["a", "b"])
    return directory


def _session(directory, checkpoint=None, seed=None):
    state = CheckpointState.load_checkpoint(checkpoint or directory / "checkpoint")
    if seed is not None:
        state.random_seed = seed
    module = Module(directory / "training_model.onnx", state)
    return state, module, Optimizer(directory / "optimizer_model.onnx", module)


def _masks(module, optimizer, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The units each layer kept at each of `steps` training steps."""
    masks = []
    for _ in range(steps):
        module.lazy_reset_grad()
        _, a, b = module(X)
        optimizer.step()
        masks.append((a != 0, b != 0))
    return masks


def test_two_dropout_layers_of_one_shape_drop_different_units(two_dropouts):
    _, module, optimizer = _session(two_dropouts)
    for first, second in _masks(module, optimizer, 3):
        assert 0.3 < first.mean() < 0.7
        # the second layer's input is the first's output: compare where both had a unit to keep
        agree = (first == (second | ~first))[first].mean()
        assert agree < 0.8, f"the layers kept the same units ({agree:.0%} agreement): one stream for both"


def test_each_step_draws_a_new_mask_and_the_same_seed_repeats_them(two_dropouts):
    _, module, optimizer = _session(two_dropouts)
    masks = _masks(module, optimizer, 3)
    assert not np.array_equal(masks[0][0], masks[1][0]) and not np.array_equal(masks[1][0], masks[2][0])
    _, again, again_optimizer = _session(two_dropouts)
    for (a, b), (a2, b2) in zip(masks, _masks(again, again_optimizer, 3)):
        np.testing.assert_array_equal(a, a2)
        np.testing.assert_array_equal(b, b2)
    _, other, other_optimizer = _session(two_dropouts, seed=1)
    assert not np.array_equal(_masks(other, other_optimizer, 1)[0][0], masks[0][0]), "the run's seed is ignored"


def test_a_resumed_run_draws_what_an_uninterrupted_run_draws(two_dropouts, tmp_path):
    _, whole, whole_optimizer = _session(two_dropouts, seed=7)
    uninterrupted = _masks(whole, whole_optimizer, 5)
    state, first_part, first_optimizer = _session(two_dropouts, seed=7)
    _masks(first_part, first_optimizer, 3)
    CheckpointState.save_checkpoint(state, tmp_path / "checkpoint", include_optimizer_state=True)
    resumed_state, resumed, resumed_optimizer = _session(two_dropouts, tmp_path / "checkpoint")
    assert resumed_state.random_seed == 7
    for (a, b), (a2, b2) in zip(uninterrupted[3:], _masks(resumed, resumed_optimizer, 2)):
        np.testing.assert_array_equal(a, a2)
        np.testing.assert_array_equal(b, b2)


def test_a_new_batch_shape_continues_the_streams(two_dropouts, tmp_path):
    """Another input shape binds another plan: its Dropouts must not start their streams over."""
    nodes = [helper.make_node("Dropout", ["x", "ratio", "training"], ["a"], name="only"),
             helper.make_node("Mul", ["a", "w"], ["aw"]), helper.make_node("ReduceSum", ["aw"], ["loss"], keepdims=0)]
    model = make_model(nodes, {"w": np.ones(64, np.float32), "ratio": np.array(RATIO, np.float32),
                               "training": np.array(True)},
                       inputs=[("x", np.float32, ["batch", 64])], outputs=[("loss", np.float32, [])])
    artifacts.generate_artifacts(model, requires_grad=["w"], loss=None, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path, additional_output_names=["a"])
    module = Module(tmp_path / "training_model.onnx", CheckpointState.load_checkpoint(tmp_path / "checkpoint"))
    first = module(X)[1] != 0
    module(X[:4])
    third = module(X)[1] != 0
    assert not np.array_equal(first, third)
