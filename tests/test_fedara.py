"""FedARA: anchors, the local objective, exact full-rank round trip, private heads, tier costs, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_federation, one_client, round_info

from jaxfed.algorithms.features import class_anchors
from jaxfed.algorithms.fedara import fedara, frobenius_penalty, lambda_at
from jaxfed.cli import main
from jaxfed.core import lowrank, tree_bytes
from jaxfed.core.losses import masked_loss
from jaxfed.errors import ConfigError
from jaxfed.nn.factorized import factorized_execution
from jaxfed.simulation import Simulation, server_step


def _fedara(model, lr=0.05, **options):
    options = {"local_epochs": 1, "batch_size": 32, **options}
    return fedara(model, lr=lr, **options)


def test_anchors_are_the_class_means_of_the_received_features(mlp, digits_federation):
    alg = _fedara(mlp, tiers=(0.5,))
    server, client = alg.init(jax.random.key(0))
    message = alg.broadcast(server, round_info(0, 0))
    variables = {"params": {**message.fe, "head": client.head}}
    data = one_client(digits_federation, 2)
    with factorized_execution():
        anchors, present = jax.jit(lambda v: class_anchors(mlp, "head", v, data, batch_size=16))(variables)
        x = np.asarray(data.x)[np.asarray(data.indices)[: int(data.count)]]
        features = np.asarray(mlp.apply(variables, jnp.asarray(x), features=True)[0], np.float64)
    labels = np.asarray(data.y)[np.asarray(data.indices)[: int(data.count)]]
    for c in range(10):
        if (labels == c).any():
            assert present[c]
            np.testing.assert_allclose(anchors[c], features[labels == c].mean(0), rtol=1e-4, atol=1e-5)
        else:
            assert not present[c] and np.all(np.asarray(anchors[c]) == 0)
    assert not np.all(np.asarray(present))  # this client lacks some classes


def _reference_steps(model, message, head, data, steps, lam, mu, lr, fixed_anchors=True, anchor_fe=None):
    """Full-batch gradient descent on FedARA's loss, written out: anchors from the received FE
    (or from ``anchor_fe``; or, to show the test can fail, recomputed from the current FE every step)."""
    count = int(data.count)
    positions = np.asarray(data.indices)[:count]
    x, y = jnp.asarray(np.asarray(data.x)[positions]), jnp.asarray(np.asarray(data.y)[positions])

    def features(fe, head_):
        with factorized_execution():
            return model.apply({"params": {**fe, "head": head_}}, x, features=True)[0]

    def anchors_of(fe, head_):
        f, onehot = features(fe, head_), jax.nn.one_hot(y, 10)
        return (onehot.T @ f) / jnp.maximum(onehot.sum(0), 1.0)[:, None]

    def loss(params, anchors):
        f = features(params["fe"], params["head"])
        logits = f @ params["head"]["kernel"] + params["head"]["bias"]
        fro = sum(
            jnp.sum(lowrank.reconstruct(lowrank.layer_factors(layer)) ** 2)
            for layer in lowrank.layers_with_factors(params["fe"]).values()
        )
        align = jnp.mean((f - anchors[y]) ** 2)  # torch's MSELoss: over examples and dimensions
        return masked_loss(logits, y, jnp.ones_like(y, bool)) + lam * align + mu * fro

    params = {"fe": message.fe, "head": head}
    received_anchors = anchors_of(message.fe if anchor_fe is None else anchor_fe, head)
    gradient = jax.jit(jax.grad(loss))
    for _ in range(steps):
        anchors = received_anchors if fixed_anchors else anchors_of(params["fe"], params["head"])
        grads = gradient(params, anchors)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return params


def test_local_objective_uses_anchors_fixed_at_the_received_fe(mlp, digits_federation):
    lam, mu, lr = 5.0, 1e-2, 0.05
    alg = _fedara(
        mlp, lr=lr, tiers=(0.5,), lambda_=lam, mu_fro=mu, lambda_warmup_rounds=0, local_epochs=3, batch_size=512
    )  # one full batch per epoch: three plain gradient steps
    server, client = alg.init(jax.random.key(0))
    info = round_info(4, 0)  # past the first round: lambda is on
    message = alg.broadcast(server, info)
    data = one_client(digits_federation, 2)
    new_client, upload, metrics = jax.jit(alg.client_update)(message, client, data, jax.random.key(1), info)
    assert float(metrics["lambda"]) == lam and float(metrics["steps"]) == 3
    expected = _reference_steps(mlp, message, client.head, data, 3, lam, mu, lr)
    moving = _reference_steps(mlp, message, client.head, data, 3, lam, mu, lr, fixed_anchors=False)
    for got, want, other in zip(
        jax.tree.leaves(upload), jax.tree.leaves(expected["fe"]), jax.tree.leaves(moving["fe"])
    ):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(moving))) > 1e-4
    for got, want in zip(jax.tree.leaves(new_client.head), jax.tree.leaves(expected["head"])):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_global_anchors_come_from_the_full_rank_global_fe(mlp, digits_federation):
    lam, mu, lr = 5.0, 1e-2, 0.05
    options = dict(lr=lr, tiers=(0.25,), lambda_=lam, mu_fro=mu, lambda_warmup_rounds=0, local_epochs=3, batch_size=512)
    alg = _fedara(mlp, anchor_model="global", **options)
    server, client = alg.init(jax.random.key(0))
    info = round_info(4, 0)
    message = alg.broadcast(server, info)
    received_only = _fedara(mlp, **options).broadcast(server, info)
    assert received_only.anchor_fe is None  # the default sends the tier's factors alone
    assert tree_bytes(message) == tree_bytes(received_only) + tree_bytes(server.fe)
    data = one_client(digits_federation, 2)
    _, upload, _ = jax.jit(alg.client_update)(message, client, data, jax.random.key(1), info)
    expected = _reference_steps(mlp, message, client.head, data, 3, lam, mu, lr, anchor_fe=server.fe)
    from_received = _reference_steps(mlp, message, client.head, data, 3, lam, mu, lr)
    for got, want in zip(jax.tree.leaves(upload), jax.tree.leaves(expected["fe"])):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    gap = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(from_received)))
    assert gap > 1e-4


def test_global_anchors_count_only_the_global_kernels_a_tier_receives_factorized(mlp):
    """anchor_model=global sends the full global FE beside the tier's; the download counted is the
    tier's FE plus the global kernels of the layers it holds as factors (none at full rank), as the
    rest of the global FE is the tier's own."""
    alg = _fedara(mlp, anchor_model="global", tiers=(1.0, 0.25))
    server, client = alg.init(jax.random.key(0))
    for tier in (0, 1):
        message = alg.broadcast(server, round_info(0, tier))
        factorized = [key for key, layer in _layers(message.fe) if "u" in layer]
        assert bool(factorized) == (tier == 1)
        kernels = sum(np.asarray(dict(_layers(server.fe))[key]["kernel"]).nbytes for key in factorized)
        counted = alg.sent_bytes(message, client, round_info(0, tier))
        assert int(counted) == tree_bytes(message.fe) + kernels < tree_bytes(message)


