"""The papers' personalized-FL baselines against independent references.

Each round is checked against its definition written another way: FedPer's and FedRep's
training against FedAvg's with the frozen parts' updates zeroed by ``optax.multi_transform``,
Ditto's two models against FedAvg's and FedProx's client steps, MOON's and FedNTD's terms in
numpy float64 (and each reduced to FedAvg when its weight is 0). Every baseline's defaults learning
and its private state staying private are tests/test_defaults.py's and tests/test_privacy.py's.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import round_info

from jaxfed.algorithms.ditto import ditto
from jaxfed.algorithms.fedavg import fedavg
from jaxfed.algorithms.fedprox import proximal_term
from jaxfed.algorithms.partial import fedbn, fedper, fedrep, merge_layers, split_layers
from jaxfed.algorithms.records import ClientStats
from jaxfed.algorithms.regularized import fedntd, model_contrastive, moon, not_true_distillation
from jaxfed.algorithms.training import train_classifier
from jaxfed.data import ClientData
from jaxfed.errors import ConfigError
from jaxfed.options import sgd

TRAIN = {"lr": 0.1, "local_epochs": 1, "batch_size": 32}


def _client(fed, client=3):
    data = fed.train_data(jnp.array([client]))
    return ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])


def _frozen_except(params, trained: str, lr: float):
    """SGD on the top-level layers named ``trained`` (a predicate on the key), zero updates elsewhere."""
    labels = {key: "train" if trained(key) else "freeze" for key in params}
    return optax.multi_transform({"train": sgd(lr), "freeze": optax.set_to_zero()}, labels)


def test_split_and_merge_layers_round_trip(mlp):
    params = mlp.init(jax.random.key(0))["params"]
    shared, private = split_layers(params, ["head", "fc1"])
    assert set(shared) == {"fc2"} and set(private) == {"head", "fc1"}
    chex.assert_trees_all_equal(merge_layers(shared, private), params)


def test_fedper_trains_every_layer_and_uploads_the_base(mlp, digits_federation):
    alg = fedper(mlp, **TRAIN)
    server, client = alg.init(jax.random.key(0))
    assert set(server.params) == {"fc1", "fc2"} and set(client.personal) == {"head"}
    data, rng = _client(digits_federation), jax.random.key(5)
    new_client, upload, _ = jax.jit(alg.client_update)(server.params, client, data, rng, round_info())

    full = merge_layers(server.params, client.personal)
    trained, _ = train_classifier(mlp, sgd(0.1), {"params": full}, data, rng, epochs=1, batch_size=32)
    chex.assert_trees_all_close(upload, {k: trained["params"][k] for k in ("fc1", "fc2")}, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new_client.personal["head"], trained["params"]["head"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="personal_layers: nope not layers of the model; allowed: fc1, fc2, head"):
        fedper(mlp, personal_layers="nope")


def test_fedrep_trains_the_head_then_the_body_each_with_the_other_frozen(mlp, digits_federation):
    alg = fedrep(mlp, lr=0.1, head_epochs=2, local_epochs=1, batch_size=32)
    server, client = alg.init(jax.random.key(0))
    data, rng = _client(digits_federation), jax.random.key(5)
    new_client, upload, metrics = jax.jit(alg.client_update)(server.params, client, data, rng, round_info())

    head_rng, body_rng = jax.random.split(rng)
    full = {"params": merge_layers(server.params, client.personal)}
    is_head = lambda key: key == "head"  # noqa: E731
    after_head, m1 = train_classifier(mlp, _frozen_except(full["params"], is_head, 0.1), full, data, head_rng,
                                      epochs=2, batch_size=32)  # fmt: skip
    not_head = lambda key: key != "head"  # noqa: E731
    after_body, m2 = train_classifier(mlp, _frozen_except(full["params"], not_head, 0.1), after_head, data, body_rng,
                                      epochs=1, batch_size=32)  # fmt: skip
    want_shared, want_head = split_layers(after_body["params"], ["head"])
    chex.assert_trees_all_close(upload, want_shared, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new_client.personal, want_head, rtol=1e-5, atol=1e-6)
    assert float(metrics["steps"]) == float(m1["steps"]) + float(m2["steps"]) > 0
    # the head did move in its phase and the body in its own
    assert not np.allclose(after_head["params"]["head"]["kernel"], full["params"]["head"]["kernel"])
    assert not np.allclose(want_shared["fc1"]["kernel"], server.params["fc1"]["kernel"])


def test_fedbn_keeps_every_normalization_layer_and_refuses_a_model_without(digits, mlp):
    from jaxfed.nn import get_model

    model = get_model("vgg8", digits.input_shape, digits.num_classes, norm="batch")
    server, client = jax.eval_shape(fedbn(model).init, jax.random.key(0))
    assert sorted(client.personal) == [f"norm{i}.BatchNorm_0" for i in range(1, 6)]
    assert "batch_stats" in client.model_state
    flat = jax.tree_util.tree_flatten_with_path(server.params)[0]
    assert flat and not any("norm" in jax.tree_util.keystr(path) for path, _ in flat)
    with pytest.raises(ConfigError, match="fedbn: model mlp has no normalization layer"):
        fedbn(mlp)


def test_ditto_trains_the_global_copy_as_fedavg_and_the_personal_model_toward_it(mlp, digits_federation):
    alg = ditto(mlp, lam=0.5, personal_epochs=2, **TRAIN)
    server, client = alg.init(jax.random.key(0))
    personal = jax.tree.map(lambda x: x + 0.05, client.personal)  # a personal model away from the global
    client = client._replace(personal=personal)
    data, rng = _client(digits_federation), jax.random.key(5)
    new_client, upload, metrics = jax.jit(alg.client_update)(server.params, client, data, rng, round_info())

    global_rng, personal_rng = jax.random.split(rng)
    _, want_upload, _ = fedavg(mlp, **TRAIN).client_update(server.params, ClientStats({}), data, global_rng,
                                                           round_info())  # fmt: skip
    chex.assert_trees_all_close(upload, want_upload, rtol=1e-5, atol=1e-6)
    pull = proximal_term(0.5)
    want, _ = train_classifier(mlp, sgd(0.1), {"params": personal}, data, personal_rng, epochs=2, batch_size=32,
                               regularizer=lambda v: pull(v, server.params))  # fmt: skip
    chex.assert_trees_all_close(new_client.personal, want["params"], rtol=1e-5, atol=1e-6)
    assert float(metrics["steps"]) > 0 and "personal_loss" in metrics


def test_the_model_contrastive_loss_is_the_papers_formula():
    rng = np.random.default_rng(0)
    z, zg, zp = (rng.normal(size=(5, 7)) for _ in range(3))
    cos = lambda a, b: np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))  # noqa: E731
    tau = 0.5
    want = -np.log(np.exp(cos(z, zg) / tau) / (np.exp(cos(z, zg) / tau) + np.exp(cos(z, zp) / tau)))
    got = model_contrastive(*(jnp.asarray(a, jnp.float32) for a in (z, zg, zp)), tau)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_not_true_distillation_is_the_kl_over_the_other_classes():
    rng = np.random.default_rng(1)
    local, glob = rng.normal(size=(6, 4)), rng.normal(size=(6, 4))
    labels = np.array([0, 1, 2, 3, 1, 0])
    tau = 2.0
    want = []
    for lo, gl, y in zip(local, glob, labels):
        keep = np.arange(4) != y
        q_l = np.exp(lo[keep] / tau) / np.exp(lo[keep] / tau).sum()
        q_g = np.exp(gl[keep] / tau) / np.exp(gl[keep] / tau).sum()
        want.append(np.sum(q_g * np.log(q_g / q_l)))
    got = not_true_distillation(jnp.asarray(local), jnp.asarray(glob), jnp.asarray(labels), tau)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # the true class's logit takes no part
    moved = jnp.asarray(local).at[jnp.arange(6), labels].add(3.0)
    np.testing.assert_allclose(not_true_distillation(moved, jnp.asarray(glob), jnp.asarray(labels), tau), want,
                               rtol=1e-5, atol=1e-7)  # fmt: skip


@pytest.mark.parametrize("build, weight", [(moon, "mu"), (fedntd, "beta")])
def test_moon_and_fedntd_are_fedavg_at_weight_zero_and_differ_from_it_otherwise(build, weight, mlp, digits_federation):
    data, rng = _client(digits_federation), jax.random.key(5)
    plain = fedavg(mlp, **TRAIN)
    server, _ = plain.init(jax.random.key(0))
    _, want, _ = plain.client_update(server.params, ClientStats({}), data, rng, round_info())
    for value, same in ((0.0, True), (1.0, False)):
        alg = build(mlp, **TRAIN, **{weight: value})
        _, client = alg.init(jax.random.key(0))
        if build is moon:  # a previous model unlike the global one, so the contrast has a negative pair
            noise = jax.tree.map(lambda x: jax.random.normal(jax.random.key(9), x.shape), client.previous)
            client = client._replace(previous=jax.tree.map(lambda x, n: x + 0.1 * n, client.previous, noise))
        new_client, upload, _ = jax.jit(alg.client_update)(server.params, client, data, rng, round_info())
        close = all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*map(jax.tree.leaves, (upload, want))))
        assert close == same, (weight, value)
    if build is moon:  # the client's next "previous model" is the model it trained
        chex.assert_trees_all_equal(new_client.previous, upload)
