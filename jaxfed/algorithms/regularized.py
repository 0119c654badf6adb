"""FedAvg with a local loss that looks at another model: MOON, FedNTD and pFedSD.

All keep FedAvg's server (the sample-weighted mean of the uploaded models); MOON and FedNTD also
its evaluation (the global model, with each client's BatchNorm statistics where the model has
them). The client adds a term computed from another model's outputs on the same batch, which is
frozen: the global model's (MOON, FedNTD) or its own previous local model's (MOON, pFedSD).

- **MOON** (Li et al., CVPR 2021): ``CE + mu * l_con`` with the model-contrastive loss
  ``l_con = -log( e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + e^{sim(z, z_prev)/tau}) )``,
  ``sim`` the cosine similarity, ``z`` the representation of the model being trained, ``z_glob``
  the global model's, ``z_prev`` the client's previous local model's (its client state, the
  initialization before its first round). The paper's ``z`` is a projection head's output; here
  it is the model's features (the classifier head's input), as PFLlib does: jaxfed's models have
  no projection head. The two frozen models run in inference mode, as the authors' ``eval()``
  copies do, with the BatchNorm statistics the client ended its last round with: the previous
  model's own; the global model has none of its own (jaxfed keeps statistics on the clients).
- **pFedSD** (Jin et al., IEEE TPDS 2022, "Personalized Edge Intelligence via Federated
  Self-Knowledge Distillation"): ``CE + lambda * tau^2 * KL(q_prev || q)`` with ``q`` the softmax
  at temperature ``tau`` of the logits, ``q_prev`` that of the client's previous local model (the
  model it trained in its last round; no term in its first round). A client's personalized model
  is its last trained local model (before aggregation), as the FedDecomp authors evaluate it. As
  their code (Fling, ``pfedsd_client.py``), the previous model's forward pass normalizes in train
  mode, as the model being trained does.
- **FedNTD** (Lee et al., NeurIPS 2022): ``CE + beta * KL(q_g || q_l)`` over the not-true classes:
  ``q`` the softmax at temperature ``tau`` of the logits with the true class's removed, ``q_g``
  the global model's, ``q_l`` the local model's. The frozen global model runs in inference mode
  (the authors' copy is taken after an evaluation left the model in ``eval()``) with the
  BatchNorm statistics the client held when the round began (theirs carries the server's
  averaged ones; jaxfed keeps statistics on the clients).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.algorithms.aggregation import model_averaging
from jaxfed.algorithms.records import ClientStats, GlobalParams, global_model
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import fit
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core.losses import kl_divergence, masked_loss, masked_mean
from jaxfed.nn import model_template, split_variables
from jaxfed.nn.layers import head_input, head_layer
from jaxfed.options import TrainingOptions, non_negative, option, positive, resolve

MOON = "Li et al. (CVPR 2021), MOON §4.1: mu 5 on CIFAR-10, tau 0.5"
FEDNTD = "Lee et al. (NeurIPS 2022), FedNTD §5: beta 1, tau 1"


def cosine(a, b, eps: float = 1e-8):
    """Row-wise cosine similarity of ``[batch, d]`` arrays."""
    return jnp.sum(a * b, -1) / jnp.maximum(jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1), eps)


def model_contrastive(z, z_global, z_previous, tau: float):
    """MOON's ``l_con`` per example: the positive pair ``(z, z_global)`` against the negative ``(z, z_previous)``."""
    logits = jnp.stack([cosine(z, z_global), cosine(z, z_previous)], -1) / tau
    return -jax.nn.log_softmax(logits, -1)[:, 0]


def not_true(logits, labels):
    """``[batch, classes - 1]``: each row's logits without its true class's, the others in order."""
    classes = logits.shape[-1]
    others = np.array([[c for c in range(classes) if c != y] for y in range(classes)], np.int32)
    return jnp.take_along_axis(logits, jnp.asarray(others)[labels], axis=-1)


