"""An element-wise loop body as one nest of loops: the text odtrain/loop_compiler.py compiles in place
of the body's kernel calls.

A Mamba step is a dozen element-wise ops over [d_model, d_state] and one sum: run as kernels, each
op is a pass over memory through a strided broadcasting kernel. Fused, one pass computes every value
of a point of the iteration space in registers and writes only what leaves the body:

    y[:] = 0
    for i0 in range(256):
        for i1 in range(16):
            v0 = dt[i0] * A[i0, i1]             # inputs read where they broadcast (index 0 on a 1-axis)
            v1 = exp(v0)                        # fast_exp in float32: the inner loop vectorises
            ...
            h_out[i0, i1] = v5                  # a body output
            terms[i0, i1] = v6                  # what a sum adds up
    for i1 in range(16):                        # ReduceSum over axis 1, in a nest of its own: the
        for i0 in range(256):                   # summed axes outside, each sum in index order
            y[i0] += terms[i0, i1]

A body fuses when every node it runs is element-wise (a float row of kernels/scalar_expressions.py, the table
the per-op kernels read: the same scalar expression, the same bits) on one float type, a view of an array
(Unsqueeze, Reshape...) or of a value keeping its shape, a Gather of one row of an array (a Loop's x[i]), a
ReduceGrad of an array (its broadcast: read where it broadcasts), a ReduceSum or SumToShape of a value over the
whole iteration space; values of sums (views, element-wise ops over them and arrays) are known after the nest
and computed there, each over its own shape, and no value of the nest reads them. A Scan's reverse body (the
forward recomputed, then its gradient) is such a body. The iteration space is the broadcast of the nest's values'
shapes. Anything else returns None, and the body keeps its kernel calls. Sums add in index order where the
ReduceSum and SumToShape kernels reassociate: within float32 rounding of the calls, not the same bits.
"""
from __future__ import annotations

import numpy as np

from .graph.ir import ODTRAIN_DOMAIN
from .graph.ops import is_view, lookup


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    rank = max(len(a), len(b))
    a, b = (1,) * (rank - len(a)) + tuple(a), (1,) * (rank - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out)


def fused_body(step, source, outputs: list[str]) -> list[str] | None:
    """The lines of one iteration of `step` (an ExecutableStep of a body) as a loop nest, its arrays
    registered with `source` (loop_compiler's parameters), or None when the body does not fuse.
    `outputs` are the body's outputs: each element-wise one is written to its slot."""
    nest = _Nest(step)
    for node in step.order:
        if not nest.take(node):
            return None
    if not nest.computed or nest.dtype is None:
        return None
    return nest.lines(source, outputs)


