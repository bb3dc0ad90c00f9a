"""The exported inference model runs in onnxruntime and agrees with odtrain's own forward pass."""
import numpy as np
import onnx
import pytest

from odtrain import ArgumentError
from odtrain.api import CheckpointState, Module, Optimizer

onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the inference oracle (pip install .[test])")


def test_trained_mlp_exports_and_matches_onnxruntime(mlp_artifacts, mlp_reference, tmp_path):
    golden = mlp_reference[2]
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", state, mlp_artifacts / "eval_model.onnx")
    optimizer = Optimizer(mlp_artifacts / "optimizer_model.onnx", module)
    for step in range(3):
        module(golden["x"][step], golden["y"][step])
        optimizer.step()
        module.lazy_reset_grad()
    module.eval()
    _, logits = module(golden["x"][5], golden["y"][5])
    path = tmp_path / "inference.onnx"
    module.export_model_for_inferencing(path, ["output"])
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert [i.name for i in model.graph.input] == ["input"]
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (ort_logits,) = session.run(None, {"input": golden["x"][5]})
    np.testing.assert_allclose(ort_logits, logits, rtol=1e-5, atol=1e-5)
    (ort_small,) = session.run(None, {"input": golden["x"][5][:3]})  # the batch axis stays symbolic
    np.testing.assert_allclose(ort_small, logits[:3], rtol=1e-5, atol=1e-5)


def test_unknown_output_name_is_refused(mlp_artifacts, tmp_path):
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", state, mlp_artifacts / "eval_model.onnx")
    with pytest.raises(ArgumentError, match="'logits'"):
        module.export_model_for_inferencing(tmp_path / "x.onnx", ["logits"])
