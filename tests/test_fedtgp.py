"""FedTGP against the authors' code written out another way: the class gaps and the margin as
their loops, the margin loss with the distance taken directly, the server's SGD as a loop of
steps, the evaluation as the nearest prototype by mean squared difference; an engine round as its
clients one by one, then the server."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_federation, module_features, one_client, round_info

from jaxfed import server_step
from jaxfed.algorithms.fedproto import Prototypes, fedproto
from jaxfed.algorithms.fedtgp import (
    NO_GAP,
    FedTGPOptions,
    NearestPrototype,
    Upload,
    adaptive_margin,
    class_gaps,
    fedtgp,
    init_tgp,
    margin_loss,
    tgp_prototypes,
    train_tgp,
)
from jaxfed.algorithms.prototype_sgd import held_order
from jaxfed.data import ClientData
from jaxfed.errors import ConfigError
from jaxfed.runs.config import Config
from jaxfed.simulation import Simulation, sampling


def authors_margin(means, held, threshold):
    """``receive_protos`` and ``update_TGP``'s margin, as their loops (numpy, float64)."""
    clients, classes, _ = means.shape
    average = {}
    for k in range(classes):  # proto_cluster: the unweighted mean over the clients holding k
        rows = [means[i, k] for i in range(clients) if held[i, k]]
        if rows:
            average[k] = np.mean(rows, axis=0)
    gap = np.full(classes, 1e9)
    for k1 in average:
        for k2 in average:
            if k1 > k2:
                distance = np.linalg.norm(average[k1] - average[k2])
                gap[k1], gap[k2] = min(gap[k1], distance), min(gap[k2], distance)
    smallest = gap.min()
    gap = np.where(gap > 1e8, smallest, gap)
    return gap, min(gap.max(), threshold)


@pytest.mark.parametrize("threshold", [100.0, 0.5])
def test_the_margin_is_the_largest_class_gap_capped_as_the_authors_compute_it(threshold):
    rng = np.random.default_rng(0)
    means = rng.normal(size=(4, 6, 5))
    held = rng.random((4, 6)) < 0.6
    held[:, 2] = False  # a class nobody holds: its gap is the smallest
    held[0] = True
    want_gap, want_margin = authors_margin(means, held, threshold)
    gaps = np.asarray(class_gaps(jnp.asarray(means, jnp.float32), jnp.asarray(held)))
    present = held.any(0)
    np.testing.assert_allclose(gaps[present], want_gap[present], rtol=1e-5)
    assert (gaps[~present] == NO_GAP).all()
    np.testing.assert_allclose(adaptive_margin(jnp.asarray(gaps), threshold), want_margin, rtol=1e-5)


def test_with_one_held_class_the_margin_is_the_threshold():
    """No class has another to measure to: every gap is the authors' 1e9, capped at the threshold."""
    held = np.zeros((2, 4), bool)
    held[:, 1] = True
    gaps = class_gaps(jnp.ones((2, 4, 3)), jnp.asarray(held))
    assert float(adaptive_margin(gaps, 100.0)) == authors_margin(np.ones((2, 4, 3)), held, 100.0)[1] == 100.0


def reference_margin_loss(tgp, prototypes, labels, mask, margin):
    centers = tgp_prototypes(tgp)
    distance = jnp.linalg.norm(prototypes[:, None] - centers[None], axis=-1)  # directly, not expanded
    logits = -(distance + margin * jax.nn.one_hot(labels, centers.shape[0]))
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1)[:, 0]
    return jnp.sum(ce * mask) / jnp.sum(mask)


def _tgp(mlp, seed=0):
    """A TGP of digits' 10 classes and the MLP's 200 features."""
    return fedtgp(mlp).init(jax.random.key(seed))[0].tgp


