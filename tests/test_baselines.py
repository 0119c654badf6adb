"""The papers' personalized-FL baselines against independent references.

Each round is checked against its definition written another way: FedPer's and FedRep's
training against FedAvg's with the frozen parts' updates zeroed by ``optax.multi_transform``,
Ditto's two models against FedAvg's and FedProx's client steps, MOON's and FedNTD's terms in
numpy float64 (and each reduced to FedAvg when its weight is 0), pFedLoRA's two schedules against
``train_classifier`` on kernels ``W + s * down @ up`` written out, frozen parts zeroed the same
way. Every baseline's defaults learning and its private state staying private are
tests/test_defaults.py's and tests/test_privacy.py's.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import BatchNormNet, client_accuracy, make_federation, module_features, one_client, round_info

from jaxfed.algorithms.ditto import ditto
from jaxfed.algorithms.features import class_counts
from jaxfed.algorithms.fedavg import fedavg
from jaxfed.algorithms.fedbabu import fedbabu
from jaxfed.algorithms.fedproto import Prototypes, Upload, fedproto
from jaxfed.algorithms.fedprox import proximal_term
from jaxfed.algorithms.fedrod import balanced_softmax_loss, fedrod
from jaxfed.algorithms.partial import fedbn, fedper, fedrep, merge_layers, split_layers
from jaxfed.algorithms.pfedlora import PFedLoRAOptions, pfedlora
from jaxfed.algorithms.records import ClientStats
from jaxfed.algorithms.regularized import (
    fedntd,
    model_contrastive,
    moon,
    not_true_distillation,
    pfedsd,
    self_distillation,
)
from jaxfed.algorithms.training import fit, train_classifier
from jaxfed.core import lowrank
from jaxfed.core.losses import masked_loss, masked_mean
from jaxfed.data import ClientData
from jaxfed.errors import ConfigError
from jaxfed.nn import Model
from jaxfed.nn.layers import head_input
from jaxfed.options import sgd
from jaxfed.simulation import Simulation, server_step
from jaxfed.simulation.sampling import personalization_key

TRAIN = {"lr": 0.1, "local_epochs": 1, "batch_size": 32}


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
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
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
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
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
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
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
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
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


def test_moons_frozen_models_normalize_with_the_statistics_of_the_clients_last_round(digits, digits_federation):
    """MOON's global and previous models run in inference mode with the BatchNorm statistics the
    client held when the round began (the previous model's own), not those training is moving."""
    model = Model("bn_net", BatchNormNet(digits.num_classes), digits.input_shape)
    alg = moon(model, mu=5.0, **TRAIN)
    server, client = alg.init(jax.random.key(0))
    moved = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(9), x.shape), client.previous)
    stats = jax.tree.map(lambda x: x + 0.5, client.model_state)  # the statistics of its last round
    client = client._replace(previous=moved, model_state=stats)
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    new_client, upload, _ = jax.jit(alg.client_update)(server.params, client, data, rng, round_info(1))
    head = "head"

    def frozen_features(params, x):
        (z, _), _ = head_input(model, head, {"params": params, **stats}, x, train=False)
        return z

    def loss(params, model_state, batch):
        variables = {"params": params, **model_state}
        (z, logits), new_state = head_input(model, head, variables, batch.x, train=True, mask=batch.mask)
        contrast = model_contrastive(z, frozen_features(server.params, batch.x), frozen_features(moved, batch.x), 0.5)
        return masked_loss(logits, batch.y, batch.mask) + 5.0 * masked_mean(contrast, batch.mask), new_state

    want, want_stats, _ = fit(loss, sgd(0.1), server.params, stats, data, rng, epochs=1, batch_size=32)
    chex.assert_trees_all_close(upload, want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new_client.model_state, want_stats, rtol=1e-5, atol=1e-6)


