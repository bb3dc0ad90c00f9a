"""What the engines of `odtrain federated` share (in process, and Flower's ServerApp and ClientApp).

- The data: the bundled 8x8 digits, TEST_FRACTION held out (stratified, seeded); the rest shared among
  the clients non-IID by label (`odtrain.federated.partition_by_label`).
- One line per round, for the console and Flower's log.
- The files of a finished run in its output folder: the global checkpoint, `inference.onnx`, and
  ROUNDS_FILE, the rounds' metrics (rewritten after every round, `finished` false until the end).

Imports nothing of Flower's, nor the modules that run the engines.
"""
from __future__ import annotations

import json
import os

from ..artifact_paths import CHECKPOINT
from ..graph.errors import ArgumentError

TEST_FRACTION = 0.2
ROUNDS_FILE = "rounds.json"


def digits_split(seed: int = 0):
    """(train_x, test_x, train_y, test_y): the bundled digits, 20% held out (stratified, seeded)."""
    from ..datasets import load_digits, train_test_split

    images, labels = load_digits()
    return train_test_split(images, labels, test_fraction=TEST_FRACTION, seed=seed)


def digits_partition(partition_id: int, num_partitions: int, alpha: float = 0.5, seed: int = 0):
    """(x, y) of one client: its share of the training digits under `partition_by_label`."""
    from .averaging import partition_by_label

    if not 0 <= partition_id < num_partitions:
        raise ArgumentError(f"partition-id must be in [0, {num_partitions}), got {partition_id}")
    train_x, _, train_y, _ = digits_split(seed)
    index = partition_by_label(train_y, num_partitions, alpha, seed)[partition_id]
    return train_x[index], train_y[index]


def format_round(entry: dict) -> str:
    """One line of a round's metrics (round 0: the initial model)."""
    head = f"round {entry['round']}:"
    train = f" clients' train loss {entry['train_loss']:.4f};" if entry.get("train_loss") is not None else ""
    accuracy = f", accuracy {entry['accuracy']:.1%}" if "accuracy" in entry else ""
    tail = " (initial model)" if entry["round"] == 0 else ""
    return f"{head}{train} held-out loss {entry['loss']:.4f}{accuracy}{tail}"


def finish(trainer, buffer, output_dir: str, rounds: list, extra: dict | None = None) -> dict:
    """Write the global checkpoint, `inference.onnx` and the rounds file for the final global buffer."""
    from ..api import CheckpointState
    from .averaging import set_parameters

    os.makedirs(output_dir, exist_ok=True)
    set_parameters(trainer.module, buffer)
    trainer.state.properties["federated_rounds"] = len(rounds) - 1
    checkpoint = os.path.join(output_dir, CHECKPOINT)
    CheckpointState.save_checkpoint(trainer.state, checkpoint)
    inference = os.path.join(output_dir, "inference.onnx")
    trainer.module.export_model_for_inferencing(inference, ["output"])
    result = {"rounds": rounds, "finished": True, "checkpoint": checkpoint, "inference_model": inference, **(extra or {})}
    write_json(os.path.join(output_dir, ROUNDS_FILE), result)
    return result


def write_json(path: str, value) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w") as handle:
        json.dump(value, handle, indent=1)
    os.replace(temporary, path)
