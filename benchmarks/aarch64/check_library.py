"""The golden MLP and CNN trajectories on a device that has numpy and a kernel library, and no compiler.

    python check_library.py --prepare DIR   # the desktop: artifacts of tests/data's mlp and cnn (SGD, AdamW)
    odtrain compile DIR/* -o DIR/kernels --target aarch64                 # the desktop: their library
    python check_library.py --run DIR       # the device: train along PyTorch's losses through the library

--run trains each set of artifacts along its golden batches at 1 thread and at the device's cores (4,
a Raspberry Pi's), compares the losses with PyTorch's at the suite's tolerances (tests/test_golden_mlp.py,
tests/test_vision.py), then runs a training, an optimizer and an eval step of each at other batch sizes
(SHAPES: 1, a last partial batch, batches larger than the recorded 32, whose steps split into parts the
library holds as parallel twins) at the device's cores, every call in the library, then checks that the
process holds none of numba, llvmlite, scipy or onnx, in
sys.modules or among its mapped files. A kernel that the library lacked would have needed Numba: the
device has none installed, so the run would have stopped there.
"""
import argparse
import json
import os
import shutil
import sys
import time

T0 = time.perf_counter()
MODELS = ("mlp", "cnn")
OPTIMIZERS = ("sgd", "adamw")
# the suite's tolerances: tests/test_golden_mlp.py (2e-6 for both), tests/test_vision.py's CNN_LOSS_RTOL
RTOL = {("mlp", "sgd"): 2e-6, ("mlp", "adamw"): 2e-6, ("cnn", "sgd"): 5e-5, ("cnn", "adamw"): 1e-3}
THREADS = (1, 4)
SHAPES = {"mlp": (1, 7, 100, 512, 2048), "cnn": (1, 7, 100)}  # batch sizes besides the golden's
COMPILER = ("numba", "llvmlite", "scipy", "onnx")


def prepare(folder: str, data: str) -> None:
    from odtrain import artifacts

    for model in MODELS:
        source = os.path.join(data, model)
        meta = json.load(open(os.path.join(source, "meta.json")))
        os.makedirs(os.path.join(folder, "data", model), exist_ok=True)
        for name in ("meta.json", "golden.npz"):
            shutil.copy(os.path.join(source, name), os.path.join(folder, "data", model, name))
        for optimizer in OPTIMIZERS:
            kind = artifacts.OptimType.SGD if optimizer == "sgd" else artifacts.OptimType.AdamW
            artifacts.generate_artifacts(os.path.join(source, "forward.onnx"), requires_grad=meta["requires_grad"],
                                         frozen_params=meta["frozen_params"], loss=artifacts.LossType.CrossEntropyLoss,
                                         optimizer=kind, artifact_directory=os.path.join(folder, f"{model}-{optimizer}"))
    print(f"artifacts of {', '.join(MODELS)} x {', '.join(OPTIMIZERS)} in {folder}")


def train(folder: str, meta: dict, golden, optimizer: str, threads: int) -> list[float]:
    import numpy as np

    from odtrain.api import CheckpointState, Module, Optimizer

    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state, os.path.join(folder, "eval_model.onnx"),
                    num_threads=threads)
    assert module.kernel_library is not None, f"{folder}: no kernel library found"
    step = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    step.set_learning_rate(meta[optimizer]["lr"])
    losses = []
    for index in range(meta["steps"]):
        losses.append(float(module(golden["x"][index].astype(np.float32), golden["y"][index])))
        step.step()
        module.lazy_reset_grad()
    return losses


