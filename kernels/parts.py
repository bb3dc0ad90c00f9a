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
# odtrain's waiting: a short spin, then sleep, odtrain/threads.py): a 2-thread region within a step costs ~2 µs
# (43-54 µs when its threads slept); a float32 add after some serial work, 2^12 / 2^15 / 2^18 elements: 5.7 /
# 41.6 / 209 µs on one thread, 4.5 / 22.7 / 85.5 µs in 2 parts. MobileNetV2 at batch 8 (batch norms over 6x6
# and 3x3 planes, ~2^17-2^18 elements): 2-thread step 39.9 ms at 2^18, 36.0 at 2^15 (profile medians). The cost:
# more kernels run their parallel twins, compiled too on a cold cache (the transformer's first step 12.0 -> 17.3
# s, the CNN's 52.6 -> 55.0 s; `odtrain warmup` compiles them ahead).
MIN_PARALLEL_WORK = 1 << 15


def part_count(threads: int, units: int, work: int) -> int:
    """How many parts to split `units` independent pieces of `work` (total) into, at `threads` threads."""
    if threads <= 1 or units <= 1 or work < MIN_PARALLEL_WORK:
        return 1
    return int(min(threads, units))


def part_bounds(units: int, parts: int) -> np.ndarray:
    """Balanced boundaries: part p covers [bounds[p], bounds[p + 1])."""
    return (np.arange(parts + 1, dtype=np.int64) * int(units)) // int(parts)
