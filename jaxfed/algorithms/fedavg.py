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

from jaxfed.algorithms.aggregation import averaging
from jaxfed.algorithms.fedopt import ServerOptimizerOptions, step_toward_average
from jaxfed.algorithms.records import ClientStats
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import train_classifier
from jaxfed.contract import FederatedAlgorithm
from jaxfed.nn import model_template, split_variables
from jaxfed.options import resolve


@dataclasses.dataclass(frozen=True)
class FedAvgOptions(ServerOptimizerOptions):
    """FedAvg's options: client SGD and an optional server optimizer."""


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
        return ServerState(*step_toward_average(server_optimizer, server_state.params, average, server_state.opt_state))

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
