"""FedCSPACK (Yang et al.): cosine-guided sparse parameter packs with double-weight aggregation.

The model's parameters are seen as packs of ``pack_size`` values (:mod:`jaxfed.core.packs`).
The server holds the global model and a global mask ``M`` (one weight per pack) and broadcasts
both. A client merges (``merge="masked"``, the paper: packs the mask flags take the global
values, the others keep the client's own; ``merge="full"``, the authors' code: the whole global
model), trains ``local_epochs``, then scores its raw weights against the global ones: the
whole-model cosine ``theta_a`` is the threshold, a pack is a candidate when its cosine
``theta_j < theta_a``, and ``select="top_k"`` shares the ``K = ceil(share_ratio * packs)``
candidates of lowest cosine (``select="all_below"``, the authors' code: every candidate). A
selected pack's double weight is ``|theta_j + beta_j|`` with ``beta_j = KL(softmax(global_j) ||
softmax(local_j))`` (``weight="cos"`` / ``"kl"``: one term). The client uploads only the selected
packs' deltas, their indices and weights; the server moves each pack to the weight-averaged
senders' pack (packs nobody sent stay) and the new mask is the sum of the weights.

The message has a static number of slots (``K``, or every pack for ``all_below``) and a
``sent`` flag per slot; ``bytes_up`` counts only the sent slots (values, index, weight).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import train_parameters
from jaxfed.contract import Aggregation, FederatedAlgorithm
from jaxfed.core import packs as pk
from jaxfed.errors import ConfigError
from jaxfed.nn import model_template, split_variables
from jaxfed.options import CLIENT_OPTIMIZER_HELP, TrainingOptions, at_least, one_of, option, ratio, resolve

MERGES = ("masked", "full")
SELECTIONS = ("top_k", "all_below")
INDEX_BYTES = WEIGHT_BYTES = 4
PAPER = "FedCSPACK paper §5.1"
CODE = "the authors' code (NigeloYang/FedCSPACK)"


@dataclasses.dataclass(frozen=True)
class FedCSPACKOptions(TrainingOptions):
    """FedCSPACK's options: packs, their selection, weighting and merge."""

    local_epochs: int = option(5, "local epochs per round (the authors' code: 3)", source=PAPER)
    batch_size: int = option(16, "local batch size", source=PAPER)
    lr: float = option(0.05, "client learning rate", source=PAPER)
    client_optimizer: str = option(
        "sgd",
        CLIENT_OPTIMIZER_HELP,
        source="FedCSPACK paper, Loss & Training ('an SGD optimizer is used for local model updates')",
    )
    pack_size: int = option(
        1024, "parameters per pack (the flattened model is zero-padded to packs)", source=PAPER, check=at_least(1)
    )
    share_ratio: float = option(
        0.1, "top_k shares K = ceil(share_ratio * packs) packs, in (0, 1]", source=PAPER, check=ratio
    )
    select: str = option(
        "top_k",
        "top_k (the K lowest-cosine candidates) or all_below (every pack below the cosine threshold: " + CODE + ")",
        source="FedCSPACK paper §4.2",
        check=one_of(*SELECTIONS),
    )
    weight: str = option(
        "cos_kl",
        "pack weight |cos + KL| (cos_kl), |cos| (cos) or |KL| (kl)",
        source="FedCSPACK paper Eq. 8",
        check=one_of(*pk.WEIGHTS),
    )
    merge: str = option(
        "masked",
        "masked (global packs where the global mask is set, the others local) or full (" + CODE + ")",
        source="FedCSPACK paper §4.3",
        check=one_of(*MERGES),
    )


class ServerState(NamedTuple):
    params: Any  # the global model
    mask: jax.Array  # [packs]: the global mask M, the summed weights of the last round's senders
    updated: jax.Array  # [packs] int32: 1 + the index of the last round that moved each pack (0: never)


class ClientState(NamedTuple):
    params: Any  # the client's own model (its unshared packs are personal)
    model_state: Any  # non-trainable collections (BatchNorm statistics), {} when none
    last_seen: jax.Array  # int32: the index of the last round it participated in (-1: never)


class Upload(NamedTuple):
    """The selected packs, in ``slots`` static slots: only the ``sent`` ones are really sent."""

    indices: jax.Array  # [slots] pack indices
    sent: jax.Array  # [slots] bool
    deltas: jax.Array  # [slots, pack_size] local minus global pack
    weights: jax.Array  # [slots] double weights m_kj


