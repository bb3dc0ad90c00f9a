"""The JIT: Numba compiling odtrain's kernels in the training process, and what serves it.

A process whose steps run in a kernel library (odtrain/kernel_library/) never loads any of this
but the cache folder's choice. The modules, from the bottom:

- `cache`: where compiled kernels are kept (chosen when `odtrain` is imported, before Numba loads),
  and the removal of cached kernels compiled from other kernel sources than the installed ones;
- `blas`: the BLAS that Numba's products call (scipy's OpenBLAS, loaded lean) and its thread count;
- `ahead`: compiling a bound step's kernels before its first run, with a note when they really compile.

The `odtrain warmup` tool, which fills the cache for a set of artifacts, runs steps through the API:
it is odtrain/trial_steps.py, above the API.

`load()` below is the compute runtime of a process: Numba's CPU target and the BLAS its matrix
products call, the floor under every JIT session. It runs once per process, before the first plan
binds (`odtrain.executor`), or earlier, from an application that wants to pay for it at start-up:

- `import numba` maps LLVM (llvmlite's shared library) and Numba's compiler;
- Numba's CPU target, set up at its first use, imports the typing and lowering registries of
  every numpy function it supports, and checks for BLAS by importing
  `scipy.linalg.cython_blas`, the table of BLAS functions its matrix products call.

The floor's size is measured by the asv suite's `bench_memory.RuntimeFloor` (results in
benchmarks/README.md, "The process floor and the cold start").
"""
from __future__ import annotations

_loaded = False


def load() -> None:
    """Load the runtime now (idempotent): BLAS on one thread, Numba's threading layer, its CPU target."""
    global _loaded
    if _loaded:
        return
    from ..kernels.jit import load as load_compiler
    from ..threads import configure as configure_threads
    from .blas import load_blas, set_blas_threads

    try:
        load_blas()  # the one extension module of scipy.linalg that Numba's products need (jit/blas.py)
    except ImportError:  # no scipy: Numba says so at the first matrix product, the only thing that needs it
        pass
    set_blas_threads(1)  # a step's parallel parts each call BLAS: one thread inside, so threads never multiply
    configure_threads()
    load_compiler()  # the kernel modules get Numba's dispatchers in place of their placeholders
    try:
        from numba.core.registry import cpu_target
    except ImportError:  # a Numba without this layout sets its target up at the first kernel instead
        pass
    else:
        cpu_target.target_context.refresh()
    _loaded = True
