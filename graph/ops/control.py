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

Sequence and optional values are refused where they appear (their ops have no rules).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..control_flow import onnx_input_count, outer_bindings
from ..errors import ModelError, UnsupportedOpError
from ..ir import Graph, Node, TensorType
from .registry import grad as grad_rule
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


# ---- Gradients -------------------------------------------------------------------------------
# Each rule differentiates a body into a body (`differentiate`: autodiff's reverse walk, run over the
# body with the gradients of its outputs as seeds) and emits one control-flow node over it:
# - If: an If on the same condition over the two branches' gradient bodies; a captured value a branch
#   does not reach gets zeros there, so the branch not taken contributes nothing.
# - Scan: the forward Scan also stacks the state each iteration enters with (saved states); a reverse
#   Scan over the body's gradient carries the states' gradients and, for each captured value, the sum of
#   its gradients over the iterations, and stacks the scan inputs' gradients. Each backward iteration
#   recomputes its forward iteration from the saved state (the body's values are not kept T times).
# - Loop with a trip count and a condition that stays true: as Scan, the backward a reverse Scan over
#   the iteration numbers. A Loop whose condition depends on the data is refused (UnsupportedOpError).


def _inner_constant(ctx):
    """The constant value of an outer value a body of `ctx.node` reads by its inner name, or None."""
    outer = dict(outer_bindings(ctx.node))
    return lambda inner: ctx.known_constant(outer[inner]) if inner in outer else None


def _zeros_like(emit, name: str, dtype) -> str:
    """Emit zeros of `name`'s shape and `dtype` through `emit(op_type, inputs, attrs)`; their name."""
    shape = emit("Shape", [name], {})
    return emit("ConstantOfShape", [shape], {"value": np.zeros(1, np.dtype(dtype or np.float32))})


def _dtype_of(types: dict, name: str):
    t = types.get(name)
    return None if t is None else np.dtype(t.dtype)


SMALL_CONSTANT = 1024  # outer constants of at most this many elements are copied into gradient bodies


def differentiate(body: Graph, seeds: dict[str, str], wanted: list[str], outer_types: dict, hint: str,
                  outer_constant=None):
    """A copy of `body` with gradient nodes appended, and {name: its gradient's name, or ''} for each of
    `wanted` (body inputs or values it captures): the reverse walk of graph/autodiff.py from `seeds`
    (body output -> the name of its gradient, a new input or an outer value). Small outer constants the
    body reads (`outer_constant(name)`: axes, shapes) become its own, so that gradient rules that need
    their values (ReduceSum's axes) see them."""
    from ..autodiff import BackwardBuilder, _depends_on, _rank_lookup, _wanted_inputs
    from ..control_flow import free_names
    from .registry import GradContext, lookup

    work = body.copy()
    for name in free_names(body) if outer_constant is not None else []:
        value = outer_constant(name)
        if value is not None and np.asarray(value).size <= SMALL_CONSTANT and name not in wanted:
            work.initializers[name] = np.asarray(value)
    work.value_types = {**outer_types, **body.value_types}
    builder = BackwardBuilder(work)
    builder.names.taken |= set(outer_types) | set(seeds.values())
    builder.names.prefix = f"{hint}/"
    reaches = _depends_on(work, set(wanted))
    contributions: dict[str, list[str]] = {}
    for output, gradient in seeds.items():
        contributions.setdefault(output, []).append(gradient)

    def total(value: str) -> str:
        parts = contributions.get(value, [])
        if len(parts) <= 1:
            return parts[0] if parts else ""
        summed = builder.emit("Sum", parts, {}, "", 1, f"{value}_grad_sum")[0]
        contributions[value] = [summed]
        return summed

    for node in reversed(work.nodes):
        if not any(o in contributions for o in node.outputs):
            continue
        wanted_inputs = _wanted_inputs(work, node, reaches)
        if not any(wanted_inputs):
            continue
        opdef = lookup(node)
        if opdef.gradient is None:
            reason = f" ({opdef.no_grad_reason})" if opdef.no_grad_reason else ""
            raise UnsupportedOpError(f"{node.describe()} in the body of '{hint}': no gradient rule for "
                                     f"{node.op_type}{reason}, and a trainable parameter depends on it")
        ctx = GradContext(node, [total(o) for o in node.outputs], wanted_inputs, builder, _rank_lookup(work))
        opdef.gradient(ctx)
        for index, gradient in ctx.input_grads.items():
            contributions.setdefault(node.inputs[index], []).append(gradient)
    grads = {name: total(name) for name in wanted}
    return work, builder, grads


