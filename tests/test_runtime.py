"""The process floor: `import odtrain` is cheap, the runtime loads without scipy.linalg's package, saved models
load without inference."""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper

from odtrain.graph import onnx_io
from oracles import make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUNTIME_PROBE = r"""
import json, sys
import numpy as np
import odtrain.jit
odtrain.jit.load()
before = "scipy.linalg" in sys.modules
from odtrain.api import CheckpointState, Module  # a Gemm through BLAS, after the runtime loaded
from odtrain import artifacts
import onnx
from onnx import helper, TensorProto
w = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                          [onnx.numpy_helper.from_array(w, "w")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
artifacts.generate_artifacts(model, requires_grad=["w"], loss=artifacts.LossType.MSELoss,
                             artifact_directory=sys.argv[1])
module = Module(sys.argv[1] + "/training_model.onnx", CheckpointState.load_checkpoint(sys.argv[1] + "/checkpoint"),
                sys.argv[1] + "/eval_model.onnx")
module.eval()
x = np.ones((2, 3), np.float32)
out = module(x, np.zeros((2, 4), np.float32))
after_step = "scipy.linalg" in sys.modules
import scipy.linalg
print(json.dumps({"package_before": before, "package_after_step": after_step,
                  "attached": scipy.linalg.cython_blas is sys.modules["scipy.linalg.cython_blas"],
                  "solve": scipy.linalg.solve([[2.0]], [1.0]).tolist(),
                  "loss": float(np.asarray(out).ravel()[0]), "expected": float(((x @ w) ** 2).mean())}))
"""


def test_runtime_loads_blas_without_scipy_linalg_and_scipy_linalg_still_imports(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", RUNTIME_PROBE, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["package_before"] is False and result["package_after_step"] is False
    assert result["attached"] is True and result["solve"] == [0.5]
    np.testing.assert_allclose(result["loss"], result["expected"], rtol=1e-6)


def test_saved_models_carry_inferred_types_and_load_without_inference(tmp_path, monkeypatch):
    model = make_model([helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1),
                        helper.make_node("Relu", ["h"], ["r"]), helper.make_node("Softmax", ["r"], ["y"], axis=-1)],
                       {"w": np.ones((5, 3), np.float32), "b": np.zeros(5, np.float32)},
                       inputs=[("x", np.float32, ["batch", 3])])
    inferred = onnx_io.graph_from_proto(model)
    path = tmp_path / "model.onnx"
    onnx_io.save_graph(inferred, path)
    saved = onnx.load(str(path))
    assert {p.key: p.value for p in saved.metadata_props}[onnx_io.SHAPES_INFERRED] == onnx.__version__

    calls = []
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", lambda proto, *a, **k: calls.append(proto) or proto)
    loaded = onnx_io.load_graph(path)
    assert calls == []
    for name in ("h", "r", "y"):
        assert loaded.value_types[name] == inferred.value_types[name], name
    onnx_io.graph_from_proto(model)  # a model from elsewhere is still inferred
    assert len(calls) == 1


IMPORT_PROBE = r"""
import json, sys
heavy = lambda: sorted({m.split(".")[0] for m in sys.modules} & {"numpy", "numba", "onnx", "scipy"})
import odtrain
after_import = heavy()
from odtrain import InferenceSession
import odtrain.inference
print(json.dumps({"after_import": after_import, "after_name": heavy(), "listed": "InferenceSession" in dir(odtrain),
                  "same": InferenceSession is odtrain.inference.InferenceSession}))
"""


def test_import_odtrain_is_cheap_and_inference_session_is_top_level():
    """`import odtrain` imports none of numpy, Numba, onnx, scipy; `from odtrain import InferenceSession`
    (onnxruntime's name) adds numpy only, and is odtrain.inference's class."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"after_import": [], "after_name": ["numpy"], "listed": True, "same": True}


def test_inference_session_runs_a_model(tmp_path):
    import odtrain

    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    path = tmp_path / "m.onnx"
    onnx.save(make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"w": w}, inputs=[("x", np.float32, ["batch", 3])]),
              str(path))
    x = np.ones((2, 3), np.float32)
    (y,) = odtrain.InferenceSession(str(path)).run(None, {"x": x})
    np.testing.assert_allclose(y, x @ w, rtol=1e-6)
    with pytest.raises(AttributeError, match="no attribute 'InferenceSessions'"):
        odtrain.InferenceSessions
