"""The steps of tests/test_device_route.py, importable where the compiler is not (its device child process):
numpy and odtrain's API only."""
import os

import numpy as np

from odtrain.api import CheckpointState, Module, Optimizer


def feeds(kind: str, batch: int, length, rng) -> list:
    if kind == "mlp":
        return [rng.standard_normal((batch, 784)).astype(np.float32), rng.integers(0, 10, batch).astype(np.int64)]
    ids = rng.integers(0, 256, (batch, length)).astype(np.int64)
    return [ids, np.ones((batch, length), np.int64), np.roll(ids, -1, axis=1)]


def steps(folder, kind: str, shapes, threads: int) -> list:
    """At each (batch, sequence length): a training step, an optimizer step and an eval step from the
    checkpoint, with each step's calls counted by where they ran. Returns, per shape, the two losses as
    hex floats, the trained weights' bytes' digest, and the calls left to the JIT."""
    import hashlib

    results = []
    for batch, length in shapes:
        state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
        module = Module(os.path.join(folder, "training_model.onnx"), state, os.path.join(folder, "eval_model.onnx"),
                        num_threads=threads)
        optimizer = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
        inputs = feeds(kind, batch, length, np.random.default_rng(batch * 1000 + (length or 0)))
        train = float(module(*inputs))
        optimizer.step()
        module.lazy_reset_grad()
        module.eval()
        evaluated = module(*inputs)
        evaluated = float(evaluated[0] if isinstance(evaluated, (list, tuple)) else evaluated)
        plans = list(module._train.plans.values()) + list(module._eval.plans.values())
        jit = sum(plan.program.jit_calls for plan in plans if plan.program is not None)
        results.append({"shape": [batch, length], "train": train.hex(), "eval": evaluated.hex(),
                        "weights": hashlib.sha256(state._store.flat.tobytes()).hexdigest(), "jit": jit,
                        "library": module.kernel_library is not None})
    return results
