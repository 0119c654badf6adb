"""FLoRAL's synthetic regression tasks: C ground-truth clusters that differ by a low-rank matrix.

Client k is in cluster ``c = k mod C`` and sees ``x ~ N(0, I_d)`` with

- ``synthetic_linear``: ``y = (x W_c + b)[:outputs]``,
- ``synthetic_mlp``:    ``y = relu(x W_c + b) W_out``,

where ``W_c = W + scale * U_c V_c`` (``U_c [d, r]``, ``V_c [r, d]``). As in the authors' code,
``W, U, b, W_out`` are ``N(0, 1/d)`` and ``V`` is ``N(0, 1/r)``. Each client gets
``samples_per_client`` examples, the first ``round(0.8 n)`` to train and the rest to test, so a
client has fewer examples than the model has parameters. Targets are float32 ``[n, outputs]``:
the loss and the metrics are mean squared errors.
"""

from __future__ import annotations

import numpy as np

from jaxfed.data.clustered import client_clusters
from jaxfed.data.datasets import Dataset
from jaxfed.errors import ConfigError

SYNTHETIC_TASKS = ("synthetic_linear", "synthetic_mlp")
DEFAULT_OUTPUTS = {"synthetic_linear": 3, "synthetic_mlp": 1}
SAMPLES_PER_PARAMETER = {"synthetic_linear": 0.25, "synthetic_mlp": 0.5}  # the authors' data-to-parameter ratios
TRAIN_FRACTION = 0.8


def ground_truth(rng: np.random.Generator, dim: int, outputs: int, num_clusters: int, rank: int) -> dict:
    """``{"W" [d, d], "U" [C, d, r], "V" [C, r, d], "b" [d], "W_out" [d, outputs]}``."""
    normal = rng.standard_normal
    return dict(
        W=normal((dim, dim)) / np.sqrt(dim),
        U=normal((num_clusters, dim, rank)) / np.sqrt(dim),
        V=normal((num_clusters, rank, dim)) / np.sqrt(rank),
        b=normal(dim) / np.sqrt(dim),
        W_out=normal((dim, outputs)) / np.sqrt(dim),
    )


def cluster_targets(task: str, truth: dict, x: np.ndarray, cluster: int, scale: float, outputs: int):
    """The targets of inputs ``x [n, d]`` under cluster ``cluster``'s model (float64)."""
    hidden = x @ (truth["W"] + scale * truth["U"][cluster] @ truth["V"][cluster]) + truth["b"]
    if task == "synthetic_linear":
        return hidden[:, :outputs]
    return np.maximum(hidden, 0.0) @ truth["W_out"]


def synthetic_task(
    task: str,
    num_clients: int,
    num_clusters: int,
    samples_per_client: int,
    rng: np.random.Generator,
    *,
    dim: int = 10,
    outputs: int = 0,
    rank: int = 1,
    scale: float = 2.0,
):
    """``(dataset, train_parts, test_parts)``: client k's examples from cluster ``k mod C``."""
    if task not in SYNTHETIC_TASKS:
        raise ConfigError(f"dataset: unknown synthetic task '{task}'; allowed: {', '.join(SYNTHETIC_TASKS)}")
    outputs = outputs or DEFAULT_OUTPUTS[task]
    if task == "synthetic_linear" and not 1 <= outputs <= dim:
        raise ConfigError(f"synthetic_outputs: synthetic_linear needs 1..synthetic_dim ({dim}), got {outputs}")
    if samples_per_client < 2:
        raise ConfigError(f"samples_per_client: must be >= 2 (a train and a test example), got {samples_per_client}")
    if not 1 <= rank <= dim:
        raise ConfigError(f"synthetic_rank: must be in 1..synthetic_dim ({dim}), got {rank}")
    clusters = client_clusters(num_clients, num_clusters)
    truth = ground_truth(rng, dim, outputs, num_clusters, rank)
    x = rng.standard_normal((num_clients, samples_per_client, dim))
    y = np.stack([cluster_targets(task, truth, x[k], c, scale, outputs) for k, c in enumerate(clusters)])
    n_train = min(max(round(TRAIN_FRACTION * samples_per_client), 1), samples_per_client - 1)
    dataset = Dataset(
        name=task,
        x_train=x[:, :n_train].reshape(-1, dim).astype(np.float32),
        y_train=y[:, :n_train].reshape(-1, outputs).astype(np.float32),
        x_test=x[:, n_train:].reshape(-1, dim).astype(np.float32),
        y_test=y[:, n_train:].reshape(-1, outputs).astype(np.float32),
        num_classes=outputs,
    )
    n_test = samples_per_client - n_train
    train_parts = [np.arange(k * n_train, (k + 1) * n_train) for k in range(num_clients)]
    test_parts = [np.arange(k * n_test, (k + 1) * n_test) for k in range(num_clients)]
    return dataset, train_parts, test_parts


def auto_samples_per_client(task: str, num_parameters: int) -> int:
    """The authors' client size: their data-to-parameter ratio times the model's parameter count."""
    return max(round(SAMPLES_PER_PARAMETER[task] * num_parameters), 2)
