"""Chains of element-wise nodes of a planned step, fused into one node that one generated loop nest runs.

A residual add and its activation, a LoRA adapter's scale and add, an attention mask's arithmetic are runs
of element-wise ops over one shape, each a pass over memory through its own kernel, each intermediate a
value the arena holds. Fused, one loop computes every value of a point in registers and writes only what leaves the chain:

    t = Mul(a, b); u = Add(t, bias); y = Relu(u)  →  FusedElementwise(a, b, bias) -> y

The pass runs on a step's order once types are bound and recomputation is decided (graph/step_plan.py),
on training, eval and inference steps alike; artifacts on disk and the exported inference model never see
a fused node (it exists in a bound step only). Which nodes are element-wise, and their arity, is the
kernels' table (kernels/scalar_expressions.py), handed in by the executor as `element_wise(node)`: the
graph layer never imports the kernels.

The rules, walking the order once:
- a member is an element-wise node with one output, of a float type, whose inputs are of that type and
  broadcast to its output's shape without enlarging it (a bias, a scale, a same-shaped operand);
- a member joins the group of a producer of one of its inputs when both compute the same shape and type,
  and no node between the group's last member and it reads a value of the group (the fused node takes the
  place of its last member, so every reader of what it writes still runs after it);
- a member's output leaves the fused node (is written to memory) when anything outside the group reads
  it, or it is a graph output, a held value (a gradient buffer) or an updated gradient; only values read
  by the group alone vanish (a value the backward reads stays materialised);
- a group of one node stays that node (its own kernel).

Invariants: the returned order computes every value the input order computed that anything reads or the
graph returns; a fused node's `steps` list its members in order, each as (op type, attributes, operand
references: ("input", k) for the fused node's input k, ("step", j) for member j's value); `results` are
the member indices whose values are the fused node's outputs, in output order. Set
ODTRAIN_ELEMENTWISE_FUSION=0 to plan steps without it (to compare).
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from .ir import ODTRAIN_DOMAIN, Node, TensorType
from .ops.fused_elementwise import FUSED_OP

SWITCH = "ODTRAIN_ELEMENTWISE_FUSION"  # "0": no fusion (the per-op kernels), to compare


def fusion_enabled() -> bool:
    """Whether steps are planned with element-wise fusion (on unless ODTRAIN_ELEMENTWISE_FUSION=0)."""
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


class _Group:
    """Members of one fused node, in order; `space` is their shared output type."""

    def __init__(self, node: Node, space: TensorType, position: int):
        self.members = [node]
        self.space = space
        self.last = position
        self.values = {node.outputs[0]}


def _fits(node: Node, types: dict, arity: int | None) -> TensorType | None:
    """The output type of `node` when it can be a member (see the rules), else None."""
    if arity is None or len(node.outputs) != 1 or len([i for i in node.inputs if i]) != arity or \
            len(node.inputs) != arity:
        return None
    out = types.get(node.outputs[0])
    if out is None or np.dtype(out.dtype).kind != "f" or out.nbytes == 0:
        return None
    for name in node.inputs:
        t = types.get(name)
        if t is None or np.dtype(t.dtype) != np.dtype(out.dtype) or len(t.shape) > len(out.shape):
            return None
        if any(d != 1 and d != s for d, s in zip(t.shape, out.shape[len(out.shape) - len(t.shape):])):
            return None
        if len(out.shape) > 4 and tuple(t.shape) != tuple(out.shape) and t.nbytes != out.nbytes // max(out.size, 1):
            return None  # a broadcast over more than the four axes the kernel's rows layout takes
    return out


def fuse_elementwise(order: list[Node], types: dict, kept: set, element_wise: Callable[[Node], int | None]) \
        -> list[Node]:
    """`order` with its element-wise chains fused (the module's rules); `kept`: values that must stay in
    memory whoever reads them (graph outputs, held values, gradients an update reads)."""
    readers: dict[str, list[int]] = {}
    for position, node in enumerate(order):
        for name in node.inputs:
            if name:
                readers.setdefault(name, []).append(position)
    group_of: dict[str, _Group] = {}  # a member's value -> its group
    groups: list[_Group] = []
    for position, node in enumerate(order):
        space = _fits(node, types, element_wise(node))
        if space is None:
            continue
        joined = None
        for name in node.inputs:
            group = group_of.get(name)
            if group is not None and group.space == space and joined in (None, group) and \
                    not _read_between(group, readers, group.last, position):
                joined = group
        if joined is None:
            joined = _Group(node, space, position)
            groups.append(joined)
        else:
            joined.members.append(node)
            joined.values.add(node.outputs[0])
            joined.last = position
        group_of[node.outputs[0]] = joined
    fused = {}
    for group in groups:
        if len(group.members) > 1:
            fused[id(group.members[-1])] = _fused_node(group, readers, order, kept)
    members = {id(n) for g in groups if len(g.members) > 1 for n in g.members}
    return [fused.get(id(node), node) for node in order if id(node) not in members or id(node) in fused]


def _read_between(group: _Group, readers: dict, start: int, end: int) -> bool:
    """Whether a node strictly between positions `start` and `end` reads a value of `group`."""
    return any(start < p < end for name in group.values for p in readers.get(name, ()))


def _fused_node(group: _Group, readers: dict, order: list[Node], kept: set) -> Node:
    """The node running `group`'s members: its inputs, outputs and steps (module docstring)."""
    inside = {id(n) for n in group.members}
    step_of = {n.outputs[0]: j for j, n in enumerate(group.members)}
    inputs: list[str] = []
    steps = []
    for member in group.members:
        operands = []
        for name in member.inputs:
            if name in step_of:
                operands.append(("step", step_of[name]))
            else:
                if name not in inputs:
                    inputs.append(name)
                operands.append(("input", inputs.index(name)))
        steps.append((member.op_type, tuple(sorted(member.attrs.items())), tuple(operands)))
    results = [j for j, member in enumerate(group.members)
               if member.outputs[0] in kept or any(id(order[p]) not in inside for p in readers.get(member.outputs[0], ()))
               or not readers.get(member.outputs[0])]
    last = group.members[-1]
    return Node(FUSED_OP, inputs, [group.members[j].outputs[0] for j in results],
                {"steps": tuple(steps), "results": tuple(results)},
                name=f"{last.name or last.outputs[0]}/fused{len(group.members)}", domain=ODTRAIN_DOMAIN,
                scope=last.scope)
