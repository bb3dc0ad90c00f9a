"""Federated averaging on flat buffers (odtrain.federated) and the in-process `odtrain federated` engine; no Flower."""
import json
import subprocess
import sys

import numpy as np
import pytest

from odtrain import federated as fl
from odtrain.federated import demo as federated
from odtrain.graph.errors import ArgumentError


@pytest.fixture(scope="module")
def digits_artifacts(tmp_path_factory):
    return federated.prepare(str(tmp_path_factory.mktemp("federated")), seed=0)


@pytest.fixture
def trainer(digits_artifacts):
    return fl.open_artifacts(digits_artifacts)


def float32_differences(count, size=257, seed=0):
    rng = np.random.default_rng(seed)
    reference = rng.normal(size=size).astype(np.float32)
    return reference, [fl.difference(reference + rng.normal(0, 0.1, size).astype(np.float32), reference)
                       for _ in range(count)]


def test_fedavg_of_identical_differences_is_the_identity():
    reference, (delta,) = float32_differences(1)
    for weights in ([1, 1, 1], [5, 17, 300], [0, 2, 0]):
        mean = fl.fedavg([delta] * 3, weights)
        assert np.array_equal(mean, delta)
        assert np.array_equal(fl.apply_difference(reference, mean), fl.apply_difference(reference, delta))