def _layers(params, prefix=()):
    """``(key, layer)`` of every layer dict (one holding a kernel or factors) in ``params``."""
    if "kernel" in params or "u" in params:
        yield "/".join(prefix), params
        return
    for name, child in params.items():
        yield from _layers(child, (*prefix, name))


def test_lambda_ramps_from_zero_in_round_one():
    values = [float(lambda_at(jnp.int32(t), 2.0, 10)) for t in (1, 2, 6, 10, 11, 50)]
    # the paper: 0 in round 1, rising linearly to lambda over the first 10 rounds
    np.testing.assert_allclose(values, [0.0, 2 / 9, 10 / 9, 2.0, 2.0, 2.0], rtol=1e-6)
    assert float(lambda_at(jnp.int32(1), 2.0, 0)) == 0.0 and float(lambda_at(jnp.int32(2), 2.0, 0)) == 2.0


def test_full_rank_is_exact_and_a_round_with_lr_zero_keeps_the_global_fe(small_cnn, digits_federation):
    alg = _fedara(small_cnn, lr=0.0, tiers=(1.0,), mu_fro=0.0)
    server, client = alg.init(jax.random.key(0))
    message = jax.jit(alg.broadcast)(server, round_info())
    x = digits_federation.x_test[:16]
    full = small_cnn.apply({"params": {**server.fe, "head": client.head}}, x, features=True)[0]
    with factorized_execution():
        factored = small_cnn.apply({"params": {**message.fe, "head": client.head}}, x, features=True)[0]
    np.testing.assert_allclose(factored, full, rtol=1e-4, atol=1e-4)
    # decompose -> train with lr 0 -> reconstruct -> aggregate gives the global FE back
    _, upload, metrics = jax.jit(alg.client_update)(
        message, client, one_client(digits_federation, 2), jax.random.key(1), round_info()
    )
    assert float(metrics["steps"]) > 0
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), upload)
    new = server_step(alg, server, stacked, jnp.array([30.0, 50.0]))  # the server decodes each upload
    for before, after in zip(jax.tree.leaves(server.fe), jax.tree.leaves(new.fe)):
        np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-5)


