"""FedAMP (Huang et al., AAAI 2021): federated attentive message passing between similar clients.

Each client keeps its own model ``w_i``. The server keeps every client's latest uploaded model and
makes each client a cloud model ``u_i = sum_j xi_ij w_j`` by attention to its similar clients:
``xi_ij = alpha_k * A'(||w_i - w_j||^2)`` for ``j != i``, with ``A(x) = 1 - exp(-x / sigma)``
(so ``A'(x) = exp(-x / sigma) / sigma``), and ``xi_ii = 1 - sum_{j != i} xi_ij``. A client trains
its own model (from where it left it) on ``F_i(w) + lambda / (2 alpha_k) ||w - u_i||^2`` and
uploads it. ``alpha_k`` falls by ``alpha_decay`` every ``alpha_decay_every`` rounds (the
authors' code: alpha 1e4, times 0.1 after rounds 30, 60, ...), so the attention to others fades
and the pull toward the cloud model grows.

As the authors' code runs it (Fling: ``fedamp_client.py``, ``fedamp_group.py``): the distances
are over every parameter (BatchNorm statistics stay on the client); the server makes every
client's cloud model after each round from its latest copies of the clients' models; a client
is evaluated with its own model. Every client's cloud model starts as the initialization. The
server sends each client its cloud model alone (``sent_bytes``).

Where clients do not all take part (the paper's cross-silo clients all do): the server uses its
latest copy of each client that has uploaded (a client that never did, e.g. a new client, adds
no attention to others' cloud models); PFLlib uses the last round's uploads only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms.client_rows import one_row_sent, own_row, with_id, with_rows
from jaxfed.algorithms.fedprox import proximal_term
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import train_parameters
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core import stack_clients
from jaxfed.nn import model_template, split_variables
from jaxfed.options import TrainingOptions, at_least, non_negative, option, positive, resolve

CODE = (
    "the FedDecomp authors' runs of FedAMP (Fling, argzoo/cifar10/cifar10_fedamp_resnet_config.py: lambda 1, "
    "alpha_K 1e4 times 0.1 every 30 rounds, sigma 100)"
)


@dataclasses.dataclass(frozen=True)
class FedAMPOptions(TrainingOptions):
    """FedAMP's options: the attention's step and bandwidth, and the pull toward the cloud model."""

    lam: float = option(1.0, "lambda: the pull toward the cloud model, lambda / (2 alpha_k) ||w - u||^2", source=CODE,
                        check=non_negative)  # fmt: skip
    alpha_k: float = option(1e4, "alpha_k: the attention step xi_ij = alpha_k A'(||w_i - w_j||^2)", source=CODE,
                            check=positive)  # fmt: skip
    sigma: float = option(100.0, "sigma of A(x) = 1 - exp(-x / sigma)", source=CODE, check=positive)
    alpha_decay: float = option(
        0.1,
        "alpha_k's factor every alpha_decay_every rounds (local SGD diverges once lr * lam / alpha_k passes 2: "
        "the authors' schedule reaches 10 at round 181)",
        source=CODE,
        check=positive,
    )
    alpha_decay_every: int = option(
        30, "rounds between alpha_k's decays (after rounds 30, 60, ...); 0 = never", source=CODE, check=at_least(0)
    )

    def alpha(self, round_) -> jax.Array:
        """alpha_k in round ``round_`` (0-based): decayed once after each ``alpha_decay_every`` rounds."""
        if self.alpha_decay_every == 0:
            return jnp.float32(self.alpha_k)
        decays = jnp.maximum(0, (jnp.asarray(round_, jnp.int32) - 1) // self.alpha_decay_every)
        return self.alpha_k * jnp.float32(self.alpha_decay) ** decays


class ServerState(NamedTuple):
    models: Any  # every client's latest uploaded model (the initialization before), [num_clients, ...]
    clouds: Any  # every client's cloud model u_i, [num_clients, ...]
    has_row: jax.Array  # [num_clients] bool: the client has uploaded


class ClientState(NamedTuple):
    id: jax.Array  # int32 scalar: the client's id (which cloud model is its own)
    params: Any  # its own (personalized) model
    model_state: Any  # the model's non-trainable collections (BatchNorm statistics), {} when none


class Upload(NamedTuple):
    params: Any  # the trained model
    id: jax.Array  # int32 scalar: who sent it


def squared_distances(models) -> jax.Array:
    """``[n, n]``: ``||w_i - w_j||^2`` over every leaf of stacked models (differences taken, not a
    Gram matrix: models close together keep their small distances), one row at a time."""

    def row(i):
        return sum(
            jnp.sum(jnp.square(leaf - leaf[i]), axis=tuple(range(1, leaf.ndim))) for leaf in jax.tree.leaves(models)
        )

    n = jax.tree.leaves(models)[0].shape[0]
    return jax.lax.map(row, jnp.arange(n))


def attention(distances, known, alpha, sigma: float) -> jax.Array:
    """``[n, n]`` row-stochastic weights ``xi``: ``alpha exp(-d_ij / sigma) / sigma`` toward every
    other known client j, the rest of the row on the client itself."""
    n = distances.shape[0]
    others = known[None, :] & ~jnp.eye(n, dtype=bool)
    xi = jnp.where(others, alpha * jnp.exp(-distances / sigma) / sigma, 0.0)
    return xi + jnp.diag(1.0 - jnp.sum(xi, axis=1))


def cloud_models(models, known, alpha, sigma: float):
    """Every client's cloud model ``u_i = sum_j xi_ij w_j``."""
    xi = attention(squared_distances(models), known, alpha, sigma)
    return jax.tree.map(lambda leaf: jnp.tensordot(xi, leaf, axes=(1, 0)), models)


def fedamp(model, options: FedAMPOptions | None = None, *, num_clients: int, **overrides) -> FederatedAlgorithm:
    """FedAMP: each client's own model pulled toward a cloud model of its similar clients' models."""
    options = resolve(FedAMPOptions, options, overrides)
    template, _ = model_template(model)

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        table = stack_clients(params, num_clients)
        return ServerState(table, table, jnp.zeros(num_clients, bool)), ClientState(jnp.int32(0), params, model_state)

    def client_update(server_state, client_state, data, rng, info):
        cloud = own_row(server_state.clouds, client_state.id)
        pull = proximal_term(options.lam / options.alpha(info.round))
        params, model_state, metrics = train_parameters(
            model, options.optimizer(info.round), client_state.params, client_state.model_state, data, rng,
            regularizer=lambda w: pull(w, cloud), **options.batching(),
        )  # fmt: skip
        return ClientState(client_state.id, params, model_state), Upload(params, client_state.id), metrics

    def server_update(server_state, uploads: Upload, weights, info):
        models = with_rows(server_state.models, uploads.id, uploads.params, weights)
        has_row = with_rows(server_state.has_row, uploads.id, weights > 0, weights)
        return ServerState(models, cloud_models(models, has_row, options.alpha(info.round), options.sigma), has_row)

    return FederatedAlgorithm(
        name="fedamp",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state,
        client_update=client_update,
        server_update=server_update,
        eval_params=lambda server_state, client_state: {"params": client_state.params, **client_state.model_state},
        sent_bytes=one_row_sent(template),
        init_client=with_id,
    )


builtin("fedamp", FedAMPOptions, lambda model, options, config: fedamp(model, options, num_clients=config.num_clients))
