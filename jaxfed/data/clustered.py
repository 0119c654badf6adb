"""Clustered tasks (FLoRAL's): clients in C ground-truth clusters, each cluster transforming data.

Client k belongs to cluster ``k mod C``. ``rotation``: cluster c rotates its images by ``c * 90``
degrees. ``label_shift``: cluster c maps labels ``y -> (y + c) mod num_classes``. The transform
is applied to each client's own training and test examples (client splits are disjoint), so the
federated arrays stay one copy of the dataset.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxfed.errors import ConfigError, unknown_choice

CLUSTER_TASKS = ("none", "rotation", "label_shift")
ROTATIONS = 4  # rotation: cluster c turns by c x 90 degrees, so 4 distinct clusters at most


def client_clusters(num_clients: int, num_clusters: int) -> np.ndarray:
    """``[num_clients]``: the ground-truth cluster of every client, ``k mod C``."""
    if not 1 <= num_clusters <= num_clients:
        raise ConfigError(f"num_clusters: must be in 1..num_clients ({num_clients}), got {num_clusters}")
    return np.arange(num_clients) % num_clusters


def _check_disjoint(parts, size: int, split: str) -> None:
    owners = np.bincount(
        np.concatenate([np.asarray(p, np.int64) for p in parts] + [np.zeros(0, np.int64)]), minlength=size
    )
    if np.any(owners > 1):
        raise ConfigError(f"cluster_task: the clients' {split} splits overlap; a clustered task needs disjoint splits")


def apply_cluster_task(dataset, train_parts, test_parts, task: str, num_clusters: int):
    """A copy of ``dataset`` in which each client's examples follow its cluster's transform."""
    if task not in CLUSTER_TASKS:
        raise ConfigError(f"cluster_task: {unknown_choice(task, CLUSTER_TASKS)}")
    if task == "none":
        return dataset
    clusters = client_clusters(len(train_parts), num_clusters)
    distinct = ROTATIONS if task == "rotation" else dataset.num_classes
    if num_clusters > distinct:  # cluster c and c + distinct would share one transform
        raise ConfigError(
            f"num_clusters: {task} has {distinct} distinct cluster transforms, got {num_clusters} clusters "
            f"(cluster {distinct} would repeat cluster 0's); use at most {distinct}"
        )
    if task == "rotation" and (dataset.x_train.ndim < 3 or dataset.x_train.shape[1] != dataset.x_train.shape[2]):
        raise ConfigError(f"cluster_task: rotation needs square images, got inputs of shape {dataset.input_shape}")
    arrays = {}
    for split, parts in (("train", train_parts), ("test", test_parts)):
        x, y = getattr(dataset, f"x_{split}").copy(), getattr(dataset, f"y_{split}").copy()
        _check_disjoint(parts, len(y), split)
        for cluster, part in zip(clusters, parts):
            if task == "rotation":
                x[part] = np.rot90(x[part], k=int(cluster), axes=(1, 2))
            else:
                y[part] = (y[part] + cluster) % dataset.num_classes
        arrays[f"x_{split}"], arrays[f"y_{split}"] = x, y
    return dataclasses.replace(dataset, **arrays)
