"""The odtrain Flower App on Flower's deployment runtime: a SuperLink and three SuperNodes as real
subprocesses on 127.0.0.1 (insecure, free ports), two FedAvg rounds driven by `flwr run`.

Skipped when Flower is not installed (`pip install "odtrain[flower]"`); the simulation test also needs
`flwr[simulation]`. Each run is bounded by timeouts and every process it started is stopped, even on failure.
"""
import importlib.util
import json
import os

import numpy as np
import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install "odtrain[flower]"')

from odtrain import federated as fl  # noqa: E402
from odtrain.federated import demo as federated  # noqa: E402
from odtrain.federated.flower import runner  # noqa: E402

SETTINGS = dict(clients=3, rounds=2, local_epochs=1, batch_size=32, learning_rate=1e-2, alpha=0.5, seed=0,
                clip_norm=None, noise_multiplier=0.0)


def run_config(artifact_dir, output_dir):
    return {"artifact-dir": str(artifact_dir), "output-dir": str(output_dir), "num-server-rounds": 2,
            "local-epochs": 1, "min-nodes": 3}


def test_deployment_two_rounds_on_loopback(tmp_path):
    artifact_dir = federated.prepare(str(tmp_path), seed=0)
    output_dir = tmp_path / "global"
    app = runner.write_app(str(tmp_path / "app"), run_config(artifact_dir, output_dir))
    federation = runner.LocalFederation(str(tmp_path / "flower"), supernodes=3, startup_timeout=60)
    try:
        with federation:
            assert federation.address.startswith("127.0.0.1:")
            assert len(federation.processes) == 4 and all(p.poll() is None for _, p in federation.processes)
            completed = federation.run_app(app, timeout=300)
            assert completed.returncode == 0, federation.tail("flwr-run", 40)
    finally:
        federation.stop()
        assert all(p.poll() is not None for _, p in federation.processes)
        assert federation.marked_pids() == []

    result = json.loads((output_dir / "rounds.json").read_text())
    rounds = result["rounds"]
    assert result["finished"] and [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[-1]["loss"] < rounds[0]["loss"] and rounds[-1]["accuracy"] > rounds[0]["accuracy"] + 0.2, rounds

    # The aggregated checkpoint holds the global model the server evaluated last, and so does inference.onnx.
    from odtrain.api import CheckpointState, Module
    from odtrain.inference import InferenceSession

    state = CheckpointState.load_checkpoint(result["checkpoint"])
    module = Module(os.path.join(artifact_dir, "training_model.onnx"), state,
                    os.path.join(artifact_dir, "eval_model.onnx"))
    _, test_x, _, test_y = federated.digits_split(0)
    assert fl.evaluate(module, test_x, test_y)["loss"] == pytest.approx(rounds[-1]["loss"], rel=1e-6)
    (logits,) = InferenceSession(result["inference_model"]).run(["output"], {"input": test_x})
    assert float((logits.argmax(axis=1) == test_y).mean()) == pytest.approx(rounds[-1]["accuracy"])

    # Same arithmetic as the in-process engine (Flower averages float32 parameters, odtrain.federated float64 differences).
    inprocess = federated.run_inprocess(artifact_dir, str(tmp_path / "inprocess"), out=lambda line: None, **SETTINGS)
    np.testing.assert_allclose([r["loss"] for r in rounds], [r["loss"] for r in inprocess["rounds"]], rtol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason='the simulation runtime needs flwr[simulation]: pip install "flwr[simulation]>=1.41,<1.42"')
def test_simulation_engine_runs_the_same_rounds(tmp_path):
    lines = []
    result = federated.run(engine="simulation", directory=str(tmp_path), timeout=300, out=lines.append,
                           **{k: v for k, v in SETTINGS.items()})
    assert result["engine"] == "simulation" and [r["round"] for r in result["rounds"]] == [0, 1, 2]
    assert sum(line.startswith("round ") for line in lines) == 3
    assert result["rounds"][-1]["loss"] < result["rounds"][0]["loss"]
