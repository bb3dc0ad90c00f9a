"""Models that loop, exported from PyTorch as users export them, train along PyTorch's losses.

The models and goldens are tests/data/loops (benchmarks/loop_goldens.py, torch 2.13): a GRU cell and a
Mamba-style selective scan run by `scan` and exported by the dynamo exporter (a Scan; the GRU also without
the exporter's optimizer, its gates' chunks then sequence ops), the selective scan
as a scripted for loop appending to a list (a Loop over a sequence, TorchScript exporter), `torch.cond`
on the data (an If, both branches taken), and a frozen scripted loop encoder under a trainable head.
Each trains 5 SGD and 5 AdamW steps (ONNX Runtime's AdamW, the artifacts' defaults) on an MSE loss.

The losses must stay within TOLERANCE of the float64 golden. Measured here: odtrain's losses within
3.7e-8..1.4e-7 relative (PyTorch's own float32 run: 3.9e-8..1.9e-7, meta.json's float32_loss_error); a
learning rate 1% off moves them 3.9e-4..1.2e-2 (checked for each model, so the test can fail).
"""
import json

import numpy as np
import pytest

from conftest import DATA
from odtrain import artifacts
from odtrain.api import CheckpointState, Module, Optimizer

TOLERANCE = 1e-5  # relative: 50x PyTorch's float32 distance from float64, 40x below a 1% learning-rate error
MODELS = ["gru_scan", "gru_scan_unoptimized", "mamba_scan", "mamba_loop", "cond", "frozen_loop"]


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


def exports_like_onnxruntime(module, meta, golden, directory):
    """The trained model's inference export keeps its control flow, and onnxruntime gives the training
    model's outputs on the last batch."""
    onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the inference oracle (pip install .[test])")
    path = directory / "inference.onnx"
    module.export_model_for_inferencing(str(path), [meta["output"]])
    module.eval()
    _, expected = module(golden["x"][-1], golden["y"][-1])
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {meta["input"]: golden["x"][-1]})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", MODELS)
def test_a_model_that_loops_trains_along_pytorchs_losses(name, optimizer, tmp_path):
    _, meta, golden = reference(name)
    losses, module = train(name, optimizer, tmp_path / "a")
    np.testing.assert_allclose(losses, golden[f"{optimizer}_losses"], rtol=TOLERANCE)
    assert meta[optimizer]["float32_loss_error"] < TOLERANCE / 10  # the golden's float32 spread is far below
    looping = {n.op_type for n in module.graph(training=True).nodes} & {"If", "Loop", "Scan"}
    assert looping, "the control flow was unrolled or folded away"
    if optimizer == "adamw":
        exports_like_onnxruntime(module, meta, golden, tmp_path)
    off, _ = train(name, optimizer, tmp_path / "b", lr_scale=1.01)
    assert np.max(np.abs(off / golden[f"{optimizer}_losses"] - 1)) > TOLERANCE  # the bound sees a 1% error


def test_the_cond_batches_take_both_branches():
    _, _, golden = reference("cond")
    taken = {bool(x.astype(np.float64).mean() > 0) for x in golden["x"]}
    assert taken == {True, False}


@pytest.mark.parametrize("name, shape", [("loop.onnx", (4, 6, 3)), ("cond.onnx", (4, 3))])
def test_the_readmes_exports_run_as_onnxruntime_runs_them_and_train(name, shape, tmp_path):
    """README's "Exporting one from PyTorch" block, run as written by benchmarks/loop_goldens.py."""
    onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the inference oracle (pip install .[test])")
    from odtrain.inference import InferenceSession

    path = DATA / "loops" / "readme" / name
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32) + (0.5 if name == "cond.onnx" else 0)
    (expected,) = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    (got,) = InferenceSession(str(path)).run(None, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    artifacts.generate_artifacts(str(path), loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module)
    target = rng.standard_normal(expected.shape).astype(np.float32)
    losses = []
    for _ in range(3):
        losses.append(float(module(x, target)))
        opt.step()
        module.lazy_reset_grad()
    assert losses[0] == pytest.approx(float(np.mean((expected - target) ** 2)), rel=1e-5)
    assert losses[2] < losses[0]


def test_a_scripted_loop_over_rows_becomes_a_scan_whose_condition_is_an_outer_constant(tmp_path):
    """The TorchScript exporter's Loop: its first condition a Constant node and the body's condition
    Identity(that constant) read from outside. Over rows x[i] it becomes a Scan (graph/control_flow.py's
    loops_as_scans) that computes what onnxruntime computes."""
    onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the inference oracle (pip install .[test])")
    from onnx import helper

    from odtrain.graph.control_flow import loops_as_scans
    from odtrain.graph.onnx_io import graph_to_proto, load_graph
    from odtrain.inference import InferenceSession
    from test_control_flow import selective_scan

    proto = selective_scan("loop", steps=6, width=3, state=2)
    graph = proto.graph
    (go,) = [t for t in graph.initializer if t.name == "go"]
    graph.initializer.remove(go)
    graph.node.insert(0, helper.make_node("Constant", [], ["go"], value=go))
    (loop,) = [n for n in graph.node if n.op_type == "Loop"]
    (identity,) = [n for n in loop.attribute[0].g.node if n.op_type == "Identity" and n.input[0] == "cond_in"]
    identity.input[0] = "go"
    converted = loops_as_scans(load_graph(proto))
    assert [n.op_type for n in converted.nodes if n.op_type in ("Loop", "Scan")] == ["Scan"]
    x = np.random.default_rng(2).standard_normal((6, 3)).astype(np.float32)
    (expected,) = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})
    np.testing.assert_allclose(InferenceSession(graph_to_proto(converted)).run(None, {"x": x})[0], expected,
                               rtol=1e-5, atol=1e-6)
