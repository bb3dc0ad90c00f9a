"""Gradient clipping by the global norm (max_grad_norm; graph/optimizers.py, odtrain/optimizer_update.py).

Oracle: a linear model under MSE written out in float64 here, its gradients by hand, the clipping rule of
torch.nn.utils.clip_grad_norm_ (scale by c / (norm + 1e-6) when below 1) and the updates of the optimizer
model's docstring. The same runs without clipping, and with a 1% larger norm, land elsewhere.
"""
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper

from odtrain import artifacts, onnxblock
from odtrain.api import CheckpointState, Module, Optimizer
from odtrain.graph.errors import ArgumentError, ModelError
from oracles import make_model

IN, OUT, BATCH, STEPS, LR = 12, 5, 16, 6, 0.05
# float32 training against the float64 oracle over STEPS steps: the largest relative difference of a
# parameter measured 3.5e-7 (SGD) and 1.0e-6 (AdamW). Against the oracle without clipping: 3.6 and 0.25; with a
# 1% larger norm (SGD) or learning rate (AdamW, whose update hardly depends on the gradients' scale): 0.022 and 0.21.
TOLERANCE = 2e-5


def linear_model():
    rng = np.random.default_rng(7)
    params = {"W": (rng.standard_normal((IN, OUT)) * 0.5).astype(np.float32),
              "b": (rng.standard_normal(OUT) * 0.1).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])]
    model = make_model(nodes, params, inputs=[("x", np.float32, ["batch", IN])],
                       outputs=[("y", np.float32, ["batch", OUT])])
    x = rng.standard_normal((STEPS, BATCH, IN)).astype(np.float32)
    t = (rng.standard_normal((STEPS, BATCH, OUT)) * 3).astype(np.float32)
    return model, params, x, t


def oracle(params, x, t, kind: str, max_norm: float | None, lr: float = LR):
    """Parameters after the steps, in float64."""
    w, b = params["W"].astype(np.float64), params["b"].astype(np.float64)
    m = {"W": np.zeros_like(w), "b": np.zeros_like(b)}
    v = {"W": np.zeros_like(w), "b": np.zeros_like(b)}
    beta1, beta2, eps = 0.9, 0.999, 1e-6
    for step in range(1, len(x) + 1):
        xs, ts = x[step - 1].astype(np.float64), t[step - 1].astype(np.float64)
        dy = 2 * (xs @ w + b - ts) / ts.size
        grads = {"W": xs.T @ dy, "b": dy.sum(axis=0)}
        if max_norm is not None:
            norm = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
            factor = min(1.0, max_norm / (norm + 1e-6))
            grads = {k: g * factor for k, g in grads.items()}
        values = {"W": w, "b": b}
        for name, g in grads.items():
            if kind == "sgd":
                values[name] = values[name] - lr * g
            else:
                m[name] = beta1 * m[name] + (1 - beta1) * g
                v[name] = beta2 * v[name] + (1 - beta2) * g * g
                size = lr * np.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
                values[name] = values[name] - size * m[name] / (np.sqrt(v[name]) + eps)
        w, b = values["W"], values["b"]
    return {"W": w, "b": b}


