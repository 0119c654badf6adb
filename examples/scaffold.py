"""SCAFFOLD (Karimireddy et al., 2020), written only against jaxfed's public API.

Each client keeps a control variate ``c_i`` (client state, never uploaded as such); the server
keeps the global model ``x`` and the global control ``c``. A round (the paper's Algorithm 1,
option II for the control update):

- client i starts from ``y = x`` and takes K local SGD steps on ``g(y) - c_i + c``; here the
  correction is the gradient of the linear term ``<y, c - c_i>`` added to the loss;
- ``c_i+ = c_i - c + (x - y) / (K lr)``; it uploads ``(y - x, c_i+ - c_i)``;
- the server: ``x += eta_g * mean(y - x)``, ``c += |S| / N * mean(c_i+ - c_i)`` over the
  sampled clients.

Run it from the command line (the file registers ``scaffold`` when imported)::

    jaxfed run scaffold --plugin examples/scaffold.py --set server_lr=0.5 rounds=20

or from Python: ``scaffold(model, ScaffoldOptions(lr=0.05), num_clients=20)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import jaxfed
from jaxfed.algorithms import Aggregation, FederatedAlgorithm, RoundInfo
from jaxfed.algorithms.training import train_classifier
from jaxfed.core import WeightedSum, mean_of, weighted_share
from jaxfed.nn import split_variables
from jaxfed.options import TrainingOptions, one_of, option, positive, resolve

PAPER = "Karimireddy et al. 2020, Alg. 1"


@dataclasses.dataclass(frozen=True)
class ScaffoldOptions(TrainingOptions):
    """SCAFFOLD's options: client SGD and the global step size."""

    # Option II's control update (x - y) / (K lr) is the mean gradient only under plain SGD steps:
    # the paper fixes the client optimizer, so this key allows SGD alone.
    client_optimizer: str = option(
        "sgd",
        "client optimizer: sgd only (option II's control update (x - y) / (K lr) assumes SGD steps)",
        source=PAPER,
        check=one_of("sgd"),
    )
    server_lr: float = option(1.0, "global step size eta_g", source=PAPER, check=positive)


class ServerState(NamedTuple):
    params: Any  # the global model x
    control: Any  # the global control variate c


class ClientState(NamedTuple):
    control: Any  # this client's control variate c_i
    model_state: Any  # non-trainable collections (BatchNorm statistics), {} when none


class Upload(NamedTuple):
    delta_params: Any  # y - x
    delta_control: Any  # c_i+ - c_i


def _zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def scaffold(model, options: ScaffoldOptions | None = None, *, num_clients: int, **overrides) -> FederatedAlgorithm:
    options = resolve(ScaffoldOptions, options, overrides)

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        return ServerState(params, _zeros(params)), ClientState(_zeros(params), model_state)

    def broadcast(server: ServerState, info: RoundInfo) -> ServerState:
        return server

    def client_update(server: ServerState, client: ClientState, data, rng, info: RoundInfo):
        optimizer = options.optimizer(info.round)  # this round's learning rate
        correction = jax.tree.map(jnp.subtract, server.control, client.control)  # c - c_i

        def drift_correction(params):  # its gradient is c - c_i at every step
            terms = jax.tree.map(lambda p, d: jnp.sum(p * jax.lax.stop_gradient(d)), params, correction)
            return sum(jax.tree.leaves(terms))

        variables, metrics = train_classifier(
            model,
            optimizer,
            {"params": server.params, **client.model_state},
            data,
            rng,
            regularizer=drift_correction,
            **options.batching(),
        )
        params, model_state = split_variables(variables)
        scale = 1.0 / (jnp.maximum(metrics["steps"], 1.0) * options.learning_rate(info.round))
        new_control = jax.tree.map(
            lambda ci, c, x, y: ci - c + (x - y) * scale, client.control, server.control, server.params, params
        )
        upload = Upload(
            delta_params=jax.tree.map(jnp.subtract, params, server.params),
            delta_control=jax.tree.map(jnp.subtract, new_control, client.control),
        )
        return ClientState(new_control, model_state), upload, metrics

    def contribute(server: ServerState, upload: Upload, weight, info: RoundInfo) -> WeightedSum:
        # Plain means over the sampled clients: each counts once (padding and skipped rows count
        # for nothing: the engine's rule), so the summed weight is the number sampled.
        return weighted_share(upload, 1.0)

    def apply(server: ServerState, total: WeightedSum, info: RoundInfo) -> ServerState:
        sampled = total.weight
        step, control_step = mean_of(total)  # a round where no client counted keeps the old state
        return ServerState(
            params=jax.tree.map(lambda x, d: x + options.server_lr * d, server.params, step),
            control=jax.tree.map(lambda c, d: c + sampled / num_clients * d, server.control, control_step),
        )

    def eval_params(server: ServerState, client: ClientState):
        return {"params": server.params, **client.model_state}

    return FederatedAlgorithm(
        name="scaffold",
        options=options,  # recorded in config.json; a resume with other options is refused
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        aggregation=Aggregation(contribute, apply),
        eval_params=eval_params,
        global_params=lambda server: {"params": server.params},
    )


@jaxfed.register("scaffold", ScaffoldOptions, replace=True)
def build(model, options: ScaffoldOptions, config):
    """SCAFFOLD: client control variates correct the drift of local SGD (Karimireddy et al., 2020)."""
    return scaffold(model, options, num_clients=config.num_clients)