def test_the_margin_loss_is_the_cross_entropy_of_the_negative_distances_plus_margin(mlp):
    tgp = _tgp(mlp)
    rng = np.random.default_rng(1)
    prototypes = jnp.asarray(rng.normal(size=(6, 200)), jnp.float32)
    labels = jnp.asarray([0, 1, 9, 2, 2, 3])
    mask = jnp.asarray([True, True, True, True, False, True])
    for margin in (0.0, 1.7):
        got = margin_loss(tgp, prototypes, labels, mask, margin)
        np.testing.assert_allclose(got, reference_margin_loss(tgp, prototypes, labels, mask, margin), rtol=1e-5)
        grads = jax.grad(margin_loss)(tgp, prototypes, labels, mask, margin)
        want = jax.grad(reference_margin_loss)(tgp, prototypes, labels, mask, margin)
        chex.assert_trees_all_close(grads, want, rtol=1e-4, atol=1e-6)


IDS = jnp.asarray([4, 0, 7])  # the senders of _uploads' rows


def _uploads(clients=3, classes=10, features=200, seed=2):
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(clients, classes, features))
    held = rng.random((clients, classes)) < 0.7
    return jnp.asarray(means, jnp.float32), jnp.asarray(held)


def test_the_server_trains_the_prototypes_by_sgd_over_every_held_prototype_each_epoch(mlp):
    """One batch holds every held prototype: ``epochs`` steps of full-batch gradient descent."""
    tgp, (means, held) = _tgp(mlp), _uploads()
    got = train_tgp(tgp, means, held, IDS, 0.8, jax.random.key(3), epochs=3, batch_size=64, lr=0.1)
    x, y = means.reshape(-1, 200), jnp.tile(jnp.arange(10), 3)
    want = tgp
    for _ in range(3):
        g = jax.grad(reference_margin_loss)(want, x, y, held.reshape(-1), 0.8)
        want = jax.tree.map(lambda p, d: p - 0.1 * d, want, g)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)


def test_the_servers_batches_are_a_shuffle_of_the_held_prototypes_the_last_partial(mlp):
    """Batches of 4 over the held prototypes in the epoch's shuffle (each one's bits drawn from
    ``fold_in(epoch_key, id * classes + class)``), the last partial; the uploads in another order,
    with rows of nothing held among them, train the same."""
    tgp, (means, held) = _tgp(mlp), _uploads()
    key = jax.random.key(7)
    got = train_tgp(tgp, means, held, IDS, 0.5, key, epochs=2, batch_size=4, lr=0.2)
    want = tgp
    for epoch_key in jax.random.split(key, 2):
        pairs = [(int(IDS[i]), c) for i in range(3) for c in range(10) if held[i, c]]
        draw = {p: int(jax.random.bits(jax.random.fold_in(epoch_key, p[0] * 10 + p[1]))) for p in pairs}
        order = sorted(pairs, key=lambda p: (draw[p], p[0] * 10 + p[1]))
        row = {int(sender): i for i, sender in enumerate(IDS)}
        for start in range(0, len(order), 4):  # torch's DataLoader, drop_last=False
            batch = order[start : start + 4]
            x = jnp.stack([means[row[sender], c] for sender, c in batch])
            y = jnp.asarray([c for _, c in batch])
            g = jax.grad(reference_margin_loss)(want, x, y, jnp.ones(len(batch)), 0.5)
            want = jax.tree.map(lambda p, d: p - 0.2 * d, want, g)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)
    reorder = jnp.asarray([2, 0, 1])
    shuffled = (
        jnp.concatenate([jnp.zeros((2, 10, 200)), means[reorder]]),
        jnp.concatenate([jnp.zeros((2, 10), bool), held[reorder]]),
        jnp.concatenate([jnp.asarray([0, 0]), IDS[reorder]]),  # padding rows carry any id
    )
    moved = train_tgp(tgp, *shuffled, 0.5, key, epochs=2, batch_size=4, lr=0.2)
    chex.assert_trees_all_close(moved, got, rtol=1e-5, atol=1e-7)


