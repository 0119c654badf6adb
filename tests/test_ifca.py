"""IFCA against its definition written another way: the cluster a client picks is the argmin of
its losses computed here in numpy float64, its upload is ``train_classifier`` of that cluster's
model, and the server step is each cluster's sample-weighted mean computed in numpy float64.
Its defaults learning and its private state (BatchNorm statistics) staying private are
tests/test_defaults.py's and tests/test_privacy.py's.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import one_client, round_info

from jaxfed.algorithms import registry
from jaxfed.algorithms.ifca import PAPER_CLUSTERS, Upload, cluster_losses, ifca
from jaxfed.algorithms.training import train_classifier
from jaxfed.core import tree_add
from jaxfed.data import ClientData
from jaxfed.errors import ConfigError
from jaxfed.nn import Model
from jaxfed.nn.models import Norm
from jaxfed.options import sgd
from jaxfed.runs.config import Config

TRAIN = {"lr": 0.1, "local_epochs": 1, "batch_size": 32}


def _numpy_losses(model, models, data: ClientData, k_models: int) -> np.ndarray:
    """Each cluster model's mean cross-entropy over the client's real examples, all at once, in float64."""
    idx = np.asarray(data.indices)[: int(data.count)]
    x, y = np.asarray(data.x)[idx], np.asarray(data.y)[idx]
    losses = []
    for k in range(k_models):
        logits, _ = model.apply({"params": jax.tree.map(lambda m: m[k], models)}, jnp.asarray(x))
        z = np.asarray(logits, np.float64)
        log_p = z - z.max(1, keepdims=True) - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True))
        losses.append(-log_p[np.arange(len(y)), y].mean())
    return np.array(losses)


@pytest.mark.parametrize("best", [2, 0])
def test_a_client_trains_the_cluster_of_lowest_loss_as_train_classifier(best, mlp, digits_federation):
    alg = ifca(mlp, clusters=3, **TRAIN)
    server, client = alg.init(jax.random.key(0))
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    assert int(data.count) % 32, "a last partial batch, so the choice's masking is exercised"
    # cluster `best` trained a little on this client's data: its loss is the lowest, the others are random
    fitted, _ = train_classifier(mlp, sgd(0.1), {"params": jax.tree.map(lambda m: m[best], server.models)}, data,
                                 jax.random.key(1), epochs=1, batch_size=32)  # fmt: skip
    models = jax.tree.map(lambda m, f: m.at[best].set(f), server.models, fitted["params"])

    want_losses = _numpy_losses(mlp, models, data, 3)
    assert int(np.argmin(want_losses)) == best
    np.testing.assert_allclose(cluster_losses(mlp, models, {}, data, 32, jax.random.key(0)), want_losses, rtol=1e-5)

    new_client, upload, metrics = jax.jit(alg.client_update)(models, client, data, rng, round_info())
    assert int(new_client.cluster) == best
    np.testing.assert_array_equal(upload.cluster, np.eye(3)[best])
    want, _ = train_classifier(mlp, sgd(0.1), {"params": jax.tree.map(lambda m: m[best], models)}, data, rng,
                               epochs=1, batch_size=32)  # fmt: skip
    chex.assert_trees_all_close(upload.params, want["params"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["cluster_loss"], want_losses[best], rtol=1e-5)
    # the personalized model is the chosen cluster's model on the server
    chex.assert_trees_all_equal(alg.eval_params(server, new_client)["params"],
                                jax.tree.map(lambda m: m[best], server.models))  # fmt: skip
    # at evaluation a client that never chose (cluster 0 in its state) picks the lowest loss again
    picked = alg.personalize(server._replace(models=models), client, data, rng, round_info())
    chex.assert_trees_all_equal(picked["params"], jax.tree.map(lambda m: m[best], models))


class TinyBatchNormNet(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x, train=False, mask=None):
        h = nn.relu(Norm("batch")(nn.Dense(16)(x.reshape(x.shape[0], -1)), train, mask))
        return nn.Dense(self.num_classes)(h)


def test_the_choice_normalizes_with_each_batchs_statistics_not_the_clients_running_ones(digits, digits_federation):
    model = Model("tiny_bn", TinyBatchNormNet(digits.num_classes), digits.input_shape)
    server, client = jax.jit(ifca(model, clusters=3).init)(jax.random.key(0))
    data = one_client(digits_federation, 3)
    moved = jax.tree.map(lambda s: 3.0 * s + 1.0, client.model_state)  # running statistics far off
    losses = jax.jit(cluster_losses, static_argnums=(0, 4))
    key = jax.random.key(0)
    np.testing.assert_array_equal(losses(model, server.models, client.model_state, data, 32, key),
                                  losses(model, server.models, moved, data, 32, key))  # fmt: skip


def test_the_server_sets_each_cluster_to_the_weighted_mean_of_the_uploads_that_chose_it(mlp):
    alg = ifca(mlp, clusters=3)
    server, _ = alg.init(jax.random.key(0))
    info = round_info(0, 0)
    chosen = [0, 2, 0, 2, 1, 0]  # cluster 1: only a weight-0 row; cluster 0: a weight-0 row too
    weights = [10.0, 25.0, 40.0, 5.0, 0.0, 0.0]
    rng = np.random.default_rng(3)
    uploads = [
        Upload(jax.tree.map(lambda m: rng.normal(size=m.shape[1:]).astype(np.float32), server.models), np.eye(3)[k])
        for k in chosen
    ]
    contribute = jax.jit(alg.aggregation.contribute)
    total = None
    for upload, weight in zip(uploads, weights):
        share = contribute(server, upload, jnp.float32(weight), info)
        total = share if total is None else tree_add(total, share)
    new = jax.jit(alg.aggregation.apply)(server, total, info)

    for path_models, path_new, *rows in zip(
        jax.tree.leaves(server.models), jax.tree.leaves(new.models), *(jax.tree.leaves(u.params) for u in uploads)
    ):
        for k in range(3):
            w = np.array([wi if ci == k else 0.0 for ci, wi in zip(chosen, weights)], np.float64)
            if w.sum() > 0:
                want = sum(wi * np.asarray(r, np.float64) for wi, r in zip(w, rows)) / w.sum()
            else:  # nobody kept chose it: it keeps its model
                want = np.asarray(path_models[k])
            np.testing.assert_allclose(path_new[k], want, rtol=1e-5, atol=1e-4)
    assert not np.allclose(jax.tree.leaves(new.models)[0][0], jax.tree.leaves(server.models)[0][0])


def test_the_cluster_count_and_its_errors(mlp):
    def k_of(*settings):
        config = Config(algorithm="ifca").with_overrides(list(settings))
        alg = registry.get("ifca").build(mlp, config.options, config)
        return jax.tree.leaves(jax.eval_shape(alg.init, jax.random.key(0))[0].models)[0].shape[0]

    assert k_of() == PAPER_CLUSTERS == 4  # not a clustered task: the paper's rotated-MNIST k
    assert k_of("partition=label_groups", "num_clusters=3") == 3  # the task's ground-truth clusters
    assert k_of("partition=label_groups", "num_clusters=3", "clusters=2") == 2  # set: wins
    models = jax.jit(ifca(mlp, clusters=2).init)(jax.random.key(0))[0].models
    kernel = models["fc1"]["kernel"]
    assert not np.allclose(kernel[0], kernel[1])  # each cluster model from its own key
    with pytest.raises(ConfigError, match=r"^clusters: must be >= 0, got -1$"):
        ifca(mlp, clusters=-1)
