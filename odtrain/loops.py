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
Carried values live between iterations in the node's own output arrays (or a buffer of the node's
when the output is omitted), so a body's in-place reuse of its own slots never clobbers them.

Invariants: the outer plan holds a body's captured values alive until the node runs (they are the
node's inputs, graph/control_flow.py); a body writes only its own arena; an omitted carried output
still carries.
"""
from __future__ import annotations

import numpy as np

from .graph.control_flow import outer_bindings
from .graph.errors import ModelError
from .graph.ir import Graph, Node, TensorType
from .graph.ops.control import bind_loop_body, scan_layout
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
        self.calls = self.step.jit_calls  # None with a kernel library
        self.run = self.step.run_calls

    def feed(self, name: str):
        """The body's slot for input `name`, or None when the input is bound as a constant or unread."""
        return self.feeds.get(name)


def _copy(destination, source) -> None:
    if destination is not None and destination is not source:
        np.copyto(destination, source, casting="no")


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
    return [(run, ())]


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

    compiled = None
    if step.calls is not None and length >= COMPILE_FROM:  # the JIT's kernels: the loop as one compiled function
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
        for t in range(length):
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

    compiled = None
    if len(steps) == 1 and steps[0].calls is not None and trip is not None and trip >= COMPILE_FROM and \
            all(s is not None for s in wired[0][1:3]):
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
        while going and (trip is None or t < trip):
            step, counter, flag, carried_feeds, condition_out, carried_out, scans = wired[t if len(wired) > 1 else 0]
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

    return run_loop
