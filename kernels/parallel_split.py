"""How a parallel kernel splits its work, and the one table of kernels and their parallel twins.

The one rule: a kernel `_x` that runs in parallel has one twin, registered by `@twin_of(_x, ...)` (TWINS),
that runs `_x` on fixed parts of an independent outer loop (images, channels, rows, elements) in one Numba
parallel region. The twin takes `_x`'s arguments, with
- `_x`'s trailing range of units (`range`: the names of its first and last unit, or of two such ranges)
  left out,
- `_x`'s work memory (`replaces`) swapped, where it stands, for the twin's own arguments (`takes`: its
  per-part memory and what cutting it needs; with nothing replaced, `takes` come after `_x`'s arguments),
- then `bounds`, int64 [parts + 1]: part p runs units [bounds[p], bounds[p + 1]).
A binding builds the serial call over all its units and hands it to the one chooser, which returns that
call itself at one part (exactly as with one thread), else the twin's call:
- `split(call, units, work, threads, takes)`: the parts from part_count;
- `on_parts(call, units, parts, takes)`: parts the binding's layout fixed already (its scratch sizes, or
  its units, depend on them).
`takes` is the twin's own arguments, or a function of the parts that gives them.

Most twins are one parallel loop over the parts calling `_x` on its units, given by `_x`'s range or by
cutting its flat arrays: such a twin is written from its record, `_x_parts = parallel_twin(_x, range=...)`
or `parallel_twin(_x, sliced=(array names))` (twin_source is its text), and compiled as part of `_x`'s
file and module so that Numba caches it on disk like a twin written out. Where a unit is several elements
of the cut arrays (a row of `n·inner` values), `unit=("n", "inner")` scales the cut and `count="outer"`
gives `_x` the part's number of units. A twin that does more per part (its own work memory, partial sums
added in part order, a check before the parts) is written out under `@twin_of(..., because=...)`, the
reason it cannot be written from a record.

- `part_count(threads, units, work)`: 1 when there is one thread, one unit, or too little work to pay for a
  parallel region (`worth_parallel`); else min(threads, units).
- `every_split()`: while the kernel library records a model's calls (odtrain/library_build/record.py), any work is
  worth a parallel region, so that each call whose units could split at some input size is recorded as
  its twin's call too: the library then holds the kernels a larger batch or sequence splits into.
- `part_bounds(units, parts)`: balanced boundaries; part p runs units [bounds[p], bounds[p + 1]).

Each part runs the serial kernel on its range with its own scratch. The parts are fixed when a step is
bound, not by the threads that happen to run them, and partial sums are added in part order: a run at a
given thread count gives the same bits every time.

TWINS (serial kernel -> Twin) is the one table of kernels and their twins: the kernel library's build
(odtrain/library_build/) and tests/test_twins.py read it. Imports numpy only: a written twin is compiled
by the njit of its serial kernel's module, like that module's own kernels, so this rule sits on the ground
floor of kernels/ and the base modules that build calls (copies.py) may use it.
"""
from __future__ import annotations

import numpy as np

# Below this many multiply-adds (or elements) a parallel region costs more than it saves: with odtrain's waiting
# (a short spin, then sleep, odtrain/threads.py) a region within a step costs about a small elementwise loop,
# and from this size on a float32 add runs faster in 2 parts than on one thread (`benchmarks/threads.py
# regions`, bench_ops.ElementwiseOps; the runs: benchmarks/README.md, "Figures behind kernel choices"). The
# cost: more kernels run their parallel twins, compiled too on a cold cache (`odtrain warmup` compiles them
# ahead).
MIN_PARALLEL_WORK = 1 << 15
_every_split = False  # while every_split(): any amount of work is split


def worth_parallel(work: int, minimum: int | None = None) -> bool:
    """Whether `work` pays for a parallel region (at least `minimum`, by default MIN_PARALLEL_WORK read at the
    call, so that a test may lower it; anything within every_split())."""
    return _every_split or work >= (MIN_PARALLEL_WORK if minimum is None else minimum)


def splitting_everything() -> bool:
    """Whether every_split() is in force (the kernel library recording the twins a larger input runs)."""
    return _every_split


