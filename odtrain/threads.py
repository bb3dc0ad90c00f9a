"""How many threads a step uses: every core this process may run on, unless asked otherwise.

One setting drives every thread of a step, looked up in this order:
- `Module(..., num_threads=n)`, for that module;
- `set_num_threads(n)`, the process default for modules created without one;
- the environment variable ODTRAIN_NUM_THREADS=n;
- otherwise the cores this process may run on (`os.sched_getaffinity`), at most Numba's pool
  (NUMBA_NUM_THREADS, fixed when Numba loads).
A count above the pool is allowed: the step is split for that many threads and runs on the pool,
giving the same bits as on a machine with that many cores.

How threads are used: a parallel kernel splits its outer loop (batch, channels, rows) into
`threads` parts, each with its own scratch in the arena, inside one Numba parallel region; a step
binds its kernels for its thread count and runs with Numba's pool at that count
(`numba.set_num_threads` is per calling thread, so modules in different Python threads keep their
own). BLAS (numpy's bundled OpenBLAS, which the products call; scipy's through Numba where numpy
carries none) runs one thread: products run inside the regions, already split, so threads never
multiply, and OpenBLAS's own pool, whose idle threads spin, never runs.

Numba's threading layer is chosen on purpose, by `configure()` before the pool starts (unless
the user chose one with NUMBA_THREADING_LAYER): OpenMP (libgomp), with OMP_WAIT_POLICY=PASSIVE and
GOMP_SPINCOUNT=SPIN_COUNT set before libgomp loads (unless the user set either): a thread waiting
for the next region spins a while, then sleeps. Why (`benchmarks/threads.py regions` times one
2-thread region after a gap of serial work, per layer and policy):
- a spinning thread starts the next region about as fast as a call, and a step's regions follow
  each other within the spin; but a loop that sleeps between steps pays a wake-up once a step;
- passive waiting alone pays the wake-up at every region, an order of magnitude more than a spin,
  which a model of many regions (MobileNetV2) feels in its step (`benchmarks/threads.py neighbour`);
- libgomp's default spin is long enough to collapse a step beside a busy process;
- Numba's workqueue layer (condition variables, never spins) pays more than passive waiting.
Spinning costs only when the cores are shared: a spinning thread spends a neighbour's share, and a
part that waits for a core holds up its region. So a step runs its parts on the cores other
processes leave free (`Neighbours`, read from /proc/stat every LOAD_WINDOW): beside one busy
process it runs them on the free cores, about as fast as the one-thread step, where spinning on
every core would take twice as long (`benchmarks/threads.py neighbour --pinned`). The parts stay
those the step was bound for, so the bits do not depend on the load.
Thread safety: odtrain's kernels hold the GIL, so two modules trained in two Python threads take
turns kernel by kernel on either layer (tests/test_threads.py; while two steps run at once, each
runs its parts on one thread, so no team spins while the other works), but two regions at once, e.g.
another library's nogil parallel kernels in another thread, terminate the process under
workqueue ("Concurrent access has been detected"; measured), where OpenMP gives each calling
thread its own team. TBB is not installed here (and has no aarch64 wheel).
If libgomp was loaded before odtrain with its default policy (it reads it once), the workqueue
layer is used instead. GNU OpenMP does not survive fork(): a child forked after its parent ran a
region runs its steps on one thread.

With one thread every kernel runs its serial code and a run is bit-for-bit reproducible. With
n threads a run is reproducible too (the parts are fixed at bind time, partial sums are added
in part order), but differs from another thread count in rounding (README.md, "Threads").
"""
from __future__ import annotations

import contextlib
import operator
import os
import sys
import threading
import time

from .graph.errors import ArgumentError

ENVIRONMENT = "ODTRAIN_NUM_THREADS"
# libgomp's spin before a waiting thread sleeps (GOMP_SPINCOUNT, iterations of a pause instruction): long
# enough that the regions of one step follow each other within it, so a spinning thread starts the next one
# instead of being woken; short enough that a step beside a busy process does not collapse. Only while this
# process has the cores to itself (NEIGHBOURS). benchmarks/threads.py regions measures it.
SPIN_COUNT = 10000
LOAD_WINDOW = 0.25  # seconds: how long the machine's load is measured over before it is read again
_process_default: int | None = None
_configured = False
_fork_guarded = False
_forked_from_openmp = False


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def pool_size() -> int:
    """The most threads Numba's pool (or the kernel library's) can run: NUMBA_NUM_THREADS, fixed when Numba
    loads, else every core of the machine, as Numba counts them."""
    if "numba" not in sys.modules:  # a process running the kernel library only
        requested = os.environ.get("NUMBA_NUM_THREADS", "").strip()
        return int(requested) if requested.isdigit() and int(requested) > 0 else max(1, os.cpu_count() or 1)
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
    """Once per process, before the first JIT step (odtrain.jit.load, which also sets the JIT's BLAS to one
    thread): Numba's threading layer (OpenMP with passive waiting, see the module docstring) unless the user
    chose one, and the fork guard."""
    global _configured
    if _configured:
        return
    from numba import config

    if "NUMBA_THREADING_LAYER" not in os.environ and config.THREADING_LAYER == "default":
        if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ or not _openmp_loaded():
            if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
                os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)  # both read once, when libgomp loads
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            config.THREADING_LAYER_PRIORITY = ["omp", "workqueue", "tbb"]
        else:  # an OpenMP runtime that already read its (spinning) wait policy: the passive layer instead
            config.THREADING_LAYER_PRIORITY = ["workqueue", "omp", "tbb"]
    _guard_fork()
    _configured = True


