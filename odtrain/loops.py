"""Running If, Loop and Scan: each body planned once, its iterations a loop over a prebuilt call list.

A control-flow node becomes one call of the outer step (`bind_control_flow`, called by the executor
as it binds the node). Binding it plans each body as a step of its own (a step of the outer step's
class, `ExecutableStep`, with an arena of its own, planned once per outer plan; taken from the outer
step, so that this module does not import the executor that imports it):
- the values a body captures are its parameters: the outer step's arrays, read in place, never
  copied (folded outer constants bind as the body's constants, so shapes and axes fold inside too);
- a body's inputs are its feeds: carried values, the iteration number and condition, a scan slice.
An iteration copies what changes into the body's feed slots, runs the body's calls (Numba
dispatchers, or the kernel library's call lists) and copies its outputs out: no planning, no lookups.
A long loop on the JIT's kernels runs as one compiled function instead (odtrain/loop_compiler.py), its
body one loop nest where it is element-wise (odtrain/body_fusion.py).
A body's random ops (Dropout) draw a fresh mask each iteration: before iteration t their streams are
set to a hash of the stream the step seeded them with (executor.seed_random: the run's seed, the node,
the step) and of t's *key*, then restored. A Loop's key is its iteration number; a Scan's the row its
first scan input reads that iteration. A Scan's gradient (graph/ops/control_gradients.py) reads the
saved states or the scan inputs in the forward's rows, reversed, so the body it recomputes draws the
masks the forward drew, and the gradient is that of the masks applied. A body with random ops runs the
Python loop, not a compiled one.
Carried values live between iterations in the node's own output arrays (or a buffer of the node's
when the output is omitted), so a body's in-place reuse of its own slots never clobbers them.

Invariants: the outer plan holds a body's captured values alive until the node runs (they are the
node's inputs, graph/control_flow.py); a body writes only its own arena; an omitted carried output
still carries.
"""
from __future__ import annotations

from types import FunctionType

import numpy as np

from .graph.control_flow import outer_bindings
from .graph.errors import ModelError
from .graph.ir import Graph, Node, TensorType
from dataclasses import dataclass

from .graph.ops.control import bind_loop_body, scan_layout
from .graph.ops.control_gradients import saved_iteration_outputs
from .body_fusion import fused_body
from .loop_compiler import LoopSpec, compile_loop, flat, rows

# Loops of this many iterations or more run as one compiled function (odtrain/loop_compiler.py); a
# shorter one keeps the Python loop over its call list, as compiling one costs seconds (benchmarks/README.md,
# "Models that loop: a selective scan", gives the Mamba step's) and saves a few microseconds a call.
COMPILE_FROM = 256


class _Body:
    """One body bound for running: its step, the views of its feeds and its outputs."""

    def __init__(self, outer, node: Node, body: Graph, storage: dict, feed_types: dict, bound: dict | None = None):
        captured = {}
        constants = dict(bound or {})
        for inner, outer_name in outer_bindings(node):
            if outer_name in outer.step_plan.folded:
                constants[inner] = np.asarray(outer.step_plan.folded[outer_name])
            else:
                captured[inner] = storage[outer_name]
        self.step = type(outer)(body, feed_types=feed_types, external=captured, bound_feeds=constants,
                                   threads=outer.threads, library=outer.library, artifact_folder=outer.artifact_folder,
                                   element_wise_fusion=False)  # an element-wise body fuses whole (body_fusion.py)
        self.feeds = {name: view for name, view in zip(self.step.feeds, self.step.feed_views)}
        self.outputs = [self.step.storage[name] for name in body.outputs]
        outer.random_streams.extend(self.step.random_streams)  # a body's Dropout draws anew each step
        self.streams = [stream for _, stream in self.step.random_streams]  # nested bodies' too
        self.calls = self.step.jit_calls  # None with a kernel library
        self.run = self.step.run_calls

    def feed(self, name: str):
        """The body's slot for input `name`, or None when the input is bound as a constant or unread."""
        return self.feeds.get(name)


