"""FedCAC against the authors' code written out in numpy float64 (Fling's ``fedcac_client.py``
``evaluate_critical_parameter`` and ``fedcac_group.py`` ``get_customized_global_models``, loop
by loop): the critical masks, the overlaps, the threshold's schedule, the customized and global
models; a client's round from its synced model; an engine round against that reference."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_federation, round_info

from jaxfed.algorithms.fedcac import Upload, collaborators, critical_mask, fedcac, kth_largest, overlaps, synced
from jaxfed.algorithms.training import train_parameters
from jaxfed.core import tree_bytes
from jaxfed.data import ClientData
from jaxfed.errors import NonFiniteUpdateError
from jaxfed.simulation import Simulation, sampling

TRAIN = {"lr": 0.1, "local_epochs": 1, "batch_size": 32}


def numpy_critical(before, after, tau):
    """``evaluate_critical_parameter`` for one tensor, as the authors wrote it (torch.topk's last value)."""
    c = np.abs((after - before) * after).ravel()
    nz = int(tau * c.size)
    thresh = np.sort(c)[::-1][nz - 1] if nz > 0 else np.inf
    if thresh <= 1e-10:
        positive = c[c > 1e-20]
        if len(positive):
            thresh = np.sort(positive)[0]
    return (c >= thresh).reshape(after.shape)


def numpy_server(models, masks, sizes, round_, beta):
    """``fed_avg`` and ``get_customized_global_models`` over the clients given (lists, float64)."""
    n = len(models)
    flat = [np.concatenate([m.ravel() for m in client]).astype(np.float64) for client in masks]
    overlap = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i != j:
                overlap[i][j] = 1 - np.sum(np.abs(flat[i] - flat[j])) / (np.sum(flat[i]) * 2)
    pairs = [overlap[i][j] for i in range(n) for j in range(n) if i != j]
    mean, largest = sum(pairs) / ((n - 1) * n), max(pairs)
    threshold = mean + (round_ + 1) / beta * (largest - mean)
    customized = []
    for i in range(n):
        together = [i] + [j for j in range(n) if j != i and overlap[i][j] >= threshold]
        customized.append([sum(models[c][k] for c in together) / len(together) for k in range(len(models[i]))])
    total = sum(sizes)
    global_model = [sum(sizes[c] / total * models[c][k] for c in range(n)) for k in range(len(models[0]))]
    return customized, global_model, threshold


@pytest.mark.parametrize("tau", [0.5, 0.3, 0.05])
def test_the_critical_mask_is_the_authors(tau):
    rng = np.random.default_rng(0)
    before = rng.normal(size=(17, 9)).astype(np.float32)
    after = before + rng.normal(scale=0.1, size=before.shape).astype(np.float32)
    after[:3] = before[:3]  # unchanged places: sensitivity 0
    got = critical_mask(jnp.asarray(before), jnp.asarray(after), tau)
    np.testing.assert_array_equal(got, numpy_critical(before, after, tau))
    assert 0 < np.sum(got) < got.size


def test_the_kth_largest_is_exact_with_ties_zeros_and_every_k():
    rng = np.random.default_rng(3)
    values = np.abs(rng.normal(size=257)).astype(np.float32)
    values[:60] = values[60]  # a run of ties
    values[-20:] = 0.0
    values[100] = np.float32(1e-30)  # subnormal-small, above zero
    ordered = np.sort(values)[::-1]
    got = jax.jit(jax.vmap(lambda k: kth_largest(jnp.asarray(values), k)))(jnp.arange(1, 258))
    np.testing.assert_array_equal(got, ordered)


def test_a_mostly_unchanged_tensor_takes_its_smallest_moved_place():
    """More than 1 - tau of the places unchanged: the k-th largest sensitivity is 0 and the rule
    falls to the smallest positive one (every moved place is critical); a tensor that did not move
    at all is all critical (threshold 0, as the authors' code leaves it); tau * n below 1: none."""
    before = np.arange(1.0, 11.0, dtype=np.float32)
    after = before.copy()
    after[[2, 7]] += 0.5
    got = critical_mask(jnp.asarray(before), jnp.asarray(after), 0.5)
    np.testing.assert_array_equal(got, numpy_critical(before, after, 0.5))
    np.testing.assert_array_equal(np.flatnonzero(got), [2, 7])
    assert np.all(critical_mask(jnp.asarray(before), jnp.asarray(before), 0.5))
    assert not np.any(critical_mask(jnp.ones(3), jnp.full(3, 2.0), 0.3))


def random_uploads(template, rows, seed):
    keys = jax.random.split(jax.random.key(seed), 2)
    leaves, structure = jax.tree.flatten(template)
    params = [jax.random.normal(jax.random.fold_in(keys[0], i), (rows,) + x.shape) for i, x in enumerate(leaves)]
    masks = [jax.random.bernoulli(jax.random.fold_in(keys[1], i), 0.5, (rows,) + x.shape) for i, x in enumerate(leaves)]
    return jax.tree.unflatten(structure, params), jax.tree.unflatten(structure, masks)


@pytest.mark.parametrize("round_", [0, 3, 9])
def test_the_server_step_is_the_authors_over_the_rounds_uploads(round_, mlp):
    """Rows of weight 0 (padding, a skipped client) take no part and write nothing; the present
    rows' customized models land at their clients' ids. beta 10: round 9's threshold is the largest overlap."""
    num_clients, beta = 8, 10
    alg = fedcac(mlp, num_clients=num_clients, beta=beta, **TRAIN)
    server, _ = alg.init(jax.random.key(0))
    params, masks = random_uploads(server.params, 6, seed=round_)
    ids = jnp.array([5, 0, 7, 2, 3, 1], jnp.int32)
    weights = jnp.array([30.0, 0.0, 12.0, 50.0, 0.0, 41.0])
    new = jax.jit(alg.server_update)(server, Upload(params, masks, ids), weights, round_info(round_, None))

    kept = [r for r in range(6) if weights[r] > 0]
    as_list = lambda tree, r: [np.asarray(x[r], np.float64) for x in jax.tree.leaves(tree)]  # noqa: E731
    customized, global_model, _ = numpy_server(
        [as_list(params, r) for r in kept], [as_list(masks, r) for r in kept], [float(weights[r]) for r in kept],
        round_, beta,
    )  # fmt: skip
    for got, want in zip(jax.tree.leaves(new.params), global_model):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for r, want in zip(kept, customized):
        for got, w in zip(jax.tree.leaves(new.customized), want):
            np.testing.assert_allclose(got[int(ids[r])], w, rtol=1e-5, atol=1e-6)
    written = sorted(int(ids[r]) for r in kept)
    np.testing.assert_array_equal(np.flatnonzero(new.has_row), written)
    for untouched in sorted(set(range(num_clients)) - set(written)):
        chex.assert_trees_all_equal(jax.tree.map(lambda t: t[untouched], new.customized), server.params)


def test_collaboration_narrows_from_above_the_mean_overlap_to_the_largest():
    """A and B mark the same places, C three of A's four, D none of them: overlaps 1, 0.75, 0.25, 0
    (mean 5.5 / 12). In round 0 the threshold is just above the mean (A, B, C share; D is alone),
    in round beta - 1 it is the largest overlap (only A and B share)."""
    masks = jnp.array([[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 1, 0, 0],
                       [0, 0, 0, 0, 1, 1, 1, 1]], bool)  # fmt: skip
    overlap = overlaps({"w": masks})
    np.testing.assert_allclose(overlap[0, 1:], [1.0, 0.75, 0.0])
    np.testing.assert_allclose(overlap[2, 3], 0.25)
    present = jnp.ones(4, bool)
    abc = [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 1]]
    np.testing.assert_array_equal(collaborators(overlap, present, 0, 100), abc)
    np.testing.assert_array_equal(collaborators(overlap, present, 99, 100), [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0],
                                                                              [0, 0, 0, 1]])  # fmt: skip
    # the round counts from 0: round 1 of beta 2 is already the largest overlap (round 0's threshold would admit C)
    np.testing.assert_array_equal(collaborators(overlap, present, 1, 2), [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0],
                                                                          [0, 0, 0, 1]])  # fmt: skip
    np.testing.assert_array_equal(collaborators(overlap, present, 0, 2), abc)
    # a row of weight 0 takes no part: without B, A's closest is C
    without_b = collaborators(overlap, jnp.array([True, False, True, True]), 99, 100)
    np.testing.assert_array_equal(without_b, [[1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]])


