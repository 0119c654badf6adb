"""pFedES against its round written out: the proxy extractor G as two convolutions written with
``lax.conv_general_dilated`` (a vector as a 1-D convolution in numpy); the local model's steps on
``(1 - mu) CE(F(x)) + mu CE(F(G(x)))`` with G frozen, then G's on ``CE(F(G(x)))`` with F frozen, by
torch's SGD written out (the gradient clipped to its norm, weight decay added, heavy-ball momentum);
a BatchNorm model's statistics moved in phase 1 by both passes; an engine round as its clients one
by one, then the sample-weighted mean of their G."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BatchNormNet, clients_one_by_one, cross_entropy, make_federation, one_client, round_info, torch_sgd

from jaxfed.algorithms.pfedes import PFedESOptions, ProxyExtractor, pfedes
from jaxfed.errors import ConfigError
from jaxfed.nn import Model
from jaxfed.runs.config import Config
from jaxfed.simulation import Simulation


def conv_relu(x, layer):
    y = jax.lax.conv_general_dilated(x, layer["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.relu(y + layer["bias"])


def proxy(params, images):
    """G on ``[batch, H, W, C]`` images."""
    return conv_relu(conv_relu(images, params["conv1"]), params["conv2"])


def test_a_client_trains_its_model_through_frozen_g_then_g_under_its_frozen_model(digits, digits_federation):
    """A BatchNorm model; one batch holds every example: ``local_epochs`` steps on F, each moving
    its statistics on the batch and then on G's transform of it, then ``local_epochs +
    extractor_extra_epochs`` steps on G through F in inference mode, each phase by a fresh
    momentum SGD whose clipping binds. The upload is G; the personalized model is F alone."""
    lr, momentum, decay, clip, mu, epochs, extra = 0.3, 0.9, 0.01, 0.1, 0.3, 2, 1
    net = Model.wrap(BatchNormNet(digits.num_classes), digits.input_shape)
    alg = pfedes(net, lr=lr, momentum=momentum, weight_decay=decay, clip_norm=clip, mu=mu, local_epochs=epochs,
                 extractor_extra_epochs=extra, batch_size=512)  # fmt: skip
    server, client = alg.init(jax.random.key(0))
    data = one_client(digits_federation, 2)
    new, upload, metrics = jax.jit(alg.client_update)(server, client, data, jax.random.key(1), round_info())
    idx = np.asarray(data.indices[: int(data.count)])
    x, y = jnp.asarray(np.asarray(data.x)[idx]), jnp.asarray(np.asarray(data.y)[idx])
    assert x.ndim == 4  # digits: 8x8 images of one channel

    def training(params, stats, inputs):  # (logits, new statistics): normalized by the batch's own
        return net.module.apply({"params": params, **stats}, inputs, train=True, mutable=["batch_stats"])

    def local_loss(f, stats, g):
        logits, stats = training(f, stats, x)
        proxy_logits, stats = training(f, stats, proxy(g, x))
        return (1 - mu) * cross_entropy(logits, y) + mu * cross_entropy(proxy_logits, y), stats

    step, local_grad = jax.jit(torch_sgd(lr, momentum, decay, clip)), jax.jit(jax.grad(local_loss, has_aux=True))
    local, stats, g = client.params, client.model_state, server.params
    velocity, norms = jax.tree.map(jnp.zeros_like, local), []
    for _ in range(epochs):
        grad, new_stats = local_grad(local, stats, g)
        (local, velocity, norm), stats = step(local, grad, velocity), new_stats
        norms.append(norm)
    frozen = {"params": local, **stats}
    proxy_loss = jax.jit(jax.grad(lambda g: cross_entropy(net.module.apply(frozen, proxy(g, x), train=False), y)))
    velocity = jax.tree.map(jnp.zeros_like, g)
    for _ in range(epochs + extra):
        g, velocity, norm = step(g, proxy_loss(g), velocity)
        norms.append(norm)
    assert min(norms) > clip  # the clipping bound every step

    chex.assert_trees_all_close(new.params, local, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(new.model_state, stats, rtol=1e-4, atol=1e-6)
    chex.assert_trees_all_close(upload, g, rtol=1e-4, atol=1e-5)
    assert float(metrics["steps"]) == 2 * epochs + extra
    assert not np.allclose(upload["conv1"]["kernel"], server.params["conv1"]["kernel"], atol=1e-4)
    assert alg.eval_model is None and alg.global_params is None  # F alone, the run's model; no global model
    chex.assert_trees_all_equal(alg.eval_params(server, new), {"params": new.params, **new.model_state})


@pytest.mark.parametrize("shape", [(7,), (7, 2)], ids=["vector", "sequence"])
def test_g_keeps_a_rows_shape_as_a_one_dimensional_convolution(shape):
    """A vector is one row of one channel, ``[L, C]`` one row of ``L`` positions: each output is
    relu(the sum of three taps over the channels, zero padded)."""
    x = np.asarray(jax.random.normal(jax.random.key(0), (3, *shape)))
    g = ProxyExtractor(width=4)
    params = g.init(jax.random.key(1), jnp.asarray(x))["params"]
    got = np.asarray(g.apply({"params": params}, jnp.asarray(x)))

    def conv1d(h, layer):  # h [batch, positions, in]; the kernel [1, 3, in, out]
        kernel, padded = np.asarray(layer["kernel"])[0], np.pad(h, ((0, 0), (1, 1), (0, 0)))
        out = sum(padded[:, t : t + h.shape[1]] @ kernel[t] for t in range(3))
        return np.maximum(out + np.asarray(layer["bias"]), 0)

    rows = x.reshape(3, 7, -1)
    want = conv1d(conv1d(rows, params["conv1"]), params["conv2"]).reshape(x.shape)
    assert got.shape == x.shape and np.abs(got).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_engine_round_is_the_clients_one_by_one_then_the_weighted_mean_of_g(mlp, digits):
    fed = make_federation(digits, num_clients=5, alpha=0.5)
    alg = pfedes(mlp, lr=0.05, batch_size=16, local_epochs=1, extractor_extra_epochs=1)
    sim = Simulation(alg, mlp, fed, participation=0.6)
    state = sim.init()
    ids, results = clients_one_by_one(sim, state, fed)
    share = np.asarray(fed.train_count[ids], np.float64) / np.sum(fed.train_count[ids])
    want = jax.tree.map(lambda *g: np.tensordot(share, np.asarray(g, np.float64), axes=1), *(u for _, u in results))
    new_state, _ = jax.jit(sim.round)(state, fed)
    chex.assert_trees_all_close(new_state.server.params, want, rtol=1e-4, atol=1e-5)
    for i, (client, _) in zip(ids, results):
        chex.assert_trees_all_close(jax.tree.map(lambda a: a[i], new_state.clients.params), client.params,
                                    rtol=1e-5, atol=1e-6)  # fmt: skip


def test_a_tiered_local_model_trains_its_rank_level_and_the_whole_g(mlp, digits_federation):
    """With ``model_tiers`` a tier-1 client's model is its rank level (rank 50 of 200 in the
    decomposed layer, after training too), and the G it trains through that model is the whole G."""
    alg = pfedes(mlp, model_tiers=(1.0, 0.25), lr=0.1, batch_size=16, local_epochs=1, extractor_extra_epochs=0)
    server, template = alg.init(jax.random.key(0))
    client = alg.init_client(template, jnp.int32(3), jnp.int32(1))
    new, upload, _ = jax.jit(alg.client_update)(server, client, one_client(digits_federation, 3),
                                                jax.random.key(5), round_info(tier=None))  # fmt: skip
    local = np.asarray(alg.eval_params(server, new)["params"]["fc2"]["kernel"])
    assert np.linalg.matrix_rank(local, tol=1e-4) == 50
    chex.assert_trees_all_equal_shapes(upload, server.params)
    assert not np.allclose(upload["conv1"]["kernel"], server.params["conv1"]["kernel"], atol=1e-4)


@pytest.mark.parametrize(
    "shape, dtype, message",
    [((5,), jnp.int32, "transforms float inputs; model inputs takes integer ids"),
     ((2, 2, 2, 1), jnp.float32, "takes vectors, sequences or images; model inputs's inputs are \\(2, 2, 2, 1\\)")],
    ids=["token ids", "volumes"],
)  # fmt: skip
def test_inputs_g_cannot_transform_are_one_line(shape, dtype, message):
    model = Model("inputs", ProxyExtractor(), shape, input_dtype=dtype)
    with pytest.raises(ConfigError, match="pfedes: the proxy extractor " + message) as err:
        pfedes(model)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("setting", ["mu=1.5", "extractor_extra_epochs=-1", "proxy_width=0"])
def test_a_bad_option_is_one_line(setting):
    with pytest.raises(ConfigError, match=setting.split("=")[0]) as err:
        Config(algorithm="pfedes").with_overrides([setting]).validate()
    assert "\n" not in str(err.value)


def test_the_defaults_are_the_authors_code():
    options = PFedESOptions()
    training = (options.lr, options.momentum, options.weight_decay, options.clip_norm)
    assert training == (0.01, 0.9, 0.001, 50.0)
    epochs = (options.local_epochs, options.extractor_extra_epochs)
    assert (options.batch_size, epochs, options.mu, options.proxy_width) == (512, (10, 10), 0.5, 8)
