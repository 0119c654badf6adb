"""Ditto (Li et al., ICML 2021): a global model trained FedAvg-style, and a personal model per client.

A round: the client trains a copy of the global model ``w`` on its data for ``local_epochs`` and
uploads it (the server averages the uploads by sample count, FedAvg's rule); then it trains its
own personal model ``v`` for ``personal_epochs`` on ``F_k(v) + lambda/2 ||v - w||^2``, ``w`` the
global model it received this round (Algorithm 1). ``v`` never leaves the client and is its
personalized model; every client's ``v`` starts at the global model's initialization.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

from jaxfed.algorithms.aggregation import model_averaging
from jaxfed.algorithms.fedprox import proximal_term
from jaxfed.algorithms.records import GlobalParams, global_model
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import train_parameters
from jaxfed.contract import FederatedAlgorithm
from jaxfed.nn import split_variables
from jaxfed.options import TrainingOptions, at_least, non_negative, option, resolve

PAPER = "Li et al. (ICML 2021), Ditto, Algorithm 1"


@dataclasses.dataclass(frozen=True)
class DittoOptions(TrainingOptions):
    """Ditto's options: the personal model's proximal coefficient and epochs."""

    lam: float = option(
        0.1,
        "lambda: the personal model's pull toward the global model, lambda/2 ||v - w||^2",
        source=PAPER + " (lambda tuned per dataset from {0.01, 0.1, 1, 2}; 0.1 here)",
        check=non_negative,
    )
    personal_epochs: int = option(
        -1, "epochs on the personal model each round; -1 = local_epochs", source=PAPER, check=at_least(-1)
    )

    def personal_batching(self) -> dict:
        epochs = self.local_epochs if self.personal_epochs == -1 else self.personal_epochs
        return {**self.batching(), "epochs": epochs}


class ClientState(NamedTuple):
    personal: Any  # the personal model's parameters v
    personal_state: Any  # its non-trainable collections (BatchNorm statistics), {} when none
    model_state: Any  # the global copy's non-trainable collections, kept between rounds as FedAvg does


def ditto(model, options: DittoOptions | None = None, **overrides) -> FederatedAlgorithm:
    """Ditto: FedAvg's global model plus a personal model pulled toward it."""
    options = resolve(DittoOptions, options, overrides)
    pull = proximal_term(options.lam)

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        return GlobalParams(params), ClientState(params, model_state, model_state)

    def broadcast(server_state, info):
        return server_state.params

    def client_update(global_params, client_state, data, rng, info):
        optimizer = options.optimizer(info.round)
        global_rng, personal_rng = jax.random.split(rng)
        local, model_state, metrics = train_parameters(
            model, optimizer, global_params, client_state.model_state, data, global_rng, **options.batching()
        )
        personal, personal_state, personal_metrics = train_parameters(
            model,
            optimizer,
            client_state.personal,
            client_state.personal_state,
            data,
            personal_rng,
            regularizer=lambda v: pull(v, global_params),
            **options.personal_batching(),
        )
        metrics = {**metrics, "personal_loss": personal_metrics["train_loss"]}
        metrics["steps"] = metrics["steps"] + personal_metrics["steps"]
        return ClientState(personal, personal_state, model_state), local, metrics

    def eval_params(server_state, client_state):
        return {"params": client_state.personal, **client_state.personal_state}

    return FederatedAlgorithm(
        name="ditto",
        options=options,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        aggregation=model_averaging(),
        eval_params=eval_params,
        global_params=global_model(model),
    )


builtin("ditto", DittoOptions, lambda model, options, config: ditto(model, options))
