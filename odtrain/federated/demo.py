"""`odtrain federated`: federated averaging of the demo classifier across simulated devices.

1. Build the 64-32-10 classifier of `odtrain demo` and generate its artifacts (AdamW, cross-entropy).
2. Hold out 20% of the bundled 8x8 digits; share the rest among the clients non-IID by label
   (Dirichlet(alpha) proportions per class, seeded: `odtrain.federated.partition_by_label`).
3. Run the rounds with one of three engines, all doing the same arithmetic: each client starts from the
   global parameters with fresh optimizer state, trains `local_epochs` on its partition (seed
   `[seed, round, client]`), and the server averages the updates weighted by example counts.
   - `inprocess`: odtrain.federated in this process, no Flower needed;
   - `simulation`: Flower's simulation runtime (a SuperLink in simulation mode; needs `flwr[simulation]`);
   - `deployment`: Flower's deployment runtime: a running SuperLink and SuperNodes (`superlink=`), or a
     SuperLink and one SuperNode per client started here on loopback for the run.
4. Print the global model's loss and accuracy on the held-out digits before training and after every round;
   write the aggregated checkpoint, an inference model and `rounds.json` to `<directory>/global/`.
"""
from __future__ import annotations

import importlib.util
import os
import time

import numpy as np

from .rounds import digits_partition, digits_split, finish, format_round
from ..graph.errors import ArgumentError
from ..graph.wording import count

ENGINES = ("auto", "inprocess", "simulation", "deployment")


def prepare(directory: str, seed: int = 0) -> str:
    """Generate the classifier's artifacts in `<directory>/artifacts` and return that folder."""
    from .. import artifacts
    from ..demo import build_classifier

    folder = os.path.join(directory, "artifacts")
    model, params = build_classifier(seed=seed)
    artifacts.generate_artifacts(model, requires_grad=params, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=folder,
                                 additional_output_names=["output"])
    return folder


FLOWER_VERSIONS = ">=1.41,<1.42"  # the flwr of the flower extra (pyproject.toml)


def flower_available(simulation: bool = False) -> bool:
    return importlib.util.find_spec("flwr") is not None and (not simulation or importlib.util.find_spec("ray") is not None)


def resolve_engine(engine: str) -> str:
    """`auto` is Flower's simulation when flwr[simulation] is installed, else in-process."""
    if engine not in ENGINES:
        raise ArgumentError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "auto":
        return "simulation" if flower_available(simulation=True) else "inprocess"
    if engine in ("simulation", "deployment") and not flower_available(simulation=engine == "simulation"):
        packages = '"odtrain[flower]"' + (f' "flwr[simulation]{FLOWER_VERSIONS}"' if engine == "simulation" else "")
        raise ArgumentError(f"the {engine} engine needs Flower: pip install {packages} (or use --engine inprocess)")
    return engine


def run_inprocess(artifact_dir: str, output_dir: str, clients: int, rounds: int, local_epochs: int, batch_size: int,
                  learning_rate: float, alpha: float, seed: int, clip_norm, noise_multiplier: float, out=print) -> dict:
    """FedAvg with odtrain.federated: the clients take turns on one Module (each from the global buffer, fresh optimizer)."""
    from . import averaging as fl

    trainer = fl.open_artifacts(artifact_dir)
    trainer.optimizer.set_learning_rate(learning_rate)
    _, test_x, _, test_y = digits_split(seed)
    parts = [digits_partition(k, clients, alpha, seed) for k in range(clients)]
    global_buffer = fl.get_parameters(trainer.module)
    history = [{"round": 0, **fl.evaluate(trainer.module, test_x, test_y)}]
    out(format_round(history[0]))
    for current in range(1, rounds + 1):
        deltas, counts, losses = [], [], []
        for k, (x, y) in enumerate(parts):
            fl.set_parameters(trainer.module, global_buffer)
            delta, examples, metrics = fl.train_local(trainer.module, trainer.optimizer, x, y, local_epochs, batch_size,
                                                   [seed, current, k], clip_norm=clip_norm,
                                                   noise_multiplier=noise_multiplier)
            deltas.append(delta), counts.append(examples), losses.append(metrics["train_loss"])
        global_buffer = fl.apply_difference(global_buffer, fl.fedavg(deltas, counts))
        fl.set_parameters(trainer.module, global_buffer)
        entry = {"round": current, "train_loss": float(np.average(losses, weights=counts)),
                 **fl.evaluate(trainer.module, test_x, test_y)}
        history.append(entry)
        out(format_round(entry))
    return finish(trainer, global_buffer, output_dir, history)


