"""Every algorithm's defaults learn: a few rounds on the default model, above chance.

A user who runs a paper's method with its defaults on the default model for a dataset must get
a run that learns, not NaN in round 1 (FedLoRU did on MNIST: its lr 0.1 with momentum 0.9 needs
the authors' gradient clipping). Real MNIST cannot be read here, so it is stood in for by the
embedded digits resized to 28 x 28 (nearest neighbour, uint8 like the real file, normalized by
the same loader): the same CNN, inputs of the same shape and scale, examples with real structure
(on it FedLoRU's old defaults collapse to one class, as they go to NaN on MNIST). Every training
recipe runs on digits' default model here (FedAvg's once, for the baselines that share it): the
papers' methods' and FedAvg's in the default run, the other baselines' in the ``slow`` run
(``python -m pytest -m slow``: tests/conftest.py's PAPER_METHODS); the whole grid (every algorithm
on every dataset's default model, the CIFAR shapes and ResNet included) is
``experiments/defaults/grid.py``, too slow for the suite.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import MODEL_NEEDS, PAPER_METHODS, paper_methods_by_default
from sklearn.datasets import load_digits

from jaxfed.algorithms import registry
from jaxfed.runs.build import build
from jaxfed.runs.config import Config

CHANCE = 0.1  # ten classes


def stand_in(name: str, directory, size: int, channels: int) -> None:
    """``directory/<name>.npz``: digits resized to ``size x size x channels`` images, uint8."""
    digits = load_digits()
    rows = np.arange(size) * 8 // size
    x = (digits.images * 255 / 16).astype(np.uint8)[:, rows][:, :, rows]
    x = np.repeat(x[..., None], channels, -1) if channels > 1 else x
    order = np.random.default_rng(0).permutation(len(x))
    train, test = order[:1400], order[1400:]
    arrays = {"x_train": x[train], "y_train": digits.target[train], "x_test": x[test], "y_test": digits.target[test]}
    np.savez(directory / f"{name}.npz", **arrays)


def learns(config: Config, rounds: int = 2) -> float:
    """The personalized accuracy after ``rounds`` rounds in which no client update was non-finite
    and every training loss is finite: the rounds and the evaluation as one compiled program."""
    sim = build(config.validate()).simulation

    def rounds_then_evaluation(state):
        state, metrics = sim.rounds_pure(state, sim.data, rounds)
        accuracy = sim.evaluate_pure(state, sim.data)["personalized_acc_mean"]
        return metrics["nonfinite_clients"], metrics["train_loss"], accuracy

    nonfinite, train_loss, accuracy = jax.jit(rounds_then_evaluation)(sim.init())
    assert not np.any(np.asarray(nonfinite)) and np.isfinite(np.asarray(train_loss)).all()
    return float(accuracy)


# pFedGate's defaults (the authors' CIFAR-10 command: one epoch of batch 128) take 2 steps a round
# on digits, and its gated model (every block scaled by a gate of about 0.5 at the start) learns
# slower than the model alone: personalized accuracy 0.179 after 2 rounds, 0.215 after 4, 0.287
# after 6 (FedAvg with the same optimizer: 0.611 after 2).
ROUNDS = {"pfedgate": 6}


# FedAvg's training recipe (its lr, momentum, batch size, epochs, clipping, decay, optimizer), which
# many baselines train with, adding weights of their own: FedAvg stands for the recipe here, and the
# others' weights are their own files' (every algorithm on every dataset's default model, these
# included: `python experiments/defaults/grid.py --datasets digits`, slow).
RECIPE = ("lr", "momentum", "batch_size", "local_epochs", "clip_norm", "weight_decay", "client_optimizer")


def training_recipe(algorithm: str) -> tuple:
    options = Config(algorithm=algorithm).options
    return tuple((key, getattr(options, key)) for key in RECIPE if options.field_for(key))


# pFedES trains with pFedAFM's recipe (the same authors' code: SGD lr 0.01, momentum 0.9, decay 1e-3,
# clipping 50, batch 512, 10 epochs), its G phase on digits' default model the slowest of the suite's
# defaults checks: pFedAFM stands for the recipe (the check below fails if either changes its own).
SAME_RECIPE_AS = {"pfedes": "pfedafm"}
OWN_RECIPES = [
    a
    for a in registry.names()
    if a not in SAME_RECIPE_AS and (a == "fedavg" or training_recipe(a) != training_recipe("fedavg"))
]


def test_the_recipe_check_leaves_out_only_algorithms_whose_recipe_another_runs():
    """The baselines known to train with FedAvg's recipe, and those with another's, no more (a new
    one is a choice to make here)."""
    shares_fedavgs = {"fedprox", "local", "fedper", "fedbn", "ditto", "moon", "fedntd", "fedspu", "fedrod"}
    shares_fedavgs |= {"fedproto", "ifca", "fedala", "fedbabu", "fedamp", "fedcac", "pfedsd"}
    assert set(registry.BUILTINS) - set(OWN_RECIPES) == shares_fedavgs | set(SAME_RECIPE_AS)  # not other tests' plugins
    assert PAPER_METHODS <= set(OWN_RECIPES)  # the default run's (a name misspelt there would go to the slow run)
    for name, stand_in_for in SAME_RECIPE_AS.items():
        assert stand_in_for in OWN_RECIPES and training_recipe(name) == training_recipe(stand_in_for)


@pytest.mark.parametrize("algorithm", paper_methods_by_default(OWN_RECIPES))
def test_every_algorithms_defaults_learn_on_digits(algorithm):
    config = Config(algorithm=algorithm, num_clients=6, participation=1.0).with_overrides(
        MODEL_NEEDS.get(algorithm, [])
    )
    assert learns(config, ROUNDS.get(algorithm, 2)) > 2 * CHANCE


# The papers' lr with momentum on mnist's un-normalized CNN: FedLoRU's needs the authors' clipping
# (old defaults: 0.0716, one class). The FedLoRU family shares these training defaults. The other
# CNN checks (FedDecomp's momentum 0 on this CNN, FLoRAL's CIFAR-10 recipe) are the conv grid's:
# `python experiments/defaults/grid.py` (every algorithm on every dataset's default model; slow).
def test_fedlorus_defaults_learn_on_the_mnist_cnn(tmp_path):
    stand_in("mnist", tmp_path, 28, 1)
    config = Config(algorithm="fedloru", dataset="mnist", data_dir=str(tmp_path), num_clients=4, participation=1.0,
                    train_reduction=0.8)  # fmt: skip
    assert learns(config) > 2 * CHANCE


def test_the_floral_familys_cifar10_recipe_is_its_default_on_cifar10():
    """local_adaptor with FLoRAL's MNIST lr (0.1) gives NaN in round 1 on the CIFAR-10 CNN (its
    preconditioned conv adaptors): on cifar10 its defaults are the authors' CIFAR-10 recipe (it
    learns there: experiments/defaults/grid.md)."""
    config = Config(algorithm="local_adaptor", dataset="cifar10")
    assert (config.options.lr, config.options.batch_size) == (0.03, 64)
