"""Training state in flat buffers: parameters, gradients, optimizer moments, properties.

Invariants:
- Every trainable parameter lives in one contiguous float32 buffer, in
  checkpoint order; a parameter's array is a view into it. So federated
  differences and the optimizer step are each one pass over one block.
- Frozen float32 parameters follow them in that buffer, unless they come from
  a file (`reader` given): then each is kept as given, a copy-on-write view of
  the file that costs no memory of its own until written, and the trainable
  ones are read from the file straight into the buffer.
- The gradient buffer and each optimizer moment buffer cover exactly the
  trainable block, with the same layout.
- Parameters of other dtypes (frozen only) are held as separate arrays.
- The float32 parameters in order (trainable, then frozen) form the layout of
  the contiguous-parameters API, wherever each is held.
- 8-bit AdamW moments (`state_dtype="int8"`) are one uint8 code per value in the trainable layout and one
  float32 absmax per block: each parameter is cut into blocks of STATE_BLOCK values (its last one shorter),
  in trainable order (`moment_blocks`), so a parameter's moments are one slice of each buffer.
- The state is always that of whole steps: a step and an update run inside `deferred_interrupt()`.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .graph.errors import ArgumentError, ParameterError

PROPERTY_TYPES = (int, float, str)


def _copy(value):
    """A copy of a parameter's values; a packed 4-bit one (graph/int4.py) stays packed."""
    return value.copy() if hasattr(value, "packed") else np.array(value)


class ParameterStore:
    def __init__(self, arrays: dict[str, np.ndarray], trainable: list[str],
                 reader: Callable[[str, np.ndarray], None] | None = None):
        """`reader(name, out)`, when the arrays are views of a file, reads parameter `name` into `out`."""
        missing = [n for n in trainable if n not in arrays]
        if missing:
            raise ParameterError(f"trainable parameters {missing} have no values")
        frozen = [n for n in arrays if n not in trainable]
        for name in trainable:
            if arrays[name].dtype != np.float32:
                raise ArgumentError(f"trainable parameter '{name}' is {arrays[name].dtype}; only float32 parameters train")
        self.trainable = list(trainable)
        self.frozen = frozen
        flat_names = self.trainable + [n for n in frozen if reader is None and arrays[n].dtype == np.float32]
        self.slices: dict[str, tuple[int, int, tuple]] = {}
        cursor = 0
        for name in flat_names:
            size = int(arrays[name].size)
            self.slices[name] = (cursor, cursor + size, tuple(arrays[name].shape))
            cursor += size
        self.trainable_size = self.slices[self.trainable[-1]][1] if self.trainable else 0
        self.flat = np.empty(cursor, dtype=np.float32)
        for name in flat_names:
            start, stop, _ = self.slices[name]
            if reader is not None:
                reader(name, self.flat[start:stop])
            else:
                self.flat[start:stop] = np.asarray(arrays[name], dtype=np.float32).reshape(-1)
        self.grad_flat = np.zeros(self.trainable_size, dtype=np.float32)
        self.others = {n: arrays[n] if reader is not None else _copy(arrays[n]) for n in frozen if n not in self.slices}
        self.mapped = reader is not None  # the others are views of the file
        self.float32_names = flat_names + [n for n in frozen if n in self.others and self.others[n].dtype == np.float32]

    def mapped_bytes(self) -> int:
        """Bytes of the parameters held as views of the checkpoint file (the frozen ones of a loaded state)."""
        return sum(int(a.nbytes) for a in self.others.values()) if self.mapped else 0

    def float32_size(self, trainable_only: bool) -> int:
        return self.trainable_size if trainable_only else sum(self.data(n).size for n in self.float32_names)

    def gather(self, trainable_only: bool) -> np.ndarray:
        """A new contiguous copy of the trainable (or all float32) parameters, in layout order."""
        if trainable_only or len(self.float32_names) == len(self.slices):
            return self.flat[:self.float32_size(trainable_only)].copy()
        return np.concatenate([self.data(n).reshape(-1) for n in self.float32_names])

    def scatter(self, array: np.ndarray, trainable_only: bool) -> list[str]:
        """Write a contiguous buffer (layout order) into the parameters; returns the names written."""
        names = self.trainable if trainable_only else self.float32_names
        cursor = 0
        for name in names:
            target = self.data(name)
            target[...] = array[cursor:cursor + target.size].reshape(target.shape)
            cursor += target.size
        return names

    @property
    def names(self) -> list[str]:
        return self.trainable + self.frozen

    def __contains__(self, name: str) -> bool:
        return name in self.slices or name in self.others

    def check(self, name: str) -> None:
        if name not in self:
            raise ParameterError(f"no parameter named '{name}'; the checkpoint has: {', '.join(self.names)}")

    def data(self, name: str) -> np.ndarray:
        """The live array of a parameter (a view of the flat buffer for float32 ones)."""
        self.check(name)
        if name in self.others:
            return self.others[name]
        start, stop, shape = self.slices[name]
        return self.flat[start:stop].reshape(shape)

    def grad(self, name: str) -> np.ndarray | None:
        """The live gradient view of a trainable parameter; None for a frozen one."""
        self.check(name)
        if name not in self.trainable:
            return None
        start, stop, shape = self.slices[name]
        return self.grad_flat[start:stop].reshape(shape)

    def first_nonfinite_gradient(self) -> str | None:
        """The first trainable parameter whose gradient holds a NaN or infinity, if any."""
        if np.isfinite(self.grad_flat).all():
            return None
        return next(n for n in self.trainable if not np.isfinite(self.grad(n)).all())

    def trainable_sizes(self) -> dict[str, int]:
        """Each trainable parameter's number of values, in trainable order."""
        return {name: self.slices[name][1] - self.slices[name][0] for name in self.trainable}

    def trainable_view(self, flat: np.ndarray, name: str) -> np.ndarray:
        """The segment of a trainable-layout buffer (gradients, moments) that belongs to `name`."""
        start, stop, shape = self.slices[name]
        return flat[start:stop].reshape(shape)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: self.data(name) for name in self.names}


