"""FedAvg (McMahan et al., 2017), with an optional server optimizer: SGD, or the adaptive FedOpt
family FedAdam / FedAdagrad / FedYogi (Reddi et al., ICLR 2021).

Clients start from the global parameters, run E epochs of SGD on cross-entropy, and upload
their parameters; the server averages them weighted by sample count. With a server optimizer
the averaged change ``w - mean_k w_k`` is its pseudo-gradient; without one the new global
model is the plain average (= server SGD with lr 1). BatchNorm statistics, when the model has
them, stay with each client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxfed.algorithms.aggregation import averaging
from jaxfed.algorithms.records import ClientStats
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import train_classifier
from jaxfed.contract import FederatedAlgorithm
from jaxfed.nn import model_template, split_variables
from jaxfed.options import TrainingOptions, momentum_coefficient, one_of, option, positive, resolve

SERVER_OPTIMIZERS = ("none", "sgd", "adam", "adagrad", "yogi")
FEDOPT = "Reddi et al., ICLR 2021 (FedOpt)"
BASELINE = "jaxfed baseline default (kept from earlier releases: docs/results.md's digits table)"


@dataclasses.dataclass(frozen=True)
class FedAvgOptions(TrainingOptions):
    """FedAvg's options: client SGD and an optional server optimizer."""

    server_optimizer: str = option(
        "none",
        "server optimizer on the averaged change: none (plain average), sgd, or FedOpt's adam, adagrad or yogi "
        "(FedAdam / FedAdagrad / FedYogi: Reddi et al.'s Algorithm 2 as written, without bias correction)",
        source="fedjax's FedAvg; adam, adagrad, yogi: " + FEDOPT,
        check=one_of(*SERVER_OPTIMIZERS),
    )
    server_lr: float = option(
        1.0,
        "server optimizer learning rate (adam, adagrad, yogi: about 0.01-0.1; adam's and yogi's first step moves "
        "every coordinate by about server_lr, adagrad's by (1 - server_b1) server_lr)",
        source="fedjax's FedAvg",
        check=positive,
    )
    server_momentum: float = option(
        0.0, "server SGD momentum, in [0, 1)", source="fedjax's FedAvg", check=momentum_coefficient
    )
    server_b1: float = option(
        0.9, "adam, adagrad, yogi: first-moment decay beta_1, in [0, 1)", source=FEDOPT, check=momentum_coefficient
    )
    server_b2: float = option(
        0.99, "adam, yogi: second-moment decay beta_2, in [0, 1)", source=FEDOPT, check=momentum_coefficient
    )
    server_eps: float = option(
        1e-3,
        "adam, adagrad, yogi: the degree of adaptivity tau (the step is m / (sqrt(v) + tau), v starts at tau^2)",
        source=FEDOPT + "'s grid of tau, 1e-5..1e-1",
        check=positive,
    )

    def server(self) -> optax.GradientTransformation | None:
        """The server's optimizer of the pseudo-gradient ``w - mean_k w_k`` (None: the plain average)."""
        if self.server_optimizer == "none":
            return None
        if self.server_optimizer == "sgd":
            return optax.sgd(self.server_lr, momentum=self.server_momentum or None)
        return optax.chain(
            scale_by_fedopt(self.server_optimizer, self.server_b1, self.server_b2, self.server_eps),
            optax.scale_by_learning_rate(self.server_lr),
        )


class FedOptState(NamedTuple):
    m: Any  # the first moment of the pseudo-gradient
    v: Any  # the second moment (starts at tau^2)


def _second_moment(rule: str, b2, v, g):
    """Algorithm 2's three updates of ``v`` for the pseudo-gradient ``g`` (its square is the change's)."""
    if rule == "adagrad":
        return v + g * g
    if rule == "adam":
        return b2 * v + (1 - b2) * g * g
    return v - (1 - b2) * g * g * jnp.sign(v - g * g)  # yogi


def scale_by_fedopt(rule: str, b1, b2, eps) -> optax.GradientTransformation:
    """FedAdam, FedAdagrad and FedYogi's direction (Reddi et al. 2021, Algorithm 2) for ``rule``
    ``adam``, ``adagrad`` or ``yogi``: ``m <- b1 m + (1 - b1) g``, ``v`` by the rule, the step
    ``m / (sqrt(v) + eps)``, with ``m`` starting at 0 and ``v`` at ``eps**2``; no bias correction
    (optax's ``adam`` corrects it, and its ``adagrad`` has no momentum and ``eps`` inside the root).
    Scale by ``-lr`` after it (:func:`optax.scale_by_learning_rate`)."""

    def init(params):
        return FedOptState(
            m=jax.tree.map(jnp.zeros_like, params), v=jax.tree.map(lambda p: jnp.full_like(p, eps * eps), params)
        )

    def update(grads, state, params=None):
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.m, grads)
        v = jax.tree.map(lambda v, g: _second_moment(rule, b2, v, g), state.v, grads)
        return jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), m, v), FedOptState(m, v)

    return optax.GradientTransformation(init, update)


class ServerState(NamedTuple):
    params: Any  # the global model's parameters
    opt_state: Any  # the server optimizer's state (() without one)


def fedavg(
    model,
    options: FedAvgOptions | None = None,
    *,
    penalty: Callable | None = None,
    name: str = "fedavg",
    **overrides,
) -> FederatedAlgorithm:
    """FedAvg. ``penalty(params, global_params)`` adds a term to the local loss (FedProx uses it);
    ``overrides`` set :class:`FedAvgOptions` fields (``fedavg(model, lr=0.1)``)."""
    options = resolve(type(options) if options is not None else FedAvgOptions, options, overrides)
    server_optimizer = options.server()

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        opt_state = server_optimizer.init(params) if server_optimizer else ()
        return ServerState(params, opt_state), ClientStats(model_state)

    def broadcast(server_state, info):
        return server_state.params

    def client_update(global_params, client_state, data, rng, info):
        optimizer = options.optimizer(info.round)  # this round's learning rate
        regularizer = None if penalty is None else (lambda p: penalty(p, global_params))
        variables, metrics = train_classifier(
            model,
            optimizer,
            {"params": global_params, **client_state.model_state},
            data,
            rng,
            regularizer=regularizer,
            **options.batching(),
        )
        params, model_state = split_variables(variables)
        return ClientStats(model_state), params, metrics

    def finish(server_state, average, info):
        params = server_state.params
        if server_optimizer is None:
            return ServerState(average, server_state.opt_state)
        pseudo_grad = jax.tree.map(jnp.subtract, params, average)
        updates, opt_state = server_optimizer.update(pseudo_grad, server_state.opt_state, params)
        return ServerState(optax.apply_updates(params, updates), opt_state)

    def eval_params(server_state, client_state):
        return {"params": server_state.params, **client_state.model_state}

    def global_params(server_state):
        return {"params": server_state.params}

    has_private_stats = bool(model_template(model)[1])
    return FederatedAlgorithm(
        name=name,
        options=options,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        aggregation=averaging(finish),
        eval_params=eval_params,
        # A model with BatchNorm has no global statistics: its global model is undefined.
        global_params=None if has_private_stats else global_params,
        evaluates_global=not has_private_stats,
    )


builtin("fedavg", FedAvgOptions, lambda model, options, config: fedavg(model, options))
