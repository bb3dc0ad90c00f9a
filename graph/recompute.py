"""Recomputation: fit a training step under a memory budget by recomputing activations.

A forward value that a backward node reads ("saved activation") normally
lives from the forward pass until its backward use. Unless it is kept as a
checkpoint, its life instead ends at its last forward use; just before its
first backward use the forward nodes that produce it run again (clones),
from values that are still alive: kept activations, feeds, parameters and
constants. A clone that needs another activation which is not kept
recomputes that one first, so the run between two checkpoints is
recomputed as one segment, as in Chen et al. (2016), "Training deep nets
with sublinear memory cost".

Invariants:
- Clones compute exactly what the originals computed (same kernels, same
  inputs), so losses and gradients are bit-identical with and without a budget.
- Clones never write state: outputs that update parameters (BatchNormalization's
  running statistics) are dropped from them, and ops marked `random` are never
  recomputed (their outputs are always kept).
- Which values are kept is the planner's choice (`choose_kept`): every k-th
  saved activation, for the smallest k whose plan fits the budget.
"""
from __future__ import annotations

from typing import Callable

from .ir import Node
from .ops import lookup

RECOMPUTE_SUFFIX = "::recomputed"


def split_forward_backward(order: list[Node], seed: str) -> tuple[list[Node], set[int]]:
    """The ids of backward nodes: those that depend on the loss gradient seed."""
    reached = {seed}
    backward: set[int] = set()
    for node in order:
        if any(i in reached for i in node.inputs if i):
            backward.add(id(node))
            reached.update(o for o in node.outputs if o)
    return order, backward


def saved_activations(order: list[Node], backward: set[int], arena_values: set[str]) -> list[str]:
    """Forward values in the arena read by a backward node, in forward order."""
    forward_outputs = [o for n in order if id(n) not in backward for o in n.outputs if o in arena_values]
    read_backward = {i for n in order if id(n) in backward for i in n.inputs}
    return [v for v in forward_outputs if v in read_backward]


def recomputable(node: Node) -> bool:
    return not getattr(lookup(node), "random", False)


def rewrite(order: list[Node], backward: set[int], kept: set[str], arena_values: set[str]) -> list[Node]:
    """The order with every forward activation outside `kept` recomputed before its backward uses.

    A clone reads kept activations, feeds, parameters and constants as they are, and recomputes
    the other forward activations it needs first (each once; later uses share the clone).
    """
    producer = {o: n for n in order if id(n) not in backward for o in n.outputs if o}
    recomputed = {v for v in producer if v in arena_values and v not in kept}
    clones: dict[str, str] = {}
    result: list[Node] = []

    def materialize(value: str) -> str:
        if value in clones:
            return clones[value]
        node = producer[value]
        inputs = [materialize(i) if i in recomputed else i for i in node.inputs]
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
        if id(node) in backward and any(i in recomputed for i in node.inputs):
            inputs = [materialize(i) if i in recomputed else i for i in node.inputs]
            node = Node(node.op_type, inputs, list(node.outputs), dict(node.attrs), node.name, node.domain)
        result.append(node)
    return result


def _strides(count: int) -> list[int]:
    """Candidate keep-every-k values: 1 (keep all), then roughly geometric up to `count`."""
    strides, k = [1], 2
    while k <= count:
        strides.append(k)
        k = k + 1 if k < 12 else int(k * 1.5)
    return strides


def choose_kept(saved: list[str], producers: dict[str, Node], arena_bytes: Callable[[set[str]], int],
                budget: int) -> tuple[set[str] | None, int]:
    """The checkpoints (kept activations) with the least recomputation whose plan fits `budget`.

    Keeps every k-th saved activation for growing k (then none but the unrecomputable ones) and
    takes the first that fits. Outputs of random ops are always kept. Returns (kept, its arena
    bytes), or (None, the smallest arena bytes any choice reached). `arena_bytes(kept)` plans
    the rewritten order.
    """
    forced = {v for v in saved if not recomputable(producers[v])}
    smallest = None
    choices = [{v for k, v in enumerate(saved) if k % stride == stride - 1} for stride in _strides(len(saved))]
    for kept in choices + [set()]:
        kept = kept | forced
        size = arena_bytes(kept)
        if size <= budget:
            return kept, size
        smallest = size if smallest is None else min(smallest, size)
    return None, smallest
