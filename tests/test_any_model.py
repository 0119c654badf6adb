"""Any Flax module is a model: stock nn.Dense / nn.Conv layers and a plain ``__call__(x)``."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_federation, round_info

from jaxfed.algorithms import fedara, feddecomp, fedhm, fedloru, floral, registry
from jaxfed.algorithms.fedavg import fedavg
from jaxfed.algorithms.fedrod import fedrod
from jaxfed.algorithms.global_head import fedgh
from jaxfed.algorithms.pfedafm import pfedafm
from jaxfed.algorithms.training import classification_loss
from jaxfed.core import lowrank
from jaxfed.data import Batch, Dataset, federate, partition
from jaxfed.errors import ConfigError
from jaxfed.nn import Model
from jaxfed.nn.factorized import factorized_execution
from jaxfed.nn.layers import interior_layers, last_dense_layer
from jaxfed.runs.config import Config
from jaxfed.simulation import Simulation


class UserNet(nn.Module):
    """What a researcher writes: stock layers, auto-named, no train / mask / features arguments."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(6, (3, 3))(x))
        x = nn.relu(nn.Conv(8, (3, 3), strides=2, padding=((1, 0), (0, 1)))(x))
        x = nn.relu(nn.Dense(24)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


class NoKernels(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Embed(16, 10)(jnp.zeros(x.shape[0], jnp.int32))


@pytest.fixture(scope="module")
def user_model(digits):
    return Model.wrap(UserNet(), digits.input_shape)


def test_stock_layers_are_found_in_call_order(user_model):
    assert interior_layers(user_model) == ["Conv_1", "Dense_0"]
    assert last_dense_layer(user_model) == "Dense_1"


def test_a_stock_conv_runs_factorized_as_its_reconstructed_kernel(user_model):
    params = user_model.init(jax.random.key(0))["params"]
    factorized = lowrank.factorize_layers(params, {"Conv_1": 3, "Dense_0": 5})
    x = jax.random.normal(jax.random.key(1), (4, *user_model.input_shape))
    with factorized_execution():
        got, _ = user_model.apply({"params": factorized}, x)
    reference = lowrank.reconstruct_layers(factorized)  # full kernels, run by the stock layers themselves
    expected, _ = user_model.apply({"params": reference}, x)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert "kernel" not in factorized["Conv_1"]


@pytest.mark.parametrize(
    "build",
    [
        lambda m: fedhm.fedhm(m, tiers=(1.0, 0.5), local_epochs=1, batch_size=32, lr=0.05),
        lambda m: fedara.fedara(m, tiers=(1.0, 0.5), local_epochs=1, batch_size=32, lr=0.05),
        lambda m: feddecomp.feddecomp(m, local_epochs=2, batch_size=32),
        lambda m: floral.floral(m, local_epochs=1, num_adaptors=2),
        lambda m: fedloru.fedloru(m, lora_rank=2, local_epochs=1),
    ],
    ids=["fedhm", "fedara", "feddecomp", "floral", "fedloru"],
)
def test_low_rank_algorithms_train_a_user_module(build, user_model, digits):
    fed = make_federation(digits, num_clients=4, alpha=1.0)
    alg = build(user_model)
    sim = Simulation(alg, user_model, fed, participation=1.0)
    start = sim.init()
    state, metrics = sim.run_rounds(start, 1)
    assert np.all(np.isfinite(np.asarray(metrics["train_loss"])))
    result = sim.evaluate(state)
    assert 0.0 <= result["personalized_acc_mean"] <= 1.0
    chex.assert_trees_all_equal_structs(state.server, start.server)  # the server's shapes never change
    with pytest.raises(AssertionError):  # and it moved
        chex.assert_trees_all_close(state.server, start.server)


def test_fedhm_factorizes_the_stock_conv(user_model):
    alg = fedhm.fedhm(user_model, tiers=(0.5,))
    server, _ = alg.init(jax.random.key(0))
    message = alg.broadcast(server, round_info())
    assert set(message["Conv_1"]) == {"u", "v", "bias"} and "kernel" in message["Conv_0"]


def test_fedara_private_head_defaults_to_the_last_dense_and_is_configurable(user_model):
    alg = fedara.fedara(user_model, tiers=(1.0,))
    server, client = alg.init(jax.random.key(0))
    assert "Dense_1" not in server.fe and client.head["kernel"].shape == (24, 10)
    expected = "head: 'Conv_1' is not a Dense layer of the model; allowed: Dense_0, Dense_1"
    with pytest.raises(ConfigError, match=expected):
        fedara.fedara(user_model, head="Conv_1")


class BiaslessHead(nn.Module):
    """A user's MLP whose last Dense layer has no bias."""

    @nn.compact
    def __call__(self, x):
        hidden = nn.relu(nn.Dense(24, name="hidden")(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, use_bias=False, name="head")(hidden)


@pytest.mark.parametrize("build", [fedrod, fedgh, pfedafm], ids=lambda build: build.__name__)
def test_a_head_that_does_not_give_the_outputs_is_one_line(build, user_model):
    """FedRoD's personal head, FedGH's server and pFedAFM's mixture compute the model's outputs
    from the head's parameters: an earlier Dense layer, or one without a bias, is refused."""
    name = build.__name__
    with pytest.raises(ConfigError, match=f"head: {name} computes the model's outputs .*'Dense_1'\\), not 'Dense_0'$"):
        build(user_model, head="Dense_0")
    with pytest.raises(ConfigError, match=f"head: {name} computes .* 'head' has no bias$"):
        build(Model.wrap(BiaslessHead(), (8, 8, 1)))


@pytest.mark.parametrize("build", [fedhm.fedhm, fedara.fedara, feddecomp.feddecomp, floral.floral, fedloru.fedloru])
def test_a_model_without_dense_or_conv_layers_is_a_one_line_error(build):
    model = Model.wrap(NoKernels(), (4,))
    with pytest.raises(ConfigError, match=r"no nn.Dense / nn.Conv layer to adapt .*its layers: Embed_0 \(Embed\)$"):
        build(model)


class DropNet(nn.Module):
    """A user's MLP with dropout between its layers (on when ``train``)."""

    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1)))
        h = nn.Dropout(0.5, deterministic=not train)(h)
        return nn.Dense(self.num_classes)(h)


