"""Full fine-tuning against LoRA on a Llama-style decoder: step time and peak RSS, odtrain beside PyTorch.

One measurement per process (fresh), printed as one JSON line:

    python lora_step.py odtrain full|lora MODEL.onnx [--batch 8 --seq 128 --steps 20]   # odtrain's venv
    python lora_step.py torch full|lora [--batch 8 --seq 128 --steps 20]                # torch + transformers

MODEL.onnx is make_models.py --benchmark's export (BENCHMARK_SIZES: 4 layers, hidden 256); PyTorch builds
the same model from the same config and seed. Both train with AdamW on random token batches, the loss
cross-entropy on logits [batch, seq, vocab]. LoRA: rank 8, alpha 16 on every q/k/v/o and MLP projection;
PyTorch adds the adapters by forward hooks (as make_models.py's golden does), with the weights frozen.
Reported: the median step (forward, backward, optimizer) after `--warmup` steps, and the process's peak RSS.
Run the variants alternately (A, B, A, B...) and take medians: the machine's load moves single figures.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import numpy as np

LORA_TARGETS = ["*proj.weight"]
RANK, ALPHA, LR = 8, 16.0, 1e-3


def batches(vocab, batch, seq, count, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(count, batch, seq + 1)).astype(np.int64)
    return ids[..., :-1], ids[..., 1:]


def run_odtrain(kind, model, batch, seq, steps, warmup, directory, targets=LORA_TARGETS, frozen_dtype="float32"):
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module, Optimizer

    lora = artifacts.LoraConfig(RANK, ALPHA, targets) if kind == "lora" else None
    artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, class_axis=-1, ignore_index=-100,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=directory, lora=lora,
                                 frozen_dtype=frozen_dtype)
    state = CheckpointState.load_checkpoint(f"{directory}/checkpoint")
    module = Module(f"{directory}/training_model.onnx", state, f"{directory}/eval_model.onnx")
    optimizer = Optimizer(f"{directory}/optimizer_model.onnx", module)
    optimizer.set_learning_rate(LR)
    vocab = module.graph(training=False).value_types["logits"].shape[-1]
    inputs, labels = batches(vocab, batch, seq, steps + warmup)
    mask = np.ones_like(inputs[0])
    times = []
    for step in range(steps + warmup):
        start = time.perf_counter()
        module(inputs[step], mask, labels[step])
        optimizer.step()
        module.lazy_reset_grad()
        times.append(time.perf_counter() - start)
    return times[warmup:], module.get_parameters_size(trainable_only=True)


def run_torch(kind, batch, seq, steps, warmup, shape=None, targets=LORA_TARGETS):
    import pathlib

    import torch

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import make_models

    family, sizes = make_models.SHAPED[shape] if shape else ("llama", make_models.BENCHMARK_SIZES)
    model = make_models.build(family, sizes=sizes).train()
    if kind == "lora":
        for p in model.parameters():
            p.requires_grad_(False)
        saved = make_models.LORA
        make_models.LORA = {**saved, "rank": RANK, "alpha": ALPHA, "target_params": targets}
        trainable = list(make_models.add_lora(model, seed=0).values())
        make_models.LORA = saved
    else:
        trainable = list(model.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=LR, eps=1e-6, weight_decay=0.0)
    inputs, labels = (torch.from_numpy(a) for a in batches(model.config.vocab_size, batch, seq, steps + warmup))
    mask = torch.ones_like(inputs[0])
    times = []
    for step in range(steps + warmup):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = make_models.sequence_loss(model(inputs[step], mask), labels[step])
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times[warmup:], sum(p.numel() for p in trainable)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("system", choices=("odtrain", "torch"))
    parser.add_argument("kind", choices=("full", "lora"))
    parser.add_argument("model", nargs="?", help="the exported model (odtrain)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--shape", choices=("smollm2-135m", "qwen2-0.5b", "llama-3.2-1b"),
                        help="torch: build a model of this released model's shape (make_models.SHAPED) instead of "
                        "BENCHMARK_SIZES' Llama")
    parser.add_argument("--lora-targets", nargs="+", default=LORA_TARGETS, metavar="GLOB",
                        help=f"the weights LoRA adapts (default: {' '.join(LORA_TARGETS)}; the issue's runs: "
                        "'*q_proj*' '*k_proj*' '*v_proj*' '*o_proj*')")
    parser.add_argument("--frozen-dtype", choices=("float32", "bfloat16", "int8"), default="float32",
                        help="odtrain: the type the frozen weights are stored and held in (generate_artifacts)")
    parser.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: PyTorch's own choice; "
                        "odtrain's threads follow ODTRAIN_NUM_THREADS)")
    args = parser.parse_args(argv)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    if args.system == "odtrain":
        import tempfile

        with tempfile.TemporaryDirectory() as directory:
            times, trainable = run_odtrain(args.kind, args.model, args.batch, args.seq, args.steps, args.warmup,
                                           directory, args.lora_targets, args.frozen_dtype)
    else:
        times, trainable = run_torch(args.kind, args.batch, args.seq, args.steps, args.warmup, args.shape,
                                     args.lora_targets)
    print(json.dumps({"system": args.system, "kind": args.kind, "torch_threads": args.torch_threads,
                      "trainable": int(trainable),
                      "step_ms": 1000 * float(np.median(times)),
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