def test_a_client_trains_from_its_synced_model_and_marks_what_moved(mlp, digits_federation):
    alg = fedcac(mlp, num_clients=4, tau=0.3, **TRAIN)
    server, client = alg.init(jax.random.key(0))
    client = alg.init_client(client, 2, 0)
    customized, critical = random_uploads(server.params, 4, seed=1)
    server = server._replace(customized=customized, has_row=jnp.array([False, False, True, False]))
    client = client._replace(critical=jax.tree.map(lambda m: m[2], critical))
    data = digits_federation.train_data(jnp.array([2]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])

    start = synced(server, client)
    for s, m, c, g in zip(*(jax.tree.leaves(t) for t in (start, client.critical, customized, server.params))):
        np.testing.assert_array_equal(s, np.where(m, c[2], g))
    new, upload, metrics = jax.jit(alg.client_update)(server, client, view, jax.random.key(3), round_info(1))
    want, _, _ = train_parameters(
        mlp, alg.options.optimizer(1), start, {}, view, jax.random.key(3), **alg.options.batching()
    )
    chex.assert_trees_all_close(upload.params, want, rtol=1e-5, atol=1e-6)
    for got, b, a in zip(jax.tree.leaves(upload.critical), jax.tree.leaves(start), jax.tree.leaves(upload.params)):
        np.testing.assert_array_equal(got, numpy_critical(np.asarray(b), np.asarray(a), 0.3))
    assert int(upload.id) == 2 and int(new.id) == 2
    # the model evaluated is the synced one, after the server's step as before it
    chex.assert_trees_all_equal(alg.eval_params(server, client)["params"], start)
    # a client the server has no row for (a new client after its update) keeps its own critical places
    alone = synced(server._replace(has_row=jnp.zeros(4, bool)), new)
    for s, m, own, g in zip(*(jax.tree.leaves(t) for t in (alone, new.critical, new.params, server.params))):
        np.testing.assert_array_equal(s, np.where(m, own, g))


