"""Federated learning on flat parameter buffers, in plain numpy (no Flower needed).

The model is one flat float32 buffer ``w`` (the trainable parameters, in
checkpoint order, as ``Module.get_contiguous_parameters(trainable_only=True)``
returns them). One round of federated averaging (FedAvg, McMahan et al. 2017):

1. every client ``k`` copies the global ``w`` into its Module and trains on its
   ``n_k`` local examples, reaching ``w_k``;
2. it sends the difference ``d_k = w_k - w`` (computed in float64, so that
   ``float32(w + d_k) == w_k`` bit for bit whenever no parameter shrank by more
   than a factor 2**28 in the round);
3. the server averages the differences weighted by example counts and applies
   the mean: ``w <- float32(w + sum_k n_k d_k / sum_k n_k)``. This equals the
   example-weighted mean of the client parameters ``w_k``.

Differential privacy (off by default): a client clips its difference to an L2
norm ``C``, ``d <- d * min(1, C / ||d||_2)``, and adds Gaussian noise
``N(0, (z C)^2)`` to every coordinate (``z`` is the noise multiplier): the
Gaussian mechanism on an update of sensitivity ``C``, applied on the device so
the server never sees the raw update. Noise comes from a seeded generator.

Invariants: functions never modify their inputs; buffers handed to a Module
are float32; differences and averages are float64.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..artifact_paths import ArtifactPaths
from ..graph.errors import ArgumentError


@dataclass
class Trainer:
    """A CheckpointState with its training Module and Optimizer, loaded from one artifact folder."""

    state: object
    module: object
    optimizer: object
    directory: str


def open_artifacts(directory) -> Trainer:
    """Load the checkpoint, training, eval and optimizer models of an artifact folder."""
    from ..api import CheckpointState, Module, Optimizer

    paths = ArtifactPaths.of(directory)
    state = CheckpointState.load_checkpoint(paths.checkpoint)
    module = Module(paths.training_model, state, paths.eval_model)
    return Trainer(state, module, Optimizer(paths.optimizer_model, module), paths.directory)


def parameter_layout(state, trainable_only: bool = True) -> list[tuple[str, tuple]]:
    """(name, shape) of each parameter in flat-buffer order: trainable ones, then (optionally) frozen float32 ones."""
    layout = [(n, p.data.shape) for n, p in state.parameters.items() if p.requires_grad]
    if not trainable_only:
        layout += [(n, p.data.shape) for n, p in state.parameters.items()
                   if not p.requires_grad and p.data.dtype == np.float32]
    return layout


def split_buffer(buffer, layout) -> dict[str, np.ndarray]:
    """Named arrays (copies) of a flat buffer laid out as ``layout``."""
    buffer = np.asarray(buffer).reshape(-1)
    sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape in layout]
    if sum(sizes) != buffer.size:
        raise ArgumentError(f"the buffer has {buffer.size} elements; the layout needs {sum(sizes)}")
    out, cursor = {}, 0
    for (name, shape), size in zip(layout, sizes):
        out[name] = buffer[cursor:cursor + size].reshape(shape).copy()
        cursor += size
    return out


def join_arrays(arrays: dict, layout) -> np.ndarray:
    """The flat float32 buffer of named arrays, in ``layout`` order (the inverse of split_buffer)."""
    missing = [name for name, _ in layout if name not in arrays]
    if missing:
        raise ArgumentError(f"parameters {missing} are missing; expected {[n for n, _ in layout]}")
    for name, shape in layout:
        if tuple(np.shape(arrays[name])) != tuple(shape):
            raise ArgumentError(f"parameter '{name}' has shape {np.shape(arrays[name])}; the model needs {shape}")
    return np.concatenate([np.asarray(arrays[n], dtype=np.float32).reshape(-1) for n, _ in layout])


def get_parameters(module, trainable_only: bool = True) -> np.ndarray:
    """A float32 copy of the module's parameter buffer (a plain ndarray)."""
    return np.array(module.get_contiguous_parameters(trainable_only=trainable_only), dtype=np.float32)


def set_parameters(module, buffer, trainable_only: bool = True) -> None:
    """Copy a flat buffer into the module's parameters (cast to float32)."""
    module.copy_buffer_to_parameters(np.asarray(buffer, dtype=np.float32), trainable_only=trainable_only)


