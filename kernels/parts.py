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

# Below this many multiply-adds (or elements) a parallel region costs more than it saves. Measured here: a
# 2-thread region with passive waiting (odtrain/threads.py) costs 12-16 µs back to back on a busy machine;
# the cheapest kernel, a float32 add, takes 13 µs for 2^16 elements and 29 µs for 2^17 on one thread, so
# from 2^17 elements half the work saves about what the region costs
MIN_PARALLEL_WORK = 1 << 17


def part_count(threads: int, units: int, work: int) -> int:
    """How many parts to split `units` independent pieces of `work` (total) into, at `threads` threads."""
    if threads <= 1 or units <= 1 or work < MIN_PARALLEL_WORK:
        return 1
    return int(min(threads, units))


def part_bounds(units: int, parts: int) -> np.ndarray:
    """Balanced boundaries: part p covers [bounds[p], bounds[p + 1])."""
    return (np.arange(parts + 1, dtype=np.int64) * int(units)) // int(parts)
