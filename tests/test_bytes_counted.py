"""Reported communication bytes against counts made by hand from the messages' shapes: a skipped
client uploads nothing, a tier no client of which uploaded is not reported as 0 bytes."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_federation

from jaxfed.algorithms.fedavg import fedavg
from jaxfed.algorithms.fedhm import fedhm
from jaxfed.algorithms.fedspu import fedspu
from jaxfed.runs.rundir import RunRecord
from jaxfed.simulation import Simulation

# digits mlp: fc1 64x200, fc2 200x200, head 200x10, with biases (float32)
MLP_FLOATS = 64 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10


@pytest.fixture(scope="module")
def fed8(digits):
    return make_federation(digits, num_clients=8)


def _poison(fed, client):
    count = int(fed.train_count[client])
    return fed.replace(x_train=fed.x_train.at[fed.train_idx[client, :count]].set(jnp.inf))


def test_skipped_client_uploads_nothing(mlp, fed8):
    """nonfinite=skip: "a bad client keeps its old state and sends nothing"; bytes_up must not count
    it, with every client vmapped (one at a time: tests/test_nonfinite.py's skip test)."""
    alg = fedavg(mlp, lr=0.1, local_epochs=1, batch_size=16)
    sim = Simulation(alg, mlp, _poison(fed8, 2), participation=1.0, nonfinite="skip", client_chunk=0)
    _, metrics = sim.run_rounds(sim.init(), 1)
    assert float(metrics["nonfinite_clients"][0]) == 1
    assert float(metrics["bytes_up"][0]) == 7 * MLP_FLOATS * 4  # the 7 finite clients' models
    assert float(metrics["bytes_down"][0]) == 8 * MLP_FLOATS * 4  # every sampled client downloaded


def test_skipped_client_uploads_nothing_padded_tiers(mlp, fed8):
    """The same with tiers run as one padded group (FedHM, client_chunk=0), where the engine
    replaces each row's upload bytes by its tier's own size."""
    alg = fedhm(mlp, tiers=(1.0, 0.25), local_epochs=1, batch_size=16)
    sim = Simulation(alg, mlp, _poison(fed8, 6), participation=1.0, nonfinite="skip", client_chunk=0)
    _, metrics = sim.run_rounds(sim.init(), 1)
    tier1 = MLP_FLOATS - 200 * 200 + 2 * 200 * 50  # fc2 as rank-50 factors
    assert float(metrics["nonfinite_clients"][0]) == 1
    assert float(metrics["bytes_up"][0]) == (4 * MLP_FLOATS + 3 * tier1) * 4
    assert float(metrics["bytes_up_client_tier1"][0]) == tier1 * 4


def _spu_floats(rate, indices):
    n = max(1, int(200 * rate))  # units drawn in fc1 and in fc2
    values = 64 * n + n + n * n + n + n * 10 + 10
    return values + (2 * n if indices and rate < 1 else 0)


def test_tier_upload_not_reported_as_zero_when_unsampled(mlp, fed8):
    """bytes_up_client_tier<t> is "what one client of tier t uploads": a round that samples no
    client of tier t must not report 0 (metrics.jsonl averages it into the tier's number)."""
    alg = fedspu(mlp, rates=(1.0, 0.25), local_epochs=1, batch_size=16)
    sim = Simulation(alg, mlp, fed8, participation=0.25, client_chunk=0)
    _, metrics = sim.run_rounds(sim.init(), 4)
    sampled = [set(int(k) for k in sim.sampled_ids(r)) for r in range(4)]
    expected = [_spu_floats(1.0, True) * 4, _spu_floats(0.25, True) * 4]
    tiers = [set(range(0, 4)), set(range(4, 8))]
    assert any(not (s & tiers[t]) for s in sampled for t in (0, 1))  # some round misses a tier
    for r, s in enumerate(sampled):
        assert float(metrics["bytes_up"][r]) == sum(expected[0 if k < 4 else 1] for k in s)
        for t in (0, 1):
            value = float(metrics[f"bytes_up_client_tier{t}"][r])
            assert value == expected[t] or (np.isnan(value) and not s & tiers[t])
    record = RunRecord({})
    record.add_rounds({k: np.asarray(v) for k, v in metrics.items()}, 0.0)
    row = record.add_row(4, {}, 0.0)
    assert [row["bytes_up_client_tier0"], row["bytes_up_client_tier1"]] == expected
