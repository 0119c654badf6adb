"""IFCA (Ghosh et al., NeurIPS 2020): the Iterative Federated Clustering Algorithm.

The server keeps K cluster models, stacked along a leading K axis, each initialized from its own
key (different initializations break the symmetry between clusters). Every client receives all K.
A round (the paper's model-averaging option: local epochs on the chosen model):

1. the client computes the loss of each cluster model over all its training examples and picks
   ``k* = argmin_k F_i(theta_k)`` (its cluster identity estimate);
2. it trains model ``k*`` with the normal local training and uploads it, with the one-hot of
   ``k*``: the cluster identity is what IFCA sends, it is not private;
3. the server sets each cluster's model to the sample-weighted mean of the uploads that chose it;
   a cluster that no kept client chose keeps its model. (The paper's machines each hold the same
   number of examples, so its plain mean over the cluster's machines is this mean; with clients
   of unequal size jaxfed weighs by examples, as FedAvg does.)

A client is evaluated on the model of the cluster with the lowest loss on its training data under
the current cluster models (``personalize``: the choice step again, whether or not it trained
lately). The paper lets each test client pick on its own labelled test data; jaxfed keeps the
test split for scoring. ``eval_params`` (a client's model without its data) is the cluster it
chose in its last round (cluster 0 before its first).

BatchNorm statistics stay on the client (as FedAvg's do), one set per client. The choice is made
with each batch's own statistics (train-mode normalization): the cluster models carry no
statistics of their own and the client's running statistics belong to the cluster it trained
last, which would favour that cluster. The choice, like the upload, then depends only on the K
models received and the client's data. For a model without BatchNorm the two modes are the same.

Not here: the paper's restarts from random initializations (the authors' CIFAR code draws new
initial models until every cluster is chosen by a set share of the clients); each run starts
from one draw of the K models.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import train_parameters
from jaxfed.contract import Aggregation, FederatedAlgorithm
from jaxfed.core import mean_of, weighted_share
from jaxfed.core.losses import example_losses
from jaxfed.data import ClientData
from jaxfed.nn import split_variables
from jaxfed.options import TrainingOptions, non_negative, option, resolve

PAPER_CLUSTERS = 4
CLUSTERS_SOURCE = (
    "Ghosh et al. (NeurIPS 2020), the rotated-MNIST experiments: k = 4 (the authors' code jichan3751/ifca, "
    "mnist/config.json: p = 4); 0 takes the task's ground-truth num_clusters"
)


@dataclasses.dataclass(frozen=True)
class IFCAOptions(TrainingOptions):
    """IFCA's options: the number of cluster models."""

    clusters: int = option(
        0,
        f"cluster models K; 0 = the task's ground-truth num_clusters when it has them, else {PAPER_CLUSTERS}",
        source=CLUSTERS_SOURCE,
        check=non_negative,
    )


class ServerState(NamedTuple):
    models: Any  # the K cluster models' parameters, stacked on a leading K axis


class ClientState(NamedTuple):
    cluster: jax.Array  # int32 scalar: the cluster it chose in its last round (0 before its first)
    model_state: Any  # the model's non-trainable collections (BatchNorm statistics), {} when none


class Upload(NamedTuple):
    params: Any  # the chosen cluster's model after local training
    cluster: jax.Array  # [K] float32: the one-hot of the chosen cluster


def cluster_count(clusters: int, num_clusters: int) -> int:
    """K: ``clusters`` when set, else the task's ground-truth ``num_clusters``, else the paper's."""
    return clusters or num_clusters or PAPER_CLUSTERS


CHOICE_STREAM = 1  # fold_in of a client's key: the dropout masks of its cluster choice


