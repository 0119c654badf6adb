"""FedALA against its definition written another way.

The adaptive local aggregation ``theta + (Theta - theta) * W`` in numpy; the weights' learning as a
plain Python loop of the authors' rule (``W <- clip(W - eta * dL/dtheta_hat * (Theta - theta), 0, 1)``,
the chain rule written out, one pass a round or, the first time, passes until the std of the last
``num_pre_loss`` passes' losses is below ``threshold``) on the same batches; then FedAvg's local
training of the aggregated model (``train_classifier``). Its defaults learning and its BatchNorm
statistics staying private are tests/test_defaults.py's and tests/test_privacy.py's.
"""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import one_client, round_info

from jaxfed.algorithms.fedala import aggregate, fedala, sample_positions, top_layer_keys
from jaxfed.algorithms.training import shuffled_positions, train_classifier
from jaxfed.errors import ConfigError
from jaxfed.nn import Model
from jaxfed.nn.models import Norm
from jaxfed.options import sgd


@pytest.fixture(scope="module")
def models(mlp):
    """A local model ``theta`` and a global model ``Theta`` far from each other."""
    init = jax.jit(mlp.init)
    return init(jax.random.key(0))["params"], init(jax.random.key(1))["params"]


def _mixed_head(theta, big_theta, w):
    """The head of ``theta_hat`` in numpy float64."""
    return {k: np.float64(theta["head"][k]) + (np.float64(big_theta["head"][k]) - theta["head"][k]) * w[k]
            for k in ("kernel", "bias")}  # fmt: skip


def test_aggregation_mixes_the_top_layers_and_takes_the_global_model_below(models):
    theta, big_theta = models
    ones = {k: np.ones(v.shape, np.float32) for k, v in theta["head"].items()}
    rng = np.random.default_rng(0)
    for w in (ones, jax.tree.map(np.zeros_like, ones), jax.tree.map(lambda x: rng.uniform(size=x.shape), ones)):
        got = aggregate(theta, big_theta, {"head": jax.tree.map(jnp.asarray, w)})
        chex.assert_trees_all_equal({k: got[k] for k in ("fc1", "fc2")}, {k: big_theta[k] for k in ("fc1", "fc2")})
        chex.assert_trees_all_close(got["head"], _mixed_head(theta, big_theta, w), rtol=1e-6, atol=1e-7)
    # W = 1: the global head; W = 0: the client's own head, exactly
    chex.assert_trees_all_close(aggregate(theta, big_theta, {"head": ones})["head"], big_theta["head"], atol=1e-7)
    chex.assert_trees_all_equal(aggregate(theta, big_theta, {"head": jax.tree.map(np.zeros_like, ones)})["head"],
                                theta["head"])  # fmt: skip


def test_the_top_layers_are_the_parameter_layers_nearest_the_output(mlp, digits):
    assert top_layer_keys(mlp, 1) == ["head"] and top_layer_keys(mlp, 2) == ["fc2", "head"]
    with pytest.raises(ConfigError, match=r"^top_layers: 4 is more than the model's 3 layers \(fc1, fc2, head\)$"):
        fedala(mlp, top_layers=4)

    class NormNet(nn.Module):  # a normalization layer between two Dense layers counts as a layer
        @nn.compact
        def __call__(self, x, train=False, mask=None):
            h = Norm("batch")(nn.Dense(8)(x.reshape(x.shape[0], -1)), train, mask)
            return nn.Dense(10, name="head")(nn.relu(h))

    model = Model("norm_net", NormNet(), digits.input_shape)
    assert top_layer_keys(model, 3) == ["Dense_0", "Norm_0.BatchNorm_0", "head"]


