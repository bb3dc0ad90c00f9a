"""The executor: a graph bound to input shapes, laid out in one arena, run as a flat call list.

Binding (once per input-shape signature):
- every value gets a static type (`graph.schedule.bind_types`), constants fold;
- storage: parameters and constants are held outside the arena; a view op
  over them is a numpy view; every other value gets arena bytes from the
  memory plan (`graph.planner.plan_memory`), verified before use;
- each node's kernel binding turns it into (kernel, args) calls on views.
A step copies the feeds into their arena slots and runs the calls: no
lookups, no allocation. Graphs that never run at the same time (a
Module's train and eval steps, at every input shape) share one arena
buffer (`SharedArena`), as large as the largest of their plans. Gradients of trainable parameters are written
straight into the gradient buffer (the usual step, after lazy_reset_grad),
or, when gradients accumulate, computed in the arena and added by a last
call per parameter.
"""
from __future__ import annotations

import weakref

import numpy as np

from .graph.errors import InputError, MemoryBudgetError, ModelError, NonFiniteError, UnsupportedOpError
from .graph.ir import ODTRAIN_DOMAIN, Graph, Node, TensorType
from .graph.ops import is_view, lookup
from .graph.autodiff import LOSS_SEED
from .graph.ops.training import APPLY_UPDATE
from .graph.planner import ALIGNMENT, SCRATCH_SUFFIX, plan_memory
from .graph.recompute import RECOMPUTE_SUFFIX, choose_kept, rewrite, saved_activations, split_forward_backward
from .graph.schedule import bind_types, execution_order, memory_aware_order
from .kernels import BINDINGS, SCRATCH
from . import runtime
from .graph.optimizers import AdamW, SGDMomentum
from .kernels.optim import adamw_update, add_into, assert_finite, copy_into, sgd_momentum_update, sgd_update


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A uint8 buffer whose first byte is ALIGNMENT-aligned."""
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start:start + nbytes]


class BoundGraph:
    """One graph at one set of feed shapes: plan, arena, and the calls of a step.

    `external` maps parameter names to the arrays that hold them (views of
    the flat parameter buffer). `gradient_sinks` maps gradient outputs to
    their views of the gradient buffer: with `accumulate` they are added
    into it, otherwise the producing kernels write into it directly.
    """

    def __init__(self, graph: Graph, feed_types: dict[str, TensorType], external: dict[str, np.ndarray],
                 gradient_sinks: dict[str, np.ndarray] | None = None, accumulate: bool = False,
                 check_finite: tuple[str, ...] = (), memory_budget: int | None = None,
                 fused_updates: dict | None = None, arena: SharedArena | None = None):
        runtime.load()  # Numba's CPU target, BLAS, serial BLAS unless asked (odtrain/threads.py)
        self.graph = graph
        fused_updates = fused_updates or {}
        # Gradients applied during the backward pass die at their update, not at the end of the step.
        self.live_outputs = [o for o in graph.outputs if o not in fused_updates]
        self.feeds = [name for name in graph.inputs if name not in external]
        constants = {k: v for k, v in graph.initializers.items() if k not in external}
        known = dict(feed_types)
        known.update({k: TensorType(v.dtype, tuple(v.shape)) for k, v in external.items()})
        types, folded = bind_types(graph, known, constants)
        order = execution_order(graph, folded, list(graph.outputs))
        sinks = gradient_sinks or {}
        outside = dict(external)
        outside.update({k: np.ascontiguousarray(v) for k, v in folded.items()})
        if not accumulate:
            outside.update({name: sink.reshape(types[name].shape) for name, sink in sinks.items()})
        self.constant_bytes = sum(np.asarray(v).nbytes for v in folded.values())
        self.recomputed = 0
        if memory_budget is not None:
            order = self._fit_budget(order, types, outside, external, int(memory_budget))
        if fused_updates:
            order = _with_updates(order, fused_updates, external)
        storage, self.copies = self._storage_outside_arena(order, types, outside, external)
        self.plan, arena_values, scratch = self._layout(order, types, storage)
        loss_node = next((n for n in order if graph.outputs and graph.outputs[0] in n.outputs), None)
        reordered = memory_aware_order(order, {v: types[v].nbytes for v in arena_values}, set(graph.outputs), loss_node)
        plan, values, slots = self._layout(reordered, types, storage)
        if plan.arena_bytes < self.plan.arena_bytes and not fused_updates:  # updates must follow every read
            order, self.plan, arena_values, scratch = reordered, plan, values, slots
        self.plan.verify()
        self.scratch = {id(order[i]): name for i, name in scratch.items()}
        self.types = types
        self._order, self._outside, self._arena_values = order, storage, arena_values
        self._check_finite, self._accumulated_sinks = check_finite, (sinks if accumulate else {})
        (arena or SharedArena()).attach(self)

    def attach(self, buffer: np.ndarray) -> None:
        """Lay the arena values into `buffer` (at least the plan's arena bytes) and bind the calls of a step."""
        storage = dict(self._outside)
        for name in self._arena_values:
            t = self.types[name]
            offset = self.plan.offset(name)
            storage[name] = buffer[offset:offset + t.nbytes].view(t.dtype).reshape(t.shape)
        self.arena = buffer
        self.storage = storage
        self.feed_views = [storage[name] for name in self.feeds]
        calls, call_nodes = [], []
        for node in self._order:
            calls.extend(self._bind_node(node, storage, self.types))
            for name in node.outputs:  # stop before a non-finite value reaches the backward pass
                if name in self._check_finite:
                    calls.append((assert_finite, (storage[name].reshape(-1),)))
            call_nodes.extend([node] * (len(calls) - len(call_nodes)))
        for name, sink in self._accumulated_sinks.items():
            calls.append((add_into, (sink, storage[name].reshape(-1))))
            call_nodes.append(None)
        self.calls = calls
        self.call_nodes = call_nodes  # the node each call belongs to (None: a gradient added into its sink)

    @staticmethod
    def _storage_outside_arena(order, types, outside, external):
        """Storage of values that live outside the arena, and the view ops that must copy instead.

        Parameters, constants and gradient sinks are held outside; a view op over them is a
        numpy view; outputs that update a parameter (running statistics) are the parameter.
        """
        storage = dict(outside)
        copies = set()
        for node in order:
            opdef = lookup(node)
            for o, i in opdef.updates:
                if o < len(node.outputs) and node.outputs[o] and node.inputs[i] in external:
                    storage[node.outputs[o]] = external[node.inputs[i]]
            if not node.outputs:
                continue
            src, out = (node.inputs[0] if node.inputs else ""), node.outputs[0]
            if is_view(opdef, [types.get(i) for i in node.inputs], [types[o] for o in node.outputs if o]):
                if out in storage:
                    copies.add(id(node))  # e.g. a gradient sink produced by a view: copy into it
                elif src in storage:
                    storage[out] = storage[src].reshape(types[out].shape)
        return storage, copies

    def _layout(self, order, types, storage):
        """The memory plan of `order`: arena values, their scratch memory, offsets."""
        arena_values = set(self.feeds)
        arena_values.update(o for node in order for o in node.outputs if o and o not in storage)
        scratch = {}
        for index, node in enumerate(order):
            size_of = SCRATCH.get(node.key)
            if size_of is None:
                continue
            specs_in = [(types[i].shape, types[i].dtype) if i else None for i in node.inputs]
            specs_out = [(types[o].shape, types[o].dtype) if o else None for o in node.outputs]
            nbytes = int(size_of(specs_in, specs_out, **node.attrs))
            if nbytes > 0:
                name = f"{node.name}{SCRATCH_SUFFIX}"
                types[name] = TensorType(np.dtype(np.uint8), (nbytes,))
                scratch[index] = name
                arena_values.add(name)
        for name in self.live_outputs:
            if name not in storage and name not in arena_values:
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

    def _fit_budget(self, order, types, outside, external, budget: int):
        """The order, with activations recomputed in backward so that the arena fits `budget` bytes."""
        _, backward = split_forward_backward(order, LOSS_SEED)
        storage, _ = self._storage_outside_arena(order, types, outside, external)
        unconstrained, arena_values, _ = self._layout(order, types, storage)
        if unconstrained.arena_bytes <= budget:
            return order
        saved = saved_activations(order, backward, arena_values)
        producers = {o: n for n in order if id(n) not in backward for o in n.outputs if o}

        def plan_of(kept):
            rewritten = _typed_clones(rewrite(order, backward, kept, arena_values), types)
            storage, _ = self._storage_outside_arena(rewritten, types, outside, external)
            return self._layout(rewritten, types, storage)[0]

        kept, size = choose_kept(saved, producers, plan_of, budget, types, arena_values, unconstrained)
        if kept is None:
            raise MemoryBudgetError(
                f"a memory budget of {budget:,} bytes cannot be met for these input shapes: the smallest arena "
                f"odtrain can plan, recomputing activations, is {size:,} bytes (without recomputation "
                f"{unconstrained.arena_bytes:,}); raise the budget to at least {size:,} or use a smaller batch")
        rewritten = _typed_clones(rewrite(order, backward, kept, arena_values), types)
        self.recomputed = sum(1 for n in rewritten if n.name.endswith(RECOMPUTE_SUFFIX))
        return rewritten

    def _bind_node(self, node, storage, types):
        if node.key == (ODTRAIN_DOMAIN, APPLY_UPDATE):  # the optimizer update of one parameter
            return [(node.attrs["update"], (storage[node.inputs[0]].reshape(-1),))]
        opdef = lookup(node)
        if id(node) in self.copies:
            return [(copy_into, (storage[node.outputs[0]].reshape(-1), storage[node.inputs[0]].reshape(-1)))]
        if is_view(opdef, [types.get(i) for i in node.inputs], [types[o] for o in node.outputs if o]):
            return []  # the output already shares the input's bytes
        bind = BINDINGS.get(node.key)
        if bind is None:
            raise UnsupportedOpError(f"{node.describe()}: no kernel is registered for this op type")
        inputs = [storage[i] if i else None for i in node.inputs]
        outputs = [storage[o] if o else None for o in node.outputs]
        extra = {"scratch": storage[self.scratch[id(node)]]} if id(node) in self.scratch else {}
        try:
            return bind(inputs, outputs, **node.attrs, **extra)
        except TypeError as error:
            raise ModelError(f"{node.describe()}: unsupported attributes {sorted(node.attrs)}: {error}") from None
        except ValueError as error:
            raise ModelError(f"{node.describe()}: {error}") from None

    @property
    def order(self) -> list[Node]:
        """The nodes of a step in execution order, recomputed and update nodes included."""
        return self._order

    def run(self, feeds: list[np.ndarray]) -> None:
        for view, value in zip(self.feed_views, feeds):
            np.copyto(view, value, casting="no")
        try:
            for kernel, args in self.calls:
                kernel(*args)
        except FloatingPointError as error:
            raise NonFiniteError(f"{self.graph.name}: {error}") from None
        except ValueError as error:  # a kernel's check on the data (e.g. a label out of range)
            raise InputError(f"{self.graph.name}: {error}; check the inputs' values") from None

    def output(self, name: str) -> np.ndarray:
        return self.storage[name].copy()


class SharedArena:
    """One arena buffer for bound graphs that never run at the same time (the train and eval steps of
    a Module, at every input shape): as large as the largest plan, not the sum of them.

    Invariant: nothing lives in the arena from one run to the next (a run copies its feeds in, its
    outputs are copied out, gradients and state go to buffers outside), so graphs may take turns
    over the same bytes. A graph whose plan is larger than the buffer replaces it: every graph
    still bound to the old buffer is attached to the new one, and the old one is freed.
    """

    def __init__(self):
        self.buffer = aligned_buffer(0)
        self._users: weakref.WeakSet = weakref.WeakSet()  # plans a session evicted from its cache drop out

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def attach(self, bound: BoundGraph) -> None:
        if bound.plan.arena_bytes > self.buffer.nbytes:
            self.buffer = aligned_buffer(bound.plan.arena_bytes)
            for user in list(self._users):
                user.attach(self.buffer)
        self._users.add(bound)
        bound.attach(self.buffer)


def _with_updates(order, fused_updates: dict, external) -> list:
    """The order with each parameter's update right after the last node that reads the parameter or
    produces its gradient. `fused_updates` maps gradient outputs to (parameter, update(grad) callable)."""
    order = list(order)
    positions = []
    for grad_name, (param, update) in fused_updates.items():
        last = max(index for index, node in enumerate(order) if grad_name in node.outputs or param in node.inputs)
        positions.append((last, Node(APPLY_UPDATE, [grad_name, param], [], {"update": update},
                                     f"{param}::update", ODTRAIN_DOMAIN)))
    for last, node in sorted(positions, key=lambda item: -item[0]):
        order.insert(last + 1, node)
    return order


def _typed_clones(order, types):
    """Give recomputed values the types of the values they recompute; returns `order`."""
    for node in order:
        for name in node.outputs:
            if name.endswith(RECOMPUTE_SUFFIX):
                types[name] = types[name.removesuffix(RECOMPUTE_SUFFIX)]
    return order


def apply_optimizer(config, weights: np.ndarray, grads: np.ndarray, moments: dict[str, np.ndarray],
                    learning_rate: float, step: int) -> None:
    """One fused update of the trainable block by the optimizer model's node (AdamW, SGD or SGDMomentum)."""
    if isinstance(config, AdamW):
        adamw_update(weights, grads, moments["momentum0"], moments["momentum1"], float(learning_rate),
                     float(config.betas[0]), float(config.betas[1]), float(config.eps), float(config.weight_decay),
                     float(step), bool(config.bias_correction))
    elif isinstance(config, SGDMomentum):
        sgd_momentum_update(weights, grads, moments["momentum_buffer"], float(learning_rate), float(config.momentum),
                            float(config.dampening), float(config.weight_decay), bool(config.nesterov), step == 1)
    else:
        sgd_update(weights, grads, float(learning_rate))
