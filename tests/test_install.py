"""The install's build step (setup.py): a reused build/ never packs an earlier install's kernel library.

`pip install .` builds the demo's kernel library into build/lib/odtrain/data/kernels/; pip reuses build/ from an
earlier install. When this build fails (no C compiler) or is switched off, the package must hold no library
rather than the old one, which was built from other kernel sources. The step runs here with its compile
stubbed (a failing or succeeding subprocess), the way setuptools calls it, without pip or a compiler.
"""
import os
import runpy
import subprocess
from pathlib import Path

import pytest
import setuptools
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

SETUP = Path(__file__).resolve().parent.parent / "setup.py"


@pytest.fixture()
def build_step(monkeypatch, tmp_path):
    """(BuildWithLibrary command on build_lib = tmp_path/lib, holding a stale library, the stale library's folder,
    setup.py's namespace)."""
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)  # read setup.py's classes, set nothing up
    namespace = runpy.run_path(str(SETUP), run_name="odtrain_setup")
    monkeypatch.setattr(build_py, "run", lambda self: None)  # the sources' copy: not what is tested
    command = namespace["BuildWithLibrary"](Distribution())
    command.build_lib = str(tmp_path / "lib")
    stale = tmp_path / "lib" / "odtrain" / "data" / "kernels"
    stale.mkdir(parents=True)
    (stale / "manifest.json").write_text("{}")
    (stale / "libkernels.so").write_bytes(b"an earlier install's library")
    monkeypatch.delenv(namespace["BUILD_SWITCH"], raising=False)
    return command, stale, namespace


def _compile_that(namespace, monkeypatch, outcome):
    def run(argv, cwd, env, check):
        target = Path(argv[-1])
        if outcome == "fails":
            target.mkdir(parents=True, exist_ok=True)
            (target / "half-written.o").write_bytes(b"")
            raise subprocess.CalledProcessError(1, argv)
        target.mkdir(parents=True, exist_ok=True)
        (target / "libkernels.so").write_bytes(b"this install's library")

    monkeypatch.setattr(namespace["subprocess"], "run", run)


def test_a_failed_build_packs_no_library_not_the_stale_one(build_step, monkeypatch, capsys):
    command, stale, namespace = build_step
    _compile_that(namespace, monkeypatch, "fails")
    command.run()
    assert not stale.exists(), sorted(os.listdir(stale))
    assert "was not built" in capsys.readouterr().err


def test_a_build_switched_off_packs_no_library_not_the_stale_one(build_step, monkeypatch, capsys):
    command, stale, namespace = build_step
    monkeypatch.setenv(namespace["BUILD_SWITCH"], "0")
    command.run()
    assert not stale.exists()
    assert "is not built" in capsys.readouterr().err


def test_a_successful_build_replaces_the_stale_library_whole(build_step, monkeypatch):
    command, stale, namespace = build_step
    _compile_that(namespace, monkeypatch, "succeeds")
    command.run()
    assert sorted(os.listdir(stale)) == ["libkernels.so"]  # the old manifest is not kept beside the new library
    assert (stale / "libkernels.so").read_bytes() == b"this install's library"
