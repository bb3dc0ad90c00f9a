"""Checkpoints: bit-exact round trips, refusal of damaged files, atomic replacement."""
import hashlib
import os

import numpy as np
import pytest
import safetensors.numpy

from odtrain import ArtifactNotFoundError, CheckpointError
from odtrain import checkpoint as checkpoint_file
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
    stored = safetensors.numpy.load_file(str(path))  # written tensor by tensor, still a safetensors file
    for name in state.parameters:
        np.testing.assert_array_equal(stored[checkpoint_file.PARAM_PREFIX + name], state.parameters[name].data)


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
    # no earlier save is kept beside it: the message must not promise one, and must say what to do
    assert "previous save" not in str(info.value) and "still whole" not in str(info.value)
    assert "copy it again" in str(info.value) and "odtrain prepare" in str(info.value)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_a_saved_checkpoint_gets_the_mode_of_a_new_file(mlp_artifacts, tmp_path, umask):
    """0666 less the umask, as the ONNX files beside it (not the temporary file's 0600)."""
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    previous = os.umask(umask)
    try:
        CheckpointState.save_checkpoint(state, tmp_path / "ckpt")
        (tmp_path / "model.onnx").write_bytes(b"")
    finally:
        os.umask(previous)
    mode = (tmp_path / "ckpt").stat().st_mode & 0o777
    assert mode == 0o666 & ~umask == (tmp_path / "model.onnx").stat().st_mode & 0o777, oct(mode)
    assert os.umask(previous) == previous  # the save set the umask back


def test_flipped_byte_in_data_is_refused(mlp_artifacts, tmp_path):
    path, blob = _saved(mlp_artifacts, tmp_path)
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 0x40
    path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="is damaged: its tensors or metadata do not match the checksum"):
        CheckpointState.load_checkpoint(path)


def test_edited_metadata_fails_the_checksum(mlp_artifacts, tmp_path):
    """The checksum covers the metadata: a changed property (or parameter list) is damage, not a new value."""
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    state.properties["epoch"] = 3
    path = tmp_path / "ckpt"
    CheckpointState.save_checkpoint(state, path)
    blob = path.read_bytes()
    stored = b'[\\"int\\", 3]'
    assert blob.count(stored) == 1
    path.write_bytes(blob.replace(stored, b'[\\"int\\", 4]'))
    with pytest.raises(CheckpointError, match="is damaged: its tensors or metadata do not match the checksum"):
        CheckpointState.load_checkpoint(path)


def test_damaged_header_is_refused(mlp_artifacts, tmp_path):
    path, blob = _saved(mlp_artifacts, tmp_path)
    damaged = bytearray(blob)
    assert damaged[8] == ord("{")  # the header's opening brace (the keys after it come in any order)
    damaged[8] = ord("}")
    path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match=r"is damaged \(its header is not valid JSON\)"):
        CheckpointState.load_checkpoint(path)


def _onnx_bytes(path):
    path.write_bytes(b"\x08\x07\x12\x07pytorch" * 10)


def _other_tool_safetensors(path):
    """A well-formed safetensors file as PyTorch and Hugging Face write them (format tag "pt")."""
    path.write_bytes(safetensors.numpy.save({"weight": np.ones((2, 3), np.float32)}, metadata={"format": "pt"}))


def _untagged_safetensors(path):
    path.write_bytes(safetensors.numpy.save({"weight": np.ones((2, 3), np.float32)}))


@pytest.mark.parametrize("write, reason", [
    (_onnx_bytes, "is truncated (its header runs past the end of the file)"),
    (_other_tool_safetensors, "is not an odtrain checkpoint (no odtrain format tag"),
    (_untagged_safetensors, "is not an odtrain checkpoint (no odtrain format tag"),
], ids=["onnx bytes", "safetensors of another tool", "safetensors without metadata"])
def test_foreign_file_is_refused_with_its_reason(tmp_path, write, reason):
    path = tmp_path / "foreign"
    write(path)
    with pytest.raises(CheckpointError) as info:
        CheckpointState.load_checkpoint(path)
    assert f"'{path}' {reason}" in str(info.value)