def trained(directory, x, t):
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state)
    optimizer = Optimizer(directory / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(LR)
    norms = []
    for step in range(len(x)):
        module(x[step], t[step])
        optimizer.step()
        norms.append(optimizer.grad_norm)
        module.lazy_reset_grad()
    return {name: state.parameters[name].data.astype(np.float64) for name in ("W", "b")}, norms, optimizer


def generated(tmp_path, name, optimizer, **options):
    model, params, x, t = linear_model()
    directory = tmp_path / name
    artifacts.generate_artifacts(model, requires_grad=["W", "b"], loss=artifacts.LossType.MSELoss,
                                 optimizer=optimizer, artifact_directory=directory, **options)
    return directory, params, x, t


def largest_difference(result, expected) -> float:
    return max(float(np.max(np.abs(result[k] - expected[k]) / (np.abs(expected[k]) + 1e-3))) for k in expected)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_clipping_scales_every_gradient_by_the_global_norm_before_the_update(tmp_path, kind):
    optimizer = artifacts.OptimType.SGD if kind == "sgd" else artifacts.OptimType.AdamW
    max_norm = 1.5
    directory, params, x, t = generated(tmp_path, "clipped", optimizer, max_grad_norm=max_norm)
    result, norms, opt = trained(directory, x, t)
    assert opt.max_grad_norm == max_norm
    assert sum(norm > max_norm for norm in norms) >= STEPS // 2, norms  # the rule is exercised, not bypassed
    assert largest_difference(result, oracle(params, x, t, kind, max_norm)) < TOLERANCE
    # the oracle tells the clipping apart: unclipped, and clipped 1% wider (SGD) or at a 1% larger learning rate
    # (AdamW), land far outside the tolerance
    assert largest_difference(result, oracle(params, x, t, kind, None)) > 100 * TOLERANCE
    mutant = oracle(params, x, t, kind, max_norm * 1.01) if kind == "sgd" else oracle(params, x, t, kind, max_norm,
                                                                                      lr=LR * 1.01)
    assert largest_difference(result, mutant) > 100 * TOLERANCE


def test_a_norm_above_every_gradient_leaves_the_run_bit_for_bit(tmp_path):
    clipped, _, x, t = generated(tmp_path, "wide", artifacts.OptimType.AdamW, max_grad_norm=1e6)
    plain, _, _, _ = generated(tmp_path, "plain", artifacts.OptimType.AdamW)
    (result, norms, _), (expected, none, _) = trained(clipped, x, t), trained(plain, x, t)
    assert all(0 < norm < 1e6 for norm in norms) and none == [None] * STEPS
    for name in expected:
        np.testing.assert_array_equal(result[name], expected[name])


def test_onnxblock_clip_grad_writes_the_same_optimizer_model(tmp_path):
    """ONNX Runtime's spelling, onnxblock.optim.AdamW(clip_grad=ClipGradNorm(c)), gives what max_grad_norm does."""
    by_block, _, _, _ = generated(tmp_path, "block", onnxblock.optim.AdamW(clip_grad=onnxblock.optim.ClipGradNorm(2.0)))
    by_keyword, _, _, _ = generated(tmp_path, "keyword", artifacts.OptimType.AdamW, max_grad_norm=2.0)
    read = [onnx.load(str(d / "optimizer_model.onnx")).graph.node[0] for d in (by_block, by_keyword)]
    assert [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in read][0]["max_grad_norm"] == 2.0
    assert read[0].attribute == read[1].attribute
    with pytest.raises(ArgumentError, match="disagree"):
        generated(tmp_path, "both", onnxblock.optim.AdamW(clip_grad=onnxblock.optim.ClipGradNorm(2.0)), max_grad_norm=3)
    with pytest.raises(ArgumentError, match="clip_grad must be an onnxblock.optim.ClipGradNorm"):
        onnxblock.optim.AdamW(clip_grad=2.0)
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ArgumentError, match="max_grad_norm must be a positive number"):
            generated(tmp_path, "bad", artifacts.OptimType.SGD, max_grad_norm=bad)


def test_clipping_cannot_be_fused_with_the_backward_pass_and_a_damaged_norm_is_refused(tmp_path):
    directory, _, _, _ = generated(tmp_path, "clipped", artifacts.OptimType.AdamW, max_grad_norm=1.0)
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state)
    with pytest.raises(ArgumentError, match="fuse_with_backward=True cannot apply it"):
        Optimizer(directory / "optimizer_model.onnx", module, fuse_with_backward=True)
    model = onnx.load(str(directory / "optimizer_model.onnx"))
    for attribute in model.graph.node[0].attribute:
        if attribute.name == "max_grad_norm":
            attribute.f = -2.0
    damaged = tmp_path / "damaged.onnx"
    onnx.save(model, str(damaged))
    with pytest.raises(ModelError, match=r"damaged.onnx'.*'max_grad_norm' is -2.0, not a positive number"):
        Optimizer(damaged, module)


def test_prepare_takes_max_grad_norm(tmp_path):
    model, _, _, _ = linear_model()
    path = tmp_path / "linear.onnx"
    onnx.save(model, str(path))
    done = subprocess.run([sys.executable, "-m", "odtrain", "prepare", str(path), "-o", str(tmp_path / "art"),
                           "--loss", "mse", "--max-grad-norm", "0.5", "--json"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["max_grad_norm"] == 0.5
    state = CheckpointState.load_checkpoint(tmp_path / "art" / "checkpoint")
    module = Module(tmp_path / "art" / "training_model.onnx", state)
    assert Optimizer(tmp_path / "art" / "optimizer_model.onnx", module).max_grad_norm == 0.5
    refused = subprocess.run([sys.executable, "-m", "odtrain", "prepare", str(path), "-o", str(tmp_path / "bad"),
                              "--loss", "mse", "--max-grad-norm", "-1"], capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "max_grad_norm must be a positive number" in refused.stderr


def test_the_norm_is_summed_a_block_at_a_time_over_the_whole_buffer(monkeypatch):
    from odtrain import optimizer_update

    grads = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    exact = float(np.sqrt(np.sum(grads.astype(np.float64) ** 2)))
    monkeypatch.setattr(optimizer_update, "CLIP_BLOCK", 7)  # 143 blocks, the last one short
    assert optimizer_update.gradient_norm(grads) == pytest.approx(exact, rel=1e-12)
    clipped = grads.copy()
    assert optimizer_update.clip_gradients(clipped, exact / 4) == pytest.approx(exact, rel=1e-12)
    np.testing.assert_allclose(clipped, grads * np.float32(exact / 4 / (exact + 1e-6)), rtol=1e-7)
    unclipped = grads.copy()
    optimizer_update.clip_gradients(unclipped, exact * 2)
    np.testing.assert_array_equal(unclipped, grads)
