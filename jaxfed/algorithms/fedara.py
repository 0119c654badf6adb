"""FedARA: resource-adaptive low-rank feature extractors with anchor-driven representation alignment.

The model is a feature extractor (FE: every layer but the ``head``) and a classifier ``head``
(option ``head``: a Dense layer's key, default the last Dense layer the forward pass calls). The
FE is shared; the head is private client state and never uploaded. Clients sit in static
tiers, each with a rank ratio ``r_k`` (``tiers``) over the decomposed layers ``Q``
(``decompose_layers``, default: every FE layer but the first, which holds the fewest parameters).

- Stage 1, server: for each tier, the truncated SVD of each layer of ``Q`` in the global FE at
  ``round(r_k * min dim)`` of its matricized kernel; the other FE layers are sent full.
- Stage 2, client: anchors first, the per-class mean feature (the head's input) of the client's
  training examples under the received, frozen FE (classes absent locally have none); then
  ``local_epochs`` of ``CE + lambda_t * MSE(f(x_i), a_{y_i}) + mu_fro * sum_q ||U_q V_q^T||_F^2``
  on the FE factors and the head, run factorized (``factorized_execution``: compute scales with
  ``r_k``). The MSE averages over examples and feature dimensions (``anchor_loss="mean"``,
  torch's ``MSELoss``); ``anchor_loss="sum"`` sums over the dimensions. ``lambda_t`` ramps
  linearly from 0 in round 1 to ``lambda`` in round ``lambda_warmup_rounds``.
- Stage 3, server: every upload reconstructed to full kernels (``receive``), then the
  sample-weighted mean.

A client's personalized model is the global FE truncated to its tier's rank plus its head.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms.base import FederatedAlgorithm
from jaxfed.algorithms.fedhm import TieredOptions, average_received, reconstruct_upload, tier_ranks
from jaxfed.algorithms.training import TrainState, gradient_step, masked_loss, run_epochs, split_variables
from jaxfed.core import lowrank
from jaxfed.data import Batch, ClientData
from jaxfed.errors import ConfigError
from jaxfed.nn.factorized import factorized_execution
from jaxfed.nn.layers import head_input, last_dense_layer, layers_in_call_order, no_adaptable_layers
from jaxfed.options import non_negative, one_of, option, resolve, split_keys

ANCHOR_LOSSES = ("mean", "sum")
PAPER = "FedARA paper §5 settings"


@dataclasses.dataclass(frozen=True)
class FedARAOptions(TieredOptions):
    """FedARA's options: tiers, the anchor alignment and the private head."""

    lambda_: float = option(
        2.0,
        "anchor alignment weight lambda (key 'lambda'); 10 in the homogeneous setting",
        source="FedARA paper §5 (CIFAR-10 heterogeneous: 2)",
        check=non_negative,
    )
    lambda_warmup_rounds: int = option(
        10,
        "lambda ramps linearly from 0 in round 1 to lambda in this round",
        source="FedARA paper §4",
        check=non_negative,
    )
    mu_fro: float = option(
        1e-3,
        "Frobenius decay of the decomposed layers, mu * sum ||U V^T||_F^2",
        source="FedARA paper §4",
        check=non_negative,
    )
    anchor_loss: str = option(
        "mean",
        "anchor MSE averaged over feature dimensions (mean) or summed over them (sum)",
        source="torch's MSELoss, the authors' framework",
        check=one_of(*ANCHOR_LOSSES),
    )
    decompose_layers: tuple[str, ...] = option(
        (), "feature-extractor layers to decompose (comma-separated); empty = all but the first"
    )
    head: str = option("", "the private classifier layer (a Dense layer's key); empty = the last Dense called")


class ServerState(NamedTuple):
    """The server's state, and what it broadcasts (the extractor factorized to the tier's rank)."""

    fe: Any  # the feature extractor's parameters (every layer but the head)
    round: jax.Array  # rounds completed (broadcast: the 1-based round being run)


class ClientState(NamedTuple):
    head: Any  # the private classifier layer's parameters
    model_state: Any  # non-trainable collections (BatchNorm statistics), {} when none


def default_decomposed_layers(model, head: str) -> list[str]:
    """Every feature-extractor layer but the first one called (the smallest in these models)."""
    extractor = [key for key in layers_in_call_order(model) if key != head]
    return extractor[1:] or extractor


def check_decomposed_layers(model, layers, head: str) -> list[str]:
    """``layers`` if each is a Dense / Conv layer of the feature extractor (they run factorized)."""
    extractor = [key for key in layers_in_call_order(model) if key != head]
    for key in layers:
        if key not in extractor:
            raise ConfigError(
                f"decompose_layers: '{key}' is not a layer of the feature extractor; allowed: {', '.join(extractor)}"
            )
    if not layers:
        raise ConfigError(f"decompose_layers: no layer to decompose; allowed: {', '.join(extractor) or 'none'}")
    return list(layers)


def check_head(model, template, head: str) -> str:
    """The head's key: ``head`` if it is a Dense layer of the model, else the last Dense called."""
    head = head or last_dense_layer(model)
    dense = [k for k in lowrank.factorizable_layers(template) if lowrank.get_layer(template, k)["kernel"].ndim == 2]
    if not dense:
        raise no_adaptable_layers("fedara", model)
    if head not in dense:
        raise ConfigError(f"head: '{head}' is not a Dense layer of the model; allowed: {', '.join(dense) or 'none'}")
    return head