def run(clients: int = 3, rounds: int = 3, engine: str = "auto", directory: str = "odtrain-federated",
        local_epochs: int = 3, batch_size: int = 32, learning_rate: float = 1e-2, alpha: float = 0.5, seed: int = 0,
        clip_norm: float | None = None, noise_multiplier: float = 0.0, superlink: str | None = None,
        timeout: float = 600.0, out=print) -> dict:
    """Prepare artifacts and data, run `rounds` rounds on `clients` clients with `engine`; return the results."""
    if clients < 1 or rounds < 1:
        raise ArgumentError(f"clients and rounds must be >= 1, got {clients} and {rounds}")
    if not alpha > 0:
        raise ArgumentError(f"alpha must be > 0, got {alpha}")
    if local_epochs < 1 or batch_size < 1 or not learning_rate > 0:
        raise ArgumentError(f"local_epochs and batch_size must be >= 1 and learning_rate > 0, got {local_epochs}, "
                            f"{batch_size} and {learning_rate}")
    if clip_norm is not None and not clip_norm > 0:
        raise ArgumentError(f"clip_norm must be > 0, got {clip_norm}")
    if not noise_multiplier >= 0 or (noise_multiplier and clip_norm is None):
        raise ArgumentError("noise_multiplier must be >= 0, and noise needs clip_norm (its scale is "
                            f"noise_multiplier * clip_norm); got {noise_multiplier} with clip_norm {clip_norm}")
    if superlink:
        host, _, port = superlink.rpartition(":")
        if not host or not port.isdigit():
            raise ArgumentError(f"superlink must be HOST:PORT, got {superlink!r}")
        if engine not in ("auto", "deployment"):
            raise ArgumentError(f"a SuperLink address is for the deployment engine, not {engine}")
        engine = "deployment"
    engine = resolve_engine(engine)
    started = time.perf_counter()
    artifact_dir = prepare(directory, seed)
    output_dir = os.path.join(directory, "global")
    out(f"artifacts written to {artifact_dir}/; engine: {engine}")
    for k in range(clients):
        _, y = digits_partition(k, clients, alpha, seed)
        counts = np.bincount(y, minlength=10)
        top = ", ".join(f"{d}:{counts[d]}" for d in np.argsort(-counts)[:3])
        out(f"client {k}: {count(len(y), 'digit')} (most common {top})")
    _, _, _, test_y = digits_split(seed)
    out(f"held out: {count(len(test_y), 'digit')}; {count(rounds, 'round')} of {count(local_epochs, 'local epoch')}")
    settings = dict(clients=clients, rounds=rounds, local_epochs=local_epochs, batch_size=batch_size,
                    learning_rate=learning_rate, alpha=alpha, seed=seed, clip_norm=clip_norm,
                    noise_multiplier=noise_multiplier)
    if engine == "inprocess":
        result = run_inprocess(artifact_dir, output_dir, out=out, **settings)
    else:
        from .flower.runner import run_flower

        result = run_flower(engine, artifact_dir, output_dir, superlink=superlink, timeout=timeout, out=out, **settings)
    result.update(engine=engine, seconds=time.perf_counter() - started)
    final = result["rounds"][-1]
    out(f"global model after {count(rounds, 'round')}: held-out accuracy {final.get('accuracy', float('nan')):.1%} "
        f"(loss {final['loss']:.4f}); {result['seconds']:.1f} s")
    out(f"checkpoint: {result['checkpoint']}; inference model: {result['inference_model']}")
    return result
