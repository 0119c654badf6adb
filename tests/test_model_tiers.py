"""Heterogeneous client models (``model_tiers``) against each tier's model built and trained on its
own: a client of tier k trains exactly the model with FedARA's decomposed layers at tier k's rank
(unpadded factors, the kernel where the tier keeps it whole), whatever the padding shared with the
other tiers; the engine gives each client its tier; one full-rank tier is the plain algorithm."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import client_accuracy, one_client, round_info

from jaxfed.algorithms.fedara import default_decomposed_layers
from jaxfed.algorithms.fedhm import tier_rank
from jaxfed.algorithms.fedproto import Prototypes, fedproto
from jaxfed.algorithms.fedtgp import fedtgp
from jaxfed.algorithms.local import local
from jaxfed.core import lowrank
from jaxfed.errors import ConfigError
from jaxfed.nn import Model, get_model
from jaxfed.nn.factorized import factorized_execution
from jaxfed.runs.build import build
from jaxfed.runs.config import Config
from jaxfed.simulation import Simulation, sampling

RATIOS = (1.0, 0.5, 0.25)
OPTIONS = {"lr": 0.1, "local_epochs": 2, "batch_size": 16}


def tier_model(model, params, ratio):
    """The tier's model on its own: each decomposed layer's truncated SVD at the tier's rank
    (numpy float64, unpadded), or its kernel where that rank is the layer's full rank."""
    for key in default_decomposed_layers(model, "head"):
        kernel = np.asarray(lowrank.get_layer(params, key)["kernel"], np.float64)
        rank = tier_rank(kernel.shape, ratio)
        matrix = lowrank.matricize(kernel) if kernel.ndim == 4 else kernel
        if rank >= min(matrix.shape):
            continue
        left, sigma, right = np.linalg.svd(matrix, full_matrices=False)
        root = np.sqrt(sigma[:rank])
        u, v = left[:, :rank] * root, right[:rank].T * root
        if kernel.ndim == 4:
            kh, kw, cin, cout = kernel.shape
            u, v = u.reshape(kh, cin, rank), v.reshape(kw, cout, rank)
        layer = {k: x for k, x in lowrank.get_layer(params, key).items() if k != "kernel"}
        params = lowrank.replace_layer(params, key, {**layer, "u": jnp.float32(u), "v": jnp.float32(v)})
    return params


def prototypes(seed=1):
    return Prototypes(jax.random.normal(jax.random.key(seed), (10, 16)), jnp.ones((10,), bool))


def unpadded(model, padded, kernel_on, ratio):
    """A padded client model as its tier's own: the kernel where it is on, else the rank's factors."""
    for key in default_decomposed_layers(model, "head"):
        layer = lowrank.get_layer(padded, key)
        rest = {k: x for k, x in layer.items() if k not in ("kernel", "u", "v")}
        if float(kernel_on[key]):
            own = {"kernel": layer["kernel"]}
        else:
            rank = tier_rank(layer["kernel"].shape, ratio)
            own = {"u": layer["u"][..., :rank], "v": layer["v"][..., :rank]}
        padded = lowrank.replace_layer(padded, key, {**rest, **own})
    return padded


@pytest.mark.parametrize("tier", [0, 1, 2])
def test_a_client_starts_at_its_tiers_truncation_of_the_shared_start(small_cnn, tier):
    alg, plain = fedproto(small_cnn, model_tiers=RATIOS), fedproto(small_cnn)
    _, client = alg.init(jax.random.key(0))
    _, own = plain.init(jax.random.key(0))
    client = alg.init_client(client, jnp.int32(3), jnp.int32(tier))
    want = lowrank.reconstruct_layers(tier_model(small_cnn, own.params, RATIOS[tier]))
    # float32's SVD against float64's: kernels of about 0.3 agree to 1e-5
    chex.assert_trees_all_close(lowrank.reconstruct_layers(client.inner.params), want, rtol=1e-4, atol=1e-5)
    if tier:
        assert not np.allclose(want["conv3"]["kernel"], own.params["conv3"]["kernel"], atol=1e-3)


