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

The modules stand on three floors. On the ground, the modules that import nothing of kernels/: jit.py
(Numba's names), registry.py, layout.py, blas_library.py and parallel_split.py (the parallel rule; a written
twin is compiled by its own module's njit). Above them the base, what families share, each importing only
the ground: blas.py, windows.py, scalar.py (fast_exp, ...), copies.py (copy, gather and sum calls),
number_formats.py and stored_weights.py. On top the families, which register bindings (elementwise, conv,
tensor, ...) and import the ground and the base only (tests/test_layering.py); a family that runs another
op (quantize.py's integer products) takes that op's binding from the registry. A family whose work spans
files is a folder: conv/ holds its strategies (taps.py, pointwise.py, depthwise.py) beside the bindings
and im2col (conv/__init__.py), which choose among them.

One base module stands on another base module, on purpose: stored_weights.py multiplies a weight stored in
fewer bits panel by panel, dequantizing each panel (its number formats) and multiplying it by BLAS
(blas.py) in one loop, for two families (dequantized.py and training.py). Merging it into blas.py would put
int4 nibbles beside the BLAS route, and giving each family its own copy of the loop would write it twice;
so dequantized.py and training.py stand one floor higher than the other families.

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
