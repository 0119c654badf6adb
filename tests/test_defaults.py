"""Every algorithm's defaults on every dataset's default model: a few rounds that stay finite.

A user who runs a paper's method with its defaults on the default model for a dataset must get
a run that learns, not NaN in round 1 (FedLoRU did: its lr 0.1 with momentum 0.9 needs the
authors' gradient clipping). Real MNIST or CIFAR cannot be read here, so each dataset is stood in
for by the embedded digits resized to its image shape (nearest neighbour, uint8 like the real
files, normalized by the same loader): the same models, inputs of the same shape and scale,
and examples with real structure (on this stand-in FedLoRU's old defaults diverge as on MNIST).
"""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits

from jaxfed.algorithms import registry
from jaxfed.build import build
from jaxfed.config import Config
from jaxfed.data import DATASETS, SYNTHETIC_TASKS, default_model

IMAGE_SHAPES = {"mnist": (28, 1), "fashion_mnist": (28, 1), "cifar10": (32, 3), "cifar100": (32, 3)}
# One dataset per distinct default model and input shape (fashion_mnist is mnist's shape and model).
DATASETS_BY_MODEL = ["digits", "mnist", "cifar10", "cifar100", *SYNTHETIC_TASKS]


def _stand_in(name: str, directory) -> None:
    """``directory/<name>.npz``: digits resized to the dataset's images, 1400 / 397 examples."""
    size, channels = IMAGE_SHAPES[name]
    digits = load_digits()
    rows = np.arange(size) * 8 // size
    x = (digits.images * 255 / 16).astype(np.uint8)[:, rows][:, :, rows]
    x = np.repeat(x[..., None], channels, -1) if channels > 1 else x
    order = np.random.default_rng(0).permutation(len(x))
    train, test = order[:1400], order[1400:]
    np.savez(directory / f"{name}.npz", x_train=x[train], y_train=digits.target[train], x_test=x[test],
             y_test=digits.target[test])  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("stand_in")
    for name in IMAGE_SHAPES:
        _stand_in(name, directory)
    return str(directory)


def test_the_grid_covers_every_default_model():
    assert {default_model(d) for d in DATASETS_BY_MODEL} == {default_model(d) for d in [*DATASETS, *SYNTHETIC_TASKS]}


@pytest.mark.parametrize("dataset", DATASETS_BY_MODEL)
@pytest.mark.parametrize("algorithm", registry.names())
def test_defaults_stay_finite_on_the_default_model(algorithm, dataset, data_dir):
    config = Config(algorithm=algorithm, dataset=dataset, data_dir=data_dir, num_clients=6, participation=1.0,
                    samples_per_client=60, client_chunk=0).validate()  # fmt: skip
    sim = build(config).simulation
    state, metrics = sim.run_rounds(sim.init(), 2)  # raises NonFiniteUpdateError on NaN / inf
    assert np.isfinite(np.asarray(metrics["train_loss"])).all()
    evaluation = sim.evaluate(state)
    assert all(np.isfinite(v) for v in evaluation.values() if v is not None)
