"""Control flow: If, Loop and Scan (type rules and gradients).

A node's bodies are `Graph` attributes that read outer values through the node's captured inputs
(graph/control_flow.py). Shapes are inferred through a body by binding it like any graph
(`schedule.bind_types`) with the types of its inputs and of the values it captures, so every value
of a body is static once the outer graph's inputs are bound. odtrain plans static shapes, which
decides what is refused:
- If: both branches must give the same types unless the condition is a constant (then only the taken
  branch is typed, and a branch computing constants only folds).
- Scan (opset 9 and later; opset 8's batched form is refused by the loader's opset check): every
  scan input has the same length along its axis; carried values keep their type.
- Loop: scan outputs need the iteration count ahead: a trip count known when shapes bind (an
  initializer, a fed input bound as a constant, which `constant_inputs` makes it; the first condition
  likewise) and a condition that only repeats itself or stays a constant true. A loop whose condition depends on the data runs (up to
  its trip count, if any) when it has no scan outputs. A body whose shapes depend on the iteration
  number (a Slice at `i:i+1`) is typed once per iteration, up to PER_ITERATION_LIMIT iterations.

Sequence and optional values have no rules here: graph/sequences.py expands them into tensors before
a plan binds (inference), and training refuses their ops. The gradients are in control_gradients.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..control_flow import onnx_input_count, outer_bindings
from ..errors import ModelError, UnsupportedOpError
from ..ir import Graph, Node, TensorType
from .registry import op

RUN_BY_EXECUTOR = "the executor runs its bodies itself (odtrain/loops.py)"
PER_ITERATION_LIMIT = 256  # bodies typed once per iteration: beyond this, refused (each is a plan)

INT64_SCALAR = TensorType(np.dtype(np.int64), ())
BOOL_SCALAR = TensorType(np.dtype(np.bool_), ())


def bind_body(node: Node, body: Graph, types, consts, inputs: dict) -> tuple[dict, dict]:
    """(types, folded values) of every value of `body`: `inputs` maps its input names to (TensorType,
    value or None); the values it captures take the node's captured inputs' `types` and `consts`."""
    from ..schedule import bind_types  # the scheduler imports the registry that this module fills

    count = onnx_input_count(node)
    known, constants = {}, {}
    for (inner, outer), t, value in zip(outer_bindings(node), types[count:], consts[count:]):
        if t is None:
            raise ModelError(f"{node.describe()}: its body reads '{inner}', whose type is unknown")
        known[inner] = t
        if value is not None:
            constants[inner] = value
    for name, (t, value) in inputs.items():
        known[name] = t
        if value is not None:
            constants[name] = np.asarray(value)
    constants.update({k: np.asarray(v) for k, v in body.initializers.items()})
    return bind_types(body, known, constants)


def _output_types(node: Node, body: Graph, bound: dict, what: str) -> list[TensorType]:
    result = []
    for name in body.outputs:
        t = bound.get(name)
        if t is None:
            raise ModelError(f"{node.describe()}: {what} output '{name}' is not computed by its body")
        result.append(t)
    return result


# ---- If --------------------------------------------------------------------------------------


@op("If", constant_inputs=(), no_kernel=RUN_BY_EXECUTOR)
def _if_rule(node, types, consts):
    condition = consts[0]
    if condition is not None:
        branch = node.attrs["then_branch" if bool(np.asarray(condition).reshape(-1)[0]) else "else_branch"]
        bound, folded = bind_body(node, branch, types, consts, {})
        out = _output_types(node, branch, bound, "branch")
        if all(name in folded for name in branch.outputs):
            return out, [folded[name] for name in branch.outputs]
        return out
    then_types = _output_types(node, node.attrs["then_branch"], bind_body(node, node.attrs["then_branch"], types,
                                                                          consts, {})[0], "then_branch")
    else_types = _output_types(node, node.attrs["else_branch"], bind_body(node, node.attrs["else_branch"], types,
                                                                          consts, {})[0], "else_branch")
    if len(then_types) != len(node.outputs) or len(else_types) != len(node.outputs):
        raise ModelError(f"{node.describe()}: its branches give {len(then_types)} and {len(else_types)} outputs, "
                         f"the node has {len(node.outputs)}")
    for name, a, b in zip(node.outputs, then_types, else_types):
        if a != b:
            raise UnsupportedOpError(f"{node.describe()}: output '{name}' is {a} in then_branch and {b} in "
                                     "else_branch; odtrain plans static shapes, so both branches must give the same "
                                     "type unless the condition is a constant")
    return then_types


# ---- Scan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScanLayout:
    """How a Scan node walks its inputs: `states` carried values, `scans` scan inputs, `outputs` scan
    outputs, `length` iterations; axes normalised to >= 0, directions 0 (forward) or 1 (reverse)."""

    states: int
    scans: int
    outputs: int
    length: int
    input_axes: tuple[int, ...]
    input_directions: tuple[int, ...]
    output_axes: tuple[int, ...]
    output_directions: tuple[int, ...]


def _normalised(node: Node, axis: int, rank: int, what: str) -> int:
    if not -rank <= axis < rank:
        raise ModelError(f"{node.describe()}: {what} {axis} is out of range for rank {rank}")
    return axis % rank


def scan_layout(node: Node, types, body_output_ranks=None) -> ScanLayout:
    """The layout of a Scan at bound input types (`body_output_ranks`: the ranks of the body's scan
    outputs, which their axes are normalised against; None leaves those axes as given)."""
    body = node.attrs["body"]
    scans = int(node.attrs.get("num_scan_inputs", 0))
    states = len(body.inputs) - scans
    outputs = len(body.outputs) - states
    if scans < 1 or states < 0 or outputs < 0 or onnx_input_count(node) != states + scans:
        raise ModelError(f"{node.describe()}: num_scan_inputs {scans} does not fit a body of {len(body.inputs)} "
                         f"inputs and {len(body.outputs)} outputs and {onnx_input_count(node)} node inputs")
    input_axes = [int(a) for a in node.attrs.get("scan_input_axes", [0] * scans)]
    input_directions = tuple(int(d) for d in node.attrs.get("scan_input_directions", [0] * scans))
    output_axes = [int(a) for a in node.attrs.get("scan_output_axes", [0] * outputs)]
    output_directions = tuple(int(d) for d in node.attrs.get("scan_output_directions", [0] * outputs))
    length = None
    for k in range(scans):
        t = types[states + k]
        input_axes[k] = _normalised(node, input_axes[k], len(t.shape), "scan_input_axes entry")
        dim = t.shape[input_axes[k]]
        if length is not None and dim != length:
            raise ModelError(f"{node.describe()}: its scan inputs have {length} and {dim} iterations along their "
                             "axes; every scan input must have the same")
        length = dim
    if body_output_ranks is not None:
        output_axes = [_normalised(node, a, r + 1, "scan_output_axes entry") for a, r in zip(output_axes, body_output_ranks)]
    return ScanLayout(states, scans, outputs, length, tuple(input_axes), input_directions, tuple(output_axes),
                      output_directions)


def bind_scan_body(node: Node, types, consts):
    """(layout, body types, body folded values) of a Scan at bound input types."""
    body = node.attrs["body"]
    layout = scan_layout(node, types)
    inputs = {}
    for k, name in enumerate(body.inputs):
        t = types[k]
        if k >= layout.states:
            axis = layout.input_axes[k - layout.states]
            t = TensorType(t.dtype, t.shape[:axis] + t.shape[axis + 1:])
        inputs[name] = (t, None)
    bound, folded = bind_body(node, body, types, consts, inputs)
    out = _output_types(node, body, bound, "body")
    layout = scan_layout(node, types, [len(t.shape) for t in out[layout.states:]])
    for k in range(layout.states):
        if out[k] != types[k]:
            raise UnsupportedOpError(f"{node.describe()}: carried value '{body.inputs[k]}' enters as {types[k]} and "
                                     f"leaves as {out[k]}; odtrain plans static shapes, so it must keep its type")
    return layout, bound, folded


@op("Scan", no_kernel=RUN_BY_EXECUTOR)
def _scan_rule(node, types, consts):
    layout, bound, _ = bind_scan_body(node, types, consts)
    body = node.attrs["body"]
    result = [types[k] for k in range(layout.states)]
    for k in range(layout.outputs):
        t = bound[body.outputs[layout.states + k]]
        axis = layout.output_axes[k]
        result.append(TensorType(t.dtype, t.shape[:axis] + (layout.length,) + t.shape[axis:]))
    return result


# ---- Loop ------------------------------------------------------------------------------------


@dataclass
class LoopBinding:
    """How a Loop runs at bound input types: `trip` the trip count (None: none), `fixed` whether it runs
    exactly `iterations` times (else its condition decides, up to `trip`), `per_iteration` whether each
    iteration has its own body types (`bodies[t]`; else `bodies[0]` serves all), each (types, folded)."""

    trip: int | None
    fixed: bool
    iterations: int | None
    per_iteration: bool
    bodies: list


def _repeats_condition(body: Graph, bound: dict, folded: dict) -> bool:
    """Whether the body's condition output is its condition input passed on, or a constant true."""
    name = body.outputs[0]
    if name in folded:
        return bool(np.asarray(folded[name]).reshape(-1)[0])
    producers = body.producers()
    while name in producers and producers[name].op_type == "Identity":
        name = producers[name].inputs[0]
    return name == body.inputs[1]


