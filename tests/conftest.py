"""Shared fixtures: the embedded digits data and small federations built from it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxfed.data import federate, load_dataset, partition
from jaxfed.nn import get_model

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

# Many tests compile the same small simulations (and subprocesses inherit the environment):
# a persistent compilation cache for the session cuts the suite's time without changing results.
_CACHE = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jaxfed-test-xla-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


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