def test_a_tie_of_draws_is_broken_by_who_sent_what_not_by_the_upload_order():
    valid = jnp.asarray([True, False, True, True, True])
    pair = jnp.asarray([31, 0, 12, 40, 7])
    bits = jnp.asarray([5, 1, 5, 2, 5], jnp.uint32)  # three held prototypes draw the same bits
    assert held_order(valid, pair, bits).tolist() == [3, 4, 2, 0, 1]  # bits 2, then 5 by pair 7, 12, 31
    swapped = jnp.asarray([2, 1, 0, 3, 4])  # the first and third uploads change places
    order = held_order(valid[swapped], pair[swapped], bits[swapped])
    assert pair[swapped][order].tolist() == pair[held_order(valid, pair, bits)].tolist()


def test_the_tgp_starts_at_torchs_initialization():
    tgp = init_tgp(jax.random.key(0), 100, 400)
    assert abs(float(jnp.std(tgp["embedding"])) - 1.0) < 0.02  # nn.Embedding: N(0, 1)
    for layer in ("hidden", "out"):  # nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for kernel and bias
        for leaf in tgp[layer].values():
            assert float(jnp.max(jnp.abs(leaf))) <= 1 / 20 and float(jnp.max(jnp.abs(leaf))) > 0.98 / 20


def test_the_defaults_are_the_authors_command():
    """run_me.sh: -lr 0.01 -lbs 10 -ls 1 -lam 10 -se 100 -mart 100."""
    options = FedTGPOptions()
    got = (options.lr, options.batch_size, options.local_epochs, options.lambda_)
    assert got + (options.server_epochs, options.margin_threshold) == (0.01, 10, 1, 10.0, 100, 100.0)


