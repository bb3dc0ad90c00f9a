"""A small CNN trained end to end, its losses compared between two machines (x86 host, aarch64).

    python check_cnn.py --write REF_DIR     # on the reference machine: model, data, losses
    python check_cnn.py --compare REF_DIR   # on the other: same model and data, losses must agree

The model: Conv(1->4, 3x3, pad 1) -> Relu -> MaxPool 2x2 (when registered) -> Flatten -> Gemm(->10),
cross-entropy, AdamW, 8 steps at batch 16 on fixed random 8x8 images. Used when tests/test_vision.py is
not there. If Conv (or another op it needs) has no rule or kernel yet, it says so and exits 0.
"""
import argparse
import json
import os
import sys

import numpy as np

STEPS, BATCH, CLASSES = 8, 16, 10
RTOL = 1e-4


def required_ops(pool: bool) -> list[str]:
    return ["Conv", "Relu", "Flatten", "Gemm"] + (["MaxPool"] if pool else [])


def missing_ops(ops) -> list[str]:
    from odtrain.graph.ops import OPS
    from odtrain.kernels import BINDINGS

    view_ops = {"Flatten", "Reshape"}  # views of their input: no kernel needed
    return [op for op in ops if ("", op) not in OPS or (("", op) not in BINDINGS and op not in view_ops)]


def build_model(pool: bool, seed: int = 0):
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(seed)
    channels, side = 4, 8
    features = channels * (side // 2 if pool else side) ** 2
    w = (rng.standard_normal((channels, 1, 3, 3)) / 3).astype(np.float32)
    b = (rng.standard_normal(channels) * 0.1).astype(np.float32)
    fw = (rng.standard_normal((CLASSES, features)) / np.sqrt(features)).astype(np.float32)
    fb = np.zeros(CLASSES, np.float32)
    nodes = [helper.make_node("Conv", ["input", "conv.weight", "conv.bias"], ["c"], kernel_shape=[3, 3],
                              pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu")]
    last = "r"
    if pool:
        nodes.append(helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"))
        last = "p"
    nodes += [helper.make_node("Flatten", [last], ["f"], axis=1, name="flatten"),
              helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["output"], transB=1, name="fc")]
    params = {"conv.weight": w, "conv.bias": b, "fc.weight": fw, "fc.bias": fb}
    graph = helper.make_graph(
        nodes, "tiny_cnn",
        [helper.make_tensor_value_info("input", 1, ["batch", 1, side, side])],
        [helper.make_tensor_value_info("output", 1, ["batch", CLASSES])],
        [numpy_helper.from_array(v, name=k) for k, v in params.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), list(params)


def train(model, params, x, y, directory) -> list[float]:
    from odtrain import artifacts
    from odtrain.api import CheckpointState, Module, Optimizer
    from odtrain.artifact_paths import ArtifactPaths

    artifacts.generate_artifacts(model, requires_grad=params, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=directory)
    paths = ArtifactPaths.of(directory)
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, paths.eval_model)
    optimizer = Optimizer(paths.optimizer_model, module)
    optimizer.set_learning_rate(1e-2)
    losses = []
    for step in range(STEPS):
        losses.append(float(module(x[step], y[step])))
        optimizer.step()
        module.lazy_reset_grad()
    module.eval()
    losses.append(float(module(x[0], y[0])))  # the eval loss after training
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="REF_DIR")
    mode.add_argument("--compare", metavar="REF_DIR")
    args = parser.parse_args()

    import onnx

    if args.write:
        pool = not missing_ops(["MaxPool"])
        missing = missing_ops(required_ops(pool))
        if missing:
            print(f"CNN check skipped: no rule or kernel yet for {missing}")
            return 0
        os.makedirs(args.write, exist_ok=True)
        model, params = build_model(pool)
        rng = np.random.default_rng(1)
        x = rng.standard_normal((STEPS, BATCH, 1, 8, 8)).astype(np.float32)
        y = rng.integers(0, CLASSES, (STEPS, BATCH)).astype(np.int64)
        onnx.save(model, os.path.join(args.write, "forward.onnx"))
        np.savez(os.path.join(args.write, "data.npz"), x=x, y=y)
        losses = train(model, params, x, y, os.path.join(args.write, "artifacts"))
        with open(os.path.join(args.write, "losses.json"), "w") as f:
            json.dump({"params": params, "losses": losses, "pool": pool}, f)
        print(f"CNN ({'with' if pool else 'without'} MaxPool) reference losses: {np.round(losses, 5).tolist()}")
        return 0

    reference = os.path.join(args.compare, "losses.json")
    if not os.path.exists(reference):
        print("CNN check skipped: no reference losses (the reference machine skipped it)")
        return 0
    with open(reference) as f:
        ref = json.load(f)
    data = np.load(os.path.join(args.compare, "data.npz"))
    model = onnx.load(os.path.join(args.compare, "forward.onnx"))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="odtrain-cnn-") as directory:
        losses = train(model, ref["params"], data["x"], data["y"], directory)
    print(f"CNN losses here:      {np.round(losses, 5).tolist()}")
    print(f"CNN reference losses: {np.round(ref['losses'], 5).tolist()}")
    worst = float(np.max(np.abs(np.array(losses) - ref["losses"]) / np.abs(ref["losses"])))
    if not np.allclose(losses, ref["losses"], rtol=RTOL, atol=0):
        print(f"CNN check FAILED: largest relative difference {worst:.2e} > {RTOL}")
        return 1
    print(f"CNN check passed: {len(losses)} losses agree within rtol {RTOL} (largest relative difference {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
