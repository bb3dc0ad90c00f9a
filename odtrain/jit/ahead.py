"""Compiling a bound step's Numba kernels before its first run, and saying so when they really compile.

Without a kernel library (odtrain/kernel_library/) every call of a step runs a Numba dispatcher, which
compiles its kernel at the first call, or loads it from the cache (odtrain/jit/cache.py). `compile_ahead` does
that at bind time instead, so that a note can come first: a cold cache holds a step for seconds to
minutes, and the user is told why and what does it ahead. Cache loads say nothing.
"""
from __future__ import annotations

import contextlib

_silenced = False  # within silenced(): the note is not said
FALLBACK_MESSAGE = "compiling {count} kernels for this model (once; `odtrain compile` or `odtrain warmup` does it ahead)"


@contextlib.contextmanager
def silenced():
    """Within the block, compiling says nothing: `odtrain compile` records steps, and its user asked for the
    compile that the note would advise."""
    global _silenced
    previous, _silenced = _silenced, True
    try:
        yield
    finally:
        _silenced = previous


def compile_ahead(calls) -> None:
    """Compile, or load from the cache, the Numba kernels of a bound step's (kernel, args) calls now, before
    the step first runs. When one of them really compiles (a cache miss: Numba's "numba:compile" event), say
    once, on stderr and in the progress line drawn now, how many kernels this model may still compile
    (FALLBACK_MESSAGE; the count is of the kernels not compiled yet in this process,
    from the first that missed the cache on). A kernel that fails to compile here is left for its call to
    report, naming its node, as it would without this."""
    from numba import typeof
    from numba.core import event

    pending, seen = [], set()
    for kernel, args in calls:
        if not hasattr(kernel, "overloads"):  # a Python function (a library call, an optimizer update)
            continue
        try:
            signature = tuple(typeof(a) for a in args)
        except ValueError:
            continue
        if signature not in kernel.overloads and (kernel, signature) not in seen:
            seen.add((kernel, signature))
            pending.append((kernel, signature))
    if not pending:
        return
    listener = _first_compile_listener()
    with event.install_listener("numba:compile", listener):
        for index, (kernel, signature) in enumerate(pending):
            listener.remaining = len(pending) - index
            try:
                kernel.compile(signature)
            except Exception:  # the call itself raises it, with the node's name
                pass


def _first_compile_listener():
    from numba.core import event
    from ..progress import announce

    class FirstCompile(event.Listener):
        """Says FALLBACK_MESSAGE at the first kernel that compiles (cache loads are not compiles)."""

        remaining, said = 0, False

        def on_start(self, ev) -> None:
            if not self.said and not _silenced:
                self.said = True
                announce(f"odtrain: {FALLBACK_MESSAGE.format(count=self.remaining)}")

        def on_end(self, ev) -> None:
            pass

    return FirstCompile()
