"""Server aggregation as a reduction: the engine sums each upload's contribution as the clients
run (chunk by chunk, across devices) instead of stacking every upload of the round.

Against the reference of stacking every upload and reducing them at once (the same algorithm
with its aggregation turned into a ``server_update``), through chunks with a remainder, tiers
and padding; the memory of a compiled round grows with the chunk, not the clients; and the
contract's rule that an algorithm gives exactly one of the two forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MODEL_NEEDS, UNCLIPPED, make_federation

from jaxfed.algorithms import Aggregation, registry
from jaxfed.algorithms.fedavg import fedavg
from jaxfed.contract import RoundInfo
from jaxfed.core import mean_of, weighted_mean, weighted_share
from jaxfed.data import federate, partition
from jaxfed.nn import get_model
from jaxfed.runs.config import Config
from jaxfed.simulation import ClientStrategy, Simulation, server_step


def stacked_reference(alg):
    """``alg`` with its aggregation replaced by a ``server_update`` that receives every decoded
    upload of the round stacked and reduces them at once (the engine's path before reductions)."""

    def server_update(server_state, messages, weights, info):
        row_info = RoundInfo(round=info.round, tier=0)
        shares = jax.vmap(lambda m, w: alg.aggregation.contribute(server_state, m, w, row_info))(messages, weights)
        kept = jax.tree.map(lambda s: jnp.where((weights > 0).reshape((-1,) + (1,) * (s.ndim - 1)), s, 0), shares)
        return alg.aggregation.apply(server_state, jax.tree.map(lambda s: jnp.sum(s, axis=0), kept), info)

    return alg._replace(aggregation=None, server_update=server_update)


# per-pack weights, and tiers decoded by receive with a sample-weighted mean (a uniform mean: the
# weight-0 test; the mixtures' per-component weights: the FLoRAL and ensemble server tests, through
# server_step). The reference is the engine's path for a server_update (every upload of the round
# stacked, with its weight): a dropped upload fails both cases, misplaced weights mFedLoRU's.
CASES = {
    "fedcspack": {"pack_size": 64},
    "mfedloru": {"lora_rank": 4, "tiers": "1.0,0.5", "accumulate_every": 1, **UNCLIPPED},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_summed_contributions_equal_reducing_every_upload_at_once(name, mlp, digits):
    fed = make_federation(digits, num_clients=9, alpha=0.5)
    wanted = {"local_epochs": 1, "batch_size": 32, "lr": 0.05, **CASES[name]}
    config = Config(algorithm=name).with_overrides([f"{k}={v}" for k, v in wanted.items()])
    alg = registry.get(name).build(mlp, config.options, config)
    assert alg.aggregation is not None and alg.server_update is None

    def run(algorithm):  # 7 of 9 sampled: a chunk of 3 twice and a remainder of 1 (tiers: padded)
        sim = Simulation(algorithm, mlp, fed, participation=0.7, client_chunk=3)
        return sim.run_rounds(sim.init(), 2)

    (summed, summed_metrics), (stacked, stacked_metrics) = run(alg), run(stacked_reference(alg))
    for got, want in zip(jax.tree.leaves(summed), jax.tree.leaves(stacked)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    for key in ("train_loss", "bytes_up", "bytes_down"):
        np.testing.assert_allclose(summed_metrics[key], stacked_metrics[key], rtol=1e-5)


# Their servers compare every pair of the round's uploads (FedAMP's attention, FedCAC's overlaps),
# or train on every upload (FedTGP's global prototypes, FedGH's head: one training example per client
# and class).
NEEDS_EVERY_UPLOAD = {"fedamp", "fedcac", "fedtgp", "fedgh"}


def test_every_builtin_gives_an_aggregation_but_those_that_compare_uploads(mlp, digits):
    for name in registry.BUILTINS:  # not what other tests registered (builders that return None)
        config = Config(algorithm=name).with_overrides(MODEL_NEEDS.get(name, []))
        model = (
            get_model(config.model, digits.input_shape, digits.num_classes, norm=config.norm) if config.model else mlp
        )
        alg = registry.get(name).build(model, config.options, config)
        if name in NEEDS_EVERY_UPLOAD:
            assert alg.aggregation is None and alg.server_update is not None, name
        else:
            assert alg.aggregation is not None and alg.server_update is None, name


@pytest.mark.parametrize("given", ["both", "neither"])
def test_an_algorithm_gives_exactly_one_server_step(given, mlp, digits_federation):
    alg = fedavg(mlp)
    if given == "both":
        alg = alg._replace(server_update=lambda s, m, w, info: s)
    else:
        alg = alg._replace(aggregation=None)
    got = "aggregation and server_update" if given == "both" else "neither"
    with pytest.raises(ValueError, match=f"fedavg: give exactly one of aggregation .*; got {got}$"):
        Simulation(alg, mlp, digits_federation)


def test_a_round_s_memory_grows_with_the_chunk_not_the_clients(mlp, digits):
    """XLA's memory analysis of the compiled round: 100 clients against 2000 in chunks of 10.
    Summed contributions keep the temporary memory within 1.2x; stacking every upload (the
    reference) grows with the clients."""

    def temp_bytes(num_clients, algorithm):
        train, test = partition(
            "resample",
            digits.y_train,
            digits.y_test,
            num_clients,
            np.random.default_rng(0),
            client_train_size=8,
            client_test_size=2,
        )
        sim = Simulation(algorithm, mlp, federate(digits, train, test), participation=1.0, client_chunk=10)
        compiled = jax.jit(sim.rounds_pure, static_argnums=2).lower(sim.init(), sim.data, 1).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    alg = fedavg(mlp, lr=0.1, local_epochs=1, batch_size=8)
    few, many = temp_bytes(100, alg), temp_bytes(2000, alg)
    assert many <= 1.2 * few, (few, many)
    message = sum(x.size * 4 for x in jax.tree.leaves(mlp.init(jax.random.key(0))["params"]))
    assert temp_bytes(2000, stacked_reference(alg)) > 2000 * message > 10 * many  # the test can fail


def test_weighted_share_and_mean_of_are_the_weighted_mean_in_float64():
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(5, 4, 3))
    weights = np.array([3.0, 0.0, 7.0, 1.0, 2.5])
    shares = [weighted_share({"w": jnp.asarray(r, jnp.float32)}, w) for r, w in zip(rows, weights)]
    total = jax.tree.map(lambda *s: sum(s), *shares)
    expected = np.tensordot(weights / weights.sum(), rows, axes=1)
    np.testing.assert_allclose(mean_of(total)["w"], expected, rtol=1e-5, atol=1e-6)
    assert isinstance(Aggregation(lambda *a: (), lambda s, t, i: s), tuple)


def test_weighted_mean_of_integer_and_bool_rows_is_their_float_mean():
    """A mean of counts is not a count: integer and bool leaves average in float32 (the weights
    were cast to the leaf's integer dtype, every one of them to 0); float leaves keep their dtype."""
    rows = {"count": jnp.array([3, 10, 4], jnp.int32), "flag": jnp.array([True, False, True])}
    rows["half"] = jnp.array([1.0, 2.0, 4.0], jnp.bfloat16)
    weights = np.array([2.0, 1.0, 1.0])
    got = weighted_mean(rows, weights)
    assert got["count"].dtype == jnp.float32 and got["half"].dtype == jnp.bfloat16
    np.testing.assert_allclose(got["count"], (2 * 3 + 10 + 4) / 4, rtol=1e-6)
    np.testing.assert_allclose(got["flag"], 3 / 4, rtol=1e-6)


def _share_of_each_dtype(shared, x):
    """An item's row and share in dtypes ``jnp.sum`` widens (bool counts as 0/1, int8 and uint8
    sum into a wider integer) and ones it keeps (int32, float32)."""
    share = {
        "flag": x % 2 == 1,
        "int8": (x * 10).astype(jnp.int8),
        "uint8": (x * 30).astype(jnp.uint8),
        "int32": x,
        "float32": x.astype(jnp.float32) / 3,
    }
    return x, share


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 8])
def test_the_summed_shares_do_not_depend_on_the_chunk_in_any_dtype(chunk):
    """Any chunk, dividing the items or not, sums every share as vmapping them all at once does
    (``chunk=0``: ``jnp.sum``), small integer and bool shares too: the running total was kept in
    the share's dtype (a bool total an OR, an int8 one wrapping; a scan of chunks failed on it)."""
    items = jnp.arange(7, dtype=jnp.int32)

    def run(c):
        return jax.jit(lambda xs: ClientStrategy(c).map_clients(_share_of_each_dtype, (), xs))(items)

    want_rows, want = run(0)
    rows, got = run(chunk)
    np.testing.assert_array_equal(rows, want_rows)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)
    assert (int(want["flag"]), int(want["int8"]), int(want["uint8"])) == (3, 210, 630)  # sums, not an OR or wrapped


