"""FedProx (Li et al., 2020): FedAvg plus ``mu/2 ||w - w_global||^2`` in each client's loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfed.algorithms import fedavg as fedavg_module
from jaxfed.algorithms.training import client_optimizer, local_training_options


def proximal_term(mu: float):
    """``regularizer(params, global_params) = mu/2 * ||params - global_params||^2``."""

    def regularizer(params, global_params):
        diffs = jax.tree.map(lambda p, g: jnp.sum(jnp.square(p - jax.lax.stop_gradient(g))), params, global_params)
        return 0.5 * mu * sum(jax.tree.leaves(diffs))

    return regularizer


def fedprox(model, optimizer, *, mu: float = 0.01, **fedavg_kwargs):
    return fedavg_module.fedavg(model, optimizer, regularizer=proximal_term(mu), name="fedprox", **fedavg_kwargs)


def from_config(config, model):
    return fedprox(
        model,
        client_optimizer(config),
        **local_training_options(config),
        mu=config.mu,
        server_optimizer=fedavg_module.server_optimizer_from_config(config),
    )
