"""Non-finite client updates: detected inside the compiled round; ``error`` stops, ``skip`` drops."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import round_info

from jaxfed import NonFiniteUpdateError
from jaxfed.algorithms.fedavg import fedavg
from jaxfed.algorithms.local import local
from jaxfed.algorithms.records import ClientStats
from jaxfed.cli import main
from jaxfed.data import ClientData
from jaxfed.simulation import Simulation, sampling


def _poison(fed, client):
    """Client ``client``'s training inputs set to inf: its update cannot be finite."""
    count = int(fed.train_count[client])
    rows = fed.train_idx[client, :count]
    return fed.replace(x_train=fed.x_train.at[rows].set(jnp.inf))


def _view(fed, k):
    """Client k alone (its padded index row: one compile for every client)."""
    return ClientData(x=fed.x_train, y=fed.y_train, indices=fed.train_idx[k], count=fed.train_count[k])


def test_skip_drops_the_client_from_the_mean(mlp, digits_federation):
    bad = 2
    fed = _poison(digits_federation, bad)
    alg = fedavg(mlp, lr=0.1, local_epochs=1, batch_size=16)
    sim = Simulation(alg, mlp, fed, participation=1.0, seed=4, nonfinite="skip", client_chunk=1)
    state = sim.init()
    new_state, metrics = sim.run_rounds(state, 1)
    assert float(metrics["nonfinite_clients"][0]) == 1
    assert np.isfinite(float(metrics["train_loss"][0]))
    # "a bad client keeps its old state and sends nothing": the 9 others' models up, all 10 down
    # (one client at a time; tests/test_bytes_counted.py: vmapped, padded tiers)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(state.server.params))
    assert float(metrics["bytes_up"][0]) == 9 * model_bytes
    assert float(metrics["bytes_down"][0]) == 10 * model_bytes

    key = sampling.round_key(sim.root, 0)
    ids = np.asarray(sampling.sample_clients(sim.root, key, fed.num_clients, fed.num_clients))
    rngs = sampling.client_keys(key, jnp.asarray(ids))
    message = alg.broadcast(state.server, round_info(0, 0))
    one = jax.jit(alg.client_update)
    uploads, counts = [], []
    for i, k in enumerate(ids):
        upload = one(message, ClientStats({}), _view(fed, k), rngs[i], round_info())[1]
        finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(upload))
        assert finite == (k != bad)
        if finite:
            uploads.append(upload)
            counts.append(float(fed.train_count[k]))
    for new_leaf, *leaves in zip(jax.tree.leaves(new_state.server.params), *map(jax.tree.leaves, uploads)):
        expected = sum(c * np.asarray(x, np.float64) for c, x in zip(counts, leaves)) / sum(counts)
        np.testing.assert_allclose(new_leaf, expected, rtol=1e-4, atol=1e-5)


def test_skip_keeps_the_clients_previous_state(mlp, digits_federation):
    bad = 5
    sim = Simulation(
        local(mlp, lr=0.1, local_epochs=1, batch_size=16),
        mlp,
        _poison(digits_federation, bad),
        participation=1.0,
        nonfinite="skip",
    )
    state = sim.init()
    new_state, metrics = sim.run_rounds(state, 2)
    np.testing.assert_array_equal(metrics["nonfinite_clients"], [1, 1])
    before, after = jax.tree.leaves(state.clients)[0], jax.tree.leaves(new_state.clients)[0]
    for k in range(digits_federation.num_clients):
        assert np.array_equal(before[k], after[k]) == (k == bad)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(new_state))


def _first_new_client(root, num_clients, per_round):
    """A client not sampled in round 0 and the first round (>= 1) that samples it."""
    seen = set()
    for t in range(50):
        ids = np.asarray(sampling.sample_clients(root, sampling.round_key(root, t), num_clients, per_round)).tolist()
        fresh = [k for k in ids if k not in seen]
        if t > 0 and fresh:
            return fresh[0], t
        seen.update(ids)
    raise AssertionError("no client appears late")


def test_error_reports_round_and_client_and_returns_the_last_good_state(mlp, digits_federation):
    sim_args = dict(participation=0.3, seed=11)
    probe = Simulation(fedavg(mlp, lr=0.1, local_epochs=1, batch_size=16), mlp, digits_federation, **sim_args)
    bad, first_round = _first_new_client(probe.root, 10, probe.num_sampled)

    alg = fedavg(mlp, lr=0.1, local_epochs=1, batch_size=16)
    sim = Simulation(alg, mlp, _poison(digits_federation, bad), **sim_args)
    state = sim.init()
    with pytest.raises(NonFiniteUpdateError) as caught:
        sim.run_rounds(state, first_round + 3)
    err = caught.value
    assert err.round == first_round + 1 and err.client_ids == [bad]
    assert f"round {first_round + 1}: non-finite update" in str(err) and str(bad) in str(err)
    assert int(err.state.round) == first_round
    assert len(err.metrics["train_loss"]) == first_round
    good, _ = sim.run_rounds(state, first_round)  # the rounds before the bad one, left alone
    for a, b in zip(jax.tree.leaves(err.state), jax.tree.leaves(good)):
        np.testing.assert_array_equal(a, b)


def test_cli_error_checkpoints_then_resume_with_skip(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["--quiet", "--set", "lr=1e6", "--set", "rounds=4", "--set", "eval_every=2", "--set", "num_clients=6"]
    assert main(["run", "--out", str(run_dir), *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("jaxfed: error: round 1: non-finite update") and "client(s) " in err
    assert "last good state saved in" in err and "--resume --set nonfinite=skip" in err
    assert (run_dir / "checkpoints" / "0").is_dir()
    assert main(["run", "--out", str(run_dir), "--resume", "--quiet"]) == 1  # resumed as it was: the same stop
    assert capsys.readouterr().err.strip().splitlines()[-1] == err
    assert main(["run", "--out", str(run_dir), "--resume", "--quiet", "--set", "nonfinite=skip"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["nonfinite_skipped_total"] >= 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [2, 4] and rows[0]["nonfinite_skipped"] >= 3


def test_a_call_failing_at_its_first_round_right_after_a_checkpoint_began_keeps_that_checkpoint(tmp_path):
    """A checkpoint begun in the background at round 2, then the next call's first round non-finite:
    the last good state is that round's, already being written. Saving it again crashed with
    orbax's ``StepAlreadyExistsError``; now it is the run's NonFiniteUpdateError, its checkpoint whole."""
    import jaxfed
    from jaxfed.runs.checkpoint import RunCheckpoints

    keys = {"algorithm": "ditto", "num_clients": 12, "participation": 0.25, "eval_every": 2, "checkpoint_every": 1,
            "rounds": 8, "train_reduction": 0.3, "lr": 3.0, "rounds_per_call": 3}  # fmt: skip
    with pytest.raises(NonFiniteUpdateError, match="^round 3: non-finite update") as raised:
        jaxfed.run(keys, tmp_path / "run", progress=False, log=lambda line: None)
    assert raised.value.checkpoint == tmp_path / "run" / "checkpoints" / "2"
    assert RunCheckpoints(tmp_path / "run" / "checkpoints").rounds() == [1, 2]
