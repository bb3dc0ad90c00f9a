"""Subgraphs in the IR: the bodies of If, Loop and Scan, and the values they read from outside.

ONNX lets a body read any value of an enclosing scope by name (a weight, a graph input, a value
computed before the node). Every pass of odtrain reasons over `Node.inputs` (lifetimes, execution
order, pruning, autodiff's fan-in, frozen analysis), so the loader makes those reads explicit:

- A control-flow node's `inputs` are its ONNX inputs followed by its *captured* values: the names its
  subgraphs read from outside, in the order `captured_names` gives (first read first, then branch
  before else branch). Nothing else records them, so the list is a pure function of the bodies.
- A body's own nodes carry their captures the same way, so a value read two scopes down is a
  captured input of the inner node, then of the outer one (`free_names` sees it in both).
- Passes may rename a node's inputs (recomputation, LoRA): position, not name, joins the i-th
  captured input to the i-th name of `captured_names`, so the executor binds the body's outer name
  to whatever value now sits in that slot.
- Export drops the captured inputs again (`onnx_inputs`): the file holds standard ONNX.

`fold_constant_ifs` inlines the branch an If takes when its condition is a constant of the model
(an initializer, a Constant node), as artifacts are prepared.
"""
from __future__ import annotations

import numpy as np

from .errors import ModelError
from .ir import Graph, NameScope, Node

CONTROL_FLOW = ("If", "Loop", "Scan")
SUBGRAPH_ATTRIBUTES = {"If": ("then_branch", "else_branch"), "Loop": ("body",), "Scan": ("body",)}


def is_control_flow(node: Node) -> bool:
    return node.op_type in CONTROL_FLOW and node.domain in ("", "ai.onnx")


def subgraphs(node: Node) -> list[Graph]:
    """The Graph attributes of a node (none for other ops): If's then_branch before its else_branch, other
    keys in sorted order, whatever order a file listed them in."""
    keys = SUBGRAPH_ATTRIBUTES.get(node.op_type, ())
    ordered = [k for k in keys if k in node.attrs] + sorted(k for k in node.attrs if k not in keys)
    return [node.attrs[k] for k in ordered if isinstance(node.attrs[k], Graph)]


def free_names(body: Graph) -> list[str]:
    """The names `body` reads that it does not define (inputs, initializers, its nodes' outputs), in the
    order first read: what the body reads from the enclosing scopes."""
    defined = set(body.inputs) | set(body.initializers)
    free: list[str] = []
    seen: set[str] = set()
    for node in body.nodes:
        for name in node.inputs:
            if name and name not in defined and name not in seen:
                seen.add(name)
                free.append(name)
        defined.update(o for o in node.outputs if o)
    for name in body.outputs:  # an output may be an outer value passed through
        if name not in defined and name not in seen:
            seen.add(name)
            free.append(name)
    return free


def captured_names(node: Node) -> list[str]:
    """The outer values a control-flow node's subgraphs read, in the order of its captured inputs."""
    names: list[str] = []
    for body in subgraphs(node):
        names.extend(n for n in free_names(body) if n not in names)
    return names


def onnx_input_count(node: Node) -> int:
    """How many of a node's inputs are its ONNX inputs (the rest are captured values)."""
    return len(node.inputs) - len(captured_names(node)) if subgraphs(node) else len(node.inputs)


def onnx_inputs(node: Node) -> list[str]:
    return node.inputs[:onnx_input_count(node)]


def with_captures(node: Node) -> Node:
    """`node` (changed in place, and returned) with its captured values appended to its inputs; a node
    whose inputs already hold them is left as it is."""
    if subgraphs(node):
        count = len(node.inputs)
        captured = captured_names(node)
        if node.inputs[count - len(captured):] != captured or not captured:
            node.inputs = list(node.inputs) + captured
    return node


def outer_bindings(node: Node) -> list[tuple[str, str]]:
    """(the name a body reads, the outer value that feeds it now) for each captured input."""
    captured = captured_names(node)
    return list(zip(captured, node.inputs[len(node.inputs) - len(captured):]))


def walk(graph: Graph):
    """Every node of `graph` and of its subgraphs, outer ones first."""
    for node in graph.nodes:
        yield node
        for body in subgraphs(node):
            yield from walk(body)


