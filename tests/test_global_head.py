"""LG-FedAvg and FedGH against their rules written out: the client as Local's update from its own
extractor under the received head, FedGH's prototypes as numpy class means, LG-FedAvg's server as
the sample-weighted mean of the heads, FedGH's as SGD on the written-out cross-entropy of the
prototypes, evaluation as the extractor's features times the server's head; an engine round as its
clients one by one, then the server."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import clients_one_by_one, make_federation, module_features, one_client, round_info

from jaxfed import server_step
from jaxfed.algorithms.global_head import (
    FedGHOptions,
    GlobalHead,
    GlobalHeadOptions,
    fedgh,
    head_loss,
    lg_fedavg,
)
from jaxfed.algorithms.local import local
from jaxfed.algorithms.prototype_sgd import Upload, train_on_prototypes
from jaxfed.core import lowrank
from jaxfed.errors import ConfigError
from jaxfed.runs.config import Config
from jaxfed.simulation import Simulation

OPTIONS = {"lr": 0.1, "local_epochs": 2, "batch_size": 16}
BUILDERS = {"lg_fedavg": lg_fedavg, "fedgh": fedgh}


def random_head(seed, features=200, classes=10):
    kernel, bias = jax.random.split(jax.random.key(seed))
    return {"kernel": 0.1 * jax.random.normal(kernel, (features, classes)), "bias": jax.random.normal(bias, (classes,))}


@pytest.mark.parametrize("name", BUILDERS)
def test_a_client_trains_its_own_extractor_under_the_received_head(name, mlp, digits_federation):
    """The update is Local's (tested against a per-client loop) from the client's model with its
    head replaced by the message; LG-FedAvg uploads the trained head, FedGH the class means of the
    trained model's features (numpy), the class counts and its id."""
    alg = BUILDERS[name](mlp, **OPTIONS)
    _, client = alg.init(jax.random.key(0))
    client = alg.init_client(client, 4, 0)
    data, rng = one_client(digits_federation, 4), jax.random.key(5)
    received = random_head(1)
    new, upload, _ = jax.jit(alg.client_update)(received, client, data, rng, round_info(3))

    under = lowrank.replace_layer(client.params, "head", received)
    reference = local(mlp, **OPTIONS)
    want, _, _ = jax.jit(reference.client_update)((), reference.init(jax.random.key(0))[1]._replace(
        variables={"params": under}), data, rng, round_info(3))  # fmt: skip
    chex.assert_trees_all_equal(new.params, want.variables["params"])
    assert not np.allclose(new.params["head"]["kernel"], received["kernel"], atol=1e-3)  # trained from it
    if name == "lg_fedavg":
        chex.assert_trees_all_equal(upload, new.params["head"])
        return
    idx = np.asarray(data.indices[: int(data.count)])
    x, y = np.asarray(data.x)[idx], np.asarray(data.y)[idx]
    z = np.asarray(module_features(mlp, new.params, jnp.asarray(x)), np.float64)
    counts = np.bincount(y, minlength=10)
    means = np.stack([z[y == c].mean(0) if counts[c] else np.zeros(z.shape[1]) for c in range(10)])
    np.testing.assert_allclose(upload.means, means, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(upload.counts, counts)
    assert int(upload.id) == int(new.id) == 4


def test_lg_fedavgs_server_head_is_the_sample_weighted_mean_of_the_heads(mlp):
    alg = lg_fedavg(mlp)
    server, _ = alg.init(jax.random.key(0))
    chex.assert_trees_all_equal(server.head, mlp.init(jax.random.key(0))["params"]["head"])  # the shared start's
    heads = [random_head(seed) for seed in range(3)]
    weights = np.asarray([30.0, 0.0, 10.0])  # a weight-0 row (padding, a skipped client) counts nothing
    stacked = jax.tree.map(lambda *h: jnp.stack(h), *heads)
    new = server_step(alg, server, stacked, jnp.asarray(weights))
    for part in ("kernel", "bias"):
        want = sum(w * np.asarray(h[part], np.float64) for w, h in zip(weights, heads)) / weights.sum()
        np.testing.assert_allclose(new.head[part], want, rtol=1e-5, atol=1e-6)


def reference_cross_entropy(layer, x, y, mask):
    """The masked mean of ``-log softmax(x W + b)_y``, the log-sum-exp written out."""
    logits = x @ layer["kernel"] + layer["bias"]
    top = jnp.max(logits, axis=1, keepdims=True)
    log_norm = top[:, 0] + jnp.log(jnp.sum(jnp.exp(logits - top), axis=1))
    picked = jnp.take_along_axis(logits, y[:, None], axis=1)[:, 0]
    return jnp.sum(mask * (log_norm - picked)) / jnp.sum(mask)


def test_fedghs_server_trains_the_head_by_sgd_on_the_held_prototypes():
    """One batch holds every held prototype: ``epochs`` steps of full-batch gradient descent on the
    cross-entropy of the head's outputs, each held (client, class) prototype labelled by its class."""
    rng = np.random.default_rng(0)
    means = jnp.asarray(rng.normal(size=(3, 10, 20)), jnp.float32)
    held = jnp.asarray(rng.random((3, 10)) < 0.7)
    layer = random_head(2, features=20)
    got = train_on_prototypes(
        layer, head_loss, means, held, jnp.arange(3), jax.random.key(3), epochs=3, batch_size=64, lr=0.5
    )
    x, y, mask = means.reshape(-1, 20), jnp.tile(jnp.arange(10), 3), held.reshape(-1).astype(jnp.float32)
    want = layer
    for _ in range(3):
        g = jax.grad(reference_cross_entropy)(want, x, y, mask)
        want = jax.tree.map(lambda p, d: p - 0.5 * d, want, g)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)
    assert not np.allclose(got["kernel"], layer["kernel"], atol=1e-3)