def _finish_body(work: Graph, builder, inputs: list[str], outputs: list[str], types: dict) -> Graph:
    """`work` as a body taking `inputs` and giving `outputs`, its value types those it defines."""
    work.nodes = list(work.nodes) + builder.nodes
    work.inputs, work.outputs = list(inputs), list(outputs)
    defined = set(inputs) | set(work.initializers) | {o for n in work.nodes for o in n.outputs if o}
    work.value_types = {k: v for k, v in {**work.value_types, **types}.items() if k in defined and v is not None}
    return work


def _body_emitter(builder, hint: str):
    def emit(op_type, inputs, attrs):
        return builder.emit(op_type, inputs, attrs, "", 1, f"{hint}_{op_type.lower()}")[0]

    return emit


def _outer_emitter(ctx):
    def emit(op_type, inputs, attrs):
        return ctx.emit(op_type, inputs, attrs)

    return emit


@grad_rule("If")
def _if_grad(ctx):
    from ..control_flow import with_captures

    node = ctx.node
    captured = outer_bindings(node)
    outer_types = ctx.value_types
    wanted = [j for j in range(len(captured)) if ctx.needs(1 + j)]
    branches = {}
    for key in ("then_branch", "else_branch"):
        branch = node.attrs[key]
        seeds = {out: ctx.GO(i) for i, out in enumerate(branch.outputs) if ctx.GO(i)}
        work, builder, grads = differentiate(branch, seeds, [captured[j][0] for j in wanted], outer_types,
                                             f"{node.name}_{key}_grad", _inner_constant(ctx))
        emit = _body_emitter(builder, "zeros")
        outputs = [grads[captured[j][0]] or _zeros_like(emit, captured[j][0], _dtype_of(outer_types, captured[j][1]))
                   for j in wanted]
        outputs = [emit("Identity", [name], {}) for name in outputs]  # a branch's outputs are its own values
        branches[key] = _finish_body(work, builder, [], outputs, {})
    results = [ctx.fresh(f"{captured[j][1]}_grad_{node.name}") for j in wanted]
    backward = with_captures(Node("If", [node.inputs[0]], results, branches, ctx.fresh(f"{node.name}_grad")))
    ctx.add_node(backward)
    for j, name in zip(wanted, results):
        ctx.set_grad(1 + j, name)


def _saving_states(node: Node, ctx, first_state: int, states: int, scan_outputs: int, first_output: int) -> list[str]:
    """Make the forward `node` also stack the state each iteration enters with (its body's inputs
    first_state.. as extra scan outputs, along axis 0, forward); their outer names."""
    from ..ir import NameScope

    if not states:
        return []
    body = node.attrs["body"]
    extended = body.copy()
    names = NameScope(extended, "saved/")
    for k in range(states):
        name = body.inputs[first_state + k]
        out = names.fresh(name)
        extended.nodes.append(Node("Identity", [name], [out], {}, names.fresh(f"{name}_save")))
        extended.outputs.append(out)
        if name in body.value_types:
            extended.value_types[out] = body.value_types[name]
    node.attrs["body"] = extended
    if node.op_type == "Scan":
        node.attrs["scan_output_axes"] = list(node.attrs.get("scan_output_axes", [0] * scan_outputs)) + [0] * states
        node.attrs["scan_output_directions"] = (list(node.attrs.get("scan_output_directions", [0] * scan_outputs))
                                                + [0] * states)
    return [ctx.forward_output(first_output + k, f"saved_state{k}") for k in range(states)]


