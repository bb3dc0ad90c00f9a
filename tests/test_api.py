"""The ONNX Runtime-compatible API: semantics of Module, Optimizer, CheckpointState and the scheduler."""
import numpy as np
import onnx
import pytest

from odtrain import ArgumentError, InputError, ParameterError, StateError, artifacts
from odtrain.api import CheckpointState, LinearLRScheduler, Module, Optimizer


@pytest.fixture()
def session(mlp_artifacts):
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", state, mlp_artifacts / "eval_model.onnx")
    return state, module, Optimizer(mlp_artifacts / "optimizer_model.onnx", module)


@pytest.fixture()
def batch(mlp_reference):
    golden = mlp_reference[2]
    return golden["x"][0], golden["y"][0]


def test_gradients_accumulate_until_lazy_reset(session, batch):
    state, module, _ = session
    module(*batch)
    once = state.parameters["fc2.weight"].grad
    module(*batch)
    np.testing.assert_allclose(state.parameters["fc2.weight"].grad, 2 * once, rtol=1e-6)
    module.lazy_reset_grad()
    module(*batch)
    np.testing.assert_array_equal(state.parameters["fc2.weight"].grad, once)


def test_eval_mode_runs_the_eval_model_without_touching_gradients(session, batch):
    state, module, _ = session
    loss, logits = module(*batch)
    grads = state.parameters["fc1.weight"].grad
    module.eval()
    assert module.output_names() == ["loss", "output"] and module.input_names() == ["input", "labels"]
    eval_loss, eval_logits = module(*batch)
    assert eval_loss == loss
    np.testing.assert_array_equal(eval_logits, logits)
    np.testing.assert_array_equal(state.parameters["fc1.weight"].grad, grads)
    assert module.train() is module and module.training


def test_parameter_views_sizes_and_flags(session):
    state, module, _ = session
    assert module.get_parameters_size() == 500 * 784 + 500 + 10 * 500 + 10
    assert module.get_parameters_size(trainable_only=False) == module.get_parameters_size()
    parameter = state.parameters["fc1.bias"]
    assert parameter.requires_grad and parameter.data.shape == (500,)
    with pytest.raises(ParameterError, match="no parameter named 'fc3.weight'.*fc1.weight"):
        state.parameters["fc3.weight"]
    with pytest.raises(KeyError):
        state.parameters["fc3.weight"]
    with pytest.raises(ArgumentError, match="shape"):
        state.parameters["fc1.bias"].data = np.zeros(3, dtype=np.float32)


def test_assigned_parameter_data_changes_the_model(session, batch):
    state, module, _ = session
    module.eval()
    _, before = module(*batch)
    state.parameters["fc2.bias"].data = state.parameters["fc2.bias"].data + 1.0
    _, after = module(*batch)
    np.testing.assert_allclose(after, before + 1.0, rtol=1e-5, atol=1e-5)


def test_contiguous_buffer_round_trip(session, batch):
    state, module, optimizer = session
    buffer = module.get_contiguous_parameters(trainable_only=True)
    assert buffer.dtype == np.float32 and buffer.size == module.get_parameters_size()
    np.testing.assert_array_equal(buffer.numpy()[:10], state.parameters["fc1.weight"].data.reshape(-1)[:10])
    module(*batch)
    optimizer.step()
    assert not np.array_equal(module.get_contiguous_parameters(trainable_only=True), buffer)
    module.copy_buffer_to_parameters(buffer, trainable_only=True)
    np.testing.assert_array_equal(module.get_contiguous_parameters(trainable_only=True), buffer)
    with pytest.raises(ArgumentError, match="elements"):
        module.copy_buffer_to_parameters(buffer[:-1])


def test_the_optimizer_state_is_public_and_restarts(session, batch):
    state, module, optimizer = session
    assert state.optimizer_state is optimizer.state and optimizer.state.step == 0
    assert optimizer.config.kind == optimizer.state.kind == "AdamW"
    module(*batch)
    optimizer.step()
    optimizer.set_learning_rate(0.5)
    assert optimizer.state.step == 1 and all(m.any() for m in optimizer.state.moments.values())
    optimizer.reset_state()
    assert optimizer.state.step == 0 and not any(m.any() for m in optimizer.state.moments.values())
    assert optimizer.get_learning_rate() == 0.5


def test_learning_rate_and_linear_scheduler(session, batch):
    _, module, optimizer = session
    assert optimizer.get_learning_rate() == pytest.approx(1e-3)
    scheduler = LinearLRScheduler(optimizer, warmup_step_count=2, total_step_count=6, initial_lr=0.1)
    rates = [optimizer.get_learning_rate()]
    for _ in range(7):
        module(*batch)
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.get_learning_rate())
    np.testing.assert_allclose(rates, [0.0, 0.05, 0.1, 0.075, 0.05, 0.025, 0.0, 0.0])