def difference(buffer, reference) -> np.ndarray:
    """``buffer - reference`` in float64 (exact for float32 inputs of similar magnitude)."""
    buffer, reference = np.asarray(buffer), np.asarray(reference)
    if buffer.shape != reference.shape:
        raise ArgumentError(f"buffer shape {buffer.shape} differs from the reference's {reference.shape}")
    return buffer.astype(np.float64) - reference.astype(np.float64)


def apply_difference(reference, delta) -> np.ndarray:
    """``float32(reference + delta)``: the parameters a difference describes."""
    reference, delta = np.asarray(reference), np.asarray(delta)
    if reference.shape != delta.shape:
        raise ArgumentError(f"difference shape {delta.shape} differs from the reference's {reference.shape}")
    return (reference.astype(np.float64) + delta).astype(np.float32)


def fedavg(differences, weights) -> np.ndarray:
    """Weighted mean ``sum_k n_k d_k / sum_k n_k`` (float64); weights are example counts, >= 0, not all 0."""
    differences = [np.asarray(d, dtype=np.float64) for d in differences]
    weights = np.asarray(weights, dtype=np.float64).reshape(-1)
    if not differences or len(differences) != weights.size:
        raise ArgumentError(f"need one weight per difference: {len(differences)} differences, {weights.size} weights")
    if any(d.shape != differences[0].shape for d in differences):
        raise ArgumentError(f"differences have different shapes: {sorted({d.shape for d in differences})}")
    if not np.all(np.isfinite(weights)) or np.any(weights < 0) or weights.sum() <= 0:
        raise ArgumentError(f"weights must be finite, >= 0 and not all 0, got {weights.tolist()}")
    total = np.zeros_like(differences[0])
    for d, w in zip(differences, weights):
        total += w * d
    return total / weights.sum()


def clip_update(delta, max_norm: float) -> tuple[np.ndarray, float]:
    """``delta * min(1, max_norm / ||delta||_2)`` and the norm before clipping."""
    if not max_norm > 0:
        raise ArgumentError(f"the clipping norm must be > 0, got {max_norm}")
    delta = np.asarray(delta, dtype=np.float64)
    norm = float(np.linalg.norm(delta))
    return (delta * (max_norm / norm) if norm > max_norm else delta.copy()), norm


def add_gaussian_noise(delta, std: float, seed) -> np.ndarray:
    """``delta + N(0, std^2)`` per coordinate, drawn from ``numpy.random.default_rng(seed)``."""
    if not std >= 0:
        raise ArgumentError(f"the noise standard deviation must be >= 0, got {std}")
    delta = np.asarray(delta, dtype=np.float64)
    return delta + np.random.default_rng(seed).normal(0.0, std, delta.shape) if std > 0 else delta.copy()


def privatize(delta, clip_norm: float | None = None, noise_multiplier: float = 0.0, seed=0) -> tuple[np.ndarray, dict]:
    """Clip to ``clip_norm`` (None: no clipping), then add noise of std ``noise_multiplier * clip_norm``."""
    delta = np.asarray(delta, dtype=np.float64)
    info = {"update_norm": float(np.linalg.norm(delta)), "clipped": 0}
    if clip_norm:
        delta, norm = clip_update(delta, clip_norm)
        info["clipped"] = int(norm > clip_norm)
    if noise_multiplier:
        if not clip_norm:
            raise ArgumentError("Gaussian noise needs a clipping norm: its scale is noise_multiplier * clip_norm")
        delta = add_gaussian_noise(delta, noise_multiplier * clip_norm, seed)
    return delta, info




def _loss_and_logits(outputs):
    if isinstance(outputs, (list, tuple)):
        return float(np.asarray(outputs[0])), (np.asarray(outputs[1]) if len(outputs) > 1 else None)
    return float(np.asarray(outputs)), None


def _data_inputs(x) -> list[np.ndarray]:
    """The arrays fed before the labels: one array, or a tuple of them (a model with several data inputs)."""
    return [np.asarray(a) for a in x] if isinstance(x, tuple) else [np.asarray(x)]


