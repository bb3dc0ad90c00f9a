"""Validation during training: several named sets, the best epoch kept, and the early stop.

    from odtrain.training import fit
    fit("artifacts", "new.npz", val=["new-val.npz", "base-val.npz"], keep_best=True, early_stop=5)

- `validation_sets` turns fit's `val` into named Datasets. One source (a
  path, a folder, a Dataset, a dict of arrays, a list of arrays or of `.npy`
  paths, one per model input) is one set; a list of several sources, or a dict
  {name: source}, is several. A file's set is named by its file name (the
  whole path when two share a name). The first set is the one the best
  epoch and the early stop are judged on.
- `epoch_metrics` scores every set. The first set's metrics keep the keys
  fit has always written (`val_loss`, `val_accuracy`, ...); with several
  sets, `validation` maps each name to its metrics as well.
- `BestKeeper` follows one metric of the first set (its loss by default,
  lower is better; accuracy: higher is better). An epoch that improves on
  every earlier one is the best: with `keep_best`, the checkpoint as that
  epoch left it is saved to `checkpoint.best` beside the checkpoint, by the
  same atomic save (a temporary file, fsynced, renamed), loadable as any
  checkpoint (`CheckpointState.load_checkpoint`). The best epoch, its
  metric and the epochs since it are kept in the checkpoint's property bag,
  so a resumed run goes on judging against the same best.
- `early_stop=N` ends the run after N epochs in a row without improvement.
"""
from __future__ import annotations

import math
import os

import numpy as np

from .artifact_paths import CHECKPOINT
from .graph.errors import ArgumentError

BEST_CHECKPOINT = f"{CHECKPOINT}.best"
BEST_METRICS = {"loss": min, "accuracy": max}  # how a better value compares
# property names of the run's best, kept in the checkpoint beside the position
BEST_PROPERTIES = ("best_epoch", "best_value", "epochs_without_improvement")


def _is_single_source(val) -> bool:
    """Whether `val` is one data source: anything but a list or tuple; or a list of .npy paths (one per input),
    or of arrays (one per input, in input order)."""
    if not isinstance(val, (list, tuple)):
        return True
    if any(isinstance(v, np.ndarray) for v in val):
        return True
    return bool(val) and all(isinstance(v, (str, os.PathLike)) and os.fspath(v).endswith(".npy") for v in val)


def _name(source, index: int) -> str:
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    if isinstance(source, (list, tuple)) and source and isinstance(source[0], (str, os.PathLike)):
        return " ".join(os.fspath(s) for s in source)
    folder = getattr(source, "folder", None) or getattr(source, "path", None)
    return os.fspath(folder) if folder else f"validation set {index + 1}"


def set_names(sources: list) -> list[str]:
    """Each source's name: its file name, or its whole path where two file names are alike."""
    paths = [_name(s, i) for i, s in enumerate(sources)]
    short = [os.path.basename(p.rstrip(os.sep)) or p for p in paths]
    return [s if short.count(s) == 1 else p for s, p in zip(short, paths)]


def validation_sets(session, val, x=None, y=None) -> list[tuple[str, object]]:
    """[(name, Dataset)] for fit's `val`: None gives none; see the module docstring."""
    if val is None:
        return []
    if isinstance(val, dict):
        names, sources = [str(k) for k in val], list(val.values())
    else:
        sources = [val] if _is_single_source(val) else list(val)
        names = set_names(sources)
    if not sources:
        return []
    return [(name, session.dataset(source, x, y)) for name, source in zip(names, sources)]


def epoch_metrics(sets, evaluate) -> dict:
    """The record entries of one epoch's validation: `val_<metric>` of the first set, and with several sets
    `validation` {name: metrics} of each; `evaluate(dataset)` scores one set."""
    record, every = {}, {}
    for index, (name, dataset) in enumerate(sets):
        metrics = {k: v for k, v in evaluate(dataset).items() if k != "samples"}
        every[name] = metrics
        if index == 0:
            record.update({f"val_{k}": v for k, v in metrics.items()})
    if len(sets) > 1:
        record["validation"] = every
    return record


def describe_sets(sets) -> str:
    """What the start line says: 'validating on 287 samples', or each set by name with its size."""
    from .graph.wording import count

    if len(sets) == 1:
        return f"validating on {count(len(sets[0][1]), 'sample')}"
    return "validating on " + ", ".join(f"{name} ({count(len(d), 'sample')})" for name, d in sets)


