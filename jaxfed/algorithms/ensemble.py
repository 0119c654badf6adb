"""FLoRAL's Ensemble baseline: C full models mixed by a private per-client router.

Client k's prediction is ``sum_c pi_kc f_c(x)`` with ``pi_k = softmax(w_k)`` (the model is a
:class:`jaxfed.nn.models.Mixture`). Local training is simultaneous, with the client optimizer
(SGD by default), on the C members and the router logits (their own learning rate, no weight
decay, training noise drawn at every step); the server averages
member c with the weights ``p(k|c) = p_k pi_kc / sum_k' p_k' pi_k'c``, as FLoRAL averages its
adaptors. ``router="oracle"`` fixes each client's router on its ground-truth cluster: C models
trained by clustered FedAvg.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms.floral import CODE, RoutedClient, RouterOptions, check_oracle
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import per_key, train_routed
from jaxfed.contract import Aggregation, FederatedAlgorithm
from jaxfed.core import mean_of
from jaxfed.core.routing import mixture_share, oracle_init
from jaxfed.nn import split_variables
from jaxfed.nn.models import Mixture
from jaxfed.options import at_least, option, resolve


@dataclasses.dataclass(frozen=True)
class EnsembleOptions(RouterOptions):
    """FLoRAL's Ensemble baseline: C full models mixed by a private router."""

    num_members: int = option(4, "full models C mixed by each client's router", source=CODE, check=at_least(1))


class ServerState(NamedTuple):
    members: Any  # the C members' parameters, stacked on a leading C axis


class Upload(NamedTuple):
    members: Any
    mixture_weights: jax.Array  # [C]: pi_k, which the server weighs member c by


def ensemble(
    model, options: EnsembleOptions | None = None, *, num_clusters: int = 0, name: str = "ensemble", **overrides
) -> FederatedAlgorithm:
    """The ensemble; ``num_clusters`` is the task's ground-truth cluster count (``router="oracle"`` only)."""
    options = resolve(EnsembleOptions, options, overrides)
    num_members = options.num_members
    check_oracle(options.router, num_members, num_clusters)
    learned = options.router == "learned"
    mixture = Mixture(model)

    def init(rng):
        members, member_state = split_variables(jax.vmap(model.init)(jax.random.split(rng, num_members)))
        return ServerState(members), RoutedClient(jnp.zeros((num_members,), jnp.float32), member_state)

    def client_update(message, client_state, data, rng, info):
        transforms = {"members": options.optimizer(info.round)}  # this round's learning rate
        if learned:
            transforms["router"] = options.router_optimizer()
        optimizer = per_key(transforms)
        router_logits = client_state.router
        if learned and not options.stateful:
            router_logits = jnp.zeros_like(router_logits)

        members, new_logits, model_state, metrics = train_routed(
            mixture,
            optimizer,
            {"members": message.members},
            router_logits,
            lambda shared, weights: {"members": shared["members"], "weights": weights},
            client_state.model_state,
            data,
            rng,
            learned=learned,
            mixture=options.mixture,
            **options.batching(),
        )
        return (
            RoutedClient(new_logits, model_state),
            Upload(members["members"], options.uploaded_mixture(new_logits)),
            metrics,
        )

    def contribute(server_state, message, weight, info):
        return mixture_share(message.members, message.mixture_weights, weight)

    def apply(server_state, total, info):
        return ServerState(mean_of(total, server_state.members))  # a member nobody used keeps its value

    def eval_params(server_state, client_state):
        pi = options.mixture(client_state.router)
        return {"params": {"members": server_state.members, "weights": pi}, **client_state.model_state}

    return FederatedAlgorithm(
        name=name,
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state,
        client_update=client_update,
        aggregation=Aggregation(contribute, apply),
        eval_params=eval_params,
        global_params=None,
        init_client=None if learned else oracle_init(num_members, num_clusters),
        eval_model=mixture,
    )


builtin(
    "ensemble",
    EnsembleOptions,
    lambda model, options, config: ensemble(model, options, num_clusters=config.ground_truth_clusters()),
)
