"""The intermediate representation: `Graph`, `Node` and `TensorType`.

Invariants:
- Values are named by strings; every name is produced once (by a graph
  input, an initializer, or exactly one node output). The empty name marks an
  omitted optional input or output, as in ONNX.
- `Graph.nodes` is in a valid execution order (producers before consumers).
- Attributes are plain Python values (int, float, str, bytes, lists of them,
  numpy arrays for tensor attributes); no protobufs live in the IR.
- A shape is a tuple whose entries are ints or strings (symbolic dims, bound
  at run time); `None` as a whole means the rank is unknown.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..op_families import ODTRAIN_DOMAIN  # noqa: F401  (the domain of the ops odtrain adds)

DEFAULT_DOMAIN = ""


@dataclass(frozen=True)
class TensorType:
    """Element type and shape of a value. `shape` is None when the rank is unknown."""

    dtype: np.dtype
    shape: tuple | None

    @property
    def is_static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    @property
    def size(self) -> int:
        """Number of elements; only for static shapes."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def __str__(self) -> str:
        dims = "?" if self.shape is None else "x".join(str(d) for d in self.shape) or "scalar"
        return f"{np.dtype(self.dtype).name}[{dims}]"


@dataclass
class Node:
    """One operator application. `inputs`/`outputs` are value names ('' = omitted)."""

    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    domain: str = DEFAULT_DOMAIN
    scope: str = ""  # the module path an exporter recorded ('model.layers.0.self_attn.q_proj/linear'), or ''

    @property
    def key(self) -> tuple[str, str]:
        """Registry key: (domain, op_type), with 'ai.onnx' folded into ''."""
        return (DEFAULT_DOMAIN if self.domain == "ai.onnx" else self.domain, self.op_type)

    def describe(self) -> str:
        label = f"{self.domain}::{self.op_type}" if self.domain else self.op_type
        return f"{label} node '{self.name}'" if self.name else f"{label} node producing {self.outputs}"


@dataclass
class Graph:
    """A computation: inputs fed by the caller, initializers, nodes, outputs.

    `initializers` holds constant tensors stored with the graph. `value_types`
    holds whatever is known about every value's type (graph inputs and
    outputs always; intermediates when shape inference found them).
    """

    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    value_types: dict[str, TensorType] = field(default_factory=dict)
    opsets: dict[str, int] = field(default_factory=lambda: {DEFAULT_DOMAIN: 17})
    name: str = "graph"

    def producers(self) -> dict[str, Node]:
        return {out: node for node in self.nodes for out in node.outputs if out}

    def consumers(self) -> dict[str, list[Node]]:
        users: dict[str, list[Node]] = {}
        for node in self.nodes:
            for name in node.inputs:
                if name:
                    users.setdefault(name, []).append(node)
        return users

    def all_value_names(self) -> set[str]:
        names = set(self.inputs) | set(self.initializers)
        for node in self.nodes:
            names.update(n for n in node.outputs if n)
        return names

    def copy(self) -> "Graph":
        return Graph(
            nodes=[Node(n.op_type, list(n.inputs), list(n.outputs), dict(n.attrs), n.name, n.domain, n.scope)
                   for n in self.nodes],
            inputs=list(self.inputs),
            outputs=list(self.outputs),
            initializers=dict(self.initializers),
            value_types=dict(self.value_types),
            opsets=dict(self.opsets),
            name=self.name,
        )

    def prune(self, outputs: list[str]) -> "Graph":
        """The subgraph that computes `outputs`, keeping only the inputs and initializers it reads."""
        needed = set(outputs)
        kept: list[Node] = []
        for node in reversed(self.nodes):
            if any(o in needed for o in node.outputs):
                kept.append(node)
                needed.update(i for i in node.inputs if i)
        kept.reverse()
        pruned = self.copy()
        pruned.nodes = [n for n in pruned.nodes if any(o in needed for o in n.outputs)]
        pruned.outputs = list(outputs)
        pruned.inputs = [i for i in self.inputs if i in needed]
        pruned.initializers = {k: v for k, v in self.initializers.items() if k in needed}
        return pruned


class NameScope:
    """Hands out value and node names that do not clash with a graph's existing ones."""

    def __init__(self, graph: Graph, prefix: str = ""):
        self.taken = graph.all_value_names() | {n.name for n in graph.nodes}
        self.prefix = prefix
        self._counter = itertools.count()

    def fresh(self, hint: str) -> str:
        name = f"{self.prefix}{hint}"
        while name in self.taken:
            name = f"{self.prefix}{hint}_{next(self._counter)}"
        self.taken.add(name)
        return name
