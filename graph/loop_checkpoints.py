"""Checkpointed scans: what a Scan's iterations save for its backward, cut to about √T states.

A forward Scan differentiated by graph/ops/control_gradients.py stacks the state each of its T
iterations starts from, and its reverse Scan reads them: T states live from the forward to the
backward. When a memory budget asks for less than the step plans (graph/step_plan.py),
`checkpoint_scans` rewrites each such pair to keep K of them, one every L = T / K iterations (L the
divisor of T nearest √T):
- the forward becomes a Scan over K segments whose body gives the state its segment starts from (the
  checkpoint) and runs the original body as a Scan over the segment's L rows;
- the backward becomes a reverse Scan over the K segments whose body recomputes the segment's L
  states from its checkpoint (the forward body as a Scan, as the forward ran it), then runs the
  original reverse body over them;
- stacked inputs and outputs are reshaped [T, ...] <-> [K, L, ...], views.
Invariants: each iteration runs the same kernels on the same values in the same order, so gradients
are the same bits (a body the compiled loop fuses at T >= loops.COMPILE_FROM iterations may round
otherwise when its segments run unfused); the states held are K rows plus one segment's L instead of
T, for a second run of each forward iteration. Handled: scan inputs and outputs along axis 0, the
forward walking forward; other Scans are left as they are, as is a T with no divisor but 1 and T.
"""
from __future__ import annotations

import numpy as np

from .control_flow import walk, with_captures
from .ir import Graph, NameScope, Node
from .ops.control_gradients import SAVED_PREFIX, saved_iteration_outputs

PREFIX = "checkpointed/"
SEGMENTS = "/segments"  # ends the name of a checkpointed Scan's body: such a Scan is not checkpointed again


def _axes_ok(node: Node, scans: int, outputs: int, direction: int) -> bool:
    attrs = node.attrs
    return (all(int(a) == 0 for a in attrs.get("scan_input_axes", [0] * scans))
            and all(int(a) == 0 for a in attrs.get("scan_output_axes", [0] * outputs))
            and all(int(d) == direction for d in attrs.get("scan_input_directions", [direction] * scans))
            and all(int(d) == direction for d in attrs.get("scan_output_directions", [direction] * outputs)))


def segment_length(length: int) -> int | None:
    """The divisor of `length` nearest its square root (the larger on a tie), or None for a prime or tiny one."""
    divisors = [d for d in range(2, length) if length % d == 0]
    return min(divisors, key=lambda d: (abs(d - length ** 0.5), -d)) if divisors else None


def checkpoint_scans(graph: Graph, types: dict) -> Graph:
    """A copy of `graph` with each forward Scan and the reverse Scan that reads its saved states
    checkpointed (the module docstring), or `graph` itself when none can be."""
    pairs = {}
    for forward in graph.nodes:
        saved = saved_iteration_outputs(forward) if forward.op_type == "Scan" else []
        if not saved or forward.attrs["body"].name.endswith(SEGMENTS):
            continue
        body = forward.attrs["body"]
        scans = int(forward.attrs.get("num_scan_inputs", 0))
        states = len(body.inputs) - scans
        if len(saved) != states or not _axes_ok(forward, scans, len(body.outputs) - states, 0):
            continue
        backward = next((n for n in graph.nodes if n.op_type == "Scan" and saved[0] in n.inputs), None)
        length = types[forward.inputs[states]].shape[0] if forward.inputs[states] in types else None
        if backward is None or not isinstance(length, int) or segment_length(length) is None:
            continue
        b_body = backward.attrs["body"]
        b_scans = int(backward.attrs.get("num_scan_inputs", 0))
        if _axes_ok(backward, b_scans, len(b_body.outputs) - (len(b_body.inputs) - b_scans), 1):
            pairs[id(forward)], pairs[id(backward)] = ("forward", backward), ("backward", forward)
    if not pairs:
        return graph
    changed = graph.copy()
    names = NameScope(changed, PREFIX)
    names.taken.update(o for n in walk(graph) for o in n.outputs + [n.name])
    nodes = []
    for node in graph.nodes:
        role = pairs.get(id(node))
        if role is None:
            nodes.append(node)
        elif role[0] == "forward":
            nodes.extend(_forward(node, changed, types, names))
        else:
            nodes.extend(_backward(node, role[1], changed, types, names))
    changed.nodes = nodes
    return changed


class _Segments:
    """Reshapes between [T, ...] and [K, L, ...] for one Scan, its shape constants in `graph`."""

    def __init__(self, graph: Graph, types: dict, names: NameScope, length: int):
        self.graph, self.types, self.names = graph, types, names
        self.length, self.rows = length, segment_length(length)
        self.count = length // self.rows

    def shape(self, dims) -> str:
        name = self.names.fresh("shape")
        self.graph.initializers[name] = np.array(list(dims), np.int64)
        return name

    def split(self, value: str, nodes: list) -> str:
        """`value` [T, ...] as [K, L, ...]: a Reshape appended to `nodes`; its name."""
        rest = self.types[value].shape[1:]
        out = self.names.fresh(f"{value}/segments")
        nodes.append(Node("Reshape", [value, self.shape((self.count, self.rows) + tuple(rest))], [out], {},
                          self.names.fresh("split")))
        return out

    def join(self, value: str, target: str, nodes: list) -> None:
        """[K, L, ...] `value` as `target` [T, ...], a Reshape appended to `nodes`."""
        rest = self.types[target].shape[1:]
        nodes.append(Node("Reshape", [value, self.shape((self.length,) + tuple(rest))], [target], {},
                          self.names.fresh("join")))


def _without_saved(body: Graph) -> Graph:
    kept = body.copy()
    kept.outputs = [o for o in body.outputs if not o.startswith(SAVED_PREFIX)]
    return kept.prune(kept.outputs)


