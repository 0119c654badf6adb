"""FedKD (Wu et al., Nature Communications 2022): a private mentor and a shared mentee learn from
each other; only the mentee's update travels, compressed by SVD to a share of its energy.

Every client keeps its mentor (the run's model; with ``model_tiers`` its tier's rank level, with
``tier_models`` its tier's model, as FedARA's other heterogeneous baselines) and a projection
``W_h`` (``[d, d]``, no bias) of the mentee's features onto the mentor's. The mentee is shared:
the run's model with FedARA's decomposed layers (every feature-extractor layer but the first) at
``mentee_ratio`` (1: the whole model). A round: the client takes the global mentee and trains
mentor, mentee and ``W_h`` together for ``local_epochs`` on the sum of the two models' losses

    L_t = CE_t + (KL(q_s || q_t) + L_h) / (CE_t + CE_s)     (the mentor's)
    L_s = CE_s + (KL(q_t || q_s) + L_h) / (CE_t + CE_s)     (the mentee's),  L_h = MSE(h_t, h_s W_h)

``q`` each model's softmax, ``h`` its features (the head's input), ``CE`` its cross-entropy on the
batch: the distillation weakens while the models still err (adaptive mutual distillation). It
uploads its mentee's update (trained minus received) compressed: each parameter of two or more
dimensions (a conv kernel matricized) keeps the fewest singular values holding a share ``T`` of its
squared norm (:func:`jaxfed.core.lowrank.energy_truncation`), ``T`` rising linearly from
``energy_start`` to ``energy_end`` over ``energy_rounds`` rounds (dynamic gradient approximation);
vectors travel whole. The server averages the round's updates, compresses the mean the same way
and adds it to the global mentee.

A client's personalized model is its mentor; the global model is the mentee. Bytes up count the
compressed factors (``k (rows + cols + 1)`` numbers a matrix, as the authors send ``U, sigma, V``);
bytes down the global mentee, or only the last compressed global update for a client that
received the mentee in the round before (a client that missed rounds is counted the whole mentee).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms.model_tiers import HTFLLIB, model_tiers_option, rank_levels, tier_models_option, with_model_tiers
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import fit
from jaxfed.contract import Aggregation, FederatedAlgorithm
from jaxfed.core import lowrank, mean_of, tree_bytes, weighted_share
from jaxfed.core.losses import kl_divergence, masked_loss, masked_mean
from jaxfed.errors import ConfigError
from jaxfed.nn import model_template, split_variables
from jaxfed.nn.factorized import factorized_execution
from jaxfed.nn.layers import head_input, head_layer
from jaxfed.options import TrainingOptions, at_least, non_negative, option, rank_ratio, ratio, resolve

PAPER = "Wu et al. (Nat. Commun. 2022), FedKD"
SENT_WHOLE = -1  # the rank recorded for a parameter that travels uncompressed (a vector)
NOT_HELD = -1  # a client's `held` before it first received the mentee
MIN_TASK_LOSS = 1e-12  # the floor of the distillation's divisor CE_t + CE_s


@dataclasses.dataclass(frozen=True)
class FedKDOptions(TrainingOptions):
    """FedKD's options: the mentee's size and the energy thresholds of its compressed updates."""

    tasks: typing.ClassVar[tuple[str, ...]] = ("classification",)  # distillation between softmaxes

    mentee_ratio: float = option(
        1.0,
        "the shared mentee: the model with every feature-extractor layer but the first at this rank ratio; "
        "1 = the whole model",
        source=HTFLLIB + " (the mentee is the model family's first model; FedARA's first tier is 1.0)",
        check=rank_ratio,
    )
    energy_start: float = option(
        0.95,
        "the energy threshold T starts from this (each compressed matrix keeps the fewest singular values "
        "holding a share T of its squared norm); in round r (1-based) T = energy_start + "
        "min(r / energy_rounds, 1) (energy_end - energy_start), as the authors' run.py",
        source=PAPER + " (T_start 0.95; HtFLlib -Ts 0.95)",
        check=ratio,
    )
    energy_end: float = option(
        0.98, "the energy threshold T from round energy_rounds on (at least energy_start)",
        source=PAPER + " (T_end 0.98; HtFLlib -Te 0.98)", check=ratio,
    )  # fmt: skip
    energy_rounds: int = option(
        100,
        "rounds over which T rises linearly from energy_start to energy_end (the authors: the run's rounds)",
        source=PAPER + " (T rises over the training's rounds; FedARA's runs: 100)",
        check=at_least(1),
    )
    head: str = option("", "the classifier head (a Dense layer's key) whose input is the feature; empty = the last")
    model_tiers: tuple[float, ...] = model_tiers_option()
    tier_models: tuple[str, ...] = tier_models_option()
    lr: float = option(0.01, "client learning rate (0 freezes the models)", source=HTFLLIB + " (-lr 0.01)",
                       check=non_negative)  # fmt: skip
    batch_size: int = option(10, "local batch size", source=HTFLLIB + " (-lbs 10)", check=at_least(1))
    local_epochs: int = option(1, "local epochs per round", source=HTFLLIB + " (-ls 1)", check=at_least(1))

    def check(self):
        super().check()
        if self.energy_end < self.energy_start:
            raise ConfigError(
                f"energy_end: {self.energy_end} is below energy_start {self.energy_start}; the threshold rises "
                "(set energy_end at least energy_start)"
            )


class ServerState(NamedTuple):
    """The server state and the message down."""

    mentee: Any  # the global mentee's parameters (its decomposed layers as factors u, v)
    update_bytes: jax.Array  # float32: the bytes of the last compressed global update


class ClientState(NamedTuple):
    params: Any  # the mentor: the client's own model
    model_state: Any  # the mentor's non-trainable collections (BatchNorm statistics), {} when none
    mentee_state: Any  # the mentee's, kept on the client
    projection: Any  # W_h [d, d]: the mentee's features onto the mentor's
    held: jax.Array  # int32: the round whose global mentee the client last received; NOT_HELD before


class Upload(NamedTuple):
    update: Any  # the mentee's update, compressed, in the mentee's shape
    ranks: Any  # per parameter: the singular values kept (int32); SENT_WHOLE for a vector


class Trainable(NamedTuple):
    mentor: Any
    mentee: Any
    projection: Any


def energy_threshold(options: FedKDOptions, round_) -> jax.Array:
    """``T`` of 0-based round ``round_``: ``T_start + min((round + 1) / energy_rounds, 1) (T_end - T_start)``."""
    progress = jnp.minimum((round_ + 1) / options.energy_rounds, 1.0)
    return options.energy_start + progress * (options.energy_end - options.energy_start)


def _matrix_shape(shape) -> tuple[int, int]:
    """A parameter's matrix: a conv kernel matricized, else its last axis against the others."""
    return lowrank.matrix_shape(shape) if len(shape) == 4 else (math.prod(shape[:-1]), shape[-1])


