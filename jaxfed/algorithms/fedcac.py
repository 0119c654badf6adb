"""FedCAC (Wu et al., ICCV 2023, "Bold but Cautious"): critical parameters shared only among
clients whose critical parameters sit in similar places.

A round, as the authors' code runs it (Fling: ``fedcac_client.py``, ``fedcac_group.py``):

1. client k starts from its synced model: its critical parameters from its customized global
   model, the others from the global model (before its first round: the global model);
2. it trains for its local epochs from there (``theta_0``) to ``theta``, and marks its critical
   parameters: in each parameter tensor, those whose sensitivity ``|(theta - theta_0) * theta|``
   is at least the ``floor(tau * n)``-th largest (ties included; where that value is at most
   1e-10, at least the smallest above 1e-20);
3. it uploads ``theta`` and its critical mask ``m_k``;
4. the server: the global model is the sample-weighted mean of the uploads; the overlap of
   clients i and j is ``o_ij = 1 - |m_i - m_j|_1 / (2 |m_i|_1)``; with ``t`` the 0-based round,
   the threshold is ``mean o + (t + 1) / beta * (max o - mean o)`` over the round's pairs i != j,
   so collaboration narrows over ``beta`` rounds; client i's customized model is the plain
   (unweighted) mean of its own upload and those of every j with ``o_ij >= threshold``.

A client's personalized model is its synced model. BatchNorm statistics stay on the client (the
authors sync parameters only). The server keeps a customized model per client (a table of every
client's rows) and, knowing each client's uploaded critical mask (here the client's state keeps
that same mask), sends each client one model, its synced one (``sent_bytes``); a critical mask
travels up as bits (``message_bytes``).

Where clients do not all take part (the paper's clients all do), the round's uploads make the
overlaps, the threshold, the customized models and the global model (as PFLlib runs FedCAC); a
client keeps the customized model of the last round it took part in. A client that never
uploaded (a new client after its local update) has no customized model: its critical parameters
are its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms.client_rows import one_row_sent, own_row, with_id, with_rows
from jaxfed.algorithms.records import global_model
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import train_parameters
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core import stack_clients, tree_bytes, tree_select, weighted_mean
from jaxfed.nn import model_template, split_variables
from jaxfed.options import DatasetDefaults, TrainingOptions, at_least, option, ratio, resolve

CODE = "the authors' code (Fling, flzoo/cifar10/cifar10_fedcac_resnet_config.py: tau 0.5, beta 100 on CIFAR-10)"


@dataclasses.dataclass(frozen=True)
class FedCACOptions(TrainingOptions):
    """FedCAC's options: the critical share of each tensor and the collaboration's narrowing."""

    dataset_defaults = {
        "cifar100": DatasetDefaults(
            {"tau": 0.4, "beta": 170}, "the authors' code (Fling, flzoo/cifar100/cifar100_fedcac_resnet_config.py)"
        )
    }

    tau: float = option(
        0.5,
        "share of each parameter tensor a client marks critical (the largest |(theta - theta_0) * theta|)",
        source=CODE,
        check=ratio,
    )
    beta: int = option(
        100,
        "rounds over which the collaboration threshold rises from the mean overlap to the largest "
        "((t + 1) / beta of the way in round t)",
        source=CODE,
        check=at_least(1),
    )


class ServerState(NamedTuple):
    params: Any  # the global model: the sample-weighted mean of the last round's uploads
    customized: Any  # every client's customized global model, stacked [num_clients, ...]
    has_row: jax.Array  # [num_clients] bool: the client has uploaded (its customized model is set)


class ClientState(NamedTuple):
    id: jax.Array  # int32 scalar: the client's id (it tells the server which row is its own)
    params: Any  # its model after its last local training (the initialization before)
    critical: Any  # bool, like params: its critical parameters (none before its first round)
    model_state: Any  # the model's non-trainable collections (BatchNorm statistics), {} when none


class Upload(NamedTuple):
    params: Any  # the trained model
    critical: Any  # its critical mask
    id: jax.Array  # int32 scalar: who sent it


def kth_largest(values, k: int):
    """The ``k``-th largest of non-negative floats, exactly: the bits of its float pattern found
    from the highest down, each kept where at least ``k`` values reach it (a radix select: one
    count per bit instead of a sort, which XLA runs many times slower on large tensors)."""
    bits = jnp.finfo(values.dtype).bits
    patterns = jax.lax.bitcast_convert_type(values, jnp.dtype(f"int{bits}"))  # ordered as the values are
    zero = jnp.zeros((), patterns.dtype)

    def keep_bit(bit, found):
        candidate = found | (jnp.ones((), patterns.dtype) << (bits - 2 - bit))
        return jnp.where(jnp.sum(patterns >= candidate) >= k, candidate, found)

    found = jax.lax.fori_loop(0, bits - 1, keep_bit, zero)  # the sign bit stays 0
    return jax.lax.bitcast_convert_type(found, values.dtype)


def critical_mask(before, after, tau: float):
    """One tensor's critical mask: the places whose sensitivity ``|(after - before) * after|`` is
    at least the ``floor(tau * n)``-th largest (where that is at most 1e-10: at least the
    smallest sensitivity above 1e-20, where there is one)."""
    sensitivity = jnp.abs((after - before) * after).ravel()
    top = int(tau * sensitivity.size)
    if top == 0:
        return jnp.zeros(after.shape, bool)
    threshold = kth_largest(sensitivity, top)
    smallest_positive = jnp.min(jnp.where(sensitivity > 1e-20, sensitivity, jnp.inf))
    threshold = jnp.where((threshold <= 1e-10) & jnp.isfinite(smallest_positive), smallest_positive, threshold)
    return (sensitivity >= threshold).reshape(after.shape)


def overlaps(critical) -> jax.Array:
    """``[rows, rows]``: ``o_ij = 1 - |m_i - m_j|_1 / (2 |m_i|_1)`` of stacked critical masks
    (counted exactly, in integers)."""
    flat = [m.reshape(m.shape[0], -1).astype(jnp.int32) for m in jax.tree.leaves(critical)]
    counts = sum(jnp.sum(f, axis=1) for f in flat)
    shared = sum(jnp.matmul(f, f.T, preferred_element_type=jnp.int32) for f in flat)
    differing = counts[:, None] + counts[None, :] - 2 * shared
    return 1.0 - differing.astype(jnp.float32) / (2.0 * jnp.maximum(counts, 1)[:, None].astype(jnp.float32))


def collaborators(overlap, present, round_, beta: int) -> jax.Array:
    """``[rows, rows]`` bool: row i's collaborators, itself and every other present j with
    ``o_ij >= mean o + (round_ + 1) / beta * (max o - mean o)`` over the present pairs."""
    rows = overlap.shape[0]
    itself = jnp.eye(rows, dtype=bool)
    pairs = present[:, None] & present[None, :] & ~itself
    mean = jnp.sum(jnp.where(pairs, overlap, 0.0)) / jnp.maximum(jnp.sum(pairs), 1)
    largest = jnp.max(jnp.where(pairs, overlap, -jnp.inf))
    threshold = mean + (round_ + 1) / beta * (largest - mean)
    return (pairs & (overlap >= threshold)) | (itself & present[:, None])


def synced(server_state: ServerState, client_state: ClientState):
    """The model a client trains from and is evaluated with: its critical parameters from its
    customized global model (its own where it has none), the others from the global model."""
    known = own_row(server_state.has_row, client_state.id)
    own = tree_select(known, own_row(server_state.customized, client_state.id), client_state.params)
    return jax.tree.map(jnp.where, client_state.critical, own, server_state.params)


def fedcac(model, options: FedCACOptions | None = None, *, num_clients: int, **overrides) -> FederatedAlgorithm:
    """FedCAC: critical parameters averaged among clients of similar critical places, the rest by all."""
    options = resolve(FedCACOptions, options, overrides)
    template, _ = model_template(model)

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        none_critical = jax.tree.map(lambda p: jnp.zeros(p.shape, bool), params)
        server = ServerState(params, stack_clients(params, num_clients), jnp.zeros(num_clients, bool))
        return server, ClientState(jnp.int32(0), params, none_critical, model_state)

    def client_update(server_state, client_state, data, rng, info):
        start = synced(server_state, client_state)
        params, model_state, metrics = train_parameters(
            model, options.optimizer(info.round), start, client_state.model_state, data, rng, **options.batching()
        )
        critical = jax.tree.map(lambda b, a: critical_mask(b, a, options.tau), start, params)
        masks = jax.tree.leaves(critical)
        critical_share = sum(jnp.sum(m) for m in masks) / sum(m.size for m in masks)
        new_state = ClientState(client_state.id, params, critical, model_state)
        return new_state, Upload(params, critical, client_state.id), {**metrics, "critical_share": critical_share}

    def server_update(server_state, uploads: Upload, weights, info):
        present = weights > 0
        together = collaborators(overlaps(uploads.critical), present, info.round, options.beta)
        share = together.astype(jnp.float32) / jnp.maximum(jnp.sum(together, axis=1, keepdims=True), 1)
        customized = jax.tree.map(lambda leaf: jnp.tensordot(share, leaf, axes=(1, 0)), uploads.params)
        return ServerState(
            weighted_mean(uploads.params, weights),
            with_rows(server_state.customized, uploads.id, customized, weights),
            with_rows(server_state.has_row, uploads.id, present, weights),
        )

    def message_bytes(upload: Upload):
        bits = sum(math.ceil(m.size / 8) for m in jax.tree.leaves(upload.critical))
        return jnp.float32(tree_bytes(upload.params) + bits + tree_bytes(upload.id))

    return FederatedAlgorithm(
        name="fedcac",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state,
        client_update=client_update,
        server_update=server_update,
        eval_params=lambda server_state, client_state: {
            "params": synced(server_state, client_state),
            **client_state.model_state,
        },
        global_params=global_model(model),
        message_bytes=message_bytes,
        sent_bytes=one_row_sent(template),
        init_client=with_id,
    )


builtin("fedcac", FedCACOptions, lambda model, options, config: fedcac(model, options, num_clients=config.num_clients))
