"""The compute runtime of a process: Numba's CPU target and the BLAS its matrix products call.

Loaded once per process, before the first plan binds (`odtrain.executor`), or earlier by an
application that wants to pay for it at start-up: `odtrain.runtime.load()`. It is the part of
a training process that does not depend on the model, the floor under every session:

- `import numba` maps LLVM (llvmlite's shared library) and Numba's compiler;
- Numba's CPU target, set up at its first use, imports the typing and lowering registries of
  every numpy function it supports, and checks for BLAS by importing
  `scipy.linalg.cython_blas`, the table of BLAS functions its matrix products call.

`odtrain.blas.load_blas()` loads that one extension module without the rest of scipy.linalg;
`odtrain.threads.configure()` sets BLAS to one thread and chooses Numba's threading layer;
`odtrain.kernels.jit.load()` gives the kernel modules Numba's dispatchers.

A process whose steps run in a kernel library (odtrain/kernel_library.py) never loads this runtime.

The floor's size is measured per commit by the asv suite's `bench_memory.RuntimeFloor`; the latest
results are in benchmarks/README.md ("The process floor and the cold start").
"""
from __future__ import annotations

from .blas import load_blas
from .kernels.jit import load as load_compiler
from .threads import configure as configure_threads

_loaded = False


def load() -> None:
    """Load the runtime now (idempotent): BLAS, the threads, Numba's CPU target."""
    global _loaded
    if _loaded:
        return
    try:
        load_blas()
    except ImportError:  # no scipy: Numba says so at the first matrix product, the only thing that needs it
        pass
    configure_threads()
    load_compiler()  # the kernel modules get Numba's dispatchers in place of their placeholders
    try:
        from numba.core.registry import cpu_target
    except ImportError:  # a Numba without this layout sets its target up at the first kernel instead
        pass
    else:
        cpu_target.target_context.refresh()
    _loaded = True
