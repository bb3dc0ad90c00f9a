"""Peak RSS at each stage of personalising a decoder with odtrain, one process, printed as JSON lines.

    python memory_stages.py ARTIFACT_DIR [--batch 4 --seq 128 --steps 10 --export-dtype float32 --memory-budget BYTES|auto|none]

ARTIFACT_DIR is `odtrain prepare MODEL.onnx --lora-rank 8 --lora-alpha 16 --lora-targets '*q_proj*' ...`'s
output (MODEL.onnx: e.g. a SmolLM2-135M-shaped Llama built by transformers from its config with random
weights, exported by make_models.export_torchscript). Stages: load_checkpoint, Module and Optimizer,
`--steps` training steps on random token batches, export of the inference model. Each stage's peak is
the high-water mark of RSS since the previous stage ended (Linux: /proc/self/clear_refs), with RSS after.
Mapped file pages a stage touches count in RSS (the kernel can drop them; they are not copies).

A 4-bit base at Llama-3.2-1B's shape, in bounded memory (`make_models.py --shaped llama-3.2-1b MODEL.onnx`):

    odtrain prepare MODEL.onnx -o art --lora-rank 8 --lora-alpha 16 \
        --lora-targets '*q_proj*' '*k_proj*' '*v_proj*' '*o_proj*' --frozen-dtype int4
    odtrain compile art --batch-size 1 --seq-len 256      # the kernel library: no Numba in the training process
    odtrain memory art --batch-size 1 --seq-len 256 --budget 100MB   # refused, naming the smallest arena
    python memory_stages.py art --batch 1 --seq 256 --steps 10 --export-dtype int4 --memory-budget 180867136

Without --memory-budget the Module plans as its default does (memory_budget="auto": what the machine, or a
memory cgroup, leaves the process); `--memory-budget none` plans without a cap.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np


def _mib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) // 1024


def _stage(name: str, started: float) -> None:
    print(json.dumps({"stage": name, "peak_mib": _mib("VmHWM:"), "rss_mib": _mib("VmRSS:"),
                      "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--export-dtype", choices=("float32", "int8", "int4", "bfloat16"), default="float32",
                        help="the frozen weights' type in the exported model (export_model_for_inferencing's "
                        "frozen_dtype; int8, int4 and bfloat16 keep the adapters beside the stored weights)")
    parser.add_argument("--memory-budget", type=lambda text: text if text in ("auto", "none") else int(text),
                        default=None, help="Module's memory_budget: the training arena's cap in bytes, met by "
                        "recomputing activations, 'auto', or 'none' (no cap); without it, Module's default, as a "
                        "user's script runs")
    args = parser.parse_args(argv)
    from odtrain.api import CheckpointState, Module, Optimizer

    folder = args.artifacts
    _stage("imports", time.perf_counter())
    started = time.perf_counter()
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    _stage("load_checkpoint", started)
    started = time.perf_counter()
    budget = {} if args.memory_budget is None else {"memory_budget": None if args.memory_budget == "none"
                                                     else args.memory_budget}
    module = Module(os.path.join(folder, "training_model.onnx"), state, os.path.join(folder, "eval_model.onnx"),
                    **budget)
    optimizer = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    _stage("module and optimizer", started)
    vocab = module.graph(training=False).value_types["logits"].shape[-1]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, size=(args.steps, args.batch, args.seq + 1)).astype(np.int64)
    mask = np.ones((args.batch, args.seq), np.int64)
    started = time.perf_counter()
    for step in range(args.steps):
        loss = module(ids[step, :, :-1], mask, ids[step, :, 1:])
        optimizer.step()
        module.lazy_reset_grad()
        print(json.dumps({"step": step, "loss": float(np.asarray(loss[0] if isinstance(loss, (list, tuple)) else loss))}),
              flush=True)
    _stage(f"{args.steps} training steps", started)
    print(json.dumps({"memory_budget_bytes": module.memory_budget_bytes, "arena_bytes": module.arena_bytes}), flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        module.export_model_for_inferencing(os.path.join(scratch, "inference.onnx"), ["logits"],
                                            frozen_dtype=args.export_dtype)
    _stage("export", started)


if __name__ == "__main__":
    main()
