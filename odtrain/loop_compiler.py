"""A loop's iterations compiled into one Numba function: the body's calls and the copies between them.

odtrain/loops.py runs a body's prebuilt call list once per iteration from Python; at a few
microseconds per call and per copy that is most of a step when the body's work is small (a Mamba
step's [256, 16] element-wise update). Here the whole loop becomes one generated function:

    def run(params...):
        for t in range(trip):                       # or: while the body's condition holds
            feed_i[:] = stream_i[t or trip-1-t]     # scan slices (axis 0, contiguous)
            carried_feed_k[:] = held_k
            k0(a, 2, b, ...); k1(...)               # the body's kernels, as bound
            stream_out_j[t or trip-1-t] = out_j
            held_k[:] = carried_out_k

compiled once per bound body (Numba's dispatchers called from compiled code cost nanoseconds, not
microseconds). A carried value whose feed no other array of the loop lies in stays there instead: copied in
before the first iteration, `carried_feed_k[:] = carried_out_k` after each, `held_k[:] = carried_feed_k` after
the last (one copy an iteration, not two). The arrays are parameters, the body's kernels globals, and the ints and bools of
the calls literals. Only what Numba can call is compiled: kernels that are Numba dispatchers, with
array, number, bool and None arguments, scan streams along a contiguous axis 0. `compile_loop`
returns None otherwise, and the caller keeps its Python loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


# Generated functions by (their text, the kernels they call): a body bound again (an arena that grew,
# a plan evicted and rebound) reuses the function and the machine code Numba compiled for its types.
_COMPILED: dict = {}


@dataclass
class LoopSpec:
    """What one loop does around its body's `calls` ((kernel, args) pairs), each array a flat view:
    - `carried`: (held, feed, out): held → feed before an iteration, out → held after it;
    - `streams_in`: (feed, whole, reverse): feed ← whole[t] (whole: [trip, n]; reverse reads trip-1-t);
    - `streams_out`: (whole, out, reverse): whole[t] ← out;
    - `counter`/`flag`: one-element feeds given the iteration number and the condition, or None;
    - `condition_out`: the body's one-element condition, read after each iteration, or None (the loop
      runs `trip` times);
    - `fused`: a function giving the body as one loop nest (odtrain/body_fusion.py) instead of its calls."""

    calls: list
    carried: list = field(default_factory=list)
    streams_in: list = field(default_factory=list)
    streams_out: list = field(default_factory=list)
    counter: np.ndarray | None = None
    flag: np.ndarray | None = None
    condition_out: np.ndarray | None = None
    fused: object = None  # fused(source) -> the iteration's lines instead of the calls, or None (body_fusion.py)


def flat(array: np.ndarray) -> np.ndarray | None:
    """A 1-D view of a contiguous array's elements, or None when it is not contiguous."""
    return array.reshape(-1) if array.flags.c_contiguous else None


def rows(whole: np.ndarray) -> np.ndarray | None:
    """A [trip, n] view of a stacked value whose slices along axis 0 are contiguous, or None."""
    if not whole.flags.c_contiguous or whole.ndim == 0:
        return None
    return whole.reshape(whole.shape[0], -1)


def _dispatcher(kernel):
    from numba.core.registry import CPUDispatcher

    return kernel if isinstance(kernel, CPUDispatcher) else None


class _Source:
    """The generated function's parameters (arrays and numpy scalars, each once) and globals."""

    def __init__(self):
        self.params: list[str] = []
        self.values: list = []
        self._by_id: dict[int, str] = {}
        self.globals: dict = {"np": np}
        self.kernels = 0

    def array(self, value) -> str:
        name = self._by_id.get(id(value))
        if name is None:
            name = f"a{len(self.params)}"
            self._by_id[id(value)] = name
            self.params.append(name)
            self.values.append(value)
        return name

    def argument(self, value) -> str | None:
        """The text of one call argument, or None when the compiled loop cannot pass it."""
        if value is None:
            return "None"
        if isinstance(value, (bool, np.bool_)):
            return "True" if value else "False"
        if isinstance(value, (int, np.integer)) and not isinstance(value, np.generic):
            return repr(int(value))
        if isinstance(value, (np.ndarray, np.generic, float, int)):
            return self.array(value)
        return None

    def kernel(self, kernel) -> str:
        name = f"k{self.kernels}"
        self.kernels += 1
        self.globals[name] = kernel
        return name


