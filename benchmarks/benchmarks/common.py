"""Shared preparation for the benchmarks: model data, fixed-seed batches, training artifacts.

Append-only: benchmarks' results stay comparable across commits only if the data
they run on never changes, so add new helpers and seeds instead of editing these.

Artifacts are generated once per benchmark process into a temporary directory
that is removed when the process exits; each benchmark then opens its own
CheckpointState, Module and Optimizer from it.
"""
import atexit
import functools
import json
import os
import pathlib
import shutil
import tempfile

import numpy as np

SEED = 1234


def _search_starts():
    yield pathlib.Path(__file__)  # asv imports the benchmarks in place from benchmark_dir
    import odtrain  # an editable install points into the repository

    yield pathlib.Path(odtrain.__file__)


def _find_data_dir() -> pathlib.Path:
    """tests/data of the repository: $ODTRAIN_BENCH_DATA, else the nearest one above this file or odtrain."""
    if os.environ.get("ODTRAIN_BENCH_DATA"):
        return pathlib.Path(os.environ["ODTRAIN_BENCH_DATA"])
    for start in _search_starts():
        for folder in start.resolve().parents:
            if (folder / "tests" / "data" / "mlp").is_dir():
                return folder / "tests" / "data"
    raise FileNotFoundError("no tests/data/mlp above the benchmarks or odtrain; set ODTRAIN_BENCH_DATA")


DATA_DIR = _find_data_dir()


def model_dir(name: str) -> pathlib.Path:
    """The folder of a reference model: forward.onnx, meta.json, golden.npz."""
    return DATA_DIR / name


def meta(name: str) -> dict:
    return json.loads((model_dir(name) / "meta.json").read_text())


def scratch_dir(label: str) -> pathlib.Path:
    """A new temporary directory, removed when the process exits."""
    path = pathlib.Path(tempfile.mkdtemp(prefix=f"odtrain-bench-{label}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.lru_cache(maxsize=None)
def artifacts(name: str, optimizer: str = "AdamW") -> pathlib.Path:
    """Training artifacts of a reference model (cross-entropy loss), generated once per process."""
    from odtrain import artifacts as odtrain_artifacts

    info = meta(name)
    directory = scratch_dir(f"{name}-artifacts")
    odtrain_artifacts.generate_artifacts(
        str(model_dir(name) / "forward.onnx"),
        requires_grad=info["requires_grad"], frozen_params=info["frozen_params"],
        loss=odtrain_artifacts.LossType.CrossEntropyLoss,
        optimizer=getattr(odtrain_artifacts.OptimType, optimizer),
        artifact_directory=directory)
    return directory


def open_training(directory: pathlib.Path):
    """(module, optimizer) on a fresh CheckpointState loaded from an artifact directory."""
    from odtrain.api import CheckpointState, Module, Optimizer
    from odtrain.artifact_paths import ArtifactPaths

    paths = ArtifactPaths.of(directory)
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, paths.eval_model)
    return module, Optimizer(paths.optimizer_model, module)


def classification_batch(batch: int, features: int, classes: int, seed: int = SEED):
    """x float32 [batch, features] ~ N(0, 1) and int64 labels in 0..classes-1."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, features), dtype=np.float32)
    y = rng.integers(0, classes, size=batch, dtype=np.int64)
    return x, y


def last_plan(module):
    """The memory plan bound by the module's most recent training call."""
    return [step for step in module.bound_steps() if step.mode == "train"][-1].plan
