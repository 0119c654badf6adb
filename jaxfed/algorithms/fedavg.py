"""FedAvg (McMahan et al., 2017), with an optional optax server optimizer (as fedjax does).

Clients start from the global parameters, run E epochs of SGD on cross-entropy, and upload
their parameters; the server averages them weighted by sample count. With a server optimizer
the averaged change ``w - mean_k w_k`` is its pseudo-gradient; without one the new global
model is the plain average (= server SGD with lr 1). BatchNorm statistics, when the model has
them, stay with each client.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxfed.algorithms.base import FederatedAlgorithm
from jaxfed.algorithms.training import client_optimizer, local_training_options, split_variables, train_classifier
from jaxfed.core import tree_select, weighted_mean


def fedavg(
    model,
    optimizer: optax.GradientTransformation,
    *,
    local_epochs: int,
    batch_size: int,
    drop_last: bool = False,
    server_optimizer: optax.GradientTransformation | None = None,
    regularizer: Callable | None = None,
    name: str = "fedavg",
) -> FederatedAlgorithm:
    """FedAvg. ``regularizer(params, global_params)`` adds a local loss term (FedProx uses it)."""

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        opt_state = server_optimizer.init(params) if server_optimizer else ()
        return {"params": params, "opt_state": opt_state}, {"model_state": model_state}

    def broadcast(server_state, tier=0):
        return server_state["params"]

    def client_update(global_params, client_state, data, rng):
        local_term = None if regularizer is None else (lambda p: regularizer(p, global_params))
        variables, metrics = train_classifier(
            model,
            optimizer,
            {"params": global_params, **client_state["model_state"]},
            data,
            rng,
            epochs=local_epochs,
            batch_size=batch_size,
            drop_last=drop_last,
            regularizer=local_term,
        )
        params, model_state = split_variables(variables)
        return {"model_state": model_state}, params, metrics

    def server_update(server_state, messages, weights):
        params = server_state["params"]
        average = weighted_mean(messages, weights)
        if server_optimizer is None:
            new_params, opt_state = average, server_state["opt_state"]
        else:
            pseudo_grad = jax.tree.map(jnp.subtract, params, average)
            updates, opt_state = server_optimizer.update(pseudo_grad, server_state["opt_state"], params)
            new_params = optax.apply_updates(params, updates)
        received = jnp.sum(weights) > 0
        return {
            "params": tree_select(received, new_params, params),
            "opt_state": tree_select(received, opt_state, server_state["opt_state"]),
        }

    def eval_params(server_state, client_state):
        return {"params": server_state["params"], **client_state["model_state"]}

    def global_params(server_state):
        return {"params": server_state["params"]}

    has_private_stats = bool(split_variables(jax.eval_shape(model.init, jax.random.key(0)))[1])
    return FederatedAlgorithm(
        name=name,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        server_update=server_update,
        eval_params=eval_params,
        # A model with BatchNorm has no global statistics: its global model is undefined.
        global_params=None if has_private_stats else global_params,
        evaluates_global=not has_private_stats,
    )


SERVER_OPTIMIZERS = ("none", "sgd", "adam")


def server_optimizer_from_config(config) -> optax.GradientTransformation | None:
    if config.server_optimizer == "none":
        return None
    if config.server_optimizer == "sgd":
        return optax.sgd(config.server_lr, momentum=config.server_momentum or None)
    return optax.adam(config.server_lr)


def from_config(config, model) -> FederatedAlgorithm:
    return fedavg(
        model,
        client_optimizer(config),
        **local_training_options(config),
        server_optimizer=server_optimizer_from_config(config),
    )
