"""Flower integration: odtrain artifacts trained by Flower ClientApps, averaged by a FedAvg ServerApp.

Install with ``pip install "odtrain[flower]"`` (flwr 1.41). Only this package imports ``flwr``, so
``import odtrain`` never needs it.

- ``odtrain.federated.flower.client_app:app``: trains the artifact folder on the node's partition (``@app.train``)
  and evaluates the global model on it (``@app.evaluate``).
- ``odtrain.federated.flower.server_app:app``: FedAvg from the checkpoint's parameters; evaluates the global model on
  held-out data each round; writes the aggregated checkpoint, ``inference.onnx`` and ``rounds.json``.
- ``odtrain.federated.flower.runner``: writes the Flower App folder (``pyproject.toml``) for ``flwr run``, starts a
  loopback SuperLink and SuperNodes, runs the simulation or deployment runtime.

Run-config keys (``[tool.flwr.app.config]``) and node-config keys are listed in
``odtrain.federated.flower.settings``.
"""
try:
    import flwr  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError('odtrain.federated.flower needs Flower: pip install "odtrain[flower]"') from error