@pytest.mark.parametrize("uniform", [False, True])
def test_a_row_of_weight_0_contributes_nothing_even_nan(uniform, mlp):
    """Padding and skipped rows weigh 0: the engine drops their share (a uniform mean would count
    them once each, and 0 * NaN is NaN)."""
    alg = fedavg(mlp)
    if uniform:
        alg = alg._replace(aggregation=Aggregation(lambda s, m, w, i: weighted_share(m, 1.0), alg.aggregation.apply))
    server, _ = alg.init(jax.random.key(0))
    rng = np.random.default_rng(4)
    rows = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=(3,) + a.shape), jnp.float32), server.params)
    rows = jax.tree.map(lambda r: r.at[1].set(jnp.nan), rows)
    weights = np.array([3.0, 0.0, 5.0])
    new = server_step(alg, server, rows, weights)
    kept = np.array([1.0, 0.0, 1.0]) if uniform else weights
    for got, r in zip(jax.tree.leaves(new.params), jax.tree.leaves(rows)):
        r = np.asarray(r, np.float64)
        np.testing.assert_allclose(got, (kept[0] * r[0] + kept[2] * r[2]) / kept.sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["aggregation", "server_update"])
def test_server_step_keeps_the_server_state_where_every_weight_is_0_as_the_engine_does(form, mlp):
    """The engine's rule 3 is server_step's too: a server with momentum (FedAvgM-like) whose
    apply moves its state even on an empty sum keeps it where no row carried weight."""
    alg = fedavg(mlp)
    moved = lambda server: jax.tree.map(lambda a: a + 1.0, server)  # noqa: E731
    if form == "aggregation":
        alg = alg._replace(aggregation=Aggregation(alg.aggregation.contribute, lambda s, t, i: moved(s)))
    else:
        alg = alg._replace(aggregation=None, server_update=lambda s, m, w, i: moved(s))
    server, _ = alg.init(jax.random.key(0))
    rows = jax.tree.map(lambda a: jnp.stack([a, a]), server.params)
    for weights, expected in ((np.zeros(2), server), (np.array([0.0, 2.0]), moved(server))):
        new = server_step(alg, server, rows, weights)
        for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(got, want)


