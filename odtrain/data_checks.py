"""Checks of loaded data that run before any step: a NaN or infinity is the data's fault, named as such.

One NaN pixel makes every loss after it NaN; met during training it reads as
divergence ("lower the learning rate"), which sends the user the wrong way.
`refuse_non_finite(dataset)` looks at every floating-point array of a
Dataset once, before the first step, and raises an InputError naming the
data's source, the input, the first sample that holds such a value (and
where in it), and how many samples do. Integer arrays (labels, token ids)
cannot hold one and are not read.
"""
from __future__ import annotations

import numpy as np

from .graph.errors import InputError
from .graph.wording import count

# rows checked at a time: np.isfinite's boolean copy of a large token or image array stays small
_CHUNK_BYTES = 64 << 20


def _first_non_finite(array: np.ndarray) -> tuple[int, int] | None:
    """(index of the first sample holding a NaN or infinity, number of such samples), or None."""
    per_sample = max(1, array[0].nbytes if array.ndim > 1 and len(array) else 1)
    rows = max(1, _CHUNK_BYTES // per_sample)
    first, bad = None, 0
    for begin in range(0, len(array), rows):
        chunk = array[begin:begin + rows]
        finite = np.isfinite(chunk).reshape(len(chunk), -1).all(axis=1)
        if not finite.all():
            where = np.flatnonzero(~finite)
            first = begin + int(where[0]) if first is None else first
            bad += len(where)
    return None if first is None else (first, bad)


def refuse_non_finite(dataset) -> None:
    """Raise an InputError naming the first sample of `dataset` with a NaN or infinity (see the module docstring)."""
    for spec, array in zip(dataset.inputs, dataset.arrays):
        if array.dtype.kind != "f" or not array.size:
            continue
        found = _first_non_finite(array)
        if found is None:
            continue
        sample, samples = found
        values = np.asarray(array[sample])
        position = np.argwhere(~np.isfinite(values))[0] if values.ndim else ()
        value = values[tuple(position)] if values.ndim else values
        at = f" at position ({', '.join(str(int(i)) for i in position)})" if len(position) else ""
        raise InputError(f"{dataset.source}: sample {sample} of input '{spec.name}' holds {value}{at} "
                         f"({count(samples, 'sample')} of {len(array):,} hold a NaN or infinity); training on it "
                         "would make every loss after it NaN: fix or drop those samples")
