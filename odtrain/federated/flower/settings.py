"""Configuration keys shared by the odtrain ClientApp and ServerApp, and model <-> ArrayRecord conversion.

Run config (``[tool.flwr.app.config]``, the same for every node; defaults in ``RUN_DEFAULTS``):
  ``artifact-dir``        the folder generate_artifacts wrote (checkpoint, training/eval/optimizer models)
  ``output-dir``          where the ServerApp writes checkpoint, inference.onnx and rounds.json
                          (default: ``<artifact-dir>/../global``)
  ``num-server-rounds``, ``local-epochs``, ``batch-size``, ``learning-rate``, ``seed``
  ``dirichlet-alpha``     label skew of the bundled-digits partitions (smaller: more skew)
  ``clip-norm``, ``noise-multiplier``   client-side update clipping and Gaussian noise (0: off)
  ``fraction-train``, ``fraction-evaluate``   FedAvg sampling, once ``min-nodes`` nodes are connected
  ``test-file``           an ``.npz`` (``x``, ``y``) the ServerApp evaluates on (default: the held-out digits)
Node config (``flower-supernode --node-config``; the simulation runtime sets the first two):
  ``partition-id``, ``num-partitions``  which share of the bundled digits this node trains on
  ``data-file``           an ``.npz`` with arrays ``x`` (float32) and ``y`` (int64) to train on instead
  ``artifact-dir``        this node's own copy of the artifacts (overrides the run config)

Invariant: an ArrayRecord holds the trainable parameters by name, float32, in checkpoint shapes; clients
reply with one ArrayRecord (``arrays``) and one MetricRecord (``metrics``, with ``num-examples``).
"""
from __future__ import annotations

import os

import numpy as np
from flwr.app import Array, ArrayRecord, Context

from .. import averaging as fl
from ...graph.errors import ArgumentError

RUN_DEFAULTS = {
    "artifact-dir": "", "output-dir": "", "num-server-rounds": 3, "local-epochs": 3, "batch-size": 32,
    "learning-rate": 0.01, "seed": 0, "dirichlet-alpha": 0.5, "clip-norm": 0.0, "noise-multiplier": 0.0,
    "fraction-train": 1.0, "fraction-evaluate": 0.0, "min-nodes": 2, "test-file": "",
}
TRAIN_KEYS = ("local-epochs", "batch-size", "learning-rate", "seed", "clip-norm", "noise-multiplier",
              "dirichlet-alpha")

_trainers: dict[str, fl.Trainer] = {}


def setting(context: Context, key: str):
    """A run-config value, or its default."""
    return context.run_config.get(key, RUN_DEFAULTS[key])


def artifact_dir(context: Context) -> str:
    directory = str(context.node_config.get("artifact-dir", "") or setting(context, "artifact-dir"))
    if not directory:
        raise ArgumentError("no artifact folder: set run config 'artifact-dir' (or node config 'artifact-dir')")
    return directory


def output_dir(context: Context) -> str:
    return str(setting(context, "output-dir")) or os.path.join(os.path.dirname(os.path.abspath(artifact_dir(context))),
                                                               "global")


def trainer(directory: str) -> fl.Trainer:
    """The artifacts of `directory`, loaded once per process (plans and compiled kernels are reused)."""
    directory = os.path.abspath(directory)
    if directory not in _trainers:
        _trainers[directory] = fl.open_artifacts(directory)
    return _trainers[directory]


def client_data(context: Context, alpha: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """This node's (x, y): its `data-file`, or partition `partition-id` of `num-partitions` of the digits."""
    node = context.node_config
    if node.get("data-file"):
        with np.load(str(node["data-file"]), allow_pickle=False) as data:
            return np.asarray(data["x"], dtype=np.float32), np.asarray(data["y"], dtype=np.int64)
    if "partition-id" not in node or "num-partitions" not in node:
        raise ArgumentError("this node has no data: start it with --node-config 'partition-id=K num-partitions=N' "
                            "or 'data-file=\"local.npz\"'")
    from ..rounds import digits_partition

    return digits_partition(int(node["partition-id"]), int(node["num-partitions"]), alpha, seed)


def to_record(buffer, layout) -> ArrayRecord:
    """An ArrayRecord of the named float32 parameters in a flat buffer."""
    return ArrayRecord({name: Array(array) for name, array in fl.split_buffer(np.asarray(buffer, np.float32),
                                                                               layout).items()})


def from_record(record: ArrayRecord, layout) -> np.ndarray:
    """The flat float32 buffer of an ArrayRecord's parameters, in the model's layout."""
    return fl.join_arrays({name: record[name].numpy() for name in record.keys()}, layout)
