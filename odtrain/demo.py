"""`odtrain demo`: the whole on-device workflow on data shipped with the package.

1. Build a small classifier (64-32-10 MLP, ReLU) as an ONNX model, as torch.onnx.export would.
2. generate_artifacts: training, eval and optimizer models and the checkpoint (AdamW, cross-entropy).
   Where onnx is not installed (a device with numpy and odtrain only), the package's copy of those
   artifacts (ARTIFACTS: generated this way at seed 0, byte for byte; tests/test_kernel_library.py
   checks it) is copied instead, its parameters drawn for `seed` as build_classifier draws them;
   the package's library of the demo's kernels (LIBRARY: built by `pip install .`, see setup.py, or by
   `odtrain compile -o`) goes beside them, so that nothing compiles and Numba is never imported.
3. Train on 80% of the 8x8 handwritten digits with CheckpointState, Module and Optimizer.
4. Report held-out accuracy and the process's peak memory; save the checkpoint; export an
   inference model and check it with odtrain's own InferenceSession.
"""
from __future__ import annotations

import os
import resource
import shutil
import time

import numpy as np

from .graph.wording import count

OUTPUT = "output"  # the classifier's logits
# the kernels of the demo's steps and of its inference check, built ahead (odtrain.library_build.compile_artifacts)
LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "kernels")
# the demo's artifacts (seed 0), for a device without onnx: `python -m odtrain.demo` writes them
ARTIFACTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "demo")
ARTIFACT_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")


def classifier_parameters(inputs: int = 64, hidden: int = 32, classes: int = 10, seed: int = 0) -> dict:
    """The classifier's parameters, Kaiming-uniform (PyTorch's nn.Linear initialisation), by name."""
    rng = np.random.default_rng(seed)

    def linear(fan_in, fan_out):
        bound = 1 / np.sqrt(fan_in)
        return (rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32),
                rng.uniform(-bound, bound, fan_out).astype(np.float32))

    (w1, b1), (w2, b2) = linear(inputs, hidden), linear(hidden, classes)
    return {"fc1.weight": w1, "fc1.bias": b1, "fc2.weight": w2, "fc2.bias": b2}


