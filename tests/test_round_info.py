"""The round and the tier have one home: the engine's ``SimState.round``, passed to every function
of a round in one ``RoundInfo``. A round in which every client is skipped (``nonfinite=skip``)
advances the round for everything that reads it: FedARA's lambda warm-up and lr schedule, FedLoRU's
accumulations and download counting."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import UNCLIPPED, make_federation

from jaxfed.algorithms import Aggregation, RoundInfo
from jaxfed.algorithms.fedara import fedara, lambda_at
from jaxfed.algorithms.fedloru import fedloru
from jaxfed.core import gather_clients, lowrank
from jaxfed.data import ClientData
from jaxfed.simulation import Simulation, sampling

SKIPPED = 1  # the 0-based round in which every client's update turns NaN


def _record(calls: list, name: str, info: RoundInfo) -> None:
    """Append ``(name, round, tier)`` to ``calls`` when the compiled round runs."""
    jax.debug.callback(lambda r: calls.append((name, int(r), info.tier)), info.round)


def recorded_and_poisoned(alg, calls: list, bad_round: int = SKIPPED):
    """``alg`` whose functions record the round and tier they are given, and whose every client
    uploads NaN in round ``bad_round``: under ``nonfinite=skip`` that round keeps no client."""

    def broadcast(server_state, info):
        _record(calls, "broadcast", info)
        return alg.broadcast(server_state, info)

    def client_update(message, client_state, data, rng, info):
        _record(calls, "client_update", info)
        new_state, upload, metrics = alg.client_update(message, client_state, data, rng, info)
        poison = jnp.where(info.round == bad_round, jnp.nan, 0.0)
        upload = jax.tree.map(
            lambda x: x + poison.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x, upload
        )
        return new_state, upload, metrics

    def contribute(server_state, message, weight, info):
        _record(calls, "contribute", info)
        return alg.aggregation.contribute(server_state, message, weight, info)

    def apply(server_state, total, info):
        _record(calls, "apply", info)
        return alg.aggregation.apply(server_state, total, info)

    aggregation = Aggregation(contribute, apply)
    wrapped = {"broadcast": broadcast, "client_update": client_update, "aggregation": aggregation}
    if alg.receive is not None:

        def receive(server_state, message, info):
            _record(calls, "receive", info)
            return alg.receive(server_state, message, info)

        wrapped["receive"] = receive
    if alg.download_bytes is not None:

        def download_bytes(message, client_state, info):
            _record(calls, "download_bytes", info)
            return alg.download_bytes(message, client_state, info)

        wrapped["download_bytes"] = download_bytes
    return alg._replace(**wrapped)


def _rounds_seen(calls, name):
    return sorted({r for n, r, _ in calls if n == name})


def _round_by_round(sim, rounds):
    """``[(state after round r, metrics of round r)]``, one compiled round at a time."""
    state, out = sim.init(), []
    for _ in range(rounds):
        state, metrics = sim.run_rounds(state, 1)
        out.append((state, jax.tree.map(lambda m: m[0], metrics)))
    return out


def test_a_skipped_round_advances_fedaras_lambda_and_lr_together(mlp, digits):
    lam, warmup, rounds = 4.0, 4, 4
    alg = fedara(
        mlp, tiers=(1.0, 0.5), lambda_=lam, lambda_warmup_rounds=warmup, local_epochs=1, batch_size=32,
        lr=0.2, lr_schedule="cosine", lr_min=0.0, lr_decay_rounds=rounds,
    )  # fmt: skip
    fed = make_federation(digits, num_clients=4, alpha=1.0)
    calls = []
    sim = Simulation(recorded_and_poisoned(alg, calls), mlp, fed, participation=1.0, seed=3, nonfinite="skip")
    history = _round_by_round(sim, rounds)

    skipped_state, skipped = history[SKIPPED]
    assert float(skipped["nonfinite_clients"]) == 4 and np.isnan(float(skipped["lambda"]))
    assert int(skipped_state.round) == SKIPPED + 1  # the engine's round advanced...
    before = history[SKIPPED - 1][0]
    for a, b in zip(jax.tree.leaves(skipped_state.server), jax.tree.leaves(before.server)):
        np.testing.assert_array_equal(a, b)  # ...and the server state was kept
    for r, (state, metrics) in enumerate(history):
        assert int(state.round) == r + 1
        if r != SKIPPED:  # lambda of the 1-based round r + 1: the warm-up does not fall behind
            np.testing.assert_allclose(float(metrics["lambda"]), float(lambda_at(r + 1, lam, warmup)), rtol=1e-6)
    for name in ("broadcast", "client_update", "receive", "contribute", "apply"):  # every function saw every round
        assert _rounds_seen(calls, name) == list(range(rounds)), name
    assert {t for n, _, t in calls if n == "apply"} == {None}
    assert {t for n, _, t in calls if n == "broadcast"} == {0, 1}

    # The round after the skipped one, client 1 (tier 0) by hand: its new private head is the
    # engine's with lambda and the learning rate of round SKIPPED + 1, and not with those of round SKIPPED.
    state, after = history[SKIPPED][0], history[SKIPPED + 1][0]
    k, tier = 1, 0
    rng = sampling.client_keys(sampling.round_key(sim.root, SKIPPED + 1), jnp.array([k]))[0]  # the engine's key
    data = fed.train_data(jnp.array([k]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    client = gather_clients(state.clients, jnp.array(k))
    update = jax.jit(alg.client_update)

    def head_in(round_):
        info = RoundInfo(round=jnp.int32(round_), tier=tier)
        new_client, _, metrics = update(alg.broadcast(state.server, info), client, view, rng, info)
        return new_client.head, float(metrics["lambda"])

    engine_head = gather_clients(after.clients, jnp.array(k)).head
    head, lam_t = head_in(SKIPPED + 1)
    assert lam_t == pytest.approx(float(lambda_at(SKIPPED + 2, lam, warmup)))
    for a, b in zip(jax.tree.leaves(head), jax.tree.leaves(engine_head)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    behind, _ = head_in(SKIPPED)  # a private counter that missed the skipped round would give this
    gap = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(behind), jax.tree.leaves(engine_head)))
    assert gap > 1e-3


def test_a_skipped_round_keeps_fedlorus_accumulations_and_downloads_on_the_engines_round(mlp, digits):
    every, rounds, skipped = 2, 5, 2  # accumulations after rounds 1 and 3 (0-based); round 2 keeps no client
    alg = fedloru(mlp, lr=0.05, local_epochs=1, batch_size=32, lora_rank=4, accumulate_every=every, **UNCLIPPED)
    fed = make_federation(digits, num_clients=6, alpha=1.0)
    calls = []
    poisoned = recorded_and_poisoned(alg, calls, bad_round=skipped)
    sim = Simulation(poisoned, mlp, fed, participation=0.5, seed=1, nonfinite="skip")
    history = _round_by_round(sim, rounds)
    assert float(history[skipped][1]["nonfinite_clients"]) == sim.num_sampled
    assert [int(s.round) for s, _ in history] == [1, 2, 3, 4, 5]

    def w(state):  # the frozen global kernel W of the adapted layer
        (key,) = state.server.loras
        return np.asarray(lowrank.get_layer(state.server.params, key)["kernel"])

    previous = [sim.init()] + [s for s, _ in history[:-1]]
    folded = [r for r, ((state, _), old) in enumerate(zip(history, previous)) if not np.array_equal(w(state), w(old))]
    assert folded == [1, 3]  # the engine's schedule: round 3 folds although round 2 kept no client

    w_bytes, factor_bytes = 200 * 200 * 4, (200 * 4 + 4 * 200) * 4
    broadcast = sum(x.size * 4 for x in jax.tree.leaves(mlp.init(jax.random.key(0))["params"])) + factor_bytes
    held = {}  # client -> the round whose W it holds: counted on the engine's round
    for r, (_, metrics) in enumerate(history):
        expected = 0
        for k in sim.sampled_ids(r).tolist():
            missed = r // every - held[k] // every if k in held else None
            expected += broadcast - w_bytes + (w_bytes if missed is None else min(w_bytes, missed * factor_bytes))
            if r != skipped:  # a skipped client keeps its old state: the W it held before
                held[k] = r
        assert float(metrics["bytes_down_cached"]) == expected, r
    for name in ("broadcast", "client_update", "download_bytes", "contribute", "apply"):
        assert _rounds_seen(calls, name) == list(range(rounds)), name


@pytest.mark.parametrize("module, records", [("fedara", ("ServerState", "Broadcast")), ("fedloru", ("ServerState",))])
def test_no_algorithm_state_or_message_carries_the_round(module, records):
    import importlib

    from jaxfed.algorithms import fedcspack

    namespace = importlib.import_module(f"jaxfed.algorithms.{module}")
    for record in records:
        fields = getattr(namespace, record)._fields
        assert "round" not in fields and "tier" not in fields, (module, record, fields)
    assert "round" not in fedcspack.ServerState._fields