def lambda_at(round_: jax.Array, lam: float, warmup_rounds: int) -> jax.Array:
    """``lambda_t`` of round ``round_`` (1-based): 0 in round 1 (no anchors yet), rising linearly to
    ``lam`` in round ``warmup_rounds`` (the paper: over the first 10 rounds), ``lam`` after; with
    ``warmup_rounds <= 1``, ``lam`` from round 2."""
    if warmup_rounds <= 1:
        return jnp.where(round_ > 1, lam, 0.0)
    return lam * jnp.clip((round_ - 1) / (warmup_rounds - 1), 0.0, 1.0)


def frobenius_penalty(fe_params, layers) -> jax.Array:
    """``sum_q ||U_q V_q^T||_F^2`` over the decomposed layers ``q``: ``sum((U^T U) * (V^T V))`` for
    a factorized layer, ``||W||_F^2`` for one its tier keeps at full rank (sent as its kernel)."""
    total = jnp.float32(0)
    for key in layers:
        layer = lowrank.get_layer(fe_params, key)
        if "u" in layer:
            u, v = lowrank.layer_factors(layer)
            total = total + jnp.sum((u.T @ u) * (v.T @ v))
        else:
            total = total + jnp.sum(jnp.square(layer["kernel"]))
    return total


def class_anchors(model, head: str, variables, data: ClientData, batch_size: int):
    """``(anchors [classes, features], present [classes])``: the mean feature of each class over the
    client's real training examples (``present`` False, anchor 0, for a class it does not hold)."""
    feature_dim, num_classes = lowrank.get_layer(variables["params"], head)["kernel"].shape
    steps = -(-data.count // batch_size)

    def one_batch(b, totals):
        sums, counts = totals
        batch = data.batch(b * batch_size + jnp.arange(batch_size, dtype=jnp.int32))
        (features, _), _ = head_input(model, head, variables, batch.x, train=False)
        members = jax.nn.one_hot(batch.y, num_classes) * batch.mask[:, None]
        return sums + members.T @ features, counts + jnp.sum(members, axis=0)

    zeros = (jnp.zeros((num_classes, feature_dim)), jnp.zeros((num_classes,)))
    sums, counts = jax.lax.fori_loop(0, steps, one_batch, zeros)
    return sums / jnp.maximum(counts, 1.0)[:, None], counts > 0


def anchored_loss(model, head: str, anchors, lam_t, mu_fro, anchor_loss: str = "mean", decomposed=()):
    """``loss(params, model_state, batch)`` of FedARA's local objective; ``params = {"fe", "head"}``."""
    per_dimension = 1.0 / anchors.shape[-1] if anchor_loss == "mean" else 1.0

    def loss(params, model_state, batch: Batch):
        variables = {"params": lowrank.replace_layer(params["fe"], head, params["head"]), **model_state}
        (features, logits), new_state = head_input(model, head, variables, batch.x, train=True, mask=batch.mask)
        weight = batch.mask.astype(jnp.float32)
        drift = jnp.sum((features - anchors[batch.y]) ** 2, axis=-1) * per_dimension
        alignment = jnp.sum(drift * weight) / jnp.maximum(jnp.sum(weight), 1.0)
        value = masked_loss(logits, batch.y, batch.mask) + lam_t * alignment
        return value + mu_fro * frobenius_penalty(params["fe"], decomposed), new_state

    return loss


def fedara(model, options: FedARAOptions | None = None, *, name: str = "fedara", **overrides) -> FederatedAlgorithm:
    """FedARA over ``len(options.tiers)`` client tiers."""
    options = resolve(FedARAOptions, options, overrides)
    template, _ = split_variables(jax.eval_shape(model.init, jax.random.key(0)))
    head = check_head(model, template, options.head)
    layers = list(split_keys(options.decompose_layers)) or default_decomposed_layers(model, head)
    decomposed = check_decomposed_layers(model, layers, head)
    ranks = tier_ranks(template, decomposed, options.tiers)

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        extractor, head_params = lowrank.pop_layer(params, head)
        return ServerState(extractor, jnp.int32(0)), ClientState(head_params, model_state)

    def broadcast(server_state, tier):
        return ServerState(lowrank.factorize_layers(server_state.fe, ranks[tier]), server_state.round + 1)

    def client_update(message, client_state, data, rng):
        optimizer = options.optimizer(data.round)  # this round's learning rate
        received = {
            "params": lowrank.replace_layer(message.fe, head, client_state.head),
            **client_state.model_state,
        }
        with factorized_execution():
            anchors, _ = class_anchors(model, head, received, data, options.batch_size)
            lam_t = lambda_at(message.round, options.lambda_, options.lambda_warmup_rounds)
            loss = anchored_loss(model, head, anchors, lam_t, options.mu_fro, options.anchor_loss, decomposed)
            trainable = {"fe": message.fe, "head": client_state.head}
            state = TrainState(trainable, optimizer.init(trainable), client_state.model_state)
            state, metrics = run_epochs(gradient_step(loss, optimizer), state, data, rng, **options.batching())
        new_client = ClientState(state.params["head"], state.model_state)
        return new_client, state.params["fe"], {**metrics, "lambda": lam_t}

    def server_update(server_state, messages, weights):
        return ServerState(average_received(server_state.fe, messages, weights), server_state.round + 1)

    def eval_server(server_state, tier):
        """The global FE truncated to the tier's rank (as the tier's clients run it), once per tier."""
        truncated = lowrank.reconstruct_layers(lowrank.factorize_layers(server_state.fe, ranks[tier]))
        return server_state._replace(fe=truncated)

    def eval_params(server_view, client_state):
        return {
            "params": lowrank.replace_layer(server_view.fe, head, client_state.head),
            **client_state.model_state,
        }

    return FederatedAlgorithm(
        name=name,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        server_update=server_update,
        eval_params=eval_params,
        global_params=None,  # the heads are private: there is no global model
        num_tiers=len(ranks),
        receive=reconstruct_upload,
        eval_server=eval_server,
    )