def test_the_server_step_is_the_margin_then_the_training_then_the_prototypes(mlp):
    """Weight-0 rows (padding, skipped clients) hold nothing; the server's key is the run's, folded
    with the round; its lr and batches are the clients'."""
    alg = fedtgp(mlp, server_epochs=2, batch_size=8, lr=0.03, margin_threshold=3.0)
    server, _ = alg.init(jax.random.key(0))
    assert not server.prototypes.present.any()
    rng = np.random.default_rng(4)
    means = jnp.asarray(rng.normal(size=(3, 10, 200)), jnp.float32)
    counts = jnp.asarray(rng.integers(0, 3, size=(3, 10)), jnp.float32)
    weights = jnp.asarray([4.0, 0.0, 2.0])
    new = server_step(alg, server, Upload(means, counts, IDS), weights, round_=5)
    held = (np.asarray(counts) > 0) & (np.asarray(weights) > 0)[:, None]
    _, margin = authors_margin(np.asarray(means, np.float64), held, 3.0)
    key = jax.random.fold_in(jax.random.wrap_key_data(server.key_data), 5)
    want = train_tgp(server.tgp, means, jnp.asarray(held), IDS, margin, key, epochs=2, batch_size=8, lr=0.03)
    chex.assert_trees_all_close(new.tgp, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(new.prototypes.means, tgp_prototypes(want), rtol=1e-4, atol=1e-6)
    assert new.prototypes.present.all()
    again = server_step(alg, server, Upload(means, counts, IDS), weights, round_=6)
    assert not np.allclose(again.tgp["embedding"], new.tgp["embedding"])  # another round, another shuffle


def test_the_client_is_fedprotos_from_its_start_and_its_upload_carries_its_id(mlp, digits_federation):
    """FedProto's step (tests/test_baselines.py checks it against its loss written out) from the
    model FedProto's client starts from with the same seed."""
    options = {"lr": 0.1, "local_epochs": 1, "batch_size": 16, "lambda_": 3.0}
    alg, reference = fedtgp(mlp, **options), fedproto(mlp, **options)
    _, client = alg.init(jax.random.key(0))
    _, own = reference.init(jax.random.key(0))
    chex.assert_trees_all_equal((client.params, client.model_state), (own.params, own.model_state))
    client = alg.init_client(client, 2, 0)
    prototypes = Prototypes(jax.random.normal(jax.random.key(1), (10, 200)), jnp.ones((10,), bool))
    data, rng = one_client(digits_federation, 2), jax.random.key(5)
    new, upload, _ = alg.client_update(prototypes, client, data, rng, round_info())
    want_state, want_upload, _ = reference.client_update(prototypes, own, data, rng, round_info())
    chex.assert_trees_all_equal((new.params, upload.means, upload.counts), (want_state.params, *want_upload))
    assert int(new.id) == int(upload.id) == 2


def test_a_client_is_evaluated_by_its_nearest_global_prototype(mlp, digits):
    alg = fedtgp(mlp)
    server, client = alg.init(jax.random.key(0))
    x = jnp.asarray(digits.x_test[:40])
    variables = alg.eval_params(server, client)
    outputs, _ = alg.eval_model.apply(variables, x)
    np.testing.assert_array_equal(outputs, mlp.apply({"params": client.params}, x)[0])  # no prototypes yet
    means = jax.random.normal(jax.random.key(2), (10, 200))
    server = server._replace(prototypes=Prototypes(means, jnp.ones((10,), bool)))
    outputs, _ = alg.eval_model.apply(alg.eval_params(server, client), x)
    z = np.asarray(module_features(mlp, client.params, x), np.float64)
    mse = ((z[:, None] - np.asarray(means, np.float64)[None]) ** 2).mean(-1)  # the authors' loss_mse(r, pro)
    np.testing.assert_array_equal(np.argmax(outputs, 1), np.argmin(mse, 1))
    np.testing.assert_allclose(outputs, -mse, rtol=1e-4, atol=1e-5)
    assert isinstance(alg.eval_model, NearestPrototype) and alg.global_params is None
    present = jnp.arange(10) % 2 == 0  # a class without a prototype is never the nearest
    server = server._replace(prototypes=Prototypes(means, present))
    outputs, _ = alg.eval_model.apply(alg.eval_params(server, client), x)
    np.testing.assert_array_equal(np.argmax(outputs, 1), np.argmin(np.where(present, mse, np.inf), 1))


def test_an_engine_round_is_the_clients_one_by_one_then_the_server(mlp, digits):
    """Three of five clients sampled, two rounds: each client's update by itself, then the server
    step on their uploads stacked in id order (the engine runs them largest first: the same step)."""
    fed = make_federation(digits, num_clients=5, alpha=0.5)
    alg = fedtgp(mlp, server_epochs=3, batch_size=16, lr=0.05)
    sim = Simulation(alg, mlp, fed, participation=0.6)
    state = sim.init()
    for _ in range(2):
        round_ = int(state.round)
        ids = np.sort(np.asarray(sim.sampled_ids(round_)))
        message = alg.broadcast(state.server, round_info(round_))
        uploads = []
        for i in ids:
            client = jax.tree.map(lambda x: x[i], state.clients)  # noqa: B023
            data = fed.train_data(jnp.array([i]))
            view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
            key = sampling.client_keys(sampling.round_key(sim.root, round_), jnp.array([i]))[0]
            uploads.append(jax.jit(alg.client_update)(message, client, view, key, round_info(round_))[1])
        stacked = jax.tree.map(lambda *u: jnp.stack(u), *uploads)
        weights = jnp.asarray(fed.train_count[ids], jnp.float32)
        want = server_step(alg, state.server, stacked, weights, round_=round_)
        state, _ = jax.jit(sim.round)(state, fed)
        chex.assert_trees_all_close(state.server, want, rtol=1e-4, atol=1e-5)
    assert state.server.prototypes.present.all()


def test_a_bad_option_is_one_line():
    with pytest.raises(ConfigError, match="server_epochs"):
        Config(algorithm="fedtgp").with_overrides(["server_epochs=0"]).validate()