class every_split:
    """Within the block (`with every_split():`), every call that has more than one unit and more than one thread
    splits, whatever its work (the kernel library's recording: the twins a larger input would run)."""

    def __enter__(self):
        global _every_split
        self._previous, _every_split = _every_split, True
        return self

    def __exit__(self, *exc):
        global _every_split
        _every_split = self._previous
        return False


def part_count(threads: int, units: int, work: int) -> int:
    """How many parts to split `units` independent pieces of `work` (total) into, at `threads` threads."""
    if threads <= 1 or units <= 1 or not worth_parallel(work):
        return 1
    return int(min(threads, units))


def part_bounds(units: int, parts: int) -> np.ndarray:
    """Balanced boundaries: part p covers [bounds[p], bounds[p + 1])."""
    return (np.arange(parts + 1, dtype=np.int64) * int(units)) // int(parts)


def parameters(kernel) -> tuple[str, ...]:
    """A kernel's parameter names."""
    code = kernel.py_func.__code__
    return code.co_varnames[:code.co_argcount]


class Twin:
    """A serial kernel, its parallel twin, and how the twin's arguments follow from the serial call's
    (`written`: the twin was written from this record by `parallel_twin`; `sliced`: then the arrays each
    part cuts to its units, `unit` the arguments whose product is a unit's elements, `count` the argument that
    takes the part's number of units; `because`: why a twin written out could not be written from a record)."""

    __slots__ = ("serial", "parallel", "range", "replaces", "takes", "sliced", "unit", "count", "written", "because")

    def __init__(self, serial, parallel, range: tuple[str, ...], replaces: tuple[str, ...], takes: tuple[str, ...],
                 sliced: tuple[str, ...] = (), written: bool = False, unit: tuple[str, ...] = (), count: str = "",
                 because: str = ""):
        self.serial, self.parallel = serial, parallel
        self.range, self.replaces, self.takes = tuple(range), tuple(replaces), tuple(takes)
        self.sliced, self.written, self.unit, self.count = tuple(sliced), written, tuple(unit), count
        self.because = because

    def parameters(self) -> tuple[str, ...]:
        """The twin's parameter names as the rule derives them from the serial kernel's."""
        names = list(parameters(self.serial))
        names = names[:len(names) - len(self.range)]
        if self.replaces:
            first = names.index(self.replaces[0])
            names[first:first + len(self.replaces)] = self.takes
        else:
            names += self.takes
        return tuple(names) + ("bounds",)

    def arguments(self, args: tuple, takes: tuple, bounds: np.ndarray) -> tuple:
        """The twin's arguments from the serial call's `args`, its own `takes` and the parts' `bounds`."""
        if len(takes) != len(self.takes):
            raise ValueError(f"{self.parallel.__name__} takes {', '.join(self.takes) or 'nothing'} of its own; "
                             f"given {len(takes)} values")
        args = args[:len(args) - len(self.range)]
        if self.replaces:
            first = parameters(self.serial).index(self.replaces[0])
            args = args[:first] + tuple(takes) + args[first + len(self.replaces):]
        else:
            args = args + tuple(takes)
        return args + (bounds,)


TWINS: dict = {}  # serial kernel -> Twin


def twin_of(serial, range: tuple[str, ...] = (), replaces: tuple[str, ...] = (), takes: tuple[str, ...] = (),
            because: str = ""):
    """Register the decorated kernel, written out, as `serial`'s parallel twin (the one rule above); `because`:
    in a line, what it does that parallel_twin cannot write (tests/test_twins.py asks for it)."""

    def register(parallel):
        TWINS[serial] = Twin(serial, parallel, range, replaces, takes, because=because)
        return parallel

    return register


# The options of every parallel twin's kernel.
TWIN_OPTIONS = {"cache": True, "error_model": "numpy", "parallel": True}


