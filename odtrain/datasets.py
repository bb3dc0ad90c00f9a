"""Small real datasets shipped inside the odtrain package.

Used by ``odtrain demo`` and the tests, so training can be shown on real data
with no network access. The data files live in ``odtrain/data/`` (see the
README there for sources and licences) and are found with
:mod:`importlib.resources`, so they work from a source tree or an installed
wheel.

Functions:

* :func:`load_digits` -- the UCI 8x8 handwritten digits (1797 samples).
* :func:`train_test_split` -- a deterministic, stratified, shuffled split.
"""

from __future__ import annotations

from importlib import resources

import numpy as np

__all__ = ["load_digits", "train_test_split"]

_PACKAGE = (__package__ or "odtrain").split(".")[0]
_DIGITS_FILE = "digits.npz"
_DIGITS_MAX = 16.0  # pixel values in the file are counts 0..16


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """Load the 8x8 handwritten digits dataset bundled with odtrain.

    Returns:
        ``(images, labels)`` where ``images`` is float32 of shape ``[N, 64]``
        with values scaled to ``[0, 1]`` (row-major 8x8 images) and
        ``labels`` is int64 of shape ``[N]`` with values ``0..9``
        (``N == 1797``).
    """
    ref = resources.files(_PACKAGE) / "data" / _DIGITS_FILE
    with resources.as_file(ref) as path, np.load(path, allow_pickle=False) as npz:
        raw_images = npz["images"]
        raw_labels = npz["labels"]
    images = raw_images.astype(np.float32) / np.float32(_DIGITS_MAX)
    labels = raw_labels.astype(np.int64)
    return images, labels


def train_test_split(
    images: np.ndarray,
    labels: np.ndarray,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split ``(images, labels)`` into a training and a test set.

    The split is stratified: each class contributes ``round(test_fraction *
    count)`` of its samples to the test set, so both sets keep the class
    proportions. Sample choice and the order within each set are shuffled with
    ``numpy.random.default_rng(seed)``, so the same seed always gives the same
    split.

    Args:
        images: array of shape ``[N, ...]``.
        labels: integer array of shape ``[N]``.
        test_fraction: share of samples to put in the test set, in ``(0, 1)``.
        seed: seed for :func:`numpy.random.default_rng`.

    Returns:
        ``(train_images, test_images, train_labels, test_labels)``.
    """
    images = np.asarray(images)
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if images.shape[:1] != labels.shape:
        raise ValueError(
            f"images and labels differ in length: {images.shape[0]} vs {labels.shape[0]}"
        )
    if labels.size == 0:
        raise ValueError("cannot split an empty dataset")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")

    rng = np.random.default_rng(seed)
    test_parts = []
    train_parts = []
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        n_test = int(round(test_fraction * idx.size))
        test_parts.append(idx[:n_test])
        train_parts.append(idx[n_test:])
    train_idx = rng.permutation(np.concatenate(train_parts))
    test_idx = rng.permutation(np.concatenate(test_parts))
    return images[train_idx], images[test_idx], labels[train_idx], labels[test_idx]
