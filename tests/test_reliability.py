"""Bad input gets a clear error and loses nothing.

One row per mistake a user can make: the call, the exception type it must raise (an OdtrainError
that is also the matching built-in), and the text that names the culprit.
"""
import os
import shutil

import numpy as np
import onnx
import pytest
import safetensors.numpy
from onnx import helper

from odtrain import (ArgumentError, ArtifactNotFoundError, CheckpointError, InferenceSession, InputError,
                     MemoryBudgetError, ModelError, NonFiniteError, OdtrainError, ParameterError, StateError,
                     UnsupportedOpError, artifacts)
from odtrain import checkpoint as checkpoint_file
from odtrain.api import CheckpointState, LinearLRScheduler, Module, Optimizer
from oracles import make_model

CE = artifacts.LossType.CrossEntropyLoss


@pytest.fixture(scope="module")
def env(tmp_path_factory, mlp_reference):
    """A folder with the reference MLP, its artifacts, and a trained session's pieces."""
    root = tmp_path_factory.mktemp("reliability")
    path, meta, golden = mlp_reference
    shutil.copy(path, root / "model.onnx")
    artifacts.generate_artifacts(str(path), requires_grad=meta["requires_grad"], loss=CE,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=root / "art")
    artifacts.generate_artifacts(str(path), requires_grad=["fc2.weight", "fc2.bias"], loss=CE,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=root / "head")
    (root / "garbage.onnx").write_bytes(os.urandom(300))
    return root, golden


def session(env, **options):
    root, _ = env
    state = CheckpointState.load_checkpoint(root / "art" / "checkpoint")
    return state, Module(root / "art" / "training_model.onnx", state, root / "art" / "eval_model.onnx", **options)


def model_with(nodes, initializers=None, inputs=(("x", np.float32, ["batch", 4]),), outputs=(("y", np.float32, None),), opset=17):
    return make_model(nodes, initializers or {"w": np.ones((4, 3), np.float32)}, inputs=inputs,
                      outputs=[o if o[2] is not None else o[0] for o in outputs], opset=opset)


def escaping_model(root):
    folder = root / "escape"
    folder.mkdir(exist_ok=True)
    tensor = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[4, 3])
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="../secret.bin")
    (root / "secret.bin").write_bytes(np.ones(12, np.float32).tobytes())
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, ["batch", 4])], [helper.make_empty_tensor_value_info("y")], [tensor])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(folder / "m.onnx"))
    return str(folder / "m.onnx")


def foreign_domain_model():
    """Two nodes of a domain odtrain does not implement, declared in the model's opset imports."""
    model = model_with([helper.make_node("NoSuchOp", ["x"], ["a"], domain="com.example", name="mystery"),
                        helper.make_node("Frobnicate", ["a", "w"], ["y"], domain="com.example")])
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    return model


def expanded(side: int, constant: bool = False):
    """x (or a constant) [1, 4] -> Expand to [side, side, 4] ('bomb') -> ReduceMean: a scalar from a huge value."""
    source = "c" if constant else "x"
    nodes = [helper.make_node("Mul", [source, "w"], ["a"], name="scale"),
             helper.make_node("Expand", ["a", "shape"], ["b"], name="bomb"),
             helper.make_node("ReduceMean", ["b"], ["y"], keepdims=0, name="mean")]
    if constant:
        nodes.append(helper.make_node("Add", ["y", "x"], ["z"], name="shift"))
    return make_model(nodes, {"w": np.ones((1, 4), np.float32), "c": np.ones((1, 1, 4), np.float32),
                              "shape": np.array([side, side, 4], np.int64)},
                      inputs=[("x", np.float32, ["batch", 1, 4])], outputs=[("z" if constant else "y", np.float32, None)])


def memory_bomb_training_step(env):
    """The step needs 149 GiB: refused before allocating, on a machine said to have 64 GiB (so that the
    row never allocates, even where 149 GiB would be granted)."""
    from unittest import mock

    from odtrain import allocation

    generate(expanded(100_000), env[0] / "bomb", requires_grad=["w"], loss=None)
    state = CheckpointState.load_checkpoint(env[0] / "bomb" / "checkpoint")
    module = Module(env[0] / "bomb" / "training_model.onnx", state)
    with mock.patch.object(allocation, "memory_limit", return_value=(64 * 2**30, "this machine's memory")):
        module(np.ones((1, 1, 4), np.float32))


def generate(model, directory, **kwargs):
    kwargs.setdefault("loss", artifacts.LossType.MSELoss)
    return artifacts.generate_artifacts(model, artifact_directory=directory, **kwargs)