def bind_loop_body(node: Node, types, consts) -> LoopBinding:
    body = node.attrs["body"]
    count = onnx_input_count(node)
    carried = count - 2
    if len(body.inputs) != count or len(body.outputs) < 1 + carried:
        raise ModelError(f"{node.describe()}: its body takes {len(body.inputs)} inputs and gives {len(body.outputs)} "
                         f"outputs for {carried} carried values")
    has_trip = bool(node.inputs[0])
    has_condition = count > 1 and bool(node.inputs[1])
    trip = int(np.asarray(consts[0]).reshape(-1)[0]) if has_trip and consts[0] is not None else None
    if has_trip and trip is None:
        raise UnsupportedOpError(f"{node.describe()}: its trip count '{node.inputs[0]}' is computed from the data; "
                                 "odtrain plans static shapes: make it a constant or a model input")
    start = None if not has_condition else (None if consts[1] is None else bool(np.asarray(consts[1]).reshape(-1)[0]))
    if not has_trip and not has_condition:
        raise UnsupportedOpError(f"{node.describe()}: it has neither a trip count nor a condition and would never "
                                 "stop")

    def inputs_at(iteration):
        named = {body.inputs[0]: (INT64_SCALAR, None if iteration is None else np.array(iteration, np.int64)),
                 body.inputs[1]: (BOOL_SCALAR, None)}
        named.update((body.inputs[2 + k], (types[2 + k], None)) for k in range(carried))
        return named

    try:
        bodies, per_iteration = [bind_body(node, body, types, consts, inputs_at(None))], False
    except ModelError as error:
        if trip is None or trip > PER_ITERATION_LIMIT:
            raise
        try:
            bodies, per_iteration = [bind_body(node, body, types, consts, inputs_at(t)) for t in range(trip)], True
        except ModelError:
            raise error from None
    # Without a condition input the body's condition is ignored (ONNX's for loop)
    fixed = has_trip and (not has_condition or start is not None and all(_repeats_condition(body, *b) for b in bodies))
    iterations = (0 if start is False else trip) if fixed else None
    binding = LoopBinding(trip, fixed, iterations, per_iteration, bodies)
    scans = len(body.outputs) - 1 - carried
    for b, _ in bodies:
        out = _output_types(node, body, b, "body")
        for k in range(carried):
            if out[1 + k] != types[2 + k]:
                raise UnsupportedOpError(f"{node.describe()}: carried value '{body.inputs[2 + k]}' enters as "
                                         f"{types[2 + k]} and leaves as {out[1 + k]}; odtrain plans static shapes, "
                                         "so it must keep its type")
        if scans and not fixed:
            raise UnsupportedOpError(f"{node.describe()}: its scan outputs need the number of iterations ahead, and "
                                     "its condition depends on the data; odtrain plans static shapes: give the loop "
                                     "a trip count and a condition that stays true")
    return binding


@op("Loop", constant_inputs=(0, 1), no_kernel=RUN_BY_EXECUTOR)
def _loop_rule(node, types, consts):
    binding = bind_loop_body(node, types, consts)
    body = node.attrs["body"]
    carried = onnx_input_count(node) - 2
    result = [types[2 + k] for k in range(carried)]
    scan_types = None
    for bound, _ in binding.bodies:
        now = [bound[name] for name in body.outputs[1 + carried:]]
        if scan_types is not None and now != scan_types:
            raise UnsupportedOpError(f"{node.describe()}: its scan outputs change type from one iteration to the "
                                     f"next ({scan_types} then {now}); odtrain stacks them into one tensor")
        scan_types = now
    result.extend(TensorType(t.dtype, (binding.iterations or 0,) + t.shape) for t in scan_types or [])
    return result

