"""Recomputation: fit a training step under a memory budget by recomputing activations.

A forward value whose contents a backward node reads ("saved activation")
normally lives from the forward pass until its backward use. Unless it is
kept as a checkpoint, its life instead ends at its last forward use; just
before its first backward use the forward nodes that produce it run again
(clones), from values that are still alive: kept activations, feeds,
parameters and constants. A clone that needs another activation which is not
kept recomputes that one first, so the run between two checkpoints is
recomputed as one segment, as in Chen et al. (2016), "Training deep nets
with sublinear memory cost". Inputs read for their shape only are never
recomputed.

Invariants:
- Clones compute exactly what the originals computed (same kernels, same
  inputs), so losses and gradients are bit-identical with and without a budget.
- Clones never write state: outputs that update parameters (BatchNormalization's
  running statistics) are dropped from them, and random ops (registered
  with `random=True`, as Dropout is) are never recomputed: their outputs are
  read as they are, kept alive as long as a clone or backward node needs them.
- Which values are kept is the planner's choice (`choose_kept`), by cost, as in
  Checkmate (Jain et al., 2020): dropping an activation frees its bytes between
  its last forward read and its next use and costs the work of the clones it
  needs (`graph/cost.py`: a Relu or BatchNormalization is cheap to run again, a
  Conv or MatMul is not). Drops are chosen greedily, by bytes freed at the steps
  over the budget per unit of work, and checked with the real planner; when that
  fails, every k-th saved activation is kept, for the smallest k whose plan fits;
  when none does, drops are chosen again aiming below the smallest of those plans.
  If no choice fits, the error names the smallest arena of the plans that do not
  depend on the budget (the evenly spaced ones and those aims'), so a budget that
  large is met.
- Without a budget, `cheap_kept` still drops the saved activations that cheap
  nodes (elementwise, normalizations, copies: no product, no window, at most
  CHEAP_UNITS of work per output element) recompute from values no larger than
  they are: a SiLU's sigmoid and product from the gate, a norm's output from
  its input, a repeated key from the key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .cost import node_cost
from .ir import Graph, Node, TensorType
from .ops import lookup
from .planner import MemoryPlan
from .schedule import RECOMPUTE_SUFFIX

MAX_ROUNDS = 6  # plans each pass of the peak covering may make before falling back to strides
CHEAP_UNITS = 8.0  # work per output element (graph/cost.py's unit) up to which a node is cheap to run again
CHEAP_SEGMENT = 4  # cheap nodes at most that one dropped activation's clones may run
LADDER = (0.9, 0.8, 0.7, 0.6, 0.5)  # shares of the evenly spaced choices' smallest arena aimed at last


def saved_activations(order: list[Node], backward: set[int], arena_values: set[str]) -> list[str]:
    """Forward values in the arena whose contents a backward node reads, in forward order."""
    forward_outputs = [o for n in order if id(n) not in backward for o in n.outputs if o in arena_values]
    read_backward = {n.inputs[k] for n in order if id(n) in backward for k in _read(n)}
    return [v for v in forward_outputs if v in read_backward]


def _read(node: Node) -> list[int]:
    """Indices of the inputs whose contents the node reads (not only their shapes)."""
    shape_only = lookup(node).shape_only
    return [k for k, name in enumerate(node.inputs) if name and k not in shape_only]


def recomputable(node: Node) -> bool:
    """Whether running the node again gives what it gave: not a random op."""
    return not lookup(node).random


def rewrite(order: list[Node], backward: set[int], kept: set[str], arena_values: set[str]) -> list[Node]:
    """The order with every forward activation outside `kept` recomputed before its backward uses.

    A clone reads kept activations, feeds, parameters and constants as they are, and recomputes
    the other forward activations it needs first (each once; later uses share the clone).
    Outputs of random ops are read as they are, and so are inputs read for their shape only.
    """
    producer = {o: n for n in order if id(n) not in backward for o in n.outputs if o}
    recomputed = {v for v, n in producer.items() if v in arena_values and v not in kept and recomputable(n)}
    clones: dict[str, str] = {}
    result: list[Node] = []

    def with_clones(node: Node) -> list[str]:
        inputs = list(node.inputs)
        for k in _read(node):
            if inputs[k] in recomputed:
                inputs[k] = materialize(inputs[k])
        return inputs

    def materialize(value: str) -> str:
        if value in clones:
            return clones[value]
        node = producer[value]
        inputs = with_clones(node)
        updates = {o for o, _ in lookup(node).updates}
        outputs = []
        for index, out in enumerate(node.outputs):
            if not out or index in updates:
                outputs.append("")
                continue
            clones[out] = f"{out}{RECOMPUTE_SUFFIX}"
            outputs.append(clones[out])
        result.append(Node(node.op_type, inputs, outputs, dict(node.attrs), f"{node.name}{RECOMPUTE_SUFFIX}", node.domain))
        return clones[value]

    for node in order:
        if id(node) in backward and any(node.inputs[k] in recomputed for k in _read(node)):
            node = Node(node.op_type, with_clones(node), list(node.outputs), dict(node.attrs), node.name, node.domain)
        result.append(node)
    return result


def cheap(node: Node, types: dict[str, TensorType]) -> bool:
    """Whether running the node again costs about as much as reading its output: no product, no sliding
    window, no body (If, Loop, Scan), no random numbers, no state update, at most CHEAP_UNITS of work per
    output element."""
    opdef = lookup(node)
    if opdef.random or opdef.flops is not None or opdef.window_reads is not None or opdef.updates:
        return False
    if any(isinstance(value, Graph) for value in node.attrs.values()):
        return False  # a body's work is not in the cost of the node's values
    produced = sum(types[o].size for o in node.outputs if o and o in types and types[o].is_static)
    return node_cost(node, types) <= CHEAP_UNITS * max(produced, 1)


def cheap_kept(order: list[Node], backward: set[int], arena_values: set[str],
               types: dict[str, TensorType]) -> set[str]:
    """The activations to keep (`rewrite`'s `kept`) when cheap nodes recompute what they can for less memory.

    In forward order, a saved activation made by a cheap node is dropped when the values its clones
    would read that nobody keeps yet, kept instead, take fewer bytes than it does. Its clones run
    back through cheap nodes (CHEAP_SEGMENT of them at most) to kept values, parameters, constants
    and feeds; the value where the segment stops is kept.
    """
    saved = saved_activations(order, backward, arena_values)
    producers = {o: n for n in order if id(n) not in backward for o in n.outputs if o}
    kept = set(saved)
    for value in saved:
        if not cheap(producers[value], types):
            continue
        segment, keep, stack = set(), set(), [value]
        while stack:
            node = producers[stack.pop()]
            if id(node) in segment:
                continue
            segment.add(id(node))
            for k in _read(node):
                name = node.inputs[k]
                if name not in producers or name not in arena_values or name in kept:
                    continue  # held outside the arena, a feed, or kept anyway
                if (len(segment) < CHEAP_SEGMENT and recomputable(producers[name])
                        and cheap(producers[name], types)):
                    stack.append(name)
                else:  # the segment starts here
                    keep.add(name)
        if sum(types[k].nbytes for k in keep) < types[value].nbytes:
            kept.discard(value)
            kept.update(keep)
    return kept


class _Choice:
    """Which saved activations are kept, the forward nodes their clones run, and those clones' lives.

    `live` holds, for each recomputed value, the steps of the last plan (first, last) between
    which its clone is estimated to be alive, and `need`, for each kept saved activation, the
    first step at which a later node or a clone reads it; choices made since then update both.
    Without `chains`, a drop that would run an existing clone earlier (lengthening a segment)
    is refused, and `blocked` records that one was.
    """

    def __init__(self, saved: list[str], producers: dict[str, Node], arena_values: set[str],
                 types: dict[str, TensorType], kept: set[str], chains: bool = True):
        self.order, self.saved = saved, set(saved)  # forward order, for deterministic choices
        self.producers, self.arena_values, self.types = producers, arena_values, types
        self.kept = set(kept)
        self.cloned: set[int] = set()
        self.live: dict[str, tuple[int, int]] = {}
        self.need: dict[str, int] = {}
        self.chains, self.blocked = chains, False
        self._costs: dict[int, float] = {}

    def node_cost(self, node: Node) -> float:
        if id(node) not in self._costs:
            self._costs[id(node)] = node_cost(node, self.types)
        return self._costs[id(node)]

    def recomputed(self, value: str, dropping=()) -> bool:
        """Whether a clone recomputes `value` rather than reading it (as `rewrite` decides)."""
        node = self.producers.get(value)
        return (node is not None and value in self.arena_values and recomputable(node)
                and (value not in self.kept or value in dropping))

    def effect(self, members: list[str], need: int):
        """What dropping `members`, first needed again at step `need`, adds: the work of the clones
        it needs that do not exist yet, (value, first, last) steps where clones live longer, and
        the kept values those clones read at `need`.

        A new clone of a forward temporary lives about one step, until the clone that reads it;
        an existing clone now needed at `need` lives from `need` on, or until `need`. None when
        the drop would run an existing clone earlier and chains are not allowed.
        """
        dropping = set(members)
        cost, longer, read, seen, counted = 0.0, [], [], set(), set()
        stack = list(members)
        while stack:
            value = stack.pop()
            if value in seen:
                continue
            seen.add(value)
            node = self.producers[value]
            if value in self.live:
                first, last = self.live[value]
                if need > last:
                    longer.append((value, last + 1, need))
                if need >= first:
                    continue
                if not self.chains:
                    self.blocked = True
                    return None
                longer.append((value, need, first - 1))  # materialized earlier, and so are its inputs
            else:
                if id(node) not in self.cloned and id(node) not in counted:
                    counted.add(id(node))
                    cost += self.node_cost(node)
                if value not in dropping:
                    longer.append((value, need, need))
            for k in _read(node):
                name = node.inputs[k]
                if self.recomputed(name, dropping):
                    stack.append(name)
                elif name in self.need:
                    read.append(name)
        return cost, longer, read

    def drop(self, members: list[str], need: int, end: int, longer, read) -> None:
        self.kept.difference_update(members)
        for value in members:
            self.live[value] = (need, end)
            self.cloned.add(id(self.producers[value]))
            self.need.pop(value, None)
        for value, first, last in longer:
            was = self.live.get(value, (first, last))
            self.live[value] = (min(was[0], first), max(was[1], last))
            self.cloned.add(id(self.producers[value]))
        for value in read:
            self.need[value] = min(self.need[value], need)

    def observe(self, plan) -> None:
        """Take the clones' lives (and which nodes are cloned) from `plan` of the kept values."""
        last_read: dict[str, int] = {}
        for step, node in enumerate(plan.order, start=1):
            for name in node.inputs:
                if name.endswith(RECOMPUTE_SUFFIX):
                    last_read[name] = step
        self.live = {}
        for name, first in plan.written.items():
            if name.endswith(RECOMPUTE_SUFFIX):
                value = name.removesuffix(RECOMPUTE_SUFFIX)
                self.live[value] = (first, last_read.get(name, first))
                self.cloned.add(id(self.producers[value]))


@dataclass
class _Unit:
    """Saved activations that share storage, dropped together. Dropping them frees `nbytes` from
    the step after their last forward read (`start`) to the step before they are needed again."""

    members: list[str]
    nbytes: int
    start: int
    end: int


def _units(plan, choice: _Choice, forward: set[int]) -> list[_Unit]:
    """The storage groups of kept, recomputable saved activations in `plan`; sets `choice.need`."""
    last_forward: dict[str, int] = {}
    first_later: dict[str, int] = {}
    for step, node in enumerate(plan.order, start=1):
        is_forward = id(node) in forward
        for k in _read(node):
            name = node.inputs[k]
            if is_forward:
                last_forward[name] = step
            else:
                first_later.setdefault(name, step)
    choice.need = {v: first_later[v] for v in choice.order if v in choice.kept and v in first_later}
    units, seen = [], set()
    for value in choice.order:
        index = plan.group_of.get(value)
        if value not in choice.need or index is None or index in seen:
            continue
        seen.add(index)
        group = plan.groups[index]
        if group.end > plan.steps:  # a graph output: alive to the end anyway
            continue
        members = [m for m in group.values if m in choice.need]
        if (any(not recomputable(choice.producers[m]) for m in members)
                or any(plan.written.get(m) == 0 for m in group.values)):  # random, or a view of a feed
            continue
        last = max(max(plan.written[m], last_forward.get(m, 0)) for m in group.values if m in choice.producers)
        units.append(_Unit(members, group.nbytes, last + 1, group.end))
    return units


def _cover(plan, choice: _Choice, forward: set[int], budget: int) -> list[str]:
    """Saved activations to drop so that, by estimate, no step of `plan` holds more than fits.

    Greedy weighted covering: a drop lowers the live bytes of the steps between the value's last
    forward read and the step it is needed again, and raises them where clones live longer
    (counted as if every step over the target were already down to it). The drop that removes
    the most bytes over the target per unit of recompute work goes first, until no step exceeds
    the target (the budget less the plan's fragmentation) or nothing helps. Scores are
    re-evaluated lazily: a drop is taken when its fresh score still beats the others' earlier ones.
    """
    live = plan.live_profile()
    target = budget - (plan.arena_bytes - plan.lower_bound)
    units = _units(plan, choice, forward)
    if target <= 0:
        return []
    sizes: dict[str, int] = {}

    def nbytes(value: str) -> int:
        if value not in sizes:
            sizes[value] = choice.types[value].nbytes
        return sizes[value]

    def score(unit: _Unit):
        need = min(choice.need[m] for m in unit.members)
        excess = np.maximum(live[unit.start:need] - target, 0)
        gain = float(np.minimum(excess, unit.nbytes).sum())
        if gain <= 0:
            return None
        effect = choice.effect(unit.members, need)
        if effect is None:
            return None
        cost, longer, read = effect
        for value, a, b in longer:
            gain -= float(np.maximum(np.minimum(live[a:b + 1], target) + nbytes(value) - target, 0).sum())
        if gain <= 0:
            return None
        return gain / (cost + 1.0), need, longer, read

    pending = []  # (score, index, unit), best first
    for index, unit in enumerate(units):
        scored = score(unit)
        if scored is not None:
            pending.append((scored[0], index, unit))
    pending.sort(key=lambda item: (-item[0], item[1]))
    dropped: list[str] = []
    while pending and (live > target).any():
        _, index, unit = pending.pop(0)
        scored = score(unit)
        if scored is None:
            continue
        if pending and scored[0] < pending[0][0]:  # stale: no longer the best
            at = next((k for k, item in enumerate(pending) if (-item[0], item[1]) > (-scored[0], index)), len(pending))
            pending.insert(at, (scored[0], index, unit))
            continue
        _, need, longer, read = scored
        live[unit.start:need] -= unit.nbytes
        for value, a, b in longer:
            live[a:b + 1] += nbytes(value)
        choice.drop(unit.members, need, unit.end, longer, read)
        dropped.extend(unit.members)
    return dropped


def _strides(count: int) -> list[int]:
    """Candidate keep-every-k values: 1 (keep all), then roughly geometric up to `count`."""
    strides, k = [1], 2
    while k <= count:
        strides.append(k)
        k = k + 1 if k < 12 else int(k * 1.5)
    return strides


def _greedy(saved: list[str], producers: dict[str, Node], plan_of: Callable[[set[str]], MemoryPlan], types, arena_values,
            forward: set[int], unconstrained: MemoryPlan, start: set[str], aim: int, budget: int,
            modes=(False, True)) -> tuple[set[str] | None, int]:
    """Cover the peaks of the plan over `aim` bytes (`_cover`), planning again after each round, at most
    MAX_ROUNDS plans a mode (without chains, then with them when that was refused); returns the first
    choice whose plan fits `budget` with its arena bytes, or (None, the smallest arena planned). Which
    plans are made depends on `aim` alone, not on `budget`."""
    smallest = unconstrained.arena_bytes
    for chains in modes:
        choice = _Choice(saved, producers, arena_values, types, start, chains)
        plan = unconstrained
        for _ in range(MAX_ROUNDS):
            if not _cover(plan, choice, forward, aim):
                break
            plan = plan_of(choice.kept)
            if plan.arena_bytes <= budget:
                return choice.kept, plan.arena_bytes
            smallest = min(smallest, plan.arena_bytes)
            choice.observe(plan)
        if not choice.blocked:  # allowing chains would choose the same
            break
    return None, smallest


def choose_kept(saved: list[str], producers: dict[str, Node], plan_of: Callable[[set[str]], MemoryPlan], budget: int,
                types: dict[str, TensorType], arena_values: set[str],
                unconstrained: MemoryPlan | None = None, start: set[str] | None = None) -> tuple[set[str] | None, int]:
    """The checkpoints (kept activations) whose plan fits `budget`, with little recompute work.

    `producers` maps forward values to their nodes; `plan_of(kept)` plans the rewritten order
    (the real planner); `start` is the choice to drop more from (default: every saved activation
    kept) and `unconstrained` its plan, if known.
    Returns (kept, its arena bytes), or (None, the smallest arena of the plans that do not depend on
    the budget: the evenly spaced choices and the aims below them), so any budget at least that
    large is met.

    1. Cover the peaks (`_greedy`): from the plan of the current choice, drop the kept
       activations that free the most bytes at the steps over the budget per unit of recompute
       work (`graph.cost`), then plan again; at most MAX_ROUNDS plans. A first pass makes only
       drops whose clones start from checkpoints or from clones that already run by then
       (short segments, little work); if it stalls where a longer segment would have helped,
       a second pass starts over allowing them.
    2. Otherwise keep every k-th saved activation for growing k (then none but the
       unrecomputable ones), Chen et al.'s segments, and take the first that fits.
    3. Otherwise cover the peaks again, aiming at LADDER shares of the smallest of those
       evenly spaced arenas: the covering's estimates err, and aiming below a budget meets
       budgets that aiming at them misses (a Llama-3.2-1B-shaped int4 LoRA step at sequence 256:
       the evenly spaced choices reach 172 MiB, covering reaches 107 MiB).
    Outputs of random ops are always kept. A choice that fits is returned at once: the passes
    go from little recomputation to much.
    """
    forced = {v for v in saved if not recomputable(producers[v])}
    forward = {id(node) for node in producers.values()}
    start = set(saved) if start is None else start
    unconstrained = unconstrained if unconstrained is not None else plan_of(start)
    covering = (saved, producers, plan_of, types, arena_values, forward, unconstrained, start)
    kept, size = _greedy(*covering, aim=budget, budget=budget)
    if kept is not None:
        return kept, size
    smallest = unconstrained.arena_bytes
    choices = [{v for k, v in enumerate(saved) if k % stride == stride - 1} for stride in _strides(len(saved))]
    for kept in choices[1:] + [set()]:
        kept = kept | forced
        size = plan_of(kept).arena_bytes
        if size <= budget:
            return kept, size
        smallest = min(smallest, size)
    evenly_spaced = smallest
    for share in LADDER:
        kept, size = _greedy(*covering, aim=int(evenly_spaced * share), budget=budget, modes=(True,))
        if kept is not None:
            return kept, size
        smallest = min(smallest, size)
    return None, smallest
