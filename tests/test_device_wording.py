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
from odtrain.demo import build_classifier
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
    heading = next(line for line in result.stdout.splitlines() if line.startswith("profile of"))
    assert re.search(r"\d+ threads? of the kernel library", heading) and "Numba" not in heading, heading


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


DEVICE_DEMO = """
import sys


class NoNumba:  # a device: Numba is not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("numba", "llvmlite"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoNumba())
from odtrain import demo
from odtrain.api import Optimizer

steps = []
original = Optimizer.step
Optimizer.step = lambda self: steps.append(1) or original(self)
demo.LIBRARY = sys.argv[1]  # the package holds no library: ODTRAIN_KERNEL_LIBRARY gives one
try:
    demo.run(sys.argv[2], epochs=2)
except Exception as error:
    print(type(error).__name__, len(steps), error)
"""


def test_without_numba_a_library_lacking_a_demo_kernel_stops_before_the_first_epoch(with_library, tmp_path):
    """A library built for the MLP's artifacts holds their training and eval steps, not the exported model's
    inference: without Numba the demo finds that before its first optimizer step, and the fix is the desktop
    command that builds the demo's library, not a command on this device's artifact folder."""
    named = with_library / kernel_library.FOLDER
    result = run("-c", DEVICE_DEMO, tmp_path / "none", tmp_path / "demo", env={kernel_library.LIBRARY_ENV: str(named)})
    assert result.stdout, result.stderr
    last = result.stdout.splitlines()[-1]
    assert last.startswith("KernelsUnavailableError 0 inference"), result.stdout + result.stderr
    assert f"is not in the kernel library {named}" in last and "checks its kernels before training" in last
    assert "`odtrain compile -o DIR --target" in last and f"{kernel_library.LIBRARY_ENV}=DIR odtrain demo" in last
    assert f"odtrain compile {tmp_path / 'demo'}" not in last
    assert "held-out accuracy" not in result.stdout
    assert f"kernels: the library {kernel_library.LIBRARY_ENV} names ({named})" in result.stdout  # not "holds no"