def test_fedntds_frozen_global_model_normalizes_with_the_statistics_the_round_began_with(digits, digits_federation):
    """FedNTD's global model runs in inference mode (the authors' copy is taken in eval()) with the
    statistics the client held when the round began, not those its training is moving."""
    model = Model("bn_net", BatchNormNet(digits.num_classes), digits.input_shape)
    alg = fedntd(model, beta=1.0, **TRAIN)
    server, client = alg.init(jax.random.key(0))
    stats = jax.tree.map(lambda x: x + 0.5, client.model_state)
    client = client._replace(model_state=stats)
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    new_client, upload, _ = jax.jit(alg.client_update)(server.params, client, data, rng, round_info(1))

    def loss(params, model_state, batch):
        logits, new_state = model.apply({"params": params, **model_state}, batch.x, train=True, mask=batch.mask)
        teacher, _ = model.apply({"params": server.params, **stats}, batch.x, train=False)
        ntd = not_true_distillation(logits, teacher, batch.y, 1.0)
        return masked_loss(logits, batch.y, batch.mask) + masked_mean(ntd, batch.mask), new_state

    want, want_stats, _ = fit(loss, sgd(0.1), server.params, stats, data, rng, epochs=1, batch_size=32)
    chex.assert_trees_all_close(upload, want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new_client.model_state, want_stats, rtol=1e-5, atol=1e-6)


def test_self_distillation_is_the_authors_tau_squared_batchmean_kl():
    """Fling's ``lamda * tau**2 * F.kl_div(log_softmax(o / tau), softmax(o_pre / tau), 'batchmean')`` per example."""
    rng = np.random.default_rng(2)
    logits, previous = rng.normal(size=(5, 6)), 2 * rng.normal(size=(5, 6))
    tau = 3.0
    q = np.exp(logits / tau) / np.exp(logits / tau).sum(1, keepdims=True)
    q_prev = np.exp(previous / tau) / np.exp(previous / tau).sum(1, keepdims=True)
    want = tau**2 * np.sum(q_prev * (np.log(q_prev) - np.log(q)), 1)
    np.testing.assert_allclose(self_distillation(jnp.asarray(logits), jnp.asarray(previous), tau), want, rtol=1e-5)


def test_pfedsd_distils_its_last_local_model_from_its_second_round_and_is_evaluated_with_it(mlp, digits_federation):
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    alg = pfedsd(mlp, lam=0.5, tau=3.0, **TRAIN)
    server, client = alg.init(jax.random.key(0))
    plain = fedavg(mlp, **TRAIN)
    # first round: nothing to distil from, FedAvg's client
    first, upload, _ = jax.jit(alg.client_update)(server.params, client, data, rng, round_info(0))
    _, want, _ = plain.client_update(server.params, ClientStats({}), data, rng, round_info(0))
    chex.assert_trees_all_close(upload, want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal(alg.eval_params(server, first)["params"], upload)  # its local model, before aggregation
    # second round: from the (new) global model, CE plus the distillation toward the model it trained before
    moved = jax.tree.map(lambda x: x + 0.05, server.params)
    _, second, _ = jax.jit(alg.client_update)(moved, first, data, rng, round_info(1))

    def loss(params, batch):
        logits = mlp.apply({"params": params}, batch.x)[0]
        teacher = mlp.apply({"params": upload}, batch.x)[0]
        log_q, log_p = jax.nn.log_softmax(logits / 3.0), jax.nn.log_softmax(teacher / 3.0)
        kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch.y[:, None], -1)[:, 0]
        weight = batch.mask.astype(jnp.float32)
        return jnp.sum((ce + 0.5 * 9.0 * kl) * weight) / jnp.maximum(jnp.sum(weight), 1.0)

    chex.assert_trees_all_close(second, _reference_fit(loss, moved, data, rng), rtol=1e-5, atol=1e-6)
    _, without, _ = plain.client_update(moved, ClientStats({}), data, rng, round_info(1))
    assert not np.allclose(jax.tree.leaves(second)[0], jax.tree.leaves(without)[0], atol=1e-6)