def _with_version(blob: bytes, version: str) -> bytes:
    tag = f'"format_version":"{checkpoint_file.FORMAT_VERSION}"'.encode()
    assert blob.count(tag) == 1
    return blob.replace(tag, f'"format_version":"{version}"'.encode())


def test_newer_format_version_is_refused(mlp_artifacts, tmp_path):
    path, blob = _saved(mlp_artifacts, tmp_path)
    path.write_bytes(_with_version(blob, "9"))
    with pytest.raises(CheckpointError, match=rf"of format version '9', newer than this odtrain reads "
                                              rf"\({checkpoint_file.FORMAT_VERSION}\); upgrade odtrain"):
        CheckpointState.load_checkpoint(path)


def test_format_version_odtrain_never_wrote_is_damage(mlp_artifacts, tmp_path):
    path, blob = _saved(mlp_artifacts, tmp_path)
    path.write_bytes(_with_version(blob, "0"))
    with pytest.raises(CheckpointError, match=r"is damaged \(its format version '0' is none that odtrain wrote\)"):
        CheckpointState.load_checkpoint(path)


def test_format_version_1_still_loads(tmp_path):
    """Version 1 files, whose sha256 covers each tensor's name, dtype, shape and bytes (in name order) and
    not the metadata, load; their tensors are still checked."""
    tensors = {"param/b": np.arange(3, dtype=np.float32), "param/w": np.ones((2, 3), np.float32)}
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(f"{name}|{tensors[name].dtype.str}|{tensors[name].shape}|".encode())
        digest.update(tensors[name].tobytes())
    metadata = {"format": "odtrain-checkpoint", "format_version": "1", "trainable": '["w"]', "frozen": '["b"]',
                "properties": '{"epoch": ["int", 2]}', "sha256": digest.hexdigest()}
    path = tmp_path / "v1"
    path.write_bytes(safetensors.numpy.save(tensors, metadata=metadata))
    loaded = CheckpointState.load_checkpoint(path)
    assert loaded.properties["epoch"] == 2 and loaded.parameters["w"].requires_grad
    np.testing.assert_array_equal(loaded.parameters["b"].data, tensors["param/b"])
    path.write_bytes(safetensors.numpy.save({**tensors, "param/b": tensors["param/b"] + 1}, metadata=metadata))
    with pytest.raises(CheckpointError, match="do not match the checksum"):
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


def test_a_save_removes_the_stale_temporaries_of_that_checkpoint_only(mlp_artifacts, tmp_path):
    """Killed saves leave `.<name>.<random>.tmp` files; the next save of the same checkpoint removes them,
    but not a temporary file that a running save still holds, nor other checkpoints' or other files."""
    import fcntl

    path, _ = _saved(mlp_artifacts, tmp_path)
    stale = [".ckpt.a1b2c3d4.tmp", ".ckpt.zz_99xyz.tmp"]
    kept = [".other.a1b2c3d4.tmp", ".ckpt.abc.tmp", ".ckpt.old.a1b2c3d4.tmp", "ckpt.a1b2c3d4.tmp", ".ckpt.a1b2c3d4.tmpx"]
    for name in stale + kept + [".ckpt.held0000.tmp"]:
        (tmp_path / name).write_bytes(b"x" * 100)
    with open(tmp_path / ".ckpt.held0000.tmp", "rb") as held:  # a save in progress elsewhere holds its lock
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        CheckpointState.save_checkpoint(CheckpointState.load_checkpoint(path), path)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + [".ckpt.held0000.tmp", "ckpt", "ckpt.previous"])
    CheckpointState.save_checkpoint(CheckpointState.load_checkpoint(path), path)  # its writer is gone now
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["ckpt", "ckpt.previous"])