def train_local(module, optimizer, x, y, epochs: int = 1, batch_size: int = 32, seed=0, *,
                clip_norm: float | None = None, noise_multiplier: float = 0.0) -> tuple[np.ndarray, int, dict]:
    """Train on one client's arrays from the module's current parameters; return (difference, examples, metrics).

    ``x`` is the data input's array, or a tuple of arrays for a model with several data inputs (a language
    model's ``input_ids`` and ``attention_mask``), in the model's input order; ``y`` the labels.

    ``seed`` (an int or a sequence of ints) seeds two streams: the order in which each epoch visits the examples,
    and the privacy noise. The optimizer's moments and step count are reset first. The module keeps the trained
    parameters; the returned float64 difference (privatized when ``clip_norm``/``noise_multiplier`` are set) is
    what leaves the device.
    Metrics: ``train_loss`` (example-weighted mean over the last epoch), ``steps``, ``update_norm``, ``clipped``.
    """
    xs, y = _data_inputs(x), np.asarray(y)
    if any(len(a) != len(y) for a in xs) or len(y) == 0:
        raise ArgumentError(f"a client needs as many labels as inputs, and at least one: {len(xs[0])} inputs, "
                            f"{len(y)} labels")
    if epochs < 1 or batch_size < 1:
        raise ArgumentError(f"epochs and batch_size must be >= 1, got {epochs} and {batch_size}")
    reference = get_parameters(module)
    optimizer.reset_state()  # each round starts afresh
    shuffle_seed, noise_seed = np.random.SeedSequence(seed).spawn(2)
    rng = np.random.default_rng(shuffle_seed)
    module.train()
    module.lazy_reset_grad()
    steps, total = 0, 0.0
    for _ in range(epochs):
        order, total = rng.permutation(len(y)), 0.0
        for start in range(0, len(order), batch_size):
            index = order[start:start + batch_size]
            loss, _ = _loss_and_logits(module(*(a[index] for a in xs), y[index]))
            optimizer.step()
            module.lazy_reset_grad()
            total += loss * len(index)
            steps += 1
    delta, info = privatize(difference(get_parameters(module), reference), clip_norm, noise_multiplier, noise_seed)
    return delta, len(y), {"train_loss": total / len(y), "steps": steps, **info}


def evaluate(module, x, y, batch_size: int = 512) -> dict:
    """Example-weighted mean loss, and accuracy when the eval model also outputs logits."""
    module.eval()
    total, correct, has_logits = 0.0, 0, True
    for start in range(0, len(y), batch_size):
        loss, logits = _loss_and_logits(module(x[start:start + batch_size], y[start:start + batch_size]))
        total += loss * len(y[start:start + batch_size])
        if logits is None:
            has_logits = False
        else:
            correct += int((logits.argmax(axis=1) == y[start:start + batch_size]).sum())
    module.train()
    result = {"loss": total / len(y), "examples": len(y)}
    if has_logits:
        result["accuracy"] = correct / len(y)
    return result


def partition_by_label(labels, num_partitions: int, alpha: float = 0.5, seed=0, min_size: int = 10) -> list[np.ndarray]:
    """Split example indices non-IID by label: each class is shared out with proportions ~ Dirichlet(alpha).

    Smaller ``alpha`` means more skew. Draws repeat (same generator) until every partition holds at least
    ``min_size`` examples. Deterministic for a given seed; partitions are disjoint and cover every index.
    """
    labels = np.asarray(labels).reshape(-1)
    if num_partitions < 1 or num_partitions * min_size > labels.size:
        raise ArgumentError(f"cannot split {labels.size} examples into {num_partitions} partitions "
                            f"of at least {min_size}")
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        parts = [[] for _ in range(num_partitions)]
        for cls in np.unique(labels):
            index = rng.permutation(np.flatnonzero(labels == cls))
            cuts = (np.cumsum(rng.dirichlet(np.full(num_partitions, alpha)))[:-1] * index.size).astype(int)
            for part, chunk in zip(parts, np.split(index, cuts)):
                part.append(chunk)
        parts = [np.sort(np.concatenate(p)) for p in parts]
        if min(p.size for p in parts) >= min_size:
            return parts
    raise ArgumentError(f"no Dirichlet({alpha}) split gave every partition {min_size} examples; raise alpha")
