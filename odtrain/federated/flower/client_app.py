"""The odtrain ClientApp: local training and evaluation of an artifact folder, on this node's data.

train:    ArrayRecord ``arrays`` (global parameters) + ConfigRecord ``config`` in; the node copies the
          parameters into its Module, runs ``odtrain.federated.train_local`` on its data (seed
          ``[seed, server-round, partition-id]``, optimizer state fresh), and replies with the parameters
          ``float32(global + difference)`` (the difference clipped and noised when configured) and a
          MetricRecord: ``num-examples``, ``train-loss``, ``update-norm``, ``clipped``.
evaluate: ArrayRecord in; MetricRecord ``num-examples``, ``loss``, ``accuracy`` on this node's data out.
"""
from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .. import averaging as fl
from . import settings

app = ClientApp()


def _config(message: Message, context: Context) -> dict:
    sent = message.content.config_records.get("config", {})
    return {key: sent.get(key, settings.setting(context, key)) for key in settings.TRAIN_KEYS}


def _load(message: Message, context: Context, config: dict):
    trainer = settings.trainer(settings.artifact_dir(context))
    layout = fl.parameter_layout(trainer.state)
    fl.set_parameters(trainer.module, settings.from_record(message.content.array_records["arrays"], layout))
    x, y = settings.client_data(context, float(config["dirichlet-alpha"]), int(config["seed"]))
    return trainer, layout, x, y


@app.train()
def train(message: Message, context: Context) -> Message:
    config = _config(message, context)
    trainer, layout, x, y = _load(message, context, config)
    reference = fl.get_parameters(trainer.module)
    trainer.optimizer.set_learning_rate(float(config["learning-rate"]))
    server_round = int(message.content.config_records["config"].get("server-round", 0))
    seed = [int(config["seed"]), server_round, int(context.node_config.get("partition-id", 0))]
    delta, count, metrics = fl.train_local(trainer.module, trainer.optimizer, x, y, int(config["local-epochs"]),
                                           int(config["batch-size"]), seed,
                                           clip_norm=float(config["clip-norm"]) or None,
                                           noise_multiplier=float(config["noise-multiplier"]))
    reply = RecordDict({
        "arrays": settings.to_record(fl.apply_difference(reference, delta), layout),
        "metrics": MetricRecord({"num-examples": count, "train-loss": metrics["train_loss"],
                                 "update-norm": metrics["update_norm"], "clipped": metrics["clipped"]}),
    })
    return Message(content=reply, reply_to=message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    config = _config(message, context)
    trainer, _, x, y = _load(message, context, config)
    result = fl.evaluate(trainer.module, x, y)
    metrics = {"num-examples": result["examples"], "loss": result["loss"]}
    if "accuracy" in result:
        metrics["accuracy"] = result["accuracy"]
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=message)
