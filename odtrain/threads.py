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
the user chose one with NUMBA_THREADING_LAYER): OpenMP (libgomp), with OMP_WAIT_POLICY=PASSIVE
set before libgomp loads, so that threads waiting for the next region sleep instead of spinning.
Measured on this 2-core VM (benchmarks/threads.py regions, medians of 3 processes), one 2-thread
region, back to back / after 1 ms idle / after 10 ms idle:
- OpenMP, passive waiting: 18 / 30 / 85 µs on a near-quiet machine; 12 / 19 / 55 µs on a busy one;
- OpenMP, libgomp's default spinning: 2.6 / 9.3 / 97 µs near-quiet, but 12 ms / 24 ms / 19 ms busy:
  spinning threads spend their share of the cores, then wait for it;
- Numba's workqueue layer (condition variables, never spins): 57 / 106 / 182 µs near-quiet;
- GOMP_SPINCOUNT=1000 or 5000 without a policy: 58 or 255 µs back to back (the wait spins out).
A whole cnn training step at 2 threads on the busy machine took 1.11x the one-thread step with
passive waiting, 5.65x with libgomp's default spinning.
Thread safety: odtrain's kernels hold the GIL, so two modules trained in two Python threads take
turns kernel by kernel on either layer (tests/test_threads.py), but two regions at once, e.g.
another library's nogil parallel kernels in another thread, terminate the process under
workqueue ("Concurrent access has been detected"; measured), where OpenMP gives each calling
thread its own team. TBB is not installed here (and has no aarch64 wheel).
If libgomp was loaded before odtrain with its default policy (it reads it once), the workqueue
layer is used instead. GNU OpenMP does not survive fork(): a child forked after its parent ran a
region runs its steps on one thread.

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
_forked_from_openmp = False


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
    """`count` (a whole number, not a bool) as a thread count, or an ArgumentError saying what works."""
    try:
        value = None if isinstance(count, bool) else operator.index(count)
    except TypeError:
        value = None
    if value is None or value < 1:
        raise ArgumentError(f"{what} must be a positive whole number of threads, got {count!r}")
    return value


def get_num_threads() -> int:
    """The thread count of modules created without their own: set_num_threads, else ODTRAIN_NUM_THREADS,
    else the cores this process may run on (at most Numba's pool)."""
    if _process_default is not None:
        return _process_default
    requested = os.environ.get(ENVIRONMENT, "").strip()
    if requested:
        return checked(int(requested) if requested.isdigit() else requested, ENVIRONMENT)
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
    """Once per process, before the first step: BLAS on one thread, Numba's threading layer (OpenMP with
    passive waiting, see the module docstring) unless the user chose one, and the fork guard."""
    global _configured
    if _configured:
        return
    set_blas_threads(1)
    from numba import config

    if "NUMBA_THREADING_LAYER" not in os.environ and config.THREADING_LAYER == "default":
        if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ or not _openmp_loaded():
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when libgomp loads
            config.THREADING_LAYER_PRIORITY = ["omp", "workqueue", "tbb"]
        else:  # an OpenMP runtime that already read its (spinning) wait policy: the passive layer instead
            config.THREADING_LAYER_PRIORITY = ["workqueue", "omp", "tbb"]
    os.register_at_fork(after_in_child=_after_fork_in_child)
    _configured = True


def _openmp_loaded() -> bool:
    """Whether the OpenMP runtime that Numba's omp layer links (libgomp.so.1) is in the process already."""
    try:
        with open("/proc/self/maps") as maps:
            return any(os.path.basename(line.split()[-1]).startswith("libgomp.so") for line in maps if "/" in line)
    except OSError:
        return False


def _after_fork_in_child() -> None:
    """GNU OpenMP does not survive fork(): Numba terminates a child that enters a parallel region after its
    parent used one. Such a child runs every step on one thread (serial kernels, no region)."""
    global _forked_from_openmp
    from numba.np.ufunc import parallel

    if parallel._is_initialized and parallel.threading_layer() == "omp":
        _forked_from_openmp = True


def usable(count: int) -> int:
    """The thread count a step may use in this process: `count`, or 1 in a child forked from OpenMP."""
    return 1 if _forked_from_openmp else count


def use(count: int) -> int:
    """Run this Python thread's parallel regions on `count` threads (at most Numba's pool: a step bound
    for more threads runs its parts on fewer, with the same result); returns the count it had."""
    from numba import get_num_threads as numba_threads, set_num_threads as set_numba_threads

    previous = numba_threads()
    count = min(count, pool_size())
    if previous != count:
        set_numba_threads(count)
    return previous