def not_true_distillation(logits, global_logits, labels, tau: float):
    """FedNTD's ``KL(q_g || q_l)`` per example over the not-true classes at temperature ``tau``."""
    log_q_local = jax.nn.log_softmax(not_true(logits, labels) / tau, -1)
    log_q_global = jax.nn.log_softmax(not_true(global_logits, labels) / tau, -1)
    return kl_divergence(log_q_global, log_q_local)


PFEDSD = "the FedDecomp authors' pFedSD (Fling, flzoo/cifar10/cifar10_pfedsd_resnet_config.py: lamda 0.5, tau 3)"


class MoonClientState(NamedTuple):
    previous: Any  # the client's previous local model's parameters (the initialization at first)
    model_state: Any  # the model's non-trainable collections (BatchNorm statistics), {} when none


@dataclasses.dataclass(frozen=True)
class MoonOptions(TrainingOptions):
    """MOON's options: the contrastive term's weight and temperature."""

    mu: float = option(5.0, "weight mu of the model-contrastive loss", source=MOON, check=non_negative)
    tau: float = option(0.5, "temperature tau of the model-contrastive loss", source=MOON, check=positive)


@dataclasses.dataclass(frozen=True)
class FedNTDOptions(TrainingOptions):
    """FedNTD's options: the not-true distillation's weight and temperature."""

    tasks: typing.ClassVar[tuple[str, ...]] = ("classification",)  # the not-true classes

    beta: float = option(1.0, "weight beta of the not-true distillation", source=FEDNTD, check=non_negative)
    tau: float = option(
        1.0,
        "temperature tau of the not-true softmax",
        source=FEDNTD + " (the authors' code also multiplies the KL by tau^2: the same at tau 1)",
        check=positive,
    )


class PFedSDClientState(NamedTuple):
    previous: Any  # its last trained local model's parameters (its personalized model)
    has_previous: jax.Array  # bool scalar: it has trained (the distillation term is on)
    model_state: Any  # the model's non-trainable collections (BatchNorm statistics), {} when none


@dataclasses.dataclass(frozen=True)
class PFedSDOptions(TrainingOptions):
    """pFedSD's options: the self-distillation's weight and temperature."""

    tasks: typing.ClassVar[tuple[str, ...]] = ("classification",)  # distils softmax outputs

    lam: float = option(0.5, "weight lambda of the self-distillation (times tau^2)", source=PFEDSD, check=non_negative)
    tau: float = option(3.0, "temperature tau of the distilled softmax", source=PFEDSD, check=positive)


def self_distillation(logits, previous_logits, tau: float):
    """pFedSD's ``tau^2 KL(q_prev || q)`` per example, ``q`` the softmax at temperature ``tau``."""
    log_q = jax.nn.log_softmax(logits / tau, -1)
    log_q_previous = jax.nn.log_softmax(previous_logits / tau, -1)
    return tau**2 * kl_divergence(log_q_previous, log_q)


def with_global_model(model, options, *, name: str, loss_for, init_client, keep) -> FederatedAlgorithm:
    """FedAvg's server and evaluation around a client loss ``loss_for(global_params, client_state)
    -> loss(params, model_state, batch)``; ``init_client(params, model_state)`` is a client's first
    state and ``keep(trained_params, model_state)`` its state after a round."""
    has_private_stats = bool(model_template(model)[1])

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        return GlobalParams(params), init_client(params, model_state)

    def broadcast(server_state, info):
        return server_state.params

    def client_update(global_params, client_state, data, rng, info):
        loss = loss_for(global_params, client_state)
        params, model_state, metrics = fit(
            loss, options.optimizer(info.round), global_params, client_state.model_state, data, rng,
            **options.batching(),
        )  # fmt: skip
        return keep(params, model_state), params, metrics

    return FederatedAlgorithm(
        name=name,
        options=options,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        aggregation=model_averaging(),
        eval_params=lambda server_state, client_state: {"params": server_state.params, **client_state.model_state},
        global_params=global_model(model),
        evaluates_global=not has_private_stats,
    )


