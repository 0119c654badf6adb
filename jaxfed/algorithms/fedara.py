"""FedARA: resource-adaptive low-rank feature extractors with anchor-driven representation alignment.

The model is a feature extractor (FE: every layer but the ``head``) and a classifier ``head``
(option ``head``: a Dense layer's key, default the last Dense layer the forward pass calls). The
FE is shared; the head is private client state and never uploaded. Clients sit in static
tiers, each with a rank ratio ``r_k`` (``tiers``) over its decomposed layers ``Q_k``: the
``decompose_layers`` (default: every FE layer but the first, which holds the fewest parameters),
or with ``tier_layers`` the ``n_k`` largest of them (by parameter count) for tier k.

- Stage 1, server: for each tier, the truncated SVD of each layer of ``Q`` in the global FE at
  ``round(r_k * min dim)`` of its matricized kernel; the other FE layers are sent full.
- Stage 2, client: anchors first, the per-class mean feature (the head's input) of the client's
  training examples under the received, frozen FE (classes absent locally have none; with
  ``anchor_model="global"`` under the full-rank global FE, sent beside the tier's); then
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
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms.aggregation import averaging
from jaxfed.algorithms.features import class_anchors
from jaxfed.algorithms.fedhm import TieredOptions, reconstruct_upload, tier_ranks
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import fit
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core import lowrank, tree_bytes
from jaxfed.core.losses import masked_loss, masked_mean
from jaxfed.data import Batch
from jaxfed.errors import ConfigError
from jaxfed.nn import model_template, split_variables
from jaxfed.nn.factorized import factorized_execution
from jaxfed.nn.layers import head_input, head_layer, layers_in_call_order
from jaxfed.options import each, non_negative, one_of, option, resolve, split_keys

ANCHOR_LOSSES = ("mean", "sum", "normalized")
ANCHOR_MODELS = ("received", "global")
PAPER = "FedARA paper §5 settings"


@dataclasses.dataclass(frozen=True)
class FedARAOptions(TieredOptions):
    """FedARA's options: tiers, the anchor alignment and the private head."""

    tasks: ClassVar[tuple[str, ...]] = ("classification",)  # anchors are class means

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
        "anchor distance: squared error averaged over feature dimensions (mean), summed over them (sum), "
        "or between unit-length feature and anchor (normalized: 2 - 2 cos)",
        source="torch's MSELoss, the authors' framework",
        check=one_of(*ANCHOR_LOSSES),
    )
    anchor_model: str = option(
        "received",
        "the frozen FE that computes the anchors: the tier's low-rank omega_rk as received (received) or the "
        "full-rank global omega (global: sent beside it, so the download grows by the full FE)",
        source="FedARA paper §3 ('the frozen low-rank GFE omega_rk'; global: 'the same omega (or its low-rank "
        "approximation)')",
        check=one_of(*ANCHOR_MODELS),
    )
    decompose_layers: tuple[str, ...] = option(
        (), "feature-extractor layers to decompose (comma-separated); empty = all but the first"
    )
    tier_layers: tuple[int, ...] = option(
        (),
        "per tier, how many of the decompose_layers it decomposes, largest first (Q_k); empty = all, every tier",
        source="FedARA paper §3 (structural parameters (r_k, Q_k))",
        check=each(non_negative),
    )
    head: str = option("", "the private classifier layer (a Dense layer's key); empty = the last Dense called")

    def check(self):
        super().check()
        if self.tier_layers and len(self.tier_layers) != len(self.tiers):
            raise ConfigError(
                f"tier_layers: one count per tier ({len(self.tiers)} tiers), got {len(self.tier_layers)}: "
                f"{','.join(map(str, self.tier_layers))}"
            )


class ServerState(NamedTuple):
    fe: Any  # the feature extractor's parameters (every layer but the head)


