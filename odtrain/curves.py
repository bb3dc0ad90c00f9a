"""Training curves: the loss per epoch, training and validation, and the accuracy beside it, drawn to a file.

    from odtrain.curves import plot_history
    plot_history(fit(...).history, "curves.png")

Reads fit's history (one record per epoch): the training loss, the first
validation set's `val_loss` and `val_accuracy`, and with several sets each
set's loss and accuracy by name (`validation`). The loss is drawn on the
left, the accuracy (when the loss is a classifier's) on the right; the best
epoch, when the run judged one, is marked. matplotlib is an optional extra
(`pip install matplotlib`); without it the error says so before any work.
"""
from __future__ import annotations

import os

from .graph.errors import ArgumentError


def require_matplotlib(path) -> None:
    """Refuse a plot before training when matplotlib is missing, naming the install command."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ArgumentError(f"drawing the curves to '{os.fspath(path)}' needs matplotlib: pip install matplotlib "
                            "(or pip install odtrain[plot])") from None


def _series(history: list[dict]) -> tuple[dict, dict]:
    """({label: [loss per epoch]}, {label: [accuracy per epoch]}) from fit's history records."""
    losses = {"training": [r["loss"] for r in history]}
    accuracies = {}
    several = any("validation" in r for r in history)
    if several:
        for name in history[0].get("validation", {}):
            losses[f"val {name}"] = [r["validation"][name].get("loss") for r in history]
            if "accuracy" in history[0]["validation"][name]:
                accuracies[f"val {name}"] = [r["validation"][name]["accuracy"] for r in history]
    elif history and "val_loss" in history[0]:
        losses["validation"] = [r["val_loss"] for r in history]
        if "val_accuracy" in history[0]:
            accuracies["validation"] = [r["val_accuracy"] for r in history]
    return losses, accuracies


def plot_history(history: list[dict], path, title: str | None = None) -> str:
    """Draw the loss (and accuracy) per epoch of `history` to `path` (its extension picks the format)."""
    require_matplotlib(path)
    if not history:
        raise ArgumentError(f"no epoch finished in this run: nothing to draw to '{os.fspath(path)}'")
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window: this also runs on a device without a display
    import matplotlib.pyplot as plt

    losses, accuracies = _series(history)
    epochs = [r["epoch"] for r in history]
    figure, axes = plt.subplots(1, 2 if accuracies else 1, figsize=(10 if accuracies else 6, 4), squeeze=False)
    loss_axis = axes[0][0]
    colours = {label: f"C{index}" for index, label in enumerate(losses)}  # a set keeps its colour in both panels
    for label, values in losses.items():
        loss_axis.plot(epochs, values, marker="o", markersize=3, label=label, color=colours[label])
    loss_axis.set_xlabel("epoch")
    loss_axis.set_ylabel("loss")
    loss_axis.set_title("loss")
    best = history[-1].get("best_epoch")
    if best is not None:
        loss_axis.axvline(best, color="grey", linestyle=":", label=f"best epoch ({best})")
    loss_axis.legend()
    if accuracies:
        accuracy_axis = axes[0][1]
        for label, values in accuracies.items():
            accuracy_axis.plot(epochs, [100 * v for v in values], marker="o", markersize=3, label=label,
                               color=colours.get(label))
        accuracy_axis.set_xlabel("epoch")
        accuracy_axis.set_ylabel("accuracy (%)")
        accuracy_axis.set_title("accuracy")
        accuracy_axis.legend()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(os.fspath(path), dpi=100)
    plt.close(figure)
    return os.fspath(path)
