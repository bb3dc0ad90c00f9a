"""Tests for odtrain.datasets: the bundled digits data and the split helper."""

import numpy as np
import pytest

from odtrain.datasets import load_digits, train_test_split


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def test_load_digits_shapes_dtypes_and_ranges(digits):
    images, labels = digits
    assert images.shape == (1797, 64)
    assert labels.shape == (1797,)
    assert images.dtype == np.float32
    assert labels.dtype == np.int64
    assert images.min() == 0.0
    assert images.max() == 1.0
    # Values are the original 0..16 counts divided by 16.
    np.testing.assert_array_equal(images * 16, np.round(images * 16))
    counts = np.bincount(labels, minlength=10)
    assert counts.size == 10
    assert counts.min() >= 170 and counts.max() <= 190
    assert counts.sum() == 1797


def test_split_sizes_stratified_and_disjoint(digits):
    images, labels = digits
    x_tr, x_te, y_tr, y_te = train_test_split(images, labels, test_fraction=0.2, seed=0)
    assert x_tr.shape[0] + x_te.shape[0] == 1797
    assert x_tr.shape[0] == y_tr.shape[0] and x_te.shape[0] == y_te.shape[0]
    assert x_tr.shape[1:] == x_te.shape[1:] == (64,)
    assert abs(x_te.shape[0] - 0.2 * 1797) <= 10
    # Stratified: each class gets round(0.2 * count) test samples.
    expected = np.round(0.2 * np.bincount(labels, minlength=10)).astype(int)
    np.testing.assert_array_equal(np.bincount(y_te, minlength=10), expected)

    # Disjoint and complete: split row indices instead of values
    # (the digits data contains a few duplicate images).
    ids = np.arange(labels.size)
    id_tr, id_te, lab_tr, lab_te = train_test_split(ids, labels, test_fraction=0.2, seed=0)
    assert np.intersect1d(id_tr, id_te).size == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([id_tr, id_te])), ids)
    np.testing.assert_array_equal(labels[id_tr], lab_tr)
    np.testing.assert_array_equal(labels[id_te], lab_te)
    np.testing.assert_array_equal(images[id_te], x_te)


def test_split_is_deterministic_by_seed(digits):
    images, labels = digits
    a = train_test_split(images, labels, seed=3)
    b = train_test_split(images, labels, seed=3)
    c = train_test_split(images, labels, seed=4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[1], c[1])


def test_split_rejects_bad_arguments():
    x = np.zeros((10, 2))
    y = np.arange(10) % 2
    with pytest.raises(ValueError):
        train_test_split(x, y, test_fraction=0.0)
    with pytest.raises(ValueError):
        train_test_split(x, y, test_fraction=1.0)
    with pytest.raises(ValueError):
        train_test_split(x[:9], y)