def epoch_text(record: dict) -> str:
    """The validation part of an epoch's line: each set's loss and accuracy (MSE), by name when several."""
    def metrics_text(metrics: dict, prefix: str) -> list[str]:
        parts = [f"{prefix}loss {metrics['loss']:.4f}"] if "loss" in metrics else []
        if "accuracy" in metrics:
            parts.append(f"{prefix}accuracy {metrics['accuracy']:.1%}")
        if "mse" in metrics:
            parts.append(f"{prefix}MSE {metrics['mse']:.4g}")
        return parts

    if "validation" in record:
        return "; ".join(f"{name}: " + ", ".join(metrics_text(m, "")) for name, m in record["validation"].items())
    return ", ".join(metrics_text({k[4:]: v for k, v in record.items() if k.startswith("val_")}, "val "))


class BestKeeper:
    """Which epoch is best by the first validation set's `metric`, and whether to stop early (module docstring).
    `properties` is the checkpoint's property bag: the best so far is read from it (a resumed run) and kept in it."""

    def __init__(self, properties, metric: str = "loss", keep_best: bool = False, early_stop: int | None = None,
                 resume: bool = False, has_validation: bool = True, directory: str = ".",
                 loss_kind: str | None = None):
        if metric not in BEST_METRICS:
            raise ArgumentError(f"best_metric must be one of {', '.join(BEST_METRICS)}, got {metric!r}")
        if metric == "accuracy" and loss_kind not in ("ce", "bce"):
            raise ArgumentError(f"--best-metric accuracy (best_metric='accuracy') needs a classifier's loss (ce or "
                                f"bce); this model's is {loss_kind or 'its own output'}: judge by loss")
        if early_stop is not None and early_stop < 1:
            raise ArgumentError(f"early stop must be at least 1 epoch without improvement, got {early_stop}")
        if (keep_best or early_stop is not None) and not has_validation:
            wanted = "--keep-best (keep_best)" if keep_best else "--early-stop (early_stop)"
            raise ArgumentError(f"{wanted} judges each epoch on validation data: give a validation set with --val "
                                "PATH (val=...)")
        self.properties, self.metric, self.keep_best, self.early_stop = properties, metric, keep_best, early_stop
        self.path = os.path.join(directory, BEST_CHECKPOINT)
        self.active = keep_best or early_stop is not None
        if not resume or properties.get("best_metric") != metric:
            for key in BEST_PROPERTIES:
                if key in properties:
                    del properties[key]
            self.best_epoch, self.best_value, self.waited = None, None, 0
        else:
            self.best_epoch = properties.get("best_epoch")
            self.best_value = properties.get("best_value")
            self.waited = int(properties.get("epochs_without_improvement", 0))

    def judge(self, record: dict) -> bool:
        """Note the finished epoch's record; True when it is the best so far (kept in the property bag)."""
        if not self.active:
            return False
        value = record.get(f"val_{self.metric}")
        if value is None:
            raise ArgumentError(f"the validation set gives no {self.metric} (it gives "
                                f"{', '.join(k[4:] for k in record if k.startswith('val_'))}); judge by loss")
        value = float(value)
        better = math.isfinite(value) and (self.best_value is None or
                                          BEST_METRICS[self.metric](value, self.best_value) != self.best_value)
        if better:
            self.best_epoch, self.best_value, self.waited = int(record["epoch"]), value, 0
        else:
            self.waited += 1
        self.properties["best_metric"] = self.metric
        if self.best_epoch is not None:
            self.properties["best_epoch"], self.properties["best_value"] = self.best_epoch, self.best_value
        self.properties["epochs_without_improvement"] = self.waited
        record["best_epoch"] = self.best_epoch
        return better

    def save_best(self, state, include_optimizer_state: bool) -> None:
        """Save `state` as the best checkpoint, by the same atomic save as the checkpoint's."""
        from .api import CheckpointState

        CheckpointState.save_checkpoint(state, self.path, include_optimizer_state=include_optimizer_state)

    @property
    def should_stop(self) -> bool:
        return self.early_stop is not None and self.waited >= self.early_stop

    def summary(self) -> dict:
        """What the result says of the best epoch: its number, the metric and its value, and the file."""
        return {"epoch": self.best_epoch, "metric": f"val_{self.metric}", "value": self.best_value,
                "checkpoint": self.path if self.keep_best and self.best_epoch is not None else None}