def _truncated(x: jax.Array, energy):
    if x.ndim < 2:
        return x, jnp.int32(SENT_WHOLE)
    matrix = lowrank.matricize(x) if x.ndim == 4 else x.reshape(_matrix_shape(x.shape))
    approx, rank = lowrank.energy_truncation(matrix, energy)
    return (lowrank.fold(approx, x.shape) if x.ndim == 4 else approx.reshape(x.shape)), rank


def compress(tree, energy) -> tuple[Any, Any]:
    """``(compressed, ranks)``: every parameter of two or more dimensions truncated to the
    singular values holding an ``energy`` share of its squared norm; vectors as they are."""
    leaves, structure = jax.tree.flatten(tree)
    parts = [_truncated(x, energy) for x in leaves]
    return structure.unflatten([p[0] for p in parts]), structure.unflatten([p[1] for p in parts])


def compressed_bytes(update, ranks) -> jax.Array:
    """The bytes a compressed tree takes: ``k (rows + cols + 1)`` numbers for a matrix kept at
    ``k`` singular values (``U_k``, ``sigma_k``, ``V_k``), every number of a vector."""
    total = jnp.float32(0.0)
    for x, rank in zip(jax.tree.leaves(update), jax.tree.leaves(ranks), strict=True):
        if x.ndim < 2:
            total += x.size * x.dtype.itemsize
        else:
            rows, cols = _matrix_shape(x.shape)
            total += rank.astype(jnp.float32) * (rows + cols + 1) * x.dtype.itemsize
    return total


