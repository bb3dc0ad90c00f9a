"""What a training session holds in memory, predicted from its buffers and plans.

    report = odtrain.memory.report(module)                          # the plans a Module has bound
    report = odtrain.memory.from_artifacts("artifacts", batch_size=32, memory_budget=None)
    print(report.render()); report.to_dict(); report.plans[0].timeline()

Counted: the flat parameter buffer (trainable and frozen), the gradient buffer,
the optimizer's moment buffers, the arena buffer that a Module's bound plans
(one per input shape, train and eval) share, as large as the largest of them,
and the constants folded for each plan. `training_bytes` is
what training adds on top of a loaded checkpoint: everything but the parameters;
`peak_bytes` adds the parameters. The Python, numpy and Numba runtime (imports
and loaded kernels) is the process's floor and is part of neither.

Invariants: every number is read off the objects a step uses (the state's
buffers, the bound steps' plans), never recomputed beside them; `from_artifacts`
binds the same plans a first step at that batch size would, without running one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .allocation import format_bytes
from .artifact_paths import ArtifactPaths, refuse_a_model
from .graph.autodiff import LOSS_SEED
from .graph.errors import ArgumentError, ArtifactNotFoundError
from .graph.planner import CATEGORIES, MemoryPlan, training_categories
from .graph.wording import count

SAVED_ITERATIONS = "saved iterations"  # a category of the plot: the states a Loop or Scan stacks for its backward

MIB = 1024 * 1024
RUNTIME_FLOOR = ("not included: the Python/Numba runtime floor (interpreter, numpy, Numba and its compiled "
                 "kernels), which every odtrain process pays")
# where a kernel library runs the steps, the process never loads Numba: its floor is the library's
LIBRARY_RUNTIME_FLOOR = ("not included: the runtime floor (interpreter, numpy and the kernel library {folder}), which "
                         "every odtrain process pays")


def runtime_floor(library) -> str:
    """The line naming the runtime floor a report leaves out: the kernel library's where one runs the steps
    (a device), else Numba's."""
    if library is None:
        return RUNTIME_FLOOR
    return LIBRARY_RUNTIME_FLOOR.format(folder=getattr(library, "folder", ""))


# values a byte of the frozen types numpy has no dtype for (graph/frozen.py); others: 1 / itemsize
VALUES_PER_BYTE = {"bfloat16": 0.5, "int4": 2}


@dataclass
class PlanMemory:
    mode: str  # "train" or "eval"
    shapes: tuple
    arena_bytes: int
    lower_bound: int
    constant_bytes: int
    recomputed_nodes: int
    no_reuse_bytes: int = 0  # every arena value and scratch buffer in bytes of its own
    plan: MemoryPlan | None = field(default=None, repr=False, compare=False)
    loss_step: int | None = None  # the step that writes the loss: the end of the forward pass
    loops: tuple = ()  # loops.LoopMemory of each If, Loop and Scan node: bodies' arenas (beside this one), saved bytes

    @property
    def body_arena_bytes(self) -> int:
        return sum(loop.body_arena_bytes for loop in self.loops)

    def timeline(self) -> dict[str, np.ndarray]:
        """Live arena bytes at each step of the plan (0..steps+1), per category of planner.CATEGORIES, and
        SAVED_ITERATIONS when a loop saves its iterations' states for the backward."""
        categories = training_categories(self.plan, LOSS_SEED)
        for loop in self.loops:  # what a loop's iterations save, apart from the other saved values
            categories.update((name, SAVED_ITERATIONS) for name in loop.saved_values if name in categories)
        rows = self.plan.live_bytes(categories.__getitem__)
        saving = (SAVED_ITERATIONS,) if any(loop.saved_values for loop in self.loops) else ()
        return {name: rows.get(name, np.zeros(self.plan.steps + 2, dtype=np.int64)) for name in CATEGORIES + saving}

    def to_dict(self) -> dict:
        return {"mode": self.mode, "inputs": {name: list(shape) for name, shape in self.shapes},
                "ops": self.plan.steps if self.plan is not None else None, "arena_bytes": self.arena_bytes,
                "lower_bound_bytes": self.lower_bound,
                "arena_over_lower_bound": self.arena_bytes / max(self.lower_bound, 1),
                "no_reuse_bytes": self.no_reuse_bytes, "folded_constant_bytes": self.constant_bytes,
                "recomputed_nodes": self.recomputed_nodes, "body_arena_bytes": self.body_arena_bytes,
                "loops": [loop.to_dict() for loop in self.loops]}


