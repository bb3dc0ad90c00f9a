"""A training step through the kernel library against the same step through Numba's JIT, in one process.

Two Modules on the same artifacts (the reference MLP or CNN of tests/data, AdamW), one whose folder holds
the artifacts' kernel library (`odtrain compile`) and one without, take turns: each round times a block of
steps (forward, backward, optimizer.step, lazy_reset_grad) of one, then of the other, the order swapped every
round, so that a drift of the machine's speed reaches both alike. Printed: the median step of each, and the
median and spread of the per-round ratios library / JIT. `--only library` (or `jit`) times one of them alone,
in a process of its own, for a runner that alternates whole processes: it prints that median step.

    python benchmarks/library_step.py [--model mlp|cnn] [--threads N] [--rounds R] [--steps K] [--work DIR]
                                      [--only library|jit]

`--work` keeps the artifacts and the library between runs (building the library takes a while).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def prepare(model: str, work: str) -> tuple[str, str]:
    """(artifact folder with its library, the same artifacts without one)."""
    from conftest import reference_artifacts

    from odtrain.library_build import compile_artifacts
    from odtrain.kernel_library import FOLDER

    with_library, without = os.path.join(work, model + "-library"), os.path.join(work, model + "-jit")
    if not os.path.isdir(os.path.join(with_library, FOLDER)):
        os.makedirs(with_library, exist_ok=True)
        reference_artifacts(model, with_library)
        compile_artifacts(with_library)
    os.makedirs(without, exist_ok=True)
    for name in os.listdir(with_library):
        if name != FOLDER:
            shutil.copy(os.path.join(with_library, name), os.path.join(without, name))
    return with_library, without


def stepper(folder: str, model: str, threads: int):
    """A function that runs `steps` training steps of the reference model in `folder` and returns the seconds."""
    from conftest import reference_model

    from odtrain.api import CheckpointState, Module, Optimizer

    _, meta, golden = reference_model(model)
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state, num_threads=threads)
    optimizer = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(meta["adamw"]["lr"] * 1e-3)  # small steps: the same work, no divergence
    x, y = golden["x"][0], golden["y"][0]

    def run(steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            module(x, y)
            optimizer.step()
            module.lazy_reset_grad()
        return time.perf_counter() - started

    run(3)  # binds, compiles or loads every kernel
    return run, module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    parser.add_argument("--threads", type=int, default=None, help="default: every core")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=None, help="steps a block (default: 200 mlp, 5 cnn)")
    parser.add_argument("--work", default=None, help="folder for the artifacts and the library (default: temporary)")
    parser.add_argument("--only", choices=["library", "jit"], default=None, help="time this one alone")
    args = parser.parse_args()
    import tempfile

    from odtrain import threads as thread_policy

    work = args.work or tempfile.mkdtemp(prefix="odtrain-library-step-")
    threads = args.threads or thread_policy.available_cores()
    steps = args.steps or (200 if args.model == "mlp" else 5)
    with_library, without = prepare(args.model, work)
    if args.only:
        run, module = stepper(with_library if args.only == "library" else without, args.model, threads)
        assert (module.kernel_library is not None) == (args.only == "library")
        step = statistics.median(run(steps) / steps for _ in range(args.rounds))
        print(f"{args.model}, {threads} threads, {args.only}: {step * 1e3:.4f} ms a step")
        return
    library, library_module = stepper(with_library, args.model, threads)
    jit, jit_module = stepper(without, args.model, threads)
    assert library_module.kernel_library is not None and jit_module.kernel_library is None
    times = {"library": [], "jit": []}
    ratios = []
    for index in range(args.rounds):
        order = [("library", library), ("jit", jit)] if index % 2 == 0 else [("jit", jit), ("library", library)]
        block = {}
        for name, run in order:
            block[name] = run(steps) / steps
            times[name].append(block[name])
        ratios.append(block["library"] / block["jit"])
    ratios.sort()
    print(f"{args.model}, {threads} threads, {args.rounds} rounds of {steps} steps: library "
          f"{statistics.median(times['library']) * 1e3:.3f} ms, JIT {statistics.median(times['jit']) * 1e3:.3f} ms "
          f"a step; library / JIT {statistics.median(ratios):.3f}x (quartiles {ratios[len(ratios) // 4]:.3f}-"
          f"{ratios[3 * len(ratios) // 4]:.3f})")


if __name__ == "__main__":
    main()
