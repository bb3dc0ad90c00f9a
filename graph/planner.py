"""Memory planning: every intermediate tensor of a step placed in one arena.

A plan is built by three pure steps over the execution order:
- Lifetimes: a value lives from the step that produces it (0 for feeds) to
  its last read (graph outputs to the end). Reads of `shape_only` inputs do
  not count.
- Storage groups: a view op's output shares its input's storage; an op that
  may work in place writes over an input that dies at that step, when the
  sizes match and no other input of the node shares that storage. A
  group lives from its first definition to its members' last read.
- Offsets: groups sorted by size, largest first; each goes into the
  best-fitting gap among the already placed groups whose lifetimes overlap
  its own, else above them. Sizes and offsets are multiples of 64 bytes.

The lower bound is the largest sum of live group sizes at any step: no
placement of this order and these groups can use less. `MemoryPlan.verify()`
proves that no two groups overlap in both time and address, that every
value lives within its group's span, and that no node writes into a group
(in place) while a value written there earlier is still to be read.

Reading a plan (pure functions of it):
- `no_reuse_bytes`: the arena if nothing shared bytes, neither over time nor
  in place nor as views: the sum of every arena value's aligned size.
- `live_bytes(category)`: bytes live at each step (0: feeds written, k: the
  k-th node of the order, steps + 1: outputs held), split by the category of
  the value each group holds at that step (its most recently written member).
  Every step's categories sum to the live groups' sizes, so the maximum over
  steps is the lower bound.
- `training_categories`: inputs, saved for backward, forward temporaries,
  backward, scratch and recomputed, from the loss gradient seed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .ir import Node, TensorType
from .ops import is_view, lookup
from .schedule import RECOMPUTE_SUFFIX, split_forward_backward

ALIGNMENT = 64
SCRATCH_SUFFIX = "::scratch"  # a node's working memory is named `<node name>::scratch` (graph/step_plan.py)
CATEGORIES = ("inputs", "saved for backward", "forward temporaries", "backward", "scratch", "recomputed")


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass
class StorageGroup:
    """Values sharing one stretch of the arena (a value and its views / in-place successors)."""

    values: list[str]
    nbytes: int
    start: int
    end: int
    offset: int = -1


@dataclass
class MemoryPlan:
    """Where and when each arena value of one step lives: the innermost of a step's plans (the others:
    graph/step_plan.py's StepPlan)."""

    order: list[Node]
    groups: list[StorageGroup]
    group_of: dict[str, int]
    arena_bytes: int
    lower_bound: int
    steps: int = 0
    types: dict[str, TensorType] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)  # arena value -> the step that writes it
    read_until: dict[str, int] = field(default_factory=dict)  # arena value -> its last read (steps + 1: output)

    @property
    def no_reuse_bytes(self) -> int:
        """The arena if every value (and scratch buffer) had bytes of its own."""
        return sum(aligned(self.types[name].nbytes) for name in self.group_of)

    def live_profile(self) -> np.ndarray:
        """Bytes alive at each step 0..steps+1, all groups together."""
        return live_profile(self.groups, self.steps)

    def live_bytes(self, category: Callable[[str], str] | None = None) -> dict[str, np.ndarray]:
        """Bytes live at each step 0..steps+1, per category of the values the groups hold then.

        `category` maps an arena value's name to its category (default: everything is "arena").
        At each step a group counts under its most recently written member; keys come in order
        of first appearance. The rows sum to the live groups' sizes, whose maximum is the lower bound.
        """
        category = category or (lambda name: "arena")
        rows: dict[str, np.ndarray] = {}
        for g in self.groups:
            members = sorted(g.values, key=lambda name: self.written.get(name, g.start))
            for k, name in enumerate(members):
                begin = max(self.written.get(name, g.start), g.start)
                end = g.end if k + 1 == len(members) else self.written.get(members[k + 1], g.start) - 1
                if end < begin:
                    continue
                row = rows.setdefault(category(name), np.zeros(self.steps + 2, dtype=np.int64))
                row[begin:end + 1] += g.nbytes
        return rows

    def offset(self, value: str) -> int:
        return self.groups[self.group_of[value]].offset

    def verify(self) -> None:
        """Raise AssertionError unless placements are aligned, in bounds and free of live overlaps, and no
        value is overwritten in place while it is still to be read."""
        if not self.groups:
            return
        self._verify_lifetimes()
        starts = np.array([g.start for g in self.groups])
        ends = np.array([g.end for g in self.groups])
        lows = np.array([g.offset for g in self.groups])
        highs = lows + np.array([g.nbytes for g in self.groups])
        assert (lows >= 0).all() and (lows % ALIGNMENT == 0).all(), "unplaced or misaligned group"
        assert (highs <= self.arena_bytes).all(), "group beyond the arena"
        for i, g in enumerate(self.groups):
            if g.nbytes == 0:
                continue
            clash = (starts <= g.end) & (ends >= g.start) & (lows < highs[i]) & (highs > lows[i])
            clash[i] = False
            clash &= highs > lows  # zero-sized groups never clash
            assert not clash.any(), (f"{g.values} overlaps {self.groups[int(np.argmax(clash))].values} "
                                     "in time and address")
        for name, index in self.group_of.items():
            assert name in self.groups[index].values
            assert self.types[name].nbytes <= self.groups[index].nbytes

    def _verify_lifetimes(self) -> None:
        """Every value lives within its group's span; a node that writes a group's bytes (any output
        but a view's) does so at the last read of every value written there before it."""
        for name, index in self.group_of.items():
            g = self.groups[index]
            assert g.start <= self.written[name] and self.read_until[name] <= g.end, \
                f"'{name}' lives outside its group's steps {g.start}..{g.end}"
        for step, node in enumerate(self.order, start=1):
            opdef = lookup(node)
            viewed = is_view(opdef, [self.types.get(i) for i in node.inputs], [self.types.get(o) for o in node.outputs])
            for o_index, out in enumerate(node.outputs):
                if out not in self.group_of or (o_index == 0 and viewed):
                    continue
                for name in self.groups[self.group_of[out]].values:
                    assert not (self.written[name] < step < self.read_until[name]), \
                        f"{node.describe()} writes '{out}' over '{name}', which is read until step " \
                        f"{self.read_until[name]} (this is step {step})"

    def render(self, width: int = 60) -> str:
        """A text timeline: one row per storage group, its offset, size and live steps."""
        lines = [f"arena {self.arena_bytes:,} B, lower bound {self.lower_bound:,} B "
                 f"({self.arena_bytes / max(self.lower_bound, 1):.3f}x), {self.steps} steps"]
        scale = max(self.steps + 1, 1)
        for g in sorted(self.groups, key=lambda g: g.offset):
            left = g.start * width // scale
            right = max(left + 1, (g.end + 1) * width // scale)
            bar = " " * left + "#" * (right - left)
            lines.append(f"{g.offset:>12,} {g.nbytes:>12,} |{bar:<{width}}| {g.values[0]}"
                         + (f" (+{len(g.values) - 1} aliases)" if len(g.values) > 1 else ""))
        return "\n".join(lines)


def plan_memory(order: list[Node], types: dict[str, TensorType], arena_values: set[str],
                feeds: list[str], outputs: list[str], scratch: dict[int, str] | None = None) -> MemoryPlan:
    """Place `arena_values` (feeds and node outputs held in the arena) for `order`.

    `scratch` maps a node's index in `order` to the name of its working memory (typed in
    `types`), which lives for that node's step only.
    """
    end_step = len(order) + 1
    first: dict[str, int] = {name: 0 for name in feeds if name in arena_values}
    last: dict[str, int] = dict(first)
    scratch = scratch or {}
    for index, name in scratch.items():
        first[name] = last[name] = index + 1
    for step, node in enumerate(order, start=1):
        shape_only = lookup(node).shape_only
        for k, name in enumerate(node.inputs):
            if name in arena_values and k not in shape_only:
                last[name] = step
        for name in node.outputs:
            if name in arena_values:
                first[name] = step
                last.setdefault(name, step)
    for name in outputs:
        if name in arena_values:
            last[name] = end_step

    groups: list[StorageGroup] = []
    group_of: dict[str, int] = {}

    def new_group(name: str) -> None:
        group_of[name] = len(groups)
        groups.append(StorageGroup([name], aligned(types[name].nbytes), first[name], last[name]))

    def join(name: str, index: int) -> None:
        group_of[name] = index
        g = groups[index]
        g.values.append(name)
        g.end = max(g.end, last[name])

    for name in feeds:
        if name in arena_values:
            new_group(name)
    for step, node in enumerate(order, start=1):
        if step - 1 in scratch:
            new_group(scratch[step - 1])
        opdef = lookup(node)
        in_types = [types.get(i) for i in node.inputs]
        out_types = [types.get(o) for o in node.outputs]
        for o_index, out in enumerate(node.outputs):
            if out not in arena_values:
                continue
            target = None
            if o_index == 0 and is_view(opdef, in_types, out_types) and node.inputs[0] in group_of:
                target = group_of[node.inputs[0]]
            else:
                for o, i in opdef.inplace:
                    src = node.inputs[i] if i < len(node.inputs) else ""
                    if o != o_index or src not in group_of:
                        continue
                    index = group_of[src]
                    g = groups[index]
                    others = [n for k, n in enumerate(node.inputs) if k != i and n and group_of.get(n) == index and n != src]
                    if g.end == step and g.nbytes == aligned(types[out].nbytes) and not others \
                            and types[src].nbytes == types[out].nbytes and not _is_output(g, outputs):
                        target = index
                        break
            if target is None:
                new_group(out)
            else:
                join(out, target)

    _place(groups)
    arena = max((g.offset + g.nbytes for g in groups), default=0)
    return MemoryPlan(order, groups, group_of, arena, int(live_profile(groups, len(order)).max()), len(order), dict(types),
                {name: first[name] for name in group_of}, {name: last[name] for name in group_of})


def training_categories(plan: MemoryPlan, seed: str) -> dict[str, str]:
    """The category (one of CATEGORIES) of every arena value of a plan whose backward pass starts at `seed`.

    Scratch and recomputed values by their names' suffixes; feeds are inputs; outputs of nodes that
    depend on the seed are backward values (gradients in flight); a forward value that a backward
    node reads is saved for backward; other forward values are temporaries (model outputs among them).
    """
    _, backward = split_forward_backward(plan.order, seed)
    read_backward = {i for node in plan.order if id(node) in backward for i in node.inputs}
    backward_values = {o for node in plan.order if id(node) in backward for o in node.outputs}
    result = {}
    for name in plan.group_of:
        if name.endswith(SCRATCH_SUFFIX):
            result[name] = "scratch"
        elif name.endswith(RECOMPUTE_SUFFIX):
            result[name] = "recomputed"
        elif plan.written.get(name) == 0:
            result[name] = "inputs"
        elif name in backward_values:
            result[name] = "backward"
        elif name in read_backward:
            result[name] = "saved for backward"
        else:
            result[name] = "forward temporaries"
    return result


def _is_output(group: StorageGroup, outputs: list[str]) -> bool:
    return any(v in outputs for v in group.values)


def _place(groups: list[StorageGroup]) -> None:
    placed: list[StorageGroup] = []
    for g in sorted(groups, key=lambda g: (-g.nbytes, g.start)):
        live = sorted((p for p in placed if p.start <= g.end and p.end >= g.start and p.nbytes),
                      key=lambda p: p.offset)
        best, best_gap, cursor = None, None, 0
        for p in live:
            gap = p.offset - cursor
            if gap >= g.nbytes and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, p.offset + p.nbytes)
        g.offset = best if best is not None else cursor
        placed.append(g)


def live_profile(groups: list[StorageGroup], steps: int) -> np.ndarray:
    """Bytes of the groups alive at each step 0..steps+1 (its maximum is the lower bound)."""
    change = np.zeros(steps + 3, dtype=np.int64)
    for g in groups:
        change[g.start] += g.nbytes
        change[g.end + 1] -= g.nbytes
    return np.cumsum(change)[:steps + 2]
