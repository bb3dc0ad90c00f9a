"""Sequence and optional values, as far as a Loop's carried values and an If's outputs need them.

(The exporters' forms around tensors, a scripted loop's appends and `torch.chunk`'s pieces, become tensors
when a model is read: graph/loop_sequences.py. What is left for this module runs, but does not train.)

odtrain plans static shapes, and once the feeds bind a sequence is static too: its length and its
elements' types are known. `expand_sequences` rewrites a graph holding sequence values into one that
holds tensors only, when the plan is made:
- a sequence value is a list of tensor names. In a body, SequenceEmpty, SequenceConstruct and
  SequenceInsert (at a constant position) build lists, SequenceAt (at a constant position) and
  SequenceLength read them; Optional and OptionalGetElement wrap and unwrap a value, and
  OptionalHasElement is a constant;
- a Loop that carries a sequence or an optional is unrolled: its trip count and its condition must be
  known when shapes bind (the sequence grows, so each iteration has types of its own). Each iteration's
  body joins the enclosing scope, renamed apart, its iteration number a constant;
- an If reading or giving a sequence takes its branch, its condition known when shapes bind;
- a sequence fed or returned is its elements (`Expanded.inputs`, `Expanded.outputs`); an optional fed
  or returned empty is None.
`check_sequences` refuses by name, in one line, the sequence ops at a graph's top level (outside every
Loop and If body) and those that take a sequence apart into tensors of the data's shape
(ConcatFromSequence, SplitToSequence, SequenceErase, SequenceMap).

Invariants: the graph returned holds no sequence op and no sequence value; `expand_sequences` returns
a graph without either unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .control_flow import is_control_flow, map_bodies, onnx_input_count, rename_free, subgraphs, walk
from .errors import UnsupportedOpError
from .ir import Graph, NameScope, Node, TensorType

BODY_OPS = ("SequenceEmpty", "SequenceConstruct", "SequenceInsert", "SequenceAt", "SequenceLength", "Optional",
            "OptionalHasElement", "OptionalGetElement")
REFUSED_OPS = ("ConcatFromSequence", "SplitToSequence", "SequenceErase", "SequenceMap")
SEQUENCE_OPS = BODY_OPS + REFUSED_OPS
WHAT_RUNS = ("odtrain runs sequence and optional values only as a Loop's carried values and an If's outputs, "
             "built inside their bodies")


@dataclass
class Expanded:
    """A graph without sequences: `graph`; `inputs` maps a fed sequence's name to its element inputs
    (None: an optional fed empty); `outputs` maps a returned sequence's name to its element outputs (a
    list), or to None (an empty optional)."""

    graph: Graph
    inputs: dict
    outputs: dict


def _is_sequence_op(node: Node) -> bool:
    return node.op_type in SEQUENCE_OPS and node.domain in ("", "ai.onnx")


def uses_sequences(graph: Graph) -> bool:
    """Whether any node of `graph` or of its bodies is a sequence or optional op."""
    return any(_is_sequence_op(n) for n in walk(graph))


def check_sequences(graph: Graph, source: str) -> None:
    """Refuse, naming the node, a sequence op at the top level of `graph` or one odtrain cannot expand."""
    for node in graph.nodes:
        if _is_sequence_op(node):
            raise UnsupportedOpError(f"{source}: {node.describe()} works on a sequence outside every Loop and If "
                                     f"body; {WHAT_RUNS}: re-export the model without it")
    for node in walk(graph):
        if _is_sequence_op(node) and node.op_type in REFUSED_OPS:
            raise UnsupportedOpError(f"{source}: {node.describe()} takes a sequence apart, which odtrain does not "
                                     f"run; {WHAT_RUNS}: re-export the model without it")


def tensor_nodes(graph: Graph) -> list[Node]:
    """The nodes of `graph` and of its bodies that are not sequence ops (those that must have rules)."""
    return [n for n in walk(graph) if not _is_sequence_op(n)]


def expand_sequences(graph: Graph, fed: dict, constants: dict, source: str) -> Expanded:
    """`graph` without sequences, at the feeds `fed` (name: array, list of arrays or None) and the values
    bound as constants (`constants`: name: array, the trip counts and conditions among them)."""
    expanded = graph.copy()
    inputs: dict = {}
    values: dict = {}
    names = NameScope(expanded)
    names.taken.update(o for n in walk(graph) for o in n.outputs + [n.name])
    new_inputs = []
    for name in graph.inputs:
        feed = fed.get(name)
        if feed is None and name in fed:
            values[name] = inputs[name] = None
        elif isinstance(feed, (list, tuple)):
            elements = [names.fresh(f"{name}/{k}") for k in range(len(feed))]
            for element, array in zip(elements, feed):
                array = np.asarray(array)
                expanded.value_types[element] = TensorType(array.dtype, tuple(array.shape))
            values[name] = inputs[name] = elements
            new_inputs.extend(elements)
        else:
            new_inputs.append(name)
    expanded.inputs = new_inputs
    known = {k: np.asarray(v) for k, v in constants.items()}
    known.update({k: np.asarray(v) for k, v in expanded.initializers.items() if k not in graph.inputs})
    scope = _Scope(names, expanded.initializers, values, known, source)
    expanded.nodes = scope.run(expanded.nodes)
    outputs: dict = {}
    new_outputs = []
    for name in graph.outputs:
        if name not in values:
            new_outputs.append(name)
            continue
        value = values[name]
        if isinstance(value, str):  # an optional tensor holding a value
            value = [value]
        outputs[name] = None if value is None else [scope.identity(e, f"{name}/{k}") for k, e in enumerate(value)]
        new_outputs.extend(outputs[name] or [])
    expanded.nodes += scope.emitted_tail
    expanded.outputs = new_outputs
    return Expanded(expanded, inputs, outputs)


class _Scope:
    """Expands the nodes of one scope in order. `values` maps a sequence value to its list of element
    names, an optional to its value's name (or list) or None; `known` maps a value to its constant."""

    def __init__(self, names: NameScope, initializers: dict, values: dict, known: dict, source: str):
        self.names, self.initializers, self.values, self.known, self.source = names, initializers, values, known, source
        self.emitted_tail: list[Node] = []

    def constant(self, hint: str, value) -> str:
        name = self.names.fresh(hint)
        self.initializers[name] = self.known[name] = np.asarray(value)
        return name

    def identity(self, source: str, hint: str) -> str:
        name = self.names.fresh(hint)
        self.emitted_tail.append(Node("Identity", [source], [name], {}, self.names.fresh(f"{hint}/identity")))
        return name

    def run(self, nodes: list[Node]) -> list[Node]:
        out: list[Node] = []
        for node in nodes:
            if _is_sequence_op(node):
                self._sequence_op(node, out)
            elif is_control_flow(node) and self._holds_sequences(node):
                self._control_flow(node, out)
            elif any(i in self.values for i in node.inputs):
                if node.op_type != "Identity":
                    raise UnsupportedOpError(f"{self.source}: {node.describe()} reads a sequence or optional value "
                                             f"'{next(i for i in node.inputs if i in self.values)}'; {WHAT_RUNS}")
                self.values[node.outputs[0]] = self.values[node.inputs[0]]
            else:
                self._fold(node)
                out.append(node)
        return out

    def _fold(self, node: Node) -> None:
        """Record the constants a condition is computed from (Constant, Identity, Not of constants)."""
        from .ops.tensor import constant_value

        if node.op_type == "Constant" and node.outputs and not subgraphs(node):
            try:
                self.known[node.outputs[0]] = np.asarray(constant_value(node))
            except Exception:  # a Constant the rules cannot read: not a condition to fold
                pass
        elif node.op_type in ("Identity", "Not") and node.inputs and node.inputs[0] in self.known:
            value = self.known[node.inputs[0]]
            self.known[node.outputs[0]] = np.logical_not(value) if node.op_type == "Not" else value

    def _holds_sequences(self, node: Node) -> bool:
        return any(i in self.values for i in node.inputs) or any(_is_sequence_op(n) for b in subgraphs(node)
                                                                  for n in walk(b))

    def _position(self, node: Node, index: int, length: int, default: int) -> int:
        if len(node.inputs) <= index or not node.inputs[index]:
            return default
        value = self.known.get(node.inputs[index])
        if value is None:
            raise UnsupportedOpError(f"{self.source}: {node.describe()}: its position '{node.inputs[index]}' is "
                                     "computed from the data; odtrain needs it known when shapes bind")
        position = int(np.asarray(value).reshape(-1)[0])
        return position + length if position < 0 else position

    def _sequence(self, node: Node, name: str) -> list:
        value = self.values.get(name)
        if not isinstance(value, list):
            raise UnsupportedOpError(f"{self.source}: {node.describe()}: '{name}' is not a sequence known when "
                                     f"shapes bind; {WHAT_RUNS}")
        return value

    def _sequence_op(self, node: Node, out: list) -> None:
        kind, result = node.op_type, node.outputs[0]
        if kind == "SequenceEmpty":
            self.values[result] = []
        elif kind == "SequenceConstruct":
            self.values[result] = list(node.inputs)
        elif kind == "SequenceInsert":
            elements = list(self._sequence(node, node.inputs[0]))
            elements.insert(self._position(node, 2, len(elements), len(elements)), node.inputs[1])
            self.values[result] = elements
        elif kind == "SequenceAt":
            elements = self._sequence(node, node.inputs[0])
            out.append(Node("Identity", [elements[self._position(node, 1, len(elements), 0)]], [result], {}, node.name))
        elif kind == "SequenceLength":
            self.initializers[result] = self.known[result] = np.array(len(self._sequence(node, node.inputs[0])),
                                                                      np.int64)
        elif kind == "Optional":
            self.values[result] = self.values.get(node.inputs[0], node.inputs[0]) if node.inputs and node.inputs[0] \
                else None
        elif kind == "OptionalHasElement":
            present = bool(node.inputs and node.inputs[0]) and self.values.get(node.inputs[0], node.inputs[0]) is not None
            self.initializers[result] = self.known[result] = np.array(present)
        elif kind == "OptionalGetElement":
            value = self.values.get(node.inputs[0], node.inputs[0])
            if value is None:
                raise UnsupportedOpError(f"{self.source}: {node.describe()} reads an optional that holds no value")
            if isinstance(value, list):
                self.values[result] = value
            else:
                out.append(Node("Identity", [value], [result], {}, node.name))
        else:
            raise UnsupportedOpError(f"{self.source}: {node.describe()} takes a sequence apart; {WHAT_RUNS}")

    def _control_flow(self, node: Node, out: list) -> None:
        if node.op_type == "If":
            condition = self.known.get(node.inputs[0])
            if condition is None:
                raise UnsupportedOpError(f"{self.source}: {node.describe()} gives or reads a sequence, and its "
                                         f"condition '{node.inputs[0]}' is computed from the data; odtrain needs it "
                                         "known when shapes bind to know the sequence's elements")
            taken = node.attrs["then_branch" if bool(np.asarray(condition).reshape(-1)[0]) else "else_branch"]
            self._inline(node, taken, {}, node.outputs, out)
        elif node.op_type == "Loop" and any(i in self.values for i in node.inputs):
            self._unroll(node, out)
        elif any(i in self.values for i in node.inputs):
            raise UnsupportedOpError(f"{self.source}: {node.describe()} carries a sequence; {WHAT_RUNS}")
        else:  # sequences built and used inside the bodies only
            out.append(map_bodies(node, lambda body: self._body(node, body)))

    def _body(self, node: Node, body: Graph) -> Graph:
        changed = body.copy()
        inner = _Scope(self.names, changed.initializers, dict(self.values), dict(self.known), self.source)
        changed.nodes = inner.run(changed.nodes)
        leaking = [o for o in changed.outputs if o in inner.values]
        if leaking:
            raise UnsupportedOpError(f"{self.source}: {node.describe()}: its body gives the sequence '{leaking[0]}' "
                                     f"each iteration; {WHAT_RUNS}, a Loop's with a trip count known when shapes bind")
        changed.nodes += inner.emitted_tail
        return changed

    def _inline(self, node: Node, body: Graph, bound: dict, results: list, out: list) -> list:
        """Expand `body`'s nodes into this scope, its inputs bound as `bound` says (body name: outer name),
        its values renamed apart; its outputs become `results` (a name, '' to keep the renamed value).
        Returns the names the body's outputs have in this scope."""
        renamed = dict(bound)
        defined = set(body.initializers) | {o for n in body.nodes for o in n.outputs if o}
        for name in defined - set(bound):
            renamed[name] = self.names.fresh(f"{node.name}/{name}")
        for name, value in body.initializers.items():
            self.initializers[renamed[name]] = self.known[renamed[name]] = np.asarray(value)
        nodes = []
        for n in body.nodes:
            if subgraphs(n):
                n = Node(n.op_type, list(n.inputs), list(n.outputs),
                         {k: rename_free(v, renamed) if isinstance(v, Graph) else v for k, v in n.attrs.items()},
                         n.name, n.domain, n.scope)
            nodes.append(Node(n.op_type, [renamed.get(i, i) for i in n.inputs], [renamed.get(o, o) for o in n.outputs],
                              dict(n.attrs), self.names.fresh(f"{node.name}/{n.name or n.op_type}"), n.domain, n.scope))
        out.extend(self.run(nodes))
        inner_outputs = [renamed.get(o, o) for o in body.outputs]
        for inner, result in zip(inner_outputs, results):
            if not result:
                continue
            if not self._pass_on(node, inner, result, out) and inner in self.known:
                self.known[result] = self.known[inner]
        return inner_outputs

    def _pass_on(self, node: Node, value: str, result: str, out: list) -> bool:
        """`result` names `value`: the same sequence (True), or an Identity of the tensor appended to `out`."""
        if value in self.values:
            self.values[result] = self.values[value]
            return True
        out.append(Node("Identity", [value], [result], {}, self.names.fresh(f"{node.name}/{result}")))
        return False

    def _unroll(self, node: Node, out: list) -> None:
        body = node.attrs["body"]
        count = onnx_input_count(node)
        carried = count - 2
        trip = self.known.get(node.inputs[0]) if node.inputs[0] else None
        going = True if not node.inputs[1] else self.known.get(node.inputs[1])
        if (node.inputs[0] and trip is None) or going is None or (trip is None and not node.inputs[1]):
            raise UnsupportedOpError(f"{self.source}: {node.describe()} carries a sequence, and its trip count or "
                                     "condition is computed from the data; odtrain unrolls such a loop, so both must be "
                                     "known when shapes bind (constants or model inputs)")
        limit = int(np.asarray(trip).reshape(-1)[0]) if trip is not None else None
        state = list(node.inputs[2:count])
        scans: list[list[str]] = [[] for _ in body.outputs[1 + carried:]]
        condition_name = node.inputs[1] or self.constant(f"{node.name}/condition", True)
        t = 0
        while bool(np.asarray(going).reshape(-1)[0]) and (limit is None or t < limit):
            bound = {body.inputs[0]: self.constant(f"{node.name}/iteration{t}", np.array(t, np.int64)),
                     body.inputs[1]: condition_name}
            bound.update(zip(body.inputs[2:], state))
            results = self._inline(node, body, bound, [""] * len(body.outputs), out)
            condition_name, state = results[0], results[1:1 + carried]
            for k, name in enumerate(results[1 + carried:]):
                scans[k].append(name)
            if node.inputs[1]:  # without a condition input the body's condition is ignored (ONNX's for loop)
                going = self.known.get(condition_name)
                if going is None:
                    raise UnsupportedOpError(f"{self.source}: {node.describe()} carries a sequence, and its body's "
                                             "condition depends on the data; odtrain unrolls such a loop, so the "
                                             "condition must be known when shapes bind")
            t += 1
            if t > 100_000:
                raise UnsupportedOpError(f"{self.source}: {node.describe()} carries a sequence and its condition stays "
                                         "true past 100000 iterations; give it a trip count")
        for result, value in zip(node.outputs[:carried], state):
            if result:
                self._pass_on(node, value, result, out)
        for result, rows in zip(node.outputs[carried:], scans):
            if not result:
                continue
            if not rows:
                raise UnsupportedOpError(f"{self.source}: {node.describe()} carries a sequence and runs no iteration, "
                                         "so its scan output has no rows to give its type")
            axis = self.constant(f"{node.name}/axis", np.array([0], np.int64))
            lifted = [self.names.fresh(f"{result}/{k}") for k in range(len(rows))]
            out.extend(Node("Unsqueeze", [row, axis], [name], {}, self.names.fresh(f"{node.name}/unsqueeze"))
                       for row, name in zip(rows, lifted))
            out.append(Node("Concat", lifted, [result], {"axis": 0}, self.names.fresh(f"{node.name}/concat")))