def _reference_fit(loss, trainable, data, rng):
    """SGD at TRAIN's settings on ``loss(trainable, batch)`` over the same batches as the engine's loop."""
    return fit(lambda t, state, batch: (loss(t, batch), state), sgd(0.1), trainable, {}, data, rng, epochs=1,
               batch_size=32)[0]  # fmt: skip


def test_balanced_softmax_is_the_papers_formula():
    rng = np.random.default_rng(2)
    logits, counts = rng.normal(size=(5, 4)), np.array([3.0, 0.0, 10.0, 1.0])
    labels = np.array([0, 2, 3, 2, 0])
    prob = counts * np.exp(logits) / np.sum(counts * np.exp(logits), axis=1, keepdims=True)
    want = -np.mean(np.log(prob[np.arange(5), labels]))
    got = balanced_softmax_loss(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(counts), jnp.ones(5, bool))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # a padding row (mask False) holding an absent class adds nothing and stays finite
    padded_labels = jnp.asarray(np.r_[1, labels[1:]])
    padded = balanced_softmax_loss(jnp.asarray(logits), padded_labels, jnp.asarray(counts),
                                   jnp.asarray([False, True, True, True, True]))  # fmt: skip
    np.testing.assert_allclose(padded, -np.mean(np.log(prob[np.arange(1, 5), labels[1:]])), rtol=1e-5)


def test_class_counts_are_the_clients_label_histogram(digits_federation):
    data = one_client(digits_federation, 3)
    labels = np.asarray(data.y)[np.asarray(data.indices)[: int(data.count)]]
    np.testing.assert_array_equal(class_counts(data, 10), np.bincount(labels, minlength=10))


def test_fedrod_trains_the_generic_model_balanced_and_the_personal_head_on_frozen_features(mlp, digits_federation):
    alg = fedrod(mlp, **TRAIN)
    server, client = alg.init(jax.random.key(0))
    assert not any(np.any(leaf) for leaf in jax.tree.leaves(client.personal))  # the personal head starts at 0
    client = client._replace(personal=jax.tree.map(lambda x: x + 0.01, client.personal))
    data, rng = one_client(digits_federation, client=1), jax.random.key(5)
    counts = np.bincount(np.asarray(data.y)[np.asarray(data.indices)[: int(data.count)]], minlength=10)
    assert (counts == 0).any(), "the check needs a client that lacks a class"
    new_client, upload, _ = jax.jit(alg.client_update)(server.params, client, data, rng, round_info())

    def loss(t, batch):  # the two losses written from the paper: log-prior shift, personal logits added
        z = module_features(mlp, t["generic"], batch.x)
        g = z @ t["generic"]["head"]["kernel"] + t["generic"]["head"]["bias"]
        shifted = jnp.where(counts > 0, g + jnp.log(jnp.maximum(counts, 1)), -1e9)
        generic = -jnp.take_along_axis(jax.nn.log_softmax(shifted), batch.y[:, None], 1)[:, 0]
        z, g = jax.lax.stop_gradient(z), jax.lax.stop_gradient(g)
        p = g + z @ t["personal"]["kernel"] + t["personal"]["bias"]
        personal = -jnp.take_along_axis(jax.nn.log_softmax(p), batch.y[:, None], 1)[:, 0]
        return jnp.sum((generic + personal) * batch.mask) / jnp.sum(batch.mask)

    want = _reference_fit(loss, {"generic": server.params, "personal": client.personal}, data, rng)
    chex.assert_trees_all_close(upload, want["generic"], rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new_client.personal, want["personal"], rtol=1e-5, atol=1e-6)
    # the personalized model's logits are the generic head's plus the personal head's
    x = data.x[:7]
    logits, _ = mlp.apply(alg.eval_params(server, new_client), x)
    z = module_features(mlp, server.params, x)
    want_logits = z @ (server.params["head"]["kernel"] + new_client.personal["kernel"])
    np.testing.assert_allclose(logits, want_logits + server.params["head"]["bias"] + new_client.personal["bias"],
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_fedproto_pulls_features_to_the_prototypes_and_uploads_its_class_means(mlp, digits_federation):
    alg = fedproto(mlp, lambda_=2.0, **TRAIN)
    _, client = alg.init(jax.random.key(0))
    present = np.arange(10) % 3 != 0  # classes 0, 3, 6, 9 have no global prototype
    prototypes = Prototypes(jax.random.normal(jax.random.key(1), (10, 200)), jnp.asarray(present))
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    new_client, upload, _ = jax.jit(alg.client_update)(prototypes, client, data, rng, round_info())

    def loss(params, batch):
        z = module_features(mlp, params, batch.x)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(mlp.apply({"params": params}, batch.x)[0]), batch.y[:, None], 1)
        pull = jnp.mean((z - prototypes.means[batch.y]) ** 2, axis=1) * jnp.asarray(present)[batch.y]
        return jnp.sum((ce[:, 0] + 2.0 * pull) * batch.mask) / jnp.sum(batch.mask)

    want = _reference_fit(loss, client.params, data, rng)
    chex.assert_trees_all_close(new_client.params, want, rtol=1e-5, atol=1e-6)
    real = np.asarray(data.indices)[: int(data.count)]
    z, y = np.asarray(module_features(mlp, want, data.x[real]), np.float64), np.asarray(data.y)[real]
    counts = np.bincount(y, minlength=10)
    np.testing.assert_array_equal(upload.counts, counts)
    for c in range(10):
        want_mean = z[y == c].mean(0) if counts[c] else np.zeros(200)
        np.testing.assert_allclose(upload.means[c], want_mean, rtol=1e-4, atol=1e-5)