@dataclass
class MemoryReport:
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    plans: list[PlanMemory] = field(default_factory=list)
    trainable_parameter_bytes: int = 0
    optimizer_kind: str | None = None
    optimizer_states: tuple = ()
    shared_arena_bytes: int | None = None  # the buffer the plans share, when read off a Module
    frozen_bytes_by_type: dict = field(default_factory=dict)  # element type name -> frozen parameter bytes
    runtime: str = RUNTIME_FLOOR  # the line naming the runtime floor left out (runtime_floor)

    @property
    def frozen_parameter_bytes(self) -> int:
        return self.parameter_bytes - self.trainable_parameter_bytes

    @property
    def saved_by_freezing(self) -> tuple[int, int]:
        """(gradient, optimizer state) bytes that training the frozen parameters too would add: what freezing
        them (a frozen backbone, LoRA's frozen weights) saves."""
        frozen, trainable = self.frozen_parameter_bytes, max(self.trainable_parameter_bytes, 1)
        if self.frozen_bytes_by_type:  # as float32 values, which gradients and moments would be
            frozen = sum(int(4 * n * VALUES_PER_BYTE[name]) if name in VALUES_PER_BYTE else
                         4 * n // np.dtype(name).itemsize for name, n in self.frozen_bytes_by_type.items())
        return (frozen if self.gradient_bytes else 0), self.optimizer_bytes * frozen // trainable

    @property
    def arena_bytes(self) -> int:
        """The arena buffer the plans share (they never run at once): the largest plan's arena."""
        if self.shared_arena_bytes is not None:
            return self.shared_arena_bytes
        return max((p.arena_bytes for p in self.plans), default=0)

    @property
    def training_bytes(self) -> int:
        """Bytes training adds to a loaded checkpoint: gradients, optimizer state, the arena, folded constants."""
        return (self.gradient_bytes + self.optimizer_bytes + self.arena_bytes
                + sum(p.constant_bytes + p.body_arena_bytes for p in self.plans))

    @property
    def peak_bytes(self) -> int:
        """The predicted peak of training's buffers: the parameters and what training adds."""
        return self.parameter_bytes + self.training_bytes

    def to_dict(self) -> dict:
        return {"parameters": {"bytes": self.parameter_bytes, "trainable_bytes": self.trainable_parameter_bytes,
                               "frozen_bytes": self.frozen_parameter_bytes,
                               "frozen_bytes_by_type": dict(self.frozen_bytes_by_type)},
                "gradient_bytes": self.gradient_bytes,
                "optimizer": {"kind": self.optimizer_kind, "states": list(self.optimizer_states),
                              "bytes": self.optimizer_bytes},
                "saved_by_freezing": dict(zip(("gradient_bytes", "optimizer_bytes"), self.saved_by_freezing)),
                "plans": [p.to_dict() for p in self.plans],
                "arena_bytes": self.arena_bytes, "training_bytes": self.training_bytes, "peak_bytes": self.peak_bytes,
                "runtime_floor_included": False}

    def _frozen_types(self) -> str:
        """': int8 1.2 MiB, float32 3.0 KiB' when the frozen parameters are held in more than float32."""
        if set(self.frozen_bytes_by_type) <= {"float32"}:
            return ""
        return ": " + ", ".join(f"{name} {format_bytes(n)}" for name, n in self.frozen_bytes_by_type.items())

    def render(self) -> str:
        def row(label: str, nbytes: int, note: str = "") -> str:
            return f"{label:<18}{format_bytes(nbytes):>11}" + (f"  {note}" if note else "")

        states = ", ".join(self.optimizer_states) or "no state"
        saved_gradients, saved_state = self.saved_by_freezing
        lines = [row("parameters", self.parameter_bytes, f"({format_bytes(self.trainable_parameter_bytes)} trainable, "
                     f"{format_bytes(self.frozen_parameter_bytes)} frozen{self._frozen_types()})"),
                 row("gradients", self.gradient_bytes,
                     f"(frozen parameters save {format_bytes(saved_gradients)})" if saved_gradients else ""),
                 row("optimizer state", self.optimizer_bytes,
                     (f"({self.optimizer_kind}: {states}" if self.optimizer_kind else "(no optimizer") +
                     (f"; frozen parameters save {format_bytes(saved_state)})" if saved_state else ")"))]
        for p in self.plans:
            shapes = ", ".join(f"{name}[{', '.join(map(str, shape))}]" for name, shape in p.shapes)
            ops = f"; {count(p.plan.steps, 'op')}" if p.plan is not None else ""
            lines.append(f"{'training' if p.mode == 'train' else p.mode} step ({shapes}{ops})")
            lines.append(row("  arena", p.arena_bytes, f"{p.arena_bytes / max(p.lower_bound, 1):.2f}x its lower "
                             f"bound ({format_bytes(p.lower_bound)})"))
            if p.no_reuse_bytes:
                lines.append(row("  without reuse", p.no_reuse_bytes, "every value in bytes of its own: "
                                 f"{p.no_reuse_bytes / max(p.arena_bytes, 1):.1f}x the arena"))
            lines.append(row("  folded constants", p.constant_bytes))
            lines.extend(_loop_rows(p, row))
            lines.append(f"{'  recomputed nodes':<18}{p.recomputed_nodes:>11,}")
        if len(self.plans) > 1:
            lines.append(row("shared arena", self.arena_bytes, "one buffer for these steps, which never run at once"))
        lines.append(row("training adds", self.training_bytes,
                         "to the loaded checkpoint (gradients, optimizer state, arena, folded constants"
                         + (", loop bodies' arenas)" if any(p.loops for p in self.plans) else ")")))
        lines.append(row("predicted peak", self.peak_bytes, "with the parameters"))
        lines.append(self.runtime)
        return "\n".join(lines)


def _loop_rows(plan: PlanMemory, row) -> list[str]:
    """The rows of a plan's If, Loop and Scan nodes: each one's bodies' arenas (held beside the step's arena,
    against their lower bound) and the bytes of the step's arena that stack what its iterations save."""
    lines = []
    for loop in plan.loops:
        runs = f"{loop.iterations:,} iterations, " if loop.iterations is not None else ""
        ratio = loop.body_arena_bytes / max(loop.body_lower_bound, 1)
        lines.append(row("  loop body", loop.body_arena_bytes, f"{loop.node}: {runs}its arena {ratio:.2f}x its lower "
                         "bound, beside the step's"))
        if loop.saved_bytes:
            per = f" ({format_bytes(loop.saved_bytes // loop.iterations)} each)" if loop.iterations else ""
            lines.append(row("  saved iterations", loop.saved_bytes, f"{loop.node}: the state each iteration starts "
                             f"from{per}, in the arena until the backward"))
    return lines


def report(module) -> MemoryReport:
    """The memory of a Module and of the plans it has bound so far (run a step of each shape first)."""
    buffers = module.state.buffer_bytes()
    result = MemoryReport(
        parameter_bytes=buffers.parameter_bytes,
        gradient_bytes=buffers.gradient_bytes,
        optimizer_bytes=sum(buffers.optimizer_state_bytes.values()),
        trainable_parameter_bytes=buffers.trainable_parameter_bytes,
        optimizer_kind=buffers.optimizer_kind,
        optimizer_states=tuple(buffers.optimizer_state_bytes),
        shared_arena_bytes=module.arena_bytes,
        frozen_bytes_by_type=buffers.frozen_bytes_by_type,
        runtime=runtime_floor(module.kernel_library))
    for step in module.bound_steps():
        result.plans.append(PlanMemory(step.mode, step.inputs, step.arena_bytes, step.lower_bound, step.constant_bytes,
                                       step.recomputed_nodes, step.plan.no_reuse_bytes, step.plan, step.loss_step,
                                       step.loops))
    return result


def from_artifacts(directory, batch_size: int, memory_budget: int | None = None,
                   sequence_length: int | None = None, input_shapes: dict | None = None) -> MemoryReport:
    """The report of an artifact folder's training step (and eval step, if it has an eval model) at
    `batch_size` (and `sequence_length` for the inputs' other symbolic axes, or the whole shapes of
    `input_shapes` by input name), planned under `memory_budget`
    bytes if given: the plans are bound, no step runs.

    Optimizer state is what the folder's optimizer model creates (none without one). Raises
    MemoryBudgetError when no plan meets the budget."""
    from .api import CheckpointState, Module, Optimizer

    refuse_a_model(directory)
    paths = ArtifactPaths.of(directory)
    missing = paths.missing("training_model", "checkpoint")
    if missing:
        raise ArtifactNotFoundError(f"'{paths.directory}' is not an artifact folder: it lacks {', '.join(missing)}; "
                                    "generate the artifacts with `odtrain prepare` or "
                                    "odtrain.artifacts.generate_artifacts")
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    with_eval = paths.has("eval_model")
    module = Module(paths.training_model, state, paths.eval_model if with_eval else None, memory_budget=memory_budget)
    if paths.has("optimizer_model"):
        Optimizer(paths.optimizer_model, module)
    for training in (True, False) if with_eval else (True,):
        module.bind_at(batch_size, training, sequence_length, input_shapes)
    return report(module)


# A PNG of a training step's memory over time (`odtrain memory --plot`; needs matplotlib: odtrain[plot]).
# Two panels share the x axis, the position in the step's execution order (0: the feeds are written; the last
# position: outputs held to the end): top, everything training holds (constant bands for the parameters, the
# gradient buffer, the optimizer state and folded constants, with the arena's live bytes stacked on them);
# bottom, the arena alone, stacked by category (planner.CATEGORIES), with the arena as planned and its lower
# bound as lines; the tallest stack touches the lower bound. A vertical line marks the loss.

CONSTANT_COLORS = {"parameters": "#9e9e9e", "gradient buffer": "#c7c7c7", "optimizer state": "#dadada",
                   "folded constants": "#ececec", "loop bodies' arenas": "#f3e0c0"}
ARENA_COLORS = {"inputs": "#8c564b", "saved for backward": "#1f77b4", "forward temporaries": "#aec7e8",
                "backward": "#ff7f0e", "scratch": "#9467bd", "recomputed": "#2ca02c", SAVED_ITERATIONS: "#17becf"}


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
                 "optimizer state": report.optimizer_bytes, "folded constants": step.constant_bytes,
                 "loop bodies' arenas": step.body_arena_bytes}
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
                    + ("the Python/Numba runtime floor" if report.runtime == RUNTIME_FLOOR else "the runtime floor")
                    + " is not included", fontsize=11)
    figure.savefig(os.fspath(path), dpi=110)
