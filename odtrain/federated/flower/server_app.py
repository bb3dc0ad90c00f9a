"""The odtrain ServerApp: FedAvg from the checkpoint's parameters, evaluated on held-out data every round.

The global model starts as the trainable parameters of ``<artifact-dir>/checkpoint``. Flower's FedAvg sends
them with a ConfigRecord of the training settings (``settings.TRAIN_KEYS``), and averages the replies
weighted by ``num-examples``. Before the first round and after each one the server evaluates the global
model on the held-out digits (or run config ``test-file``, an ``.npz`` with ``x`` and ``y``) and rewrites
``<output-dir>/rounds.json`` (``finished`` false until the end). At the end it writes the aggregated
checkpoint and ``inference.onnx`` there.
"""
from __future__ import annotations

import os
from logging import INFO

import numpy as np
from flwr.app import ConfigRecord, Context, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from .. import averaging as fl
from ..rounds import ROUNDS_FILE, digits_split, finish, format_round, write_json
from . import settings

app = ServerApp()


def held_out(context: Context):
    path = str(settings.setting(context, "test-file"))
    if path:
        with np.load(path, allow_pickle=False) as data:
            return np.asarray(data["x"], dtype=np.float32), np.asarray(data["y"], dtype=np.int64)
    _, test_x, _, test_y = digits_split(int(settings.setting(context, "seed")))
    return test_x, test_y


@app.main()
def main(grid: Grid, context: Context) -> None:
    trainer = fl.open_artifacts(settings.artifact_dir(context))  # its own copy, never shared with a client
    layout = fl.parameter_layout(trainer.state)
    initial = fl.get_parameters(trainer.module)
    output = settings.output_dir(context)
    os.makedirs(output, exist_ok=True)
    test_x, test_y = held_out(context)
    history, latest = [], {}

    def aggregate_train_metrics(records, weight_key):
        latest["train"] = aggregate_metricrecords(records, weight_key)
        return latest["train"]

    def evaluate(server_round: int, arrays) -> MetricRecord:
        fl.set_parameters(trainer.module, settings.from_record(arrays, layout))
        entry = {"round": server_round, **fl.evaluate(trainer.module, test_x, test_y)}
        train = latest.pop("train", None)
        if server_round:
            entry["train_loss"] = float(train["train-loss"]) if train is not None else None
        history.append(entry)
        write_json(os.path.join(output, ROUNDS_FILE), {"rounds": history, "finished": False})
        log(INFO, "%s", format_round(entry))
        return MetricRecord({k: v for k, v in entry.items() if isinstance(v, (int, float)) and k != "round"})

    nodes = int(settings.setting(context, "min-nodes"))
    strategy = FedAvg(fraction_train=float(settings.setting(context, "fraction-train")),
                      fraction_evaluate=float(settings.setting(context, "fraction-evaluate")),
                      min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=nodes,
                      train_metrics_aggr_fn=aggregate_train_metrics)
    train_config = ConfigRecord({key: settings.setting(context, key) for key in settings.TRAIN_KEYS})
    result = strategy.start(grid=grid, initial_arrays=settings.to_record(initial, layout),
                            num_rounds=int(settings.setting(context, "num-server-rounds")),
                            train_config=train_config, evaluate_config=ConfigRecord(dict(train_config)),
                            evaluate_fn=evaluate)
    final = settings.from_record(result.arrays, layout) if len(result.arrays) else initial
    finish(trainer, final, output, history)