def test_the_random_subset_is_rand_percent_of_the_clients_own_examples(digits_federation):
    data = one_client(digits_federation, 8)  # 83 examples
    positions, batches = sample_positions(data, jax.random.key(3), 80, 16)
    real = np.asarray(positions)[np.asarray(positions) < 83]
    assert len(real) == 83 * 80 // 100 == len(set(real.tolist())) and int(batches) == -(-66 // 16)
    assert np.all(np.asarray(positions)[66:] >= 83) and positions.shape == (-(-179 // 16) * 16,)
    other, _ = sample_positions(data, jax.random.key(4), 80, 16)
    assert set(real.tolist()) != set(np.asarray(other)[:66].tolist())


TRAIN = {"lr": 0.1, "local_epochs": 1, "batch_size": 16}
ALA = {"eta": 2.0, "rand_percent": 80, "threshold": 0.01, "num_pre_loss": 5, "max_passes": 60}
ROWS = 128  # the reference pads every batch to this many rows


@pytest.fixture(scope="module")
def update(mlp):
    """One FedALA client update, compiled once for the tests below (a client of 83 examples:
    a subset of 66, four batches of 16 and one of 2)."""
    return jax.jit(fedala(mlp, **ALA, **TRAIN).client_update)


@pytest.fixture(scope="module")
def fedavg_training(mlp):
    """FedAvg's local training of ``params`` (``train_classifier``), compiled once."""
    return jax.jit(lambda params, data, rng: train_classifier(mlp, sgd(0.1), {"params": params}, data, rng, epochs=1,
                                                              batch_size=16)[0]["params"])  # fmt: skip


@functools.cache
def _loss_and_grad(model):
    @jax.jit
    def loss_and_grad(params, x, y, real):
        def loss(p):
            logits, _ = model.apply({"params": p}, x, train=True)
            return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, y) * real) / jnp.sum(real)

        return jax.value_and_grad(loss)(params)

    return loss_and_grad


