"""FedAMP against the authors' code written out in numpy float64 (Fling's ``fedamp_group.py``
``aggregate``, client by client and pair by pair, with its alpha decay run round by round), a
client's round against ``train_parameters`` with the proximal term written here, and an engine
round against both."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_federation, round_info

from jaxfed.algorithms.fedamp import Upload, fedamp
from jaxfed.algorithms.training import train_parameters
from jaxfed.core import tree_bytes
from jaxfed.data import ClientData
from jaxfed.errors import NonFiniteUpdateError
from jaxfed.simulation import Simulation, sampling

TRAIN = {"lr": 0.1, "local_epochs": 1, "batch_size": 32}


def numpy_clouds(models, alpha, sigma):
    """``aggregate``'s cloud models: ``coef[j] = alphaK * exp(-|w_i - w_j|^2 / sigma) / sigma``,
    ``coef[i] = 1 - sum``, ``u_i = sum_j coef[j] w_j`` (models: lists of float64 arrays)."""
    flat = [np.concatenate([x.ravel() for x in m]) for m in models]
    clouds = []
    for i in range(len(models)):
        coef = np.zeros(len(models))
        for j in range(len(models)):
            if i != j:
                sub = flat[i] - flat[j]
                coef[j] = alpha * np.exp(-np.dot(sub, sub) / sigma) / sigma
        coef[i] = 1 - np.sum(coef)
        clouds.append([sum(coef[j] * models[j][k] for j in range(len(models))) for k in range(len(models[i]))])
    return clouds


def fling_alphas(rounds, alpha, rate, every):
    """alpha_k as the authors' loop has it in each round: decayed after ``aggregate(i)`` when
    ``i % every == 0 and i != 0``."""
    out = []
    for i in range(rounds):
        out.append(alpha)
        if i % every == 0 and i != 0:
            alpha *= rate
    return out


def test_alpha_decays_as_the_authors_loop_does(mlp):
    alg = fedamp(mlp, num_clients=2, alpha_k=1e4, alpha_decay=0.1, alpha_decay_every=30)
    want = fling_alphas(95, 1e4, 0.1, 30)
    np.testing.assert_allclose([float(alg.options.alpha(r)) for r in range(95)], want, rtol=1e-6)
    assert float(fedamp(mlp, num_clients=2, alpha_decay_every=0).options.alpha(500)) == 1e4


@pytest.mark.parametrize("sigma", [100.0, 5.0])
def test_the_server_step_is_the_authors_cloud_models(sigma, mlp):
    """Models a distance of order sigma apart, so the attention is neither 0 nor saturated; a row
    of weight 0 writes nothing, and a client that never uploaded draws no attention."""
    num_clients = 5
    alg = fedamp(mlp, num_clients=num_clients, alpha_k=3.0, sigma=sigma, **TRAIN)
    server, _ = alg.init(jax.random.key(0))
    leaves, structure = jax.tree.flatten(server.models)
    scale = np.sqrt(sigma / sum(x[0].size for x in leaves))  # |w_i - w_j|^2 about 2 sigma
    uploads = jax.tree.unflatten(
        structure,
        [x[:4] + scale * jax.random.normal(jax.random.key(i), x[:4].shape) for i, x in enumerate(leaves)],
    )
    ids = jnp.array([3, 0, 2, 1], jnp.int32)
    weights = jnp.array([10.0, 20.0, 0.0, 5.0])  # the row for client 2 is padding
    new = jax.jit(alg.server_update)(server, Upload(uploads, ids), weights, round_info(7, None))

    known = [0, 1, 3]  # clients 2 and 4 never uploaded: 4 keeps its initial model and draws no attention
    as_list = lambda tree, r: [np.asarray(x[r], np.float64) for x in jax.tree.leaves(tree)]  # noqa: E731
    models = {int(ids[r]): as_list(uploads, r) for r in range(4) if weights[r] > 0}
    for c in range(num_clients):
        if c not in models:
            models[c] = as_list(server.models, c)
    for c in range(num_clients):
        group = sorted(set(known) | {c})
        clouds = numpy_clouds([models[j] for j in group], 3.0, sigma)
        for got, want in zip(jax.tree.leaves(new.clouds), clouds[group.index(c)]):
            np.testing.assert_allclose(got[c], want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.flatnonzero(new.has_row), known)
    for c in range(num_clients):
        for got, want in zip(jax.tree.leaves(new.models), models[c]):
            np.testing.assert_array_equal(got[c], want.astype(np.float32))
    first_cloud = numpy_clouds([models[j] for j in known], 3.0, sigma)[0]
    assert any(not np.allclose(w, m) for w, m in zip(first_cloud, models[0])), "the attention moved a cloud model"


def test_a_client_trains_its_own_model_pulled_toward_its_cloud_model(mlp, digits_federation):
    alg = fedamp(mlp, num_clients=3, lam=2.0, alpha_k=0.5, alpha_decay_every=0, **TRAIN)
    server, client = alg.init(jax.random.key(0))
    client = alg.init_client(client, 1, 0)
    own = jax.tree.map(lambda x: x + 0.05, client.params)
    clouds = jax.tree.map(lambda t: t.at[1].set(t[1] - 0.1), server.clouds)
    server, client = server._replace(clouds=clouds), client._replace(params=own)
    data = digits_federation.train_data(jnp.array([1]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    new, upload, _ = jax.jit(alg.client_update)(server, client, view, jax.random.key(2), round_info(4))

    cloud = jax.tree.map(lambda t: t[1], clouds)

    def pull(w):  # lambda / (2 alpha) ||w - u||^2, written out
        return 2.0 / (2 * 0.5) * sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(cloud)))

    want, _, _ = train_parameters(mlp, alg.options.optimizer(4), own, {}, view, jax.random.key(2), regularizer=pull,
                                  **alg.options.batching())  # fmt: skip
    chex.assert_trees_all_close(upload.params, want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal(new.params, upload.params)
    chex.assert_trees_all_equal(alg.eval_params(server, new)["params"], upload.params)  # its own model
    assert int(upload.id) == 1
    # it starts from its own model, not from the cloud model
    from_cloud, _, _ = train_parameters(mlp, alg.options.optimizer(4), cloud, {}, view, jax.random.key(2),
                                        regularizer=pull, **alg.options.batching())  # fmt: skip
    assert not np.allclose(jax.tree.leaves(from_cloud)[0], jax.tree.leaves(upload.params)[0])


def test_engine_rounds_are_the_clients_one_by_one_then_the_server(mlp, digits):
    """alpha_k decays every round here: 2, 2, 0.2 in rounds 0-2 (the authors' loop)."""
    fed = make_federation(digits, num_clients=4, alpha=0.5)
    alg = fedamp(mlp, num_clients=4, alpha_k=2.0, sigma=50.0, alpha_decay_every=1, **TRAIN)
    sim = Simulation(alg, mlp, fed, participation=1.0)
    state = sim.init()
    alphas = fling_alphas(3, 2.0, 0.1, 1)
    for _ in range(3):
        round_ = int(state.round)
        uploads = []
        for i in range(4):
            client = jax.tree.map(lambda x: x[i], state.clients)  # noqa: B023
            data = fed.train_data(jnp.array([i]))
            view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
            key = sampling.client_keys(sampling.round_key(sim.root, round_), jnp.array([i]))[0]
            uploads.append(jax.jit(alg.client_update)(state.server, client, view, key, round_info(round_))[1])
        clouds = numpy_clouds(
            [[np.asarray(x, np.float64) for x in jax.tree.leaves(u.params)] for u in uploads], alphas[round_], 50.0
        )
        state, metrics = jax.jit(sim.round)(state, fed)
        for i in range(4):
            for got, want in zip(jax.tree.leaves(state.server.clouds), clouds[i]):
                np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-5)
            chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], state.clients.params), uploads[i].params,  # noqa: B023
                                        rtol=1e-5, atol=1e-6)  # fmt: skip
        np.testing.assert_allclose(metrics["bytes_down"], 4 * tree_bytes(uploads[0].params))  # its cloud model only
        np.testing.assert_allclose(metrics["bytes_up"], 4 * (tree_bytes(uploads[0].params) + 4))


def test_an_algorithm_built_for_fewer_clients_stops_as_non_finite(mlp, digits):
    """A client beyond the server's table reads a NaN cloud model, not another client's."""
    fed = make_federation(digits, num_clients=4, alpha=0.5)
    sim = Simulation(fedamp(mlp, num_clients=3, **TRAIN), mlp, fed, participation=1.0)
    with pytest.raises(NonFiniteUpdateError):
        sim.run_rounds(sim.init(), 1)