def test_fedprotos_server_weighs_each_class_by_its_counts(mlp):
    alg = fedproto(mlp)
    server, _ = alg.init(jax.random.key(0))
    rng = np.random.default_rng(3)
    means = rng.normal(size=(3, 10, 200))
    counts = rng.integers(0, 4, size=(3, 10)).astype(np.float64)
    counts[:, 4] = 0  # nobody holds class 4
    weights = np.array([5.0, 0.0, 7.0])  # the second client is a weight-0 row: it counts for nothing
    uploads = Upload(jnp.asarray(means, jnp.float32), jnp.asarray(counts, jnp.float32))
    new = server_step(alg, server, uploads, jnp.asarray(weights, jnp.float32))
    kept = counts * (weights > 0)[:, None]
    for c in range(10):
        if kept[:, c].sum() == 0:
            assert not new.present[c]
        else:
            want = (kept[:, c, None] * means[:, c]).sum(0) / kept[:, c].sum()
            assert new.present[c]
            np.testing.assert_allclose(new.means[c], want, rtol=1e-5, atol=1e-6)


def test_fedbabu_trains_the_body_under_the_fixed_head_and_uploads_the_body(mlp, digits_federation):
    alg = fedbabu(mlp, **TRAIN)
    server, client = alg.init(jax.random.key(0))
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    _, upload, _ = jax.jit(alg.client_update)(server.params, client, data, rng, round_info())
    not_head = lambda key: key != "head"  # noqa: E731
    want, _ = train_classifier(mlp, _frozen_except(server.params, not_head, 0.1), {"params": server.params}, data,
                               rng, epochs=1, batch_size=32)  # fmt: skip
    assert set(upload) == {"fc1", "fc2"}
    chex.assert_trees_all_close(upload, split_layers(want["params"], ["head"])[0], rtol=1e-5, atol=1e-6)
    new = alg.aggregation.apply(server, alg.aggregation.contribute(server, upload, 3.0, round_info(tier=None)),
                                round_info(tier=None))  # fmt: skip
    chex.assert_trees_all_equal(new.params["head"], server.params["head"])  # the head stays at its init


