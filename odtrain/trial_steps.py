"""Running a set of artifacts' steps once, on zero-valued inputs, and `warmup()`, which does it to fill the JIT's cache.

`run_steps` is what `odtrain warmup` (`warmup()` below) and `odtrain compile` (odtrain/library_build/record.py:
the kernel library's calls recorded) both do, and what the benchmarks that time a first step do: the same
steps at the same shapes, so that what one fills the other finds. `warmup()` runs a training step, an
optimizer step and an eval step so that every kernel they use is compiled into the JIT's cache
(odtrain/jit/cache.py) or checked to load from it: the first real step in a later process then compiles
nothing. Above the API: it loads artifacts through odtrain.api as a user's script would.
"""
from __future__ import annotations

import os
import time

from .graph.wording import count
from .jit.cache import cache_dir, configured_source, kernel_dispatchers

DEFAULT_WARMUP_BATCH = 32


def zero_inputs(module, batch_size: int, input_shapes: dict | None = None, sequence_length: int | None = None) -> list:
    """Zero-valued inputs of a Module's current mode, as a step would see them: the first symbolic axis
    is `batch_size`, the other symbolic axes `sequence_length`; `input_shapes` gives whole shapes by input name."""
    from .api import placeholder_feeds

    return placeholder_feeds(module.input_types(module.training), batch_size, sequence_length, input_shapes)


def run_steps(directory: str, batch_size: int, input_shapes: dict, sequence_length=None,
              inference_output: str | None = None) -> tuple[list[str], dict]:
    """Load the artifacts in `directory` and run each step they have once on zero-valued inputs (zero_inputs):
    a training step writing gradients and one accumulating them, an optimizer step, an eval step; with
    `inference_output`, also the inference model exported with that output, run once by InferenceSession (in
    a temporary folder). Nothing is written to the artifacts. Returns the steps run and the inputs' shapes by name."""
    import tempfile

    import numpy as np

    from .api import CheckpointState, Module, Optimizer
    from .artifact_paths import ArtifactPaths
    from .executor import assert_finite, invoke
    from .inference import InferenceSession

    paths = ArtifactPaths.of(directory)
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    has_eval = paths.has("eval_model")
    module = Module(paths.training_model, state, paths.eval_model if has_eval else None)
    optimizer = Optimizer(paths.optimizer_model, module) if paths.has("optimizer_model") else None
    steps = []
    feeds = zero_inputs(module.train(), batch_size, input_shapes, sequence_length)
    loss = module(*feeds)  # gradients written
    module(*feeds)  # gradients accumulated (no lazy_reset_grad in between)
    steps.append("train")
    if optimizer is not None:
        optimizer.step()
        steps.append("optimizer")
    module.lazy_reset_grad()
    if has_eval:
        module.eval()
        module(*zero_inputs(module, batch_size, input_shapes, sequence_length))
        module.train()
        steps.append("eval")
    if inference_output is not None:
        with tempfile.TemporaryDirectory(prefix="odtrain-inference-") as scratch:
            path = os.path.join(scratch, "inference.onnx")
            module.export_model_for_inferencing(path, [inference_output])
            session = InferenceSession(path)
            inputs = dict(zip(module.eval().input_names(), zero_inputs(module, batch_size, input_shapes, sequence_length)))
            module.train()
            session.run([inference_output], {i.name: inputs[i.name] for i in session.get_inputs()})
        steps.append("inference")
    first = loss[0] if isinstance(loss, (list, tuple)) else loss
    first = np.asarray(first)
    if first.dtype.kind == "f":  # the check of Module(check_finite=True)
        invoke(assert_finite, (np.zeros(1, dtype=first.dtype),), library=module.kernel_library)
    return steps, {name: list(array.shape) for name, array in zip(module.input_names(), feeds)}


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

    from .artifact_paths import TRAINING_MODEL, ArtifactPaths, refuse_a_model
    from .demo import demo_artifacts
    from .graph.errors import ArgumentError, ArtifactNotFoundError

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
