"""Shared fixtures: the embedded digits data and small federations built from it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxfed.data import federate, load_dataset, partition
from jaxfed.nn import get_model

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="session")
def mlp(digits):
    return get_model("mlp", digits.input_shape, digits.num_classes)


def make_federation(dataset, num_clients=10, name="dirichlet", seed=0, **options):
    train, test = partition(name, dataset.y_train, dataset.y_test, num_clients, np.random.default_rng(seed), **options)
    return federate(dataset, train, test)


@pytest.fixture(scope="session")
def digits_federation(digits):
    return make_federation(digits, num_clients=10, alpha=0.5)


def shared_data_dir():
    """``../shared/data`` beside the repository when present (offline MNIST etc.)."""
    return SHARED_DATA if (SHARED_DATA / "mnist.npz").exists() else None