def packs_to_take(updated, last_seen):
    """``[packs]`` bool: the packs a client takes from the global model under ``merge="masked"``:
    every pack the server moved since the client last participated (all of them at its first
    participation). For a client sampled every round these are the packs of the last round's mask
    M, the paper's rule; a client sampled rarely also gets the packs of the masks it missed."""
    return (last_seen < 0) | (updated > last_seen)


def merge_packs(local_packs, global_packs, take, merge: str = "masked"):
    """The client's starting packs: global where ``take`` (``masked``) or everywhere (``full``)."""
    if merge == "full":
        return global_packs
    return jnp.where(take[:, None], global_packs, local_packs)


def score_and_select(local_packs, global_packs, slots: int, weight: str = "cos_kl"):
    """``(indices, sent, weights)`` of the packs a client shares, ``slots`` of them (static)."""
    threshold = pk.cosine(local_packs.reshape(-1), global_packs.reshape(-1))
    theta = pk.pack_cosine(local_packs, global_packs)
    indices, sent = pk.select_packs(theta, threshold, slots)
    beta = pk.pack_kl(local_packs, global_packs)
    weights = jnp.where(sent, pk.pack_weights(theta[indices], beta[indices], weight), 0.0)
    return indices, sent, weights


def fedcspack(model, options: FedCSPACKOptions | None = None, *, name: str = "fedcspack", **overrides):
    options = resolve(FedCSPACKOptions, options, overrides)
    pack_size, share_ratio, select, weight, merge = (
        options.pack_size,
        options.share_ratio,
        options.select,
        options.weight,
        options.merge,
    )
    template, private_stats = model_template(model)
    view = pk.pack_view(template, pack_size)
    if view.num_packs < 2:  # a single pack's cosine is the whole model's threshold: never below it
        raise ConfigError(
            f"pack_size: {pack_size} makes one pack of the model's {view.size} parameters, which is never "
            f"below the whole-model cosine and so never sent; at most {view.size // 2} (two packs or more)"
        )
    top_k = pk.num_selected(view.num_packs, share_ratio)
    slots = top_k if select == "top_k" else view.num_packs
    pack_bytes = pack_size * jnp.dtype(jnp.float32).itemsize + INDEX_BYTES + WEIGHT_BYTES

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        packs = view.num_packs
        server = ServerState(params, jnp.ones((packs,), jnp.float32), jnp.zeros((packs,), jnp.int32))
        return server, ClientState(params, model_state, jnp.int32(-1))

    def personalized_params(server_state, client_state):
        """The client's model after receiving the global model: see :func:`packs_to_take`."""
        take = packs_to_take(server_state.updated, client_state.last_seen)
        merged = merge_packs(view.to_packs(client_state.params), view.to_packs(server_state.params), take, merge)
        return view.to_tree(merged)

    def client_update(message, client_state, data, rng, info):
        optimizer = options.optimizer(info.round)  # this round's learning rate
        start = personalized_params(message, client_state)
        params, model_state, metrics = train_parameters(
            model,
            optimizer,
            start,
            client_state.model_state,
            data,
            rng,
            **options.batching(),
        )
        local_packs, global_packs = view.to_packs(params), view.to_packs(message.params)
        indices, sent, weights = score_and_select(local_packs, global_packs, slots, weight)
        deltas = jnp.where(sent[:, None], local_packs[indices] - global_packs[indices], 0.0)
        upload = Upload(indices, sent, deltas, weights)
        metrics = {**metrics, "packs_sent": jnp.sum(sent).astype(jnp.float32)}
        return ClientState(params, model_state, info.round), upload, metrics

    def contribute(server_state, message, weight, info):
        pack_weights = jnp.where(message.sent, message.weights, 0.0)
        return pk.pack_share(view.to_packs(server_state.params), message.indices, message.deltas, pack_weights)

    def apply(server_state, total, info):
        new_packs = pk.aggregated_packs(view.to_packs(server_state.params), total)
        mask = total.weight  # M_j
        updated = jnp.where(mask > 0, info.round + 1, server_state.updated)  # > the last_seen of this round
        return ServerState(view.to_tree(new_packs), mask, updated)

    def eval_params(server_state, client_state):
        return {"params": personalized_params(server_state, client_state), **client_state.model_state}

    def global_params(server_state):
        return {"params": server_state.params}

    def message_bytes(message):
        return jnp.sum(message.sent) * pack_bytes

    return FederatedAlgorithm(
        name=name,
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state,
        client_update=client_update,
        aggregation=Aggregation(contribute, apply),
        eval_params=eval_params,
        global_params=None if private_stats else global_params,
        message_bytes=message_bytes,
    )


builtin("fedcspack", FedCSPACKOptions, lambda model, options, config: fedcspack(model, options))
