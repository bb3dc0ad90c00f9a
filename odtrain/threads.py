"""How many threads a step uses: every core this process may run on, unless asked otherwise.

One setting drives every thread of a step, looked up in this order:
- `Module(..., num_threads=n)`, for that module;
- `set_num_threads(n)`, the process default for modules created without one;
- the environment variable ODTRAIN_NUM_THREADS=n;
- otherwise the cores this process may run on (`os.sched_getaffinity`), at most Numba's pool
  (NUMBA_NUM_THREADS, fixed when Numba loads).
A count above the pool is allowed: the step is split for that many threads and runs on the pool,
giving the same bits as on a machine with that many cores.

How threads are used (DESIGN.md, "Threads"): a parallel kernel splits its outer loop (batch,
channels, rows) into `threads` parts, each with its own scratch in the arena, inside one Numba
parallel region; a step binds its kernels for its thread count and runs with Numba's pool at
that count (`numba.set_num_threads` is per calling thread, so modules in different Python
threads keep their own). BLAS (scipy's OpenBLAS, which Numba's products call) runs one thread:
products run inside the regions, already split, so threads never multiply, and OpenBLAS's
own pool, whose idle threads spin, never runs.

Numba's threading layer is chosen on purpose, by `configure()` before the pool starts (unless
the user set NUMBA_THREADING_LAYER): {LAYER_NOTE}

With one thread every kernel runs its serial code and a run is bit-for-bit reproducible. With
n threads a run is reproducible too (the parts are fixed at bind time, partial sums are added
in part order), but differs from another thread count in rounding (README: "Threads").
"""
from __future__ import annotations

import contextlib
import operator
import os

from .blas import set_blas_threads
from .graph.errors import ArgumentError

ENVIRONMENT = "ODTRAIN_NUM_THREADS"
_process_default: int | None = None
_configured = False
# Measured choices (module docstring): Numba's layer, and the OpenMP runtime's waiting, unless the user set them
LAYER = "omp"
WAITING = {"OMP_WAIT_POLICY": "PASSIVE"}


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def pool_size() -> int:
    """The most threads Numba's pool can run (NUMBA_NUM_THREADS, fixed when Numba loads)."""
    from numba import config

    return int(config.NUMBA_NUM_THREADS)


def checked(count, what: str = "num_threads") -> int:
    """`count` (an integer, or its digits as text) as a thread count, or an ArgumentError saying what works."""
    try:
        value = int(count) if isinstance(count, str) else operator.index(count)
    except (TypeError, ValueError):
        value = None
    if isinstance(count, bool) or value is None or value < 1:
        raise ArgumentError(f"{what} must be a positive whole number of threads, got {count!r}")
    return value


def get_num_threads() -> int:
    """The thread count of modules created without their own: set_num_threads, else ODTRAIN_NUM_THREADS,
    else the cores this process may run on (at most Numba's pool)."""
    if _process_default is not None:
        return _process_default
    requested = os.environ.get(ENVIRONMENT)
    if requested is not None and requested.strip():
        return checked(requested.strip(), ENVIRONMENT)
    return min(available_cores(), pool_size())


def set_num_threads(count: int) -> None:
    """Use `count` threads in the steps of modules created without num_threads (from their next step)."""
    global _process_default
    _process_default = checked(count)


@contextlib.contextmanager
def process_default(count, what: str = "--threads"):
    """set_num_threads(count) for the duration of a `with` block (nothing when count is None)."""
    global _process_default
    previous = _process_default
    if count is not None:
        _process_default = checked(count, what)
    try:
        yield
    finally:
        _process_default = previous


def configure() -> None:
    """Once per process, before the first step: BLAS on one thread, Numba's threading layer and how its
    idle threads wait (the environment of the OpenMP runtime, read when it loads)."""
    global _configured
    if _configured:
        return
    set_blas_threads(1)
    from numba import config

    if "NUMBA_THREADING_LAYER" not in os.environ:
        config.THREADING_LAYER = LAYER
    for name, value in WAITING.items():
        os.environ.setdefault(name, value)
    _configured = True


def use(count: int) -> int:
    """Run this Python thread's parallel regions on `count` threads (at most Numba's pool: a step bound
    for more threads runs its parts on fewer, with the same result); returns the count it had."""
    from numba import get_num_threads as numba_threads, set_num_threads as set_numba_threads

    previous = numba_threads()
    count = min(count, pool_size())
    if previous != count:
        set_numba_threads(count)
    return previous