def _reverse_scan(ctx, body: Graph, *, hint: str, state_names: list[str], state_outer: list[str], state_seeds: list[str],
                  scanned: list[tuple[str, str, int, int]], scan_seeds: list[tuple[str, str, int, int]],
                  gradients_of_scanned: list[int], constants: dict, first_captured: int):
    """Emit the reverse Scan over `body`'s gradient; return (initial-state gradients, captured value
    gradients by captured index, scan-input gradients by `scanned` index).

    `state_names`: the body's carried inputs (their outputs are body.outputs[offset..]); `state_seeds`:
    the outer gradients of their final values ('' for none); `state_outer`: the outer values they start
    from. `scanned`: (body input name, outer stacked
    value, axis, forward direction) for the saved states and scan inputs; `scan_seeds`: (body output,
    its outer gradient, axis, forward direction) for scan outputs that receive one. `constants`: body
    inputs that become constants of the backward body (Loop's condition)."""
    from ..control_flow import with_captures

    node = ctx.node
    outer_types = ctx.value_types
    captured = outer_bindings(node)
    wanted_captured = [j for j in range(len(captured)) if ctx.needs(first_captured + j)]
    state_grads_in = [ctx.fresh(f"{hint}/d_{n}") for n in state_names]
    accumulators_in = [ctx.fresh(f"{hint}/acc_{captured[j][0]}") for j in wanted_captured]
    dy_in = [ctx.fresh(f"{hint}/d_{out}") for out, _, _, _ in scan_seeds]
    seeds = {}
    for name, gradient in zip(_carried_outputs(node, body), state_grads_in):
        seeds.setdefault(name, gradient)
    for (out, _, _, _), gradient in zip(scan_seeds, dy_in):
        seeds[out] = gradient
    wanted = list(state_names) + [scanned[i][0] for i in gradients_of_scanned] + [captured[j][0] for j in wanted_captured]
    work, builder, grads = differentiate(body, seeds, wanted, outer_types, hint, _inner_constant(ctx))
    for name, value in constants.items():
        work.initializers[name] = value
        work.inputs = [i for i in work.inputs if i != name]
    emit = _body_emitter(builder, "zeros")
    body_types = {**outer_types, **body.value_types}
    state_out = [emit("Identity", [grads[n] or _zeros_like(emit, n, _dtype_of(body_types, n))], {}) for n in state_names]
    accumulated = [emit("Add", [acc, grads[captured[j][0]]], {}) if grads[captured[j][0]] else emit("Identity", [acc], {})
                   for acc, j in zip(accumulators_in, wanted_captured)]
    scanned_out = [emit("Identity", [grads[scanned[i][0]] or _zeros_like(emit, scanned[i][0],
                                                                         _dtype_of(body_types, scanned[i][0]))], {})
                   for i in gradients_of_scanned]
    types = {}
    for name, carried in zip(state_grads_in, state_names):
        types[name] = body_types.get(carried)
    for name, j in zip(accumulators_in, wanted_captured):
        types[name] = outer_types.get(captured[j][1])
    for name, (out, _, _, _) in zip(dy_in, scan_seeds):
        types[name] = body_types.get(out)
    backward_body = _finish_body(work, builder, state_grads_in + accumulators_in + [s[0] for s in scanned] + dy_in,
                                 state_out + accumulated + scanned_out, types)
    outer = _outer_emitter(ctx)
    initial = [seed or _zeros_like(outer, outer_name, _dtype_of(body_types, name))
               for seed, name, outer_name in zip(state_seeds, state_names, state_outer)]
    initial += [_zeros_like(outer, captured[j][1], _dtype_of(outer_types, captured[j][1])) for j in wanted_captured]
    streams = [(outer_name, axis, 1 - direction) for _, outer_name, axis, direction in scanned]
    streams += [(gradient, axis, 1 - direction) for _, gradient, axis, direction in scan_seeds]
    attrs = {"body": backward_body, "num_scan_inputs": len(streams),
             "scan_input_axes": [a for _, a, _ in streams], "scan_input_directions": [d for _, _, d in streams],
             "scan_output_axes": [scanned[i][2] for i in gradients_of_scanned],
             "scan_output_directions": [1 - scanned[i][3] for i in gradients_of_scanned]}
    results = [ctx.fresh(f"{hint}/initial_{n}") for n in state_names]
    results += [ctx.fresh(f"{captured[j][1]}_grad_{node.name}") for j in wanted_captured]
    results += [ctx.fresh(f"{hint}/d_{scanned[i][1]}") for i in gradients_of_scanned]
    backward = with_captures(Node("Scan", initial + [s for s, _, _ in streams], results, attrs, ctx.fresh(hint)))
    ctx.add_node(backward)
    states = len(state_names)
    by_captured = dict(zip(wanted_captured, results[states:states + len(wanted_captured)]))
    return results[:states], by_captured, results[states + len(wanted_captured):]


def _carried_outputs(node: Node, body: Graph) -> list[str]:
    """The body outputs that give the carried values' next values."""
    if node.op_type == "Scan":
        states = len(body.inputs) - int(node.attrs.get("num_scan_inputs", 0))
        return body.outputs[:states]
    return body.outputs[1:len(body.inputs) - 1]


