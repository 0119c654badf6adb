"""FedLoRA and FedLoRU: accumulation keeps the model, factors averaged separately, they learn."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import UNCLIPPED, fedopt_reference, make_federation, round_info, with_random_lora_updates

from jaxfed.algorithms.fedloru import ServerState, Upload, fedloru
from jaxfed.cli import main
from jaxfed.core import lowrank
from jaxfed.errors import ConfigError
from jaxfed.simulation import Simulation, sampling, server_step


def _algorithm(mlp, **options):
    return fedloru(mlp, lr=0.05, local_epochs=1, batch_size=32, lora_rank=4, **UNCLIPPED, **options)


def _logits(alg, mlp, server, x):
    return mlp.apply(alg.global_params(server), x)[0]


def _message(alg, server):
    """What a client that did not move would upload: the broadcast trainable tree."""
    free, _ = lowrank.split_kernels(server.params, list(server.loras))
    return Upload(free=free, loras=server.loras)


@pytest.mark.parametrize("reinit", [True, False])
def test_accumulation_leaves_the_model_unchanged(mlp, digits, reinit):
    alg = _algorithm(mlp, accumulate_every=3, reinit=reinit)
    server, _ = alg.init(jax.random.key(0))
    server = with_random_lora_updates(server, seed=1)
    x = jnp.asarray(digits.x_test[:64])
    before = _logits(alg, mlp, server, x)
    stacked = jax.tree.map(lambda a: a[None], _message(alg, server))
    after_state = server_step(alg, server, stacked, jnp.ones(1), round_=2)  # round 2 (0-based) accumulates
    np.testing.assert_allclose(_logits(alg, mlp, after_state, x), before, rtol=1e-5, atol=1e-5)
    key = next(iter(server.loras))
    kernel_before = lowrank.get_layer(server.params, key)["kernel"]
    kernel_after = lowrank.get_layer(after_state.params, key)["kernel"]
    assert float(jnp.abs(kernel_after - kernel_before).max()) > 1e-3  # the update moved into W
    if reinit:
        np.testing.assert_array_equal(after_state.loras[key].up, 0)
        assert not np.array_equal(after_state.loras[key].down, server.loras[key].down)
    else:  # continued factors: W holds them once, the model subtracts what W already holds
        np.testing.assert_array_equal(after_state.loras[key].up, server.loras[key].up)
        np.testing.assert_array_equal(after_state.merged[key].up, server.loras[key].up)
        again = server_step(
            alg, after_state, jax.tree.map(lambda a: a[None], _message(alg, after_state)), jnp.ones(1), round_=5
        )  # and round 5
        np.testing.assert_allclose(_logits(alg, mlp, again, x), before, rtol=1e-5, atol=1e-5)


def test_factors_are_averaged_separately(mlp):
    alg = _algorithm(mlp, accumulate_every=0)  # fedlora: never accumulates
    server, _ = alg.init(jax.random.key(0))
    one, two = with_random_lora_updates(server, 1), with_random_lora_updates(server, 2)
    two = two._replace(loras={k: lowrank.LoRA(2 * f.down, f.up) for k, f in two.loras.items()})
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), _message(alg, one), _message(alg, two))
    weights = jnp.array([1.0, 3.0])
    new = server_step(alg, server, stacked, weights)
    for key in server.loras:
        a, b = one.loras[key], two.loras[key]
        np.testing.assert_allclose(new.loras[key].down, (np.asarray(a.down) + 3 * np.asarray(b.down)) / 4, rtol=1e-6)
        np.testing.assert_allclose(new.loras[key].up, (np.asarray(a.up) + 3 * np.asarray(b.up)) / 4, rtol=1e-5)
        product_mean = (np.asarray(a.down @ a.up) + 3 * np.asarray(b.down @ b.up)) / 4
        assert not np.allclose(new.loras[key].down @ new.loras[key].up, product_mean, atol=1e-4)
    # frozen W: fedlora's adapted kernels never change
    for key in server.loras:
        np.testing.assert_array_equal(
            lowrank.get_layer(new.params, key)["kernel"], lowrank.get_layer(server.params, key)["kernel"]
        )


def test_clients_upload_only_factors_of_the_adapted_layers(mlp):
    alg = _algorithm(mlp)
    server, client = alg.init(jax.random.key(0))
    message = _message(alg, server)
    assert list(server.loras) == ["fc2"]  # not the first layer, not the head
    assert "kernel" not in message.free["fc2"] and "kernel" in message.free["fc1"]
    assert message.loras["fc2"].down.shape == (200, 4) and message.loras["fc2"].up.shape == (4, 200)


def test_fedloru_learns_digits(mlp, digits):
    fed = make_federation(digits, num_clients=10, alpha=0.5)
    alg = fedloru(mlp, lr=0.05, local_epochs=2, batch_size=32, lora_rank=8, accumulate_every=5, **UNCLIPPED)
    sim = Simulation(alg, mlp, fed, participation=0.5)
    state, metrics = sim.run_rounds(sim.init(), 15)
    assert sim.evaluate(state)["global_acc"] > 0.8
    full_bytes = sum(x.size * 4 for x in jax.tree.leaves(mlp.init(jax.random.key(0))["params"]))
    assert float(metrics["bytes_up"][0]) < 0.5 * 5 * full_bytes  # fc2 travels as two rank-8 factors


def test_rank_larger_than_a_layer_allows_is_a_clear_error(mlp, capsys, tmp_path):
    with pytest.raises(ConfigError, match=r"lora_rank: 500 is not a valid rank for fc2 .* allowed 1..200"):
        fedloru(mlp, lr=0.1, local_epochs=1, batch_size=32, lora_rank=500)
    assert main(["run", "fedloru", "--quiet", "--out", str(tmp_path / "r"), "--set", "lora_rank=0"]) == 2
    assert "lora_rank: must be >= 1" in capsys.readouterr().err


def test_merged_travels_only_when_it_can_be_non_zero(mlp):
    for reinit, accumulate_every, sent in ((True, 5, False), (False, 5, True), (False, 0, False)):
        alg = fedloru(mlp, lora_rank=4, reinit=reinit, accumulate_every=accumulate_every)
        server, _ = alg.init(jax.random.key(0))
        assert (alg.broadcast(server, round_info(0, 0)).merged is not None) == sent, (reinit, accumulate_every)


@pytest.mark.parametrize(
    "name, accumulate_every, reinit, rank",
    [("fedlora", 0, True, 4), ("fedloru", 2, True, 4), ("fedloru", 2, False, 4), ("fedloru", 1, True, 60)]
    + [("pfedloru", 3, True, 4)],
)
def test_download_when_clients_keep_w_matches_a_hand_count(
    mlp, digits_federation, name, accumulate_every, reinit, rank
):
    """``bytes_down_cached``: each client downloads W (fc2's kernel) at its first participation,
    later only the rank-r factors of each accumulation it missed (``reinit``; none without it), or
    W if smaller; ``bytes_down`` counts the whole broadcast every time."""
    from jaxfed.algorithms import registry

    spec = registry.get(name)
    options = dict(lr=0.05, local_epochs=1, batch_size=32, lora_rank=rank)
    if name != "fedlora":
        options.update(accumulate_every=accumulate_every, reinit=reinit)
    sim = Simulation(spec.build(mlp, spec.options(**options), None), mlp, digits_federation, participation=0.3)
    rounds = 7
    _, metrics = sim.run_rounds(sim.init(), rounds)

    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(mlp.init(jax.random.key(0))["params"]))
    w_bytes = 200 * 200 * 4  # fc2, the one adapted layer
    factor_bytes = (200 * rank + rank * 200) * 4
    sends_merged = accumulate_every > 0 and not reinit
    broadcast = param_bytes + factor_bytes * (2 if sends_merged else 1)
    held = {}  # client -> the round whose W it holds
    for r in range(rounds):
        ids = np.asarray(sampling.sample_clients(sim.root, sampling.round_key(sim.root, r), 10, sim.num_sampled))
        expected = 0
        for k in ids.tolist():
            if k not in held:
                refresh = w_bytes
            elif accumulate_every and reinit:
                missed = r // accumulate_every - held[k] // accumulate_every
                refresh = min(w_bytes, missed * factor_bytes)
            else:
                refresh = 0
            expected += broadcast - w_bytes + refresh
            held[k] = r
        assert float(metrics["bytes_down"][r]) == len(ids) * broadcast
        assert float(metrics["bytes_down_cached"][r]) == expected, r
    assert float(metrics["bytes_down_cached"].sum()) < float(metrics["bytes_down"].sum())


# fedlora and pfedloru build their global pair as fedloru does (the family's one init); mfedloru's tiers differ.
@pytest.mark.parametrize("name", ["fedloru", "mfedloru"])
def test_the_authors_init_starts_a_pure_rank_r_model(mlp, digits_federation, name):
    """``init=authors``: adapted kernels at zero, both factors random, so each adapted layer of the
    global model is ``s * down @ up`` (rank r), checked in float64; ``init=lora`` is the model's
    own init with a zero update."""
    from jaxfed.algorithms import registry

    spec = registry.get(name)
    options = dict(lr=0.05, local_epochs=1, batch_size=32, lora_rank=4, init="authors")
    alg = spec.build(mlp, spec.options(**options), None)
    server, _ = alg.init(jax.random.key(0))
    assert server.loras
    for key, lora in server.loras.items():
        kernel = lowrank.get_layer(server.params, key)["kernel"]
        assert not np.any(np.asarray(kernel)) and np.any(np.asarray(lora.up))
        product = np.float64(lora.down) @ np.float64(lora.up)
        assert np.linalg.matrix_rank(product) == 4
    plain = spec.build(mlp, spec.options(**{**options, "init": "lora"}), None)
    server, _ = plain.init(jax.random.key(0))
    assert all(not np.any(np.asarray(lora.up)) for lora in server.loras.values())
    sim = Simulation(alg, mlp, digits_federation, participation=0.5)
    state, metrics = sim.run_rounds(sim.init(), 2)
    assert np.all(np.isfinite(np.asarray(metrics["train_loss"])))


def _uploads(server, seeds):
    """Uploads of clients that moved the full parameters and the factors at random, stacked."""
    moved = [with_random_lora_updates(server, seed) for seed in seeds]
    moved = [
        m._replace(
            params=jax.tree.map(lambda p, s=s: p + 0.1 * s, m.params),
            loras={k: lowrank.LoRA(f.down + 0.01 * s, f.up) for k, f in m.loras.items()},
        )
        for s, m in zip(seeds, moved)
    ]
    return jax.tree.map(lambda *rows: jnp.stack(rows), *(_message(None, m) for m in moved))


def test_a_server_optimizer_steps_the_full_parameters_and_the_factors_from_their_averages(mlp):
    """FedLoRU with FedYogi on the server: two rounds of given uploads, the full parameters and each
    factor against Algorithm 2 (float64) from the plain server's averages of the same uploads."""
    options = dict(server_lr=0.3, server_b1=0.8, server_b2=0.95, server_eps=0.01)
    plain, yogi = (
        _algorithm(mlp, accumulate_every=5),
        _algorithm(mlp, accumulate_every=5, server_optimizer="yogi", **options),
    )
    start, _ = yogi.init(jax.random.key(0))
    # without the option the state is as it was (its checkpoints, written before the option, restore)
    assert plain.init(jax.random.key(0))[0]._fields == ("params", "loras", "merged", "key_data")
    weights = jnp.asarray([3.0, 1.0])
    averages, state = [], start
    for round_, seeds in enumerate([(1, 2), (3, 4)]):
        uploads = _uploads(state, seeds)
        plain_state = ServerState(*state[:4])  # the same server without the optimizer's state
        averages.append(_message(None, server_step(plain, plain_state, uploads, weights, round_)))
        state = server_step(yogi, state, uploads, weights, round_)
    got, x0 = _message(None, state), _message(None, start)
    for x, *rounds, leaf in zip(*map(jax.tree.leaves, (x0, *averages, got)), strict=True):
        want = fedopt_reference("yogi", x, rounds, 0.3, 0.8, 0.95, 0.01)
        np.testing.assert_allclose(leaf, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reinit", [True, False])
def test_restarted_factors_restart_their_server_optimizer_state(mlp, reinit):
    """At an accumulation with ``reinit`` the new factors' moments start again (m 0, v tau^2);
    continued factors keep theirs, and the full parameters' always carry on."""
    alg = _algorithm(mlp, accumulate_every=2, reinit=reinit, server_optimizer="adam", server_lr=0.1)
    state, _ = alg.init(jax.random.key(0))
    for round_ in (0, 1):  # round 1 completes 2 rounds: it accumulates
        state = server_step(alg, state, _uploads(state, (round_ + 1, round_ + 5)), jnp.ones(2), round_)
    (free_moments, _), (factor_moments, _) = state.opt_state
    assert all(np.abs(m).max() > 0 for m in jax.tree.leaves(free_moments.m))
    if reinit:
        assert all(np.all(m == 0) for m in jax.tree.leaves(factor_moments.m))
        assert all(np.allclose(v, 1e-3**2) for v in jax.tree.leaves(factor_moments.v))
    else:
        assert all(np.abs(m).max() > 0 for m in jax.tree.leaves(factor_moments.m))
