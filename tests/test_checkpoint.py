"""Checkpoints: bit-exact round trips, refusal of damaged files, atomic replacement."""
import os

import numpy as np
import pytest

from odtrain import ArtifactNotFoundError, CheckpointError
from odtrain.api import CheckpointState, Module, Optimizer


def trained_state(mlp_artifacts, mlp_reference, steps=3):
    _, _, golden = mlp_reference
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", state, mlp_artifacts / "eval_model.onnx")
    optimizer = Optimizer(mlp_artifacts / "optimizer_model.onnx", module)
    for step in range(steps):
        module(golden["x"][step], golden["y"][step])
        optimizer.step()
        module.lazy_reset_grad()
    return state, module, optimizer


def test_round_trip_is_bit_exact_with_optimizer_state_and_properties(mlp_artifacts, mlp_reference, tmp_path):
    state, _, optimizer = trained_state(mlp_artifacts, mlp_reference)
    optimizer.set_learning_rate(0.0123)
    state.properties["epoch"] = 7
    state.properties["best_accuracy"] = 0.1 + 0.2  # not exactly representable in decimal
    state.properties["note"] = "personalised on device ✓"
    path = tmp_path / "ckpt"
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    loaded = CheckpointState.load_checkpoint(path)
    assert list(loaded.parameters) == list(state.parameters)
    for name in state.parameters:
        np.testing.assert_array_equal(loaded.parameters[name].data, state.parameters[name].data)
        assert loaded.parameters[name].requires_grad == state.parameters[name].requires_grad
    assert dict(loaded.properties.items()) == {"epoch": 7, "best_accuracy": 0.1 + 0.2, "note": "personalised on device ✓"}
    assert type(loaded.properties["epoch"]) is int
    assert loaded._optimizer.step == 3 and loaded._optimizer.learning_rate == 0.0123
    for key, moment in state._optimizer.moments.items():
        np.testing.assert_array_equal(loaded._optimizer.moments[key], moment)


def test_resumed_training_continues_identically(mlp_artifacts, mlp_reference, tmp_path):
    _, _, golden = mlp_reference
    state, module, optimizer = trained_state(mlp_artifacts, mlp_reference, steps=2)
    CheckpointState.save_checkpoint(state, tmp_path / "ckpt", include_optimizer_state=True)
    resumed = CheckpointState.load_checkpoint(tmp_path / "ckpt")
    module2 = Module(mlp_artifacts / "training_model.onnx", resumed)
    optimizer2 = Optimizer(mlp_artifacts / "optimizer_model.onnx", module2)
    for step in range(2, 5):
        loss_a, logits_a = module(golden["x"][step], golden["y"][step])
        loss_b, logits_b = module2(golden["x"][step], golden["y"][step])
        assert loss_a == loss_b
        np.testing.assert_array_equal(logits_a, logits_b)
        for opt, mod in ((optimizer, module), (optimizer2, module2)):
            opt.step()
            mod.lazy_reset_grad()
    np.testing.assert_array_equal(module.get_contiguous_parameters(), module2.get_contiguous_parameters())


def test_without_optimizer_state_resets_it(mlp_artifacts, mlp_reference, tmp_path):
    state, _, _ = trained_state(mlp_artifacts, mlp_reference, steps=1)
    CheckpointState.save_checkpoint(state, tmp_path / "ckpt")
    assert CheckpointState.load_checkpoint(tmp_path / "ckpt")._optimizer is None


def _saved(mlp_artifacts, tmp_path):
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    path = tmp_path / "ckpt"
    CheckpointState.save_checkpoint(state, path)
    return path, path.read_bytes()


@pytest.mark.parametrize("cut", [0, 5, 100, -1000, -1])
def test_truncated_checkpoint_is_refused(mlp_artifacts, tmp_path, cut):
    path, blob = _saved(mlp_artifacts, tmp_path)
    path.write_bytes(blob[:cut])
    with pytest.raises(CheckpointError, match="truncated|damaged") as info:
        CheckpointState.load_checkpoint(path)
    assert str(path) in str(info.value)


def test_flipped_byte_in_data_is_refused(mlp_artifacts, tmp_path):
    path, blob = _saved(mlp_artifacts, tmp_path)
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 0x40
    path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="checksum"):
        CheckpointState.load_checkpoint(path)


def test_damaged_header_is_refused(mlp_artifacts, tmp_path):
    path, blob = _saved(mlp_artifacts, tmp_path)
    damaged = bytearray(blob)
    damaged[12] = ord("}")
    path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="damaged"):
        CheckpointState.load_checkpoint(path)


def test_foreign_file_is_refused(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\x08\x07\x12\x07pytorch" * 10)
    with pytest.raises(CheckpointError, match="not an odtrain checkpoint|truncated"):
        CheckpointState.load_checkpoint(path)


def test_newer_format_version_is_refused(mlp_artifacts, tmp_path):
    path, blob = _saved(mlp_artifacts, tmp_path)
    path.write_bytes(blob.replace(b'"format_version":"1"', b'"format_version":"9"'))
    with pytest.raises(CheckpointError, match="version"):
        CheckpointState.load_checkpoint(path)


def test_missing_checkpoint_names_the_file(tmp_path):
    with pytest.raises(ArtifactNotFoundError, match="nowhere"):
        CheckpointState.load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError):
        CheckpointState.load_checkpoint(tmp_path / "nowhere")


def test_failed_save_leaves_the_old_checkpoint_whole(mlp_artifacts, tmp_path, monkeypatch):
    path, blob = _saved(mlp_artifacts, tmp_path)
    state = CheckpointState.load_checkpoint(path)
    state.parameters["fc2.bias"].data = np.full(10, 3.0, dtype=np.float32)

    def crash(*args):
        raise OSError("disk pulled out")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        CheckpointState.save_checkpoint(state, path)
    assert path.read_bytes() == blob
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the temporary file is gone


def test_no_pickle_anywhere():
    import pathlib

    import odtrain

    root = pathlib.Path(odtrain.__file__).parent.parent
    for folder in ("odtrain", "graph", "kernels"):
        for source in (root / folder).rglob("*.py"):
            text = source.read_text()
            assert "import pickle" not in text and "allow_pickle=True" not in text, source
