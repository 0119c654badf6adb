"""Datasets, partitioners and the on-device federated dataset."""

from jaxfed.data.clustered import CLUSTER_TASKS, apply_cluster_task, client_clusters
from jaxfed.data.datasets import DATASETS, Dataset, default_model, load_dataset
from jaxfed.data.federated import Batch, ClientData, FederatedData, federate, index_table
from jaxfed.data.partition import (
    FILE_PARTITION,
    PARTITIONERS,
    describe,
    load_partition,
    partition,
    reduce_parts,
    save_partition,
    summarize,
)
from jaxfed.data.synthetic import SYNTHETIC_TASKS, auto_samples_per_client, synthetic_task
from jaxfed.data.validate import DataError, DataWarning

__all__ = [
    "CLUSTER_TASKS",
    "DATASETS",
    "FILE_PARTITION",
    "PARTITIONERS",
    "SYNTHETIC_TASKS",
    "Batch",
    "ClientData",
    "DataError",
    "DataWarning",
    "Dataset",
    "FederatedData",
    "apply_cluster_task",
    "auto_samples_per_client",
    "client_clusters",
    "default_model",
    "describe",
    "federate",
    "index_table",
    "load_dataset",
    "load_partition",
    "partition",
    "reduce_parts",
    "save_partition",
    "summarize",
    "synthetic_task",
]