def _reference_ala(mlp, theta, big_theta, w, data, rng, *, passes, settle):
    """The weights' learning as a Python loop: the subset is the first ``rand_percent``% of the
    client's shuffled positions (``shuffled_positions`` on the ALA key), batched in order, the same
    batches every pass; each step's gradient is dL/dtheta_hat (of the plain model) times
    (Theta - theta), the authors' rule. Returns ``(W, theta_hat, passes)``."""
    count, max_examples, size = int(data.count), data.indices.shape[0], ALA["rand_percent"]
    order = np.asarray(shuffled_positions(rng, data.count, max_examples, max_examples))[: count * size // 100]
    examples = np.asarray(data.indices)[order]
    batches = [examples[i : i + TRAIN["batch_size"]] for i in range(0, len(examples), TRAIN["batch_size"])]
    loss_and_grad = _loss_and_grad(mlp)
    delta = {k: np.float32(big_theta["head"][k]) - np.float32(theta["head"][k]) for k in ("kernel", "bias")}
    mixed = lambda w: {**big_theta, "head": {k: np.float32(theta["head"][k]) + delta[k] * w[k] for k in w}}  # noqa: E731
    losses = []
    for _ in range(passes):
        for idx in batches:
            rows = np.pad(idx, (0, ROWS - len(idx)))
            value, grads = loss_and_grad(mixed(w), data.x[rows], data.y[rows], np.arange(ROWS) < len(idx))
            w = {k: np.clip(w[k] - ALA["eta"] * np.asarray(grads["head"][k]) * delta[k], 0.0, 1.0) for k in w}
        losses.append(float(value))
        if settle and len(losses) > ALA["num_pre_loss"] and np.std(losses[-ALA["num_pre_loss"] :]) < ALA["threshold"]:
            break
    return w, mixed(w), len(losses)


def _state(mlp, theta, w, rounds):
    _, client = fedala(mlp).init(jax.random.key(0))
    return client._replace(params=theta, weights={"head": jax.tree.map(jnp.asarray, w)}, rounds=jnp.int32(rounds))


def _check_round(models, mlp, digits_federation, update, fedavg_training, w, rounds, passes, settle):
    """A round of a client that trained ``rounds`` rounds before: ALA (against the reference), then
    FedAvg's training of theta_hat with the key's second half. Returns the new W and the passes."""
    theta, big_theta = models
    data, rng = one_client(digits_federation, 8), jax.random.key(5)
    state, upload, metrics = update(big_theta, _state(mlp, theta, w, rounds), data, rng, round_info(4))
    ala_rng, train_rng = jax.random.split(rng)
    want_w, want_start, want_passes = _reference_ala(mlp, theta, big_theta, w, data, ala_rng, passes=passes,
                                                     settle=settle)  # fmt: skip
    chex.assert_trees_all_close(state.weights["head"], want_w, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(upload, fedavg_training(want_start, data, train_rng), rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_equal(state.params, upload)
    assert float(metrics["ala_passes"]) == want_passes and int(state.rounds) == rounds + 1
    assert float(metrics["steps"]) == -(-83 // 16) + want_passes * -(-66 // 16)  # training's steps and W's
    return np.asarray(state.weights["head"]["kernel"]), want_passes


def test_a_later_round_makes_one_pass_of_clipped_gradient_steps_on_w(models, mlp, digits_federation, update,
                                                                      fedavg_training):  # fmt: skip
    """W starts anywhere in [0, 1], some entries at each end, so that the clip acts at both."""
    rng = np.random.default_rng(1)
    w = jax.tree.map(lambda x: np.clip(rng.uniform(-0.3, 1.3, x.shape), 0, 1).astype(np.float32), models[0]["head"])
    kernel, passes = _check_round(models, mlp, digits_federation, update, fedavg_training, w, 2, passes=1, settle=False)
    assert passes == 1 and (kernel == 0).any() and (kernel == 1).any() and ((kernel > 0) & (kernel < 1)).any()


def test_the_first_ala_trains_w_until_its_losses_settle(models, mlp, digits_federation, update, fedavg_training):
    """The client's second round (its first ALA): W from ones, passes until the std rule holds."""
    ones = jax.tree.map(lambda x: np.ones(x.shape, np.float32), models[0]["head"])
    kernel, passes = _check_round(models, mlp, digits_federation, update, fedavg_training, ones, 1,
                                  passes=ALA["max_passes"], settle=True)  # fmt: skip
    assert ALA["num_pre_loss"] < passes < ALA["max_passes"]  # stopped by the rule, not the cap
    assert not np.allclose(kernel, 1.0)


def test_the_first_ala_stops_after_num_pre_loss_plus_one_passes_of_equal_losses(models, mlp, digits_federation,
                                                                                update):  # fmt: skip
    """theta = Theta: W cannot move (its gradient is a multiple of Theta - theta), every pass's loss
    is the same, and the authors' rule (more than num_pre_loss losses recorded) stops at the 6th."""
    big_theta = models[1]
    ones = jax.tree.map(lambda x: np.ones(x.shape, np.float32), big_theta["head"])
    data = one_client(digits_federation, 8)
    state, _, metrics = update(big_theta, _state(mlp, big_theta, ones, 1), data, jax.random.key(5), round_info(4))
    assert float(metrics["ala_passes"]) == ALA["num_pre_loss"] + 1
    chex.assert_trees_all_equal(state.weights["head"], ones)


def test_a_clients_first_round_is_fedavgs_and_leaves_w_alone(models, mlp, digits_federation, update,
                                                             fedavg_training):  # fmt: skip
    """A client that never trained (theta the initialization) starts from the global model."""
    theta, big_theta = models
    data, rng = one_client(digits_federation, 8), jax.random.key(5)
    _, client = fedala(mlp).init(jax.random.key(0))
    state, upload, metrics = update(big_theta, client, data, rng, round_info(4))
    chex.assert_trees_all_close(upload, fedavg_training(big_theta, data, jax.random.split(rng)[1]), rtol=1e-5,
                                atol=1e-6)  # fmt: skip
    chex.assert_trees_all_equal(state.weights, client.weights)
    assert float(metrics["ala_passes"]) == 0 and int(state.rounds) == 1
