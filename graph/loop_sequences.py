"""A Loop that appends to a sequence, rewritten as a Loop with a scan output.

The TorchScript exporter writes a scripted `ys.append(y)` inside `for t in range(T)`, and the
`torch.stack(ys, a)` after it, as sequence ops around a Loop:

    s0 = SequenceEmpty()                      outside
    Loop(T, cond, ..., s0, ...) body:         s_out = SequenceInsert(s_in, y)   (appended at the end)
    stacked = ConcatFromSequence(s_T, axis=a, new_axis=1)

odtrain trains no sequence values (graph/sequences.py expands them only when an inference plan binds, by
unrolling the Loop); a Loop's scan output is that same stack along axis 0, and it trains. So where all of
this holds, the carried sequence leaves the Loop, `y` becomes a scan output (after the existing
ones), and the ConcatFromSequence becomes a Transpose that moves the stacked axis to `a` (nothing when
`a` is 0):
- the SequenceEmpty feeds only this Loop, as a carried value;
- in the body, the carried sequence is read only by one SequenceInsert without a position, whose output
  is the carried value's output and is read by nothing else;
- outside, the Loop's final sequence is read only by one ConcatFromSequence with new_axis=1, and is
  not a graph output.
Anything else is left as it is, for graph/sequences.py to expand or refuse by name. The rank the
Transpose needs comes from binding the graph up to the Loop at example sizes (a symbolic axis as 2).

`split_sequences_as_slices` does the same for the dynamo exporter's `torch.chunk`/`split` without its
optimizer (`optimize=False`, a GRU cell's gates): `SplitToSequence(x, split, axis)` read only by
`SequenceAt(seq, k)` at constant non-negative positions k becomes one `Slice` per position (the k-th
chunk's start and end along `axis`; a `Gather` where no split is given and keepdims=0), in every body.
"""
from __future__ import annotations

import numpy as np

from .control_flow import map_bodies, onnx_input_count, with_captures
from .errors import ModelError
from .ir import Graph, NameScope, Node, TensorType


def appended_sequences_as_scan_outputs(graph: Graph) -> Graph:
    """`graph` with each Loop that appends to a sequence stacked after it rewritten as above (a copy when
    anything changed)."""
    if not any(n.op_type == "SequenceEmpty" for n in graph.nodes):
        return graph
    changed = graph.copy()
    names = NameScope(changed)
    while any(_rewrite_one(changed, n, names) for n in changed.nodes if n.op_type == "Loop"):
        pass  # one sequence at a time: each rewrite replaces the Loop node
    return changed


def _rewrite_one(graph: Graph, loop: Node, names: NameScope) -> bool:
    """Rewrites the first appended sequence of `loop` found (True), or changes nothing (False)."""
    count = onnx_input_count(loop)
    body = loop.attrs.get("body")
    if not isinstance(body, Graph) or len(body.inputs) != count or len(body.outputs) < count - 1 or \
            len(loop.outputs) < count - 2:
        return False  # a malformed Loop: its own rule names what is wrong
    consumers, producers = graph.consumers(), graph.producers()
    body_consumers = body.consumers()
    for k in range(count - 2):
        initial, inner, final = loop.inputs[2 + k], body.inputs[2 + k], loop.outputs[k]
        empty = producers.get(initial)
        if empty is None or empty.op_type != "SequenceEmpty" or len(consumers.get(initial, [])) != 1:
            continue
        readers = body_consumers.get(inner, [])
        if len(readers) != 1 or readers[0].op_type != "SequenceInsert" or len(readers[0].inputs) != 2 or \
                readers[0].inputs[0] != inner:
            continue
        insert = readers[0]
        if body.outputs[1 + k] != insert.outputs[0] or body_consumers.get(insert.outputs[0]) or \
                body.outputs.count(insert.outputs[0]) != 1:
            continue
        concat = consumers.get(final, [])
        if len(concat) != 1 or concat[0].op_type != "ConcatFromSequence" or \
                int(concat[0].attrs.get("new_axis", 0)) != 1 or final in graph.outputs:
            continue
        _replace(graph, loop, k, insert, empty, concat[0], names)
        return True
    return False