def _copy(destination, source) -> None:
    if destination is not None and destination is not source:
        np.copyto(destination, source, casting="no")


def _iteration_seed(base: int, key: int) -> int:
    """A 32-bit stream for iteration `key` of a run whose stream is `base` (splitmix64's finaliser: nearby
    bases and keys give unrelated streams, and a nested loop's keys mix on top of its outer one's)."""
    z = ((int(base) << 32) ^ (int(key) + 1)) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0xFFFFFFFF


class _Draws:
    """Sets a body's random streams per iteration (`at(key)`), from the bases they hold when the loop
    starts (`start()`), which `finish()` restores."""

    def __init__(self, bodies):
        self.streams = [s for body in bodies for s in body.streams]
        self.bases: list[int] = []

    def start(self) -> None:
        self.bases = [int(s[0]) for s in self.streams]

    def at(self, key: int) -> None:
        for stream, base in zip(self.streams, self.bases):
            stream[0] = _iteration_seed(base, key)

    def finish(self) -> None:
        for stream, base in zip(self.streams, self.bases):
            stream[0] = base


def bind_control_flow(outer, node: Node, storage: dict) -> list:
    """The calls that run `node` (If, Loop or Scan) in the step `outer` (an ExecutableStep) whose values
    live in `storage`."""
    bodies: list[_Body] = []
    try:
        run = {"If": _bind_if, "Loop": _bind_loop, "Scan": _bind_scan}[node.op_type](outer, node, storage, bodies)
    except ModelError as error:
        raise ModelError(f"{node.describe()}: {error}") from None
    # what a kernel library must hold to run the bodies (recorded with the step's calls: executor.nested_calls)
    run.body_calls = [call for body in bodies for call in body.step.calls]
    run.node, run.body_steps = node, [body.step for body in dict.fromkeys(bodies)]  # read by loop_memory
    run.iterations = getattr(run, "iterations", None)  # an If's: none
    return [(run, ())]


@dataclass(frozen=True)
class LoopMemory:
    """What one If, Loop or Scan node of a step holds beside the step's arena, and what it saves in it:
    `body_arena_bytes` its bodies' own arenas (each planned once, `body_lower_bound` the sum of their lower
    bounds), `iterations` (None for an If, or a condition the data decides), `saved_bytes` the bytes of the
    step's arena that stack what each iteration saves for the backward."""

    node: str
    body_arena_bytes: int
    body_lower_bound: int
    iterations: int | None
    saved_bytes: int
    saved_values: tuple = ()  # the names of those stacks in the step's arena

    def to_dict(self) -> dict:
        return {"node": self.node, "body_arena_bytes": self.body_arena_bytes,
                "body_lower_bound_bytes": self.body_lower_bound, "iterations": self.iterations,
                "saved_bytes": self.saved_bytes}


def loop_memory(calls, types: dict) -> list[LoopMemory]:
    """A LoopMemory for each control-flow node among a step's `calls` (its values' `types`), the nodes of
    their bodies after them."""
    found = []
    for kernel, _ in calls:
        # a loop's runner is a Python function; a kernel is looked at no further (a lazy Numba kernel's attributes
        # would load Numba, which a device running a kernel library does not have)
        steps = getattr(kernel, "body_steps", None) if isinstance(kernel, FunctionType) else None
        if steps is None:
            continue
        node = kernel.node
        saved = [o for o in saved_iteration_outputs(node) if o in types]
        found.append(LoopMemory(node.describe(), sum(s.plan.arena_bytes for s in steps),
                                sum(s.plan.lower_bound for s in steps), kernel.iterations,
                                sum(types[o].nbytes for o in saved), tuple(saved)))
        for step in steps:
            found.extend(loop_memory(step.calls, step.types))
    return found


def _type(array) -> TensorType:
    return TensorType(array.dtype, tuple(array.shape))