def moon(model, options: MoonOptions | None = None, **overrides) -> FederatedAlgorithm:
    """MOON: FedAvg plus a model-contrastive loss on the model's features."""
    options = resolve(MoonOptions, options, overrides)
    head = head_layer(model, algorithm="moon")

    def features(params, model_state, x):
        (z, _), _ = head_input(model, head, {"params": params, **model_state}, x, train=False)
        return jax.lax.stop_gradient(z)

    def loss_for(global_params, client_state):
        def loss(params, model_state, batch):
            variables = {"params": params, **model_state}
            (z, logits), new_state = head_input(
                model, head, variables, batch.x, train=True, mask=batch.mask, rng=batch.key
            )
            # the frozen models normalize with the statistics the client ended its last round with
            # (the previous model's own), not those this round's training is moving
            z_global = features(global_params, client_state.model_state, batch.x)
            z_previous = features(client_state.previous, client_state.model_state, batch.x)
            contrast = masked_mean(model_contrastive(z, z_global, z_previous, options.tau), batch.mask)
            return masked_loss(logits, batch.y, batch.mask) + options.mu * contrast, new_state

        return loss

    return with_global_model(model, options, name="moon", loss_for=loss_for, init_client=MoonClientState,
                             keep=MoonClientState)  # fmt: skip


def fedntd(model, options: FedNTDOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedNTD: FedAvg plus distillation of the global model's not-true-class outputs."""
    options = resolve(FedNTDOptions, options, overrides)

    def loss_for(global_params, client_state):
        def loss(params, model_state, batch):
            logits, new_state = model.apply(
                {"params": params, **model_state}, batch.x, train=True, mask=batch.mask, rng=batch.key
            )
            frozen = {"params": global_params, **client_state.model_state}  # the statistics the round began with
            global_logits, _ = model.apply(frozen, batch.x, train=False)
            ntd = not_true_distillation(logits, jax.lax.stop_gradient(global_logits), batch.y, options.tau)
            return masked_loss(logits, batch.y, batch.mask) + options.beta * masked_mean(ntd, batch.mask), new_state

        return loss

    return with_global_model(
        model, options, name="fedntd", loss_for=loss_for,
        init_client=lambda params, model_state: ClientStats(model_state),
        keep=lambda params, model_state: ClientStats(model_state),
    )  # fmt: skip


def pfedsd(model, options: PFedSDOptions | None = None, **overrides) -> FederatedAlgorithm:
    """pFedSD: FedAvg plus self-distillation from the client's previous local model."""
    options = resolve(PFedSDOptions, options, overrides)

    def loss_for(global_params, client_state):
        def loss(params, model_state, batch):
            logits, new_state = model.apply(
                {"params": params, **model_state}, batch.x, train=True, mask=batch.mask, rng=batch.key
            )
            previous_logits, _ = model.apply(
                {"params": client_state.previous, **model_state}, batch.x, train=True, mask=batch.mask,
                rng=jax.random.fold_in(batch.key, 1),
            )  # fmt: skip
            distilled = self_distillation(logits, jax.lax.stop_gradient(previous_logits), options.tau)
            term = jnp.where(client_state.has_previous, options.lam * masked_mean(distilled, batch.mask), 0.0)
            return masked_loss(logits, batch.y, batch.mask) + term, new_state

        return loss

    algorithm = with_global_model(
        model, options, name="pfedsd", loss_for=loss_for,
        init_client=lambda params, model_state: PFedSDClientState(params, jnp.bool_(False), model_state),
        keep=lambda params, model_state: PFedSDClientState(params, jnp.bool_(True), model_state),
    )  # fmt: skip
    return algorithm._replace(
        eval_params=lambda server_state, client_state: {"params": client_state.previous, **client_state.model_state},
        evaluates_global=False,
    )


builtin("moon", MoonOptions, lambda model, options, config: moon(model, options))
builtin("pfedsd", PFedSDOptions, lambda model, options, config: pfedsd(model, options))
builtin("fedntd", FedNTDOptions, lambda model, options, config: fedntd(model, options))