@dataclass
class OptimizerState:
    """Optimizer step count, learning rate and moment buffers (trainable layout; 8-bit moments: their codes,
    and their absmax values in the block layout, keyed `<moment>` + ABSMAX)."""

    kind: str
    step: int = 0
    learning_rate: float = 1e-3
    initial_learning_rate: float = 1e-3
    moments: dict[str, np.ndarray] = field(default_factory=dict)
    state_dtype: str = "float32"


ABSMAX = "_absmax"


def moment_blocks(sizes: dict[str, int], block: int) -> tuple[np.ndarray, dict[str, tuple[int, int]]]:
    """(block boundaries over the trainable block, int64 [blocks + 1]; each parameter's range of blocks), from
    the trainable parameters' sizes in trainable order (`ParameterStore.trainable_sizes`)."""
    starts, ranges, start = [0], {}, 0
    for name, size in sizes.items():
        first = len(starts) - 1
        starts += list(range(start + block, start + size, block)) + [start + size]
        ranges[name] = (first, len(starts) - 1)
        start += size
    return np.array(starts, np.int64), ranges


class PropertyBag:
    """User key/value pairs (int, float, str) saved with the checkpoint."""

    def __init__(self, values: dict | None = None):
        self._values: dict[str, int | float | str] = {}
        for key, value in (values or {}).items():
            self[key] = value

    def __setitem__(self, key: str, value) -> None:
        if not isinstance(key, str):
            raise ArgumentError(f"property names must be strings, got {key!r}")
        if isinstance(value, bool):
            value = int(value)
        elif isinstance(value, np.generic):
            value = value.item()
        if not isinstance(value, PROPERTY_TYPES):
            raise ArgumentError(f"property '{key}' must be an int, float or str, got {type(value).__name__}")
        self._values[key] = value

    def __getitem__(self, key: str):
        if key not in self._values:
            raise ParameterError(f"no property named '{key}'; properties: {sorted(self._values)}")
        return self._values[key]

    def __contains__(self, key) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self):
        return iter(self._values)

    def __delitem__(self, key: str) -> None:
        self[key]  # raises the helpful error when missing
        del self._values[key]

    def get(self, key: str, default=None):
        return self._values.get(key, default)

    def items(self):
        return self._values.items()

    def to_dict(self) -> dict:
        return dict(self._values)

    def __repr__(self) -> str:
        return f"PropertyBag({self._values!r})"


# Ctrl-C during a training step completes the step, then interrupts. A step writes gradients, parameters and
# moments in several kernel calls; stopping between two of them would leave the state half updated. Inside
# `deferred_interrupt()` a SIGINT is remembered and raised as KeyboardInterrupt when the block ends, so the
# state is always that of a whole step. Outside the main thread (where handlers cannot be installed) it does
# nothing.
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
