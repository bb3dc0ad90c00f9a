"""What the demo, `memory` and `profile` say on a device: the kernel library that runs, not Numba.

A library built for the digits MLP's artifacts (odtrain compile, ~20 s) runs their steps: `memory` names the
library's runtime floor, `profile` the library's threads. The demo's kernels line names the library that
ODTRAIN_KERNEL_LIBRARY gives, and without Numba a library lacking a kernel of the demo stops it before its first
epoch, with the desktop command that builds the demo's library.
"""
import os
import re
import subprocess
import sys

import onnx
import pytest

from odtrain import cli, demo, kernel_library
from odtrain.api import Optimizer
from odtrain.demo import build_classifier
from odtrain.graph.errors import KernelsUnavailableError
from odtrain.library_build import compile_artifacts

SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(demo.__file__)))


def run(*argv, env=None) -> subprocess.CompletedProcess:
    """A fresh process (a library is looked for once per process and folder, and this one saw the folder before
    its library was built)."""
    environment = dict(os.environ, PYTHONPATH=SOURCE_ROOT, **(env or {}))
    return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, timeout=600,
                          env=environment)


@pytest.fixture(scope="module")
def with_library(tmp_path_factory):
    folder = tmp_path_factory.mktemp("device")
    onnx.save(build_classifier()[0], str(folder / "mlp.onnx"))
    assert cli.main(["prepare", str(folder / "mlp.onnx"), "-o", str(folder / "art")]) == 0
    compile_artifacts(str(folder / "art"), thread_counts=(1, 2), out=lambda line: None)
    return folder / "art"


def test_memory_with_a_library_names_its_floor_not_numbas(with_library):
    result = run("-m", "odtrain", "memory", with_library, "--batch-size", "32")
    assert result.returncode == 0, result.stderr
    floor = result.stdout.splitlines()[-1]
    assert "kernel library" in floor and "Numba" not in floor, floor
    result = run("-m", "odtrain", "memory", with_library, "--batch-size", "32",
                 env={kernel_library.LIBRARY_ENV: "off"})  # the same artifacts on Numba's kernels
    assert "Numba runtime floor" in result.stdout.splitlines()[-1]


def test_profile_with_a_library_names_its_threads_not_numbas(with_library):
    result = run("-m", "odtrain", "profile", with_library, "--batch-size", "32", "--steps", "2", "--threads", "2")
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert re.search(r"\d+ threads? of the kernel library", first) and "Numba" not in first, first


PLACE = """
import sys
from odtrain import demo
demo.LIBRARY = sys.argv[1]  # the package holds no library
print(demo.place_library(sys.argv[2]))
"""


def test_the_demo_names_the_library_odtrain_kernel_library_gives(with_library, tmp_path):
    named = with_library / kernel_library.FOLDER
    line = run("-c", PLACE, tmp_path / "none", tmp_path / "demo", env={kernel_library.LIBRARY_ENV: str(named)}).stdout
    assert f"the library {kernel_library.LIBRARY_ENV} names ({named})" in line, line
    assert "holds no library" not in line and "compile through Numba" not in line
    line = run("-c", PLACE, tmp_path / "none", tmp_path / "demo",
               env={kernel_library.LIBRARY_ENV: str(tmp_path / "empty")}).stdout
    assert "gives no usable library" in line, line


def test_without_numba_a_library_lacking_a_demo_kernel_stops_before_the_first_epoch(tmp_path, monkeypatch):
    """The inference model's kernels are checked before training: no optimizer step runs, and the fix is the
    desktop command that builds the demo's library, not a command on this device's artifact folder."""
    from odtrain import inference

    monkeypatch.setattr(kernel_library, "compiler_installed", lambda: False)  # what the demo asks: a device
    lacking = ("inference model: Gemm node 'fc1': kernel odtrain.kernels.linalg._gemm(...) is not in the kernel "
               f"library L, and Numba is not installed to compile it: rebuild the library with "
               f"`odtrain compile {tmp_path / 'demo'} --target x86_64` (on a machine with odtrain's dependencies)")

    def missing(self, *args, **kwargs):
        raise KernelsUnavailableError(lacking)

    steps = []
    original_step = Optimizer.step
    monkeypatch.setattr(inference.InferenceSession, "run", missing)
    monkeypatch.setattr(Optimizer, "step", lambda self: steps.append(1) or original_step(self))
    with pytest.raises(KernelsUnavailableError) as raised:
        demo.run(str(tmp_path / "demo"), epochs=1, out=lambda line: None)
    message = str(raised.value)
    assert not steps
    assert "is not in the kernel library L" in message and "checked before training" in message
    assert "odtrain compile -o DIR" in message and f"{kernel_library.LIBRARY_ENV}=DIR odtrain demo" in message
    assert f"odtrain compile {tmp_path / 'demo'}" not in message
