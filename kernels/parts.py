"""How a parallel kernel splits its work: `parts` ranges of an independent outer loop (images, channels,
rows), run in one Numba parallel region.

- `part_count(threads, units, work)`: 1 (the serial kernel, exactly as with one thread) when there is one
  thread, one unit, or too little work to pay for a parallel region; else min(threads, units).
- `part_bounds(units, parts)`: int64 [parts + 1], balanced; part p runs units [bounds[p], bounds[p + 1]).

Each part runs the serial kernel on its range with its own scratch. The parts are fixed when a step is
bound, not by the threads that happen to run them, and partial sums are added in part order: a run at a
given thread count gives the same bits every time.
"""
from __future__ import annotations

import numpy as np

# Below this many multiply-adds (or elements) a parallel region costs more than it saves. Measured here (2 cores,
# passive waiting, odtrain/threads.py): a 2-thread region costs 12-20 µs back to back, 30-85 µs after the
# threads idle; the cheapest kernel, a float32 add, on 2^16 / 2^18 / 2^20 elements: 13.5 / 48.8 / 272 µs on
# one thread, 26.5 / 49.4 / 142.5 µs in 2 parts. From 2^18 every kernel gains or breaks even.
MIN_PARALLEL_WORK = 1 << 18


def part_count(threads: int, units: int, work: int) -> int:
    """How many parts to split `units` independent pieces of `work` (total) into, at `threads` threads."""
    if threads <= 1 or units <= 1 or work < MIN_PARALLEL_WORK:
        return 1
    return int(min(threads, units))


def part_bounds(units: int, parts: int) -> np.ndarray:
    """Balanced boundaries: part p covers [bounds[p], bounds[p + 1])."""
    return (np.arange(parts + 1, dtype=np.int64) * int(units)) // int(parts)