class _Nest:
    """A body's nodes as the statements of one loop nest: `take` walks them in order (False: the body does not
    fuse), `lines` writes the nest."""

    def __init__(self, step):
        self.table = step.expressions  # the kernels' table of scalar expressions (kernels/scalar_expressions.py)
        self.types, self.storage, self.folded = step.types, step.storage, step.step_plan.folded
        self.virtual: dict[str, str] = {}  # value -> the local holding it at the current point
        # ("value", name, row, inputs) | ("sum", name, input, axes, dropped axes) | ("after", name, row, inputs)
        self.computed: list[tuple] = []
        self.space: tuple = ()
        self.dtype = None
        self.reduced: dict[str, str] = {}  # a value known after the nest -> the value whose buffer holds it
        self.gathered: dict[str, tuple] = {}  # a row of an array picked by a one-element index: (array, index)
        self.spread: dict[str, np.ndarray] = {}  # a ReduceGrad's output -> its input viewed with the summed axes kept

    def take(self, node) -> bool:
        row = self.table.row_of(node.op_type, node.attrs)
        kind = node.op_type
        if node.domain not in ("", "ai.onnx") and not (node.domain == ODTRAIN_DOMAIN and (
                row is not None or kind in ("ReduceGrad", "SumToShape"))):
            return False
        types, storage = self.types, self.storage
        inputs = [i for i in node.inputs if i]
        view = is_view(lookup(node), [types.get(i) for i in node.inputs], [types[o] for o in node.outputs if o])
        if any(i in self.reduced for i in node.inputs):  # known after the nest: a view of it, or a value after it
            if view and inputs[0] in self.reduced:
                self.reduced[node.outputs[0]] = self.reduced[inputs[0]]
                return True
            if view or row is None or not self.table.ROWS[row].fusable or \
                    any(i in self.virtual or i in self.gathered or i in self.spread for i in inputs):
                return False
            return self._element_wise(node, row, inputs, after=True)
        if view:
            return self._view(node, kind, inputs)
        if row is not None and self.table.ROWS[row].fusable:
            return self._element_wise(node, row, inputs)
        if kind == "ReduceGrad":
            return self._spread(node, inputs)
        if kind == "SumToShape" and len(inputs) == 2 and inputs[0] in self.virtual:
            shape, out = tuple(types[inputs[0]].shape), tuple(types[node.outputs[0]].shape)
            lead = len(shape) - len(out)
            if lead < 0:
                return False
            axes = list(range(lead)) + [lead + k for k, d in enumerate(out) if d == 1 and shape[lead + k] != 1]
            return self._sum(node, inputs[:1], axes, list(range(lead)))
        if kind == "Gather" and int(node.attrs.get("axis", 0)) == 0 and len(inputs) == 2 and \
                not any(i in self.virtual or i in self.gathered for i in inputs) and storage[inputs[1]].size == 1 and \
                storage[inputs[1]].ndim == 0 and storage[inputs[1]].dtype.kind == "i" and storage[inputs[0]].ndim:
            self.gathered[node.outputs[0]] = (storage[inputs[0]], storage[inputs[1]])  # a Loop's x[i]
            return True
        if kind == "ReduceSum" and inputs and inputs[0] in self.virtual:
            axes = node.attrs.get("axes")
            if axes is None and len(inputs) > 1:
                axes = self.folded.get(inputs[1])
                if axes is None:
                    return False
            if axes is None or node.attrs.get("noop_with_empty_axes", 0):
                return False
            axes = [int(a) for a in np.asarray(axes).reshape(-1)]
            return self._sum(node, inputs[:1], axes, None if node.attrs.get("keepdims", 1) else axes)
        return False

    def _spread(self, node, inputs) -> bool:
        """ReduceGrad(dY, X) of a sum (not a mean): dY read at each point with the summed axes at 0."""
        dy, out = inputs[0], node.outputs[0]
        if node.attrs.get("mean", 0) or dy in self.virtual or dy in self.gathered or dy in self.spread:
            return False
        shape = tuple(self.types[out].shape)
        axes = node.attrs.get("axes")
        if not axes:
            if node.attrs.get("noop_with_empty_axes", 0):
                return False
            axes = range(len(shape))
        axes = {int(a) % len(shape) for a in axes} if shape else set()
        kept = tuple(1 if k in axes else d for k, d in enumerate(shape))
        data = self.storage[dy]
        if data.size != int(np.prod(kept, dtype=np.int64)) or not data.flags.c_contiguous or \
                np.dtype(self.types[dy].dtype) != np.dtype(self.types[out].dtype):
            return False
        self.space = _broadcast(self.space, shape)
        if self.space is None:
            return False
        self.spread[out] = data.reshape(kept)
        return True

    def _view(self, node, kind, inputs) -> bool:
        if inputs[0] in self.gathered:  # a view of a picked row: pick the row of the array viewed alike
            data, index = self.gathered[inputs[0]]
            if not data.flags.c_contiguous:
                return False
            shape = (data.shape[0],) + tuple(self.types[node.outputs[0]].shape)
            self.gathered[node.outputs[0]] = (data.reshape(shape), index)
            return True
        if inputs[0] in self.virtual or inputs[0] in self.spread:  # a view keeping the shape: the same value
            if tuple(self.types[node.outputs[0]].shape) != tuple(self.types[inputs[0]].shape):
                return False
            if inputs[0] in self.virtual:
                self.virtual[node.outputs[0]] = self.virtual[inputs[0]]
            else:
                self.spread[node.outputs[0]] = self.spread[inputs[0]]
        return True  # a view of an array: its storage is already the view

    def _element_wise(self, node, row, inputs, after: bool = False) -> bool:
        """A value at each point of the nest, or (`after`) a value of sums, computed after the nest over its
        own shape."""
        if len(inputs) != self.table.ROWS[row].arity:
            return False
        out = node.outputs[0]
        t = self.types[out]
        if self.dtype is None:
            self.dtype = np.dtype(t.dtype)
        dtype = self.dtype
        if np.dtype(t.dtype) != dtype or dtype.kind != "f" or any(np.dtype(self.types[i].dtype) != dtype
                                                                  for i in inputs):
            return False
        if after:
            if any(_broadcast(t.shape, self.types[i].shape) != tuple(t.shape) for i in inputs):
                return False
            self.computed.append(("after", out, row, inputs))
            self.reduced[out] = out
            return True
        for shape in [t.shape] + [self.types[i].shape for i in inputs]:
            self.space = _broadcast(self.space, shape)
            if self.space is None:
                return False
        self.virtual[out] = f"v{len(self.virtual)}"
        self.computed.append(("value", out, row, inputs))
        return True

    def _sum(self, node, inputs, axes: list[int], dropped: list[int] | None) -> bool:
        """A sum over `axes` of a value of the nest, known after it; `dropped`: the summed axes its shape drops
        (None: it keeps them all, as 1)."""
        self.computed.append(("sum", node.outputs[0], inputs[0], axes, dropped))
        self.reduced[node.outputs[0]] = node.outputs[0]
        return True

    def _term(self, name: str, source) -> str | None:
        """How the nest reads `name` at the point (i0, i1, ...): a local, a picked row, or an array indexed
        where it broadcasts."""
        if name in self.virtual:
            return self.virtual[name]
        space = self.space
        if name in self.spread:
            self.reads.append(self.spread[name])
            return term_target(self.spread[name], space, source)
        if name in self.gathered:  # data[row, ...], the row picked once an iteration, before the nest
            data, index = self.gathered[name]
            self.reads.append(data)
            key = (id(index), data.shape[0])
            if key not in self.rows:  # index % rows: a negative index counts from the end, as Gather's
                self.rows[key] = f"row{len(self.rows)}"
                self.before.append(f"{self.rows[key]} = {source.array(index.reshape(1))}[0] % {data.shape[0]}")
            return term_target(data[0], space, source, prefix=self.rows[key], whole=data)
        self.reads.append(self.storage[name])
        return term_target(self.storage[name], space, source)

    def _private(self, name: str) -> np.ndarray:
        # What the nest writes goes to buffers of its own, copied to the slots after it: the planner may have
        # placed a slot written here over an input the nest still reads (a value that dies before it).
        if name not in self.written:
            self.written[name] = np.empty(self.storage[name].shape, self.storage[name].dtype)
        return self.written[name]

    def lines(self, source, outputs: list[str]) -> list[str] | None:
        rank, dtype = len(self.space), self.dtype
        zero = source.array(np.zeros((), dtype)[()])
        self.before, self.rows, self.written, self.sums, self.reads = [], {}, {}, [], []
        source.globals.update(self.table.names())  # what the table's expressions call
        inner, after, late = [], [], []  # late: the arrays read after the nest
        for entry in self.computed:
            if entry[0] == "after":
                nest = self._after(entry, source, late)
                if nest is None:
                    return None
                after.append(nest)
            elif entry[0] == "value":
                _, out, row, inputs = entry
                terms = [self._term(i, source) for i in inputs]
                if any(t is None for t in terms):
                    return None
                # rounded to the body's type as a kernel's store rounds it (an integer constant in a row computes in float64)
                inner.append(f"{self.virtual[out]} = np.{dtype.name}({self.table.scalar_source(row, terms)})")
            elif not self._sum_nest(entry, source, zero, inner):
                return None
        copies = self._outputs(outputs, source, inner, late)
        if copies is None:
            return None
        lines = list(self.before)
        for axis in range(rank):
            lines.append("    " * axis + f"for i{axis} in range({self.space[axis]}):")
        lines += ["    " * rank + line for line in inner]
        for nest in self.sums + after:
            lines += ["    " * depth + line for depth, line in enumerate(nest)]
        for name, held in copies:  # only the body's outputs leave the nest's buffers
            slot, buffer = self.storage[name], self.written[held]
            if not slot.flags.c_contiguous or slot.size != buffer.size:
                return None
            lines.append(f"{source.array(slot.reshape(-1))}[:] = {source.array(buffer.reshape(-1))}")
        return lines

    def _after(self, entry, source, late: list) -> list[str] | None:
        """The nest of a value of sums, over its own shape, after the main nest; the arrays it reads go to `late`."""
        _, out, row, inputs = entry
        target = self._private(out)
        shape = target.shape
        late += [self.storage[i] for i in inputs if i not in self.reduced]
        terms = [term_target(self.written[self.reduced[i]].reshape(self.types[i].shape)
                             if i in self.reduced else self.storage[i], shape, source) for i in inputs]
        written = term_target(target, shape, source)
        if any(t is None for t in terms) or written is None:
            return None
        return [f"for i{k} in range({d}):" for k, d in enumerate(shape)] + \
            [f"{written} = np.{self.dtype.name}({self.table.scalar_source(row, terms)})"]

    def _sum_nest(self, entry, source, zero: str, inner: list) -> bool:
        """A sum: its terms stored by the main nest (`inner`), added up by a nest of its own (`self.sums`)."""
        rank = len(self.space)
        _, out, source_value, axes, dropped = entry
        if tuple(self.types[source_value].shape) != self.space:
            return False
        axes = sorted({a % rank for a in axes}) if rank else []
        dropped = {a % rank for a in dropped} if dropped is not None and rank else set()
        target = self._private(out)
        kept = [f"i{k}" if k not in axes else "0" for k in range(rank) if k not in dropped]
        if target.ndim != len(kept):
            return False
        name = source.array(target if target.ndim else target.reshape(1))
        self.before.append(f"{name}[:] = {zero}" if target.ndim else f"{name}[0] = {zero}")
        # The summed axes outside the kept ones: each sum takes its terms in the order the whole nest would, and
        # the kept axes inside leave the main nest, and the additions, free of a chain from one point to the next.
        terms = source.array(np.empty(self.space, self.dtype))
        index = ", ".join(f"i{k}" for k in range(rank)) or "0"
        inner.append(f"{terms}[{index}] = {self.virtual[source_value]}" if rank else
                     f"{terms}.reshape(1)[0] = {self.virtual[source_value]}")
        self.sums.append([f"for i{k} in range({self.space[k]}):" for k in axes + [k for k in range(rank)
                                                                                if k not in axes]] +
                         [f"{name}[{', '.join(kept) or '0'}] += {terms}[{index}]" if rank else
                          f"{name}[0] += {terms}.reshape(1)[0]"])
        return True

    def _outputs(self, outputs: list[str], source, inner: list, late: list) -> list[tuple] | None:
        """Write the nest's outputs (in `inner`); the (output, buffer) pairs copied to their slots after it."""
        copies = []
        slots = [self.storage[o] for o in dict.fromkeys(outputs) if o in self.virtual or o in self.reduced]
        for out in dict.fromkeys(outputs):
            if out in self.virtual:
                slot = self.storage[out]
                # Written in place where nothing the nest reads, and no other output, lies in its slot (the
                # planner may have put it over a value that dies in the body); else in a buffer, copied after.
                # Not over an input read at the same point either: correct, but LLVM's check that the arrays
                # do not overlap then fails at run time, and the nest runs its scalar version.
                direct = not any(np.may_share_memory(slot, a) for a in self.reads + late) and \
                    sum(np.may_share_memory(slot, other) for other in slots) == 1
                target = term_target(slot if direct else self._private(out), self.space, source)
                if target is None:
                    return None
                inner.append(f"{target} = {self.virtual[out]}")
                if not direct:
                    copies.append((out, out))
            elif out in self.reduced:
                copies.append((out, self.reduced[out]))
        return copies


def term_target(array: np.ndarray, space: tuple, source, prefix: str | None = None, whole=None) -> str | None:
    """Where the nest reads an input or writes a body output at the current point (the array indexed where
    it broadcasts), or None when its shape does not fit the space. With `prefix`, `array` is a row of `whole`
    that the index expression `prefix` picks."""
    rank = len(space)
    if prefix is not None and array.ndim == 0:
        return f"{source.array(whole)}[{prefix}]"
    if array.ndim == 0:
        return f"{source.array(array.reshape(1))}[0]"
    if array.ndim > rank:
        return None
    index = []
    for k, dim in enumerate(array.shape):
        axis = rank - array.ndim + k
        if dim == space[axis]:
            index.append(f"i{axis}")
        elif dim == 1:
            index.append("0")
        else:
            return None
    if prefix is not None:
        return f"{source.array(whole)}[{', '.join([prefix] + index)}]"
    return f"{source.array(array)}[{', '.join(index)}]"
