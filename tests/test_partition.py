import numpy as np
import pytest

from jaxfed.data import partition
from jaxfed.data.partition import PARTITIONERS
from jaxfed.errors import ConfigError


def _labels(n=2000, classes=10, seed=0):
    return np.random.default_rng(seed).integers(0, classes, size=n)


@pytest.mark.parametrize("name", PARTITIONERS)
def test_every_client_non_empty_and_no_example_twice(name):
    y_train, y_test = _labels(3000), _labels(600, seed=1)
    options = {"client_train_size": 100, "client_test_size": 20}
    train, test = partition(name, y_train, y_test, 20, np.random.default_rng(1), **options)
    for parts, pool in ((train, y_train), (test, y_test)):
        flat = np.concatenate(parts)
        assert len(flat) == len(np.unique(flat)), "an example was given to two clients"
        assert flat.min() >= 0 and flat.max() < len(pool)
    assert all(len(p) > 0 for p in train)
    if name in ("iid", "dirichlet", "pathological"):
        assert sum(len(p) for p in train) == len(y_train)  # every training example used


def test_dirichlet_alpha_extremes():
    y = _labels(5000)
    y_test = _labels(1000, seed=2)

    def classes_per_client(alpha):
        train, _ = partition("dirichlet", y, y_test, 10, np.random.default_rng(0), alpha=alpha, min_examples=1)
        return np.mean([len(np.unique(y[p])) for p in train])

    assert classes_per_client(1000.0) == 10  # near IID: every client sees every class
    assert classes_per_client(0.01) < 4  # highly skewed: few classes per client


def test_dirichlet_min_examples():
    y = _labels(2000)
    train, _ = partition("dirichlet", y, _labels(400), 20, np.random.default_rng(3), alpha=0.1, min_examples=15)
    assert min(len(p) for p in train) >= 15


def test_pathological_classes_per_client():
    y = _labels(2000)
    train, _ = partition("pathological", y, _labels(400), 15, np.random.default_rng(0), classes_per_client=3)
    assert all(len(np.unique(y[p])) == 3 for p in train)


def test_client_dirichlet_sizes():
    y, y_test = _labels(5000), _labels(1000)
    train, test = partition(
        "client_dirichlet",
        y,
        y_test,
        8,
        np.random.default_rng(0),
        alpha=0.3,
        client_train_size=200,
        client_test_size=40,
    )
    assert [len(p) for p in train] == [200] * 8
    assert [len(p) for p in test] == [40] * 8


def test_test_split_follows_training_distribution():
    y, y_test = _labels(6000), _labels(3000, seed=5)
    train, test = partition("dirichlet", y, y_test, 10, np.random.default_rng(0), alpha=0.3)
    for tr, te in zip(train, test):
        p_train = np.bincount(y[tr], minlength=10) / len(tr)
        p_test = np.bincount(y_test[te], minlength=10) / max(len(te), 1)
        assert np.abs(p_train - p_test).sum() < 0.25
        assert set(np.unique(y_test[te])) <= set(np.unique(y[tr]))


@pytest.mark.parametrize(
    "name, clients, options, field",
    [
        ("dirichlet", 10, {"alpha": 0.0}, "alpha"),
        ("dirichlet", 10, {"alpha": -1.0}, "alpha"),
        ("iid", 5000, {}, "num_clients"),
        ("pathological", 10, {"classes_per_client": 11}, "classes_per_client"),
        ("client_dirichlet", 10, {"client_train_size": 1000}, "client_train_size"),
        ("shards", 10, {}, "partition"),
    ],
)
def test_bad_input_is_a_clear_error(name, clients, options, field):
    with pytest.raises(ConfigError, match=field):
        partition(name, _labels(2000), _labels(400), clients, np.random.default_rng(0), **options)
