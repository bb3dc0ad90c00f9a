"""Filling the JIT's cache before the first step: `warmup()`, the `odtrain warmup` command.

It runs a training step, an optimizer step and an eval step of a set of artifacts on zero-valued
inputs (odtrain/trial_steps.py), so that every kernel they use is compiled into the cache
(odtrain/jit/cache.py) or checked to load from it: the first real step in a later process then
compiles nothing. A tool above the API: it loads the artifacts as a user's script would.
"""
from __future__ import annotations

import os
import time

from ..graph.wording import count
from .cache import cache_dir, configured_source, kernel_dispatchers

DEFAULT_WARMUP_BATCH = 32


def demo_artifacts(directory: str) -> str:
    """The demo classifier's artifacts, generated in `directory` (returned; odtrain.demo.demo_artifacts)."""
    from ..demo import demo_artifacts as written

    return written(directory)


def _kernel_activity() -> dict[str, tuple[int, int]]:
    """Each kernel of this process -> (signatures compiled, signatures loaded from the cache) so far."""
    return {f"{d.py_func.__module__}.{d.py_func.__qualname__}":
            (sum(d.stats.cache_misses.values()), sum(d.stats.cache_hits.values())) for d in kernel_dispatchers()}


def warmup(artifact_dir=None, batch_size: int = DEFAULT_WARMUP_BATCH, input_shapes: dict | None = None,
           out=print, sequence_length: int | None = None) -> dict:
    """Compile, or load from the cache, every kernel of a training step, an optimizer step and an eval step.

    `artifact_dir` holds training_model.onnx, checkpoint, and optionally eval_model.onnx and
    optimizer_model.onnx (the files generate_artifacts writes); None warms up the built-in demo
    classifier. The steps run on zero-valued inputs whose first symbolic axis is `batch_size` and whose
    other symbolic axes are `sequence_length`; `input_shapes` gives whole shapes by input name. Nothing is
    written to the artifacts. Returns the kernel counts and seconds: each kernel the steps used is counted
    once, as compiled (some signature of it was compiled) or loaded from the cache.
    """
    import tempfile

    from ..trial_steps import run_steps
    from ..artifact_paths import TRAINING_MODEL, ArtifactPaths, refuse_a_model
    from ..graph.errors import ArgumentError, ArtifactNotFoundError

    if int(batch_size) < 1:
        raise ArgumentError(f"batch size must be >= 1, got {batch_size}")
    if sequence_length is not None and int(sequence_length) < 1:
        raise ArgumentError(f"sequence length must be >= 1, got {sequence_length}")
    started = time.perf_counter()
    scratch = None
    if artifact_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="odtrain-warmup-")
        directory = demo_artifacts(scratch.name)
        label = "the built-in demo classifier"
    else:
        directory = os.fspath(artifact_dir)
        refuse_a_model(directory)
        label = directory
        if not ArtifactPaths.of(directory).has("training_model"):
            raise ArtifactNotFoundError(f"'{directory}' has no {TRAINING_MODEL}: give the folder that "
                                        f"generate_artifacts wrote ({TRAINING_MODEL}, checkpoint, ...)")
    try:
        before = _kernel_activity()
        steps, shapes = run_steps(directory, int(batch_size), input_shapes or {}, sequence_length)
    finally:
        if scratch is not None:
            scratch.cleanup()
    after = _kernel_activity()
    compiled = loaded = 0
    for name, (misses, hits) in after.items():
        new_misses, new_hits = (misses, hits) if name not in before else (misses - before[name][0],
                                                                          hits - before[name][1])
        compiled += new_misses > 0
        loaded += new_misses == 0 and new_hits > 0
    result = {"artifacts": label, "batch_size": int(batch_size), "inputs": shapes, "steps": steps,
              "compiled": compiled, "loaded": loaded, "kernels": compiled + loaded, "cache_dir": cache_dir(),
              "cache_source": configured_source(), "seconds": time.perf_counter() - started}
    inputs = ", ".join(f"{name} [{', '.join(map(str, shape))}]" for name, shape in shapes.items())
    out(f"warmed up {label} on inputs {inputs} ({', '.join(steps)} steps): {count(result['kernels'], 'kernel')}, "
        f"{compiled} compiled and {loaded} loaded from the cache, in {result['seconds']:.1f} s")
    out(f"kernel cache: {result['cache_dir']}")
    return result


