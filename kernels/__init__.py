"""Numba kernels, one module per op family, and the bindings that call them.

Each kernel is a private `@njit(cache=True)` function that takes only arrays
and scalars, writes into its output arrays and allocates nothing. Each
binding is registered under its ONNX op type and called once when a graph
is bound to the arena:

    binding(inputs, outputs, **onnx_attributes) -> list of (kernel, args)

`inputs`/`outputs` are numpy views of the arena (None for an omitted
optional input); the returned calls are what a step runs. Bindings do the
shape-dependent work (broadcast layouts, transposed views) once.

Imports numpy and numba only, nothing else of odtrain's.
"""
from __future__ import annotations

BINDINGS: dict[tuple[str, str], object] = {}
ODTRAIN_DOMAIN = "ai.odtrain"


def binding(op_type: str, domain: str = ""):
    """Register a binding under (domain, op_type)."""

    def register(fn):
        BINDINGS[(domain, op_type)] = fn
        return fn

    return register


from . import elementwise, linalg, nn, normalization, optim, recurrent, reduction, tensor, training  # noqa: E402,F401