def configure_without_compiler() -> None:
    """configure() for a process whose kernels run in the kernel library (odtrain/kernel_library/): its
    OpenMP waits as Numba's omp layer would here (spin, then sleep), set before libgomp loads; the fork guard."""
    if not _openmp_loaded() and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _guard_fork()


def _guard_fork() -> None:
    global _fork_guarded
    if not _fork_guarded:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_guarded = True


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
    if "numba" not in sys.modules:  # the kernel library runs its regions serially itself after a fork
        return
    from numba.np.ufunc import parallel

    if parallel._is_initialized and parallel.threading_layer() == "omp":
        _forked_from_openmp = True


def usable(count: int) -> int:
    """The thread count a step may use in this process: `count`, or 1 in a child forked from OpenMP."""
    return 1 if _forked_from_openmp else count


def use(count: int) -> int:
    """Run this Python thread's parallel regions on `count` threads (at most Numba's pool: a step bound
    for more threads runs its parts on fewer, with the same result); returns the count it had."""
    if "numba" not in sys.modules:  # no JIT kernel runs: the kernel library takes the count per step
        return count
    from numba import get_num_threads as numba_threads, set_num_threads as set_numba_threads

    previous = numba_threads()
    count = min(count, pool_size())
    if previous != count:
        set_numba_threads(count)
    return previous


def _busy_seconds(cpus) -> float | None:
    """CPU seconds the CPUs `cpus` have spent busy since boot (user, nice, system, irq, softirq and steal
    time in /proc/stat), or None where the file or one of those CPUs is missing."""
    try:
        with open("/proc/stat", "rb") as stat:
            lines = stat.read().splitlines()
    except OSError:
        return None
    ticks, seen = 0, 0
    for line in lines:
        if line.startswith(b"cpu") and line[3:4].isdigit():
            fields = line.split()
            if int(fields[0][3:]) in cpus and len(fields) >= 9:
                user, nice, system, _, _, irq, softirq, steal = (int(value) for value in fields[1:9])
                ticks += user + nice + system + irq + softirq + steal
                seen += 1
    return ticks / os.sysconf("SC_CLK_TCK") if seen == len(cpus) else None


def _reading():
    """(wall seconds, busy CPU seconds of this process's cores, CPU seconds of this process, how many cores
    it may run on), or None."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return None
    busy = _busy_seconds(cpus)
    return None if busy is None else (time.monotonic(), busy, time.process_time(), len(cpus))


class Neighbours:
    """How many threads a step may run now: the cores this process may run on that other processes leave
    free, read from /proc/stat at most every LOAD_WINDOW seconds (the CPU time the machine spent busy on
    those cores, less this process's own).

    A step bound for n parts runs them on min(n, cores left free, rounded) threads, and on one thread
    while another step of this process runs in another Python thread: a busy neighbour then costs a step
    about what it costs one thread, instead of a waiting thread's spin or a part that waits for a core
    (measured in benchmarks/threads.py neighbour). The parts stay those bound, so the results are the same
    bits on any number of threads. Without /proc/stat every step runs its n threads."""

    def __init__(self, read=_reading, clock=time.monotonic):
        self._read, self._clock = read, clock
        self._lock = threading.Lock()
        self._last = None  # the last reading
        self._readable = True
        self.others = 0.0  # cores other processes kept busy over the last window
        self._steps = 0  # steps running in this process now

    def enter(self, count: int) -> int:
        """A step bound for `count` parts starts: the threads it may run on now."""
        with self._lock:
            self._steps += 1
            if self._steps > 1:
                return 1
            if self._readable and (self._last is None or self._clock() - self._last[0] >= LOAD_WINDOW):
                self._measure()
            if self._last is None:
                return count
            return max(1, min(count, int(self._last[3] - self.others + 0.5)))

    def _measure(self) -> None:
        """A new reading; the load over the window since the last one (measured anew when the cores changed)."""
        now = self._read()
        if now is None:
            self._readable, self._last = False, None
            return
        if self._last is not None and now[3] == self._last[3]:
            wall, busy, own = (a - b for a, b in zip(now[:3], self._last[:3]))
            self.others = max(0.0, busy - own) / max(wall, 1e-9)
        self._last = now

    def leave(self) -> None:
        with self._lock:
            self._steps -= 1


NEIGHBOURS = Neighbours()


@contextlib.contextmanager
def running(count: int):
    """For the duration of a step bound for `count` parts (count > 1): Numba's pool at the threads the
    machine leaves free now (Neighbours); yields that count."""
    threads = min(NEIGHBOURS.enter(count), pool_size())
    try:
        previous = use(threads)
        try:
            yield threads
        finally:
            use(previous)
    finally:
        NEIGHBOURS.leave()