def twin_source(serial, range: tuple[str, ...] = (), sliced: tuple[str, ...] = (), unit: tuple[str, ...] = (),
                count: str = "") -> str:
    """The source of the twin that most serial kernels have, which `parallel_twin` compiles: one Numba
    parallel loop over the parts, each calling `serial` on its units, given either as `serial`'s trailing
    `range` (its first and last unit) or by cutting the flat arrays named in `sliced` to them: a unit is one
    element of them, or the product of the arguments named in `unit` (a row of n·inner values), and the
    argument named `count` then receives the part's number of units."""
    name, names = serial.__name__, parameters(serial)
    kept = names[:len(names) - len(range)]
    if range:
        if len(range) != 2 or sliced or unit or count:
            raise ValueError(f"{name}: a written twin takes one range of units (first, last) or sliced arrays")
        arguments = kept + ("bounds[p]", "bounds[p + 1]")
    else:
        unknown = sorted(set(sliced) - set(kept))
        if not sliced or unknown:
            raise ValueError(f"{name}: its twin must cut some of its arrays to the parts ({unknown or 'none'} given)")
        if bool(unit) != bool(count) or not set(unit) | {count} <= set(kept) | {""} or count in sliced:
            raise ValueError(f"{name}: a unit of several elements ({unit}) goes with the argument counting the "
                             f"units ({count or 'none'}), both among its parameters")
        scale = "".join(f" * {n}" for n in unit)
        arguments = tuple(f"{n}[bounds[p]{scale}:bounds[p + 1]{scale}]" if n in sliced
                          else "bounds[p + 1] - bounds[p]" if n == count else n for n in kept)
    return (f"def {name}_parts({', '.join(kept + ('bounds',))}):\n"
            f"    for p in prange(bounds.size - 1):\n"
            f"        {name}({', '.join(arguments)})\n")


def parallel_twin(serial, range: tuple[str, ...] = (), sliced: tuple[str, ...] = (), unit: tuple[str, ...] = (),
                  count: str = ""):
    """`serial`'s parallel twin `<serial>_parts`, written from its Twin record (twin_source), registered in
    TWINS and returned, for the module to bind under that name.

    The function is compiled as part of `serial`'s file and module: its globals are the module's (prange,
    `serial`) and its code names that file, at `serial`'s first line, so Numba's on-disk cache keeps it
    beside the module's other kernels and stamps it with that file (a function without a file cannot be
    cached), and what reads a kernel's source finds `serial`'s; it is compiled by that module's njit, with the
    options of every twin (TWIN_OPTIONS)."""
    function = serial.py_func
    namespace, name = function.__globals__, f"{serial.__name__}_parts"
    if (namespace.get(serial.__name__) is not serial or name in namespace or "prange" not in namespace
            or "njit" not in namespace):
        raise ValueError(f"{name}: the twin is written in {serial.__name__}'s module (which imports njit and prange "
                         "from .jit), under a name of its own")
    lines = "\n" * (function.__code__.co_firstlineno - 1)
    scratch = {}
    exec(compile(lines + twin_source(serial, range, sliced, unit, count), function.__code__.co_filename, "exec"),
         namespace, scratch)
    written = scratch[name]
    written.__doc__ = (f"{serial.__name__} on parts of its units (bounds), in parallel: written from its Twin "
                       "record (kernels/parallel_split.py, parallel_twin).")
    parallel = namespace["njit"](**TWIN_OPTIONS)(written)
    TWINS[serial] = Twin(serial, parallel, range, (), (), sliced, written=True, unit=unit, count=count)
    return parallel


def on_parts(call: tuple, units: int, parts: int, takes=()) -> tuple:
    """`call` (serial kernel, args over all `units`) itself at one part, else its twin's call on `parts`
    fixed parts of the units; `takes`: the twin's own arguments, or a function of the parts giving them."""
    if parts == 1:
        return call
    kernel, args = call
    twin = TWINS.get(kernel)
    if twin is None:
        raise KeyError(f"{getattr(kernel, '__name__', kernel)} has no parallel twin (kernels/parallel_split.py, twin_of)")
    return twin.parallel, twin.arguments(args, takes(parts) if callable(takes) else takes, part_bounds(units, parts))


def split(call: tuple, units: int, work: int, threads: int, takes=()) -> tuple:
    """`call` itself, or its twin's call on part_count(threads, units, work) parts of its `units`."""
    return on_parts(call, units, part_count(threads, units, work), takes)
