"""How many threads odtrain's matrix products use: one unless asked otherwise.

Numba reaches BLAS through scipy (`scipy.linalg.cython_blas`), so the products of a step run
on scipy's OpenBLAS, whose default is one thread per core. Its idle threads spin before they
sleep: on a busy machine (other processes on the same cores) a two-thread transformer step
took 9x the time and 10x the CPU of a one-thread step (970 ms vs 108 ms here). odtrain runs
serial by default, as its kernels do (DESIGN.md: threading is an explicit option):

- `set_num_threads(n)` sets the BLAS threads of odtrain's products;
- the environment variable ODTRAIN_NUM_THREADS=n does the same when the first model binds;
- if OPENBLAS_NUM_THREADS or OMP_NUM_THREADS is set, odtrain leaves BLAS as the user set it.

Only scipy's OpenBLAS is changed (numpy carries its own copy, which is left alone). Where the
library cannot be found (another BLAS, another OS), this is a no-op.
"""
from __future__ import annotations

import ctypes
import os

_SETTERS = ("scipy_openblas_set_num_threads", "scipy_openblas_set_num_threads64_", "openblas_set_num_threads")
_applied = False


def _scipy_blas_setter():
    """The thread-count setter of the OpenBLAS that scipy.linalg.cython_blas is linked to, or None."""
    try:
        from .blas import load_blas

        load_blas()  # scipy's BLAS table, the one Numba's products call
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and "scipy.libs" in line}
    except (ImportError, OSError):
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SETTERS:
            setter = getattr(library, name, None)
            if setter is not None:
                return setter
    return None


def set_num_threads(count: int) -> bool:
    """Use `count` threads in odtrain's BLAS products; returns whether the BLAS library was found."""
    global _applied
    _applied = True
    setter = _scipy_blas_setter()
    if setter is None:
        return False
    setter(ctypes.c_int(max(int(count), 1)))
    return True


def apply_default() -> None:
    """Once per process, before the first step: ODTRAIN_NUM_THREADS, else 1 unless the user set BLAS threads."""
    global _applied
    if _applied:
        return
    requested = os.environ.get("ODTRAIN_NUM_THREADS")
    if requested is not None:
        set_num_threads(int(requested))
    elif "OPENBLAS_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        set_num_threads(1)
    else:
        _applied = True
