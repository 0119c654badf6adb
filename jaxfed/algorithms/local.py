"""Local training: no communication; each client trains its own model on its own data.

Every client starts from the same initialization; nothing is sent either way, so the server
state never changes and there is no global model. With ``model_tiers`` (rank levels) or
``tier_models`` (architectures) the clients' models are heterogeneous (:mod:`jaxfed.algorithms.model_tiers`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jaxfed.algorithms.model_tiers import model_tiers_option, tier_models_option, with_model_tiers
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import train_classifier
from jaxfed.contract import Aggregation, FederatedAlgorithm
from jaxfed.options import TrainingOptions, resolve


@dataclasses.dataclass(frozen=True)
class LocalOptions(TrainingOptions):
    """Client SGD only (nothing is communicated)."""

    model_tiers: tuple[float, ...] = model_tiers_option()
    tier_models: tuple[str, ...] = tier_models_option()


class ClientState(NamedTuple):
    variables: Any  # the client's own Flax variables


def local(model, options: LocalOptions | None = None, **overrides) -> FederatedAlgorithm:
    options = resolve(LocalOptions, options, overrides)

    def init(rng):
        return (), ClientState(model.init(rng))

    def broadcast(server_state, info):
        return ()

    def client_update(message, client_state, data, rng, info):
        optimizer = options.optimizer(info.round)  # this round's learning rate
        variables, metrics = train_classifier(model, optimizer, client_state.variables, data, rng, **options.batching())
        return ClientState(variables), (), metrics

    def eval_params(server_state, client_state):
        return client_state.variables

    algorithm = FederatedAlgorithm(
        name="local",
        options=options,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        aggregation=Aggregation(  # nothing to sum: the server never changes
            contribute=lambda server_state, message, weight, info: (),
            apply=lambda server_state, total, info: server_state,
        ),
        eval_params=eval_params,
        global_params=None,  # every client's model is its own
    )
    return with_model_tiers(
        algorithm, model, options,
        params_of=lambda state: state.variables["params"],
        with_params=lambda state, params: ClientState({**state.variables, "params": params}),
    )  # fmt: skip


builtin("local", LocalOptions, lambda model, options, config: local(model, options))