def test_heads_stay_private_and_tier_uploads_fall_with_rank(mlp, digits):
    tiers = (1.0, 0.5, 0.25)
    alg = _fedara(mlp, tiers=tiers)
    fed = make_federation(digits, num_clients=6, alpha=0.5)
    sim = Simulation(alg, mlp, fed, participation=1.0)
    start = sim.init()
    for t in range(3):
        assert "head" not in alg.broadcast(start.server, round_info(0, t)).fe
    state, metrics = sim.run_rounds(start, 3)
    sent = [float(metrics[f"bytes_up_client_tier{t}"][0]) for t in range(3)]
    expected = [
        tree_bytes(alg.broadcast(start.server, round_info(0, t)).fe) for t in range(3)
    ]  # the upload has the FE's shapes
    # ratio 1.0 sends the 200 x 200 kernel: as many values as its rank-100 factors at ratio 0.5
    assert sent == expected and sent[0] == sent[1] > sent[2]
    assert "kernel" in alg.broadcast(start.server, round_info(0, 0)).fe["fc2"]
    assert "u" in alg.broadcast(start.server, round_info(0, 1)).fe["fc2"]
    assert "head" not in state.server.fe
    heads = np.asarray(state.clients.head["kernel"])
    assert not np.allclose(heads[0], heads[3])  # personal heads
    result = sim.evaluate(state)
    assert result["personalized_acc_mean"] > 0.6 and "global_acc" not in result


def test_client_flops_fall_with_the_tier_rank(mlp, digits_federation):
    alg = _fedara(mlp, tiers=(0.5, 0.25, 0.125))
    server, client = alg.init(jax.random.key(0))
    data = one_client(digits_federation, 2)
    flops = [
        jax.jit(alg.client_update)
        .lower(alg.broadcast(server, round_info(0, t)), client, data, jax.random.key(1), round_info(0, t))
        .cost_analysis()["flops"]
        for t in range(3)
    ]
    assert flops[0] > flops[1] > flops[2]


