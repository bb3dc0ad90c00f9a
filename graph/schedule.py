"""Binding shapes and choosing the execution order.

Steps:
- `bind_types`: walk the nodes in order and apply each op's type rule to
  concrete input types, giving every value a static type. Rules may fold
  their outputs to constants (Shape, Constant); values computed only from
  constants are then known before the first step.
- `execution_order`: the nodes still to run per step (not folded, and
  leading to a wanted output), in the graph's topological order.
- `split_forward_backward`: the nodes of a training order that depend on the
  loss gradient seed (the backward pass); the others are the forward pass.
- `memory_aware_order`: a topological reordering that keeps fewer bytes alive.
- `with_updates`: fused optimizer updates, each placed right after the last
  node that reads its parameter or produces its gradient.
- `defer_constant_work`: nodes that compute only from values held outside
  the arena (parameters, constants), such as the DequantizeLinear of an
  int8 weight, move to just before their first reader, so that their
  outputs live for a step instead of from the start.

Names the order is made of: a node recomputed in the backward pass (and each
of its outputs) is named `<original>::recomputed`.

`configuring_inputs` names the graph inputs whose values shape the plan
(axes, pads, target shapes, sizes, k fed by the caller): a runtime binds
their fed values as constants, one plan per distinct value.
"""
from __future__ import annotations

import numpy as np

from .errors import MemoryBudgetError, ModelError
from .ir import ODTRAIN_DOMAIN, Graph, Node, TensorType
from .onnx_wire import is_storage_dtype
from .ops import lookup
from .ops.dequantized import STORED_WEIGHT_READERS
from .ops.tensor import STORAGE_OPS
from .ops.training import APPLY_UPDATE

RECOMPUTE_SUFFIX = "::recomputed"


def bind_types(graph: Graph, known: dict[str, TensorType], constants: dict[str, np.ndarray]):
    """Static types for every value, and the values folded to constants.

    `known` gives the types of the feeds and of externally held tensors
    (parameters); `constants` the values known before running (initializers).
    Returns (types, folded) where `folded` maps names to constant values.
    """
    types = dict(known)
    folded = dict(constants)
    for name, value in constants.items():
        types.setdefault(name, TensorType(value.dtype, tuple(value.shape)))
    for node in graph.nodes:
        opdef = lookup(node)
        in_types, in_consts = [], []
        for name in node.inputs:
            if not name:
                in_types.append(None)
                in_consts.append(None)
                continue
            if name not in types:
                raise ModelError(f"{node.describe()}: input '{name}' is neither fed, an initializer, nor produced earlier")
            in_types.append(types[name])
            in_consts.append(folded.get(name))
        try:
            result = opdef.infer(node, in_types, in_consts)
        except ModelError:
            raise
        except MemoryError as error:  # folding to a constant: numpy's error names the size
            raise MemoryBudgetError(f"{node.describe()}: its output, computed once as a constant from constant "
                                    f"inputs {[str(t) for t in in_types]}, cannot be allocated ({error}); use "
                                    "smaller shapes") from None
        except Exception as error:
            raise ModelError(f"{node.describe()}: cannot compute its output types from inputs "
                             f"{[str(t) for t in in_types]}: {error}") from None
        out_types, out_values = result if isinstance(result, tuple) else (result, None)
        if out_values is None:  # a node that runs a kernel
            _refuse_storage_types(node, in_types)
        for i, name in enumerate(node.outputs):
            if not name:
                continue
            t = out_types[i]
            if t.shape is None or not t.is_static:
                raise ModelError(f"{node.describe()}: output '{name}' has no static shape after binding inputs ({t})")
            types[name] = t
            if out_values is not None:
                folded[name] = np.asarray(out_values[i], order="C")  # keeps 0-d values 0-d
    return types, folded


def _refuse_storage_types(node: Node, in_types) -> None:
    """Only STORAGE_OPS run on the element types numpy lacks (bfloat16, float8...) and on float16, which Numba
    has no arithmetic for: other kernels cannot read them (a node folded to a constant runs none)."""
    if node.op_type in STORAGE_OPS and node.domain in ("", "ai.onnx") or node.key in STORED_WEIGHT_READERS:
        return
    stored = next((t for t in in_types if t is not None and (is_storage_dtype(t.dtype) or t.dtype == np.float16)),
                  None)
    if stored is not None:
        raise ModelError(f"{node.describe()}: an input is {stored}; odtrain computes on float32, float64, "
                         "integer and bool tensors and converts other element types only in Cast: cast it to "
                         "float first")


def configuring_inputs(graph: Graph) -> list[str]:
    """The graph inputs that an op reads at one of its constant inputs (`OpDef.constant_inputs`),
    directly or through the ops computing that input (not through inputs read for their shape
    only, such as Shape's), in the order of `graph.inputs`."""
    producers = graph.producers()
    fed = set(graph.inputs) - set(graph.initializers)
    pending = [name for node in graph.nodes for k, name in enumerate(node.inputs)
               if name and k in lookup(node).constant_inputs]
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        producer = producers.get(name)
        if producer is not None:
            shape_only = lookup(producer).shape_only
            pending.extend(i for k, i in enumerate(producer.inputs) if i and k not in shape_only)
    return [name for name in graph.inputs if name in fed and name in seen]