def test_feeds_are_checked(session, batch):
    _, module, _ = session
    x, y = batch
    with pytest.raises(InputError, match="takes 2 inputs"):
        module(x)
    with pytest.raises(InputError, match="'input' must be float32.*astype"):
        module(x.astype(np.float64), y)
    with pytest.raises(InputError, match=r"'input' must have shape \[batch, 784\]"):
        module(x[:, :100], y)
    with pytest.raises(InputError, match="'batch'"):
        module(x, y[:10])


def test_out_of_range_label_fails_and_keeps_gradients(session, batch):
    state, module, _ = session
    module(*batch)
    grads = module.get_contiguous_parameters().copy(), state.parameters["fc1.weight"].grad
    bad = batch[1].copy()
    bad[3] = 10
    with pytest.raises(InputError, match="label"):
        module(batch[0], bad)
    np.testing.assert_array_equal(state.parameters["fc1.weight"].grad, grads[1])


def test_a_smaller_last_batch_gets_its_own_plan(session, batch):
    _, module, _ = session
    loss_full, _ = module(*batch)
    loss_part, logits = module(batch[0][:7], batch[1][:7])
    assert logits.shape == (7, 10) and np.isfinite(loss_part)
    assert module(*batch)[0] == loss_full


def test_bind_at_binds_the_step_that_a_call_at_that_batch_runs(mlp_artifacts, batch):
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", state, mlp_artifacts / "eval_model.onnx")
    step = module.bind_at(len(batch[0]))
    assert step.mode == "train" and dict(step.inputs) == {"input": batch[0].shape, "labels": batch[1].shape}
    assert step.arena_bytes == module.arena_bytes and step.lower_bound <= step.arena_bytes
    assert 0 < step.loss_step < step.plan.steps and step.recomputed_nodes == 0
    module(*batch)  # runs on the plan bound above: no second one
    (bound,) = module.bound_steps()
    assert bound.plan is step.plan
    evaluation = module.bind_at(7, training=False)
    assert [s.mode for s in module.bound_steps()] == ["train", "eval"] and evaluation.inputs[0][1][0] == 7
    for wrong in (0, -1, 2.5, True):
        with pytest.raises(ArgumentError, match="batch size"):
            module.bind_at(wrong)


def test_buffer_bytes_are_the_state_buffers(session):
    state, module, _ = session
    buffers = state.buffer_bytes()
    trainable = 4 * module.get_parameters_size(trainable_only=True)
    assert buffers.gradient_bytes == buffers.trainable_parameter_bytes == trainable
    assert buffers.parameter_bytes == 4 * module.get_parameters_size(trainable_only=False)
    assert buffers.optimizer_kind == "AdamW" and buffers.optimizer_state_bytes == {"momentum0": trainable,
                                                                                   "momentum1": trainable}
    assert module.state is state