def test_fedghs_server_step_trains_at_its_own_lr_and_epochs_with_the_rounds_key(mlp):
    alg = fedgh(mlp, server_epochs=2, batch_size=8, server_lr=0.2)
    server, _ = alg.init(jax.random.key(0))
    rng = np.random.default_rng(4)
    means = jnp.asarray(rng.normal(size=(3, 10, 200)), jnp.float32)
    counts = jnp.asarray(rng.integers(0, 3, size=(3, 10)), jnp.float32)
    ids, weights = jnp.asarray([6, 1, 3]), jnp.asarray([4.0, 0.0, 2.0])
    new = server_step(alg, server, Upload(means, counts, ids), weights, round_=5)
    held = (np.asarray(counts) > 0) & (np.asarray(weights) > 0)[:, None]
    key = jax.random.fold_in(jax.random.wrap_key_data(server.key_data), 5)
    want = train_on_prototypes(
        server.head, head_loss, means, jnp.asarray(held), ids, key, epochs=2, batch_size=8, lr=0.2
    )
    chex.assert_trees_all_close(new.head, want, rtol=1e-5, atol=1e-7)
    again = server_step(alg, server, Upload(means, counts, ids), weights, round_=6)
    assert not np.allclose(again.head["kernel"], new.head["kernel"])  # another round, another shuffle


@pytest.mark.parametrize("name", BUILDERS)
def test_a_client_is_evaluated_by_its_own_extractor_under_the_servers_head(name, mlp, digits):
    alg = BUILDERS[name](mlp)
    server, client = alg.init(jax.random.key(0))
    own = jax.tree.map(lambda p: p + 0.05, client.params)  # a client's model after training
    server = server._replace(head=random_head(7))
    x = jnp.asarray(digits.x_test[:40])
    outputs, _ = mlp.apply(alg.eval_params(server, client._replace(params=own)), x)  # eval_model None: the run's
    z = np.asarray(module_features(mlp, own, x), np.float64)
    want = z @ np.asarray(server.head["kernel"], np.float64) + np.asarray(server.head["bias"])
    np.testing.assert_allclose(outputs, want, rtol=1e-4, atol=1e-4)
    assert alg.eval_model is None and alg.global_params is None


@pytest.mark.parametrize("name", BUILDERS)
def test_an_engine_round_is_the_clients_one_by_one_then_the_server(name, mlp, digits):
    """Three of five clients sampled, two rounds: each client's update by itself from the head the
    server sends, then the server step on their uploads stacked in id order."""
    fed = make_federation(digits, num_clients=5, alpha=0.5)
    alg = BUILDERS[name](mlp, lr=0.05, batch_size=16, **({"server_epochs": 3} if name == "fedgh" else {}))
    sim = Simulation(alg, mlp, fed, participation=0.6)
    state = sim.init()
    for _ in range(2):
        round_ = int(state.round)
        ids, results = clients_one_by_one(sim, state, fed)
        clients, uploads = zip(*results)
        stacked = jax.tree.map(lambda *u: jnp.stack(u), *uploads)
        weights = jnp.asarray(fed.train_count[ids], jnp.float32)
        want = server_step(alg, state.server, stacked, weights, round_=round_)
        state, _ = jax.jit(sim.round)(state, fed)
        chex.assert_trees_all_close(state.server, want, rtol=1e-4, atol=1e-5)
        for i, new in zip(ids, clients):
            chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], state.clients), new, rtol=1e-4, atol=1e-5)  # noqa: B023
    assert isinstance(state.server, GlobalHead) == (name == "lg_fedavg")


def test_the_defaults_are_htfllibs():
    """HtFLlib's system/main.py: -lr 0.01 -lbs 10 -ls 1; FedGH -se 100 -slr 0.01."""
    for options in (GlobalHeadOptions(), FedGHOptions()):
        assert (options.lr, options.batch_size, options.local_epochs) == (0.01, 10, 1)
    assert (FedGHOptions().server_epochs, FedGHOptions().server_lr) == (100, 0.01)


@pytest.mark.parametrize(
    "name, setting", [("fedgh", "server_epochs=0"), ("fedgh", "server_lr=-1"), ("lg_fedavg", "lr=-1")]
)
def test_a_bad_option_is_one_line(name, setting):
    with pytest.raises(ConfigError, match=setting.split("=")[0]) as err:
        Config(algorithm=name).with_overrides([setting]).validate()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", BUILDERS)
def test_rank_level_tiers_train_their_factors_under_the_global_head(name, mlp, digits_federation):
    """With ``model_tiers`` a tier-1 client trains its rank-level extractor (the decomposed layer's
    factors, its kernel switched off) under the received head, and is evaluated as its
    reconstructed extractor under the server's head."""
    alg = BUILDERS[name](mlp, model_tiers=(1.0, 0.25), **OPTIONS)
    server, template = alg.init(jax.random.key(0))
    client = alg.init_client(template, jnp.int32(3), jnp.int32(1))
    received = random_head(1)
    new, _, _ = jax.jit(alg.client_update)(received, client, one_client(digits_federation, 3), jax.random.key(5),
                                           round_info(tier=None))  # fmt: skip
    server = server._replace(head=random_head(8))
    variables = alg.eval_params(server, new)
    chex.assert_trees_all_equal(variables["params"]["head"], server.head)
    hidden = np.asarray(variables["params"]["fc2"]["kernel"])  # the decomposed layer, reconstructed
    assert np.linalg.matrix_rank(hidden, tol=1e-4) == 50  # rank_from_ratio((200, 200), 0.25)
    before = np.asarray(alg.eval_params(server, client)["params"]["fc2"]["kernel"])
    assert not np.allclose(hidden, before, atol=1e-4)