def execution_order(graph: Graph, folded: dict[str, np.ndarray], wanted: list[str]) -> list[Node]:
    """The nodes to run each step: those not folded that lead to a wanted output."""
    needed = set(wanted)
    order: list[Node] = []
    for node in reversed(graph.nodes):
        outputs = [o for o in node.outputs if o]
        if all(o in folded for o in outputs) or not any(o in needed for o in outputs):
            continue
        order.append(node)
        shape_only = lookup(node).shape_only
        needed.update(i for k, i in enumerate(node.inputs) if i and k not in shape_only)
    order.reverse()
    return order


def defer_constant_work(order: list[Node], held: set[str]) -> list[Node]:
    """`order` with each node whose inputs are all in `held` (values outside the arena) or made by such
    nodes placed just before the first node that reads its outputs; other nodes keep their order.
    Their inputs live outside the arena, so no arena value lives longer for it."""
    derived = set(held)
    movable: set[int] = set()
    for node in order:
        if node.inputs and all(not i or i in derived for i in node.inputs):
            movable.add(id(node))
            derived.update(o for o in node.outputs if o)
    producer = {o: node for node in order if id(node) in movable for o in node.outputs if o}
    result: list[Node] = []
    placed: set[int] = set()

    def place(node: Node) -> None:
        for name in node.inputs:
            before = producer.get(name)
            if before is not None and id(before) not in placed:
                place(before)
        placed.add(id(node))
        result.append(node)

    for node in order:
        if id(node) not in movable:
            place(node)
    for node in order:  # read by no other node (a graph output of constants only): at the end
        if id(node) not in placed:
            place(node)
    return result


def memory_aware_order(order: list[Node], nbytes: dict[str, int], keep: set[str],
                       first: Node | None = None) -> list[Node]:
    """A topological reordering that greedily keeps fewer bytes alive.

    At each step, among the nodes whose inputs are ready, run the one that frees the most
    bytes net of what it allocates (a value is freed when its last reader runs); ties keep the
    original order. `nbytes` gives the size of every value held in the arena (others count 0);
    values in `keep` (graph outputs) are never freed. `first`, when given, runs before every
    node that does not lead to it (the loss before the backward pass). O(n²) in the nodes.
    """
    producers = {o: index for index, node in enumerate(order) for o in node.outputs if o}
    readers: dict[str, set[int]] = {}
    for index, node in enumerate(order):
        for name in set(node.inputs):
            if name in producers:
                readers.setdefault(name, set()).add(index)
    waiting = [len({producers[i] for i in set(node.inputs) if i in producers}) for node in order]
    dependents: dict[int, list[int]] = {}
    for index, node in enumerate(order):
        for producer in {producers[i] for i in set(node.inputs) if i in producers}:
            dependents.setdefault(producer, []).append(index)
    if first is not None:
        barrier = next(i for i, node in enumerate(order) if node is first)
        ancestors, stack = {barrier}, [barrier]
        while stack:
            for name in set(order[stack.pop()].inputs):
                if name in producers and producers[name] not in ancestors:
                    ancestors.add(producers[name])
                    stack.append(producers[name])
        for index in range(len(order)):
            if index not in ancestors:
                waiting[index] += 1
                dependents.setdefault(barrier, []).append(index)
    ready = [index for index, count in enumerate(waiting) if count == 0]
    remaining_readers = {name: set(indices) for name, indices in readers.items()}
    result: list[Node] = []
    while ready:
        def gain(index: int) -> int:
            node = order[index]
            allocated = sum(nbytes.get(o, 0) for o in node.outputs if o)
            freed = sum(nbytes.get(i, 0) for i in set(node.inputs)
                        if i in remaining_readers and i not in keep and remaining_readers[i] == {index})
            return freed - allocated

        chosen = max(ready, key=lambda index: (gain(index), -index))
        ready.remove(chosen)
        result.append(order[chosen])
        for name in set(order[chosen].inputs):
            if name in remaining_readers:
                remaining_readers[name].discard(chosen)
        for dependent in dependents.get(chosen, []):
            waiting[dependent] -= 1
            if waiting[dependent] == 0:
                ready.append(dependent)
    return result


def split_forward_backward(order: list[Node], seed: str) -> tuple[list[Node], set[int]]:
    """The ids of backward nodes: those that depend on the loss gradient seed."""
    reached = {seed}
    backward: set[int] = set()
    for node in order:
        if any(i in reached for i in node.inputs if i):
            backward.add(id(node))
            reached.update(o for o in node.outputs if o)
    return order, backward


def with_updates(order: list[Node], updates: dict[str, str]) -> list[Node]:
    """The order with an ApplyUpdate(gradient, parameter) node for each entry of `updates`
    (gradient output -> parameter), right after the last node that reads the parameter or
    produces the gradient: the update follows every read of the parameter."""
    order = list(order)
    positions = []
    for grad_name, param in updates.items():
        last = max(index for index, node in enumerate(order) if grad_name in node.outputs or param in node.inputs)
        positions.append((last, Node(APPLY_UPDATE, [grad_name, param], [], {}, f"{param}::update", ODTRAIN_DOMAIN)))
    for last, node in sorted(positions, key=lambda item: -item[0]):
        order.insert(last + 1, node)
    return order
