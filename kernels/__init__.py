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
registered twin of a serial one, chosen by one rule (kernels/parallel_split.py).

The modules are one floor of families over a base. A family registers bindings (elementwise, conv,
tensor, ...); the base is what families share: jit.py (Numba's names), registry.py, layout.py, blas.py,
parallel_split.py, windows.py, scalar.py (fast_exp, ...), copies.py (copy, gather and sum calls),
number_formats.py, stored_weights.py and the convolution strategies conv_taps.py, conv_pointwise.py and
depthwise.py. A family imports only the base (tests/test_layering.py), and a family that runs another
op (quantize.py's integer products) takes that op's binding from the registry.

The registry (BINDINGS, SCRATCH, PARALLEL, `binding`) lives in kernels/registry.py, which the family
modules import. Importing this package imports every module of its folder, sorted by name (so the
registries fill in the same order in every process; private `_` modules and the registry itself
excepted): a new family module registers its bindings by being there, with no list to edit.

Kernel modules take Numba's names from kernels/jit.py, which loads Numba only when a kernel compiles:
a process whose steps run in a kernel library (odtrain/kernel_library/) imports the bindings without
it. Imports numpy (and Numba, through jit.py), nothing else of odtrain's but the leaf both op layers share
(odtrain/op_families.py: the domain of odtrain's ops, and the import of every family module).
"""
from __future__ import annotations

from functools import partial

from ..op_families import import_submodules, submodules as _modules_of
from .registry import BINDINGS, ODTRAIN_DOMAIN, PARALLEL, SCRATCH, binding  # noqa: F401

submodules = partial(_modules_of, __path__)  # the modules imported below: odtrain/op_families.py's rule
import_submodules(__name__, __path__)
