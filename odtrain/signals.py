"""Ctrl-C during a training step completes the step, then interrupts.

A step writes gradients, parameters and moments in several kernel calls;
stopping between two of them would leave the state half updated. Inside
`deferred_interrupt()` a SIGINT is remembered and raised as
KeyboardInterrupt when the block ends, so state is always that of a whole
step. Outside the main thread (where handlers cannot be installed) it does
nothing.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


@contextmanager
def deferred_interrupt():
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
