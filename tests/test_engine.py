"""The engine against independent references: per-client Python loops, padding-free runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import client_accuracy, make_federation, one_client, round_info

from jaxfed.algorithms.fedavg import fedavg
from jaxfed.algorithms.local import local
from jaxfed.algorithms.records import ClientStats
from jaxfed.data import ClientData
from jaxfed.simulation import ClientStrategy, Simulation, sampling


def _client_view(fed, k, pad_to=None):
    """Client k's training data alone: its own indices, padded only to ``pad_to``."""
    count = int(fed.train_count[k])
    indices = np.asarray(fed.train_idx[k, :count])
    if pad_to is not None:
        indices = np.pad(indices, (0, pad_to - count))
    return ClientData(x=fed.x_train, y=fed.y_train, indices=jnp.asarray(indices), count=jnp.int32(count))


def _stack(views):
    return ClientData(
        x=views[0].x,
        y=views[0].y,
        indices=jnp.stack([v.indices for v in views]),
        count=jnp.stack([v.count for v in views]),
    )


def test_vmapped_client_update_equals_python_loop(mlp, digits_federation):
    """Each row of the vmapped update is the client's update run alone. The reference gets the
    client's padded row (one shape for every client: ``client_update`` compiles once, where each
    client's own length compiled it per client); test_padding_is_exact checks that the padding
    changes no bit of a client's result."""
    fed = digits_federation
    alg = fedavg(mlp, lr=0.1, momentum=0.9, local_epochs=2, batch_size=16)
    server, client = alg.init(jax.random.key(0))
    message = alg.broadcast(server, round_info(0, 0))
    ids = [0, 3, 4, 7]
    rngs = [jax.random.key(100 + k) for k in ids]
    stacked = fed.train_data(jnp.array(ids))

    vmapped = jax.jit(jax.vmap(alg.client_update, in_axes=(None, None, ClientData.vmap_axes(), 0, None)))
    _, params_v, metrics_v = vmapped(message, client, stacked, jnp.stack(rngs), round_info())

    one = jax.jit(alg.client_update)
    for row, (k, rng) in enumerate(zip(ids, rngs)):
        _, params_k, metrics_k = one(message, client, one_client(fed, k), rng, round_info())
        for a, b in zip(jax.tree.leaves(params_k), jax.tree.leaves(params_v)):
            np.testing.assert_allclose(b[row], a, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(metrics_v["train_loss"][row], metrics_k["train_loss"], rtol=1e-5)
    # and the clients really trained (a no-op update would pass the comparison above)
    moved = jax.tree.leaves(jax.tree.map(lambda p, g: jnp.abs(p[0] - g).max(), params_v, message))
    assert max(float(m) for m in moved) > 1e-3


def test_padding_is_exact(mlp, digits_federation):
    """Client 0's result is bit-identical whether it shares the batch with a small or a big client."""
    fed = digits_federation
    counts = np.asarray(fed.train_count)
    small, big = int(np.argmin(counts[1:])) + 1, int(np.argmax(counts[1:])) + 1
    assert counts[big] > counts[0] and counts[big] > counts[small]
    alg = fedavg(mlp, lr=0.1, momentum=0.9, local_epochs=2, batch_size=8)  # momentum: a padded step would move
    server, client = alg.init(jax.random.key(0))
    message = alg.broadcast(server, round_info(0, 0))
    update = jax.jit(jax.vmap(alg.client_update, in_axes=(None, None, ClientData.vmap_axes(), 0, None)))
    rngs = jnp.stack([jax.random.key(1), jax.random.key(2)])

    def client0_with(other):
        width = max(counts[0], counts[other])
        views = _stack([_client_view(fed, 0, width), _client_view(fed, other, width)])
        _, params, metrics = update(message, client, views, rngs, round_info())
        return jax.tree.map(lambda p: p[0], params), metrics["steps"][0]

    alone_params, alone_steps = client0_with(small)
    shared_params, shared_steps = client0_with(big)
    assert float(alone_steps) == float(shared_steps) == 2 * np.ceil(counts[0] / 8)
    for a, b in zip(jax.tree.leaves(alone_params), jax.tree.leaves(shared_params)):
        np.testing.assert_array_equal(a, b)


def test_round_aggregates_sampled_clients_by_sample_count(mlp, digits_federation):
    """One engine round equals: sample, run each client alone, weighted mean by n_k (each client
    on its padded row, one compiled ``client_update``: see test_vmapped_client_update_equals_python_loop)."""
    fed = digits_federation
    alg = fedavg(mlp, lr=0.1, local_epochs=1, batch_size=16)
    sim = Simulation(alg, mlp, fed, participation=0.4, seed=3)
    state = sim.init()
    new_state, _ = jax.jit(sim.round)(state, fed)

    key = sampling.round_key(sim.root, 0)
    ids = np.asarray(sampling.sample_clients(sim.root, key, fed.num_clients, 4))
    rngs = sampling.client_keys(key, jnp.asarray(ids))
    message = alg.broadcast(state.server, round_info(0, 0))
    one = jax.jit(alg.client_update)
    uploads = [one(message, ClientStats({}), one_client(fed, k), rngs[i], round_info())[1] for i, k in enumerate(ids)]
    counts = np.asarray(fed.train_count)[ids].astype(np.float64)
    for leaf_new, *leaves in zip(jax.tree.leaves(new_state.server.params), *map(jax.tree.leaves, uploads)):
        expected = sum(c * np.asarray(leaf, np.float64) for c, leaf in zip(counts, leaves)) / counts.sum()
        np.testing.assert_allclose(leaf_new, expected, rtol=1e-4, atol=1e-5)


def test_an_integer_client_metric_is_reported_as_its_sample_weighted_mean(mlp, digits_federation):
    """docs/contract.md: the engine reports the sample-weighted mean of each client metric. An
    int32 metric (here the client's example count) averages as its float copy does: it was
    reported as 0.0 (the weights were cast to int32)."""
    base = fedavg(mlp, lr=0.1, local_epochs=1, batch_size=16)

    def client_update(message, client_state, data, rng, info):
        state, upload, metrics = base.client_update(message, client_state, data, rng, info)
        return state, upload, {**metrics, "examples": data.count, "examples_float": data.count.astype(jnp.float32)}

    sim = Simulation(base._replace(client_update=client_update), mlp, digits_federation, participation=0.3, seed=0)
    _, metrics = sim.run_rounds(sim.init(), 1)
    counts = np.asarray(digits_federation.train_count)[sim.sampled_ids(0)].astype(np.float64)
    want = float(np.sum(counts * counts) / np.sum(counts))
    assert float(metrics["examples_float"][0]) == pytest.approx(want, rel=1e-6)
    assert float(metrics["examples"][0]) == pytest.approx(want, rel=1e-6)


def test_sampling_without_replacement_and_fixed_cohort():
    root = jax.random.key(0)
    seen = set()
    for t in range(5):
        ids = np.asarray(sampling.sample_clients(root, sampling.round_key(root, t), 50, 10))
        assert len(set(ids.tolist())) == 10 and ids.min() >= 0 and ids.max() < 50
        seen.add(tuple(ids))
    assert len(seen) > 1  # uniform sampling changes clients between rounds
    fixed = {
        tuple(np.asarray(sampling.sample_clients(root, sampling.round_key(root, t), 50, 10, "fixed"))) for t in range(5)
    }
    assert len(fixed) == 1
    first = {
        tuple(np.asarray(sampling.sample_clients(root, sampling.round_key(root, t), 50, 10, "first"))) for t in range(5)
    }
    assert first == {tuple(range(10))}  # PFLlib's "fix": the first clients, whatever the seed
    assert sampling.num_sampled(100, 0.1) == 10 and sampling.num_sampled(3, 0.01) == 1


def test_unsampled_clients_keep_their_state(mlp, digits_federation):
    alg = local(mlp, lr=0.1, local_epochs=1, batch_size=16)
    sim = Simulation(alg, mlp, digits_federation, participation=0.3, seed=1)
    state = sim.init()
    new_state, _ = sim.run_rounds(state, 1)
    key = sampling.round_key(sim.root, 0)
    ids = set(np.asarray(sampling.sample_clients(sim.root, key, 10, 3)).tolist())
    before = jax.tree.leaves(state.clients)[0]
    after = jax.tree.leaves(new_state.clients)[0]
    for k in range(10):
        changed = not np.array_equal(before[k], after[k])
        assert changed == (k in ids)


def test_same_seed_same_numbers(mlp, digits_federation):
    def once(seed):
        alg = fedavg(mlp, lr=0.1, local_epochs=1, batch_size=16)
        sim = Simulation(alg, mlp, digits_federation, participation=0.5, seed=seed)
        state, metrics = sim.run_rounds(sim.init(), 3)
        return jax.tree.leaves(state.server.params), metrics["train_loss"]

    (p1, l1), (p2, l2), (p3, _) = once(7), once(7), once(8)
    for a, b in zip(p1, p2):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(l1, l2)
    assert any(not np.array_equal(a, c) for a, c in zip(p1, p3))


def test_bytes_counted_from_messages(mlp, digits_federation):
    alg = fedavg(mlp, lr=0.1, local_epochs=1, batch_size=16)
    sim = Simulation(alg, mlp, digits_federation, participation=0.5)
    _, metrics = sim.run_rounds(sim.init(), 2)
    model_bytes = sum(x.size * 4 for x in jax.tree.leaves(mlp.init(jax.random.key(0))["params"]))
    np.testing.assert_array_equal(metrics["bytes_up"], [5 * model_bytes] * 2)
    np.testing.assert_array_equal(metrics["bytes_down"], [5 * model_bytes] * 2)
    sim_local = Simulation(local(mlp, lr=0.1, local_epochs=1, batch_size=16), mlp, digits_federation)
    _, metrics = sim_local.run_rounds(sim_local.init(), 1)
    assert float(metrics["bytes_up"][0]) == 0 and float(metrics["bytes_down"][0]) == 0


def test_client_strategies_agree(mlp, digits_federation):
    """vmap over all sampled clients, one at a time, and chunks of 3 give the same round. The
    client strategy is one swappable object: a subclass given as ``strategy`` runs the round's
    client updates, with the numbers of the same chunk given as ``client_chunk`` bit for bit (its
    program is the chunk-3 one: no compile of its own)."""

    class Recording(ClientStrategy):
        mapped = 0

        def map_clients(self, f, shared, per_client):
            Recording.mapped += 1
            return super().map_clients(f, shared, per_client)

    def run(**strategy):
        alg = fedavg(mlp, lr=0.1, momentum=0.9, local_epochs=2, batch_size=16)
        sim = Simulation(alg, mlp, digits_federation, participation=0.7, **strategy)
        state, metrics = sim.run_rounds(sim.init(), 2)
        return sim, state, jax.tree.leaves(state.server.params) + [metrics["train_loss"]]

    _, _, everyone = run(client_chunk=0)
    for chunk in (1, 3):
        by_chunk, expected, got = run(client_chunk=chunk)
        for a, b in zip(everyone, got):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    swapped, ran, _ = run(strategy=Recording(chunk=3))
    assert (swapped.client_chunk, swapped.num_devices) == (3, by_chunk.num_devices)
    assert Recording.mapped == 1  # traced once: the round's client updates ran through it
    for got, want in zip(jax.tree.leaves(ran), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(got, want)


def test_pooled_evaluation_of_a_global_model_equals_the_per_client_one(mlp, digits_federation):
    """``evaluates_global``: one pass over the pooled test set, summed per client, gives what
    evaluating each client's (identical) model on its own split gives."""
    alg = fedavg(mlp, lr=0.1, local_epochs=1, batch_size=16)
    assert alg.evaluates_global
    pooled = Simulation(alg, mlp, digits_federation, participation=0.5, seed=2)
    per_client = Simulation(alg._replace(evaluates_global=False), mlp, digits_federation, participation=0.5, seed=2)
    state, _ = pooled.run_rounds(pooled.init(), 2)
    got, expected = pooled.evaluate(state), per_client.evaluate(state)
    assert got.keys() == expected.keys() and got["clients"].keys() == expected["clients"].keys()
    for key in expected.keys() - {"clients"}:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    for key, values in expected["clients"].items():
        np.testing.assert_allclose(got["clients"][key], values, rtol=1e-5, atol=1e-6, err_msg=key)
    assert 0.3 < got["personalized_acc_mean"] < 1.0 and got["personalized_acc_std"] > 0


def test_the_pooled_pass_may_run_another_conv_implementation(digits, digits_federation):
    """``pooled_eval_model``: the global model's pass over the whole test set with XLA's conv
    gives what the training model (patches conv), evaluated client by client, gives."""
    from jaxfed.nn import get_model

    patches, xla = (
        get_model("cnn4", digits.input_shape, digits.num_classes, "group", impl) for impl in ("patches", "xla")
    )
    alg = fedavg(patches, lr=0.3, local_epochs=2, batch_size=16)
    pooled = Simulation(alg, patches, digits_federation, participation=0.5, pooled_eval_model=xla)
    per_client = Simulation(alg._replace(evaluates_global=False), patches, digits_federation, participation=0.5)
    state, _ = pooled.run_rounds(pooled.init(), 3)
    got, expected = pooled.evaluate(state), per_client.evaluate(state)
    for key in expected.keys() - {"clients"}:
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-5), key
    assert got["personalized_acc_mean"] > 0.1  # above chance (10 classes): not a constant prediction


@pytest.mark.parametrize("make, mode", [(fedavg, "fixed"), (local, "fixed"), (fedavg, "first")])
def test_cohort_evaluation_is_the_mean_over_the_fixed_cohort(mlp, digits_federation, make, mode):
    """``eval_clients="cohort"`` (FedCSPACK's authors): personalized accuracy over the clients
    that train, checked against a per-client loop over the cohort."""
    alg = make(mlp, lr=0.05, local_epochs=1, batch_size=32)
    fed = digits_federation
    sim = Simulation(alg, mlp, fed, participation=0.3, sampling=mode, eval_clients="cohort", seed=1)
    state, _ = sim.run_rounds(sim.init(), 2)
    cohort = np.asarray(sim.sampled_ids(0))
    assert list(cohort) == list(np.asarray(sim.sampled_ids(1)))  # the same clients every round
    assert (list(cohort) == list(range(len(cohort)))) == (mode == "first")
    accuracies = []
    for k in cohort:
        variables = alg.eval_params(state.server, jax.tree.map(lambda a, k=k: a[k], state.clients))
        accuracies.append(client_accuracy(mlp, variables, fed, k))
    evaluation = sim.evaluate(state)
    got = evaluation["personalized_acc_mean"]
    np.testing.assert_allclose(got, np.mean(accuracies), rtol=1e-5)
    per_client = evaluation["clients"]  # in client-id order: the cohort's values, NaN for the others
    np.testing.assert_allclose(per_client["acc"][cohort], accuracies, rtol=1e-5)
    assert np.isnan(np.delete(per_client["acc"], cohort)).all()
    assert (np.delete(per_client["examples"], cohort) == 0).all()
    np.testing.assert_array_equal(per_client["examples"][cohort], np.asarray(fed.test_count)[cohort])
    everyone = Simulation(alg, mlp, fed, participation=0.3, sampling=mode, seed=1).evaluate(state)
    assert everyone["personalized_acc_mean"] != got  # the untrained clients count there


def test_cohort_evaluation_needs_the_fixed_cohort(mlp, digits_federation):
    with pytest.raises(ValueError, match="eval_clients"):
        Simulation(fedavg(mlp), mlp, digits_federation, participation=0.3, eval_clients="cohort")
    unknown = r"^sampling: unknown 'fix' \(did you mean 'fixed'\?\); allowed: uniform, fixed, first$"
    with pytest.raises(ValueError, match=unknown):
        Simulation(fedavg(mlp), mlp, digits_federation, participation=0.3, sampling="fix")
    with pytest.warns(DeprecationWarning, match="sampling_mode"):  # the keyword's old name still works
        assert Simulation(fedavg(mlp), mlp, digits_federation, sampling_mode="fixed").sampling == "fixed"


def test_a_variant_runs_its_own_algorithm_and_key(mlp, digits_federation):
    template = Simulation(fedavg(mlp, lr=0.05), mlp, digits_federation, participation=0.5, seed=0)
    alone = Simulation(local(mlp, lr=0.1), mlp, digits_federation, participation=0.5, seed=3)
    member = template.variant(jax.random.key(3), alone.algorithm)
    template.run_rounds(template.init(), 1)  # the template compiled first: its programs must not be reused
    ran, _ = member.run_rounds(member.init(), 2)
    expected, _ = alone.run_rounds(alone.init(), 2)
    for got, want in zip(jax.tree.leaves(ran), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(*(jax.tree.leaves(e) for e in (member.evaluate(ran), alone.evaluate(expected))), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("chunk", [0, 1, 3])
def test_vmapped_members_run_their_clients_one_at_a_time_with_each_members_numbers(chunk):
    """Under a vmap over members (a sweep), one client at a time, ``map_clients`` runs the
    members' clients as one client axis: rows and per-member totals equal each member's own call,
    each client seeing its member's shared values and closed-over numbers, and the scan runs
    members x clients items (nested, it would run one per rank with the members batched). In
    vmapped chunks (0, 3) the members' chunks run side by side, with the same numbers."""
    members, n = 3, 5
    rng = np.random.default_rng(0)
    steps = jnp.asarray(rng.integers(1, 6, (members, n)), jnp.int32)  # each client's own loop length
    # small integers and scales of powers of two: every sum is exact in any order
    values = jnp.asarray(rng.integers(-9, 10, (members, n, 4)), jnp.float32)
    scales = jnp.asarray([0.5, 2.0, -1.0], jnp.float32)  # batched, closed over by f
    offsets = jnp.asarray(rng.integers(-9, 10, (members, 4)), jnp.float32)  # batched shared leaf
    base = jnp.asarray(rng.integers(-9, 10, 4), jnp.float32)  # unbatched shared leaf

    def member(strategy, scale, offset, step_counts, client_values):
        def f(shared, client):
            offset, base = shared
            count, value = client

            def body(carry):
                i, acc = carry
                return i + 1, acc * scale + value + offset

            _, acc = jax.lax.while_loop(lambda c: c[0] < count, body, (0, base))
            return {"acc": acc, "count": count}, {"sum": acc * count, "n": count.astype(jnp.float32)}

        return strategy.map_clients(f, (offset, base), (step_counts, client_values))

    flat = ClientStrategy(chunk=chunk)
    flat.members_as_clients = True
    swept = jax.jit(jax.vmap(lambda *a: member(flat, *a)))(scales, offsets, steps, values)
    for m in range(members):
        alone = jax.jit(lambda *a: member(ClientStrategy(chunk=chunk), *a))(scales[m], offsets[m], steps[m], values[m])
        for got, want in zip(jax.tree.leaves(swept), jax.tree.leaves(alone)):
            np.testing.assert_array_equal(got[m], want, err_msg=f"member {m}")
    if chunk == 1:
        text = str(jax.make_jaxpr(jax.vmap(lambda *a: member(flat, *a)))(scales, offsets, steps, values))
        assert f"length={members * n}" in text


def test_new_clients_never_train_and_are_evaluated_after_their_own_local_update(mlp, digits_federation):
    """Held-out clients are never sampled and keep their initial states; evaluation reports them
    with the global model and after one local update from that state (nothing uploaded), each
    checked against a per-client loop; the trained clients' summaries leave them out."""
    from jaxfed.algorithms.ditto import ditto

    fed, new = digits_federation, [2, 7]
    alg = ditto(mlp, lr=0.05, batch_size=32)
    sim = Simulation(alg, mlp, fed, participation=0.5, seed=1, new_clients=new)
    start = sim.init()
    state, _ = sim.run_rounds(start, 3)
    assert not {int(i) for r in range(3) for i in sim.sampled_ids(r)} & set(new)
    assert len(sim.sampled_ids(0)) == 4  # half of the 8 clients that train
    for before, after in zip(jax.tree.leaves(start.clients), jax.tree.leaves(state.clients)):
        np.testing.assert_array_equal(before[np.asarray(new)], after[np.asarray(new)])
    evaluation = sim.evaluate(state)
    per_client = evaluation["clients"]
    key, info = sampling.personalization_key(sim.root, state.round), round_info(int(state.round), None)
    adapted_acc, global_acc, untouched = [], [], []
    update = jax.jit(alg.client_update)  # each client on its padded row: one compile for both
    for k in new:
        client = jax.tree.map(lambda a, k=k: a[k], state.clients)
        rng = jax.random.fold_in(jax.random.fold_in(key, k), 0)
        adapted, _, _ = update(alg.broadcast(state.server, info), client, one_client(fed, k), rng, info)
        adapted_acc.append(client_accuracy(mlp, alg.eval_params(state.server, adapted), fed, k))
        global_acc.append(client_accuracy(mlp, alg.global_params(state.server), fed, k))
        untouched.append(client_accuracy(mlp, alg.eval_params(state.server, client), fed, k))
    np.testing.assert_allclose(per_client["new_acc"][new], adapted_acc, rtol=1e-5)
    np.testing.assert_allclose(per_client["new_global_acc"][new], global_acc, rtol=1e-5)
    assert evaluation["new_personalized_acc_mean"] == pytest.approx(np.mean(adapted_acc), rel=1e-5)
    assert evaluation["new_global_acc_mean"] == pytest.approx(np.mean(global_acc), rel=1e-5)
    assert untouched != adapted_acc  # the local update did change the personal models
    trained = np.setdiff1d(np.arange(fed.num_clients), new)
    assert np.isnan(per_client["acc"][new]).all() and np.isnan(np.delete(per_client["new_acc"], new)).all()
    assert not per_client["examples"][new].any() and not np.delete(per_client["new_examples"], new).any()
    assert per_client["new_examples"][new].min() > 0
    assert evaluation["personalized_acc_mean"] == pytest.approx(np.mean(per_client["acc"][trained]), rel=1e-6)


def test_new_clients_and_other_data_are_refused_in_one_line(mlp, digits_federation, digits):
    from jaxfed import Config, ConfigError

    alg = fedavg(mlp)
    for bad, says in (
        ([3, 3], "distinct"),
        ([10], "in 0..9"),
        (list(range(10)), "at least one must train"),
        (3, r"client ids \(a list\) or a fraction of the clients in \[0, 1\), got 3 \(client 3 alone: \[3\]\)"),
        (1.0, r"a fraction of the clients must be in \[0, 1\), got 1.0"),
    ):
        with pytest.raises(ConfigError, match=f"new_clients: .*{says}"):
            Simulation(alg, mlp, digits_federation, new_clients=bad)
    # a fraction: the clients the run key new_clients holds out
    held = Config().with_overrides(["new_clients=0.2", "num_clients=10"]).held_out_ids()
    assert held == (2, 7) and Simulation(alg, mlp, digits_federation, new_clients=0.2).new_clients.tolist() == [2, 7]
    assert Simulation(alg, mlp, digits_federation, new_clients=np.float32(0.2)).new_clients.tolist() == [2, 7]
    with pytest.raises(ConfigError, match="new_client_ids: give new_clients .* or new_client_ids"):
        Config().with_overrides(["new_clients=0.2", "new_client_ids=1,2"]).validate()
    with pytest.raises(ConfigError, match=r"^new_client_ids: ids must be distinct and in 0..3, got \[9\]$"):
        Config().with_overrides(["new_client_ids=9", "num_clients=4"]).validate()  # the key given is named
    assert Config().with_overrides(["new_clients=0.2", "num_clients=20"]).held_out_ids() == (2, 7, 12, 17)
    sim = Simulation(alg, mlp, digits_federation)
    others = make_federation(digits, num_clients=6)
    with pytest.raises(ConfigError, match="data: has 6 clients, but this simulation's state has 10"):
        sim.evaluate_pure(sim.init(), others)