def _forward(node: Node, graph: Graph, types: dict, names: NameScope) -> list[Node]:
    """The forward Scan over segments: each segment's body gives its checkpoints and runs the original
    body (without its saved outputs) over the segment's rows."""
    body = node.attrs["body"]
    scans = int(node.attrs.get("num_scan_inputs", 0))
    states = len(body.inputs) - scans
    saved = set(saved_iteration_outputs(node))
    segments = _Segments(graph, types, names, types[node.inputs[states]].shape[0])
    before, after = [], []
    streams = [segments.split(v, before) for v in node.inputs[states:states + scans]]
    state_in = [names.fresh(f"{n}/state") for n in body.inputs[:states]]
    rows_in = [names.fresh(f"{n}/rows") for n in body.inputs[states:]]
    inner = _without_saved(body)
    kept_outputs = [o for o, inner_name in zip(node.outputs[states:], body.outputs[states:]) if o not in saved]
    state_out = [names.fresh(f"{n}/next") for n in body.inputs[:states]]
    rows_out = [names.fresh(f"{o or 'unused'}/rows") for o in kept_outputs]
    # named as saved states, so that reports count them as what the iterations save
    checkpoints = [SAVED_PREFIX + names.fresh(f"{n}/checkpoint") for n in body.inputs[:states]]
    scan = with_captures(Node("Scan", state_in + rows_in, state_out + rows_out,
                              {"body": inner, "num_scan_inputs": scans}, names.fresh(f"{node.name}/segment")))
    copies = [Node("Identity", [s], [c], {}, names.fresh("checkpoint")) for s, c in zip(state_in, checkpoints)]
    outer_body = Graph(copies + [scan], state_in + rows_in, state_out + rows_out + checkpoints, {}, {}, dict(body.opsets),
                       body.name + SEGMENTS)
    stacked = [names.fresh(f"{o}/segments") if o else "" for o in kept_outputs]
    checkpoint_values = [o for o in node.outputs[states:] if o in saved]
    outer = with_captures(Node("Scan", list(node.inputs[:states]) + streams,
                               list(node.outputs[:states]) + stacked + checkpoint_values,
                               {"body": outer_body, "num_scan_inputs": scans}, node.name, node.domain, node.scope))
    for value, target in zip(stacked, kept_outputs):
        if target:
            segments.join(value, target, after)
    return before + [outer] + after


def _backward(node: Node, forward: Node, graph: Graph, types: dict, names: NameScope) -> list[Node]:
    """The reverse Scan over segments: each recomputes its states from its checkpoint, then runs the
    original reverse body over them."""
    body = node.attrs["body"]
    scans = int(node.attrs.get("num_scan_inputs", 0))
    states = len(body.inputs) - scans
    f_body = forward.attrs["body"]
    f_scans = int(forward.attrs.get("num_scan_inputs", 0))
    f_states = len(f_body.inputs) - f_scans
    saved = saved_iteration_outputs(forward)
    segments = _Segments(graph, types, names, types[forward.inputs[f_states]].shape[0])
    before, after = [], []
    streams, inner_names = [], []
    for value, inner in zip(node.inputs[states:states + scans], body.inputs[states:]):
        streams.append(value if value in saved else segments.split(value, before))  # checkpoints: [K, S] as they are
        inner_names.append(names.fresh(f"{inner}/segment"))
    by_value = dict(zip(node.inputs[states:states + scans], inner_names))
    missing = [v for v in forward.inputs[f_states:f_states + f_scans] if v not in by_value]
    if missing:  # the reverse Scan does not read a forward scan input: the recomputation cannot either
        return [node]
    recomputed = [names.fresh(f"{s}/recomputed") for s in saved]
    f_outputs = [""] * len(f_body.outputs)  # every output omitted but the saved states
    for position, name in zip([k for k, o in enumerate(forward.outputs) if o in saved], recomputed):
        f_outputs[position] = name
    rerun = with_captures(Node("Scan", [by_value[s] for s in saved] + [by_value[v] for v in
                                                                       forward.inputs[f_states:f_states + f_scans]],
                               f_outputs, {"body": f_body, "num_scan_inputs": f_scans},
                               names.fresh(f"{forward.name}/recompute")))
    state_in = [names.fresh(f"{n}/carried") for n in body.inputs[:states]]
    reverse_inputs = state_in + [recomputed[saved.index(v)] if v in saved else by_value[v]
                                 for v in node.inputs[states:states + scans]]
    outputs_count = len(body.outputs) - states
    state_out = [names.fresh(f"{n}/next") for n in body.inputs[:states]]
    rows_out = [names.fresh(f"{o or 'unused'}/rows") for o in node.outputs[states:states + outputs_count]]
    reverse = with_captures(Node("Scan", reverse_inputs, state_out + rows_out,
                                 {k: v for k, v in node.attrs.items()}, names.fresh(f"{node.name}/segment")))
    outer_body = Graph([rerun, reverse], state_in + inner_names, state_out + rows_out, {}, {}, dict(body.opsets),
                       body.name + SEGMENTS)
    stacked = [names.fresh(f"{o}/segments") if o else "" for o in node.outputs[states:states + outputs_count]]
    attrs = {"body": outer_body, "num_scan_inputs": scans, "scan_input_directions": [1] * scans,
             "scan_output_directions": [1] * outputs_count}
    outer = with_captures(Node("Scan", list(node.inputs[:states]) + streams, list(node.outputs[:states]) + stacked,
                               attrs, node.name, node.domain, node.scope))
    for value, target in zip(stacked, node.outputs[states:states + outputs_count]):
        if target:
            segments.join(value, target, after)
    return before + [outer] + after