def test_the_default_chunk_fits_the_memory_budget(mlp, digits):
    """``chunk=None`` with a memory budget: all clients at once when the round fits, else the
    widest chunk that fits (chosen from XLA's memory analysis); numbers as vmapping them all."""
    train, test = partition(
        "resample",
        digits.y_train,
        digits.y_test,
        64,
        np.random.default_rng(0),
        client_train_size=8,
        client_test_size=2,
    )
    fed = federate(digits, train, test)
    alg = fedavg(mlp, lr=0.1, local_epochs=1, batch_size=8)
    everyone = Simulation(alg, mlp, fed, participation=1.0, client_chunk=0)
    state = everyone.init()
    memory = everyone.compiled(state, 1).memory_analysis()
    fixed = memory.argument_size_in_bytes + memory.output_size_in_bytes
    roomy = ClientStrategy(memory_bytes=int((fixed + memory.temp_size_in_bytes) / 0.9) + 1)
    assert roomy.chunk == 0 and roomy.fitted(memory, 64) is None  # it fits: all at once
    tight = ClientStrategy(memory_bytes=int((fixed + memory.temp_size_in_bytes / 4) / 0.9))
    fitted = Simulation(alg, mlp, fed, participation=1.0, strategy=tight)
    got, _ = fitted.run_rounds(fitted.init(), 1)
    assert 1 < fitted.client_chunk < 64, fitted.client_chunk
    narrowed = fitted.compiled(got, 1).memory_analysis()
    assert narrowed.temp_size_in_bytes <= 0.9 * tight.memory_bytes - fixed
    want, _ = everyone.run_rounds(state, 1)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    assert ClientStrategy().chunk == 1 and not ClientStrategy().fits_memory  # CPU: no budget, one at a time


def test_a_round_whose_compilation_runs_out_of_memory_is_compiled_narrower(mlp, digits, monkeypatch):
    """An accelerator's compiler can run out of memory before a memory analysis exists (XLA's GPU
    autotuner at 1 000 000 W2 clients): the default strategy narrows by the failed allocation
    against its budget and compiles again. A given chunk, or another error, is raised as it is.
    (The narrower round's numbers as vmapping them all: test_the_default_chunk_fits_the_memory_budget,
    whose chunk comes out of the same compile-again loop of the engine.)"""
    train, test = partition(
        "resample", digits.y_train, digits.y_test, 40, np.random.default_rng(0), client_train_size=8, client_test_size=2
    )
    fed = federate(digits, train, test)
    alg = fedavg(mlp, lr=0.1, local_epochs=1, batch_size=8)
    budget = 2**30
    asked = budget  # ROUND_BUFFERS such buffers do not fit: 40 clients / (4 / 0.9) -> 9
    real_compile = jax.stages.Lowered.compile
    widths = []

    def compile_on_a_small_device(lowered, *args, **kwargs):
        widths.append(strategy.chunk)
        if strategy.chunk == 0:
            raise jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate {asked}B")
        return real_compile(lowered, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_on_a_small_device)
    strategy = ClientStrategy(memory_bytes=budget)
    sim = Simulation(alg, mlp, fed, participation=1.0, strategy=strategy)
    sim.run_rounds(sim.init(), 1)
    assert widths == [0, 9] and sim.client_chunk == 9
    fresh = ClientStrategy(memory_bytes=budget)
    for message in (f"allocate {budget} bytes.", f"Failed to allocate request for {budget / 2**20}MiB"):
        assert fresh.narrowed(40, ValueError(f"RESOURCE_EXHAUSTED: {message}")) == 9, message  # XLA's other wordings
    assert fresh.narrowed(40, ValueError("RESOURCE_EXHAUSTED")) == 4  # no size named: 10x
    assert fresh.narrowed(40, RuntimeError("INTERNAL: a compiler bug")) is None

    strategy = ClientStrategy(0)  # a chunk the user gave is not changed
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        Simulation(alg, mlp, fed, participation=1.0, strategy=strategy).run_rounds(sim.init(), 1)


