"""Checkpoints survive SIGKILL mid-save; loaders survive hostile files; long runs do not leak."""
import os
import random
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odtrain import CheckpointError, ModelError, OdtrainError
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.graph.onnx_io import load_graph

SAVER = textwrap.dedent("""
    import sys
    import numpy as np
    from odtrain.api import CheckpointState
    state = CheckpointState.load_checkpoint(sys.argv[1])
    target = sys.argv[2]
    print("ready", flush=True)
    counter = int(sys.argv[3])
    while True:
        counter += 1
        state.parameters["fc2.bias"].data = np.full(10, counter, dtype=np.float32)
        state.properties["counter"] = counter
        CheckpointState.save_checkpoint(state, target)
""")


def test_a_save_reaches_the_disk_before_it_replaces_the_checkpoint(mlp_artifacts, tmp_path, monkeypatch):
    """A power cut keeps the old checkpoint or the new one only if the new file's bytes are on the disk
    (flushed, then fsynced) before the rename, and the folder's new entry is fsynced after it."""
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    target = tmp_path / "checkpoint"
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        info = os.fstat(fd)
        events.append(("fsync", info.st_ino, stat.S_ISDIR(info.st_mode), info.st_size))
        real_fsync(fd)

    def replace(source, destination, *args, **kwargs):
        events.append(("replace", os.stat(source).st_ino, os.fspath(destination)))
        real_replace(source, destination, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    CheckpointState.save_checkpoint(state, target)
    renames = [k for k, e in enumerate(events) if e[0] == "replace" and e[2] == str(target)]
    assert len(renames) == 1, events
    renamed, written = renames[0], events[renames[0]][1]
    assert any(e[:3] == ("fsync", written, False) and e[3] == target.stat().st_size for e in events[:renamed]), \
        f"the temporary file is not flushed and fsynced before the rename: {events}"
    assert ("fsync", tmp_path.stat().st_ino, True) in [e[:3] for e in events[renamed + 1:]], \
        f"the folder is not fsynced after the rename: {events}"
    assert CheckpointState.load_checkpoint(target).parameters.keys() == state.parameters.keys()


def test_sigkill_during_saves_never_corrupts_the_checkpoint(mlp_artifacts, tmp_path):
    target = tmp_path / "checkpoint"
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    state.properties["counter"] = 0
    state.parameters["fc2.bias"].data = np.zeros(10, dtype=np.float32)
    CheckpointState.save_checkpoint(state, target)
    rng = random.Random(1234)
    last = 0
    for kill in range(20):
        child = subprocess.Popen([sys.executable, "-c", SAVER, str(mlp_artifacts / "checkpoint"), str(target), str(last * 1000)],
                                 stdout=subprocess.PIPE, cwd=tmp_path)
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.0, 0.25))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        loaded = CheckpointState.load_checkpoint(target)  # never damaged
        counter = loaded.properties["counter"]
        np.testing.assert_array_equal(loaded.parameters["fc2.bias"].data, np.full(10, counter, np.float32))
        np.testing.assert_array_equal(loaded.parameters["fc1.weight"].data, state.parameters["fc1.weight"].data)
        if (tmp_path / "checkpoint.previous").exists():  # the save before, kept whole as well
            kept = CheckpointState.load_checkpoint(tmp_path / "checkpoint.previous")
            assert kept.properties["counter"] <= counter
        last = kill + 1
        leftovers = [p.name for p in tmp_path.iterdir() if p.name not in ("checkpoint", "checkpoint.previous")]
        # A killed save may leave its temporary file (and the link that was to become checkpoint.previous); the
        # next save removes them, so they never pile up.
        assert all(name.startswith(".checkpoint.") and name.endswith(".tmp") for name in leftovers), leftovers
        assert len(leftovers) <= 2, leftovers
    CheckpointState.save_checkpoint(CheckpointState.load_checkpoint(target), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint.previous"]


def test_a_save_after_one_killed_between_keeping_and_renaming_leaves_no_link_behind(mlp_artifacts, tmp_path):
    """Killed after the checkpoint became checkpoint.previous and before the new file took its name, a save leaves
    both names on one file; the next save must not leave its link to that file behind (renaming one link of a file
    over another does nothing)."""
    target = tmp_path / "checkpoint"
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    CheckpointState.save_checkpoint(state, target)
    os.link(target, tmp_path / "checkpoint.previous")  # where the killed save stopped
    CheckpointState.save_checkpoint(state, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint.previous"]
    assert not os.path.samefile(target, tmp_path / "checkpoint.previous")
    CheckpointState.load_checkpoint(tmp_path / "checkpoint.previous")  # the save before, whole


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _mutate(blob: bytes, data, within: int | None = None) -> bytes:
    """`blob` after 1 to 8 random flips, cuts, insertions and overwrites (in its first `within` bytes)."""
    blob = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 8))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert", "overwrite"]))
        at = data.draw(st.integers(0, max(min(len(blob), within or len(blob)) - 1, 0)))
        if kind == "flip" and blob:
            blob[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "cut":
            del blob[at:at + data.draw(st.integers(1, 64))]
        elif kind == "insert":
            blob[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        elif blob:
            blob[at:at + 8] = data.draw(st.binary(min_size=8, max_size=8))
    return bytes(blob)


# Every refusal names the file and its reason; a checkpoint's checksum covers all it holds, so any change
# to its bytes is refused, while an ONNX file has none: a changed one may load, but then as ONNX reads it.
CHECKPOINT_REFUSAL = re.compile(r" is (truncated|damaged|not an odtrain checkpoint|of format version '\d+', newer)")


@FUZZ
@given(data=st.data())
def test_a_damaged_checkpoint_is_refused_with_its_reason(mlp_artifacts, tmp_path, data):
    good = (mlp_artifacts / "checkpoint").read_bytes()
    header = 8 + int.from_bytes(good[:8], "little")  # the length, then the JSON of names, shapes and metadata
    blob = data.draw(st.one_of(st.binary(max_size=200), st.just(good[:4096]).map(lambda b: _mutate(b, data)),
                               st.builds(lambda: _mutate(good, data)), st.builds(lambda: _mutate(good, data, header))))
    path = tmp_path / "fuzzed"
    path.write_bytes(blob)
    if blob == good:  # the mutations undid each other
        CheckpointState.load_checkpoint(path)
        return
    with pytest.raises(CheckpointError) as refusal:
        CheckpointState.load_checkpoint(path)
    message = str(refusal.value)
    assert message.startswith(f"checkpoint '{path}'") and CHECKPOINT_REFUSAL.search(message), message


@FUZZ
@given(data=st.data())
def test_a_damaged_onnx_model_is_refused_or_read_as_onnx_reads_it(mlp_artifacts, tmp_path, data):
    good = (mlp_artifacts / "eval_model.onnx").read_bytes()
    blob = data.draw(st.one_of(st.binary(max_size=200), st.builds(lambda: _mutate(good, data))))
    path = tmp_path / "fuzzed.onnx"
    path.write_bytes(blob)
    try:
        parsed = onnx.load_from_string(blob)
    except Exception:  # protobuf's DecodeError and the like: not ONNX at all
        parsed = None
    try:
        graph = load_graph(path)
    except ModelError as error:
        assert str(path) in str(error), str(error)
        if parsed is None:
            assert f"'{path}' is not a readable ONNX model" in str(error), str(error)
        return
    assert parsed is not None, "odtrain read a file that onnx cannot parse"
    assert [(n.domain, n.op_type, list(n.input), list(n.output)) for n in parsed.graph.node] == \
        [(n.domain, n.op_type, n.inputs, n.outputs) for n in graph.nodes]
    assert list(graph.outputs) == [o.name for o in parsed.graph.output]
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    try:  # as the eval model of a session: bound to the training model's parameters, or refused
        Module(mlp_artifacts / "training_model.onnx", state, path)
    except OdtrainError as error:
        assert str(path) in str(error), str(error)


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


def test_long_run_keeps_memory_flat(mlp_artifacts, mlp_reference):
    """ODTRAIN_SOAK_STEPS=5000 for the full soak; CI runs a shorter one."""
    steps = int(os.environ.get("ODTRAIN_SOAK_STEPS", "1500"))
    golden = mlp_reference[2]
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", state, mlp_artifacts / "eval_model.onnx")
    optimizer = Optimizer(mlp_artifacts / "optimizer_model.onnx", module)
    samples = {}
    for step in range(1, steps + 1):
        i = step % 10
        module(golden["x"][i], golden["y"][i])
        optimizer.step()
        module.lazy_reset_grad()
        if step in (500, steps):
            samples[step] = _rss_kib()
    assert abs(samples[steps] - samples[500]) < 1024, samples


def test_an_attribute_field_onnx_would_parse_as_a_tensor_is_read_as_one(mlp_artifacts, tmp_path):
    """A flipped bit turns a Gemm attribute's name (field 1) into its tensor field (5): onnx parses that field as a
    TensorProto and refuses the file; so does odtrain, although the attribute is a float and its tensor unused."""
    good = (mlp_artifacts / "eval_model.onnx").read_bytes()
    assert b"\n\x04beta" in good
    path = tmp_path / "flipped.onnx"
    path.write_bytes(good.replace(b"\n\x04beta", b"*\x04beta", 1))
    with pytest.raises(Exception):
        onnx.load(path)
    with pytest.raises(ModelError, match="is not a readable ONNX model"):
        load_graph(path)
