"""The op registry: for each op type, its type rule, its facts (memory, inputs, cost) and gradient rule.

An op is registered with `@op("Relu", ...)` on its type rule, and its
gradient with `@grad("Relu")`. The registry is a plain dict keyed by
(domain, op_type). This module is a leaf of graph/ops (it imports none of
its modules): each family module imports the registry from here, and importing
the package `graph.ops` imports every family module, which fills it.

Type rule: `rule(node, types, consts) -> list[TensorType]` where `types[i]` is
the TensorType of input i (None for an omitted optional input) and
`consts[i]` its value when known while binding shapes (initializers, folded
constants). A rule may also return `(types, values)` to fold its outputs to
constants (Shape, Constant): such nodes cost nothing per step.

Memory facts, read by the planner:
- `inplace`: pairs (output index, input index) where the output may
  overwrite the input when the input dies at this node and sizes match.
- `view`: the output is input 0's bytes reinterpreted (Reshape, Flatten,
  Identity): it shares the input's storage. May be a function of the bound
  (input types, output types), for ops that are views only sometimes.
- `shape_only`: input indices whose values are never read, only their
  shapes; they do not extend a value's lifetime.
- `updates`: pairs (output index, input index) where the output is the new
  value of a state input (BatchNormalization's running statistics). When
  the input is a parameter, the output is written over it in place, so the
  checkpoint carries the update.

Input facts, read by autodiff and artifact generation:
- `constant_inputs`: input indices that configure the op rather than feed
  it (shapes, axes, scales, pads): they must be constants of the model,
  never receive a gradient, and are never chosen as trainable parameters.

Cost facts, read by the cost model (`graph/cost.py`, which states the unit):
- `passes`: how many times the op goes over each element it touches
  (normalizations and softmax 3, a transcendental function per element 2).
- `flops`: for a product, `flops(node, input_types, output_type)`, its
  operations (2 per multiply-add) at static bound types.
- `window_reads`: for an op over sliding windows, `window_reads(node,
  input_types, output_type)`, the input elements its windows read.
- `gradient_product`: for a gradient op that is a product again (a Conv's
  input and weight gradients, MatMul's), `(forward op, position of its two
  operands among the gradient's inputs, position of dY)`: it does as many
  operations as the forward product of those operands giving dY's shape.

Kernel fact, read by tests/test_registry.py:
- `no_kernel`: why the op never reaches a kernel (a view sharing its input's bytes, a constant folded
  when shapes bind, an op the executor runs itself): every other op has a binding in kernels/.

Opset upgrades, applied by the loader (graph/onnx_io.py): `@upgrade("Softmax",
before=13)` on `fn(node, opset, value_types, source)` rewrites, in place, a
node of a model whose opset (of the op's domain) is older than `before` to the
meaning the type rule and the kernels read (writing out an old default,
pinning an attribute), or raises ModelError where that meaning cannot express
it. An op may register several, applied in registration order.

Eval form: `eval_form(node) -> Node` gives the node as the eval and inference
models run it (BatchNormalization with running statistics, Dropout as
identity); ops without one run the same in both.

Gradient rule: `rule(ctx: GradContext)` emits gradient nodes through `ctx`
and sets `ctx.set_grad(i, name)` for the input gradients it was asked for
(`ctx.needs(i)`). `no_grad(op, reason)` states that an op has no gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import UnsupportedOpError
from ..ir import DEFAULT_DOMAIN, ODTRAIN_DOMAIN, Node


@dataclass
class OpDef:
    op_type: str
    domain: str
    infer: Callable
    inplace: tuple[tuple[int, int], ...] = ()
    view: bool | Callable = False
    shape_only: frozenset[int] = frozenset()
    updates: tuple[tuple[int, int], ...] = ()
    constant_inputs: frozenset[int] = frozenset()
    passes: float = 1.0
    flops: Callable | None = None
    window_reads: Callable | None = None
    eval_form: Callable | None = None
    gradient: Callable | None = None
    no_grad_reason: str | None = None
    random: bool = False  # draws random numbers: running it again gives other values (never recomputed)
    no_kernel: str | None = None  # why no kernel runs it (a view, a folded constant, ...); None: a binding does
    gradient_product: tuple[str, int, int, int] | None = None  # (forward product, its operands' positions, dY's)
    upgrades: tuple[tuple[int, Callable], ...] = ()  # (before opset, fn): rewrites a node of an older opset


OPS: dict[tuple[str, str], OpDef] = {}


def op(op_type: str, domain: str = DEFAULT_DOMAIN, inplace=(), view=False, shape_only=(), updates=(),
       constant_inputs=(), passes: float = 1.0, flops=None, window_reads=None, random=False,
       no_kernel: str | None = None, gradient_product: tuple[str, int, int, int] | None = None):
    """Register the type rule of an op, with its memory, input, cost and kernel facts (see the module docstring)."""

    def register(rule):
        OPS[(domain, op_type)] = OpDef(op_type, domain, rule, tuple(inplace), view, frozenset(shape_only),
                                       tuple(updates), frozenset(constant_inputs), passes, flops, window_reads,
                                       random=random, no_kernel=no_kernel, gradient_product=gradient_product)
        return rule

    return register


def eval_form(op_type: str, domain: str = DEFAULT_DOMAIN):
    """Register how an op runs in the eval and inference models: fn(node) -> Node."""

    def register(fn):
        OPS[(domain, op_type)].eval_form = fn
        return fn

    return register


def upgrade(op_type: str, before: int, domain: str = DEFAULT_DOMAIN):
    """Register how a node of an opset older than `before` becomes what the op's rule reads:
    fn(node, opset, value_types, source), changing the node in place (see the module docstring)."""

    def register(fn):
        opdef = OPS[(domain, op_type)]
        opdef.upgrades = opdef.upgrades + ((before, fn),)
        return fn

    return register


def upgrade_legacy_nodes(nodes, opsets: dict, value_types: dict, source: str) -> None:
    """Apply to each node the upgrades its op registers for its model's opset (opsets: domain -> version,
    'ai.onnx' folded into ''); nodes of ops odtrain does not know are left as they are."""
    for node in nodes:
        opdef = OPS.get(node.key)
        if opdef is None or not opdef.upgrades:
            continue
        opset = opsets.get(node.key[0], 0)
        for before, fn in opdef.upgrades:
            if opset < before:
                fn(node, opset, value_types, source)


def grad(op_type: str, domain: str = DEFAULT_DOMAIN):
    """Register the gradient rule of an op already registered with `op`."""

    def register(rule):
        OPS[(domain, op_type)].gradient = rule
        return rule

    return register


def no_grad(op_type: str, reason: str, domain: str = DEFAULT_DOMAIN):
    """State that an op has no gradient, and why (integer outputs, comparisons, ...)."""
    OPS[(domain, op_type)].no_grad_reason = reason


def is_view(opdef: OpDef, input_types, output_types) -> bool:
    """Whether this op, at these bound types, only reinterprets input 0's bytes."""
    return opdef.view(input_types, output_types) if callable(opdef.view) else bool(opdef.view)