@grad_rule("Scan")
def _scan_grad(ctx):
    node = ctx.node
    body = node.attrs["body"]
    scans = int(node.attrs.get("num_scan_inputs", 0))
    states = len(body.inputs) - scans
    outputs = len(body.outputs) - states
    input_axes = [int(a) for a in node.attrs.get("scan_input_axes", [0] * scans)]
    input_directions = [int(d) for d in node.attrs.get("scan_input_directions", [0] * scans)]
    output_axes = [int(a) for a in node.attrs.get("scan_output_axes", [0] * outputs)]
    output_directions = [int(d) for d in node.attrs.get("scan_output_directions", [0] * outputs)]
    saved = _saving_states(node, ctx, 0, states, outputs, states + outputs)
    scanned = [(body.inputs[k], saved[k], 0, 0) for k in range(states)]
    scanned += [(body.inputs[states + i], node.inputs[states + i], input_axes[i], input_directions[i])
                for i in range(scans)]
    scan_seeds = [(body.outputs[states + k], ctx.GO(states + k), output_axes[k], output_directions[k])
                  for k in range(outputs) if ctx.GO(states + k)]
    wanted_scans = [states + i for i in range(scans) if ctx.needs(states + i)]
    initial, by_captured, by_scan = _reverse_scan(
        ctx, body, hint=f"{node.name}_grad", state_names=body.inputs[:states], state_outer=node.inputs[:states],
        state_seeds=[ctx.GO(k) for k in range(states)], scanned=scanned, scan_seeds=scan_seeds,
        gradients_of_scanned=wanted_scans, constants={}, first_captured=states + scans)
    for k in range(states):
        ctx.set_grad(k, initial[k])
    for index, name in zip(wanted_scans, by_scan):
        ctx.set_grad(index, name)
    for j, name in by_captured.items():
        ctx.set_grad(states + scans + j, name)


def _condition_stays_true(body: Graph) -> bool:
    """Whether a Loop body's condition output is its condition input passed on (through Identity), or a
    Constant true."""
    from .tensor import constant_value

    name = body.outputs[0]
    producers = body.producers()
    while name in producers and producers[name].op_type == "Identity":
        name = producers[name].inputs[0]
    if name in producers and producers[name].op_type == "Constant":
        return bool(np.asarray(constant_value(producers[name])).reshape(-1)[0])
    if name in body.initializers:
        return bool(np.asarray(body.initializers[name]).reshape(-1)[0])
    return name == body.inputs[1]


@grad_rule("Loop")
def _loop_grad(ctx):
    node = ctx.node
    body = node.attrs["body"]
    has_condition = len(node.inputs) > 1 and node.inputs[1] and onnx_input_count(node) > 1
    if not node.inputs[0] or (has_condition and not _condition_stays_true(body)):
        raise UnsupportedOpError(
            f"{node.describe()}: a Loop whose condition depends on the data has no gradient in odtrain (the "
            "reverse pass would need the forward's iteration count); give it a trip count and a condition that "
            "stays true, or freeze the parameters it reads")
    carried = onnx_input_count(node) - 2
    outputs = len(body.outputs) - 1 - carried
    saved = _saving_states(node, ctx, 2, carried, outputs, carried + outputs)
    start, step = ctx.constant(np.array(0, np.int64), "loop_start"), ctx.constant(np.array(1, np.int64), "loop_step")
    iterations = ctx.emit("Range", [start, ctx.I(0), step])
    scanned = [(body.inputs[2 + k], saved[k], 0, 0) for k in range(carried)]
    scanned.append((body.inputs[0], iterations, 0, 0))
    scan_seeds = [(body.outputs[1 + carried + k], ctx.GO(carried + k), 0, 0) for k in range(outputs)
                  if ctx.GO(carried + k)]
    initial, by_captured, _ = _reverse_scan(
        ctx, body, hint=f"{node.name}_grad", state_names=body.inputs[2:2 + carried],
        state_outer=node.inputs[2:2 + carried],
        state_seeds=[ctx.GO(k) for k in range(carried)], scanned=scanned, scan_seeds=scan_seeds,
        gradients_of_scanned=[], constants={body.inputs[1]: np.array(True)}, first_captured=2 + carried)
    for k in range(carried):
        ctx.set_grad(2 + k, initial[k])
    for j, name in by_captured.items():
        ctx.set_grad(2 + carried + j, name)