def build_classifier(inputs: int = 64, hidden: int = 32, classes: int = 10, seed: int = 0):
    """An ONNX MLP with Kaiming-uniform weights (classifier_parameters)."""
    from onnx import helper, numpy_helper

    params = classifier_parameters(inputs, hidden, classes, seed)
    nodes = [helper.make_node("Gemm", ["input", "fc1.weight", "fc1.bias"], ["hidden"], transB=1, name="fc1"),
             helper.make_node("Relu", ["hidden"], ["hidden_relu"], name="relu"),
             helper.make_node("Gemm", ["hidden_relu", "fc2.weight", "fc2.bias"], [OUTPUT], transB=1, name="fc2")]
    graph = helper.make_graph(
        nodes, "digits_mlp",
        [helper.make_tensor_value_info("input", 1, ["batch", inputs])],
        [helper.make_tensor_value_info(OUTPUT, 1, ["batch", classes])],
        [numpy_helper.from_array(v, name=k) for k, v in params.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), list(params)


def run(directory: str = "odtrain-demo", epochs: int = 15, batch_size: int = 32, learning_rate: float = 1e-2,
        seed: int = 0, out=print) -> dict:
    from . import artifacts
    from .api import CheckpointState, Module, Optimizer
    from .artifact_paths import ArtifactPaths
    from .datasets import load_digits, train_test_split
    from .inference import InferenceSession
    from .progress import Progress

    started = time.perf_counter()
    if onnx_installed():
        model, params = build_classifier(seed=seed)
        artifacts.generate_artifacts(model, requires_grad=params, loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=directory,
                                     additional_output_names=[OUTPUT])
        out(f"artifacts written to {directory}/ (training, eval and optimizer models, checkpoint)")
    else:
        copy_artifacts(directory, seed)
        out(f"artifacts copied to {directory}/ from the package (onnx is not installed to generate them)")
    out(place_library(directory))

    images, labels = load_digits()
    train_x, test_x, train_y, test_y = train_test_split(images, labels, test_fraction=0.2, seed=seed)
    out(f"data: 8x8 handwritten digits, {len(train_y)} for training, {len(test_y)} held out")

    paths = ArtifactPaths.of(directory)
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, paths.eval_model)
    optimizer = Optimizer(paths.optimizer_model, module)
    optimizer.set_learning_rate(learning_rate)
    check_kernels_before_training(module, directory, test_x, batch_size)
    rng = np.random.default_rng(seed)
    batches = (len(train_y) + batch_size - 1) // batch_size
    for epoch in range(1, epochs + 1):
        module.train()
        order = rng.permutation(len(train_y))
        bar = Progress(batches, f"epoch {epoch:>2}/{epochs}")
        total = 0.0
        for start in range(0, len(order), batch_size):
            index = order[start:start + batch_size]
            loss, _ = module(train_x[index], train_y[index])
            optimizer.step()
            module.lazy_reset_grad()
            total += float(loss) * len(index)
            bar.update(loss=float(loss))
        bar.update(0, mean_loss=total / len(train_y))
        bar.close()

    module.eval()
    test_loss, logits = module(test_x, test_y)
    accuracy = float((logits.argmax(axis=1) == test_y).mean())
    state.properties["epochs"] = epochs
    state.properties["held_out_accuracy"] = accuracy
    CheckpointState.save_checkpoint(state, paths.checkpoint, include_optimizer_state=True)
    inference_path = os.path.join(directory, "inference.onnx")
    module.export_model_for_inferencing(inference_path, [OUTPUT])
    (check,) = InferenceSession(inference_path).run([OUTPUT], {"input": test_x})
    agree = float((check.argmax(axis=1) == logits.argmax(axis=1)).mean())
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"held_out_accuracy": accuracy, "held_out_loss": float(test_loss), "peak_rss_mib": peak_mib,
              "seconds": time.perf_counter() - started, "inference_model": inference_path, "inference_agreement": agree}
    out(f"held-out accuracy: {accuracy:.1%} (loss {float(test_loss):.4f}) on {count(len(test_y), 'digit')}")
    out(f"peak memory (RSS): {peak_mib:.0f} MiB; total time {result['seconds']:.1f} s")
    out(f"inference model: {inference_path} (its predictions agree with training's on {agree:.0%} of the digits)")
    return result


def check_kernels_before_training(module, directory: str, test_x, batch_size: int) -> None:
    """Where Numba is not installed (a device), every kernel the demo calls must be in the kernel library: bind
    the training step, the held-out evaluation and the exported model's inference now, so that a library that
    lacks one stops the demo before its first epoch, with the command that builds the demo's library where
    odtrain's dependencies are (a desktop) and how to use it here."""
    import tempfile

    from .graph.errors import KernelsUnavailableError
    from .inference import InferenceSession
    from .kernel_library import LIBRARY_ENV, compiler_installed
    from .kernel_library.cpu import host_arch

    if compiler_installed():
        return  # what a library lacks compiles through Numba
    try:
        module.bind_at(batch_size, training=True)
        module.bind_at(len(test_x), training=False)
        with tempfile.TemporaryDirectory(prefix="odtrain-demo-check-", dir=directory) as scratch:
            path = os.path.join(scratch, "inference.onnx")
            module.export_model_for_inferencing(path, [OUTPUT])
            InferenceSession(path).run([OUTPUT], {"input": test_x[:1]})
    except KernelsUnavailableError as error:
        text = str(error)
        # the step's own advice compiles this device's artifact folder on a desktop, which has no such folder
        cut = min((text.find(m) for m in (": rebuild the library", ": build the library") if m in text),
                  default=len(text))
        raise KernelsUnavailableError(
            f"{text[:cut]} (the demo checks its kernels before training). On a machine with odtrain's dependencies "
            f"(a desktop), `odtrain compile -o DIR --target {host_arch()}` builds the demo's; copy DIR here and run "
            f"`{LIBRARY_ENV}=DIR odtrain demo`") from None