def test_no_pickle_anywhere():
    import pathlib

    import odtrain

    root = pathlib.Path(odtrain.__file__).parent.parent
    for folder in ("odtrain", "graph", "kernels"):
        for source in (root / folder).rglob("*.py"):
            text = source.read_text()
            assert "import pickle" not in text and "allow_pickle=True" not in text, source


LOAD_PEAK = """
import sys
import numpy as np
from odtrain.api import CheckpointState

def status(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]) * 1024

with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # the high-water mark restarts from the current RSS
before = status('VmRSS:')
state = CheckpointState.load_checkpoint(sys.argv[1])
print(status('VmHWM:') - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures peak RSS through Linux's /proc")
def test_loading_costs_the_trainable_bytes_and_maps_the_frozen_ones(tmp_path):
    """160 MB of frozen and 16 MB of trainable float32: loading raises the peak RSS by about the trainable
    bytes (reading the whole file, as before, raised it by twice the file)."""
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    trainable = {f"adapter{i}": rng.standard_normal((1000, 1000), dtype=np.float32) for i in range(4)}
    frozen = {f"base{i}": np.full((5000, 1000), i, dtype=np.float32) for i in range(8)}
    path = tmp_path / "ckpt"
    checkpoint_file.save(path, checkpoint_file.CheckpointContents({**trainable, **frozen}, list(trainable)))
    del frozen
    run = subprocess.run([sys.executable, "-c", LOAD_PEAK, str(path)], capture_output=True, text=True, check=True)
    rise, trainable_bytes = int(run.stdout), sum(a.nbytes for a in trainable.values())
    assert rise < trainable_bytes + (12 << 20), (rise, trainable_bytes)
    state = CheckpointState.load_checkpoint(path)
    for name, array in trainable.items():
        np.testing.assert_array_equal(state.parameters[name].data, array)
    assert state._store.others["base7"].base is not None and (state.parameters["base7"].data == 7).all()


def test_saving_over_a_loaded_checkpoint_leaves_its_mapped_values_alone(tmp_path):
    """Frozen parameters are views of the file they came from: a save over it (a new file renamed into place)
    and a write to them change neither the other's values nor the file."""
    path = tmp_path / "ckpt"
    values = {"w": np.ones(3, np.float32), "frozen": np.arange(6, dtype=np.float32).reshape(2, 3)}
    checkpoint_file.save(path, checkpoint_file.CheckpointContents(values, ["w"]))
    first = CheckpointState.load_checkpoint(path)
    second = CheckpointState.load_checkpoint(path)
    second.parameters["frozen"] = np.full((2, 3), -1, np.float32)
    CheckpointState.save_checkpoint(second, path)
    np.testing.assert_array_equal(first.parameters["frozen"].data, values["frozen"])
    np.testing.assert_array_equal(CheckpointState.load_checkpoint(path).parameters["frozen"].data, -1)
    first.parameters["frozen"] = np.zeros((2, 3), np.float32)  # copy-on-write: the file keeps its bytes
    np.testing.assert_array_equal(CheckpointState.load_checkpoint(path).parameters["frozen"].data, -1)


@pytest.mark.parametrize("change, reason", [
    (lambda blob: blob + b"\0", "damaged \\(bytes follow its last tensor\\)"),
    (lambda blob: blob.replace(b'"data_offsets":[0,', b'"data_offsets":[4,', 1), "damaged|truncated"),
])
def test_tensors_that_do_not_tile_the_data_are_refused(mlp_artifacts, tmp_path, change, reason):
    path, blob = _saved(mlp_artifacts, tmp_path)
    changed = change(blob)
    assert changed != blob
    path.write_bytes(changed)
    with pytest.raises(CheckpointError, match=reason):
        CheckpointState.load_checkpoint(path)


