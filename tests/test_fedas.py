"""FedAS against its authors' code written out another way: the alignment loss as their loop over
the batch's labels (numpy, float64), the Fisher trace as their loop over batches (plain
``jax.grad`` on each batch's real examples, no mask), a client's round as its three steps run
by hand, and the server as the trace-weighted mean written out."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import BatchNormNet, module_features, one_client, round_info

from jaxfed.algorithms.features import class_means
from jaxfed.algorithms.fedas import Upload, alignment_loss, fedas, fisher_trace
from jaxfed.algorithms.partial import merge_layers, split_layers
from jaxfed.algorithms.training import fit, shuffled_positions, train_classifier, train_parameters
from jaxfed.nn import Model
from jaxfed.nn.layers import head_input
from jaxfed.options import sgd
from jaxfed.simulation import server_step

TRAIN = {"lr": 0.1, "local_epochs": 1, "batch_size": 32}


def _ce(mlp, params, x, y):
    """Mean cross-entropy over exactly the examples given (torch's ``CrossEntropyLoss``)."""
    logits = mlp.apply({"params": params}, x)[0]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


@pytest.mark.parametrize("seed", [0, 1])
def test_alignment_loss_is_the_authors_sum_over_labels_of_mse(seed):
    rng = np.random.default_rng(seed)
    features, prototypes = rng.normal(size=(12, 5)), rng.normal(size=(4, 5))
    labels = rng.integers(0, 4, size=12)
    mask = np.arange(12) < 9  # three padding rows, whatever their labels
    want = 0.0
    for label in np.unique(labels[mask]):  # the authors' `for label in y_batch.unique()`
        rows = features[mask & (labels == label)]
        want += np.mean((rows - prototypes[label]) ** 2)  # torch's MSELoss broadcasts the prototype
    got = alignment_loss(jnp.asarray(features), jnp.asarray(prototypes), jnp.asarray(labels), jnp.asarray(mask))
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("drop_last", [False, True])
def test_fisher_trace_sums_each_batchs_squared_gradient_norm(drop_last, mlp, digits_federation):
    data, rng = one_client(digits_federation, 3), jax.random.key(4)
    params = mlp.init(jax.random.key(1))["params"]
    count, batch = int(data.count), 16
    assert count % batch  # a partial last batch: kept or dropped
    trace, batches = jax.jit(
        lambda p: fisher_trace(mlp, p, {}, data, rng, batch_size=batch, drop_last=drop_last)
    )(params)  # fmt: skip
    padded = -(-data.indices.shape[0] // batch) * batch
    order = np.asarray(shuffled_positions(jax.random.split(rng, 1)[0], data.count, data.indices.shape[0], padded))
    want, taken = 0.0, 0
    for start in range(0, count, batch):
        positions = order[start : start + batch]
        positions = positions[positions < count]
        if drop_last and len(positions) < batch:
            continue
        rows = np.asarray(data.indices)[positions]
        grads = jax.grad(_ce, argnums=1)(mlp, params, data.x[rows], data.y[rows])
        want += sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads))
        taken += 1
    assert int(batches) == taken == (count // batch if drop_last else -(-count // batch))
    np.testing.assert_allclose(trace, want, rtol=1e-4)


def test_a_fedas_client_aligns_the_global_body_to_its_prototypes_then_trains_the_whole_model(mlp, digits_federation):
    alg = fedas(mlp, align_lr=0.05, **TRAIN)
    server, client = alg.init(jax.random.key(0))
    own = mlp.init(jax.random.key(7))["params"]  # the client's model is not the global one
    client = client._replace(params=own)
    global_body = jax.tree.map(lambda x: x + 0.02, server.params)
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    new_client, upload, metrics = jax.jit(alg.client_update)(global_body, client, data, rng, round_info(2))

    # by hand: prototypes of the client's own model over all its examples (numpy)
    real = np.asarray(data.indices)[: int(data.count)]
    z, y = np.asarray(module_features(mlp, own, data.x[real]), np.float64), np.asarray(data.y)[real]
    prototypes = np.zeros((10, z.shape[1]))
    for c in np.unique(y):
        prototypes[c] = z[y == c].mean(0)
    align_rng, train_rng, fisher_rng = jax.random.split(rng, 3)
    head = split_layers(own, ["head"])[1]

    def align_loss(body, state, batch):  # the authors' loop over the batch's labels, in jnp
        f = module_features(mlp, merge_layers(body, head), batch.x)
        total = 0.0
        for c in range(10):
            members = (batch.y == c) & batch.mask
            n = jnp.sum(members)
            per = jnp.sum(jnp.where(members[:, None], (f - prototypes[c]) ** 2, 0.0)) / jnp.maximum(n * f.shape[1], 1)
            total = total + jnp.where(n > 0, per, 0.0)
        return total, state

    aligned = fit(align_loss, optax.sgd(0.05), global_body, {}, data, align_rng, epochs=1, batch_size=16)[0]
    assert not np.allclose(jax.tree.leaves(aligned)[0], jax.tree.leaves(global_body)[0])
    trained, _ = train_classifier(mlp, sgd(0.1), {"params": merge_layers(aligned, head)}, data, train_rng, epochs=1,
                                  batch_size=32)  # fmt: skip
    chex.assert_trees_all_close(new_client.params, trained["params"], rtol=2e-4, atol=2e-5)
    chex.assert_trees_all_close(upload.body, split_layers(trained["params"], ["head"])[0], rtol=2e-4, atol=2e-5)
    want_trace, _ = fisher_trace(mlp, trained["params"], {}, data, fisher_rng, batch_size=32, drop_last=False)
    np.testing.assert_allclose(upload.fisher, want_trace, rtol=1e-3)
    assert "head" not in upload.body and upload.fisher > 0
    assert float(metrics["fisher_trace"]) == float(upload.fisher)
    # the personalized model is the client's own, trained
    chex.assert_trees_all_equal(alg.eval_params(server, new_client)["params"], new_client.params)


def test_with_batchnorm_the_alignment_and_the_trace_run_in_inference_mode_on_the_clients_statistics(
    digits, digits_federation
):
    """The alignment and the prototypes normalize with the statistics the client holds when the round
    begins, the trace with those training left (each in inference mode), training in train mode."""
    model = Model("bn_net", BatchNormNet(digits.num_classes), digits.input_shape)
    alg = fedas(model, align_lr=0.05, **TRAIN)
    server, client = alg.init(jax.random.key(0))
    stats = jax.tree.map(lambda x: x + 0.5, client.model_state)  # what its last round left
    own = model.init(jax.random.key(7))["params"]
    client = client._replace(params=own, model_state=stats)
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    new_client, upload, _ = jax.jit(alg.client_update)(server.params, client, data, rng, round_info(2))

    align_rng, train_rng, fisher_rng = jax.random.split(rng, 3)
    head = split_layers(own, ["head"])[1]
    prototypes, _ = class_means(model, "head", {"params": own, **stats}, data, 16)

    def align_loss(body, state, batch):
        variables = {"params": merge_layers(body, head), **stats}
        (f, _), _ = head_input(model, "head", variables, batch.x, train=False)
        return alignment_loss(f, prototypes, batch.y, batch.mask), state

    aligned = fit(align_loss, optax.sgd(0.05), server.params, stats, data, align_rng, epochs=1, batch_size=16)[0]
    trained, trained_stats, _ = train_parameters(
        model, sgd(0.1), merge_layers(aligned, head), stats, data, train_rng, epochs=1, batch_size=32
    )
    chex.assert_trees_all_close(new_client.params, trained, rtol=2e-4, atol=2e-5)
    chex.assert_trees_all_close(new_client.model_state, trained_stats, rtol=1e-5, atol=1e-6)
    trace, _ = fisher_trace(model, trained, trained_stats, data, fisher_rng, batch_size=32, drop_last=False)
    np.testing.assert_allclose(upload.fisher, trace, rtol=1e-3)


def test_without_alignment_the_global_body_replaces_the_clients_before_training(mlp, digits_federation):
    """``align_epochs=0``: the authors' ``wo_local`` ablation (the body substituted as it came)."""
    alg = fedas(mlp, align_epochs=0, **TRAIN)
    server, client = alg.init(jax.random.key(0))
    client = client._replace(params=mlp.init(jax.random.key(7))["params"])
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    new_client, _, _ = jax.jit(alg.client_update)(server.params, client, data, rng, round_info())
    head = split_layers(client.params, ["head"])[1]
    _, train_rng, _ = jax.random.split(rng, 3)
    trained, _ = train_classifier(mlp, sgd(0.1), {"params": merge_layers(server.params, head)}, data, train_rng,
                                  epochs=1, batch_size=32)  # fmt: skip
    chex.assert_trees_all_close(new_client.params, trained["params"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fisher_weighting", [True, False])
def test_fedas_server_weighs_each_body_by_its_fisher_trace(fisher_weighting, mlp):
    alg = fedas(mlp, fisher_weighting=fisher_weighting)
    server, _ = alg.init(jax.random.key(0))
    rng = np.random.default_rng(3)
    bodies = [jax.tree.map(lambda x: x + rng.normal(), server.params) for _ in range(3)]
    traces = np.array([2.0, 9.0, 0.5])
    weights = np.array([30.0, 0.0, 10.0])  # the second is a weight-0 row: it counts for nothing
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *bodies)
    new = server_step(alg, server, Upload(stacked, jnp.asarray(traces, jnp.float32)), jnp.asarray(weights, jnp.float32))
    by = traces if fisher_weighting else weights
    kept = by * (weights > 0)
    want = jax.tree.map(lambda *xs: sum(k * np.asarray(x, np.float64) for k, x in zip(kept, xs)) / kept.sum(), *bodies)
    chex.assert_trees_all_close(new.params, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--set", "align_epochs=-1"], "align_epochs: must be >= 0, got -1"),
        (["--set", "align_lr=-0.1"], "align_lr: must be >= 0, got -0.1"),
        (["--set", "head=fc9"], "fc9"),
        (["--dataset", "synthetic_linear"], "synthetic_linear is a regression task; fedas runs classification"),
    ],
)
def test_bad_fedas_settings_are_one_line_errors(args, expected, tmp_path, capsys):
    from jaxfed.cli import main

    assert main(["run", "fedas", *args, "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