def damaged_checkpoint(root, how):
    source = (root / "art" / "checkpoint").read_bytes()
    target = root / f"ckpt_{how}"
    if how == "truncated":
        target.write_bytes(source[: len(source) // 2])
    elif how == "flipped":
        blob = bytearray(source)
        blob[-100] ^= 1
        target.write_bytes(bytes(blob))
    elif how == "version":
        target.write_bytes(source.replace(f'"format_version":"{checkpoint_file.FORMAT_VERSION}"'.encode(),
                                          b'"format_version":"7"'))
    elif how == "foreign":
        target.write_bytes((root / "model.onnx").read_bytes())
    elif how == "other tool":  # well-formed safetensors, as PyTorch and Hugging Face write them
        target.write_bytes(safetensors.numpy.save({"weight": np.ones(3, np.float32)}, metadata={"format": "pt"}))
    return target


def feeds(env, **change):
    _, golden = env
    x, y = golden["x"][0].copy(), golden["y"][0].copy()
    return change.get("x", x), change.get("y", y)


def mismatched_optimizer(env):
    root, _ = env
    _, module = session(env)
    Optimizer(root / "head" / "optimizer_model.onnx", module)


def nan_input(env):
    _, module = session(env, check_finite=True)
    x, y = feeds(env)
    x[3, 7] = np.nan
    module(x, y)


ROWS = {
    # models and artifact generation
    "missing model": (lambda e: generate(str(e[0] / "nope.onnx"), e[0] / "o"), ArtifactNotFoundError, "nope.onnx"),
    "garbage model": (lambda e: generate(str(e[0] / "garbage.onnx"), e[0] / "o"), ModelError, "garbage.onnx"),
    "unsupported op": (lambda e: generate(model_with([helper.make_node("Det", ["x"], ["y"], name="pick")]), e[0] / "o", requires_grad=[]),
                       UnsupportedOpError, "Det node 'pick'"),
    "foreign domain op": (lambda e: generate(model_with([helper.make_node("FusedGemm", ["x", "w"], ["y"], domain="com.microsoft", name="fg")]), e[0] / "o"),
                          UnsupportedOpError, "FusedGemm node 'fg' of domain 'com.microsoft'"),
    "nodes of a declared foreign domain": (lambda e: generate(foreign_domain_model(), e[0] / "o"), UnsupportedOpError,
                                           "com.example: NoSuchOp node 'mystery' of domain 'com.example'; Frobnicate node "
                                           "'Frobnicate_1' of domain 'com.example'"),
    "opset from the future": (lambda e: generate(model_with([helper.make_node("MatMul", ["x", "w"], ["y"])], opset=99), e[0] / "o"),
                              ModelError, "opset 99"),
    "external data escapes": (lambda e: generate(escaping_model(e[0]), e[0] / "o"), ModelError, "'w' keeps its data at '../secret.bin'"),
    "unknown trainable name": (lambda e: generate(str(e[0] / "model.onnx"), e[0] / "o", requires_grad=["fc9.bias"], loss=CE), ParameterError, "fc9.bias"),
    "trainable and frozen": (lambda e: generate(str(e[0] / "model.onnx"), e[0] / "o", requires_grad=["fc1.bias"], frozen_params=["fc1.bias"], loss=CE),
                             ArgumentError, "fc1.bias"),
    "unknown loss input": (lambda e: generate(str(e[0] / "model.onnx"), e[0] / "o", loss_input_names=["logits"], loss=CE), ArgumentError, "'logits'"),
    "two outputs, no loss input": (lambda e: generate(model_with([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
                                                                 outputs=(("y", np.float32, None), ("z", np.float32, None))), e[0] / "o"),
                                   ArgumentError, "loss_input_names"),
    "non-scalar model loss": (lambda e: generate(model_with([helper.make_node("MatMul", ["x", "w"], ["y"])], outputs=(("y", np.float32, ["batch", 3]),)),
                                                 e[0] / "o", loss=None), ModelError, "'y'"),
    "unknown loss": (lambda e: generate(str(e[0] / "model.onnx"), e[0] / "o", loss="HingeLoss"), ArgumentError, "HingeLoss"),
    "unknown optimizer": (lambda e: generate(str(e[0] / "model.onnx"), e[0] / "o", loss=CE, optimizer="Lion"), ArgumentError, "Lion"),
    "ort format": (lambda e: generate(str(e[0] / "model.onnx"), e[0] / "o", ort_format=True), ArgumentError, "ort_format"),
    "ancient opset": (lambda e: generate(model_with([helper.make_node("MatMul", ["x", "w"], ["y"])], opset=7), e[0] / "o"), ModelError, "opset 7"),
    "integer trainable": (lambda e: generate(model_with([helper.make_node("Add", ["x", "w"], ["y"])], {"w": np.ones(4, np.int64)},
                                                        inputs=(("x", np.int64, ["batch", 4]),)), e[0] / "o", requires_grad=["w"]),
                          ArgumentError, "'w'"),
    "missing training model": (lambda e: Module(e[0] / "nope.onnx", session(e)[0]), ArtifactNotFoundError, "nope.onnx"),
    "eval model as training model": (lambda e: Module(e[0] / "art" / "eval_model.onnx", session(e)[0]), ModelError, "eval_model.onnx"),
    "training model as optimizer": (lambda e: Optimizer(e[0] / "art" / "training_model.onnx", session(e)[1]), ModelError, "not an odtrain optimizer model"),
    "optimizer of other artifacts": (mismatched_optimizer, ParameterError, "fc2.weight"),
    "memory bomb": (memory_bomb_training_step, MemoryBudgetError,
                    "more than this machine's memory (64.00 GiB); its largest values: 'b' float32[100000x100000x4] "
                    "(149.01 GiB, written by Expand node 'bomb')"),
    "memory bomb at inference": (lambda e: InferenceSession(expanded(10**7)).run(None, {"x": np.ones((1, 1, 4), np.float32)}),
                                 MemoryBudgetError, "'b' float32[10000000x10000000x4] (1.42 PiB"),
    "constant too large to fold": (lambda e: InferenceSession(expanded(10**7, constant=True)).run(None, {"x": np.ones((1, 1, 4), np.float32)}),
                                   MemoryBudgetError, "Expand node 'bomb': its output, computed once as a constant"),
    # checkpoints
    "truncated checkpoint": (lambda e: CheckpointState.load_checkpoint(damaged_checkpoint(e[0], "truncated")), CheckpointError, "ckpt_truncated"),
    "flipped checkpoint byte": (lambda e: CheckpointState.load_checkpoint(damaged_checkpoint(e[0], "flipped")), CheckpointError,
                                "ckpt_flipped' is damaged: its tensors or metadata do not match the checksum"),
    "newer checkpoint version": (lambda e: CheckpointState.load_checkpoint(damaged_checkpoint(e[0], "version")), CheckpointError,
                                 "ckpt_version' is of format version '7', newer than this odtrain reads"),
    "ONNX file as checkpoint": (lambda e: CheckpointState.load_checkpoint(damaged_checkpoint(e[0], "foreign")), CheckpointError,
                                "ckpt_foreign' is truncated (its header runs past the end of the file)"),
    "checkpoint of another tool": (lambda e: CheckpointState.load_checkpoint(damaged_checkpoint(e[0], "other tool")), CheckpointError,
                                   "ckpt_other tool' is not an odtrain checkpoint (no odtrain format tag"),
    "missing checkpoint": (lambda e: CheckpointState.load_checkpoint(e[0] / "none"), ArtifactNotFoundError, "none"),
    "list property": (lambda e: session(e)[0].properties.__setitem__("classes", [1, 2]), ArgumentError, "'classes'"),
    "non-string property name": (lambda e: session(e)[0].properties.__setitem__(3, 1), ArgumentError, "3"),
    "missing property": (lambda e: session(e)[0].properties["epoch"], ParameterError, "'epoch'"),
    "optimizer state before any optimizer": (lambda e: CheckpointState.save_checkpoint(session(e)[0], e[0] / "c", include_optimizer_state=True),
                                             StateError, "Optimizer"),
    "unknown parameter": (lambda e: session(e)[0].parameters["fc3.weight"], ParameterError, "fc3.weight"),
    "parameter of the wrong shape": (lambda e: setattr(session(e)[0].parameters["fc1.bias"], "data", np.zeros(5, np.float32)), ArgumentError, "'fc1.bias'"),
    # feeds
    "too few inputs": (lambda e: session(e)[1](feeds(e)[0]), InputError, "['input', 'labels']"),
    "wrong dtype": (lambda e: session(e)[1](feeds(e)[0].astype(np.float16), feeds(e)[1]), InputError, "'input' must be float32"),
    "wrong rank": (lambda e: session(e)[1](feeds(e)[0].reshape(64, 28, 28), feeds(e)[1]), InputError, "'input'"),
    "wrong width": (lambda e: session(e)[1](feeds(e)[0][:, :700], feeds(e)[1]), InputError, "784"),
    "inconsistent batch": (lambda e: session(e)[1](feeds(e)[0], feeds(e)[1][:32]), InputError, "'batch'"),
    "label out of range": (lambda e: session(e)[1](*feeds(e, y=np.full(64, 10, np.int64))), InputError, "label"),
    "negative label": (lambda e: session(e)[1](*feeds(e, y=np.full(64, -3, np.int64))), InputError, "label"),
    "NaN input, checked": (nan_input, NonFiniteError, "'input'"),
    # API misuse
    "GPU device": (lambda e: Module(e[0] / "art" / "training_model.onnx", session(e)[0], device="cuda:0"), ArgumentError, "cuda:0"),
    "state of the wrong type": (lambda e: Module(e[0] / "art" / "training_model.onnx", {"fc1.weight": 1}), ArgumentError, "CheckpointState"),
    "buffer of the wrong size": (lambda e: session(e)[1].copy_buffer_to_parameters(np.zeros(10, np.float32)), ArgumentError, "10 elements"),
    "buffer of the wrong dtype": (lambda e: session(e)[1].copy_buffer_to_parameters(np.zeros(397510, np.float64)), ArgumentError, "float64"),
    "negative learning rate": (lambda e: Optimizer(e[0] / "art" / "optimizer_model.onnx", session(e)[1]).set_learning_rate(-0.1), ArgumentError, "-0.1"),
    "schedule shorter than warm-up": (lambda e: LinearLRScheduler(Optimizer(e[0] / "art" / "optimizer_model.onnx", session(e)[1]), 10, 5, 0.1),
                                      ArgumentError, "warmup_step_count"),
    "export of an unknown output": (lambda e: session(e)[1].export_model_for_inferencing(e[0] / "i.onnx", ["probabilities"]), ArgumentError, "probabilities"),
    "eval without an eval model": (lambda e: Module(e[0] / "art" / "training_model.onnx", session(e)[0]).eval()(*feeds(e)), StateError, "eval_model_uri"),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_bad_input_is_named(row, env):
    call, kind, culprit = ROWS[row]
    with pytest.raises(kind) as info:
        call(env)
    assert isinstance(info.value, OdtrainError)
    assert culprit in str(info.value), str(info.value)


def test_the_table_is_long_enough():
    assert len(ROWS) >= 30


def test_a_failed_call_changes_nothing(env):
    state, module = session(env)
    optimizer = Optimizer(env[0] / "art" / "optimizer_model.onnx", module)
    x, y = feeds(env)
    module(x, y)
    optimizer.step()
    module(x, y)  # gradients now hold a step's values, not yet applied
    before = (module.get_contiguous_parameters(), state._store.grad_flat.copy(), state._optimizer.step,
              {k: v.copy() for k, v in state._optimizer.moments.items()})
    bad = y.copy()
    bad[0] = 99
    for call in (lambda: module(x, bad), lambda: module(x[:, :5], y), lambda: module(x.astype(np.float64), y)):
        module.lazy_reset_grad()
        with pytest.raises(InputError):
            call()
    np.testing.assert_array_equal(module.get_contiguous_parameters(), before[0])
    np.testing.assert_array_equal(state._store.grad_flat, before[1])
    assert state._optimizer.step == before[2]
    for key, moment in before[3].items():
        np.testing.assert_array_equal(state._optimizer.moments[key], moment)


def test_non_finite_loss_stops_before_backward_and_the_optimizer_refuses(env):
    state, module = session(env, check_finite=True)
    optimizer = Optimizer(env[0] / "art" / "optimizer_model.onnx", module)
    x, y = feeds(env)
    module(x, y)
    grads = state._store.grad_flat.copy()
    state.parameters["fc2.bias"].data = np.full(10, np.inf, np.float32)
    module.lazy_reset_grad()
    with pytest.raises(NonFiniteError, match="step 2"):
        module(x, y)
    np.testing.assert_array_equal(state._store.grad_flat, grads)  # backward never ran
    state._store.grad_flat[5] = np.nan
    params = module.get_contiguous_parameters()
    with pytest.raises(NonFiniteError, match="fc1.weight"):
        optimizer.step()
    np.testing.assert_array_equal(module.get_contiguous_parameters(), params)


def test_a_checkpoint_that_does_not_train_the_models_parameters_is_refused(env):
    """The full model's artifacts with the head-only checkpoint: fc1 is frozen there, trained here."""
    root, _ = env
    state = CheckpointState.load_checkpoint(root / "head" / "checkpoint")
    with pytest.raises(ParameterError, match="'fc1.weight'"):
        Module(root / "art" / "training_model.onnx", state)