def fold_constant_ifs(graph: Graph) -> Graph:
    """A copy of `graph` in which each If whose condition is a constant (an initializer or a Constant
    node's value) is replaced by the nodes of the branch it takes, their values renamed apart from the
    graph's; the branch's outputs become the If's outputs. Other nodes are kept as they are."""
    from .ops.tensor import constant_value

    if not any(is_control_flow(n) and n.op_type == "If" for n in graph.nodes):
        return graph
    folded = graph.copy()
    constants = {k: np.asarray(v) for k, v in folded.initializers.items() if k not in folded.inputs}
    names = NameScope(folded)
    nodes: list[Node] = []
    for node in folded.nodes:
        if node.op_type == "Constant" and node.outputs and not subgraphs(node):
            try:
                constants[node.outputs[0]] = np.asarray(constant_value(node))
            except Exception:  # a Constant the rules cannot read: not a condition we fold
                pass
        condition = constants.get(node.inputs[0]) if node.op_type == "If" and node.inputs else None
        if condition is None or condition.size != 1:
            nodes.append(node)
            continue
        branch = node.attrs["then_branch" if bool(condition.reshape(-1)[0]) else "else_branch"]
        nodes.extend(_inlined(branch, node, names, folded))
    folded.nodes = nodes
    return folded


def _inlined(branch: Graph, node: Node, names: NameScope, graph: Graph) -> list[Node]:
    """The nodes of `branch`, renamed apart, with its outputs renamed to the If node's outputs."""
    if len(branch.outputs) != len(node.outputs):
        raise ModelError(f"{node.describe()}: its branch has {len(branch.outputs)} outputs, the node "
                         f"{len(node.outputs)}")
    renamed: dict[str, str] = {}
    defined = set(branch.initializers) | {o for n in branch.nodes for o in n.outputs if o}
    for name in defined:
        renamed[name] = names.fresh(f"{node.name}/{name}")
    for inner, outer in zip(branch.outputs, node.outputs):
        if inner in defined and inner not in branch.initializers and outer:
            renamed[inner] = outer
    for name, value in branch.initializers.items():
        graph.initializers[renamed[name]] = value
    result = [Node(n.op_type, [renamed.get(i, i) for i in n.inputs], [renamed.get(o, o) for o in n.outputs],
                   dict(n.attrs), names.fresh(f"{node.name}/{n.name}"), n.domain, n.scope)
              for n in _renamed_bodies(branch.nodes, renamed)]
    for inner, outer in zip(branch.outputs, node.outputs):  # an output that is an outer value or an initializer
        if outer and renamed.get(inner, inner) != outer:
            result.append(Node("Identity", [renamed.get(inner, inner)], [outer], {}, names.fresh(f"{node.name}/out")))
    for name, t in branch.value_types.items():
        if name in renamed:
            graph.value_types.setdefault(renamed[name], t)
    return result


def _renamed_bodies(nodes: list[Node], renamed: dict[str, str]) -> list[Node]:
    """Nodes whose nested bodies read renamed values: those bodies read the new names."""
    result = []
    for n in nodes:
        if subgraphs(n) and any(name in renamed for name in captured_names(n)):
            attrs = {k: rename_free(v, renamed) if isinstance(v, Graph) else v for k, v in n.attrs.items()}
            n = Node(n.op_type, list(n.inputs), list(n.outputs), attrs, n.name, n.domain, n.scope)
        result.append(n)
    return result


def rename_free(body: Graph, renamed: dict[str, str]) -> Graph:
    """A copy of `body` in which the outer values it reads are renamed (`renamed`: old -> new)."""
    free = set(free_names(body))
    mapping = {k: v for k, v in renamed.items() if k in free}
    if not mapping:
        return body
    copy = body.copy()
    copy.nodes = _renamed_bodies(copy.nodes, mapping)
    for n in copy.nodes:
        n.inputs = [mapping.get(i, i) for i in n.inputs]
    copy.outputs = [mapping.get(o, o) for o in copy.outputs]
    return copy


def loops_as_scans(graph: Graph) -> Graph:
    """A copy of `graph` in which each Loop that is a scan in disguise becomes a Scan: a trip count that is
    a constant, no condition or one that stays true (passed on, or a constant true), and outer values read
    only by `Gather(value, i, axis=0)` of the iteration number `i`, with as many rows as the trip count. Each
    such value becomes a scan input whose slices are the rows the Gather took; `i`, if the body reads it
    otherwise, a scan input over Range(0, trip). Its gradient is then the reverse Scan's, whose rows are
    scan outputs, instead of a dense tensor summed every iteration (benchmarks/loops.py --train)."""
    if not any(is_control_flow(n) and n.op_type == "Loop" for n in graph.nodes):
        return graph
    changed = graph.copy()
    names = NameScope(changed)
    nodes = []
    for node in changed.nodes:
        nodes.extend(_as_scan(node, changed, names) or [node])
    changed.nodes = nodes
    return changed


