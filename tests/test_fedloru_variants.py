"""pFedLoRU and mFedLoRU: private personal pairs, phases, nested factors, tier uploads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import UNCLIPPED, make_federation, round_info, with_random_lora_updates

from jaxfed.algorithms.fedloru import Upload, fedloru, mfedloru, pfedloru, with_nested
from jaxfed.core import lowrank, tree_bytes
from jaxfed.data import ClientData
from jaxfed.errors import ConfigError
from jaxfed.simulation import Simulation, server_step

# ----- pFedLoRU --------------------------------------------------------------------------------


def _one_client_update(alg, fed, client=2, tier=0, seed=1):
    server, client_state = alg.init(jax.random.key(0))
    data = fed.train_data(jnp.array([client]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    message = alg.broadcast(server, round_info(0, tier))
    new_client, upload, _ = jax.jit(alg.client_update)(
        message, client_state, view, jax.random.key(seed), round_info(0, tier)
    )
    return server, client_state, message, new_client, upload


def _pfedloru(mlp, **options):
    return pfedloru(mlp, lr=0.05, batch_size=32, lora_rank=8, personal_rank=4, **UNCLIPPED, **options)


def test_pfedloru_personal_pair_stays_on_the_client(mlp, digits_federation):
    alg = _pfedloru(mlp, personal_epochs=1, local_epochs=1)
    server, before, message, after, upload = _one_client_update(alg, digits_federation)
    personal = after.personal["fc2"]
    assert personal.down.shape == (200, 4) and personal.up.shape == (4, 200)
    assert float(jnp.abs(personal.up).max()) > 0  # trained (it starts at zero)
    free, _ = lowrank.split_kernels(message.params, ["fc2"])
    assert jax.tree.structure(upload) == jax.tree.structure(Upload(free=free, loras=message.loras))
    assert upload.loras["fc2"].down.shape == (200, 8)  # the global pair, rank 8
    personal_leaves = [np.asarray(x) for x in jax.tree.leaves(after.personal)]
    for leaf in jax.tree.leaves(upload):
        assert not any(p.shape == np.shape(leaf) and np.array_equal(p, leaf) for p in personal_leaves)


@pytest.mark.parametrize("phase", ["personal", "global"])
def test_pfedloru_each_phase_trains_only_its_pair(mlp, digits_federation, phase):
    epochs = (
        {"personal_epochs": 1, "local_epochs": 0} if phase == "personal" else {"personal_epochs": 0, "local_epochs": 1}
    )
    server, before, message, after, upload = _one_client_update(_pfedloru(mlp, **epochs), digits_federation)
    personal_changed = not np.array_equal(after.personal["fc2"].up, before.personal["fc2"].up)
    global_changed = not np.array_equal(upload.loras["fc2"].up, message.loras["fc2"].up)
    free_changed = not np.array_equal(upload.free["head"]["kernel"], message.params["head"]["kernel"])
    assert (personal_changed, global_changed, free_changed) == (
        (True, False, False) if phase == "personal" else (False, True, True)
    )


def test_pfedloru_personalizes(mlp, digits):
    fed = make_federation(digits, num_clients=10, name="pathological", classes_per_client=2)
    sim = Simulation(_pfedloru(mlp, personal_epochs=1, local_epochs=1), mlp, fed, participation=1.0)
    state, _ = sim.run_rounds(sim.init(), 6)
    result = sim.evaluate(state)
    assert result["personalized_acc_mean"] > 0.9 and result["personalized_acc_mean"] > result["global_acc"]


# ----- mFedLoRU --------------------------------------------------------------------------------


def _mfedloru(mlp, tiers, **options):
    return mfedloru(mlp, lr=0.05, local_epochs=1, batch_size=32, lora_rank=16, tiers=tiers, **UNCLIPPED, **options)


def test_mfedloru_with_full_rank_tiers_is_fedloru(mlp, digits_federation):
    runs = []
    plain = fedloru(mlp, lr=0.05, local_epochs=1, batch_size=32, lora_rank=16, accumulate_every=2, **UNCLIPPED)
    for alg in (_mfedloru(mlp, (1.0,), accumulate_every=2), plain):
        sim = Simulation(alg, mlp, digits_federation, participation=0.5)
        runs.append(sim.run_rounds(sim.init(), 3)[0].server)
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_mfedloru_nested_factors_start_at_the_global_model_and_recover_rank_r(mlp):
    alg = _mfedloru(mlp, (0.5,), accumulate_every=0)
    server, _ = alg.init(jax.random.key(0))
    server = with_random_lora_updates(server, 3)
    message = alg.broadcast(server, round_info(0, 0))
    d, u = message.nested["fc2"]
    assert (d.down.shape, d.up.shape, u.down.shape, u.up.shape) == ((200, 8), (8, 16), (16, 8), (8, 200))
    start = with_nested(server.loras, message.nested)
    np.testing.assert_array_equal(start["fc2"].down, server.loras["fc2"].down)  # D2 = U2 = 0
    np.testing.assert_array_equal(start["fc2"].up, server.loras["fc2"].up)

    rng = np.random.default_rng(0)
    free, _ = lowrank.split_kernels(server.params, ["fc2"])
    uploads = [
        Upload(
            free=free, nested=jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), message.nested)
        )
        for _ in range(2)
    ]
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), *uploads)
    new = server_step(alg, server, stacked, jnp.array([1.0, 3.0]))  # the server decodes each upload
    base = server.loras["fc2"]
    (d0, u0), (d1, u1) = (u.nested["fc2"] for u in uploads)
    down = [np.float64(base.down) + np.float64(d.down) @ np.float64(d.up) for d in (d0, d1)]
    up = [np.float64(base.up) + np.float64(u.down) @ np.float64(u.up) for u in (u0, u1)]
    np.testing.assert_allclose(new.loras["fc2"].down, (down[0] + 3 * down[1]) / 4, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new.loras["fc2"].up, (up[0] + 3 * up[1]) / 4, rtol=1e-4, atol=1e-5)


def test_mfedloru_tiers_upload_less_than_fedloru_at_rank_r(mlp, digits):
    plain = fedloru(mlp, lr=0.05, local_epochs=1, batch_size=32, lora_rank=16, **UNCLIPPED)
    server, _ = jax.eval_shape(plain.init, jax.random.key(0))
    free, _ = lowrank.split_kernels(server.params, ["fc2"])
    fedloru_per_client = tree_bytes(Upload(free=free, loras=server.loras))  # what the engine counts per client

    fed = make_federation(digits, num_clients=6, alpha=0.5)
    sim = Simulation(_mfedloru(mlp, (1.0, 0.5, 0.25)), mlp, fed, participation=1.0)
    state, metrics = sim.run_rounds(sim.init(), 3)
    per_client = [float(metrics[f"bytes_up_client_tier{t}"][0]) for t in range(3)]
    assert per_client[0] == fedloru_per_client  # ratio 1: the rank-r factors themselves
    assert fedloru_per_client > per_client[1] > per_client[2]
    fc2_saving = 4 * (200 * 16 * 2 - (200 * 8 + 8 * 16 + 16 * 8 + 8 * 200))
    assert fedloru_per_client - per_client[1] == fc2_saving
    assert float(metrics["bytes_up"][0]) == 2 * sum(per_client)  # two clients per tier, all sampled
    # every client downloads FedLoRU's broadcast (W and the rank-r factors); a lower tier's nested
    # pairs' start counts as the 8-byte key it is drawn from
    fedloru_download = tree_bytes(plain.broadcast(server, round_info(0, 0)))
    assert float(metrics["bytes_down"][0]) == 6 * fedloru_download + 4 * 8
    assert sim.evaluate(state)["global_acc"] > 0.5


def test_mfedloru_tier_errors(mlp):
    with pytest.raises(ConfigError, match=r"tiers: every rank ratio must be in \(0, 1\], got 0.0 in '0.5,0'"):
        _mfedloru(mlp, (0.5, 0))