def _bind_if(outer, node: Node, storage: dict, bodies: list):
    condition = storage[node.inputs[0]]
    targets = [storage[o] if o else None for o in node.outputs]
    known = outer.step_plan.folded.get(node.inputs[0])
    if known is not None:  # a condition known when shapes bind: only its branch is planned (the other may not fit)
        taken = _Body(outer, node, node.attrs["then_branch" if bool(np.asarray(known).reshape(-1)[0]) else "else_branch"],
                      storage, {})
        branches = [taken, taken]
    else:
        branches = [_Body(outer, node, node.attrs[key], storage, {}) for key in ("else_branch", "then_branch")]
    bodies.extend(dict.fromkeys(branches))

    def run_if():
        branch = branches[bool(condition.reshape(-1)[0])]
        branch.run()
        for target, value in zip(targets, branch.outputs):
            _copy(target, value)

    return run_if


def _holders(node: Node, storage: dict, first: int, count: int, types: list) -> list:
    """The arrays carried values live in between iterations: the node's outputs, or buffers of its own
    where an output is omitted."""
    held = []
    for k in range(count):
        name = node.outputs[first + k] if first + k < len(node.outputs) else ""
        held.append(storage[name] if name else np.empty(types[k].shape, types[k].dtype))
    return held


def _bind_scan(outer, node: Node, storage: dict, bodies: list):
    body = node.attrs["body"]
    types = [_type(storage[name]) if name else None for name in node.inputs]
    states = len(body.inputs) - int(node.attrs.get("num_scan_inputs", 0))
    ranks = [len(outer.types[o].shape) - 1 if o else 0 for o in node.outputs[states:]]
    layout = scan_layout(node, types, ranks + [0] * (len(body.outputs) - states - len(ranks)))
    states, length = layout.states, layout.length
    feed_types = {name: types[k] for k, name in enumerate(body.inputs[:states])}
    sources = []
    for k in range(layout.scans):
        whole = np.moveaxis(storage[node.inputs[states + k]], layout.input_axes[k], 0)
        feed_types[body.inputs[states + k]] = _type(whole[0]) if length else TensorType(whole.dtype, whole.shape[1:])
        sources.append((whole, layout.input_directions[k]))
    step = _Body(outer, node, body, storage, feed_types)
    bodies.append(step)
    held = _holders(node, storage, 0, states, types[:states])
    initial = [storage[node.inputs[k]] for k in range(states)]
    state_feeds = [step.feed(name) for name in body.inputs[:states]]
    scan_feeds = [step.feed(name) for name in body.inputs[states:]]
    state_outputs, scan_outputs = step.outputs[:states], step.outputs[states:]
    targets = []
    for k in range(layout.outputs):
        name = node.outputs[states + k] if states + k < len(node.outputs) else ""
        targets.append((np.moveaxis(storage[name], layout.output_axes[k], 0), layout.output_directions[k])
                       if name else None)

    draws = _Draws([step])
    first_reversed = bool(layout.input_directions[0]) if layout.scans else False
    compiled = None
    if step.calls is not None and length >= COMPILE_FROM and not draws.streams:  # the JIT's kernels: one compiled function
        compiled = compile_loop(LoopSpec(
            step.calls, carried=[(flat(h), flat(f), flat(o)) for h, f, o in zip(held, state_feeds, state_outputs)],
            streams_in=[(flat(f), rows(w) if axis == 0 else None, bool(d))
                        for f, (w, d), axis in zip(scan_feeds, sources, layout.input_axes)],
            streams_out=[(rows(t[0]) if axis == 0 else None, flat(o), bool(t[1]))  # omitted outputs: not written
                         for t, o, axis in zip(targets, scan_outputs, layout.output_axes) if t is not None],
            fused=lambda source: fused_body(step.step, source, body.outputs)), length)

    def run_scan():
        for hold, value in zip(held, initial):
            _copy(hold, value)
        if compiled is not None:
            compiled()
            return
        draws.start()
        for t in range(length):
            if draws.streams:
                draws.at(length - 1 - t if first_reversed else t)
            for feed, hold in zip(state_feeds, held):
                _copy(feed, hold)
            for feed, (whole, direction) in zip(scan_feeds, sources):
                _copy(feed, whole[length - 1 - t if direction else t, ...])
            step.run()
            for target, value in zip(targets, scan_outputs):
                if target is not None:
                    whole, direction = target
                    np.copyto(whole[length - 1 - t if direction else t, ...], value, casting="no")
            for hold, value in zip(held, state_outputs):
                _copy(hold, value)
        draws.finish()

    run_scan.iterations = length
    return run_scan