def _as_scan(node: Node, graph: Graph, names: NameScope) -> list[Node] | None:
    if node.op_type != "Loop" or not node.inputs or not node.inputs[0]:
        return None
    body = node.attrs["body"]
    trip = _constant_of(graph, node.inputs[0])
    count = onnx_input_count(node)
    if trip is None or np.asarray(trip).size != 1 or count < 2:
        return None
    trip = int(np.asarray(trip).reshape(-1)[0])
    if node.inputs[1]:
        start = _constant_of(graph, node.inputs[1])
        if start is None or not bool(np.asarray(start).reshape(-1)[0]) or not _passes_condition_on(body, graph):
            return None
    counter, condition = body.inputs[0], body.inputs[1]
    gathers, other_reads = {}, False
    free = set(free_names(body))
    for inner in body.nodes:
        if inner.op_type == "Gather" and len(inner.inputs) == 2 and inner.inputs[1] == counter and \
                int(inner.attrs.get("axis", 0)) == 0 and inner.inputs[0] in free:
            t = graph.value_types.get(inner.inputs[0])
            if t is None or t.shape is None or not t.shape or t.shape[0] != trip:
                return None
            gathers[inner.outputs[0]] = inner.inputs[0]
        elif counter in inner.inputs:
            other_reads = True
        if any(i in set(gathers.values()) for i in inner.inputs) and inner.op_type != "Gather":
            return None  # a gathered value read otherwise too
    if not gathers:
        return None
    carried = count - 2
    kept_outputs = body.outputs[1:]
    needed = set(kept_outputs)
    kept: list[Node] = []
    for inner in reversed(body.nodes):
        if inner.op_type == "Gather" and inner.outputs[0] in gathers:
            continue
        if any(o in needed for o in inner.outputs):
            kept.append(inner)
            needed.update(i for i in inner.inputs if i)
    kept.reverse()
    if condition in needed:
        return None  # the body computes with its condition
    scan_body = Graph(kept, body.inputs[2:] + list(gathers) + ([counter] if other_reads else []), kept_outputs,
                      dict(body.initializers), dict(body.value_types), dict(body.opsets), body.name)
    for row, whole in gathers.items():
        t = graph.value_types[whole]
        scan_body.value_types[row] = type(t)(t.dtype, tuple(t.shape[1:]))
    made = []
    streams = list(gathers.values())
    if other_reads:
        start, step = names.fresh(f"{node.name}/start"), names.fresh(f"{node.name}/step")
        graph.initializers[start], graph.initializers[step] = np.array(0, np.int64), np.array(1, np.int64)
        steps = names.fresh(f"{node.name}/iterations")
        made.append(Node("Range", [start, node.inputs[0], step], [steps], {}, names.fresh(f"{node.name}/range")))
        streams.append(steps)
    made.append(with_captures(Node("Scan", node.inputs[2:count] + streams, list(node.outputs),
                                   {"body": scan_body, "num_scan_inputs": len(streams)}, node.name, node.domain,
                                   node.scope)))
    return made


def _constant_of(graph: Graph, name: str):
    """The value of `name` if an initializer or a Constant node of `graph` gives it, else None."""
    from .ops.tensor import constant_value

    if name in graph.initializers:
        return graph.initializers[name]
    producer = graph.producers().get(name)
    return constant_value(producer) if producer is not None and producer.op_type == "Constant" else None


def _passes_condition_on(body: Graph, graph: Graph) -> bool:
    """Whether a Loop body's condition output is its condition input, through Identity nodes, or a constant
    true of the Loop's `graph` that the body reads (the TorchScript exporter's `Identity(true)`)."""
    name, producers = body.outputs[0], body.producers()
    while name in producers and producers[name].op_type == "Identity":
        name = producers[name].inputs[0]
    if name not in producers and name not in body.inputs and name not in body.initializers:
        value = _constant_of(graph, name)
        if value is not None:
            return bool(np.asarray(value).reshape(-1)[0])
    return name == body.inputs[1]


def map_bodies(node: Node, change) -> Node:
    """`node` with each body replaced by `change(body)` (a new node; `node` is left as it is), its captured
    inputs those the new bodies read."""
    if not subgraphs(node):
        return node
    count = onnx_input_count(node)
    attrs = {k: change(v) if isinstance(v, Graph) else v for k, v in node.attrs.items()}
    return with_captures(Node(node.op_type, node.inputs[:count], list(node.outputs), attrs, node.name, node.domain,
                              node.scope))
