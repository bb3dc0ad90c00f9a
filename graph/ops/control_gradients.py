"""Gradients of If, Loop and Scan, as graph passes (the type rules are in control.py).

Each rule differentiates a body into a body (`differentiate`: autodiff's reverse walk, run over the
body with the gradients of its outputs as seeds) and emits one control-flow node over it:
- If: an If on the same condition over the two branches' gradient bodies; a captured value a branch
  does not reach gets zeros there, so the branch not taken contributes nothing.
- Scan: the forward Scan also stacks the state each iteration enters with (saved states); a reverse
  Scan over the body's gradient carries the states' gradients and, for each captured value, the sum of
  its gradients over the iterations, and stacks the scan inputs' gradients. Each backward iteration
  recomputes its forward iteration from the saved state (the body's values are not kept T times).
- Loop with a trip count and a condition that stays true: as Scan, the backward a reverse Scan over
  the iteration numbers. A Loop whose condition depends on the data is refused (UnsupportedOpError):
  the reverse pass would need the forward's iteration count.
"""
from __future__ import annotations

import numpy as np

from ..control_flow import onnx_input_count, outer_bindings
from ..errors import UnsupportedOpError
from ..ir import Graph, Node
from .registry import grad as grad_rule


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


SAVED_PREFIX = "saved/"  # the body outputs that stack the states a forward saves for its reverse Scan


def saved_iteration_outputs(node: Node) -> list[str]:
    """The outputs of a forward Scan or Loop that stack what each iteration saves for the backward (the
    states `_saving_states` added), '' omitted."""
    body = node.attrs.get("body")
    if node.op_type not in ("Scan", "Loop") or not isinstance(body, Graph):
        return []
    shift = 1 if node.op_type == "Loop" else 0  # a Loop body's first output is its condition
    return [o for o, inner in zip(node.outputs, body.outputs[shift:]) if o and inner.startswith(SAVED_PREFIX)]


SMALL_CONSTANT = 1024  # outer constants of at most this many elements are copied into gradient bodies


def differentiate(body: Graph, seeds: dict[str, str], wanted: list[str], outer_types: dict, hint: str,
                  outer_constant=None):
    """A copy of `body` with gradient nodes appended, and {name: its gradient's name, or ''} for each of
    `wanted` (body inputs or values it captures): the reverse walk of graph/autodiff.py from `seeds`
    (body output -> the name of its gradient, a new input or an outer value). Small outer constants the
    body reads (`outer_constant(name)`: axes, shapes) become its own, so that gradient rules that need
    their values (ReduceSum's axes) see them."""
    from ..autodiff import BackwardBuilder, depends_on, reverse_walk
    from ..control_flow import free_names

    work = body.copy()
    for name in free_names(body) if outer_constant is not None else []:
        value = outer_constant(name)
        if value is not None and np.asarray(value).size <= SMALL_CONSTANT and name not in wanted:
            work.initializers[name] = np.asarray(value)
    work.value_types = {**outer_types, **body.value_types}
    builder = BackwardBuilder(work)
    builder.names.taken |= set(outer_types) | set(seeds.values())
    builder.names.prefix = f"{hint}/"
    reaches = depends_on(work, set(wanted))
    contributions: dict[str, list[str]] = {}
    for output, gradient in seeds.items():
        contributions.setdefault(output, []).append(gradient)

    def no_rule(node, reason: str) -> UnsupportedOpError:
        return UnsupportedOpError(f"{node.describe()} in the body of '{hint}': no gradient rule for "
                                  f"{node.op_type}{reason}, and a trainable parameter depends on it")

    total = reverse_walk(work, builder, contributions, reaches, no_rule)
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
    first_state.. as extra scan outputs, along axis 0); their outer names. A Scan stacks them in the
    direction of its first scan input, so that the reverse Scan, reading them first, walks the rows the
    forward walked: the executor keys a body's random draws by that row (odtrain/loops.py)."""
    from ..ir import NameScope

    if not states:
        return []
    body = node.attrs["body"]
    extended = body.copy()
    names = NameScope(extended, SAVED_PREFIX)
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
        first = int(list(node.attrs.get("scan_input_directions", [0]))[0])
        node.attrs["scan_output_directions"] = (list(node.attrs.get("scan_output_directions", [0] * scan_outputs))
                                                + [first] * states)
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
    scanned = [(body.inputs[k], saved[k], 0, input_directions[0] if scans else 0) for k in range(states)]
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


def _condition_stays_true(body: Graph, outer_constant=lambda name: None) -> bool:
    """Whether a Loop body's condition output is its condition input passed on (through Identity), or a
    Constant true: the body's own, or one of the enclosing graph that `outer_constant` (a name the body reads
    from outside -> its value, or None) knows, as the TorchScript exporter writes `Identity(true)`."""
    from .tensor import constant_value

    name = body.outputs[0]
    producers = body.producers()
    while name in producers and producers[name].op_type == "Identity":
        name = producers[name].inputs[0]
    if name in producers and producers[name].op_type == "Constant":
        return bool(np.asarray(constant_value(producers[name])).reshape(-1)[0])
    if name in body.initializers:
        return bool(np.asarray(body.initializers[name]).reshape(-1)[0])
    outer = outer_constant(name) if name not in producers and name not in body.inputs else None
    if outer is not None:
        return bool(np.asarray(outer).reshape(-1)[0])
    return name == body.inputs[1]


@grad_rule("Loop")
def _loop_grad(ctx):
    node = ctx.node
    body = node.attrs["body"]
    has_condition = len(node.inputs) > 1 and node.inputs[1] and onnx_input_count(node) > 1
    if not node.inputs[0] or (has_condition and not _condition_stays_true(body, _inner_constant(ctx))):
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
