"""The vocabulary loss fused and unfused, at SmolLM2-135M's vocabulary: arena, training peak RSS, step time.

    python vocabulary_loss.py fused|unfused [--batch 4 --seq 128 --steps 6 --state-dtype float32|int8]
                              [--train-embedding]

The model is the head of a causal LM with SmolLM2's sizes (vocabulary 49,152, hidden 576) and tied
embeddings: Gather(embedding, ids), one ReLU layer with a residual, then logits = h · embeddingᵀ, scored by
cross-entropy with the classes last. The layer trains with AdamW, the embedding too with --train-embedding
(else frozen, as under LoRA). `unfused` generates the artifacts with
graph/fusion.py's vocabulary pass left out, so the [tokens, V] logits and their gradient are arena values.
Printed as one JSON line: the training plan's arena and lower bound, the peak RSS of the training phase
alone (VmHWM reset after the artifacts are written and loaded), the AdamW state bytes, the median step, the
last loss. Run the variants alternately in fresh processes.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import onnx
from onnx import helper, numpy_helper

VOCAB, HIDDEN = 49152, 576


def head_model(seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = {"embed": (rng.standard_normal((VOCAB, HIDDEN)) * 0.02).astype(np.float32),
             "w": (rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)}
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["h"]),
             helper.make_node("MatMul", ["h", "w"], ["z"]), helper.make_node("Relu", ["z"], ["r"]),
             helper.make_node("Add", ["r", "h"], ["hidden"]),
             helper.make_node("Transpose", ["embed"], ["embed_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["hidden", "embed_t"], ["logits"])]
    graph = helper.make_graph(
        nodes, "vocabulary_head",
        [helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", "seq", VOCAB])],
        [numpy_helper.from_array(v, name=k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", choices=["fused", "unfused"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--state-dtype", default="float32", choices=["float32", "int8"])
    parser.add_argument("--train-embedding", action="store_true")
    args = parser.parse_args()

    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module, Optimizer
    from odtrain.graph import fusion

    if args.variant == "unfused":
        fusion.TRAINING_PASSES = tuple(p for p in fusion.TRAINING_PASSES if p is not fusion.vocabulary_loss_pass)
    directory = tempfile.mkdtemp(prefix="vocabulary-loss-")
    artifacts.generate_artifacts(head_model(), requires_grad=["embed", "w"] if args.train_embedding else ["w"], loss=artifacts.LossType.CrossEntropyLoss,
                                 class_axis=-1, ignore_index=-100, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=directory)
    state = CheckpointState.load_checkpoint(f"{directory}/checkpoint")
    module = Module(f"{directory}/training_model.onnx", state)
    optimizer = Optimizer(f"{directory}/optimizer_model.onnx", module, state_dtype=args.state_dtype)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, (args.batch, args.seq + 1)).astype(np.int64)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak from here on: training alone
    times, loss = [], None
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = float(module(tokens[:, :-1], tokens[:, 1:]))
        optimizer.step()
        module.lazy_reset_grad()
        times.append(time.perf_counter() - start)
    step = module.bound_graph_at(args.batch, sequence_length=args.seq)
    print(json.dumps({"variant": args.variant, "state_dtype": args.state_dtype, "train_embedding": args.train_embedding, "arena_bytes": step.plan.arena_bytes,
                      "lower_bound": step.plan.lower_bound, "training_peak_rss_mib": round(peak_rss_mib(), 1),
                      "optimizer_state_bytes": sum(state.buffer_bytes().optimizer_state_bytes.values()),
                      "median_step_s": round(float(np.median(times[1:] or times)), 4), "last_loss": loss}))


if __name__ == "__main__":
    main()