def _bind_loop(outer, node: Node, storage: dict, bodies: list):
    body = node.attrs["body"]
    types = [_type(storage[name]) if name else None for name in node.inputs]
    consts = [np.asarray(outer.step_plan.folded[name]) if name in outer.step_plan.folded else None
              for name in node.inputs]
    binding = bind_loop_body(node, types, consts)
    carried = len(body.inputs) - 2
    feed_types = {body.inputs[0]: TensorType(np.dtype(np.int64), ()), body.inputs[1]: TensorType(np.dtype(np.bool_), ())}
    feed_types.update((body.inputs[2 + k], types[2 + k]) for k in range(carried))
    if binding.per_iteration:
        steps = [_Body(outer, node, body, storage, {k: v for k, v in feed_types.items() if k != body.inputs[0]},
                       {body.inputs[0]: np.array(t, np.int64)}) for t in range(binding.trip)]
    else:
        steps = [_Body(outer, node, body, storage, feed_types)]
    bodies.extend(steps)
    held = _holders(node, storage, 0, carried, types[2:])
    initial = [storage[node.inputs[2 + k]] for k in range(carried)]
    targets = [storage[o] if o else None for o in node.outputs[carried:]]
    trip = binding.trip
    condition = storage[node.inputs[1]] if len(node.inputs) > 1 and node.inputs[1] else None
    wired = [(s, s.feed(body.inputs[0]), s.feed(body.inputs[1]), [s.feed(n) for n in body.inputs[2:]],
              s.outputs[0], s.outputs[1:1 + carried], s.outputs[1 + carried:]) for s in steps]

    draws = _Draws(steps)
    compiled = None
    if len(steps) == 1 and steps[0].calls is not None and trip is not None and trip >= COMPILE_FROM and \
            all(s is not None for s in wired[0][1:3]) and not draws.streams:
        _, counter, flag, carried_feeds, condition_out, carried_out, scans = wired[0]
        compiled = compile_loop(LoopSpec(
            steps[0].calls, carried=[(flat(h), flat(f), flat(o)) for h, f, o in zip(held, carried_feeds, carried_out)],
            streams_out=[(rows(w), flat(o), False) for w, o in zip(targets, scans) if w is not None],
            counter=flat(counter), flag=flat(flag),
            condition_out=flat(condition_out) if condition is not None else None,
            fused=lambda source: fused_body(steps[0].step, source, body.outputs)), trip)

    def run_loop():
        for hold, value in zip(held, initial):
            _copy(hold, value)
        going = True if condition is None else bool(condition.reshape(-1)[0])
        if compiled is not None:
            compiled(going)
            return
        t = 0
        draws.start()
        while going and (trip is None or t < trip):
            step, counter, flag, carried_feeds, condition_out, carried_out, scans = wired[t if len(wired) > 1 else 0]
            if draws.streams:
                draws.at(t)
            if counter is not None:
                counter[...] = t
            if flag is not None:
                flag[...] = going
            for feed, hold in zip(carried_feeds, held):
                _copy(feed, hold)
            step.run()
            if condition is not None:  # without a condition input, the body's is ignored (ONNX's for loop)
                going = bool(condition_out.reshape(-1)[0])
            for target, value in zip(targets, scans):
                if target is not None:
                    np.copyto(target[t, ...], value, casting="no")
            for hold, value in zip(held, carried_out):
                _copy(hold, value)
            t += 1
        draws.finish()

    run_loop.iterations = binding.iterations
    return run_loop
