"""Blocks (odtrain.onnxblock): custom losses, ONNX Runtime's notebook flow, SGD with momentum, nominal
checkpoints, and inference in odtrain against onnxruntime.

Oracles: float64 finite differences through onnx.reference, the PyTorch golden trajectory of the reference
MLP, numpy formulas of the losses and of torch.optim.SGD, and onnxruntime for exported models.
"""
import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

import odtrain.onnxblock as onnxblock
from odtrain import ArgumentError, ModelError, StateError, artifacts
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.inference import InferenceSession
from oracles import as_float64, assert_gradients_match, make_model

onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the inference oracle (pip install .[test])")

rng = np.random.default_rng(11)
N, D, H, K = 8, 4, 3, 2


def two_output_model():
    """x -> y1 = x·W1 + b1;  y2 = tanh(y1)·W2 + b2. Both outputs are scored by the loss."""
    params = {"W1": rng.standard_normal((D, H)).astype(np.float32), "b1": rng.standard_normal(H).astype(np.float32),
              "W2": rng.standard_normal((H, K)).astype(np.float32), "b2": rng.standard_normal(K).astype(np.float32)}
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["y1"]), helper.make_node("Tanh", ["y1"], ["h"]),
             helper.make_node("Gemm", ["h", "W2", "b2"], ["y2"])]
    model = make_model(nodes, params, inputs=[("x", np.float32, ["batch", D])],
                       outputs=[("y1", np.float32, ["batch", H]), ("y2", np.float32, ["batch", K])])
    return model, params


class WeightedLoss(onnxblock.Block):
    """0.7 · MSE(y1, target1) + 0.3 · L1(y2, target2)."""

    def __init__(self):
        super().__init__()
        self.mse, self.l1 = onnxblock.loss.MSELoss(), onnxblock.loss.L1Loss()
        self.add, self.mul = onnxblock.blocks.Add(), onnxblock.blocks.Mul()

    def build(self, first, second):
        return self.add(self.mul(0.7, self.mse(first, "target1")), self.mul(0.3, self.l1(second, "target2")))