def test_fedavg_honours_the_example_counts():
    _, (a, b, c) = float32_differences(3)
    np.testing.assert_allclose(fl.fedavg([a, b], [1, 3]), (a + 3 * b) / 4, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(fl.fedavg([a, b, c], [10, 0, 30]), (a + 3 * c) / 4, rtol=1e-12, atol=1e-15)
    assert np.array_equal(fl.fedavg([a, b], [2, 2]), fl.fedavg([a, b], [7, 7]))
    for weights in ([0, 0], [1, -1], [1, np.nan], [1]):
        with pytest.raises(ArgumentError):
            fl.fedavg([a, b], weights)
    with pytest.raises(ArgumentError):
        fl.fedavg([a, b[:-1]], [1, 1])


def test_a_difference_applied_to_the_reference_reproduces_the_client_bit_for_bit(trainer):
    x, y = federated.digits_partition(0, 3)
    reference = fl.get_parameters(trainer.module)
    delta, count, metrics = fl.train_local(trainer.module, trainer.optimizer, x, y, epochs=2, batch_size=32, seed=3)
    trained = fl.get_parameters(trainer.module)
    assert count == len(y) and metrics["steps"] == 2 * -(-len(y) // 32) and metrics["clipped"] == 0
    assert delta.dtype == np.float64 and np.abs(delta).max() > 1e-3
    rebuilt = fl.apply_difference(reference, delta)
    assert rebuilt.dtype == np.float32 and np.array_equal(rebuilt.view(np.uint32), trained.view(np.uint32))
    assert np.array_equal(fl.difference(reference, reference), np.zeros_like(delta))


def test_local_training_is_seeded_and_starts_from_fresh_optimizer_state(trainer):
    x, y = federated.digits_partition(1, 3)
    start = fl.get_parameters(trainer.module)
    runs = []
    for seed in (5, 5, 6):
        fl.set_parameters(trainer.module, start)
        runs.append(fl.train_local(trainer.module, trainer.optimizer, x, y, 1, 32, seed)[0])
    assert np.array_equal(runs[0], runs[1]) and not np.array_equal(runs[0], runs[2])


def test_clipping_bounds_the_norm():
    rng = np.random.default_rng(1)
    big, small = rng.normal(size=1000) * 10, rng.normal(size=1000) * 1e-3
    clipped, norm = fl.clip_update(big, 1.5)
    assert norm == pytest.approx(np.linalg.norm(big)) and np.linalg.norm(clipped) <= 1.5 * (1 + 1e-12)
    np.testing.assert_allclose(clipped / np.linalg.norm(clipped), big / np.linalg.norm(big))
    kept, _ = fl.clip_update(small, 1.5)
    assert np.array_equal(kept, small)
    private, info = fl.privatize(big, clip_norm=2.0)
    assert info["clipped"] == 1 and np.linalg.norm(private) <= 2.0 * (1 + 1e-12)
    with pytest.raises(ArgumentError):
        fl.clip_update(big, 0.0)


def test_noise_is_seeded_and_scaled():
    delta = np.zeros(20000)
    first, _ = fl.privatize(delta, clip_norm=1.0, noise_multiplier=0.5, seed=7)
    again, _ = fl.privatize(delta, clip_norm=1.0, noise_multiplier=0.5, seed=7)
    other, _ = fl.privatize(delta, clip_norm=1.0, noise_multiplier=0.5, seed=8)
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    assert np.std(first) == pytest.approx(0.5, rel=0.03) and abs(np.mean(first)) < 0.02
    assert np.array_equal(fl.privatize(delta)[0], delta)  # off by default
    with pytest.raises(ArgumentError):
        fl.privatize(delta, noise_multiplier=1.0)  # noise needs a clipping norm


def test_private_local_training_repeats_with_the_same_seed(trainer):
    x, y = federated.digits_partition(2, 3)
    start = fl.get_parameters(trainer.module)
    deltas = []
    for _ in range(2):
        fl.set_parameters(trainer.module, start)
        delta, _, metrics = fl.train_local(trainer.module, trainer.optimizer, x, y, 1, 64, [0, 1, 2],
                                           clip_norm=0.1, noise_multiplier=0.1)
        deltas.append(delta)
    assert metrics["clipped"] == 1 and metrics["update_norm"] > 0.1
    assert np.array_equal(deltas[0], deltas[1])


def test_partitions_are_disjoint_complete_seeded_and_skewed():
    _, _, train_y, _ = federated.digits_split(0)
    parts = fl.partition_by_label(train_y, 3, alpha=0.5, seed=0)
    joined = np.concatenate(parts)
    assert np.array_equal(np.sort(joined), np.arange(len(train_y)))
    assert all(np.array_equal(a, b) for a, b in zip(parts, fl.partition_by_label(train_y, 3, alpha=0.5, seed=0)))
    shares = np.array([np.bincount(train_y[p], minlength=10) / len(p) for p in parts])
    assert np.abs(shares - np.bincount(train_y) / len(train_y)).max() > 0.1  # non-IID
    with pytest.raises(ArgumentError):
        fl.partition_by_label(train_y[:20], 3, min_size=10)


def test_buffers_split_into_named_parameters_and_back(trainer):
    layout = fl.parameter_layout(trainer.state)
    assert [name for name, _ in layout] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    buffer = fl.get_parameters(trainer.module)
    arrays = fl.split_buffer(buffer, layout)
    assert arrays["fc1.weight"].shape == (32, 64)
    assert np.array_equal(fl.join_arrays(arrays, layout), buffer)
    with pytest.raises(ArgumentError):
        fl.join_arrays({**arrays, "fc2.bias": np.zeros(3, np.float32)}, layout)


def test_three_inprocess_clients_improve_the_global_model(tmp_path):
    lines = []
    result = federated.run(clients=3, rounds=3, engine="inprocess", directory=str(tmp_path), out=lines.append)
    losses = [entry["loss"] for entry in result["rounds"]]
    accuracies = [entry["accuracy"] for entry in result["rounds"]]
    assert len(losses) == 4 and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert accuracies[-1] > 0.8 > 0.3 > accuracies[0], accuracies
    assert sum(line.startswith("round ") for line in lines) == 4
    saved = json.loads((tmp_path / "global" / "rounds.json").read_text())
    assert saved["finished"] and saved["rounds"][-1]["loss"] == pytest.approx(losses[-1])
    from odtrain.api import CheckpointState, Module

    state = CheckpointState.load_checkpoint(result["checkpoint"])
    module = Module(str(tmp_path / "artifacts" / "training_model.onnx"), state,
                    str(tmp_path / "artifacts" / "eval_model.onnx"))
    _, test_x, _, test_y = federated.digits_split(0)
    assert fl.evaluate(module, test_x, test_y)["accuracy"] == pytest.approx(accuracies[-1])


def test_the_cli_runs_inprocess_and_rejects_bad_settings(tmp_path, capsys):
    from odtrain.cli import main

    assert main(["federated", "--engine", "inprocess", "--rounds", "1", "--local-epochs", "1",
                 "-o", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["engine"] == "inprocess" and [r["round"] for r in result["rounds"]] == [0, 1]
    assert main(["federated", "--engine", "inprocess", "--noise-multiplier", "1", "-o", str(tmp_path)]) == 2
    assert "clip_norm" in capsys.readouterr().err


def test_import_odtrain_never_imports_flower():
    code = ("import sys, odtrain, odtrain.federated, odtrain.federated.demo, odtrain.cli; odtrain.cli.build_parser(); "
            "print(any(m == 'flwr' or m.startswith('flwr.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_engines_resolve_by_what_is_installed(monkeypatch):
    monkeypatch.setattr(federated, "flower_available", lambda simulation=False: False)
    assert federated.resolve_engine("auto") == "inprocess"
    for engine in ("simulation", "deployment"):
        with pytest.raises(ArgumentError, match=r"odtrain\[flower\]"):
            federated.resolve_engine(engine)
    with pytest.raises(ArgumentError):
        federated.resolve_engine("threads")
    monkeypatch.setattr(federated, "flower_available", lambda simulation=False: True)
    assert federated.resolve_engine("auto") == "simulation"


def test_the_flower_package_names_its_extra_when_flower_is_missing():
    code = ("import sys; sys.modules['flwr'] = None\n"
            "try:\n    import odtrain.federated.flower\nexcept ImportError as error:\n    print(error)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 'pip install "odtrain[flower]"' in out


def test_a_missing_simulation_engine_names_a_pip_command_that_parses(monkeypatch):
    """`pip install` takes requirement specifiers separated by spaces: every quoted word must be one."""
    import shlex

    from packaging.requirements import Requirement

    monkeypatch.setattr(federated, "flower_available", lambda simulation=False: False)
    for engine in ("simulation", "deployment"):
        with pytest.raises(ArgumentError) as refused:
            federated.resolve_engine(engine)
        command = str(refused.value).split("pip install ", 1)[1].split(" (or")[0]
        requirements = [Requirement(word) for word in shlex.split(command)]
        assert requirements[0].name == "odtrain" and requirements[0].extras == {"flower"}
        assert [r.name for r in requirements[1:]] == (["flwr"] if engine == "simulation" else [])
