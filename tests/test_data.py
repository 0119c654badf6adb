"""Dataset loading: the embedded default, local .npz files, and the offline shared data."""

import numpy as np
import pytest
from conftest import shared_data_dir

from jaxfed.data import load_dataset
from jaxfed.errors import ConfigError


def test_digits_is_embedded_and_normalized():
    ds = load_dataset("digits")
    assert ds.x_train.shape[1:] == (8, 8, 1) and ds.num_classes == 10
    assert len(ds.y_train) + len(ds.y_test) == 1797
    assert abs(float(ds.x_train.mean())) < 1e-3 and abs(float(ds.x_train.std()) - 1) < 1e-2
    assert sorted(np.unique(ds.y_test)) == list(range(10))


def test_digits_are_scikit_learns_read_from_its_file_or_through_load_digits(monkeypatch):
    """The digits are read from the file scikit-learn ships (no scikit-learn import at a run's
    start), equal to ``load_digits``; where the file is not found, through ``load_digits``."""
    import importlib.util

    from sklearn.datasets import load_digits

    from jaxfed.data import datasets

    bunch = load_digits()
    images, labels = datasets._digits_images_and_labels()
    np.testing.assert_array_equal(images, bunch.images)
    np.testing.assert_array_equal(labels, bunch.target)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no file where it was
    fallback = datasets._digits_images_and_labels()
    np.testing.assert_array_equal(fallback[0], bunch.images)
    np.testing.assert_array_equal(fallback[1], bunch.target)


def test_npz_in_data_dir(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "fashion_mnist.npz",
        x_train=rng.integers(0, 255, (50, 28, 28), dtype=np.uint8),
        y_train=rng.integers(0, 10, 50),
        x_test=rng.integers(0, 255, (20, 28, 28), dtype=np.uint8),
        y_test=rng.integers(0, 10, 20),
    )
    ds = load_dataset("fashion_mnist", data_dir=str(tmp_path))
    assert ds.x_train.shape == (50, 28, 28, 1) and ds.x_test.shape == (20, 28, 28, 1)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32


def test_npz_missing_arrays_is_a_clear_error(tmp_path):
    np.savez(tmp_path / "mnist.npz", x_train=np.zeros((2, 28, 28)))
    with pytest.raises(ConfigError, match="lacks y_train, x_test, y_test"):
        load_dataset("mnist", data_dir=str(tmp_path))


def test_unknown_dataset():
    with pytest.raises(ConfigError, match="allowed: digits"):
        load_dataset("svhn")


def test_offline_mnist_from_shared_data():
    data_dir = shared_data_dir()
    if data_dir is None:
        pytest.skip("../shared/data/mnist.npz not present beside the repository")
    ds = load_dataset("mnist", data_dir=str(data_dir))
    assert ds.x_train.shape == (60000, 28, 28, 1) and ds.x_test.shape == (10000, 28, 28, 1)
    assert np.bincount(ds.y_train).min() > 5000
