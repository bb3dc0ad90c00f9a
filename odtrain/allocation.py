"""The arena of a plan, or a MemoryBudgetError before any work when the machine cannot hold it.

`allocate(plan, what, advice)` returns the plan's arena buffer (ALIGNMENT-aligned), or raises a
MemoryBudgetError that says the plan's size, its largest values with the nodes that write them, and
`advice(bytes)`: the memory_budget that fits those bytes by recomputing activations, or that none does.

- A plan larger than the most memory this process can ever hold (`memory_limit`: physical memory, or
  a container's or `ulimit -v`'s lower limit) is refused without trying: Linux may grant such a
  request lazily and kill the process when a step first touches the pages.
- Below that limit the allocation is tried, and numpy's MemoryError (memory others hold) becomes the
  same error, advised against the memory free at that moment.

`auto_budget(mapped, arena)`: the arena budget that memory_budget="auto" stands for, taken when a training
step is first planned at an input shape:
    available + arena - mapped - reserve
- available: MemAvailable (/proc/meminfo: what the kernel estimates a new workload can take without
  swapping, reclaimable page cache included), or less when a cgroup the process is in leaves less
  (memory.max - memory.current, or v1's limit less its usage, its unmapped page cache left out of the use
  but not its shared memory; `cgroup_memory`: the process's own cgroup and its ancestors, so a systemd
  service's MemoryMax or a container's limit counts);
- arena: the shared arena already held (a new plan replaces it, so its bytes are the plan's to use);
- mapped: the parameters that are views of the checkpoint file (frozen weights): MemAvailable counts their
  pages as reclaimable cache, yet every step reads all of them, so they must stay resident;
- reserve: an eighth of what is available, at least RESERVE_FLOOR: what the process adds besides the arena
  (a kernel's first compilation where the JIT runs, whose LLVM memory benchmarks/README.md gives under
  "Figures moved out of the code"; the plans' Python objects; a batch's feeds) and room for the rest of the
  device, so that the step does not push the machine into reclaim.
A budget at or below 0 is a MemoryBudgetError naming these figures. When no plan fits the budget, the
step is refused in those terms (`auto_shortfall`), or, when even the smallest plan is more than the process
can ever hold, as a plan without a budget is (`allocate`: the machine's limit and the largest values).
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from .graph.errors import MemoryBudgetError
from .graph.planner import ALIGNMENT, MemoryPlan

LARGEST_SHOWN = 3
CGROUP_ROOT = "/sys/fs/cgroup"
# the files of a memory cgroup that hold its limit and its use: cgroup v2, and v1's memory controller
_CGROUP_V2, _CGROUP_V1 = ("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")


def format_bytes(nbytes: int) -> str:
    """A size in the largest binary unit it reaches, e.g. '1.50 MiB'."""
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:,} B"


def memory_limit() -> tuple[int, str] | None:
    """(bytes, what sets them): the most memory this process can hold, or None when nothing says."""
    limits = []
    try:
        limits.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"))
    except (AttributeError, ValueError, OSError):
        pass
    for limit, _, path in cgroup_memory():
        limits.append((limit, f"this container's memory limit ({path})"))
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            limits.append((soft, "this process's address-space limit (ulimit -v)"))
    except (ImportError, ValueError, OSError):
        pass
    return min(limits) if limits else None


def free_memory() -> int | None:
    """Bytes of memory free now (not counting caches the kernel could drop), or None when unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


AUTO = "auto"
RESERVE_SHARE = 8
RESERVE_FLOOR = 64 << 20