@pytest.mark.parametrize("tier", [0, 1, 2])
def test_a_clients_update_is_its_tiers_model_trained_on_its_own(small_cnn, digits_federation, tier):
    """FedProto's client of each tier against FedProto's plain client holding the tier's model
    unpadded (run factorized): the same trained model (reconstructed) and the same upload."""
    alg, plain = fedproto(small_cnn, model_tiers=RATIOS, **OPTIONS), fedproto(small_cnn, **OPTIONS)
    _, client = alg.init(jax.random.key(0))
    _, own = plain.init(jax.random.key(0))
    client = alg.init_client(client, jnp.int32(3), jnp.int32(tier))
    own = own._replace(params=unpadded(small_cnn, client.inner.params, client.kernel_on, RATIOS[tier]))
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    new, upload, _ = jax.jit(alg.client_update)(prototypes(), client, data, rng, round_info(tier=None))
    with factorized_execution():
        want, want_upload, _ = jax.jit(plain.client_update)(prototypes(), own, data, rng, round_info())
    trained = lowrank.reconstruct_layers(new.inner.params)
    chex.assert_trees_all_close(trained, lowrank.reconstruct_layers(want.params), rtol=1e-4, atol=1e-6)
    chex.assert_trees_all_close(upload, want_upload, rtol=1e-4, atol=1e-6)
    before = lowrank.reconstruct_layers(client.inner.params)
    assert not np.allclose(before["conv3"]["kernel"], trained["conv3"]["kernel"], atol=1e-3)


