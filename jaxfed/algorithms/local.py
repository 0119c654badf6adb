"""Local training: no communication; each client trains its own model on its own data.

Every client starts from the same initialization; nothing is sent either way, so the server
state never changes and there is no global model.
"""

from __future__ import annotations

from jaxfed.algorithms.base import FederatedAlgorithm
from jaxfed.algorithms.training import client_optimizer, local_training_options, train_classifier


def local(model, optimizer, *, local_epochs: int, batch_size: int, drop_last: bool = False) -> FederatedAlgorithm:
    def init(rng):
        return {}, {"variables": model.init(rng)}

    def broadcast(server_state, tier=0):
        return {}

    def client_update(message, client_state, data, rng):
        variables, metrics = train_classifier(
            model,
            optimizer,
            client_state["variables"],
            data,
            rng,
            epochs=local_epochs,
            batch_size=batch_size,
            drop_last=drop_last,
        )
        return {"variables": variables}, {}, metrics

    def server_update(server_state, messages, weights):
        return server_state

    def eval_params(server_state, client_state):
        return client_state["variables"]

    return FederatedAlgorithm("local", init, broadcast, client_update, server_update, eval_params, None)


def from_config(config, model) -> FederatedAlgorithm:
    return local(model, client_optimizer(config), **local_training_options(config))