@pytest.mark.parametrize("part, fixed", [("head", ["fc1", "fc2"]), ("body", ["head"])])
def test_fedbabus_fine_tuning_trains_only_the_part_named_at_the_base_lr(part, fixed, mlp, digits_federation):
    alg = fedbabu(mlp, finetune=part, finetune_epochs=1, lr_schedule="cosine", lr_min=0.0, lr_decay_rounds=5,
                  **TRAIN)  # fmt: skip
    server, client = alg.init(jax.random.key(0))
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    tuned = alg.personalize(server, client, data, rng, round_info(5))["params"]  # round 5: the cosine's lr is 0
    trained = lambda key: key not in fixed  # noqa: E731
    want, _ = train_classifier(mlp, _frozen_except(server.params, trained, 0.1), {"params": server.params}, data,
                               rng, epochs=1, batch_size=32)  # fmt: skip
    chex.assert_trees_all_close(tuned, want["params"], rtol=1e-5, atol=1e-6)
    for key in fixed:
        chex.assert_trees_all_equal(tuned[key], server.params[key])


def test_fedbabu_is_evaluated_after_each_client_fine_tunes_the_global_model(mlp, digits):
    """The engine's ``personalize`` path against a per-client loop: each client fine-tunes the
    global model on its training split (with the key of its id) and is scored on its test split."""
    fed = make_federation(digits, num_clients=4, alpha=0.5)
    alg = fedbabu(mlp, finetune_epochs=2, **TRAIN)
    sim = Simulation(alg, mlp, fed, seed=3)
    state, _ = sim.run_rounds(sim.init(), 1)
    got = sim.evaluate(state)
    global_params = state.server.params
    key = personalization_key(sim.root, state.round)
    accuracies = []
    for k in range(fed.num_clients):
        train = fed.train_data(jnp.array([k]))
        own = ClientData(train.x, train.y, train.indices[0], train.count[0])
        tuned, _ = train_classifier(mlp, sgd(0.1), {"params": global_params}, own, jax.random.fold_in(key, k), epochs=2,
                                    batch_size=32)  # fmt: skip
        accuracies.append(client_accuracy(mlp, tuned, fed, k))
    np.testing.assert_allclose(got["personalized_acc_mean"], np.mean(accuracies), atol=1e-6)


def _pfedlora_client(alg, digits_federation):
    """pFedLoRA's start with personal modules away from zero (so their scale matters), a client's data, a key."""
    server, client = alg.init(jax.random.key(0))
    tau = {
        key: lora._replace(up=0.1 * jax.random.normal(jax.random.key(2), lora.up.shape))
        for key, lora in client.tau.items()
    }
    return server, client._replace(tau=tau), one_client(digits_federation, 3), jax.random.key(5)


def _kernel_plus_lora(params, tau, scale):
    """The personalized MLP written out: each adapted Dense kernel ``W + scale * (down @ up)`` (for a
    Dense kernel the im2col folding is the plain matrix product)."""
    written = dict(params)
    for key, (down, up) in tau.items():
        written[key] = {**params[key], "kernel": params[key]["kernel"] + scale * (down @ up)}
    return written


def _only(part, optimizer):
    """``optimizer`` on ``part`` ("global" or "personal") of the trained tree, zero updates on the other."""
    labels = {name: "train" if name == part else "freeze" for name in ("global", "personal")}
    return optax.multi_transform({"train": optimizer, "freeze": optax.set_to_zero()}, labels)


