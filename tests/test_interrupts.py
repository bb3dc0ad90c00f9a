"""Ctrl-C where a user presses it: during `odtrain compile`, and during a first step that compiles its kernels.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group; the tests do the same (`os.killpg` on a
command started in a session of its own) and check what the user sees: one line, exit code 130, nothing half
made left behind, and no process left running.
"""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import reference_artifacts

SOURCE_ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")])))


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes whose parent is `pid` (Linux's /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append((int(entry), command))
    return found


def _wait_for(condition, process, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if process.poll() is not None:
            pytest.fail(f"the command ended before {what}: {process.communicate()}")
        time.sleep(0.05)
    process.kill()
    pytest.fail(f"no {what} within {timeout} s")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the build process through Linux's /proc")
def test_ctrl_c_during_compile_says_one_line_and_leaves_no_kernels_folder(tmp_path):
    folder = reference_artifacts("mlp", tmp_path / "art")
    process = subprocess.Popen([sys.executable, "-m", "odtrain", "compile", str(folder)], env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    builders = _wait_for(lambda: [p for p, command in _children(process.pid) if "odtrain.library_build" in command],
                         process, "the build process started")
    time.sleep(0.5)  # inside the build: Numba imported, compiling
    os.killpg(process.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole foreground group
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, (out, err)
    assert err.strip() == "odtrain compile: interrupted", err  # one line, no build traceback
    assert not (folder / "kernels").exists(), sorted(os.listdir(folder / "kernels"))
    time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
                   != "Z" for pid in builders), "the build process is still running"


@pytest.fixture()
def digits_artifacts(tmp_path):
    """The demo classifier's artifacts and 64 digits in train.npz, in tmp_path."""
    import numpy as np
    import onnx

    from odtrain import cli
    from odtrain.datasets import load_digits
    from odtrain.demo import build_classifier

    images, labels = load_digits()
    np.savez(tmp_path / "train.npz", input=images[:64], labels=labels[:64])
    onnx.save(build_classifier()[0], str(tmp_path / "mlp.onnx"))
    assert cli.main(["prepare", str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "art")]) == 0
    return tmp_path


def test_ctrl_c_while_the_first_step_compiles_stops_at_once_and_saves_nothing(digits_artifacts, tmp_path):
    """With an empty kernel cache the first step compiles its kernels (minutes on a small device). A Ctrl-C then
    stops at once: nothing has changed that a save would keep, so the checkpoint stays as it was, rather than
    the stop waiting for every kernel, then the step, then a save."""
    checkpoint = digits_artifacts / "art" / "checkpoint"
    before = checkpoint.read_bytes()
    env = dict(_env(), ODTRAIN_CACHE_DIR=str(tmp_path / "empty-cache"))
    env.pop("NUMBA_CACHE_DIR", None)
    process = subprocess.Popen([sys.executable, "-m", "odtrain", "train", "art", "--data", "train.npz"],
                               cwd=digits_artifacts, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, "")), daemon=True)
    reader.start()
    _wait_for(lambda: any("compiling" in line for line in lines), process, "the first step compiled")
    os.killpg(process.pid, signal.SIGINT)
    out = process.stdout.read()  # to its end: the process closed it
    process.wait(timeout=600)
    reader.join(timeout=60)
    err = "".join(lines)
    assert process.returncode == 130, (out, err)
    assert err.strip().splitlines()[-1] == "odtrain train: interrupted", err
    assert "epoch 1/1" not in out and "stopped by SIGINT" not in err
    assert checkpoint.read_bytes() == before