def onnx_installed() -> bool:
    from importlib.util import find_spec

    try:
        return find_spec("onnx") is not None
    except (ImportError, ValueError):
        return False


def copy_artifacts(directory: str, seed: int = 0) -> None:
    """The package's demo artifacts into `directory`, their parameters drawn for `seed`."""
    from .api import CheckpointState

    os.makedirs(directory, exist_ok=True)
    for name in ARTIFACT_FILES:
        shutil.copyfile(os.path.join(ARTIFACTS, name), os.path.join(directory, name))
    if seed != 0:
        path = os.path.join(directory, "checkpoint")
        state = CheckpointState.load_checkpoint(path)
        for name, value in classifier_parameters(seed=seed).items():
            state.parameters[name] = value
        CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)


def demo_artifacts(directory: str) -> str:
    """The demo classifier's artifacts (seed 0) in `directory` (returned): generated, or where onnx is not
    installed the package's copy, the same bytes."""
    from . import artifacts

    if not onnx_installed():
        copy_artifacts(directory)
        return directory
    model, params = build_classifier()
    artifacts.generate_artifacts(model, requires_grad=params, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=directory,
                                 additional_output_names=[OUTPUT])
    return directory


def write_artifacts(directory: str = ARTIFACTS) -> None:
    """Generate the package's demo artifacts (seed 0) into `directory` (needs onnx)."""
    import tempfile

    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="odtrain-demo-") as scratch:
        demo_artifacts(scratch)
        for name in ARTIFACT_FILES:
            shutil.copyfile(os.path.join(scratch, name), os.path.join(directory, name))


def place_library(directory: str) -> str:
    """Copy the package's library of the demo's kernels into the artifact folder's kernels/ (where Module and
    InferenceSession look), replacing the files whole; returns what was done, as a line to print."""
    from .kernel_library import FOLDER, LIBRARY_FILE, MANIFEST_FILE

    target = os.path.join(directory, FOLDER)
    if not os.path.isfile(os.path.join(LIBRARY, MANIFEST_FILE)):
        from .kernel_library import LIBRARY_ENV, compiler_installed

        named = os.environ.get(LIBRARY_ENV, "").strip()
        if named and named.lower() != "off":
            return _named_library(directory, named)
        if not compiler_installed():
            return (f"kernels: the package holds no library of them (a pure wheel) and Numba is not installed: build "
                    f"one where odtrain's dependencies are, `odtrain compile -o DIR --target ARCH`, then run "
                    f"`{LIBRARY_ENV}=DIR odtrain demo` here")
        return (f"kernels: the package holds no library of them (an editable install, ODTRAIN_BUILD_LIBRARY=0, or "
                f"a build that failed at install, without a C compiler say): they compile through Numba on first "
                f"use, once; `odtrain compile -o {LIBRARY}` builds them ahead")
    os.makedirs(target, exist_ok=True)
    for name in (LIBRARY_FILE, MANIFEST_FILE):  # the manifest last: a library is found by its manifest
        partial = os.path.join(target, f".{name}.{os.getpid()}")
        shutil.copyfile(os.path.join(LIBRARY, name), partial)
        os.replace(partial, os.path.join(target, name))  # a process that maps the old file keeps it whole
    return f"kernels: the package's library of them, built ahead, copied to {target}/"


def _named_library(directory: str, named: str) -> str:
    """The kernels line where the package holds no library and ODTRAIN_KERNEL_LIBRARY names one: the library it
    names runs them, or why it cannot."""
    from .kernel_library import LIBRARY_ENV, compiler_installed, find

    library = find(directory)
    if library is not None:
        return f"kernels: the library {LIBRARY_ENV} names ({getattr(library, 'folder', named)}), built ahead"
    fallback = ("they compile through Numba on first use, once" if compiler_installed() else
                "Numba is not installed to compile them: build the demo's library on a machine with odtrain's "
                "dependencies with `odtrain compile -o DIR`, and point " + LIBRARY_ENV + " at it")
    return f"kernels: {LIBRARY_ENV}={named} gives no usable library (see the line above, if any); {fallback}"


if __name__ == "__main__":
    write_artifacts()
