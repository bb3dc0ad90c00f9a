"""Memory of a training step: the planner's arena against its lower bound, the memory report's
prediction against the RSS a process really adds, and training under a memory budget.

    python benchmarks/memory.py --workload mlp cnn transformer mobilenetv2_personalize mobilenetv2_full
    python benchmarks/memory.py --workload mobilenetv2_full --budget-fraction 0.5

Each workload runs in a fresh process. To measure only what training adds, the process first
loads every kernel with a separate warm-up session on the same batch, kept alive so its pages are
not reused (Numba's runtime is the process's floor, not training's), then resets the peak-RSS counter (/proc/self/clear_refs) and trains
--steps AdamW steps on a freshly loaded checkpoint; "measured" is the new peak minus the RSS after
that checkpoint was loaded, the same baseline the report's `training_bytes` counts from. "step ms"
is the median step after the first; "first s" the time from creating the Module to the end of its
first step (binding, planning, and under a budget choosing what to recompute).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = [HERE.parent / "tests" / "data", HERE.parents[1] / "shared" / "models"]
MIB = 1024 * 1024


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(name: str, steps: int, budget_fraction: float | None) -> dict:
    import numpy as np

    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module, Optimizer
    from odtrain.artifact_paths import ArtifactPaths
    from odtrain.memory import report

    folder = next(root / name for root in MODELS if (root / name / "forward.onnx").exists())
    meta = json.loads((folder / "meta.json").read_text())
    golden = np.load(folder / "golden.npz")
    dtype = np.dtype(meta["input_dtype"])
    batches = [(golden["x"][i].astype(dtype), golden["y"][i]) for i in range(min(steps, len(golden["x"])))]
    directory = Path(tempfile.mkdtemp(prefix=f"odtrain-memory-{name}-"))
    artifacts.generate_artifacts(str(folder / "forward.onnx"), requires_grad=meta["requires_grad"],
                                 frozen_params=meta["frozen_params"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=directory)
    paths = ArtifactPaths.of(directory)

    def session(state, budget=None):
        module = Module(paths.training_model, state, memory_budget=budget)
        return module, Optimizer(paths.optimizer_model, module)

    def last_training_step(module):
        return [step for step in module.bound_steps() if step.mode == "train"][-1]

    # Loads the kernels, each in the specializations (array layouts) the measured batch needs.
    warm, warm_optimizer = session(CheckpointState.load_checkpoint(paths.checkpoint))
    warm(*batches[0])
    warm_optimizer.step()
    free_arena = last_training_step(warm).arena_bytes  # unconstrained, for a budget
    # The warm-up session stays alive: freeing it would let the measured session reuse its pages.

    budget = int(free_arena * budget_fraction) if budget_fraction else None
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    gc.collect()
    before = rss_bytes()
    reset_peak()
    created = time.perf_counter()
    module, optimizer = session(state, budget)
    losses, times, first_step = [], [], None
    for x, y in batches:
        start = time.perf_counter()
        losses.append(float(module(x, y)))
        optimizer.step()
        module.lazy_reset_grad()
        times.append(time.perf_counter() - start)
        first_step = first_step or time.perf_counter() - created
    measured = peak_bytes() - before
    bound = last_training_step(module)
    predicted = report(module).training_bytes
    return {"workload": name, "arena": bound.arena_bytes, "lower_bound": bound.lower_bound,
            "predicted_added": predicted, "measured_added": measured, "budget": budget,
            "recomputed_nodes": bound.recomputed_nodes, "losses": losses, "first_step_s": first_step,
            "median_step_ms": sorted(times[1:] or times)[len(times[1:] or times) // 2] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", nargs="+", default=["mlp"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--budget-fraction", type=float, help="also train under this fraction of the arena")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fraction", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.workload[0], args.steps, args.fraction)))
        return
    print(f"{'workload':<26}{'arena MiB':>10}{'x bound':>9}{'predicted':>11}{'measured':>10}{'pred/meas':>10}"
          f"{'step ms':>9}{'first s':>9}  budget")
    for name in args.workload:
        runs = [None] + ([args.budget_fraction] if args.budget_fraction else [])
        results = []
        for fraction in runs:
            command = [sys.executable, __file__, "--worker", "--workload", name, "--steps", str(args.steps)]
            if fraction:
                command += ["--fraction", str(fraction)]
            # A fixed mmap threshold: large buffers are mapped fresh (untouched pages cost nothing)
            # instead of recycled from the heap, so the RSS counts what training really touches.
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode:
                print(f"{name}: failed\n{done.stderr[-2000:]}")
                break
            r = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(r)
            budget = "none" if r["budget"] is None else f"{r['budget'] / MIB:.1f} MiB, {r['recomputed_nodes']} nodes recomputed"
            print(f"{name:<26}{r['arena'] / MIB:>10.2f}{r['arena'] / max(r['lower_bound'], 1):>9.3f}"
                  f"{r['predicted_added'] / MIB:>11.1f}{r['measured_added'] / MIB:>10.1f}"
                  f"{r['predicted_added'] / max(r['measured_added'], 1):>10.2f}{r['median_step_ms']:>9.1f}"
                  f"{r['first_step_s']:>9.2f}  {budget}")
        if len(results) == 2:
            same = results[0]["losses"] == results[1]["losses"]
            print(f"{'':<26}losses under the budget {'identical' if same else 'DIFFER'}: {results[1]['losses']}")


if __name__ == "__main__":
    main()