def _replace(graph: Graph, loop: Node, k: int, insert: Node, empty: Node, concat: Node, names: NameScope) -> None:
    """Carried value k of `loop` (an appended sequence) becomes its last scan output, stacked by `concat`."""
    count = onnx_input_count(loop)
    original = loop.attrs["body"]
    body = original.copy()
    position = next(i for i, n in enumerate(original.nodes) if n is insert)
    body.nodes = body.nodes[:position] + body.nodes[position + 1:]
    body.inputs = body.inputs[:2 + k] + body.inputs[3 + k:]
    body.outputs = body.outputs[:1 + k] + body.outputs[2 + k:] + [insert.inputs[1]]
    stacked = names.fresh(f"{loop.name}/stacked")
    outputs = loop.outputs[:k] + loop.outputs[k + 1:] + [stacked]
    attrs = {**loop.attrs, "body": body}
    rewritten = with_captures(Node(loop.op_type, loop.inputs[:2 + k] + loop.inputs[3 + k:count], outputs, attrs,
                                   loop.name, loop.domain, loop.scope))
    axis = int(concat.attrs.get("axis", 0))
    nodes = []
    for node in graph.nodes:
        if node is empty:
            continue
        if node is loop:
            nodes.append(rewritten)
        elif node is concat:
            nodes.append(_moved_axis(graph, stacked, concat, axis, nodes + [rewritten]))
        else:
            nodes.append(node)
    graph.nodes = nodes
    graph.value_types.pop(loop.outputs[k], None)


def _moved_axis(graph: Graph, stacked: str, concat: Node, axis: int, before: list[Node]) -> Node:
    """The node giving `concat`'s output from the stack along axis 0: an Identity, or a Transpose that moves
    axis 0 to `axis` (ConcatFromSequence's axis counts in the output, so -1 is the last axis)."""
    if axis == 0:
        return Node("Identity", [stacked], list(concat.outputs), {}, concat.name, concat.domain, concat.scope)
    rank = _rank(graph, stacked, before)
    if rank is None:
        raise ModelError(f"{concat.describe()}: stacks a Loop's appended values along axis {axis}, but their rank "
                         "is unknown when the model is read; export the model with inputs of known rank")
    axis = axis + rank if axis < 0 else axis
    perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank))
    dtype = graph.value_types[concat.outputs[0]].dtype if concat.outputs[0] in graph.value_types else np.float32
    for name, axes in ((stacked, range(rank)), (concat.outputs[0], perm)):  # gradients need the ranks
        if name not in graph.value_types or graph.value_types[name].shape is None:  # a declared shape stays
            graph.value_types[name] = TensorType(np.dtype(dtype), tuple(f"{stacked}_axis{a}" for a in axes))
    return Node("Transpose", [stacked], list(concat.outputs), {"perm": perm}, concat.name, concat.domain,
                concat.scope)


def _rank(graph: Graph, stacked: str, nodes: list[Node]) -> int | None:
    """The rank of `stacked`, from binding the nodes that compute it at example sizes (symbolic axes as 2)."""
    from .schedule import bind_types

    probe = graph.copy()
    probe.nodes = nodes
    probe = probe.prune([stacked])
    known = {}
    for name in probe.inputs:
        t = graph.value_types.get(name)
        if t is None or t.shape is None:
            return None
        known[name] = TensorType(t.dtype, tuple(d if isinstance(d, int) else 2 for d in t.shape))
    constants = {k: np.asarray(v) for k, v in probe.initializers.items() if k not in probe.inputs}
    try:
        types, _ = bind_types(probe, known, constants)
    except Exception:  # an op the example sizes do not suit: the rank stays unknown
        return None
    return len(types[stacked].shape)


