"""A PNG of a training step's memory over time, from a MemoryReport (needs matplotlib: odtrain[plot]).

Two panels share the x axis, the position in the step's execution order (0: the feeds are
written; the last position: outputs held to the end):
- top, everything training holds: constant bands for the parameters, the gradient buffer, the
  optimizer state and folded constants, with the arena's live bytes stacked on them;
- bottom, the arena alone, stacked by category (planner.CATEGORIES), with the arena as planned
  and its lower bound as lines; the tallest stack touches the lower bound.
A vertical line marks the loss: forward to its left, backward to its right.
"""
from __future__ import annotations

import os

import numpy as np

from .graph.errors import ArgumentError
from .memory import MIB, MemoryReport, format_bytes

CONSTANT_COLORS = {"parameters": "#9e9e9e", "gradient buffer": "#c7c7c7", "optimizer state": "#dadada",
                   "folded constants": "#ececec"}
ARENA_COLORS = {"inputs": "#8c564b", "saved for backward": "#1f77b4", "forward temporaries": "#aec7e8",
                "backward": "#ff7f0e", "scratch": "#9467bd", "recomputed": "#2ca02c"}


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ArgumentError('plotting needs matplotlib: pip install matplotlib') from None


def plot_timeline(report: MemoryReport, path, title: str) -> None:
    """Write the PNG of the report's first training-step plan to `path`."""
    require_matplotlib()
    from matplotlib.figure import Figure

    step = next((p for p in report.plans if p.mode == "train"), None)
    if step is None or step.plan is None:
        raise ArgumentError("the report holds no bound training step to plot")
    rows, plan = step.timeline(), step.plan
    steps = np.arange(plan.steps + 2)
    edges = np.append(steps - 0.5, steps[-1] + 0.5)  # one bar per position, drawn from edge to edge

    def bar(values):
        return np.append(values, values[-1]) / MIB

    constants = {"parameters": report.parameter_bytes, "gradient buffer": report.gradient_bytes,
                 "optimizer state": report.optimizer_bytes, "folded constants": step.constant_bytes}
    constants = {name: value for name, value in constants.items() if value}
    base = sum(constants.values())

    figure = Figure(figsize=(11, 7.5), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=(1, 1.3))
    level = np.zeros(len(steps), dtype=np.int64)
    for name, value in constants.items():
        top.fill_between(edges, bar(level), bar(level + value), step="post", color=CONSTANT_COLORS[name],
                         label=f"{name} ({format_bytes(value)})", linewidth=0)
        level = level + value
    for axes, start in ((top, level), (bottom, np.zeros(len(steps), dtype=np.int64))):
        stacked = start
        for name, row in rows.items():
            if not row.any():
                continue
            axes.fill_between(edges, bar(stacked), bar(stacked + row), step="post", color=ARENA_COLORS[name],
                              label=f"{name} (peak {format_bytes(int(row.max()))})" if axes is bottom else None,
                              linewidth=0)
            stacked = stacked + row
    top.axhline((base + plan.arena_bytes) / MIB, color="black", linestyle="--", linewidth=1,
                label=f"buffers + arena as planned: {format_bytes(base + plan.arena_bytes)}")
    bottom.axhline(plan.arena_bytes / MIB, color="black", linestyle="--", linewidth=1.2,
                   label=f"arena as planned: {format_bytes(plan.arena_bytes)}")
    bottom.axhline(plan.lower_bound / MIB, color="#d62728", linestyle=":", linewidth=1.5,
                   label=f"lower bound: {format_bytes(plan.lower_bound)} "
                   f"(arena {plan.arena_bytes / max(plan.lower_bound, 1):.2f}x)")
    for axes, peak in ((top, base + plan.arena_bytes), (bottom, plan.arena_bytes)):
        if step.loss_step is not None:
            axes.axvline(step.loss_step, color="black", linewidth=1.2,
                         label=f"the loss (position {step.loss_step}): forward | backward")
        axes.set_ylabel("MiB")
        axes.set_ylim(0, 1.1 * max(peak, 1) / MIB)
        axes.set_xlim(edges[0], edges[-1])
        axes.grid(axis="y", alpha=0.3)
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9, frameon=False)
    top.set_title("everything training holds: buffers (grey) and the arena's live bytes", fontsize=10, loc="left")
    bottom.set_title("the arena's live bytes by category", fontsize=10, loc="left")
    bottom.set_xlabel(f"position in the training step's execution order (0: inputs written; {plan.steps} ops)")
    with_eval = " (with the eval step's arena)" if any(p.mode == "eval" for p in report.plans) else ""
    figure.suptitle(f"{title}\npredicted peak {format_bytes(report.peak_bytes)}{with_eval}; "
                    "the Python/Numba runtime floor is not included", fontsize=11)
    figure.savefig(os.fspath(path), dpi=110)
