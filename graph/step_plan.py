"""Planning a step: a graph at bound input shapes, decided down to where every value lives.

`plan_step` is a pure function of the graph, the types of its feeds and
parameters, and `scratch_bytes(node, types)` (the working memory a node's
kernel asks for, a fact of the kernels that the executor passes in). It
decides, in this order:
1. Types: every value gets a static type; values computed only from
   constants fold (`schedule.bind_types`).
2. Order: the nodes still to run, topologically (`schedule.execution_order`).
   Dropouts that pass their input through (ratio 0, or not training) become
   views (`ops.nn.inert_dropouts`). Activations that cheap nodes recompute
   from smaller values are recomputed in the backward pass when that makes
   the arena smaller (`recompute.cheap_kept`); under a memory budget that this
   does not meet, activations are recomputed until the arena fits
   (`recompute.choose_kept`, `recompute.rewrite`); when none fits, the states a
   Scan's iterations save are checkpointed every √T iterations (`loop_checkpoints`) and the
   graph planned again. Chains of element-wise nodes become one fused node each
   (`elementwise_fusion`; not where that would break a memory budget). Fused
   optimizer updates go right after the last use of their parameter
   (`schedule.with_updates`).
3. Storage outside the arena: parameters, folded constants and `held`
   values (gradients written straight into their buffer) keep their own
   memory; a view op over one of them is a view of it; an output that
   updates a parameter (running statistics) is the parameter; a view op
   whose output is held copies into it instead.
4. The arena: feeds, the other node outputs and each node's scratch (alive
   for that node's step only) are placed by `planner.plan_memory`. A
   memory-aware reordering (`schedule.memory_aware_order`) replaces the
   order when its arena is smaller, except with fused updates (an update
   must follow every read of its parameter, which a reordering may break).

Invariants: the returned plan is verified; `types` covers every value the
order names, scratch and recomputed values included; inputs are not modified.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .autodiff import LOSS_SEED
from .elementwise_fusion import fuse_elementwise
from .errors import MemoryBudgetError, ModelError, UnsupportedOpError
from .ir import Graph, Node, TensorType
from .loop_checkpoints import checkpoint_scans
from .ops import is_view, lookup
from .planner import SCRATCH_SUFFIX, MemoryPlan, plan_memory
from .ops.nn import inert_dropouts
from .recompute import cheap_kept, choose_kept, rewrite, saved_activations
from .schedule import (RECOMPUTE_SUFFIX, bind_types, defer_constant_work, execution_order, memory_aware_order,
                       split_forward_backward, with_updates)

ScratchBytes = Callable[[Node, dict[str, TensorType]], int]  # bytes of working memory a node's kernel needs


@dataclass
class StepPlan:
    """Everything the executor lays out for one graph at one set of feed shapes.

    The plans of a step, from the inside out:
    - `MemoryPlan` (graph/planner.py): where and when each arena value lives (offsets, lifetimes,
      storage groups), with its lower bound, verification and timeline;
    - `StepPlan` (this class): the step decided: node order, types, folded constants, storage outside
      the arena, scratch, copies, and its MemoryPlan (`plan`); pure data, no memory;
    - `ExecutableStep` (odtrain/executor.py): a StepPlan laid out on an arena and the parameter
      buffers, as the list of kernel calls that runs the step;
    - `BoundStep` (odtrain/api.py): what `Module.bind_at` reports of an ExecutableStep, for memory
      reports and tools: its inputs, MemoryPlan and the bytes held beside the arena.

    `views` maps each value held outside the arena that is not given (views of parameters,
    constants or held values; parameter updates) to the value whose memory it shares, in
    order, so each source comes before its views. `copies` and `scratch` are keyed by a
    node's index in `order`.
    """

    order: list[Node]
    types: dict[str, TensorType]
    folded: dict[str, np.ndarray]  # constants, known before the first step
    feeds: list[str]
    plan: MemoryPlan
    arena_values: set[str]
    views: dict[str, str]
    copies: set[int]  # view nodes whose output is held: they copy
    scratch: dict[int, str]  # node index -> its working memory (an arena value of type uint8[n])
    recomputed: int  # nodes recomputed in the backward pass (cheap ones, and those a memory budget needs)

    @property
    def constant_bytes(self) -> int:
        return sum(np.asarray(v).nbytes for v in self.folded.values())


def plan_step(graph: Graph, feed_types: dict[str, TensorType], parameter_types: dict[str, TensorType],
              scratch_bytes: ScratchBytes, held: set[str] = frozenset(), memory_budget: int | None = None,
              fused_updates: dict[str, str] | None = None,
              bound_feeds: dict[str, np.ndarray] | None = None,
              element_wise: Callable[[Node], int | None] | None = None) -> StepPlan:
    """Plan `graph` for `feed_types`, its parameters (held outside the arena) of `parameter_types`.

    `held` names outputs written to memory of their own (gradient buffers); `memory_budget` caps
    the arena (MemoryBudgetError when no recomputation meets it); `fused_updates` maps gradient
    outputs to the parameters they update during the backward pass. `bound_feeds` maps graph
    inputs to fed values bound as constants (the axes, shapes or sizes an op reads while shapes
    bind): the plan holds for those values only, and a step is fed the other inputs, `feeds`.
    `element_wise(node)`: the arity of the element-wise row a node computes, or None; given, chains of
    them are fused once recomputation is decided (graph/elementwise_fusion.py).
    """
    fused_updates = fused_updates or {}
    bound_feeds = bound_feeds or {}
    live_outputs = [o for o in graph.outputs if o not in fused_updates]  # an applied gradient dies at its update
    feeds = [name for name in graph.inputs if name not in parameter_types and name not in bound_feeds]
    constants = {k: v for k, v in graph.initializers.items() if k not in parameter_types}
    constants.update(bound_feeds)
    known = {**feed_types, **parameter_types}
    types, folded = bind_types(graph, known, constants)  # the layout adds scratch and recomputed values
    order = execution_order(graph, folded, list(graph.outputs))
    order = defer_constant_work(order, set(parameter_types) | set(folded))  # e.g. an int8 weight's dequantization
    order = inert_dropouts(order, folded, set(graph.outputs))
    given = set(parameter_types) | set(folded) | set(held)
    layout = _Layout(graph, types, feeds, live_outputs, scratch_bytes, given, set(parameter_types))
    try:
        order = layout.fit_budget(order, None if memory_budget is None else int(memory_budget))
    except MemoryBudgetError:
        # the states a Scan's iterations save: keep every √T-th and recompute the others (graph/loop_checkpoints.py)
        checkpointed = checkpoint_scans(graph, types)
        if checkpointed is graph:
            raise
        return plan_step(checkpointed, feed_types, parameter_types, scratch_bytes, held, memory_budget, fused_updates,
                         bound_feeds, element_wise)
    recomputed = sum(1 for n in order if n.name.endswith(RECOMPUTE_SUFFIX))
    kept = set(graph.outputs) | set(held) | set(fused_updates)
    unfused = order
    fused = fuse_elementwise(unfused, types, kept, element_wise) if element_wise is not None else unfused
    order, plan, arena_values, views, copies, scratch = layout.finish(fused, fused_updates)
    if fused is not unfused and memory_budget is not None and plan.arena_bytes > int(memory_budget):
        # the recomputation met the budget unfused, and a fused chain's inputs may live longer: keep it unfused
        order, plan, arena_values, views, copies, scratch = layout.finish(unfused, fused_updates)
    return StepPlan(order, types, folded, feeds, plan, arena_values, views, copies, scratch, recomputed)


class _Layout:
    """The storage and arena decisions for orders of one graph at one set of types (which it extends
    with scratch and recomputed values as orders name them)."""

    def __init__(self, graph, types, feeds, live_outputs, scratch_bytes, given, parameters):
        self.graph, self.types, self.feeds, self.live_outputs = graph, types, feeds, live_outputs
        self.scratch_bytes, self.given, self.parameters = scratch_bytes, given, parameters

    def finish(self, order: list[Node], fused_updates: dict[str, str]) -> tuple:
        """(order, plan, arena values, views, copies, scratch) of `order` with its fused updates, reordered for
        memory when that plans a smaller arena (and no update must follow its parameter's reads); verified."""
        graph, types = self.graph, self.types
        if fused_updates:
            order = with_updates(order, fused_updates)
        views, copies = self.outside_arena(order)
        plan, arena_values, scratch = self.place(order, views)
        loss_node = next((n for n in order if graph.outputs and graph.outputs[0] in n.outputs), None)
        reordered = memory_aware_order(order, {v: types[v].nbytes for v in arena_values}, set(graph.outputs), loss_node)
        candidate = self.place(reordered, views)
        if candidate[0].arena_bytes < plan.arena_bytes and not fused_updates:
            order, (plan, arena_values, scratch) = reordered, candidate
        plan.verify()
        copies = {index for index, node in enumerate(order) if id(node) in copies}
        return order, plan, arena_values, views, copies, scratch

    def outside_arena(self, order: list[Node]) -> tuple[dict[str, str], set[int]]:
        """Values held outside the arena beyond the given ones (value -> the value whose memory it
        shares), and the ids of the view nodes that must copy instead."""
        outside, views, copies = set(self.given), {}, set()
        types = self.types
        for node in order:
            opdef = lookup(node)
            for o, i in opdef.updates:
                if o < len(node.outputs) and node.outputs[o] and node.inputs[i] in self.parameters:
                    views[node.outputs[o]] = node.inputs[i]
                    outside.add(node.outputs[o])
            if not node.outputs:
                continue
            src, out = (node.inputs[0] if node.inputs else ""), node.outputs[0]
            if is_view(opdef, [types.get(i) for i in node.inputs], [types[o] for o in node.outputs if o]):
                if out in outside:
                    copies.add(id(node))  # e.g. a gradient sink produced by a view: copy into it
                elif src in outside:
                    views[out] = src
                    outside.add(out)
        return views, copies

    def place(self, order: list[Node], views: dict[str, str]) -> tuple[MemoryPlan, set[str], dict[int, str]]:
        """The memory plan of `order`: arena values, their scratch memory, offsets."""
        types = self.types
        outside = self.given | set(views)
        arena_values = set(self.feeds)
        arena_values.update(o for node in order for o in node.outputs if o and o not in outside)
        scratch = {}
        for index, node in enumerate(order):
            nbytes = int(self.scratch_bytes(node, types))
            if nbytes > 0:
                name = f"{node.name}{SCRATCH_SUFFIX}"
                types[name] = TensorType(np.dtype(np.uint8), (nbytes,))
                scratch[index] = name
                arena_values.add(name)
        for name in self.live_outputs:
            if name not in outside and name not in arena_values:
                raise ModelError(f"graph output '{name}' is not computed by any node")
        for node in order:  # state updates (running statistics) go to parameters, not to callers
            for o, i in lookup(node).updates:
                if o < len(node.outputs) and node.outputs[o] in self.graph.outputs:
                    raise UnsupportedOpError(
                        f"{node.describe()}: output '{node.outputs[o]}' is the updated state of input "
                        f"'{node.inputs[i]}'; odtrain writes it over that checkpoint parameter during training "
                        "(running variance from the unbiased batch variance, as PyTorch) and does not return "
                        "it as a model output")
        plan = plan_memory(order, types, arena_values, self.feeds, self.live_outputs, scratch)
        return plan, arena_values, scratch

    def fit_budget(self, order: list[Node], budget: int | None) -> list[Node]:
        """The order, with activations recomputed in backward: those cheap nodes recompute from smaller
        values (`recompute.cheap_kept`) when that plans a smaller arena, then, if the arena does not fit
        `budget` bytes (None: no budget), as many more as it takes (`recompute.choose_kept`)."""
        _, backward = split_forward_backward(order, LOSS_SEED)
        if not backward:  # an eval step: nothing is saved for a backward pass
            return order
        unconstrained, arena_values, _ = self.place(order, self.outside_arena(order)[0])
        saved = saved_activations(order, backward, arena_values)
        producers = {o: n for n in order if id(n) not in backward for o in n.outputs if o}

        def plan_of(kept):
            rewritten = self._typed_clones(rewrite(order, backward, kept, arena_values))
            return self.place(rewritten, self.outside_arena(rewritten)[0])[0]

        start, start_plan = set(saved), unconstrained
        cheaper = cheap_kept(order, backward, arena_values, self.types)
        cheaper_plan = plan_of(cheaper)
        if cheaper_plan.arena_bytes < unconstrained.arena_bytes:
            start, start_plan = cheaper, cheaper_plan
        if budget is None or start_plan.arena_bytes <= budget:
            return order if start_plan is unconstrained else self._typed_clones(rewrite(order, backward, start, arena_values))
        kept, size = choose_kept(saved, producers, plan_of, budget, self.types, arena_values, start_plan, start)
        if kept is None:
            raise MemoryBudgetError(
                f"a memory budget of {budget:,} bytes cannot be met for these input shapes: the smallest arena "
                f"odtrain can plan, recomputing activations, is {size:,} bytes (without recomputation "
                f"{unconstrained.arena_bytes:,}); raise the budget to at least {size:,} or use a smaller batch",
                smallest_bytes=size)
        return self._typed_clones(rewrite(order, backward, kept, arena_values))

    def _typed_clones(self, order: list[Node]) -> list[Node]:
        """Give recomputed values the types of the values they recompute; returns `order`."""
        for node in order:
            for name in node.outputs:
                if name.endswith(RECOMPUTE_SUFFIX):
                    self.types[name] = self.types[name.removesuffix(RECOMPUTE_SUFFIX)]
        return order