def _read_number(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT) -> list[tuple[int, int | None, str]]:
    """(limit, use or None, the limit's file) of each memory cgroup this process is in: its own and every
    ancestor's up to its hierarchy's root, since a parent's limit holds for its children (a systemd service's
    MemoryMax, a container's limit, a slice's). The process's cgroups come from `proc_cgroup`: cgroup v2's
    `0::/path` (mounted at `root`, or `root/unified` beside v1) and v1's memory controller (`root/memory`). In a
    container with a cgroup namespace of its own the path is `/`, the container's cgroup. A limit of "max"
    (none) is left out."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = ["0::/", "0:memory:/"]  # the hierarchies' roots: what a container sees of its own cgroup
    folders = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            mounts, files = (root, os.path.join(root, "unified")), _CGROUP_V2
        elif "memory" in controllers.split(","):
            mounts, files = (os.path.join(root, "memory"),), _CGROUP_V1
        else:
            continue
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        for mount in mounts:
            folders += [(os.path.join(mount, *parts[:depth]), files) for depth in range(len(parts), -1, -1)]
    found, seen = [], set()
    for folder, (limit_file, use_file) in folders:
        limit_path = os.path.join(folder, limit_file)
        if limit_path in seen:  # a hierarchy's root, reached from two cgroups of it
            continue
        seen.add(limit_path)
        limit = _read_number(limit_path)
        if limit is not None:
            found.append((limit, _working_set(folder, use_file), limit_path))
    return found


def _working_set(folder: str, use_file: str) -> int | None:
    """A cgroup's use less the page cache no process maps (the kernel reclaims it when the cgroup nears its
    limit, and MemAvailable counts it available alike): v1's cache less mapped_file, v2's file less file_mapped,
    each less shared memory (tmpfs, /dev/shm, shmem): the cache counts its pages, yet without swap the kernel
    cannot drop them. Mapped shared memory is subtracted twice, which errs toward less room."""
    use = _read_number(os.path.join(folder, use_file))
    if use is None:
        return None
    try:
        with open(os.path.join(folder, "memory.stat")) as f:
            stat = {k: int(v) for k, v, *_ in (line.split() for line in f) if v.isdigit()}
    except (OSError, ValueError):
        return use
    if "total_cache" in stat:  # v1, its children included
        unmapped = stat["total_cache"] - stat.get("total_mapped_file", 0) - stat.get("total_shmem", 0)
    else:  # v2
        unmapped = stat.get("file", 0) - stat.get("file_mapped", 0) - stat.get("shmem", 0)
    return max(0, use - max(0, unmapped))


def available_memory(meminfo: str = "/proc/meminfo") -> tuple[int, str] | None:
    """(bytes, what says so) that this process may still take without swapping, or None when unknown."""
    found = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = (int(line.split()[1]) * 1024, "MemAvailable")
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage, limit_path in cgroup_memory():
        if usage is not None and (found is None or limit - usage < found[0]):
            found = (max(0, limit - usage), f"this container's limit less its use ({limit_path})")
    return found


def auto_budget(mapped: int, arena: int, available: tuple[int, str] | None = None) -> int:
    """The arena budget of memory_budget="auto" (see the module docstring); `available` defaults to
    available_memory()."""
    available = available if available is not None else available_memory()
    if available is None:
        raise MemoryBudgetError('memory_budget="auto" reads the memory available from /proc/meminfo, which this '
                                "system does not have; give memory_budget a number of bytes")
    free, source = available
    reserve = max(RESERVE_FLOOR, free // RESERVE_SHARE)
    budget = free + arena - mapped - reserve
    if budget <= 0:
        raise MemoryBudgetError(f'memory_budget="auto": {format_bytes(free)} available ({source}), of which the '
                                f"mapped parameters need {format_bytes(mapped)} resident and {format_bytes(reserve)} "
                                "stay in reserve: nothing is left for a training step's arena; free memory, "
                                "store the frozen weights in fewer bytes (prepare --frozen-dtype int8 or int4), or "
                                "plan without a budget at your own risk (memory_budget=None, --memory-budget none)")
    return budget


def auto_shortfall(smallest: int, budget: int) -> None:
    """When no plan fits the auto budget (`budget`), the smallest arena odtrain can plan being `smallest` bytes:
    None (plan without a budget) when even that is more than the process can ever hold, so that `allocate`
    refuses the plan naming the machine's limit and its largest values; else a MemoryBudgetError that says
    what is available and what to do (a budget the user gave is told to rise instead)."""
    limit = memory_limit()
    if limit is not None and smallest > limit[0]:
        return None
    raise MemoryBudgetError(f'memory_budget="auto": {format_bytes(budget)} ({budget:,} bytes) of what is available '
                            "is left for a training step's arena, and the smallest arena odtrain can plan, "
                            f"recomputing activations, is {format_bytes(smallest)} ({smallest:,} bytes): free memory, "
                            "use a smaller batch, or plan without a budget at your own risk (memory_budget=None, "
                            "--memory-budget none)", smallest_bytes=smallest)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A uint8 buffer whose first byte is ALIGNMENT-aligned."""
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start:start + nbytes]