class Broadcast(NamedTuple):
    fe: Any  # the extractor with the tier's Q_k factorized to its rank (padded tiers: lowrank.Padded)
    anchor_fe: Any = None  # with anchor_model=global, the full-rank global FE the anchors come from
    in_tier: Any = None  # padded tiers: [layer] 0/1, the tier's Q_k among the decomposed layers


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


def tier_layer_sets(template, decomposed: list[str], counts, num_tiers: int) -> list[list[str]]:
    """``Q_k`` per tier: all of ``decomposed``, or with ``counts`` its ``n_k`` largest layers."""
    if not counts:
        return [list(decomposed)] * num_tiers
    size = {key: lowrank.get_layer(template, key)["kernel"].size for key in decomposed}
    largest = sorted(decomposed, key=lambda key: -size[key])
    for n in counts:
        if n > len(decomposed):
            raise ConfigError(
                f"tier_layers: {n} exceeds the {len(decomposed)} decompose_layers ({', '.join(decomposed)})"
            )
    return [[key for key in decomposed if key in largest[:n]] for n in counts]


def lambda_at(round_: jax.Array, lam: float, warmup_rounds: int) -> jax.Array:
    """``lambda_t`` of round ``round_`` (1-based): 0 in round 1 (no anchors yet), rising linearly to
    ``lam`` in round ``warmup_rounds`` (the paper: over the first 10 rounds), ``lam`` after; with
    ``warmup_rounds <= 1``, ``lam`` from round 2."""
    if warmup_rounds <= 1:
        return jnp.where(round_ > 1, lam, 0.0)
    return lam * jnp.clip((round_ - 1) / (warmup_rounds - 1), 0.0, 1.0)


def frobenius_penalty(fe_params, layers, weights=None) -> jax.Array:
    """``sum_q ||U_q V_q^T||_F^2`` over the decomposed layers ``q``: ``sum((U^T U) * (V^T V))``
    (:func:`~jaxfed.core.lowrank.product_norm_sq`) for a factorized layer, ``||W||_F^2`` for one
    its tier keeps at full rank (sent as its kernel); ``weights`` (one per layer, 0 or 1) picks
    the tier's ``Q_k`` out of ``layers``."""
    total = jnp.float32(0)
    for i, key in enumerate(layers):
        layer = lowrank.get_layer(fe_params, key)
        term = jnp.float32(0)  # a padded layer has both: a zero kernel or zero factors
        if "u" in layer:
            term = term + lowrank.product_norm_sq(*lowrank.layer_factors(layer))
        if "kernel" in layer:
            term = term + jnp.sum(jnp.square(layer["kernel"]))
        total = total + (term if weights is None else weights[i] * term)
    return total


def anchor_drift(features, anchors, anchor_loss: str) -> jax.Array:
    """Per example, the distance of its features from its class anchor under ``anchor_loss``."""
    if anchor_loss == "normalized":
        features, anchors = unit_length(features), unit_length(anchors)
    squared = jnp.sum((features - anchors) ** 2, axis=-1)
    return squared / features.shape[-1] if anchor_loss == "mean" else squared


def unit_length(x, eps: float = 1e-8):
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def anchored_loss(model, head: str, anchors, lam_t, mu_fro, anchor_loss="mean", decomposed=(), in_tier=None):
    """``loss(params, model_state, batch)`` of FedARA's local objective; ``params = {"fe", "head"}``."""

    def loss(params, model_state, batch: Batch):
        variables = {"params": lowrank.replace_layer(params["fe"], head, params["head"]), **model_state}
        (features, logits), new_state = head_input(
            model, head, variables, batch.x, train=True, mask=batch.mask, rng=batch.key
        )
        alignment = masked_mean(anchor_drift(features, anchors[batch.y], anchor_loss), batch.mask)
        value = masked_loss(logits, batch.y, batch.mask) + lam_t * alignment
        return value + mu_fro * frobenius_penalty(params["fe"], decomposed, in_tier), new_state

    return loss