def lookup(node: Node) -> OpDef:
    """The OpDef for a node, or an UnsupportedOpError naming it and listing what is supported."""
    opdef = OPS.get(node.key)
    if opdef is None:
        supported = ", ".join(sorted(f"{d}::{t}" if d else t for d, t in OPS))
        raise UnsupportedOpError(
            f"{node.describe()}: odtrain has no kernel for this op type. Supported ops: {supported}"
        )
    return opdef


def check_supported(nodes, source: str) -> None:
    """Name every node whose op odtrain does not know, before any work is done."""
    unknown = [n for n in nodes if n.key not in OPS]
    if unknown:
        listed = "; ".join(n.describe() for n in unknown[:10]) + (f"; and {len(unknown) - 10} more" if len(unknown) > 10 else "")
        kinds = sorted({f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in unknown})
        raise UnsupportedOpError(f"{source}: odtrain has no kernel for {', '.join(kinds)} ({listed}). "
                                 "Run `odtrain check --ops` for the list of supported ops, or re-export the model "
                                 "with supported ops")


# ---- helpers shared by the family modules ---------------------------------------------------


def same_as_input(index: int = 0):
    """A type rule: every output has the type of input `index`."""

    def rule(node, types, consts):
        return [types[index]] * len(node.outputs)

    return rule


def broadcast_shapes(*shapes: tuple) -> tuple:
    """Numpy-style (multidirectional) broadcast of static or symbolic shapes."""
    rank = max(len(s) for s in shapes)
    out = []
    for axis in range(rank):
        dims = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]
        chosen = 1
        for d in dims:
            if d == 1:
                continue
            if chosen == 1:
                chosen = d
            elif d != chosen:
                if isinstance(d, str) or isinstance(chosen, str):
                    chosen = chosen if isinstance(chosen, int) else d
                else:
                    raise ValueError(f"shapes {shapes} do not broadcast (axis {axis}: {chosen} vs {d})")
        out.append(chosen)
    return tuple(out)


def attr_axes(node: Node, consts, axes_input: int | None, rank: int) -> tuple[int, ...] | None:
    """Reduction axes from the attribute or the (constant) axes input, normalised to >= 0."""
    axes = node.attrs.get("axes")
    if axes is None and axes_input is not None and len(node.inputs) > axes_input and node.inputs[axes_input]:
        value = consts[axes_input]
        if value is None:
            raise UnsupportedOpError(f"{node.describe()}: its axes input must be a constant")
        axes = [int(a) for a in np.asarray(value).reshape(-1)]
    if axes is None:
        return None
    return tuple(sorted(int(a) % rank for a in axes)) if rank else ()