OPTIMIZERS = [
    {},
    {"client_optimizer": "adam", "lr": 0.01, "weight_decay": 1e-3, "clip_norm": 1.0},
    {"client_optimizer": "momentum", "momentum": 0.9, "weight_decay": 1e-3},
    {"client_optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1},
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=["sgd", "adam", "momentum", "adamw"])
def test_what_a_tier_does_not_own_stays_zero(small_cnn, digits_federation, optimizer):
    """The padding beyond a tier's rank and a switched-off kernel get no gradient, under every
    client optimizer (weight decay and clipping included); what the tier owns moves."""
    alg = fedproto(small_cnn, model_tiers=RATIOS, **{**OPTIONS, **optimizer})
    _, start = alg.init(jax.random.key(0))
    data = one_client(digits_federation, 0)
    update = jax.jit(alg.client_update)  # as the engine runs it; the tiers share shapes: one compile
    for tier in (0, 2):  # the whole layers' tier, and one with padding beyond its rank
        ratio = RATIOS[tier]
        client = alg.init_client(start, jnp.int32(0), jnp.int32(tier))
        new, _, _ = update(prototypes(), client, data, jax.random.key(1), round_info())
        for key in default_decomposed_layers(small_cnn, "head"):
            layer, before = (lowrank.get_layer(c.inner.params, key) for c in (new, client))
            rank = tier_rank(layer["kernel"].shape, ratio)
            whole = rank >= min(lowrank.matrix_shape(layer["kernel"].shape))
            assert float(new.kernel_on[key]) == float(whole)
            owned = "kernel" if whole else "u"
            assert not np.allclose(layer[owned], before[owned])
            if whole:
                np.testing.assert_array_equal(layer["u"], 0.0)
                np.testing.assert_array_equal(layer["v"], 0.0)
            else:
                np.testing.assert_array_equal(layer["kernel"], 0.0)
                np.testing.assert_array_equal(layer["u"][..., rank:], 0.0)
                np.testing.assert_array_equal(layer["v"][..., rank:], 0.0)


def test_a_dense_tier_trains_its_own_model_too(mlp, digits_federation):
    """The MLP's decomposed Dense layer (padded_dense) against the tier's model unpadded."""
    alg, plain = local(mlp, model_tiers=(1.0, 0.5, 0.1), **OPTIONS), local(mlp, **OPTIONS)
    _, client = alg.init(jax.random.key(0))
    _, own = plain.init(jax.random.key(0))
    client = alg.init_client(client, jnp.int32(1), jnp.int32(2))
    params = unpadded(mlp, client.inner.variables["params"], client.kernel_on, 0.1)
    own = own._replace(variables={**own.variables, "params": params})
    data, rng = one_client(digits_federation, 1), jax.random.key(2)
    new, _, _ = jax.jit(alg.client_update)((), client, data, rng, round_info(tier=None))
    with factorized_execution():
        want, _, _ = jax.jit(plain.client_update)((), own, data, rng, round_info())
    chex.assert_trees_all_close(
        lowrank.reconstruct_layers(new.inner.variables["params"]),
        lowrank.reconstruct_layers(want.variables["params"]),
        rtol=1e-4,
        atol=1e-6,
    )


def test_local_without_tiers_needs_no_dense_head():
    """Without model_tiers, Local builds on any model (a conv-only one has no head to find)."""

    class ConvOnly(nn.Module):
        @nn.compact
        def __call__(self, x, train=False, mask=None):
            return nn.Conv(10, (3, 3))(x).mean(axis=(1, 2))

    model = Model("conv_only", ConvOnly(), (8, 8, 1))
    assert local(model).num_tiers is None
    with pytest.raises(ConfigError, match="local"):
        local(model, model_tiers=(1.0, 0.5))


def test_a_model_without_a_layer_to_decompose_is_refused(digits):
    linear = get_model("linear", digits.input_shape, digits.num_classes)
    with pytest.raises(ConfigError, match="^model_tiers: the model has no feature-extractor layer to decompose"):
        local(linear, model_tiers=(1.0, 0.5))


def test_the_engine_gives_each_client_its_tier_and_evaluates_its_own_model(small_cnn, digits_federation):
    """Local with three tiers over 10 clients: each client starts at its tier's ranks (the engine's
    equal contiguous blocks) and is evaluated on its own model, reconstructed."""
    sim = Simulation(local(small_cnn, model_tiers=RATIOS, **OPTIONS), small_cnn, digits_federation, seed=0)
    state = sim.init()
    tiers = np.asarray(sampling.tier_of(jnp.arange(10), sampling.tier_bounds(10, 3)))
    assert tiers.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    for client, tier in enumerate(tiers):
        params = jax.tree.map(lambda x, c=client: x[c], state.clients.inner.variables["params"])
        layer = lowrank.get_layer(params, "conv3")
        rank = tier_rank(layer["kernel"].shape, RATIOS[tier])
        used = int(np.sum(np.abs(np.asarray(layer["v"])).sum(axis=(0, 1)) > 0))
        assert (float(state.clients.kernel_on["conv3"][client]), used) == ((1.0, 0) if tier == 0 else (0.0, rank))
    state, _ = sim.run_rounds(state, 1)
    accuracies = []
    for client in range(10):
        variables = jax.tree.map(lambda x, c=client: x[c], state.clients.inner.variables)
        whole = {**variables, "params": lowrank.reconstruct_layers(variables["params"])}
        accuracies.append(client_accuracy(small_cnn, whole, digits_federation, client))
    np.testing.assert_allclose(sim.evaluate(state)["personalized_acc_mean"], np.mean(accuracies), rtol=1e-6)


def test_one_full_rank_tier_is_the_plain_algorithm():
    """``model_tiers=1``: one tier whose model is the whole one, the same numbers as without."""
    results = []
    for extra in ([], ["model_tiers=1"]):
        sim = build(Config(algorithm="fedproto").with_overrides(["seed=1", *extra]).validate()).simulation
        state, metrics = sim.run_rounds(sim.init(), 2)
        results.append((np.asarray(metrics["train_loss"]), sim.evaluate(state)))
    (plain_loss, plain), (tiered_loss, tiered) = results
    np.testing.assert_array_equal(tiered_loss, plain_loss)
    for key in ("personalized_acc_mean", "personalized_loss"):
        assert tiered[key] == plain[key], key


def test_fedtgps_clients_take_tiers_and_keep_their_ids(mlp):
    alg = fedtgp(mlp, model_tiers=(1.0, 0.25))
    _, client = alg.init(jax.random.key(0))
    client = alg.init_client(client, jnp.int32(4), jnp.int32(1))
    assert int(client.inner.id) == 4
    assert set(client.kernel_on) == set(default_decomposed_layers(mlp, "head"))
    assert all(float(on) == 0.0 for on in client.kernel_on.values())


@pytest.mark.parametrize("value", ["0", "1.5", "1,-1"])
def test_a_bad_ratio_is_one_line(value):
    with pytest.raises(ConfigError, match=r"model_tiers: every rank ratio must be in \(0, 1\]") as caught:
        Config(algorithm="fedproto").with_overrides([f"model_tiers={value}"]).validate()
    assert "\n" not in str(caught.value)


def test_more_model_tiers_than_clients_is_one_line_naming_them():
    with pytest.raises(
        ConfigError,
        match=r"^model_tiers: 3 tiers for 2 clients; every tier needs at least one client \(give model_tiers at most 2 "
        r"entries, or num_clients >= 3\)$",
    ):
        Config(algorithm="local").with_overrides(["model_tiers=1,0.5,0.25", "num_clients=2"]).validate()