def cluster_losses(model, models, model_state, data: ClientData, batch_size: int, rng) -> jax.Array:
    """``[K]``: the mean loss of each stacked cluster model over the client's real examples, in
    batches of ``batch_size`` (train-mode normalization: each batch's own statistics; a model with
    dropout draws one mask per batch from ``rng``, the same for every cluster model)."""
    steps = -(-data.count // batch_size)

    def loss_sum(params):
        def one_batch(carry):
            i, total = carry
            batch = data.batch(i * batch_size + jnp.arange(batch_size, dtype=jnp.int32))
            variables = {"params": params, **model_state}
            outputs, _ = model.apply(variables, batch.x, train=True, mask=batch.mask, rng=jax.random.fold_in(rng, i))
            return i + 1, total + jnp.sum(jnp.where(batch.mask, example_losses(outputs, batch.y), 0.0))

        return jax.lax.while_loop(lambda carry: carry[0] < steps, one_batch, (jnp.int32(0), jnp.float32(0)))[1]

    return jax.vmap(loss_sum)(models) / jnp.maximum(data.count, 1).astype(jnp.float32)


def choose_cluster(losses: jax.Array) -> jax.Array:
    """The cluster of lowest loss (the first on a tie; a NaN loss is never the lowest)."""
    return jnp.argmin(jnp.where(jnp.isnan(losses), jnp.inf, losses)).astype(jnp.int32)


def cluster_model(models, k):
    """Cluster ``k``'s model out of the stacked ``models``."""
    return jax.tree.map(lambda stacked: stacked[k], models)


def cluster_share(upload: Upload, weight, num_clusters: int):
    """One upload's share of every cluster's weighted mean: its model on each cluster's row,
    weighted by ``weight`` on the chosen row and 0 elsewhere (one shape for every client)."""
    rows = jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (num_clusters,) + leaf.shape), upload.params)
    return weighted_share(rows, upload.cluster * weight)


def ifca(model, options: IFCAOptions | None = None, *, num_clusters: int = 0, **overrides) -> FederatedAlgorithm:
    """IFCA: K cluster models; each client trains the one with the lowest loss on its data."""
    options = resolve(IFCAOptions, options, overrides)
    k_models = cluster_count(options.clusters, num_clusters)

    def init(rng):
        models, model_states = split_variables(jax.vmap(model.init)(jax.random.split(rng, k_models)))
        return ServerState(models), ClientState(jnp.int32(0), cluster_model(model_states, 0))

    def client_update(models, client_state, data, rng, info):
        choice_rng = jax.random.fold_in(rng, CHOICE_STREAM)  # rng itself drives the training, as FedAvg's
        losses = cluster_losses(model, models, client_state.model_state, data, options.batch_size, choice_rng)
        k = choose_cluster(losses)
        params, model_state, metrics = train_parameters(
            model, options.optimizer(info.round), cluster_model(models, k), client_state.model_state, data, rng,
            **options.batching(),
        )  # fmt: skip
        upload = Upload(params, jax.nn.one_hot(k, k_models, dtype=jnp.float32))
        return ClientState(k, model_state), upload, {**metrics, "cluster_loss": losses[k]}

    def apply(server_state, total, info):
        return ServerState(mean_of(total, server_state.models))  # an unchosen cluster keeps its model

    def eval_params(server_state, client_state):
        return {"params": cluster_model(server_state.models, client_state.cluster), **client_state.model_state}

    def personalize(server_state, client_state, data, rng, info):
        losses = cluster_losses(model, server_state.models, client_state.model_state, data, options.batch_size, rng)
        return {"params": cluster_model(server_state.models, choose_cluster(losses)), **client_state.model_state}

    return FederatedAlgorithm(
        name="ifca",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state.models,
        client_update=client_update,
        aggregation=Aggregation(
            contribute=lambda server_state, upload, weight, info: cluster_share(upload, weight, k_models),
            apply=apply,
        ),
        eval_params=eval_params,
        global_params=None,  # K cluster models, no single global one
        personalize=personalize,
    )


builtin(
    "ifca",
    IFCAOptions,
    lambda model, options, config: ifca(model, options, num_clusters=config.ground_truth_clusters()),
)
