"""Recording what a kernel library must hold: the (kernel, signature) calls of a set of artifacts' steps.

A kernel's signature depends on types and layouts, not sizes, so a few shapes stand for all: the
steps run (odtrain/trial_steps.py, on zero-valued inputs; nothing is written) at batch 1 and one larger
batch, at sequence length 1 and one larger length, at each thread count a device runs, and split as a
larger size would split them (kernels/parallel_split.py, every_split). The calls are recorded by the executor
(`record_calls`) as they are bound, without a library (with one they would be the same calls).
Above the API: the steps are bound through odtrain.api, as a user's script binds them.
"""
from __future__ import annotations

import contextlib
import os

from ..kernel_library import LIBRARY_ENV, kernel_name, signature_of
from ..trial_steps import run_steps


def recorded_shapes(batch_size: int, sequence_length: int | None) -> list[tuple[int, int | None]]:
    """The (batch size, sequence length) pairs a library records: 1 and `batch_size`, 1 and `sequence_length`
    (when given). Across the sizes of an axis only its length-1 case changes a call's types (a size-1 axis
    makes a strided view contiguous); at a size above 1, every call that could split is recorded split too
    (kernels/parallel_split.py, every_split), so one larger size stands for all."""
    batches = sorted({1, int(batch_size)})
    lengths = sorted({1, int(sequence_length)}) if sequence_length is not None else [None]
    return [(b, n) for b in batches for n in lengths]


def recorded_entries(artifact_dir, batch_size: int = 32, thread_counts=None, input_shapes=None,
                     inference_output: str | None = None, sequence_length: int | None = None) -> list:
    """The (kernel name, signature) pairs of the steps `odtrain warmup` runs on a set of artifacts (a training
    step writing and one accumulating gradients, an optimizer step, an eval step), closed under the input
    sizes the artifacts accept: at batch 1 and `batch_size`, and for inputs with another symbolic axis at
    lengths 1 and `sequence_length` (recorded_shapes; `input_shapes` gives whole shapes by name instead, then
    recorded as given), at each thread count of `thread_counts` (default: 1 and every core of this machine, as
    a device would run) both as the step splits its work at that size and with every call that has
    more than one unit split (kernels/parallel_split.py, every_split: the parallel twins a larger size runs). With
    `inference_output`, also of an InferenceSession on the model they export with that output. Nothing runs."""
    from .. import threads
    from ..executor import record_calls
    from ..jit.ahead import silenced
    from ..kernels.parallel_split import every_split

    counts = sorted(set(thread_counts or (1, threads.available_cores())))
    shapes = recorded_shapes(batch_size, sequence_length)
    previous = os.environ.get(LIBRARY_ENV)
    os.environ[LIBRARY_ENV] = "off"  # the calls are the same with a library: record them without one
    try:
        with record_calls() as calls, silenced():
            for count in counts:
                for split_all in ((False, True) if count > 1 else (False,)):
                    with threads.process_default(count), every_split() if split_all else contextlib.nullcontext():
                        for batch, length in shapes:
                            run_steps(os.fspath(artifact_dir), batch, input_shapes or {}, length, inference_output)
    finally:
        if previous is None:
            del os.environ[LIBRARY_ENV]
        else:
            os.environ[LIBRARY_ENV] = previous
    entries = {(kernel_name(kernel), signature_of(args)) for kernel, args in calls}
    return sorted((name, signature) for name, signature in entries if name and signature is not None)