def test_a_model_with_dropout_draws_a_mask_from_each_steps_key_and_evaluates_deterministically(digits):
    """Flax's Dropout needs a "dropout" key when training: a local step gets its batch's key (the
    same key, the same loss; another key, another mask), evaluation none (it raised
    InvalidRngError on every training call)."""
    model = Model.wrap(DropNet(), digits.input_shape)
    params = model.init(jax.random.key(0))["params"]
    x, y = jnp.asarray(digits.x_train[:16]), jnp.asarray(digits.y_train[:16])
    loss = classification_loss(model)
    batch = Batch(x, y, jnp.ones(16, bool), jax.random.key(1))
    first, again = loss(params, {}, batch)[0], loss(params, {}, batch)[0]
    other = loss(params, {}, batch._replace(key=jax.random.key(2)))[0]
    assert first == again and first != other
    np.testing.assert_array_equal(model.apply({"params": params}, x)[0], model.apply({"params": params}, x)[0])


# each way a built-in's local objective runs the model in training mode: the plain loss, MOON's,
# FedNTD's, FedRoD's, FedProto's and FedARA's head inputs, IFCA's cluster choice, FLoRAL's routed
# adaptors and the ensemble's members
DROPOUT_ALGORITHMS = ("fedavg", "moon", "fedntd", "fedrod", "fedproto", "fedara", "ifca", "floral", "ensemble")


@pytest.mark.parametrize("name", DROPOUT_ALGORITHMS)
def test_each_local_objective_trains_a_model_with_dropout(name, digits):
    model = Model.wrap(DropNet(), digits.input_shape)
    fed = make_federation(digits, num_clients=5, alpha=1.0)
    # FedARA at one tier: its head inputs run the model the same way whatever the tiers (five compile five programs)
    one_tier = ["tiers=0.5"] if name == "fedara" else []
    config = Config(algorithm=name).with_overrides(["local_epochs=1", "batch_size=32", *one_tier])
    sim = Simulation(registry.get(name).build(model, config.options, config), model, fed, participation=0.5)
    state, metrics = sim.run_rounds(sim.init(), 1)
    assert np.isfinite(metrics["train_loss"]).all()
    assert np.isfinite(sim.evaluate(state)["personalized_loss"])


class TokenNet(nn.Module):
    """Token ids in, as a text model takes them (nn.Embed refuses float inputs)."""

    num_classes: int = 4

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.num_classes)(nn.Embed(50, 8)(x).mean(axis=1))


def test_a_model_of_integer_inputs_initializes_and_trains_with_its_input_dtype():
    rng = np.random.default_rng(0)
    x_train, y_train = rng.integers(0, 50, (200, 6)).astype(np.int32), rng.integers(0, 4, 200)
    x_test, y_test = rng.integers(0, 50, (40, 6)).astype(np.int32), rng.integers(0, 4, 40)
    data = Dataset("tokens", x_train, y_train, x_test, y_test, num_classes=4)
    train, test = partition("iid", y_train, y_test, 4, np.random.default_rng(0))
    model = Model.wrap(TokenNet(), data.input_shape, input_dtype=jnp.int32)
    sim = Simulation(fedavg(model), model, federate(data, train, test), seed=0)
    state, _ = sim.run_rounds(sim.init(), 1)
    assert np.isfinite(sim.evaluate(state)["personalized_loss"])
