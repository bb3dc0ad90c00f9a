"""The executor: a graph bound to input shapes, laid out in one arena, run as a flat call list.

Binding (once per input-shape signature):
- every value gets a static type (`graph.schedule.bind_types`), constants fold;
- storage: parameters and constants are held outside the arena; a view op
  over them is a numpy view; every other value gets arena bytes from the
  memory plan (`graph.planner.plan_memory`), verified before use;
- each node's kernel binding turns it into (kernel, args) calls on views.
A step copies the feeds into their arena slots and runs the calls: no
lookups, no allocation. Gradients of trainable parameters are written
straight into the gradient buffer (the usual step, after lazy_reset_grad),
or, when gradients accumulate, computed in the arena and added by a last
call per parameter.
"""
from __future__ import annotations

import numpy as np

from .graph.errors import InputError, ModelError, NonFiniteError, UnsupportedOpError
from .graph.ir import Graph, TensorType
from .graph.ops import is_view, lookup
from .graph.planner import ALIGNMENT, Plan, plan_memory
from .graph.schedule import bind_types, execution_order
from .kernels import BINDINGS, SCRATCH
from .graph.optimizers import AdamW
from .kernels.optim import adamw_update, add_into, assert_finite, copy_into, sgd_update


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
                 check_finite: tuple[str, ...] = ()):
        self.graph = graph
        self.feeds = [name for name in graph.inputs if name not in external]
        constants = {k: v for k, v in graph.initializers.items() if k not in external}
        known = dict(feed_types)
        known.update({k: TensorType(v.dtype, tuple(v.shape)) for k, v in external.items()})
        types, folded = bind_types(graph, known, constants)
        order = execution_order(graph, folded, list(graph.outputs))

        storage: dict[str, np.ndarray] = dict(external)
        storage.update({k: np.ascontiguousarray(v) for k, v in folded.items()})
        sinks = gradient_sinks or {}
        if not accumulate:
            storage.update({name: sink.reshape(types[name].shape) for name, sink in sinks.items()})
        self.copies = set()  # view ops that must copy, because their output is a gradient sink
        for node in order:
            opdef = lookup(node)
            for o, i in opdef.updates:  # new values of parameters (running statistics) overwrite them
                if o < len(node.outputs) and node.outputs[o] and node.inputs[i] in external:
                    storage[node.outputs[o]] = external[node.inputs[i]]
            src, out = (node.inputs[0] if node.inputs else ""), node.outputs[0]
            if is_view(lookup(node), [types.get(i) for i in node.inputs], [types[o] for o in node.outputs if o]):
                if out in storage:
                    self.copies.add(id(node))
                elif src in storage:
                    storage[out] = storage[src].reshape(types[out].shape)
        arena_values = {name for name in self.feeds}
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
                name = f"{node.name}::scratch"
                types[name] = TensorType(np.dtype(np.uint8), (nbytes,))
                scratch[index] = name
                arena_values.add(name)
        self.scratch = {id(order[i]): name for i, name in scratch.items()}
        for name in graph.outputs:
            if name not in storage and name not in arena_values:
                raise ModelError(f"graph output '{name}' is not computed by any node")
        self.plan: Plan = plan_memory(order, types, arena_values, self.feeds, list(graph.outputs), scratch)
        self.plan.verify()
        self.arena = aligned_buffer(self.plan.arena_bytes)
        for name in arena_values:
            t = types[name]
            offset = self.plan.offset(name)
            storage[name] = self.arena[offset:offset + t.nbytes].view(t.dtype).reshape(t.shape)
        self.types = types
        self.storage = storage
        self.feed_views = [storage[name] for name in self.feeds]
        self.calls = []
        for node in order:
            self.calls.extend(self._bind_node(node, storage, types))
            for name in node.outputs:  # stop before a non-finite value reaches the backward pass
                if name in check_finite:
                    self.calls.append((assert_finite, (storage[name].reshape(-1),)))
        if accumulate:
            for name, sink in sinks.items():
                self.calls.append((add_into, (sink, storage[name].reshape(-1))))

    def _bind_node(self, node, storage, types):
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


def apply_optimizer(config, weights: np.ndarray, grads: np.ndarray, moments: dict[str, np.ndarray],
                    learning_rate: float, step: int) -> None:
    """One fused update of the trainable block by the optimizer model's node (AdamW or SGD)."""
    if isinstance(config, AdamW):
        adamw_update(weights, grads, moments["momentum0"], moments["momentum1"], float(learning_rate),
                     float(config.betas[0]), float(config.betas[1]), float(config.eps), float(config.weight_decay),
                     float(step), bool(config.bias_correction))
    else:
        sgd_update(weights, grads, float(learning_rate))
