"""Numba kernels, one module per op family, and the bindings that call them.

Each kernel is a private `@njit(cache=True)` function that takes only arrays
and scalars, writes into its output arrays and allocates nothing. Each
binding is registered under its ONNX op type and called once when a graph
is bound to the arena:

    binding(inputs, outputs, **onnx_attributes) -> list of (kernel, args)

`inputs`/`outputs` are numpy views of the arena (None for an omitted
optional input); the returned calls are what a step runs. Bindings do the
shape-dependent work (broadcast layouts, transposed views) once.

A binding that needs working memory (im2col buffers and the like) declares
`scratch=fn`, where `fn(input_specs, output_specs, **onnx_attributes)`
returns its size in bytes from (shape, dtype) pairs; the planner places it
in the arena for that one step and the binding receives it as `scratch=`,
a uint8 array.

Imports numpy and numba only, nothing else of odtrain's.
"""
from __future__ import annotations

BINDINGS: dict[tuple[str, str], object] = {}
SCRATCH: dict[tuple[str, str], object] = {}
ODTRAIN_DOMAIN = "ai.odtrain"


def binding(op_type: str, domain: str = "", scratch=None):
    """Register a binding under (domain, op_type), with its scratch-size function if it needs one."""

    def register(fn):
        BINDINGS[(domain, op_type)] = fn
        if scratch is not None:
            SCRATCH[(domain, op_type)] = scratch
        return fn

    return register


from . import (  # noqa: E402,F401
    attention, conv, elementwise, linalg, nn, normalization, optim, pool, quantize, recurrent, reduction, resize, tensor,
    training)
