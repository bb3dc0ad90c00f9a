"""The built-in losses: values against ONNX's reference evaluator, gradients against float64 differences."""
import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from odtrain import artifacts
from odtrain.api import CheckpointState, Module, Optimizer
from oracles import as_float64, assert_gradients_match, make_model

rng = np.random.default_rng(7)
N, D, K = 6, 5, 3


def linear_model():
    params = {"W": rng.standard_normal((D, K)).astype(np.float32), "b": rng.standard_normal(K).astype(np.float32)}
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["logits"])]
    return make_model(nodes, params, inputs=[("x", np.float32, ["batch", D])],
                      outputs=[("logits", np.float32, ["batch", K])]), params


def targets(loss_type):
    if loss_type is artifacts.LossType.CrossEntropyLoss:
        return rng.integers(0, K, N).astype(np.int64)
    if loss_type is artifacts.LossType.BCEWithLogitsLoss:
        return rng.integers(0, 2, (N, K)).astype(np.float32)
    return rng.standard_normal((N, K)).astype(np.float32)


@pytest.mark.parametrize("loss_type", list(artifacts.LossType), ids=lambda t: t.name)
def test_loss_value_gradient_and_training(loss_type, tmp_path):
    model, params = linear_model()
    artifacts.generate_artifacts(model, requires_grad=["W", "b"], loss=loss_type,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    x = rng.standard_normal((N, D)).astype(np.float32) * 3
    t = targets(loss_type)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    assert module.input_names() == ["x", "labels" if loss_type is artifacts.LossType.CrossEntropyLoss else "target"]
    loss = float(module(x, t))

    reference = ReferenceEvaluator(as_float64(onnx.load(str(tmp_path / "eval_model.onnx"))))

    def loss64(values):
        feeds = {"x": x.astype(np.float64), module.input_names()[1]: t if t.dtype == np.int64 else t.astype(np.float64)}
        return float(reference.run(None, {**feeds, **values})[0])

    params64 = {k: v.astype(np.float64) for k, v in params.items()}
    assert loss == pytest.approx(loss64(params64), rel=1e-5)
    assert_gradients_match(state, loss64, params64)

    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(0.05)
    for _ in range(30):
        module.lazy_reset_grad()
        module(x, t)
        optimizer.step()
    module.eval()
    assert float(module(x, t)) < 0.8 * loss


def test_model_output_as_the_loss(tmp_path):
    """loss=None: the model computes its own scalar loss (a custom loss built into the ONNX graph)."""
    params = {"w": rng.standard_normal(D).astype(np.float32)}
    nodes = [helper.make_node("Mul", ["x", "w"], ["p"]), helper.make_node("Mul", ["p", "p"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    model = make_model(nodes, params, inputs=[("x", np.float32, ["batch", D])], outputs=[("loss", np.float32, [])])
    artifacts.generate_artifacts(model, requires_grad=["w"], optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    x = rng.standard_normal((4, D)).astype(np.float32)
    module(x)
    expected = 2 * (x * x).sum(axis=0) * params["w"] / x.size  # the mean runs over every element
    np.testing.assert_allclose(state.parameters["w"].grad, expected, rtol=1e-5)
