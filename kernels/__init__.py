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

A binding registered with `parallel=True` splits its work into `threads`
parts inside one Numba parallel region: it and its scratch-size function
also receive `threads=` (the step's thread count, fixed when the step is
bound), so scratch sizes are a function of the thread count. With
`threads=1` it runs its serial kernels. Each parallel kernel is the
registered twin of a serial one, chosen by one rule (kernels/parts.py).

Kernel modules take Numba's names from kernels/jit.py, which loads Numba only when a kernel compiles:
a process whose steps run in a kernel library (odtrain/kernel_library.py) imports the bindings without
it. Imports numpy (and Numba, through jit.py), nothing else of odtrain's.
"""
from __future__ import annotations

BINDINGS: dict[tuple[str, str], object] = {}
SCRATCH: dict[tuple[str, str], object] = {}
PARALLEL: set[tuple[str, str]] = set()
ODTRAIN_DOMAIN = "ai.odtrain"


def binding(op_type: str, domain: str = "", scratch=None, parallel: bool = False):
    """Register a binding under (domain, op_type), with its scratch-size function if it needs one; a
    `parallel` binding (and its scratch-size function) takes the step's thread count as `threads=`."""

    def register(fn):
        BINDINGS[(domain, op_type)] = fn
        if scratch is not None:
            SCRATCH[(domain, op_type)] = scratch
        if parallel:
            PARALLEL.add((domain, op_type))
        return fn

    return register

from . import (  # noqa: E402,F401
    attention, conv, dequantized, elementwise, linalg, nn, normalization, optim, pool, quantize, recurrent, reduction, resize, signal,
    tensor, training)
