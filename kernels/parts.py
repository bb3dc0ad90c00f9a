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

# Below this many multiply-adds (or element updates) a parallel region costs more than it saves: a region
# costs 2-3 µs with hot threads and 10-25 µs after they idle, and ~2^16 float32 multiply-adds take ~10 µs
MIN_PARALLEL_WORK = 1 << 16


def part_count(threads: int, units: int, work: int) -> int:
    """How many parts to split `units` independent pieces of `work` (total) into, at `threads` threads."""
    if threads <= 1 or units <= 1 or work < MIN_PARALLEL_WORK:
        return 1
    return int(min(threads, units))


def part_bounds(units: int, parts: int) -> np.ndarray:
    """Balanced boundaries: part p covers [bounds[p], bounds[p + 1])."""
    return (np.arange(parts + 1, dtype=np.int64) * int(units)) // int(parts)