def _keeps_feed(spec: LoopSpec, k: int) -> bool:
    """Whether carried value k's feed may hold it from one iteration to the next: no other array the loop writes
    between the body's end and its next start lies in the feed, nor does its own output but exactly."""
    held, feed, out = spec.carried[k]
    others = [a for j, (h, f, o) in enumerate(spec.carried) if j != k for a in (h, f, o)]
    others += [f for f, _, _ in spec.streams_in] + [w for w, _, _ in spec.streams_out] + [o for _, o, _ in spec.streams_out]
    others += [a for a in (spec.counter, spec.flag, spec.condition_out, held) if a is not None]
    same = out.shape == feed.shape and out.strides == feed.strides and out.ctypes.data == feed.ctypes.data
    return not any(np.may_share_memory(feed, a) for a in others) and (same or not np.may_share_memory(feed, out))


def compile_loop(spec: LoopSpec, trip: int | None):
    """A callable running the loop of `spec` (`trip` iterations at most; None: until the condition turns
    false) in one compiled function, or None when something in it cannot be compiled."""
    try:
        import numba
    except ImportError:
        return None
    if any(a is None for entry in spec.carried + spec.streams_in + spec.streams_out for a in entry[:2]) or \
            any(entry[2] is None for entry in spec.carried):
        return None  # a view that is not contiguous
    source = _Source()
    lines = spec.fused(source) if spec.fused is not None else None
    for kernel, args in spec.calls if lines is None else []:
        dispatcher = _dispatcher(kernel)
        if dispatcher is None:
            return None
        texts = [source.argument(a) for a in args]
        if any(t is None for t in texts):
            return None
        lines = (lines or []) + [f"{source.kernel(dispatcher)}({', '.join(texts)})"]
    carried = [(source.array(h), source.array(f), source.array(o)) for h, f, o in spec.carried]
    streams_in = [(source.array(f), source.array(w), r) for f, w, r in spec.streams_in]
    streams_out = [(source.array(w), source.array(o), r) for w, o, r in spec.streams_out]
    body = []
    if spec.counter is not None:
        body.append(f"{source.array(spec.counter)}[0] = t")
    if spec.flag is not None:
        body.append(f"{source.array(spec.flag)}[0] = going")
    # A carried value whose feed nothing else in the loop writes stays in its feed between iterations: its
    # output is copied there after each, and to the holder once, after the last.
    kept = [_keeps_feed(spec, k) for k in range(len(carried))]
    body += [f"{f}[:] = {h}" for (h, f, _), keep in zip(carried, kept) if not keep]
    body += [f"{f}[:] = {w}[{'trip - 1 - t' if r else 't'}]" for f, w, r in streams_in]
    body += lines or []
    body += [f"{w}[{'trip - 1 - t' if r else 't'}] = {o}" for w, o, r in streams_out]
    body += [f"{f if keep else h}[:] = {o}" for (h, f, o), keep in zip(carried, kept)]
    if spec.condition_out is not None:
        body.append(f"going = {source.array(spec.condition_out)}[0]")
    body.append("t += 1")
    text = [f"def loop(trip, going, {', '.join(source.params)}):", "    t = 0"] + \
        [f"    {f}[:] = {h}" for (h, f, _), keep in zip(carried, kept) if keep] + \
        ["    while going and (trip < 0 or t < trip):"] + [f"        {line}" for line in body] + \
        [f"    {h}[:] = {f}" for (h, f, _), keep in zip(carried, kept) if keep]
    key = ("\n".join(text), tuple(id(k) for name, k in sorted(source.globals.items()) if name != "np"))
    compiled = _COMPILED.get(key)
    if compiled is None:  # the same text over the same kernels: the function compiled for an earlier binding
        namespace = dict(source.globals)
        exec(compile(key[0], "<odtrain compiled loop>", "exec"), namespace)  # noqa: S102 (our own text)
        compiled = _COMPILED[key] = numba.njit(error_model="numpy")(namespace["loop"])
    values = source.values
    limit = -1 if trip is None else int(trip)

    def run(going: bool = True) -> None:
        compiled(limit, bool(going), *values)

    return run
