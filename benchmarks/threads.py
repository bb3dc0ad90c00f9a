"""Threads: what a parallel region costs in each of Numba's threading layers, and a training step beside a
busy process. Every figure comes from fresh processes, the variants alternating, as medians.

    python benchmarks/threads.py regions [--runs 3]
    python benchmarks/threads.py neighbour --workload cnn [--steps 20] [--runs 3] [--pinned]

regions: Numba's omp layer with libgomp's default waiting (spinning ~3 ms), with OMP_WAIT_POLICY=PASSIVE and
odtrain's short spin (what odtrain sets), passive without a spin, and the workqueue layer; each process
reports the median time of one 2-thread region with trivial work, back to back, after ~20 µs of serial work,
and after sleeping 1 ms and 10 ms.

neighbour: the median training step (AdamW, ../shared/models/WORKLOAD, batches of golden.npz) at
num_threads=1 and at odtrain's default (every core this process may run on; beside a busy process, the
cores it leaves free), alone and beside one busy process (`python -c 'while True: pass'`, with --pinned on
the last core); prints default / one thread.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"

REGION = r"""
import json, os, sys, time
import numpy as np
import numba
from numba import njit, prange
numba.config.THREADING_LAYER = sys.argv[1]

@njit(parallel=True)
def region(a):
    for i in prange(2):
        a[i] += 1.0

@njit
def serial(b):
    for r in range(10):
        for i in range(b.size):
            b[i] = b[i] * 0.5 + 1.0

a, b = np.zeros(2), np.zeros(2000)
region(a)
serial(b)
result = {}
for name, gap in (("back to back", None), ("after 20 us of work", "work"), ("after 1 ms idle", 1e-3),
                  ("after 10 ms idle", 1e-2)):
    times = []
    for _ in range(300 if gap in (None, "work") else 60):
        if gap == "work":
            serial(b)
        elif gap:
            time.sleep(gap)
        start = time.perf_counter()
        region(a)
        times.append(time.perf_counter() - start)
    result[name] = 1e6 * float(np.median(times))
print(json.dumps(result))
"""

STEP = r"""
import json, sys, time
import numpy as np
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.threads import get_num_threads
folder, data, lr, steps, threads = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
golden = np.load(data)
state = CheckpointState.load_checkpoint(folder + "/checkpoint")
module = Module(folder + "/training_model.onnx", state, num_threads=None if threads == "default" else int(threads))
optimizer = Optimizer(folder + "/optimizer_model.onnx", module)
optimizer.set_learning_rate(lr)
x, y = golden["x"], golden["y"]
times = []
for step in range(steps + 3):
    start = time.perf_counter()
    module(x[step % len(x)].astype(np.float32), y[step % len(y)])
    optimizer.step()
    module.lazy_reset_grad()
    times.append(time.perf_counter() - start)
print(json.dumps({"step_ms": 1e3 * float(np.median(times[3:])),
                  "threads": get_num_threads() if threads == "default" else int(threads)}))
"""


def _run(code, *argv, env=None):
    done = subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, env=env,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def regions(args):
    from odtrain.threads import SPIN_COUNT

    variants = {"omp, spinning (libgomp's default)": ("omp", {}),
                f"omp, OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT={SPIN_COUNT} (odtrain)":
                    ("omp", {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(SPIN_COUNT)}),
                "omp, OMP_WAIT_POLICY=PASSIVE, no spin": ("omp", {"OMP_WAIT_POLICY": "PASSIVE"}),
                "workqueue": ("workqueue", {})}
    results = {name: [] for name in variants}
    for _ in range(args.runs):
        for name, (layer, extra) in variants.items():
            env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
            results[name].append(_run(REGION, layer, env={**env, **extra}))
    print(f"µs per 2-thread region, medians of {args.runs} processes")
    for name, runs in results.items():
        cells = ", ".join(f"{key} {statistics.median(r[key] for r in runs):.1f}" for key in runs[0])
        print(f"  {name}: {cells}")


def neighbour(args):
    folder = Path(args.models) / args.workload
    meta = json.loads((folder / "meta.json").read_text())
    with tempfile.TemporaryDirectory() as artifacts_dir:
        from odtrain import artifacts

        artifacts.generate_artifacts(str(folder / "forward.onnx"), requires_grad=meta["requires_grad"],
                                     frozen_params=meta["frozen_params"], loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=artifacts_dir)
        step = (artifacts_dir, folder / "golden.npz", meta["adamw"]["lr"], args.steps)
        _run(STEP, *step, "default")  # compiles the kernels into the cache
        results = {}
        for _ in range(args.runs):
            for busy in (False, True):
                hog = None
                if busy:
                    command = [sys.executable, "-c", "while True: pass"]
                    if args.pinned:
                        command = ["taskset", "-c", str(max(os.sched_getaffinity(0)))] + command
                    hog = subprocess.Popen(command)
                    time.sleep(0.5)
                try:
                    for threads in ("1", "default"):
                        results.setdefault((busy, threads), []).append(_run(STEP, *step, threads))
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
    print(f"{args.workload}: ms per training step, medians of {args.runs} processes x {args.steps} steps")
    for busy in (False, True):
        one = statistics.median(r["step_ms"] for r in results[(busy, "1")])
        default = statistics.median(r["step_ms"] for r in results[(busy, "default")])
        where = "beside a busy process" + (" (pinned)" if args.pinned else "") if busy else "alone"
        print(f"  {where}: one thread {one:.1f}, default ({results[(busy, 'default')][0]['threads']} threads) "
              f"{default:.1f}: {default / one:.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    region_parser = commands.add_parser("regions")
    region_parser.add_argument("--runs", type=int, default=3)
    region_parser.set_defaults(handler=regions)
    step_parser = commands.add_parser("neighbour")
    step_parser.add_argument("--workload", default="cnn")
    step_parser.add_argument("--models", default=str(MODELS))
    step_parser.add_argument("--steps", type=int, default=20)
    step_parser.add_argument("--runs", type=int, default=3)
    step_parser.add_argument("--pinned", action="store_true", help="pin the busy process to the last core")
    step_parser.set_defaults(handler=neighbour)
    args = parser.parse_args()
    args.handler(args)


if __name__ == "__main__":
    main()