def other_batches(folder: str, model: str, threads: int) -> list[str]:
    """A training, an optimizer and an eval step at each of SHAPES[model]: its losses, each through the library."""
    import numpy as np

    from odtrain.api import CheckpointState, Module, Optimizer

    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state, os.path.join(folder, "eval_model.onnx"),
                    num_threads=threads)
    step = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    shape, = [t.shape for t in module.input_types(True).values() if t.dtype == np.float32]
    rng = np.random.default_rng(0)
    lines = []
    for batch in SHAPES[model]:
        x = rng.standard_normal((batch, *shape[1:])).astype(np.float32)
        y = rng.integers(0, 10, batch).astype(np.int64)
        module.train()
        loss = float(module(x, y))
        step.step()
        module.lazy_reset_grad()
        module.eval()
        evaluated = float(module(x, y))  # a kernel the library lacked would have stopped the step: no Numba here
        assert np.isfinite(loss) and np.isfinite(evaluated), (batch, loss, evaluated)
        lines.append(f"batch {batch}: loss {loss:.4f}, eval {evaluated:.4f}")
    return lines


def run(folder: str) -> int:
    import numpy as np

    import odtrain.api  # noqa: F401

    imported = time.perf_counter() - T0
    from odtrain import kernel_library

    from odtrain.kernels.blas_library import product_threads

    library = kernel_library.find()
    if library is None:  # refused, or none there: the line a step would stop with says why
        print(f"  no kernel library: {kernel_library.unavailable(None)}")
        return 1
    manifest = library.manifest
    blas = product_threads()
    print(f"  products: {blas.name or 'no OpenBLAS found in numpy'} ({blas.core or 'core unknown'})")
    print(f"  numpy and odtrain imported in {imported:.1f} s; library for {manifest['triple']} "
          f"({manifest['cpu']}, {manifest['features']}), {len(manifest['entries'])} kernels; "
          f"this CPU: {' '.join(sorted(kernel_library.cpu_flags() or ['(unknown)']))}")
    failed = 0
    for model in MODELS:
        meta = json.load(open(os.path.join(folder, "data", model, "meta.json")))
        golden = np.load(os.path.join(folder, "data", model, "golden.npz"))
        for optimizer in OPTIMIZERS:
            for threads in THREADS:
                started = time.perf_counter()
                losses = train(os.path.join(folder, f"{model}-{optimizer}"), meta, golden, optimizer, threads)
                expected = golden[f"{optimizer}_losses"]
                worst = float(np.max(np.abs(np.array(losses) - expected) / np.abs(expected)))
                ok = worst <= RTOL[model, optimizer]
                failed += not ok
                print(f"  {model} {optimizer:<5} {threads} thread{'s' if threads > 1 else ' '}: {len(losses)} losses "
                      f"within {worst:.1e} of PyTorch's (tolerance {RTOL[model, optimizer]:.0e}) "
                      f"{'ok' if ok else 'FAILED'}  ({time.perf_counter() - started:.1f} s)")
    for model in MODELS:
        started = time.perf_counter()
        try:
            lines = other_batches(os.path.join(folder, f"{model}-adamw"), model, THREADS[-1])
            print(f"  {model} adamw {THREADS[-1]} threads, other batches, every call in the library: "
                  f"{'; '.join(lines)} ok  ({time.perf_counter() - started:.1f} s)")
        except Exception as error:  # the one line the device printed, or a failed check
            failed += 1
            print(f"  {model} adamw, other batches: FAILED: {type(error).__name__}: {error}")
    modules = sorted(m for m in sys.modules if m.split(".")[0] in COMPILER)
    with open("/proc/self/maps") as maps:
        mapped = sorted({line.split()[-1] for line in maps if any(f"/{n}" in line for n in COMPILER)})
    print(f"  compiler modules imported: {modules or 'none'}; compiler libraries mapped: {mapped or 'none'}")
    if modules or mapped:
        failed += 1
    print("library check", "FAILED" if failed else "passed")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prepare", metavar="DIR")
    mode.add_argument("--run", metavar="DIR")
    parser.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data"),
                        help="the reference models' folder (default: tests/data)")
    args = parser.parse_args()
    if args.prepare:
        prepare(args.prepare, args.data)
        return 0
    return run(args.run)


if __name__ == "__main__":
    sys.exit(main())