def test_an_engine_round_is_the_clients_one_by_one_then_the_server(mlp, digits):
    """Three of five clients sampled: each client's update by itself, then the reference server."""
    fed = make_federation(digits, num_clients=5, alpha=0.5)
    alg = fedcac(mlp, num_clients=5, beta=3, **TRAIN)
    sim = Simulation(alg, mlp, fed, participation=0.6)
    state = sim.init()
    for _ in range(2):
        ids = np.sort(np.asarray(sim.sampled_ids(int(state.round))))
        server = state.server
        uploads, sizes = [], []
        for i in ids:
            client = jax.tree.map(lambda x: x[i], state.clients)  # noqa: B023
            data = fed.train_data(jnp.array([i]))
            view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
            key = sampling.client_keys(sampling.round_key(sim.root, int(state.round)), jnp.array([i]))[0]
            uploads.append(jax.jit(alg.client_update)(server, client, view, key, round_info(int(state.round)))[1])
            sizes.append(float(fed.train_count[i]))
        as_list = lambda tree: [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]  # noqa: E731
        customized, global_model, _ = numpy_server(
            [as_list(u.params) for u in uploads], [as_list(u.critical) for u in uploads], sizes, int(state.round), 3
        )
        state, metrics = jax.jit(sim.round)(state, fed)
        for got, want in zip(jax.tree.leaves(state.server.params), global_model):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        for i, want in zip(ids, customized):
            for got, w in zip(jax.tree.leaves(state.server.customized), want):
                np.testing.assert_allclose(got[i], w, rtol=1e-4, atol=1e-5)
        model_bytes = tree_bytes(server.params)
        mask_bits = sum(-(-x.size // 8) for x in jax.tree.leaves(server.params))
        np.testing.assert_allclose(metrics["bytes_down"], len(ids) * model_bytes)  # one model each, not the table
        np.testing.assert_allclose(metrics["bytes_up"], len(ids) * (model_bytes + mask_bits + 4))
        for i in ids:
            np.testing.assert_array_equal(state.clients.id[i], i)


def test_an_algorithm_built_for_fewer_clients_stops_as_non_finite(mlp, digits):
    """A client beyond the server's table reads NaN, not another client's row."""
    fed = make_federation(digits, num_clients=4, alpha=0.5)
    sim = Simulation(fedcac(mlp, num_clients=3, **TRAIN), mlp, fed, participation=1.0)
    with pytest.raises(NonFiniteUpdateError):
        sim.run_rounds(sim.init(), 2)