def split_sequences_as_slices(graph: Graph, outer: dict | None = None) -> Graph:
    """`graph` with each SplitToSequence read only by SequenceAt at constant positions replaced by tensor ops
    (see the module's docstring), in its bodies too (a copy when anything changed). `outer`: the constants of
    the enclosing scopes, by name (a body reads its split sizes from outside too)."""
    from .control_flow import walk

    if not any(n.op_type == "SplitToSequence" for n in walk(graph)):
        return graph
    changed = graph.copy()
    known = _constants(changed, outer or {})
    changed.nodes = [map_bodies(n, lambda body: split_sequences_as_slices(body, known)) for n in changed.nodes]
    names = NameScope(changed)
    consumers = changed.consumers()
    for split in [n for n in changed.nodes if n.op_type == "SplitToSequence" and n.inputs and n.outputs]:
        readers = consumers.get(split.outputs[0], [])
        positions = [known.get(r.inputs[1]) if r.op_type == "SequenceAt" and len(r.inputs) == 2 else None
                     for r in readers]
        sizes = known.get(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] else None
        if not readers or split.outputs[0] in changed.outputs or any(
                p is None or p.size != 1 or int(p.reshape(-1)[0]) < 0 for p in positions) or \
                (len(split.inputs) > 1 and split.inputs[1] and sizes is None):
            continue
        replaced = {id(r): _chunk(changed, split, sizes, int(p.reshape(-1)[0]), r, names)
                    for r, p in zip(readers, positions)}
        changed.nodes = [replaced.get(id(n), n) for n in changed.nodes if n is not split]
    return changed


def _constants(graph: Graph, outer: dict) -> dict:
    """The integer values known before running that `graph` reads: `outer`'s, its initializers, its Constant
    nodes' (split sizes and positions are int64)."""
    from .ops.tensor import constant_value

    known = dict(outer)
    known.update((k, np.asarray(v)) for k, v in graph.initializers.items() if np.asarray(v).dtype.kind in "iu")
    for node in graph.nodes:
        if node.op_type == "Constant" and node.outputs:
            try:
                value = np.asarray(constant_value(node))
            except Exception:  # a Constant the rules cannot read: not a position we use
                continue
            if value.dtype.kind in "iu":
                known[node.outputs[0]] = value
    for name in graph.inputs:  # a body's own input hides an outer value of its name
        known.pop(name, None)
    return known


def _chunk(graph: Graph, split: Node, sizes, k: int, reader: Node, names: NameScope) -> Node:
    """The node giving `reader`'s output, chunk k of `split`'s input: a Slice along the split's axis (ends past
    the axis clamp, as the last chunk of an uneven split ends), or a Gather of row k when the chunks are single
    rows without their axis (no split given, keepdims=0)."""
    axis = int(split.attrs.get("axis", 0))
    if sizes is None:
        if int(split.attrs.get("keepdims", 1)) == 0:
            index = names.fresh(f"{reader.name}/index")
            graph.initializers[index] = np.array(k, np.int64)
            return Node("Gather", [split.inputs[0], index], list(reader.outputs), {"axis": axis}, reader.name,
                        reader.domain, reader.scope)
        sizes = np.array(1, np.int64)
    sizes = sizes.reshape(-1).astype(np.int64)
    start = int(sizes[0]) * k if sizes.size == 1 else int(np.sum(sizes[:k]))
    end = start + int(sizes[0] if sizes.size == 1 else sizes[k])
    inputs = [split.inputs[0]]
    for hint, value in (("starts", start), ("ends", end), ("axes", axis)):
        inputs.append(names.fresh(f"{reader.name}/{hint}"))
        graph.initializers[inputs[-1]] = np.array([value], np.int64)
    return Node("Slice", inputs, list(reader.outputs), {}, reader.name, reader.domain, reader.scope)
