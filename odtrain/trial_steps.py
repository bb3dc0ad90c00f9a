"""Running a set of artifacts' steps once, on zero-valued inputs.

What `odtrain warmup` (odtrain/jit/warmup.py: the JIT's cache filled) and `odtrain compile`
(odtrain/library_build/record.py: the kernel library's calls recorded) both do, and the benchmarks
that time a first step: the same steps at the same shapes, so that what one fills the other finds.
Above the API: it loads artifacts through odtrain.api as a user's script would.
"""
from __future__ import annotations

def zero_inputs(module, batch_size: int, input_shapes: dict | None = None, sequence_length: int | None = None) -> list:
    """Zero-valued inputs of a Module's current mode, as a step would see them: the first symbolic axis
    is `batch_size`, the other symbolic axes `sequence_length`; `input_shapes` gives whole shapes by input name."""
    import numpy as np

    from .graph.errors import ArgumentError

    input_shapes = input_shapes or {}
    feeds = []
    for name, declared in module.input_types(module.training).items():
        if name in input_shapes:
            shape = tuple(int(d) for d in input_shapes[name])
        elif declared.shape is None:
            raise ArgumentError(f"input '{name}' has no declared shape: give it with --input-shape {name}=D0,D1,...")
        else:
            shape = []
            for axis, dim in enumerate(declared.shape):
                if not isinstance(dim, str):
                    shape.append(int(dim))
                elif axis == 0:
                    shape.append(int(batch_size))
                elif sequence_length is not None:
                    shape.append(int(sequence_length))
                else:
                    raise ArgumentError(f"input '{name}' has a symbolic axis {axis} ('{dim}') besides the batch: "
                                        f"give its length with --seq-len N, or the whole shape with "
                                        f"--input-shape {name}=D0,D1,...")
            shape = tuple(shape)
        feeds.append(np.zeros(shape, dtype=declared.dtype))
    return feeds


def run_steps(directory: str, batch_size: int, input_shapes: dict, sequence_length=None,
              inference_output: str | None = None) -> tuple[list[str], dict]:
    """Load the artifacts in `directory` and run each step they have once on zero-valued inputs (zero_inputs):
    a training step writing gradients and one accumulating them, an optimizer step, an eval step; with
    `inference_output`, also the inference model exported with that output, run once by InferenceSession (in
    a temporary folder). Nothing is written to the artifacts. Returns the steps run and the inputs' shapes by name."""
    import os
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
