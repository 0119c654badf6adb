"""FLoRAL's Ensemble baseline: C full models mixed by a private per-client router.

Client k's prediction is ``sum_c pi_kc f_c(x)`` with ``pi_k = softmax(w_k)`` (the model is a
:class:`jaxfed.nn.models.Mixture`). Local training is simultaneous SGD on the C members and the
router logits (their own learning rate, training noise drawn at every step); the server averages
member c with the weights ``p(k|c) = p_k pi_kc / sum_k' p_k' pi_k'c``, as FLoRAL averages its
adaptors. ``router="oracle"`` fixes each client's router on its ground-truth cluster: C models
trained by clustered FedAvg.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfed.algorithms.base import FederatedAlgorithm
from jaxfed.algorithms.training import per_key, sgd, split_variables, train_routed
from jaxfed.core import tree_select
from jaxfed.core.routing import check_router, mixture_average, mixture_weights, oracle_init
from jaxfed.nn.models import Mixture


def ensemble(
    model,
    *,
    lr: float,
    local_epochs: int,
    batch_size: int,
    drop_last: bool = False,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    num_members: int = 4,
    router_lr: float = 0.1,
    router_noise: float = 0.0,
    router_temperature: float = 1.0,
    stateful: bool = True,
    router: str = "learned",
    num_clusters: int = 0,
    name: str = "ensemble",
) -> FederatedAlgorithm:
    check_router(router, num_members, num_clusters)
    learned = router == "learned"
    mixture = Mixture(model)
    transforms = {"members": sgd(lr, momentum, weight_decay)}
    if learned:
        transforms["router"] = sgd(router_lr)
    optimizer = per_key(transforms)

    def init(rng):
        members, member_state = split_variables(jax.vmap(model.init)(jax.random.split(rng, num_members)))
        return {"members": members}, {"router": jnp.zeros((num_members,), jnp.float32), "model_state": member_state}

    def client_update(message, client_state, data, rng):
        router_logits = client_state["router"]
        if learned and not stateful:
            router_logits = jnp.zeros_like(router_logits)

        members, new_logits, pi, model_state, metrics = train_routed(
            mixture,
            optimizer,
            {"members": message["members"]},
            router_logits,
            lambda shared, weights: {"members": shared["members"], "weights": weights},
            client_state["model_state"],
            data,
            rng,
            learned=learned,
            noise=router_noise,
            temperature=router_temperature,
            epochs=local_epochs,
            batch_size=batch_size,
            drop_last=drop_last,
        )
        upload = {"members": members["members"], "mixture_weights": pi}
        return {"router": new_logits, "model_state": model_state}, upload, metrics

    def server_update(server_state, messages, weights):
        members = mixture_average(messages["members"], messages["mixture_weights"], weights, server_state["members"])
        return tree_select(jnp.sum(weights) > 0, {"members": members}, server_state)

    def eval_params(server_state, client_state):
        pi = mixture_weights(client_state["router"], temperature=router_temperature)
        return {"params": {"members": server_state["members"], "weights": pi}, **client_state["model_state"]}

    return FederatedAlgorithm(
        name=name,
        init=init,
        broadcast=lambda server_state, tier=0: server_state,
        client_update=client_update,
        server_update=server_update,
        eval_params=eval_params,
        global_params=None,
        init_client=None if learned else oracle_init(num_members, num_clusters),
        eval_model=mixture,
    )


def from_config(config, model) -> FederatedAlgorithm:
    return ensemble(
        model,
        lr=config.lr,
        local_epochs=config.local_epochs,
        batch_size=config.batch_size,
        drop_last=config.drop_last,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        num_members=config.num_adaptors,
        router_lr=config.router_lr,
        router_noise=config.router_noise,
        router_temperature=config.router_temperature,
        stateful=config.stateful,
        router=config.router,
        num_clusters=config.num_clusters,
    )