def test_bad_settings_are_clear_errors(mlp, tmp_path, capsys):
    with pytest.raises(ConfigError, match="decompose_layers: 'conv9' is not a layer of the feature extractor"):
        _fedara(mlp, decompose_layers=["conv9"])
    with pytest.raises(ConfigError, match="decompose_layers: 'head' is not a layer of the feature extractor"):
        _fedara(mlp, decompose_layers=["head"])
    with pytest.raises(ConfigError, match=r"tiers: every rank ratio must be in \(0, 1\], got 1.5 in '1.0,1.5'"):
        _fedara(mlp, tiers=(1.0, 1.5))
    cases = [
        (["--set", "tiers=1.0,0"], "tiers: every rank ratio must be in (0, 1], got 0.0 in '1.0,0.0'"),
        (["--set", "decompose_layers=fc2,fc9"], "decompose_layers: 'fc9' is not a layer of the feature extractor"),
        (["--set", "num_clients=3", "--set", "tiers=1,0.5,0.25,0.1"], "tiers: 4 tiers for 3 clients"),
        (["--set", "lambda=-1"], "lambda: must be >= 0, got -1.0"),
        (["--set", "anchor_model=full"], "anchor_model: unknown 'full'; allowed: received, global"),
    ]
    for args, expected in cases:
        assert main(["run", "fedara", *args, "--out", str(tmp_path / "r"), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, err


def test_the_lambda_key_maps_to_its_field():
    from jaxfed.runs.config import Config

    config = Config(algorithm="fedara").with_overrides(["lambda=0.5", "lambda_warmup_rounds=3", "mu_fro=0"]).validate()
    options = config.options
    assert (options.lambda_, options.lambda_warmup_rounds, options.mu_fro) == (0.5, 3, 0.0)
    assert ("lambda", 2.0) in [(k, d) for k, d, _, _ in type(options).describe()]


def test_the_frobenius_term_is_the_same_for_a_kernel_and_its_full_rank_factors():
    rng = np.random.default_rng(0)
    kernel = jnp.asarray(rng.normal(size=(12, 7)), jnp.float32)
    plain = {"fc": {"kernel": kernel}}
    factored = lowrank.factorize_layers(plain, {"fc": 7})
    expected = float(np.sum(np.float64(kernel) ** 2))
    np.testing.assert_allclose(float(frobenius_penalty(plain, ["fc"])), expected, rtol=1e-5)
    np.testing.assert_allclose(float(frobenius_penalty(factored, ["fc"])), expected, rtol=1e-4)


def test_each_tier_decomposes_its_largest_layers_and_penalizes_only_those(small_cnn):
    from jaxfed.algorithms.fedara import tier_layer_sets

    template = jax.eval_shape(small_cnn.init, jax.random.key(0))["params"]
    alg = _fedara(small_cnn, tiers=(0.5, 0.25, 0.25), tier_layers=(1, 2, 0))
    extractor = [k for k in lowrank.factorizable_layers(template) if k != "head"]
    decomposed = extractor[1:]  # the default: every extractor layer but the first
    size = {key: lowrank.get_layer(template, key)["kernel"].size for key in decomposed}
    by_size = sorted(decomposed, key=lambda key: -size[key])
    sets = tier_layer_sets(template, decomposed, (1, 2, 0), 3)
    assert [set(s) for s in sets] == [set(by_size[:1]), set(by_size[:2]), set()]
    server, _ = alg.init(jax.random.key(0))
    rng = np.random.default_rng(1)
    for tier, q in enumerate(sets):
        message = alg.broadcast(server, round_info(0, tier))
        assert set(lowrank.layers_with_factors(message.fe)) == set(q)
        # the Frobenius term over Q_k only: ||U V^T||^2 written out in float64
        fe = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), message.fe)
        expected = 0.0
        for key in q:
            u, v = (np.float64(lowrank.get_layer(fe, key)[f]) for f in ("u", "v"))
            u, v = u.reshape(-1, u.shape[-1]), v.reshape(-1, v.shape[-1])
            expected += np.sum((u @ v.T) ** 2)
        weights = jnp.asarray([key in q for key in decomposed], jnp.float32)
        got = float(frobenius_penalty(fe, decomposed, weights))
        np.testing.assert_allclose(got, expected, rtol=1e-4)


def test_tier_layers_errors_are_one_line(mlp):
    with pytest.raises(ConfigError, match=r"tier_layers: one count per tier \(5 tiers\), got 2: 1,2"):
        _fedara(mlp, tier_layers=(1, 2))
    with pytest.raises(ConfigError, match="tier_layers: 9 exceeds the"):
        _fedara(mlp, tiers=(0.5,), tier_layers=(9,))
