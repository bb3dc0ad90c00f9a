"""The optimizer's update of the trainable block: which kernel call each optimizer makes, run or checked.

`UPDATES` maps an optimizer (its kind, and the type its moments are kept in) to the function that builds
its one serial call on the flat block: (kernel, arguments) of kernels/optim.py. Everything else is shared:
the call is split into parts at the step's thread count by the parallel-split rule (kernels/parallel_split.py),
run through the kernel library when it holds it, else through Numba (`executor.invoke`), and a device
without Numba asks the library for exactly that call before the first step (`require_update_kernels`).
A new optimizer is its record (graph/optimizers.py: kind, state names, hyper-parameters), its kernel and its
parallel twin (kernels/optim.py), and its row here; README's "Adding an optimizer" walks through them.

8-bit AdamW moments are codes and absmax values over blocks of the trainable block (odtrain/state.py);
`int8_moments` and `float_moments` convert them from and to float32.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from . import threads as thread_policy
from .executor import invoke
from .graph.errors import KernelsUnavailableError
from .graph.optimizers import CLIP_EPSILON
from .kernel_library import compiler_installed, missing_kernel
from .kernels.optim import (CODE_MAPS, CODE_TABLES, adamw8_update, adamw_update, dequantize_blocks, quantize_blocks,
                            sgd_momentum_update, sgd_update)
from .kernels.parallel_split import split
from .state import ABSMAX


def _adamw(config, weights, grads, moments, learning_rate, step, blocks):
    return adamw_update, (weights, grads, moments["momentum0"], moments["momentum1"], float(learning_rate),
                          float(config.betas[0]), float(config.betas[1]), float(config.eps),
                          float(config.weight_decay), float(step), bool(config.bias_correction))


def _adamw_int8(config, weights, grads, moments, learning_rate, step, blocks):
    return adamw8_update, (weights, grads, moments["momentum0"], moments["momentum1"], moments["momentum0" + ABSMAX],
                           moments["momentum1" + ABSMAX], CODE_MAPS, CODE_TABLES, blocks, float(learning_rate),
                           float(config.betas[0]), float(config.betas[1]), float(config.eps),
                           float(config.weight_decay), float(step), bool(config.bias_correction))


def _sgd_momentum(config, weights, grads, moments, learning_rate, step, blocks):
    return sgd_momentum_update, (weights, grads, moments["momentum_buffer"], float(learning_rate),
                                 float(config.momentum), float(config.dampening), float(config.weight_decay),
                                 bool(config.nesterov), step == 1)


def _sgd(config, weights, grads, moments, learning_rate, step, blocks):
    return sgd_update, (weights, grads, float(learning_rate))


# (optimizer kind, the type its moments are kept in) -> the builder of its serial call
UPDATES = {("AdamW", "float32"): _adamw, ("AdamW", "int8"): _adamw_int8,
           ("SGDMomentum", "float32"): _sgd_momentum, ("SGD", "float32"): _sgd}


CLIP_BLOCK = 1 << 20  # gradient values squared in float64 at a time: a bounded copy, whatever the model's size


def gradient_norm(grads: np.ndarray) -> float:
    """The L2 norm of the flat gradient block: squares summed in float64 by numpy's pairwise sum a block at a
    time, so the same bits at every thread count and no float64 copy of the whole block."""
    total = 0.0
    for start in range(0, grads.size, CLIP_BLOCK):
        total += float(np.square(grads[start:start + CLIP_BLOCK], dtype=np.float64).sum())
    return math.sqrt(total)


def clip_gradients(grads: np.ndarray, max_norm: float) -> float:
    """Scale the flat gradient block in place so that its L2 norm is at most `max_norm`, as
    torch.nn.utils.clip_grad_norm_ does: by max_norm / (norm + CLIP_EPSILON) when that is below 1 (a
    non-finite norm spreads into the gradients, as there). Returns the norm before clipping."""
    norm = gradient_norm(grads)
    factor = max_norm / (norm + CLIP_EPSILON)
    if not factor >= 1.0:
        np.multiply(grads, np.float32(factor), out=grads)
    return norm


def update_calls(config, weights, grads, moments, learning_rate, step, threads, blocks) -> tuple:
    """(the serial update's call, the call that runs at `threads`: itself, or its twin's on parts). 8-bit
    moments split in parts of their blocks, everything else in parts of the elements."""
    state_dtype = getattr(config, "state_dtype", "float32")
    call = UPDATES[(config.kind, state_dtype)](config, weights, grads, moments, learning_rate, step, blocks)
    units = blocks.size - 1 if state_dtype == "int8" else weights.size
    return call, split(call, units, weights.size, threads)


def apply_update(config, weights: np.ndarray, grads: np.ndarray, moments: dict[str, np.ndarray],
                 learning_rate: float, step: int, threads: int = 1, blocks: np.ndarray | None = None,
                 library=None) -> None:
    """One fused update of the trainable block by the optimizer model's node (its UPDATES row),
    on parts of the block in parallel at `threads` threads when the block is large enough; through the
    kernel `library` when it holds the update. 8-bit AdamW moments are quantized in `blocks` (boundaries
    within `weights`, odtrain/state.py)."""
    call, parts = update_calls(config, weights, grads, moments, learning_rate, step, threads, blocks)
    if parts is not call and library is not None and library.address(*parts) is None and \
            library.address(*call) is not None and not compiler_installed():
        # The library holds the serial update only (built for one thread, the thread count raised after the
        # Optimizer's pre-check): run that, the same numbers element by element, rather than stop after the
        # gradients were computed.
        parts = call
    with thread_policy.running(threads) if parts is not call else contextlib.nullcontext(1) as running:
        invoke(*parts, threads=running, library=library)


def require_update_kernels(config, weights: np.ndarray, grads: np.ndarray, moments: dict[str, np.ndarray],
                           threads: int, blocks: np.ndarray | None, library, artifact_folder) -> None:
    """Where Numba is not installed, raise KernelsUnavailableError, in the one line of a step's missing kernel,
    when `library` lacks the call apply_update would make on these arrays at `threads` threads: said before
    a training step computes gradients the update could not apply. Without a library the step's bind says so."""
    if library is None or compiler_installed():
        return
    _, (kernel, args) = update_calls(config, weights, grads, moments, 0.0, 1, threads, blocks)
    if library.address(kernel, args) is None:
        raise KernelsUnavailableError(missing_kernel("the optimizer's update", kernel, args, library,
                                                     artifact_folder))


def int8_moments(blocks: np.ndarray, names, values: dict | None = None) -> dict[str, np.ndarray]:
    """8-bit moments `names` over the trainable block cut at `blocks` (odtrain/state.py; the signed map for the
    first, the unsigned one for the others), quantized from float `values` (trainable layout) or zero."""
    moments = {}
    for index, name in enumerate(names):
        codes, absmax = np.zeros(blocks[-1], np.uint8), np.zeros(blocks.size - 1, np.float32)
        source = values[name] if values is not None else np.zeros(blocks[-1], np.float32)
        quantize_blocks(source, blocks, CODE_TABLES[min(index, 1)], codes, absmax)
        moments[name], moments[name + ABSMAX] = codes, absmax
    return moments


def float_moments(blocks: np.ndarray, moments: dict, names) -> dict[str, np.ndarray]:
    """The float32 values of 8-bit moments `names`."""
    values = {}
    for index, name in enumerate(names):
        values[name] = np.zeros(blocks[-1], np.float32)
        dequantize_blocks(moments[name], moments[name + ABSMAX], blocks, CODE_MAPS[min(index, 1)], values[name])
    return values