def allocate(plan: MemoryPlan, what: str, advice: Callable[[int], str] | None = None) -> np.ndarray:
    """The arena of `plan`, or a MemoryBudgetError naming what `what` (the graph and its inputs) needs."""
    limit = memory_limit()
    if limit is not None and plan.arena_bytes > limit[0]:
        raise MemoryBudgetError(_refusal(plan, what, f"more than {limit[1]} ({format_bytes(limit[0])})",
                                         advice(limit[0]) if advice else ""))
    try:
        return aligned_buffer(plan.arena_bytes)
    except MemoryError:
        free = free_memory()
        reason = "more than could be allocated" + (f" ({format_bytes(free)} free)" if free is not None else "")
        advised = advice(free) if advice and free is not None and free < plan.arena_bytes else ""
        raise MemoryBudgetError(_refusal(plan, what, reason, advised)) from None


def budget_advice(plan: MemoryPlan, trains: bool, fit_budget: Callable[[int], object], nbytes: int) -> str:
    """Which memory_budget makes a step fit `nbytes`, or that none does. `plan` is the step's plan,
    `trains` whether it has a backward pass, `fit_budget(budget)` raises MemoryBudgetError (with the
    smallest arena odtrain can plan) when recomputing activations cannot meet `budget`."""
    if not trains:
        return "Without a backward pass there is nothing to recompute (memory_budget applies to training steps); " \
               "use smaller inputs"
    largest = max(plan.groups, key=lambda g: g.nbytes)
    if largest.nbytes > nbytes:
        return (f"No memory_budget can help: recomputation does not split a value, and '{largest.values[0]}' alone "
                "is larger; use smaller inputs")
    try:
        fit_budget(nbytes)
    except MemoryBudgetError as refusal:
        return (f"No memory_budget fits: recomputing activations, the smallest arena odtrain can plan is "
                f"{refusal.smallest_bytes:,} bytes; use smaller inputs")
    return f"memory_budget={nbytes:,} fits, recomputing activations in the backward pass"


def largest_values(plan: MemoryPlan, count: int = LARGEST_SHOWN) -> list[str]:
    """The first value of each of the `count` largest storage groups, with its type, size and writer."""
    shown = []
    for group in sorted(plan.groups, key=lambda g: -g.nbytes)[:count]:
        name = min(group.values, key=lambda v: plan.written.get(v, group.start))
        step = plan.written.get(name, group.start)
        writer = f"written by {plan.order[step - 1].describe()}" if step > 0 else "an input"
        shown.append(f"'{name}' {plan.types[name]} ({format_bytes(group.nbytes)}, {writer})")
    return shown


def _refusal(plan: MemoryPlan, what: str, reason: str, advice: str) -> str:
    return (f"{what}: the memory plan needs an arena of {format_bytes(plan.arena_bytes)} ({plan.arena_bytes:,} "
            f"bytes), {reason}; its largest values: {'; '.join(largest_values(plan))}"
            + (f". {advice}" if advice else ""))
