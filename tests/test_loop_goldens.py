"""Models that loop, exported from PyTorch as users export them, train along PyTorch's losses.

The models and goldens are tests/data/loops (benchmarks/loop_goldens.py, torch 2.13): a GRU cell and a
Mamba-style selective scan run by `scan` and exported by the dynamo exporter (a Scan), the selective scan
as a scripted for loop appending to a list (a Loop over a sequence, TorchScript exporter), `torch.cond`
on the data (an If, both branches taken), and a frozen scripted loop encoder under a trainable head.
Each trains 5 SGD and 5 AdamW steps (ONNX Runtime's AdamW, the artifacts' defaults) on an MSE loss.

The losses must stay within TOLERANCE of the float64 golden: PyTorch's own float32 run lands at most
1.9e-7 relative from it (meta.json's float32_loss_error); a learning rate 1% off moves the fifth loss by
more than TOLERANCE (checked below for each model, so the test can fail).
"""
import json

import numpy as np
import pytest

from conftest import DATA
from odtrain import artifacts
from odtrain.api import CheckpointState, Module, Optimizer

TOLERANCE = 1e-4  # relative; the assignment's bound, 500x PyTorch's float32 distance from float64
MODELS = ["gru_scan", "mamba_scan", "mamba_loop", "cond", "frozen_loop"]


def reference(name: str):
    folder = DATA / "loops" / name
    return folder / "forward.onnx", json.loads((folder / "meta.json").read_text()), np.load(folder / "golden.npz")


def train(name: str, optimizer: str, directory, lr_scale: float = 1.0):
    """(losses of the golden's steps, module) of odtrain trained on the golden's batches."""
    path, meta, golden = reference(name)
    kind = artifacts.OptimType.SGD if optimizer == "sgd" else artifacts.OptimType.AdamW
    artifacts.generate_artifacts(str(path), requires_grad=meta["requires_grad"], frozen_params=meta["frozen_params"],
                                 loss=artifacts.LossType.MSELoss, optimizer=kind, artifact_directory=directory,
                                 additional_output_names=[meta["output"]])
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")
    opt = Optimizer(directory / "optimizer_model.onnx", module)
    opt.set_learning_rate(meta[optimizer]["lr"] * lr_scale)
    module.train()
    losses = []
    for x, y in zip(golden["x"], golden["y"]):
        losses.append(float(module(x, y)[0]))
        opt.step()
        module.lazy_reset_grad()
    return np.array(losses), module


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", MODELS)
def test_a_model_that_loops_trains_along_pytorchs_losses(name, optimizer, tmp_path):
    _, meta, golden = reference(name)
    losses, _ = train(name, optimizer, tmp_path / "a")
    np.testing.assert_allclose(losses, golden[f"{optimizer}_losses"], rtol=TOLERANCE)
    assert meta[optimizer]["float32_loss_error"] < TOLERANCE / 100  # the golden's float32 spread is far below
    off, _ = train(name, optimizer, tmp_path / "b", lr_scale=1.01)
    assert np.max(np.abs(off / golden[f"{optimizer}_losses"] - 1)) > TOLERANCE  # the bound sees a 1% error


def test_the_cond_batches_take_both_branches():
    _, _, golden = reference("cond")
    taken = {bool(x.astype(np.float64).mean() > 0) for x in golden["x"]}
    assert taken == {True, False}
