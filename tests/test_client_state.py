"""Host-held client states (``client_state=host``): the same numbers as device-held ones, and a
compiled call that holds only the states of the clients its rounds sample."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import jaxfed
from jaxfed.algorithms.fedamp import fedamp
from jaxfed.algorithms.feddecomp import feddecomp
from jaxfed.algorithms.fedhm import fedhm
from jaxfed.core import tree_bytes
from jaxfed.data import federate, partition
from jaxfed.errors import ConfigError
from jaxfed.runs.build import build
from jaxfed.runs.checkpoint import RunCheckpoints
from jaxfed.runs.config import Config
from jaxfed.runs.sweep import check_sweepable
from jaxfed.simulation import Simulation

CLIENTS, PARTICIPATION = 12, 0.25  # 3 clients per round


def simulations(algorithm: str, digits, mlp, participation=PARTICIPATION, **options) -> dict[str, Simulation]:
    """The same algorithm, data and seed with client states on the device and on the host."""
    train, test = partition("dirichlet", digits.y_train, digits.y_test, CLIENTS, np.random.default_rng(0), alpha=0.5)
    data = federate(digits, train, test)
    built = {"feddecomp": feddecomp, "fedhm": fedhm, "fedamp": fedamp}[algorithm](mlp, **options)
    return {
        where: Simulation(built, mlp, data, participation=participation, seed=0, client_state=where)
        for where in ("device", "host")
    }


@pytest.mark.parametrize("algorithm, options", [("feddecomp", {"local_epochs": 2}), ("fedhm", {"local_epochs": 1})])
def test_host_held_client_states_give_the_device_held_numbers(algorithm, options, digits, mlp):
    """FedDecomp (private per-client state) and FedHM (tiers: evaluation per tier's server view),
    two calls of one round each: states and metrics bit for bit, the evaluation's accuracies too."""
    results = {}
    for where, sim in simulations(algorithm, digits, mlp, **options).items():
        state = sim.init()
        state, first = sim.run_rounds(state, 1)
        state, second = sim.run_rounds(state, 1)
        results[where] = (state, first, second), sim.evaluate(state)
        held = jax.tree.leaves(state.clients)
        assert all(isinstance(x, np.ndarray) == (where == "host") for x in held)
    (device, device_eval), (host, host_eval) = results["device"], results["host"]
    for a, b in zip(jax.tree.leaves(device), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Evaluation runs the host-held clients in blocks: a client's forward pass is vmapped beside
    # other clients there, and the CPU's batched kernels may round its loss in the last bit.
    # Accuracies are counts: equal; the losses agree to float32 rounding.
    assert device_eval.keys() == host_eval.keys() and device_eval["clients"].keys() == host_eval["clients"].keys()
    flat = lambda evaluation: {**evaluation["clients"], **{k: v for k, v in evaluation.items() if k != "clients"}}  # noqa: E731
    for key, value in flat(device_eval).items():
        if "loss" in key:
            np.testing.assert_allclose(flat(host_eval)[key], value, rtol=1e-6)
        else:
            np.testing.assert_array_equal(flat(host_eval)[key], value, err_msg=key)


def test_a_call_holds_only_the_clients_its_rounds_sample(digits, mlp):
    """One round samples 3 of 12 clients: the host-held call's arguments are the device-held
    call's less 9 clients' states, plus the id -> row table (13 int32)."""
    sims = simulations("feddecomp", digits, mlp, local_epochs=2)
    per_client = tree_bytes(sims["device"].init().clients) // CLIENTS
    assert per_client > 0
    arguments = {}
    for where, sim in sims.items():
        state = sim.init()
        arguments[where] = sim.compiled(state, 1).memory_analysis().argument_size_in_bytes
        if where == "host":
            working, _, _ = sim._working_set(state, 1)
            assert tree_bytes(working.clients) == PARTICIPATION * CLIENTS * per_client
    assert arguments["device"] - arguments["host"] == (CLIENTS - 3) * per_client - (CLIENTS + 1) * 4


def test_a_host_held_run_resumes_as_the_device_held_run(tmp_path):
    keys = {"algorithm": "fedper", "num_clients": CLIENTS, "participation": PARTICIPATION, "eval_every": 2,
            "checkpoint_every": 1, "train_reduction": 0.3}  # fmt: skip
    jaxfed.run({**keys, "rounds": 1, "client_state": "host"}, tmp_path / "host", progress=False)
    jaxfed.run({**keys, "rounds": 2, "client_state": "host"}, tmp_path / "host", resume=True, progress=False)
    jaxfed.run({**keys, "rounds": 2}, tmp_path / "device", progress=False)

    def digest(run):
        return json.loads((run / "checkpoints" / "2" / "run" / "metadata").read_text())["integrity"]["state"]

    assert digest(tmp_path / "host") == digest(tmp_path / "device")


def test_client_state_takes_device_or_host_and_a_sweep_refuses_host():
    with pytest.raises(ConfigError, match="client_state: unknown 'disk'.*allowed: device, host"):
        Config(client_state="disk").validate()
    host = Config(client_state="host")
    with pytest.raises(ConfigError, match="client_state: host is for single runs"):
        check_sweepable([host, Config(client_state="host", seed=1)])


def test_a_donated_call_writes_the_clients_back_in_place_with_the_same_numbers(digits, mlp):
    """``run_rounds(..., donate=True)`` (the run loop's) updates the host-held arrays in place: no
    copy of every client's state per call (10 000 FedDecomp clients: 0.145 -> 0.032 s a round on
    this CPU); without it the state given is left as it was."""
    sim = simulations("feddecomp", digits, mlp, local_epochs=2)["host"]
    start = sim.init()
    kept = jax.tree.map(np.copy, start.clients)
    copied, _ = sim.run_rounds(start, 1)
    copied, _ = sim.run_rounds(copied, 1)
    jax.tree.map(np.testing.assert_array_equal, start.clients, kept)  # not donated: unchanged
    first, _ = sim.run_rounds(start, 1, donate=True)
    donated, _ = sim.run_rounds(first, 1, donate=True)
    assert all(a is b for a, b in zip(jax.tree.leaves(first.clients), jax.tree.leaves(donated.clients)))
    jax.tree.map(np.testing.assert_array_equal, donated.clients, copied.clients)


def test_every_checkpoint_of_a_donating_run_holds_the_state_of_its_round(tmp_path):
    """The run loop donates host-held states to the next call while the last checkpoint is still
    being written in the background: each checkpoint restores (its bytes checked against the
    digest taken when it was saved) to the device-held run's state of that round."""
    keys = {"algorithm": "fedper", "num_clients": CLIENTS, "participation": PARTICIPATION, "eval_every": 3,
            "checkpoint_every": 1, "keep_checkpoints": 3, "rounds": 3, "train_reduction": 0.3}  # fmt: skip
    jaxfed.run({**keys, "client_state": "host"}, tmp_path / "host", progress=False)
    jaxfed.run(keys, tmp_path / "device", progress=False)
    like = build(Config.of(keys)).simulation.init()
    for round_ in (1, 2, 3):
        host, _ = RunCheckpoints(tmp_path / "host" / "checkpoints").restore(round_, like)
        device, _ = RunCheckpoints(tmp_path / "device" / "checkpoints").restore(round_, like)
        jax.tree.map(np.testing.assert_array_equal, host, device)


@pytest.mark.parametrize(
    "algorithm, options", [("feddecomp", {"local_epochs": 2}), ("fedamp", {"num_clients": CLIENTS})]
)
def test_host_held_states_start_block_by_block_as_the_device_held_ones(algorithm, options, digits, mlp, monkeypatch):
    """``init`` builds host-held states a block of clients at a time (here a round's 5 of 12: the
    block's bytes set to nothing; the last block padded), never every client's on the device, by
    the program that builds them all at once: the same numbers (FedAMP: each client's id from
    ``init_client``)."""
    import jaxfed.simulation.engine as engine

    monkeypatch.setattr(engine, "HOST_INIT_BLOCK_BYTES", 1)
    sims = simulations(algorithm, digits, mlp, participation=5 / CLIENTS, **options)
    blocks, init_pure = [], Simulation.init_pure
    monkeypatch.setattr(Simulation, "init_pure", lambda self, ids=None: blocks.append(ids) or init_pure(self, ids))
    device, host = sims["device"].init(), sims["host"].init()
    assert [ids.shape for ids in blocks] == [(1,), (5,)]  # its size, then one block traced for every block
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host.clients))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), device, host)


def test_a_checkpoint_holds_host_arrays_as_they_were_when_saved(tmp_path):
    """The run loop donates host-held states to the next call, which writes them in place while
    the checkpoint just begun may still be written: ``save`` must have copied them (orbax's
    ``NumpyHandler`` does, before ``save`` returns). Changed at once after ``save``, the
    checkpoint restores as saved (its digest, taken at ``save``, checks the bytes)."""
    state = {"clients": np.arange(2_000_000, dtype=np.float32).reshape(1000, 2000), "round": np.int32(1)}
    saved = jax.tree.map(np.copy, state)
    checkpoints = RunCheckpoints(tmp_path / "checkpoints")
    checkpoints.save(1, state, {"config": {}})
    state["clients"][:] = -1.0  # what the next call's write-back does
    checkpoints.wait()
    restored, _ = checkpoints.restore(1, saved)
    jax.tree.map(np.testing.assert_array_equal, restored, saved)
