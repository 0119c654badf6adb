import numpy as np
import pytest

from jaxfed.data import partition
from jaxfed.data.partition import PARTITIONERS, reduce_parts
from jaxfed.errors import ConfigError


def _labels(n=2000, classes=10, seed=0):
    return np.random.default_rng(seed).integers(0, classes, size=n)


@pytest.mark.parametrize("name", [p for p in PARTITIONERS if p != "resample"])  # resample shares by design
def test_every_client_non_empty_and_no_example_twice(name):
    y_train, y_test = _labels(3000), _labels(600, seed=1)
    options = {"client_train_size": 100, "client_test_size": 20}
    train, test = partition(name, y_train, y_test, 20, np.random.default_rng(1), **options)
    for parts, pool in ((train, y_train), (test, y_test)):
        flat = np.concatenate(parts)
        assert len(flat) == len(np.unique(flat)), "an example was given to two clients"
        assert flat.min() >= 0 and flat.max() < len(pool)
    assert all(len(p) > 0 for p in train)
    if name in ("iid", "dirichlet", "pathological", "label_groups"):
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
        ("label_groups", 10, {"num_groups": 11}, r"^num_groups \(the run key num_clusters\)"),
    ],
)
def test_bad_input_is_a_clear_error(name, clients, options, field):
    with pytest.raises(ConfigError, match=field):
        partition(name, _labels(2000), _labels(400), clients, np.random.default_rng(0), **options)


def test_label_groups_give_each_cluster_disjoint_labels_shared_by_its_clients():
    y_train, y_test = _labels(3000, classes=12), _labels(600, classes=12, seed=1)
    train, test = partition("label_groups", y_train, y_test, 8, np.random.default_rng(0), num_groups=3)
    for parts, labels in ((train, y_train), (test, y_test)):
        groups = [set(np.unique(labels[np.concatenate(parts[c::3])]).tolist()) for c in range(3)]
        assert [len(g) for g in groups] == [4, 4, 4] and set.union(*groups) == set(range(12))
        for k, part in enumerate(parts):  # client k holds only its group's labels, an equal share of them
            assert set(np.unique(labels[part]).tolist()) <= groups[k % 3]
            members = np.flatnonzero(np.isin(labels, list(groups[k % 3])))
            assert abs(len(part) - len(members) / len(parts[k % 3 :: 3])) <= 1
    assert groups == [set(np.unique(y_train[np.concatenate(train[c::3])]).tolist()) for c in range(3)]


def test_reduce_parts_keeps_a_fraction_but_at_least_min_examples():
    parts = [np.arange(0, 200), np.arange(200, 230), np.arange(230, 235)]
    kept = reduce_parts(parts, 0.9, 10, np.random.default_rng(0))
    assert [len(p) for p in kept] == [20, 10, 5]
    assert all(set(k) <= set(p) for k, p in zip(kept, parts))
    assert reduce_parts(parts, 0.0, 10, np.random.default_rng(0)) is parts
    with pytest.raises(ConfigError, match="train_reduction"):
        reduce_parts(parts, 1.0, 10, np.random.default_rng(0))


def test_resample_gives_every_client_its_own_draw_even_beyond_the_pool():
    y_train, y_test = _labels(300), _labels(60, seed=1)
    train, test = partition(
        "resample", y_train, y_test, 1000, np.random.default_rng(0), client_train_size=8, client_test_size=3
    )
    assert len(train) == 1000 and all(len(p) == 8 and len(np.unique(p)) == 8 for p in train)
    assert all(len(p) == 3 for p in test) and max(p.max() for p in train) < 300
    with pytest.raises(ConfigError, match="client_train_size"):
        partition("resample", y_train, y_test, 10, np.random.default_rng(0), client_train_size=301)


def test_the_fedcspack_authors_clients_are_a_partition_of_the_pooled_images(tmp_path):
    """experiments/fedcspack/authors_data.py: every pooled example in exactly one client's split,
    each client's test split ceil(25%) of its examples, and jaxfed reads the files it writes."""
    import subprocess
    import sys
    from pathlib import Path

    from jaxfed.data import load_partition

    labels = np.repeat(np.arange(10), 7000)  # Fashion-MNIST's 60 000 + 10 000, 7000 per class
    rng = np.random.default_rng(0)
    x = (np.arange(len(labels)) % 251).astype(np.uint8)[:, None, None] * np.ones((1, 2, 2), np.uint8)
    cut = rng.permutation(len(labels))
    train, test = cut[:60000], cut[60000:]
    np.savez(
        tmp_path / "fashion_mnist.npz", x_train=x[train], y_train=labels[train], x_test=x[test], y_test=labels[test]
    )
    script = Path(__file__).parents[1] / "experiments" / "fedcspack" / "authors_data.py"
    subprocess.run([sys.executable, str(script), str(tmp_path), str(tmp_path / "out")], check=True, capture_output=True)
    with np.load(tmp_path / "out" / "fashion_mnist.npz") as data:
        y_train, y_test = data["y_train"], data["y_test"]
    assert (
        len(y_train) + len(y_test) == 70000 and np.bincount(np.concatenate([y_train, y_test])).tolist() == [7000] * 10
    )
    parts = load_partition(tmp_path / "out" / "authors_parts.npz", 20, len(y_train), len(y_test))
    for split, size in zip(parts, (len(y_train), len(y_test))):
        assert np.array_equal(np.sort(np.concatenate(split)), np.arange(size))  # each example once
    for tr, te in zip(*parts):
        assert len(te) == int(np.ceil(0.25 * (len(tr) + len(te))))
    assert min(len(tr) + len(te) for tr, te in zip(*parts)) >= 64  # the authors' least_samples