def test_each_save_keeps_the_one_before_it_as_previous(mlp_artifacts, mlp_reference, tmp_path):
    """The file a save replaces becomes `<name>.previous` (a hard link to its bytes, replaced atomically)."""
    path, first = _saved(mlp_artifacts, tmp_path)
    assert not (tmp_path / "ckpt.previous").exists()  # nothing was replaced
    state, _, _ = trained_state(mlp_artifacts, mlp_reference, steps=1)
    CheckpointState.save_checkpoint(state, path)
    second = path.read_bytes()
    assert (tmp_path / "ckpt.previous").read_bytes() == first != second
    CheckpointState.save_checkpoint(state, path)
    assert (tmp_path / "ckpt.previous").read_bytes() == second
    assert os.stat(tmp_path / "ckpt.previous").st_mode == os.stat(path).st_mode


def test_a_damaged_checkpoint_names_the_kept_previous_one_and_training_resumes_from_it(mlp_artifacts, mlp_reference,
                                                                                       tmp_path):
    """A run saves every 2 steps and stops after 5; its checkpoint is then cut short (a copy to a card): the
    refusal names checkpoint.previous and how to resume from it; following it, the resumed run ends exactly
    where the uninterrupted run ends."""
    import shutil

    from odtrain.training import fit

    _, _, golden = mlp_reference
    np.savez(tmp_path / "train.npz", input=golden["x"][:2].reshape(-1, 784), labels=golden["y"][:2].reshape(-1))
    settings = dict(epochs=2, batch_size=16, seed=3, log=None, progress=False, handle_signals=False)
    whole, pieces = tmp_path / "whole", tmp_path / "pieces"
    for folder in (whole, pieces):
        shutil.copytree(mlp_artifacts, folder)
    fit(whole, tmp_path / "train.npz", **settings)
    stopped = fit(pieces, tmp_path / "train.npz", checkpoint_every=2, stop_after_steps=5, **settings)
    assert stopped.stopped_by and stopped.global_step == 5
    checkpoint, previous = pieces / "checkpoint", pieces / "checkpoint.previous"
    assert CheckpointState.load_checkpoint(previous).properties["global_step"] == 4
    checkpoint.write_bytes(checkpoint.read_bytes()[:-1000])
    with pytest.raises(CheckpointError) as refused:
        CheckpointState.load_checkpoint(checkpoint)
    message = str(refused.value)
    assert f"the save before it is kept as '{previous}': copy that over it (cp '{previous}' '{checkpoint}') and " \
           "train again with --resume" in message and "odtrain prepare writes it again" not in message, message
    shutil.copyfile(previous, checkpoint)
    resumed = fit(pieces, tmp_path / "train.npz", resume=True, **settings)
    assert resumed.finished and resumed.global_step == 16  # 2 epochs of 128 samples in batches of 16
    np.testing.assert_array_equal(CheckpointState.load_checkpoint(checkpoint).parameters["fc1.weight"].data,
                                  CheckpointState.load_checkpoint(whole / "checkpoint").parameters["fc1.weight"].data)


def test_new_artifacts_over_old_ones_keep_no_previous_checkpoint(mlp_reference, tmp_path):
    """generate_artifacts writes a first checkpoint: a checkpoint.previous of the artifacts it replaces would be
    another model's, so it is removed rather than offered for a resume."""
    from conftest import reference_artifacts

    folder = reference_artifacts("mlp", tmp_path / "art")
    CheckpointState.save_checkpoint(CheckpointState.load_checkpoint(folder / "checkpoint"), folder / "checkpoint")
    assert (folder / "checkpoint.previous").is_file()
    reference_artifacts("mlp", folder, optimizer="SGD")
    assert not (folder / "checkpoint.previous").exists()


def test_without_a_previous_save_the_refusal_says_how_to_start_again(mlp_artifacts, tmp_path):
    path, blob = _saved(mlp_artifacts, tmp_path)
    path.write_bytes(blob[:-1])
    with pytest.raises(CheckpointError, match="odtrain prepare writes it again, and every save after that keeps the "
                                              "one before it as 'ckpt.previous'"):
        CheckpointState.load_checkpoint(path)
