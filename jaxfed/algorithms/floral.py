"""FLoRAL (Almansoori et al.): a federated mixture of low-rank adaptors with per-client routers.

Every adapted layer has a shared base weight and ``C`` adaptors (:mod:`jaxfed.core.adaptors`:
dense LoRA, conv ``balanced_2d`` / ``channel`` / ``in_layer`` / ``out_layer``, bias and norm
adaptors). Client k holds private router logits ``w_k``; its model is the base mixed with
``pi_k = softmax(w_k)`` inside one forward pass. Local training is simultaneous SGD on the base,
the adaptors (LoRA-preconditioned by default) and the router (its own learning rate). The server
averages the base with the sample weights ``p_k`` and adaptor c's factors with
``p(k|c) = p_k pi_kc / sum_k' p_k' pi_k'c``. The router logits never leave the client; a client
sends its mixture weights ``pi_k`` (C numbers) with its update, since the server weighs by them.
Stateless clients (``stateful=False``) restart their router from zero logits every round. The
router's training noise is drawn afresh at every local step, as in the authors' code.
``router="oracle"`` fixes client k's router on its ground-truth cluster ``k mod num_clusters``
(logits 0 there and -100 elsewhere, never trained): FLoRAL's optimal-router baseline.

Baseline ``local_adaptor``: one private adaptor per client (C = 1, never uploaded), the base
federated with sample weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxfed.algorithms.base import FederatedAlgorithm
from jaxfed.algorithms.training import per_key, sgd, split_variables, train_parameters, train_routed
from jaxfed.core import adaptors as ad
from jaxfed.core import tree_select, weighted_mean
from jaxfed.core.routing import check_router, mixture_average, mixture_weights, oracle_init


def _local_optimizer(plan, lr, momentum, weight_decay, precondition, router_lr=None):
    """SGD on the base and the adaptors (LoRA-preconditioned), and on the router at its own rate."""
    adaptor_opt = sgd(lr, momentum, weight_decay)
    transforms = {
        "base": sgd(lr, momentum, weight_decay),
        "adaptors": optax.chain(ad.lora_preconditioner(plan), adaptor_opt) if precondition else adaptor_opt,
    }
    if router_lr is not None:
        transforms["router"] = sgd(router_lr)
    return per_key(transforms)


def floral(
    model,
    *,
    lr: float,
    local_epochs: int,
    batch_size: int,
    drop_last: bool = False,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    num_adaptors: int = 4,
    rho: float = 0.01,
    rank: int = 0,
    conv_adaptor: str = "balanced_2d",
    alpha: float = 1.0,
    router_lr: float = 0.1,
    router_noise: float = 0.0,
    router_temperature: float = 1.0,
    precondition: bool = True,
    stateful: bool = True,
    router: str = "learned",
    num_clusters: int = 0,
    name: str = "floral",
) -> FederatedAlgorithm:
    check_router(router, num_adaptors, num_clusters)
    learned = router == "learned"
    template, _ = split_variables(jax.eval_shape(model.init, jax.random.key(0)))
    plan = ad.adaptor_plan(template, num_adaptors, rho=rho, rank=rank, conv_adaptor=conv_adaptor, alpha=alpha)
    optimizer = _local_optimizer(plan, lr, momentum, weight_decay, precondition, router_lr if learned else None)

    def init(rng):
        base_rng, adaptor_rng = jax.random.split(rng)
        params, model_state = split_variables(model.init(base_rng))
        server = {"base": params, "adaptors": ad.init_adaptors(adaptor_rng, template, plan)}
        return server, {"router": jnp.zeros((num_adaptors,), jnp.float32), "model_state": model_state}

    def client_update(message, client_state, data, rng):
        router_logits = client_state["router"]
        if learned and not stateful:
            router_logits = jnp.zeros_like(router_logits)

        trained, new_logits, pi, model_state, metrics = train_routed(
            model,
            optimizer,
            {"base": message["base"], "adaptors": message["adaptors"]},
            router_logits,
            lambda shared, weights: ad.mix(shared["base"], shared["adaptors"], weights, plan),
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
        upload = {"base": trained["base"], "adaptors": trained["adaptors"], "mixture_weights": pi}
        return {"router": new_logits, "model_state": model_state}, upload, metrics

    def server_update(server_state, messages, weights):
        new = {
            "base": weighted_mean(messages["base"], weights),
            "adaptors": mixture_average(
                messages["adaptors"], messages["mixture_weights"], weights, server_state["adaptors"]
            ),
        }
        return tree_select(jnp.sum(weights) > 0, new, server_state)

    def eval_params(server_state, client_state):
        pi = mixture_weights(client_state["router"], temperature=router_temperature)
        return {
            "params": ad.mix(server_state["base"], server_state["adaptors"], pi, plan),
            **client_state["model_state"],
        }

    return FederatedAlgorithm(
        name=name,
        init=init,
        broadcast=lambda server_state, tier=0: server_state,
        client_update=client_update,
        server_update=server_update,
        eval_params=eval_params,
        global_params=None,  # every client mixes the adaptors with its own router
        init_client=None if learned else oracle_init(num_adaptors, num_clusters),
    )


def local_adaptor(
    model,
    *,
    lr: float,
    local_epochs: int,
    batch_size: int,
    drop_last: bool = False,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    rho: float = 0.01,
    rank: int = 0,
    conv_adaptor: str = "balanced_2d",
    alpha: float = 1.0,
    precondition: bool = True,
    name: str = "local_adaptor",
) -> FederatedAlgorithm:
    """FLoRAL's Local Adaptor baseline: the base is FedAvg's, each client's adaptor is its own."""
    template, _ = split_variables(jax.eval_shape(model.init, jax.random.key(0)))
    plan = ad.adaptor_plan(template, 1, rho=rho, rank=rank, conv_adaptor=conv_adaptor, alpha=alpha)
    optimizer = _local_optimizer(plan, lr, momentum, weight_decay, precondition)
    only = jnp.ones((1,), jnp.float32)

    def init(rng):
        base_rng, adaptor_rng = jax.random.split(rng)
        params, model_state = split_variables(model.init(base_rng))
        return {"base": params}, {"adaptors": ad.init_adaptors(adaptor_rng, template, plan), "model_state": model_state}

    def client_update(message, client_state, data, rng):
        trainable = {"base": message["base"], "adaptors": client_state["adaptors"]}
        trained, model_state, metrics = train_parameters(
            model,
            optimizer,
            trainable,
            client_state["model_state"],
            data,
            rng,
            epochs=local_epochs,
            batch_size=batch_size,
            drop_last=drop_last,
            to_params=lambda t: ad.mix(t["base"], t["adaptors"], only, plan),
        )
        return {"adaptors": trained["adaptors"], "model_state": model_state}, trained["base"], metrics

    def server_update(server_state, messages, weights):
        return {"base": tree_select(jnp.sum(weights) > 0, weighted_mean(messages, weights), server_state["base"])}

    def eval_params(server_state, client_state):
        return {
            "params": ad.mix(server_state["base"], client_state["adaptors"], only, plan),
            **client_state["model_state"],
        }

    return FederatedAlgorithm(
        name=name,
        init=init,
        broadcast=lambda server_state, tier=0: {"base": server_state["base"]},
        client_update=client_update,
        server_update=server_update,
        eval_params=eval_params,
        global_params=None,
    )


def _adaptor_options(config) -> dict:
    return {
        "lr": config.lr,
        "momentum": config.momentum,
        "weight_decay": config.weight_decay,
        "local_epochs": config.local_epochs,
        "batch_size": config.batch_size,
        "drop_last": config.drop_last,
        "rho": config.rho,
        "rank": config.adaptor_rank,
        "conv_adaptor": config.conv_adaptor,
        "alpha": config.adaptor_alpha,
        "precondition": config.precondition,
    }


def local_adaptor_from_config(config, model) -> FederatedAlgorithm:
    return local_adaptor(model, **_adaptor_options(config))


def from_config(config, model) -> FederatedAlgorithm:
    return floral(
        model,
        **_adaptor_options(config),
        num_adaptors=config.num_adaptors,
        router_lr=config.router_lr,
        router_noise=config.router_noise,
        router_temperature=config.router_temperature,
        stateful=config.stateful,
        router=config.router,
        num_clusters=config.num_clusters,
    )
