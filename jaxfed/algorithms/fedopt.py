"""The server optimizer FedAvg, FedProx and the FedLoRU family share: the pseudo-gradient
``w - mean_k w_k`` (the server's parameters minus the clients' average) stepped by SGD (with
momentum) or by FedOpt's adaptive rules FedAdam / FedAdagrad / FedYogi (Reddi et al., ICLR 2021,
Algorithm 2); ``none`` takes the average as it is (= SGD at lr 1)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxfed.options import TrainingOptions, momentum_coefficient, one_of, option, positive

SERVER_OPTIMIZERS = ("none", "sgd", "adam", "adagrad", "yogi")
FEDOPT = "Reddi et al., ICLR 2021 (FedOpt)"


@dataclasses.dataclass(frozen=True)
class ServerOptimizerOptions(TrainingOptions):
    """Client training plus the server optimizer of the clients' average."""

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


def step_toward_average(optimizer: optax.GradientTransformation | None, params, average, opt_state):
    """``(new parameters, new optimizer state)``: ``average`` itself without an optimizer, else
    ``params`` stepped by ``optimizer`` on the pseudo-gradient ``params - average``."""
    if optimizer is None:
        return average, opt_state
    pseudo_grad = jax.tree.map(jnp.subtract, params, average)
    updates, opt_state = optimizer.update(pseudo_grad, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