def test_custom_loss_gradients_match_finite_differences_and_it_trains(tmp_path):
    model, params = two_output_model()
    artifacts.generate_artifacts(model, requires_grad=list(params), loss=WeightedLoss(),
                                 optimizer=onnxblock.optim.SGDMomentum(momentum=0.9), artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    assert module.input_names() == ["x", "target1", "target2"] and module.output_names() == ["loss"]
    x = rng.standard_normal((N, D)).astype(np.float32)
    t1 = rng.standard_normal((N, H)).astype(np.float32)
    t2 = rng.standard_normal((N, K)).astype(np.float32)
    loss = float(module(x, t1, t2))

    reference = ReferenceEvaluator(as_float64(onnx.load(str(tmp_path / "eval_model.onnx"))))
    feeds = {"x": x.astype(np.float64), "target1": t1.astype(np.float64), "target2": t2.astype(np.float64)}

    def loss64(values):
        return float(reference.run(None, {**feeds, **values})[0])

    params64 = {k: v.astype(np.float64) for k, v in params.items()}
    y1 = x @ params64["W1"] + params64["b1"]
    y2 = np.tanh(y1) @ params64["W2"] + params64["b2"]
    w1, w2 = float(np.float32(0.7)), float(np.float32(0.3))  # the block's constants are float32
    assert loss64(params64) == pytest.approx(w1 * np.mean((y1 - t1) ** 2) + w2 * np.mean(np.abs(y2 - t2)), rel=1e-12)
    assert loss == pytest.approx(loss64(params64), rel=1e-5)
    assert_gradients_match(state, loss64, params64)

    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(0.02)
    for _ in range(40):
        module.lazy_reset_grad()
        module(x, t1, t2)
        optimizer.step()
    module.eval()
    assert float(module(x, t1, t2)) < 0.5 * loss


# ONNX Runtime's MNIST notebook, imports changed -------------------------------------------------------------


class MNISTTrainingBlock(onnxblock.TrainingBlock):
    def __init__(self):
        super(MNISTTrainingBlock, self).__init__()
        self.loss = onnxblock.loss.CrossEntropyLoss()

    def build(self, output_name):
        return self.loss(output_name), output_name


@pytest.fixture(scope="module")
def notebook_artifacts(mlp_reference, tmp_path_factory):
    """The offline step of the notebook, line for line."""
    onnx_model = onnx.load(str(mlp_reference[0]))
    data = tmp_path_factory.mktemp("data")

    training_block = MNISTTrainingBlock()
    for param in onnx_model.graph.initializer:
        training_block.requires_grad(param.name, True)

    model_params = None
    with onnxblock.base(onnx_model):
        _ = training_block(*[output.name for output in onnx_model.graph.output])
        training_model, eval_model = training_block.to_model_proto()
        model_params = training_block.parameters()

    optimizer_block = onnxblock.optim.AdamW()
    with onnxblock.empty_base() as accessor:  # noqa: F841  (the notebook's line)
        _ = optimizer_block(model_params)
        optimizer_model = optimizer_block.to_model_proto()

    onnxblock.save_checkpoint(training_block.parameters(), data / "checkpoint")
    onnx.save(training_model, data / "training_model.onnx")
    onnx.save(optimizer_model, data / "optimizer_model.onnx")
    onnx.save(eval_model, data / "eval_model.onnx")
    return data


def test_notebook_flow_trains_along_the_golden_losses(notebook_artifacts, mlp_reference, tmp_path):
    _, meta, golden = mlp_reference
    state = CheckpointState.load_checkpoint(notebook_artifacts / "checkpoint")
    model = Module(notebook_artifacts / "training_model.onnx", state, notebook_artifacts / "eval_model.onnx")
    optimizer = Optimizer(notebook_artifacts / "optimizer_model.onnx", model)
    model.train()
    losses = []
    for step in range(meta["steps"]):
        train_loss, logits = model(golden["x"][step], golden["y"][step])
        optimizer.step()
        model.lazy_reset_grad()
        losses.append(float(train_loss))
        assert logits.shape == (64, 10)
    np.testing.assert_allclose(losses, golden["adamw_losses"], rtol=1e-4)

    model.eval()
    test_loss, logits = model(golden["x"][0], golden["y"][0])
    assert np.isfinite(test_loss) and logits.shape == (64, 10)

    # Inference in odtrain's runtime and in onnxruntime: the same outputs
    model.export_model_for_inferencing(tmp_path / "inference_model.onnx", ["output"])
    session = InferenceSession(str(tmp_path / "inference_model.onnx"), providers=["CPUExecutionProvider"])
    oracle = onnxruntime.InferenceSession(str(tmp_path / "inference_model.onnx"), providers=["CPUExecutionProvider"])
    for batch in (golden["x"][0], golden["x"][3][:5]):
        (ours,) = session.run(["output"], {"input": batch})
        (theirs,) = oracle.run(["output"], {"input": batch})
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(session.run(None, {"input": golden["x"][0]})[0], logits, rtol=1e-6, atol=1e-6)


def test_blocks_need_no_global_context(mlp_reference, notebook_artifacts):
    path = str(mlp_reference[0])
    explicit = MNISTTrainingBlock()
    for name in mlp_reference[1]["requires_grad"]:
        explicit.requires_grad(name)
    training_model, eval_model = explicit.to_model_proto(path)
    written = onnx.load(str(notebook_artifacts / "training_model.onnx"))
    assert training_model.SerializeToString() == written.SerializeToString()
    assert [o.name for o in eval_model.graph.output] == ["loss", "output"]
    optimizer_model = onnxblock.optim.AdamW().to_model_proto(explicit.parameters())
    assert optimizer_model.graph.node[0].op_type == "AdamW"

    class BoundBlock(onnxblock.TrainingBlock):
        def __init__(self, model):
            super().__init__(model)
            self.loss = onnxblock.loss.MSELoss(reduction="sum")

        def build(self, output_name):
            return self.loss(output_name)

    bound = BoundBlock(path)
    bound.requires_grad("fc2.weight")
    bound.requires_grad("fc1.weight", False)
    assert bound("output") == "loss"
    trainable, frozen = bound.parameters()
    assert [t.name for t in trainable] == ["fc2.weight"] and [t.name for t in frozen] == ["fc1.weight"]

    with pytest.raises(StateError, match="with onnxblock.base"):
        onnxblock.loss.MSELoss()("output")
    with pytest.raises(StateError, match="parameters"):
        onnxblock.optim.SGD().to_model_proto()
    with pytest.raises(ArgumentError, match="requires_grad"):
        MNISTTrainingBlock().to_model_proto(path)


def test_a_loss_that_is_not_a_scalar_cannot_train(mlp_reference):
    class Unreduced(onnxblock.TrainingBlock):
        def build(self, output_name):
            return onnxblock.loss.L1Loss(reduction="none")(output_name)

    block = Unreduced()
    block.requires_grad("fc2.bias")
    with pytest.raises(ModelError, match="must be a scalar"):
        block.to_model_proto(str(mlp_reference[0]))


# Nominal checkpoints ------------------------------------------------------------------------------------------


def test_nominal_checkpoint_refuses_until_loaded_then_trains_identically(notebook_artifacts, mlp_reference, tmp_path):
    _, meta, golden = mlp_reference
    full = CheckpointState.load_checkpoint(notebook_artifacts / "checkpoint")
    trainable = [onnx.numpy_helper.from_array(full.parameters[n].data, name=n) for n in meta["requires_grad"]]
    onnxblock.save_checkpoint((trainable, []), tmp_path / "nominal_checkpoint", nominal_checkpoint=True)
    assert (tmp_path / "nominal_checkpoint").stat().st_size < 4096

    state = CheckpointState.load_checkpoint(tmp_path / "nominal_checkpoint")
    module = Module(notebook_artifacts / "training_model.onnx", state, notebook_artifacts / "eval_model.onnx")
    optimizer = Optimizer(notebook_artifacts / "optimizer_model.onnx", module)
    batch = golden["x"][0], golden["y"][0]
    with pytest.raises(StateError, match="nominal"):
        module(*batch)
    with pytest.raises(StateError, match="nominal"):
        optimizer.step()
    with pytest.raises(StateError, match="nominal"):
        module.export_model_for_inferencing(tmp_path / "inference.onnx", ["output"])
    CheckpointState.save_checkpoint(state, tmp_path / "still_nominal")  # nothing loaded: stays shapes only
    assert (tmp_path / "still_nominal").stat().st_size < 4096

    for name in meta["requires_grad"][:-1]:
        state.parameters[name].data = full.parameters[name].data
    with pytest.raises(StateError, match="'fc2.bias'"):
        module.eval()(*batch)
    with pytest.raises(StateError, match="'fc2.bias'"):
        CheckpointState.save_checkpoint(state, tmp_path / "partial")
    state.parameters["fc2.bias"].data = full.parameters["fc2.bias"].data

    full_module = Module(notebook_artifacts / "training_model.onnx", full)
    full_optimizer = Optimizer(notebook_artifacts / "optimizer_model.onnx", full_module)
    module.train()
    for step in range(3):
        results = []
        for m, o in ((module, optimizer), (full_module, full_optimizer)):
            loss, logits = m(golden["x"][step], golden["y"][step])
            o.step()
            m.lazy_reset_grad()
            results.append((loss, logits))
        assert results[0][0] == results[1][0]
        np.testing.assert_array_equal(results[0][1], results[1][1])
    np.testing.assert_array_equal(module.get_contiguous_parameters(), full_module.get_contiguous_parameters())


# SGD with momentum and Nesterov --------------------------------------------------------------------------------


def torch_sgd_step(w, g, buffer, lr, momentum, dampening, nesterov, weight_decay, first):
    """torch.optim.SGD's update, in float64."""
    d = g + weight_decay * w
    if momentum:
        buffer = d.copy() if first else momentum * buffer + (1 - dampening) * d
        d = d + momentum * buffer if nesterov else buffer
    return w - lr * d, buffer


@pytest.mark.parametrize("momentum, dampening, nesterov, weight_decay", [
    (0.9, 0.0, False, 0.0), (0.9, 0.0, True, 0.01), (0.5, 0.25, False, 0.05), (0.0, 0.0, False, 0.1)],
    ids=["momentum", "nesterov", "dampening", "decay-only"])
def test_sgd_momentum_follows_torch_formula(momentum, dampening, nesterov, weight_decay, tmp_path):
    model, params = two_output_model()
    block = onnxblock.optim.SGD(momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay)
    artifacts.generate_artifacts(model, requires_grad=list(params), loss=onnxblock.loss.MSELoss(),
                                 loss_input_names=["y2"], optimizer=block, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(0.1)
    # hyper-parameters travel as ONNX float attributes: compare against their float32 values
    mu, tau, decay = (float(np.float32(v)) for v in (momentum, dampening, weight_decay))
    weights = {n: state.parameters[n].data.astype(np.float64) for n in params}
    buffers = {n: np.zeros_like(w) for n, w in weights.items()}
    for step in range(6):
        x = rng.standard_normal((N, D)).astype(np.float32)
        module.lazy_reset_grad()
        module(x, rng.standard_normal((N, K)).astype(np.float32))
        for name in params:
            weights[name], buffers[name] = torch_sgd_step(weights[name], state.parameters[name].grad.astype(np.float64),
                                                          buffers[name], 0.1, mu, tau, nesterov, decay, step == 0)
        optimizer.step()
        for name in params:
            np.testing.assert_allclose(state.parameters[name].data, weights[name], rtol=2e-5, atol=2e-6,
                                       err_msg=f"{name} after step {step + 1}")


def test_momentum_buffer_travels_in_the_checkpoint(tmp_path):
    model, params = two_output_model()
    artifacts.generate_artifacts(model, requires_grad=list(params), loss=onnxblock.loss.L1Loss(),
                                 loss_input_names=["y2"], optimizer=artifacts.SGDMomentum(momentum=0.8, nesterov=True),
                                 artifact_directory=tmp_path)
    batches = [(rng.standard_normal((N, D)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32))
               for _ in range(5)]

    def run(module, optimizer, steps):
        for x, t in steps:
            module.lazy_reset_grad()
            module(x, t)
            optimizer.step()

    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(0.05)
    run(module, optimizer, batches[:3])
    CheckpointState.save_checkpoint(state, tmp_path / "resumed", include_optimizer_state=True)
    run(module, optimizer, batches[3:])

    resumed = CheckpointState.load_checkpoint(tmp_path / "resumed")
    resumed_module = Module(tmp_path / "training_model.onnx", resumed)
    resumed_optimizer = Optimizer(tmp_path / "optimizer_model.onnx", resumed_module)
    assert resumed._optimizer.step == 3 and resumed_optimizer.get_learning_rate() == pytest.approx(0.05)
    assert np.abs(resumed._optimizer.moments["momentum_buffer"]).max() > 0
    run(resumed_module, resumed_optimizer, batches[3:])
    np.testing.assert_array_equal(resumed_module.get_contiguous_parameters(), module.get_contiguous_parameters())


def test_optimizer_blocks_and_their_checks():
    names = ["a", "b"]
    assert onnxblock.optim.SGD().to_model_proto(names).graph.node[0].op_type == "SGD"
    node = onnxblock.optim.SGDMomentum(0.9, nesterov=True).to_model_proto(names).graph.node[0]
    assert node.op_type == "SGDMomentum" and node.domain == "ai.odtrain"
    assert {a.name for a in node.attribute} == {"momentum", "dampening", "nesterov", "weight_decay", "parameters"}
    with pytest.raises(ArgumentError, match="Nesterov"):
        onnxblock.optim.SGD(momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(ArgumentError, match="momentum >= 0"):
        onnxblock.optim.SGDMomentum(momentum=-1)
    with pytest.raises(ArgumentError, match="clip_grad"):
        onnxblock.optim.AdamW(clip_grad=1.0)


# Loss blocks against numpy, every reduction --------------------------------------------------------------------


class Scored(onnxblock.ForwardBlock):
    """The model's scores, then a loss block: a forward model whose output is the loss."""

    def __init__(self, loss):
        super().__init__()
        self.loss = loss

    def build(self, output_name):
        return self.loss(output_name)


def scores_model():
    scale = {"scale": rng.uniform(0.5, 2.0, (1, K + 1)).astype(np.float32)}
    nodes = [helper.make_node("Mul", ["x", "scale"], ["scores"])]
    return make_model(nodes, scale, inputs=[("x", np.float32, ["batch", K + 1])],
                      outputs=[("scores", np.float32, ["batch", K + 1])]), scale["scale"]


def reduce(values, reduction, weights=None):
    if reduction == "none":
        return values
    return values.sum() / (values.size if weights is None else weights.sum()) if reduction == "mean" else values.sum()


def log_sigmoid(z):
    return -np.logaddexp(0.0, -z)


CLASS_WEIGHT = np.array([0.5, 2.0, 1.0], dtype=np.float32)
POS_WEIGHT = np.array([3.0, 0.5, 1.0], dtype=np.float32)
ELEMENT_WEIGHT = np.array([1.0, 0.25, 2.0], dtype=np.float32)


def expected_loss(kind, scores, target, reduction):
    s, t = scores.astype(np.float64), target
    if kind == "MSELoss":
        return reduce((s - t) ** 2, reduction)
    if kind == "L1Loss":
        return reduce(np.abs(s - t), reduction)
    if kind == "BCEWithLogitsLoss":
        p, w = POS_WEIGHT.astype(np.float64), ELEMENT_WEIGHT.astype(np.float64)
        return reduce(-w * (p * t * log_sigmoid(s) + (1 - t) * log_sigmoid(-s)), reduction)
    log_prob = s - np.logaddexp.reduce(s, axis=1, keepdims=True)
    kept = t != 1  # ignore_index=1
    w = np.where(kept, CLASS_WEIGHT[np.where(kept, t, 0)], 0.0)
    per_sample = -w * log_prob[np.arange(len(t)), np.where(kept, t, 0)]
    return reduce(per_sample, reduction, w)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kind", ["MSELoss", "L1Loss", "BCEWithLogitsLoss", "CrossEntropyLoss"])
def test_loss_blocks_match_numpy(kind, reduction):
    model, scale = scores_model()
    if kind == "CrossEntropyLoss":
        loss = onnxblock.loss.CrossEntropyLoss(weight=CLASS_WEIGHT, reduction=reduction, ignore_index=1)
        target_name, target = "labels", rng.integers(0, K + 1, N).astype(np.int64)
    elif kind == "BCEWithLogitsLoss":
        loss = onnxblock.loss.BCEWithLogitsLoss(weight=ELEMENT_WEIGHT, reduction=reduction, pos_weight=POS_WEIGHT)
        target_name, target = "target", rng.integers(0, 2, (N, K + 1)).astype(np.float32)
    else:
        loss = getattr(onnxblock.loss, kind)(reduction=reduction)
        target_name, target = "target", rng.standard_normal((N, K + 1)).astype(np.float32)
    forward = Scored(loss).to_model_proto(model)
    onnx.checker.check_model(forward)
    x = (rng.standard_normal((N, K + 1)) * 4).astype(np.float32)
    (value,) = InferenceSession(forward).run(None, {"x": x, target_name: target})
    expected = expected_loss(kind, x * scale, target, reduction)
    assert value.shape == np.shape(expected)
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
    (oracle,) = onnxruntime.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, target_name: target})
    np.testing.assert_allclose(value, oracle, rtol=1e-5, atol=1e-6)


def test_mean_loss_blocks_equal_the_built_in_losses(tmp_path):
    model, _ = scores_model()
    x = rng.standard_normal((N, K + 1)).astype(np.float32)
    for kind, target in (("MSELoss", rng.standard_normal((N, K + 1)).astype(np.float32)),
                         ("CrossEntropyLoss", rng.integers(0, K + 1, N).astype(np.int64))):
        values = []
        for loss in (getattr(onnxblock.loss, kind)(), artifacts.LossType[kind]):
            folder = tmp_path / f"{kind}_{len(values)}"
            artifacts.generate_artifacts(model, requires_grad=["scale"], loss=loss, artifact_directory=folder)
            state = CheckpointState.load_checkpoint(folder / "checkpoint")
            values.append((float(Module(folder / "training_model.onnx", state)(x, target)),
                           state.parameters["scale"].grad))
        assert values[0][0] == values[1][0]
        np.testing.assert_array_equal(values[0][1], values[1][1])


def test_building_blocks_compose(tmp_path):
    """A hand-written smooth loss, mean(log(1 + (s - t)²)) · 2 + 0.1 · mean(sigmoid(s)), from elementwise blocks."""
    b = onnxblock.blocks

    class LogCosh(onnxblock.Block):
        def build(self, scores):
            target = b.InputLike(scores)("target")
            square = b.Pow(2)(b.Sub()(scores, target))
            log_term = b.ReduceMean()(b.Log()(b.Add()(square, b.Constant(1.0)())))
            return b.Add()(b.Mul()(log_term, 2.0), b.Mul()(0.1, b.ReduceMean()(b.Sigmoid()(scores))))

    model, scale = scores_model()
    artifacts.generate_artifacts(model, requires_grad=["scale"], loss=LogCosh(), artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    x, t = rng.standard_normal((N, K + 1)).astype(np.float32), rng.standard_normal((N, K + 1)).astype(np.float32)
    s = (x * scale).astype(np.float64)
    expected = 2 * np.mean(np.log1p((s - t) ** 2)) + 0.1 * np.mean(1 / (1 + np.exp(-s)))
    assert float(module(x, t)) == pytest.approx(expected, rel=1e-5)
    sig = 1 / (1 + np.exp(-s))
    d_scores = 2 * 2 * (s - t) / (1 + (s - t) ** 2) / s.size + 0.1 * sig * (1 - sig) / s.size
    np.testing.assert_allclose(state.parameters["scale"].grad, (d_scores * x).sum(axis=0, keepdims=True), rtol=1e-4)
