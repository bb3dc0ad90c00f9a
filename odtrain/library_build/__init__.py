"""Building the kernel library (`odtrain compile`): odtrain's kernels compiled ahead into one shared object.

- `record`: the (kernel, signature) calls a set of artifacts' steps make, at the shapes and thread
  counts that stand for all the others;
- `link`: Numba compiles each call's kernel, llvmlite links them into one module for the target CPU,
  the target's C compiler links that with the launcher (`launcher.c`) into the library;
- `targets`: the CPUs and C compilers a library is built for.

The device side that loads the result (numpy and ctypes only) is odtrain/kernel_library/. This
package is a tool above the API: it binds steps through odtrain.api to record them.
"""
from __future__ import annotations

import os
import tempfile

from ..kernel_library import FOLDER, artifacts_digest
from ..kernel_library.cpu import host_arch
from .link import build, build_target
from .record import recorded_entries
from .targets import DEVICE_CORES


def library_folder(artifact_dir) -> str:
    """Where the library of an artifact folder goes."""
    return os.path.join(os.fspath(artifact_dir), FOLDER)


def compile_artifacts(artifact_dir=None, out_dir=None, batch_size: int = 32, thread_counts=None, out=print,
                      target: str | None = None, cpu: str | None = None, sequence_length: int | None = None,
                      input_shapes: dict | None = None) -> dict:
    """Build the kernel library of a set of artifacts (a folder, or a list of folders: one library for them all;
    None: the built-in demo classifier's, its inference model's included: the library the package ships,
    odtrain.demo.LIBRARY) into `out_dir` (default: the artifact folder's kernels/) for `target` and `cpu`
    (build()); returns the manifest. The steps are recorded at `thread_counts` (default: 1 and the cores of
    the device: this machine's, or DEVICE_CORES of another architecture), with the inputs' other symbolic axes
    at `sequence_length` (a language model's) or the whole shapes of `input_shapes`."""
    target, cpu, _, _ = build_target(target, cpu)  # before recording: an unknown name or no compiler fails now
    if target != host_arch() and thread_counts is None:
        thread_counts = (1, DEVICE_CORES.get(target, 1))
    folders = [artifact_dir] if artifact_dir is None or isinstance(artifact_dir, (str, os.PathLike)) \
        else list(artifact_dir)
    entries, recorded = set(), []
    for folder in folders:
        if folder is None:
            from ..demo import OUTPUT, demo_artifacts

            with tempfile.TemporaryDirectory(prefix="odtrain-compile-") as scratch:
                entries.update(recorded_entries(demo_artifacts(scratch), batch_size, thread_counts,
                                                inference_output=OUTPUT))
                recorded.append({"folder": "the demo classifier", "digest": artifacts_digest(scratch)})
        else:
            entries.update(recorded_entries(folder, batch_size, thread_counts, input_shapes,
                                            sequence_length=sequence_length))
            recorded.append({"folder": os.path.abspath(os.fspath(folder)), "digest": artifacts_digest(folder)})
    if out_dir is None:
        if len(folders) != 1 or folders[0] is None:
            raise ValueError("give the library's folder (-o DIR) for the demo classifier or several artifact folders")
        out_dir = library_folder(folders[0])
    return build(sorted(entries), out_dir, out, target, cpu, artifacts=recorded)
