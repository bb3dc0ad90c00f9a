"""Which calls go parallel: the (kernel, parts) of every call that the steps of the reference workloads bind,
at given thread counts, one line a call: workload, threads, kernel, parts (1 for a serial kernel). Two runs
of it, before and after a change to the kernels' twins or their chooser, must print the same lines.

    python benchmarks/parallel_calls.py [--models /work/shared/models] [--threads 1 2] > calls.txt

Each workload's artifacts (AdamW, CrossEntropy, as benchmarks/compare.py prepares them) are generated into a
temporary folder; its training, optimizer and eval steps are recorded at its batch size, nothing runs.
"""
from __future__ import annotations

import argparse
import inspect
import json
import tempfile
from pathlib import Path

import numpy as np

WORKLOADS = ("mlp", "cnn", "transformer", "mobilenetv2_personalize", "mobilenetv2_full")


def parts_of(kernel, args) -> int:
    """The parts a call runs in: its bounds' count (a twin's `bounds`, `vocabulary` or `parts` argument), 1
    for a serial kernel."""
    function = getattr(kernel, "py_func", kernel)
    for name, value in zip(inspect.signature(function).parameters, args):
        if name in ("bounds", "vocabulary") and isinstance(value, np.ndarray):
            return int(value.size - 1)
        if name == "parts" and isinstance(value, int):
            return value
    return 1


def recorded(folder: Path, thread_counts) -> dict:
    from odtrain import artifacts, threads
    from odtrain.trial_steps import run_steps
    from odtrain.executor import record_calls

    meta = json.loads((folder / "meta.json").read_text())
    found = {}
    with tempfile.TemporaryDirectory(prefix="odtrain-calls-") as out:
        artifacts.generate_artifacts(str(folder / "forward.onnx"), requires_grad=meta["requires_grad"],
                                     frozen_params=meta["frozen_params"], loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=out)
        shapes = {meta["input_name"]: meta["input_shape"]}
        for count in thread_counts:
            with record_calls() as calls, threads.process_default(count):
                run_steps(out, int(meta["input_shape"][0]), shapes)
            found[str(count)] = [[getattr(getattr(k, "py_func", k), "__qualname__", repr(k)), parts_of(k, a)]
                                 for k, a in calls]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="/work/shared/models")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    args = parser.parse_args()
    for name in args.workloads:
        for count, calls in recorded(Path(args.models) / name, args.threads).items():
            for kernel, parts in calls:
                print(name, count, kernel, parts)


if __name__ == "__main__":
    main()