def _modeled_round(sizes, chunk):
    """The strategy's cost model written out: the clients in size order, split into groups of
    ``chunk`` (all: one group), each group ``max size x (1 + width / STEP_WIDTH)``."""
    from jaxfed.simulation.strategy import STEP_WIDTH

    ordered = sorted(sizes, reverse=True)
    width = chunk or len(ordered)
    groups = [ordered[i : i + width] for i in range(0, len(ordered), width)]
    return sum(max(g) * (1 + len(g) / STEP_WIDTH) for g in groups)


@pytest.mark.parametrize("devices", [1, 2, 3, 4])
def test_device_shares_are_the_clients_the_engines_run_order_gives_each_device(devices):
    """The one rule the chunk model and the bench use for which clients each device runs, against
    ClientStrategy.run_order on the same sizes padded with size-0 dummies (device d: the d-th
    contiguous block of the order, as the clients axis is sharded)."""
    from types import SimpleNamespace

    from jaxfed.simulation.strategy import ClientStrategy, device_shares

    sizes = np.random.default_rng(devices).integers(1, 50, size=11)
    padded = np.concatenate([sizes, np.zeros(-len(sizes) % devices, sizes.dtype)])
    order = np.asarray(ClientStrategy.run_order(SimpleNamespace(num_devices=devices), jnp.asarray(padded)))
    blocks = np.split(padded[order], devices)
    shares = device_shares(sizes, devices)
    assert len(shares) == devices
    for share, block in zip(shares, blocks):
        np.testing.assert_array_equal(share, block)
    assert 0 not in shares[0]  # the busiest device never gets a dummy


def test_the_accelerator_default_chunk_is_the_modeled_fastest_for_the_client_sizes(mlp, digits):
    """On a device with a memory budget the default chunk is the candidate (powers of two, or all
    at once) whose modeled round over the sampled clients' sizes is least: against the model
    written out per group; equal sizes run all at once; a chunk given is kept (CPU's default,
    with no budget, is the test above's)."""
    from jaxfed.simulation.strategy import fastest_chunk

    rng = np.random.default_rng(3)
    for n in (3, 40, 100):
        rounds = [rng.integers(1, 200, size=n) for _ in range(3)]
        candidates = [c for c in (1, 2, 4, 8, 16, 32, 64) if c < n] + [0]
        want = min(candidates, key=lambda c: sum(_modeled_round(s, c) for s in rounds))
        assert fastest_chunk(rounds) == want, n
    skewed = [np.array([200] + [10] * 99)]  # one large client: all at once runs 99 of them idle
    assert fastest_chunk(skewed) not in (0, 1) and fastest_chunk([np.full(100, 50)]) == 0
    assert fastest_chunk([np.arange(1, 9)], num_devices=2) == fastest_chunk([np.arange(2, 9, 2)])

    train, test = partition("dirichlet", digits.y_train, digits.y_test, 40, np.random.default_rng(0), alpha=0.3)
    fed = federate(digits, train, test)
    alg = fedavg(mlp, lr=0.1, local_epochs=1, batch_size=8)
    sized = Simulation(alg, mlp, fed, participation=1.0, strategy=ClientStrategy(memory_bytes=2**40))
    got, _ = sized.run_rounds(sized.init(), 1)
    counts = np.asarray(fed.train_count)
    assert sized.client_chunk == fastest_chunk([counts[sized.sampled_ids(0)]]) not in (0,)
    want, _ = Simulation(alg, mlp, fed, participation=1.0, client_chunk=0).run_rounds(sized.init(), 1)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    given = Simulation(alg, mlp, fed, participation=1.0, strategy=ClientStrategy(0, memory_bytes=2**40))
    given.run_rounds(given.init(), 1)
    assert given.client_chunk == 0