@pytest.mark.parametrize("schedule", ["alternating", "simultaneous"])
def test_pfedlora_trains_the_personal_modules_and_the_global_model_by_its_schedule(schedule, mlp, digits_federation):
    options = PFedLoRAOptions(schedule=schedule, personal_rank=4, lora_alpha=2.0, personal_epochs=2, local_epochs=1)
    alg = pfedlora(mlp, options)
    server, client, data, rng = _pfedlora_client(alg, digits_federation)
    assert {key: lora.down.shape for key, lora in client.tau.items()} == {"fc2": (200, 4)}  # the interior layer
    info = round_info(3)  # the cosine schedule's lr of round 3
    new_client, upload, metrics = jax.jit(alg.client_update)(server, client, data, rng, info)

    optimizer = options.optimizer(3)
    both = {"params": {"global": server.params, "personal": client.tau}}
    scale = 2.0 / 4  # lora_alpha / personal_rank
    to_params = lambda t: _kernel_plus_lora(t["global"], t["personal"], scale)  # noqa: E731
    train = functools.partial(train_classifier, mlp, data=data, batch_size=32, to_params=to_params)
    if schedule == "simultaneous":
        want, m = train(optimizer, both, rng=rng, epochs=1)
        steps = m["steps"]
    else:  # the personal modules first (key fold_in(rng, 1)), then the global model, each with the other frozen
        after_personal, m1 = train(_only("personal", optimizer), both, rng=jax.random.fold_in(rng, 1), epochs=2)
        want, m2 = train(_only("global", optimizer), after_personal, rng=rng, epochs=1)
        steps = m1["steps"] + m2["steps"]
        assert not np.allclose(after_personal["params"]["personal"]["fc2"].up, client.tau["fc2"].up)
    chex.assert_trees_all_close(upload.params, want["params"]["global"], rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new_client.tau, want["params"]["personal"], rtol=1e-5, atol=1e-6)
    assert float(metrics["steps"]) == float(steps) > 0
    assert not np.allclose(upload.params["fc1"]["kernel"], server.params["fc1"]["kernel"])  # the global model trained
    personalized = alg.eval_params(upload, new_client)["params"]
    chex.assert_trees_all_close(personalized, to_params(want["params"]), rtol=1e-5, atol=1e-6)


def test_pfedlora_starts_at_the_global_model_and_averages_it_by_sample_count(mlp):
    alg = pfedlora(mlp)
    server, client = alg.init(jax.random.key(0))
    assert PFedLoRAOptions().schedule == "simultaneous"  # pFedLoRA(2), the paper's better variant
    assert not any(np.any(lora.up) for lora in client.tau.values()) and all(np.any(x.down) for x in client.tau.values())
    chex.assert_trees_all_equal(alg.eval_params(server, client), alg.global_params(server), {"params": server.params})
    rng = np.random.default_rng(0)
    uploads = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=(3,) + a.shape), jnp.float32), server)
    counts = np.array([10.0, 30.0, 0.0])  # the third is padding
    new = server_step(alg, server, uploads, jnp.asarray(counts))
    weights = counts / counts.sum()
    for got, stacked in zip(jax.tree.leaves(new.params), jax.tree.leaves(uploads.params), strict=True):
        np.testing.assert_allclose(got, np.tensordot(weights, np.asarray(stacked, np.float64), 1), rtol=1e-5, atol=1e-6)


def test_pfedlora_keeps_batchnorm_statistics_on_the_client_and_uses_the_families_im2col_layout(digits):
    from jaxfed.nn import get_model

    model = get_model("vgg8", digits.input_shape, digits.num_classes, norm="batch")
    alg = pfedlora(model, personal_rank=2)
    server, client = jax.eval_shape(alg.init, jax.random.key(0))
    assert alg.global_params is None and not server.model_state and "batch_stats" in client.model_state
    # every Dense/Conv but the first called and the head; a kernel [..., cout] as [prod(...), r] @ [r, cout]
    assert sorted(client.tau) == ["conv2", "conv3", "conv4", "conv5", "fc1", "fc2"]
    template = jax.eval_shape(model.init, jax.random.key(0))["params"]
    for key, lora in client.tau.items():
        shape = lowrank.get_layer(template, key)["kernel"].shape  # conv: (kh, kw, cin, cout), im2col rows
        assert (lora.down.shape, lora.up.shape) == ((np.prod(shape[:-1]), 2), (2, shape[-1])), key
    with pytest.raises(ConfigError, match="personal_rank: 500 is not a valid rank"):
        pfedlora(model, personal_rank=500)