def test_frozen_parameters_do_not_train(mlp_reference, tmp_path):
    path, _, golden = mlp_reference
    artifacts.generate_artifacts(str(path), requires_grad=["fc2.weight", "fc2.bias"], frozen_params=["fc1.weight", "fc1.bias"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path, prefix="head_")
    training = onnx.load(str(tmp_path / "head_training_model.onnx"))
    assert not any("fc1.weight_grad" in n.output for n in training.graph.node)
    state = CheckpointState.load_checkpoint(tmp_path / "head_checkpoint")
    module = Module(tmp_path / "head_training_model.onnx", state)
    optimizer = Optimizer(tmp_path / "head_optimizer_model.onnx", module)
    frozen_before = state.parameters["fc1.weight"].data
    head_before = state.parameters["fc2.weight"].data
    module(golden["x"][0], golden["y"][0])
    optimizer.step()
    assert state.parameters["fc1.weight"].grad is None and not state.parameters["fc1.weight"].requires_grad
    np.testing.assert_array_equal(state.parameters["fc1.weight"].data, frozen_before)
    assert not np.array_equal(state.parameters["fc2.weight"].data, head_before)
    assert module.get_parameters_size(trainable_only=True) == 10 * 500 + 10
    assert module.get_contiguous_parameters(trainable_only=False).size == module.get_parameters_size(False)


def test_sgd_steps_match_the_update_in_float64(mlp_reference, tmp_path):
    """After one step and after each of four more (the learning rate changed midway), every trainable
    value is w - lr·g computed in float64 from the same float32 w and g, within float32's rounding: the
    subtraction rounds to within u·|w - lr·g| (u = 2⁻²⁴), and lr and the product lr·g round to within
    u·|lr·g| each. The bound u·(|w - lr·g| + 3·|lr·g|) leaves room for second-order terms; the subtraction
    alone reaches its first term (this run: 0.9997 of the bound on the worst value). A learning rate 1% off
    moves most values by several bounds, which the last assertion checks."""
    path, meta, golden = mlp_reference
    artifacts.generate_artifacts(str(path), requires_grad=meta["requires_grad"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    unit = 2.0 ** -24
    worst, telling = 0.0, []
    for step, lr in enumerate([meta["sgd"]["lr"]] * 3 + [0.05] * 2):
        optimizer.set_learning_rate(lr)
        module(golden["x"][step], golden["y"][step])
        before = {n: state.parameters[n].data.astype(np.float64) for n in meta["requires_grad"]}
        grads = {n: state.parameters[n].grad.astype(np.float64) for n in meta["requires_grad"]}
        optimizer.step()
        module.lazy_reset_grad()
        for name in meta["requires_grad"]:
            update = lr * grads[name]
            expected = before[name] - update
            bound = unit * (np.abs(expected) + 3 * np.abs(update))
            error = np.abs(state.parameters[name].data - expected)
            assert (error <= bound).all(), (step, name, float((error / np.maximum(bound, 1e-45)).max()))
            worst = max(worst, float((error / np.maximum(bound, 1e-45)).max()))
            telling.append(np.mean(0.01 * np.abs(update) > 2 * bound))
    assert worst > 0  # float32 arithmetic, not a float64 copy
    assert min(telling) > 0.5, telling  # a 1% learning-rate error would fail on most values


def test_nominal_checkpoint_needs_values_before_training(mlp_reference, tmp_path):
    path, meta, golden = mlp_reference
    artifacts.generate_artifacts(str(path), requires_grad=meta["requires_grad"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path, nominal_checkpoint=True)
    assert (tmp_path / "nominal_checkpoint").stat().st_size < (tmp_path / "checkpoint").stat().st_size / 100
    full = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    state = CheckpointState.load_checkpoint(tmp_path / "nominal_checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    with pytest.raises(StateError, match="nominal"):
        module(golden["x"][0], golden["y"][0])
    full_module = Module(tmp_path / "training_model.onnx", full)
    module.copy_buffer_to_parameters(full_module.get_contiguous_parameters(), trainable_only=False)
    assert module(golden["x"][0], golden["y"][0]) == full_module(golden["x"][0], golden["y"][0])


def test_generate_artifacts_refuses_what_does_not_apply(mlp_reference, tmp_path):
    path, meta, _ = mlp_reference
    common = dict(requires_grad=meta["requires_grad"], loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    with pytest.raises(ArgumentError, match="ort_format"):
        artifacts.generate_artifacts(str(path), ort_format=True, **common)
    with pytest.raises(ArgumentError, match="custom_op_library"):
        artifacts.generate_artifacts(str(path), custom_op_library="libcustom.so", **common)
    with pytest.raises(ParameterError, match="'fc9.weight' is not an initializer"):
        artifacts.generate_artifacts(str(path), requires_grad=["fc9.weight"], loss=artifacts.LossType.MSELoss,
                                     artifact_directory=tmp_path)
    with pytest.raises(ArgumentError, match="additional output 'logits'"):
        artifacts.generate_artifacts(str(path), additional_output_names=["logits"], **common)
    with pytest.raises(FileNotFoundError, match="missing.onnx"):
        artifacts.generate_artifacts(str(tmp_path / "missing.onnx"), **common)

def test_only_the_cpu_device(mlp_artifacts):
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    with pytest.raises(ArgumentError, match="device 'cuda'"):
        Module(mlp_artifacts / "training_model.onnx", state, device="cuda")


def test_optimizer_hyper_parameters_are_set_at_generation(mlp_reference, tmp_path):
    path, meta, golden = mlp_reference
    artifacts.generate_artifacts(str(path), requires_grad=meta["requires_grad"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.AdamW(betas=(0.8, 0.99), eps=1e-8, weight_decay=0.01),
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    config = optimizer._config  # stored as ONNX float attributes: float32 precision
    assert config.betas == pytest.approx((0.8, 0.99)) and config.eps == pytest.approx(1e-8)
    assert config.weight_decay == pytest.approx(0.01)
    w0 = state.parameters["fc2.bias"].data.astype(np.float64)
    module(golden["x"][0], golden["y"][0])
    g = state.parameters["fc2.bias"].grad.astype(np.float64)
    optimizer.step()
    m, v = 0.2 * g, 0.01 * g * g
    step_size = 1e-3 * np.sqrt(1 - 0.99) / (1 - 0.8)
    expected = w0 - step_size * m / (np.sqrt(v) + 1e-8)
    expected -= 1e-3 * 0.01 * expected
    np.testing.assert_allclose(state.parameters["fc2.bias"].data, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("label", [10, 11, -1])
def test_a_label_at_or_past_the_class_count_is_named_with_its_sample(mlp_artifacts, mlp_reference, label):
    """The MLP has 10 classes, [0, 10): a label of 10 (one past the last, the edge) is named with its sample
    and the class count as a label further out is, not left to the kernel's generic message."""
    _, meta, golden = mlp_reference
    assert meta["classes"] == 10
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", state)
    labels = golden["y"][0].copy()
    labels[3] = label
    with pytest.raises(InputError, match=rf"input 'labels': sample 3 has label {label}, outside the model's 10 "
                                         r"classes \[0, 10\); relabel the data"):
        module(golden["x"][0], labels)