def fedara(model, options: FedARAOptions | None = None, *, name: str = "fedara", **overrides) -> FederatedAlgorithm:
    """FedARA over ``len(options.tiers)`` client tiers."""
    options = resolve(FedARAOptions, options, overrides)
    template, _ = model_template(model)
    head = head_layer(model, options.head, "fedara")
    layers = list(split_keys(options.decompose_layers)) or default_decomposed_layers(model, head)
    decomposed = check_decomposed_layers(model, layers, head)
    per_tier = tier_layer_sets(template, decomposed, options.tier_layers, len(options.tiers))
    ranks = tier_ranks(template, per_tier, options.tiers)
    membership = jnp.asarray([[key in q for key in decomposed] for q in per_tier], jnp.float32)  # [tier, layer]

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        extractor, head_params = lowrank.pop_layer(params, head)
        return ServerState(extractor), ClientState(head_params, model_state)

    def broadcast(server_state, info):
        fe = lowrank.factorize_layers(server_state.fe, ranks[info.tier], options.factorization)
        return Broadcast(fe, server_state.fe if options.anchor_model == "global" else None)

    def sent_bytes_with_global_anchors(message, client_state, info):
        """``anchor_model=global``: the tier's FE and, of the global FE, the kernels the tier
        receives factorized; the rest of the global FE is the tier's FE itself, sent once."""
        kernels = [lowrank.get_layer(message.anchor_fe, key)["kernel"] for key in ranks[info.tier]]
        return tree_bytes(message.fe) + tree_bytes(kernels)

    union = lowrank.union_ranks(ranks)

    def pad_tier(message, info):
        return message._replace(fe=lowrank.pad_to_union(message.fe, union), in_tier=membership[info.tier])

    def client_update(message, client_state, data, rng, info):
        optimizer = options.optimizer(info.round)  # this round's learning rate
        fe, kernel_on = message.fe if isinstance(message.fe, lowrank.Padded) else (message.fe, None)
        anchor_fe = fe if message.anchor_fe is None else message.anchor_fe
        frozen = {"params": lowrank.replace_layer(anchor_fe, head, client_state.head), **client_state.model_state}
        with factorized_execution(kernel_on):
            anchors, _ = class_anchors(model, head, frozen, data, options.batch_size)
            lam_t = lambda_at(info.round + 1, options.lambda_, options.lambda_warmup_rounds)  # 1-based round
            # the client's tier's Q_k, for the Frobenius term
            in_tier = membership[info.tier] if message.in_tier is None else message.in_tier
            loss = anchored_loss(model, head, anchors, lam_t, options.mu_fro, options.anchor_loss, decomposed, in_tier)
            trainable = {"fe": fe, "head": client_state.head}
            trained, model_state, metrics = fit(
                loss, optimizer, trainable, client_state.model_state, data, rng, **options.batching()
            )
        return ClientState(trained["head"], model_state), trained["fe"], {**metrics, "lambda": lam_t}

    def eval_server(server_state, info):
        """The global FE truncated to the tier's rank (as the tier's clients run it), once per tier."""
        factors = lowrank.factorize_layers(server_state.fe, ranks[info.tier], options.factorization)
        truncated = lowrank.reconstruct_layers(factors)
        return server_state._replace(fe=truncated)

    def eval_params(server_view, client_state):
        return {
            "params": lowrank.replace_layer(server_view.fe, head, client_state.head),
            **client_state.model_state,
        }

    return FederatedAlgorithm(
        name=name,
        options=options,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        aggregation=averaging(lambda server_state, average, info: ServerState(average)),  # full kernels
        eval_params=eval_params,
        global_params=None,  # the heads are private: there is no global model
        num_tiers=len(ranks),
        receive=reconstruct_upload,
        pad_tier=pad_tier,
        eval_server=eval_server,
        sent_bytes=sent_bytes_with_global_anchors if options.anchor_model == "global" else None,
    )


builtin("fedara", FedARAOptions, lambda model, options, config: fedara(model, options))
