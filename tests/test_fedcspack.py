"""FedCSPACK: the client's upload against a numpy reference, merge, aggregation, bytes, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_federation, round_info
from test_packs import _np_scores

from jaxfed.algorithms.fedcspack import fedcspack
from jaxfed.cli import main
from jaxfed.core import packs as pk
from jaxfed.data import ClientData
from jaxfed.simulation import Simulation, server_step

PACK = 1024


def _fedcspack(model, **options):
    return fedcspack(model, lr=0.05, local_epochs=1, batch_size=32, pack_size=PACK, **options)


def _client_update(alg, fed, server, client_state, client=2, seed=1):
    data = fed.train_data(jnp.array([client]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    info = round_info()
    return jax.jit(alg.client_update)(alg.broadcast(server, info), client_state, view, jax.random.key(seed), info)


def _packs(tree):
    flat = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])
    padded = np.zeros(-(-flat.size // PACK) * PACK)
    padded[: flat.size] = flat
    return padded.reshape(-1, PACK)


@pytest.mark.parametrize("select, weight", [("top_k", "cos_kl"), ("all_below", "kl")])
def test_upload_is_the_selected_packs_of_a_numpy_reference(mlp, digits_federation, select, weight):
    alg = _fedcspack(mlp, select=select, weight=weight, share_ratio=0.1)
    server, client = alg.init(jax.random.key(0))
    new_client, upload, metrics = _client_update(alg, digits_federation, server, client)
    local, reference = _packs(new_client.params), _packs(server.params)
    theta_a, theta, beta = _np_scores(local, reference)
    candidates = np.flatnonzero(theta < theta_a)
    candidates = candidates[np.argsort(theta[candidates], kind="stable")]
    k = int(np.ceil(0.1 * len(theta))) if select == "top_k" else len(theta)
    expected = candidates[:k]
    assert 0 < len(expected) and upload.indices.shape == (k,)
    sent = np.asarray(upload.indices)[np.asarray(upload.sent)]
    np.testing.assert_array_equal(sent, expected)
    term = {"cos_kl": theta + beta, "kl": beta}[weight]
    np.testing.assert_allclose(
        np.asarray(upload.weights)[np.asarray(upload.sent)], np.abs(term[expected]), rtol=1e-4, atol=1e-6
    )
    assert np.all(np.asarray(upload.weights)[~np.asarray(upload.sent)] == 0)
    np.testing.assert_allclose(
        np.asarray(upload.deltas)[np.asarray(upload.sent)],
        local[expected] - reference[expected],
        rtol=1e-5,
        atol=1e-6,
    )
    assert float(metrics["packs_sent"]) == len(expected)


@pytest.mark.parametrize("merge", ["masked", "full"])
def test_masked_merge_keeps_the_packs_the_global_mask_does_not_flag(mlp, merge):
    """A client sampled every round (last seen in the previous round) takes exactly the packs of the
    last round's mask M, the paper's rule; merge=full takes the whole global model."""
    alg = _fedcspack(mlp, merge=merge)
    server, client = alg.init(jax.random.key(0))
    other = jax.tree.map(lambda x: x + 1.0, client.params)  # the client's own, different model
    num_packs = _packs(server.params).shape[0]
    flagged = np.arange(num_packs) % 3 == 0
    mask = jnp.asarray(flagged, jnp.float32) * 0.4
    # M moved these in round 4 (0-based; updated = 1 + the round), the round the client last took part in
    updated = jnp.asarray(np.where(flagged, 5, np.arange(num_packs) % 5), jnp.int32)
    server = server._replace(mask=mask, updated=updated)
    merged = _packs(alg.eval_params(server, client._replace(params=other, last_seen=jnp.int32(4)))["params"])
    np.testing.assert_array_equal(merged[flagged], _packs(server.params)[flagged])
    keep = _packs(other)[~flagged] if merge == "masked" else _packs(server.params)[~flagged]
    np.testing.assert_array_equal(merged[~flagged], keep)


def test_a_rarely_sampled_client_takes_every_pack_moved_since_it_last_took_part(mlp):
    alg = _fedcspack(mlp)
    server, client = alg.init(jax.random.key(0))
    other = jax.tree.map(lambda x: x + 1.0, client.params)
    num_packs = _packs(server.params).shape[0]
    updated = np.arange(num_packs) % 6  # pack p last moved in round updated[p] - 1 (0: never)
    server = server._replace(updated=jnp.asarray(updated, jnp.int32))
    for last_seen, take in ((2, updated > 2), (-1, np.ones(num_packs, bool))):  # -1: never took part
        merged = _packs(
            alg.eval_params(server, client._replace(params=other, last_seen=jnp.int32(last_seen)))["params"]
        )
        np.testing.assert_array_equal(merged[take], _packs(server.params)[take])
        np.testing.assert_array_equal(merged[~take], _packs(other)[~take])


def test_a_never_sampled_client_is_evaluated_on_the_global_model(mlp, digits):
    fed = make_federation(digits, num_clients=10, alpha=0.5)
    sim = Simulation(_fedcspack(mlp), mlp, fed, participation=0.2)
    state, _ = sim.run_rounds(sim.init(), 3)
    sampled = set(np.concatenate([sim.sampled_ids(r) for r in range(3)]).tolist())
    never = next(k for k in range(10) if k not in sampled)
    client = jax.tree.map(lambda x: x[never], state.clients)
    assert int(client.last_seen) == -1
    chex.assert_trees_all_equal(sim.algorithm.eval_params(state.server, client)["params"], state.server.params)
    seen = next(iter(sampled))
    assert int(jax.tree.map(lambda x: x[seen], state.clients).last_seen) >= 0


def test_server_moves_only_sent_packs_and_the_new_mask_sums_the_weights(mlp, digits_federation):
    alg = _fedcspack(mlp, share_ratio=0.2)
    server, client = alg.init(jax.random.key(0))
    uploads = [_client_update(alg, digits_federation, server, client, client=c, seed=c)[1] for c in (1, 4)]
    stacked = jax.tree.map(lambda *rows: jnp.stack(rows), *uploads)
    new = server_step(alg, server, stacked, jnp.array([50.0, 80.0]))
    before, after = _packs(server.params), _packs(new.params)
    mask = np.zeros(before.shape[0])
    for u in uploads:
        for i, s, w in zip(np.asarray(u.indices), np.asarray(u.sent), np.asarray(u.weights)):
            mask[i] += w if s else 0.0
    np.testing.assert_allclose(new.mask, mask, rtol=1e-6)
    unsent = mask == 0
    assert unsent.any() and (~unsent).any()
    np.testing.assert_array_equal(after[unsent], before[unsent])
    assert np.all(np.any(after[~unsent] != before[~unsent], axis=1))


def test_bytes_up_count_the_sent_packs_and_it_learns(mlp, digits_federation):
    alg = _fedcspack(mlp, share_ratio=0.1)
    sim = Simulation(alg, mlp, digits_federation, participation=0.5)
    k = pk.num_selected(_packs(sim.init().server.params).shape[0], 0.1)
    state, metrics = sim.run_rounds(sim.init(), 1)
    # every client had k candidates: their sample-weighted mean is k up to float32 rounding of the sum
    assert float(metrics["packs_sent"][0]) == pytest.approx(k, rel=1e-6)
    assert float(metrics["bytes_up"][0]) == 5 * k * (PACK * 4 + 4 + 4)  # values, index, weight
    before = sim.evaluate(state)["personalized_acc_mean"]
    # rarely sampled clients take every pack moved since: more rounds to 0.8. One round a call: the
    # 1-round program above runs again (8 rounds in one call would compile another program)
    for _ in range(8):
        state, _ = sim.run_rounds(state, 1)
    after = sim.evaluate(state)["personalized_acc_mean"]
    assert after > 0.8 and after > before


@pytest.mark.parametrize(
    "override, expected",
    [
        ("pack_size=0", "pack_size: must be >= 1, got 0"),
        ("share_ratio=0", "share_ratio: must be in (0, 1], got 0.0"),
        ("share_ratio=1.5", "share_ratio: must be in (0, 1], got 1.5"),
        ("select=random", "select: unknown 'random'; allowed: top_k, all_below"),
        ("weight=l2", "weight: unknown 'l2'; allowed: cos_kl, cos, kl"),
        ("merge=none", "merge: unknown 'none'; allowed: masked, full"),
    ],
)
def test_bad_settings_are_one_line_errors(override, expected, tmp_path, capsys):
    assert main(["run", "fedcspack", "--set", override, "--out", str(tmp_path / "r"), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == f"jaxfed: error: {expected}"