# ---- gradient building -----------------------------------------------------------------------


class GradContext:
    """What a gradient rule sees of one forward node, in ONNX Runtime's vocabulary.

    I(i): name of forward input i; O(i): forward output i; GO(i): gradient
    flowing into output i ('' when none); needs(i): whether input i's
    gradient is wanted; set_grad(i, name): hand back input i's gradient.
    `emit` adds a node to the backward graph and returns its output name(s).
    """

    def __init__(self, node: Node, output_grads: list[str], wanted: list[bool], builder, rank_of):
        self.node = node
        self._output_grads = output_grads
        self._wanted = wanted
        self._builder = builder
        self._rank_of = rank_of
        self.input_grads: dict[int, str] = {}

    def I(self, i: int) -> str:  # noqa: E743 (ONNX Runtime's name)
        return self.node.inputs[i] if i < len(self.node.inputs) else ""

    def O(self, i: int) -> str:  # noqa: E743
        return self.node.outputs[i]

    def GO(self, i: int) -> str:
        return self._output_grads[i] if i < len(self._output_grads) else ""

    def forward_output(self, i: int, hint: str) -> str:
        """O(i), first adding output i to the forward node if the model left it out (Dropout's mask)."""
        outputs = self.node.outputs
        if i >= len(outputs) or not outputs[i]:
            outputs.extend([""] * (i + 1 - len(outputs)))
            outputs[i] = self._builder.names.fresh(f"{outputs[0]}_{hint}")
        return outputs[i]

    def dtype(self, name: str):
        """The element type of a forward value, when shape inference knew it (else None)."""
        t = self._builder.graph.value_types.get(name)
        return None if t is None else np.dtype(t.dtype)

    def needs(self, i: int) -> bool:
        return i < len(self._wanted) and self._wanted[i]

    @property
    def value_types(self) -> dict:
        """What is known of every forward value's type (the graph being differentiated)."""
        return self._builder.graph.value_types

    def known_constant(self, name: str):
        """The value of `name` when it is a constant of the graph (an initializer, a Constant node), else None."""
        return self._builder.constant_value(name)

    def fresh(self, hint: str) -> str:
        """A value or node name that clashes with none of the graph's."""
        return self._builder.names.fresh(hint)

    def add_node(self, node: Node) -> None:
        """Add a node built whole (a control-flow node with its bodies) to the backward graph."""
        self._builder.nodes.append(node)

    def attr(self, name: str, default: Any = None) -> Any:
        return self.node.attrs.get(name, default)

    def rank(self, name: str) -> int:
        """Rank of a forward value, from shape inference; fails clearly if unknown."""
        rank = self._rank_of(name)
        if rank is None:
            raise UnsupportedOpError(f"{self.node.describe()}: the rank of '{name}' is unknown; its gradient needs it")
        return rank

    def emit(self, op_type: str, inputs: list[str], attrs: dict | None = None, domain: str = DEFAULT_DOMAIN,
             outputs=1, hint: str | None = None):
        """`outputs`: a count, or one bool per output where False leaves that output omitted ('')."""
        wanted = None if isinstance(outputs, int) else [bool(w) for w in outputs]
        count = outputs if wanted is None else len(wanted)
        names = self._builder.emit(op_type, inputs, attrs or {}, domain, count, hint or f"{self.node.name or op_type}_grad")
        if wanted is not None:
            names = [name if keep else "" for name, keep in zip(names, wanted)]
            self._builder.nodes[-1].outputs = list(names)
        return names[0] if isinstance(outputs, int) and outputs == 1 else names

    def odtrain(self, op_type: str, inputs: list[str], attrs: dict | None = None, outputs=1):
        """Emit an op of odtrain's own domain (gradient ops, fused losses)."""
        return self.emit(op_type, inputs, attrs, ODTRAIN_DOMAIN, outputs)

    def constant(self, value, hint: str = "const") -> str:
        return self._builder.constant(np.asarray(value), hint)

    def const_axes(self, i: int) -> list[int]:
        """The value of input i, which must be a constant of the graph (an axes list)."""
        value = self._builder.constant_value(self.I(i))
        if value is None:
            raise UnsupportedOpError(f"{self.node.describe()}: input '{self.I(i)}' must be a constant for its gradient")
        return [int(a) for a in np.asarray(value).reshape(-1)]

    def set_grad(self, i: int, name: str) -> None:
        if self.needs(i):
            self.input_grads[i] = name

    def sum_to_input(self, grad_name: str, i: int) -> str:
        """Reduce a broadcast gradient back to the shape of input i (a no-op when shapes match)."""
        return self.odtrain("SumToShape", [grad_name, self.I(i)])
