"""FML against its loss written out (log-softmax by its log-sum-exp, the KL as its sum), a client's
round as that loss's gradient steps on both models, the server as the plain mean of the memes
(HtFLlib's), and an engine round as its clients one by one, then the server."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import clients_one_by_one, log_softmax, make_federation, one_client, round_info

from jaxfed import server_step
from jaxfed.algorithms.fml import FMLOptions, Meme, fml
from jaxfed.errors import ConfigError
from jaxfed.runs.config import Config
from jaxfed.simulation import Simulation


def reference_loss(local, meme, model, x, y, alpha, beta):
    """``alpha CE_l + (1 - alpha) KL(p_m || p_l) + beta CE_m + (1 - beta) KL(p_l || p_m)``, each a
    mean over the examples, the KL summed over classes."""
    log_l = log_softmax(model.module.apply({"params": local}, x))
    log_m = log_softmax(model.module.apply({"params": meme}, x))
    rows = jnp.arange(len(y))
    ce_l, ce_m = -jnp.mean(log_l[rows, y]), -jnp.mean(log_m[rows, y])
    kl_m_l = jnp.mean(jnp.sum(jnp.exp(log_m) * (log_m - log_l), axis=1))
    kl_l_m = jnp.mean(jnp.sum(jnp.exp(log_l) * (log_l - log_m), axis=1))
    return alpha * ce_l + (1 - alpha) * kl_m_l + beta * ce_m + (1 - beta) * kl_l_m


@pytest.mark.parametrize("alpha, beta", [(0.5, 0.5), (0.2, 0.9)])
def test_a_client_takes_gradient_steps_of_both_models_on_the_mutual_loss(alpha, beta, mlp, digits_federation):
    """One batch holds every example: ``local_epochs`` steps of gradient descent on the written-out
    loss, both models at once (neither softmax detached); the upload is the trained meme."""
    alg = fml(mlp, local_ce_weight=alpha, meme_ce_weight=beta, lr=0.3, local_epochs=3, batch_size=512)
    server, client = alg.init(jax.random.key(0))
    data = one_client(digits_federation, 2)
    new, upload, _ = jax.jit(alg.client_update)(server, client, data, jax.random.key(1), round_info())
    idx = np.asarray(data.indices[: int(data.count)])
    x, y = jnp.asarray(np.asarray(data.x)[idx]), jnp.asarray(np.asarray(data.y)[idx])
    local, meme = client.params, server.params
    grad = jax.grad(reference_loss, argnums=(0, 1))
    for _ in range(3):
        g_local, g_meme = grad(local, meme, mlp, x, y, alpha, beta)
        local = jax.tree.map(lambda p, d: p - 0.3 * d, local, g_local)
        meme = jax.tree.map(lambda p, d: p - 0.3 * d, meme, g_meme)
    chex.assert_trees_all_close(new.params, local, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(upload, meme, rtol=1e-4, atol=1e-5)
    assert not np.allclose(upload["head"]["kernel"], server.params["head"]["kernel"], atol=1e-3)


def test_the_distillation_couples_the_models(mlp, digits_federation):
    """With ``alpha = beta = 1`` (HtFLlib's defaults) the local model trains on its cross-entropy
    alone: another meme leaves it unchanged; with the paper's 0.5 it moves it (also through the
    meme's KL, whose gradient reaches the local model)."""
    data, rng = one_client(digits_federation, 2), jax.random.key(1)
    other = Meme(jax.tree.map(lambda p: p + 0.1, mlp.init(jax.random.key(9))["params"]))
    locals_ = []
    for weight in (1.0, 0.5):
        alg = fml(mlp, local_ce_weight=weight, meme_ce_weight=weight, lr=0.1, local_epochs=1, batch_size=16)
        server, client = alg.init(jax.random.key(0))
        update = jax.jit(alg.client_update)
        locals_.append([update(message, client, data, rng, round_info())[0].params for message in (server, other)])
    chex.assert_trees_all_close(*locals_[0], rtol=1e-6, atol=1e-7)
    assert not np.allclose(locals_[1][0]["head"]["kernel"], locals_[1][1]["head"]["kernel"], atol=1e-4)


def test_an_engine_round_is_the_clients_one_by_one_then_the_memes_plain_mean(mlp, digits):
    fed = make_federation(digits, num_clients=5, alpha=0.5)
    alg = fml(mlp, lr=0.05, batch_size=16)
    sim = Simulation(alg, mlp, fed, participation=0.6)
    state = sim.init()
    for _ in range(2):
        ids, results = clients_one_by_one(sim, state, fed)
        memes = [upload for _, upload in results]
        want = jax.tree.map(lambda *m: np.mean([np.asarray(x, np.float64) for x in m], axis=0), *memes)
        state, _ = jax.jit(sim.round)(state, fed)
        chex.assert_trees_all_close(state.server.params, want, rtol=1e-4, atol=1e-5)
        stacked = jax.tree.map(lambda *m: jnp.stack(m), *memes)
        weights = jnp.asarray(fed.train_count[ids], jnp.float32)  # the clients' sizes count nothing
        padded = jax.tree.map(lambda x: jnp.concatenate([x, 100 + x[:1]]), stacked)  # a padding row, weight 0
        got = server_step(alg, Meme(memes[0]), padded, jnp.append(weights, 0.0)).params
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    variables = alg.global_params(state.server)
    chex.assert_trees_all_equal(variables["params"], state.server.params)  # the global model is the meme


def test_a_tiered_local_model_learns_beside_the_whole_meme(mlp, digits_federation):
    """With ``model_tiers`` a tier-1 client's local model is its rank level (rank 50 of 200 in the
    decomposed layer, after training too) while the meme it uploads stays the run's whole model."""
    alg = fml(mlp, model_tiers=(1.0, 0.25), lr=0.1, batch_size=16)
    server, template = alg.init(jax.random.key(0))
    client = alg.init_client(template, jnp.int32(3), jnp.int32(1))
    new, meme, _ = jax.jit(alg.client_update)(server, client, one_client(digits_federation, 3), jax.random.key(5),
                                              round_info(tier=None))  # fmt: skip
    local = np.asarray(alg.eval_params(server, new)["params"]["fc2"]["kernel"])
    assert np.linalg.matrix_rank(local, tol=1e-4) == 50
    assert np.linalg.matrix_rank(np.asarray(meme["fc2"]["kernel"]), tol=1e-4) == 200
    assert not np.allclose(meme["fc2"]["kernel"], server.params["fc2"]["kernel"], atol=1e-4)


def test_the_defaults_are_the_papers_weights_and_htfllibs_training():
    options = FMLOptions()
    assert (options.local_ce_weight, options.meme_ce_weight, options.lr, options.batch_size, options.local_epochs) == (
        0.5,
        0.5,
        0.01,
        10,
        1,
    )


@pytest.mark.parametrize("setting", ["local_ce_weight=1.5", "meme_ce_weight=-0.1"])
def test_a_bad_weight_is_one_line(setting):
    with pytest.raises(ConfigError, match=setting.split("=")[0]) as err:
        Config(algorithm="fml").with_overrides([setting]).validate()
    assert "\n" not in str(err.value)