def mutual_distillation(model, head: str):
    """``loss(trainable, states, batch)``: ``L_t + L_s`` (the module's docstring) of a
    :class:`Trainable` on a batch, and both models' new non-trainable collections."""

    def loss(trainable: Trainable, states, batch):
        (h_t, logits_t), mentor_state = head_input(
            model, head, {"params": trainable.mentor, **states["mentor"]}, batch.x,
            train=True, mask=batch.mask, rng=batch.key,
        )  # fmt: skip
        with factorized_execution():  # the mentee's decomposed layers run as their factors
            (h_s, logits_s), mentee_state = head_input(
                model, head, {"params": trainable.mentee, **states["mentee"]}, batch.x,
                train=True, mask=batch.mask, rng=jax.random.fold_in(batch.key, 1),
            )  # fmt: skip
        ce_t = masked_loss(logits_t, batch.y, batch.mask)
        ce_s = masked_loss(logits_s, batch.y, batch.mask)
        log_t, log_s = jax.nn.log_softmax(logits_t), jax.nn.log_softmax(logits_s)
        kl_both = masked_mean(kl_divergence(log_s, log_t) + kl_divergence(log_t, log_s), batch.mask)
        hidden = masked_mean(jnp.mean(jnp.square(h_t - h_s @ trainable.projection), axis=-1), batch.mask)
        # both models fitting the batch exactly (float32 cross-entropies of 0) would divide by 0
        total = ce_t + ce_s + (kl_both + 2.0 * hidden) / jnp.maximum(ce_t + ce_s, MIN_TASK_LOSS)
        return total, {"mentor": mentor_state, "mentee": mentee_state}

    return loss


def fedkd(model, options: FedKDOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedKD: private mentors and a shared mentee distil into each other; the mentee's updates travel SVD-compressed."""
    options = resolve(FedKDOptions, options, overrides)
    head = head_layer(model, options.head, "fedkd")
    template, private_stats = model_template(model)
    feature_dim = lowrank.get_layer(template, head)["kernel"].shape[0]
    mentee_ranks = (
        rank_levels(model, [options.mentee_ratio], head, "mentee_ratio")[0] if options.mentee_ratio < 1 else {}
    )
    loss = mutual_distillation(model, head)

    def init(rng):
        mentor_rng, mentee_rng, projection_rng = jax.random.split(rng, 3)
        params, model_state = split_variables(model.init(mentor_rng))
        mentee, mentee_state = split_variables(model.init(mentee_rng))
        projection = lowrank.kaiming_uniform(projection_rng, (feature_dim, feature_dim), feature_dim)  # torch's Linear
        server = ServerState(lowrank.factorize_layers(mentee, mentee_ranks), jnp.float32(0.0))
        return server, ClientState(params, model_state, mentee_state, projection, jnp.int32(NOT_HELD))

    def client_update(message: ServerState, client: ClientState, data, rng, info):
        trainable = Trainable(client.params, message.mentee, client.projection)
        states = {"mentor": client.model_state, "mentee": client.mentee_state}
        trained, states, metrics = fit(
            loss, options.optimizer(info.round), trainable, states, data, rng, **options.batching()
        )
        update = jax.tree.map(jnp.subtract, trained.mentee, message.mentee)
        update, ranks_kept = compress(update, energy_threshold(options, info.round))
        held = jnp.asarray(info.round, jnp.int32)
        client = ClientState(trained.mentor, states["mentor"], states["mentee"], trained.projection, held)
        return client, Upload(update, ranks_kept), metrics

    def contribute(server_state, upload: Upload, weight, info):
        return weighted_share(upload.update, 1.0)  # the plain mean of the round's updates, as the authors'

    def apply(server_state: ServerState, total, info):
        update, ranks_kept = compress(mean_of(total), energy_threshold(options, info.round))
        mentee = jax.tree.map(jnp.add, server_state.mentee, update)
        return ServerState(mentee, compressed_bytes(update, ranks_kept))

    def sent_bytes(message: ServerState, client: ClientState, info):
        return jnp.float32(tree_bytes(message.mentee))  # update_bytes is the simulation's bookkeeping

    def download_bytes(message: ServerState, client: ClientState, info):
        had_last = (client.held != NOT_HELD) & (client.held == info.round - 1)
        return jnp.where(had_last, message.update_bytes, sent_bytes(message, client, info))

    def global_params(server_state: ServerState):
        return {"params": lowrank.reconstruct_layers(server_state.mentee)}

    algorithm = FederatedAlgorithm(
        name="fedkd",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state,
        client_update=client_update,
        aggregation=Aggregation(contribute, apply),
        eval_params=lambda server_state, client: {"params": client.params, **client.model_state},
        global_params=None if private_stats else global_params,  # the mentee has no global statistics
        message_bytes=lambda upload: compressed_bytes(upload.update, upload.ranks),
        sent_bytes=sent_bytes,
        download_bytes=download_bytes,
    )
    # the projection W_h and L_h span the run's features: a mentor with fewer would be fit on padding
    return with_model_tiers(algorithm, model, options, head, same_features=True)


builtin("fedkd", FedKDOptions, lambda model, options, config: fedkd(model, options))
