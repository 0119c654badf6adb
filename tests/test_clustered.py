"""Clustered tasks: each client's examples follow its cluster's transform (numpy reference)."""

import numpy as np
import pytest

from jaxfed.data import apply_cluster_task, client_clusters, partition
from jaxfed.errors import ConfigError
from jaxfed.runs.build import build
from jaxfed.runs.config import Config


def _parts(digits, n=6):
    return partition("dirichlet", digits.y_train, digits.y_test, n, np.random.default_rng(0), alpha=1.0)


def test_clients_are_assigned_round_robin():
    np.testing.assert_array_equal(client_clusters(6, 4), [0, 1, 2, 3, 0, 1])
    with pytest.raises(ConfigError, match=r"num_clusters: must be in 1..num_clients \(3\), got 4"):
        client_clusters(3, 4)


@pytest.mark.parametrize("task", ["rotation", "label_shift"])
def test_each_client_follows_its_cluster(digits, task):
    train, test = _parts(digits)
    shifted = apply_cluster_task(digits, train, test, task, 4)
    for k, (tr, te) in enumerate(zip(train, test)):
        c = k % 4
        for part, x0, y0, x1, y1 in (
            (tr, digits.x_train, digits.y_train, shifted.x_train, shifted.y_train),
            (te, digits.x_test, digits.y_test, shifted.x_test, shifted.y_test),
        ):
            for i in part[:5]:
                want_x = np.rot90(x0[i], c) if task == "rotation" else x0[i]
                want_y = y0[i] if task == "rotation" else (y0[i] + c) % 10
                np.testing.assert_array_equal(x1[i], want_x)
                assert y1[i] == want_y
    assert np.array_equal(digits.y_train, digits.y_train.copy())  # the input is not modified


def test_overlapping_splits_and_non_square_inputs_are_errors(digits):
    train, test = _parts(digits)
    with pytest.raises(ConfigError, match="cluster_task: the clients' train splits overlap"):
        apply_cluster_task(digits, [train[0], train[0]], test[:2], "label_shift", 2)
    flat = type(digits)(
        "flat",
        digits.x_train.reshape(len(digits.x_train), -1),
        digits.y_train,
        digits.x_test.reshape(len(digits.x_test), -1),
        digits.y_test,
        10,
    )
    with pytest.raises(ConfigError, match="cluster_task: rotation needs square images"):
        apply_cluster_task(flat, train, test, "rotation", 2)


def test_a_run_config_builds_the_clustered_federation(digits):
    built = build(Config(cluster_task="label_shift", num_clusters=2, num_clients=4, alpha=1.0))
    data = built.simulation.data
    client = 1  # cluster 1: labels shifted by one
    idx = np.asarray(data.train_idx[client])[: int(data.train_count[client])]
    plain_train, _ = partition(
        "dirichlet", digits.y_train, digits.y_test, 4, np.random.default_rng(0), alpha=1.0, min_examples=10
    )
    np.testing.assert_array_equal(np.sort(idx), np.sort(plain_train[client]))
    np.testing.assert_array_equal(np.asarray(data.y_train)[idx], (digits.y_train[idx] + 1) % 10)
    with pytest.raises(ConfigError, match="cluster_task: unknown 'mirror'"):
        Config(cluster_task="mirror").validate()


@pytest.mark.parametrize(("task", "distinct"), [("rotation", 4), ("label_shift", 10)])
def test_a_clustered_task_builds_as_many_clusters_as_it_has_distinct_transforms_and_no_more(digits, task, distinct):
    """Cluster c rotates by c x 90 degrees / shifts labels by c mod classes: cluster ``distinct``
    would repeat cluster 0's task (IFCA, FLoRAL's oracle router and cluster recovery would be
    scored against clusters no model can tell apart), so one more is refused, naming the key."""
    train, test = _parts(digits, distinct + 1)
    assert apply_cluster_task(digits, train[:distinct], test[:distinct], task, distinct).x_train.shape == (
        digits.x_train.shape
    )
    with pytest.raises(ConfigError, match=f"num_clusters: {task} has {distinct} distinct"):
        apply_cluster_task(digits, train, test, task, distinct + 1)
