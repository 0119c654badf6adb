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
from jaxfed.algorithms.training import sgd, split_variables, train_parameters
from jaxfed.core import adaptors as ad
from jaxfed.core import tree_select, weighted_mean
from jaxfed.errors import ConfigError

ROUTERS = ("learned", "oracle")
ORACLE_LOGIT_GAP = 100.0  # the authors' optimal router: logits -100 off the client's cluster


def per_key(transforms: dict[str, optax.GradientTransformation]) -> optax.GradientTransformation:
    """One optax transformation per top-level key of a dict of parameters."""

    def init(params):
        return {k: t.init(params[k]) for k, t in transforms.items()}

    def update(updates, state, params=None):
        out, new_state = {}, {}
        for k, t in transforms.items():
            out[k], new_state[k] = t.update(updates[k], state[k], None if params is None else params[k])
        return out, new_state

    return optax.GradientTransformation(init, update)


def adaptor_weights(pi: jax.Array, weights: jax.Array) -> jax.Array:
    """``[clients, C]``: ``p(k|c) = p_k pi_kc / sum_k' p_k' pi_k'c`` (0 for an adaptor nobody used)."""
    joint = weights[:, None] * pi
    return joint / jnp.where(jnp.sum(joint, axis=0) > 0, jnp.sum(joint, axis=0), 1.0)


def mixture_average(components, pi: jax.Array, weights: jax.Array, previous):
    """Component c of the stacked uploads ``components`` (leaves ``[clients, C, ...]``) averaged with
    weights ``p(k|c)``; a component no client used keeps its ``previous`` value (leaves ``[C, ...]``)."""
    per_client = adaptor_weights(pi, weights)
    used = jnp.sum(weights[:, None] * pi, axis=0) > 0  # [C]

    def average(x, old):
        w = per_client.reshape(per_client.shape + (1,) * (x.ndim - 2))
        return jnp.where(used.reshape((-1,) + (1,) * (old.ndim - 1)), jnp.sum(w * x, axis=0), old)

    return jax.tree.map(average, components, previous)


def check_router(router: str, num_components: int, num_clusters: int) -> None:
    if router not in ROUTERS:
        raise ConfigError(f"router: unknown '{router}'; allowed: {', '.join(ROUTERS)}")
    if router == "oracle" and num_clusters > num_components:
        raise ConfigError(
            f"router: oracle routes each of num_clusters={num_clusters} clusters to its own component; "
            f"needs num_adaptors >= {num_clusters}, got {num_components}"
        )


def oracle_logits(client_id, num_components: int, num_clusters: int) -> jax.Array:
    """Router logits one-hot (after softmax) on client ``client_id``'s cluster ``client_id mod num_clusters``."""
    cluster = client_id % num_clusters
    return jnp.where(jnp.arange(num_components) == cluster, 0.0, -ORACLE_LOGIT_GAP).astype(jnp.float32)


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
        if not learned:
            router_logits = client_state["router"]
        else:
            router_logits = client_state["router"] if stateful else jnp.zeros_like(client_state["router"])

        def to_params(t, step_key):  # fresh router noise at every step
            logits = t["router"] if learned else router_logits
            pi = ad.mixture_weights(logits, step_key, router_noise, router_temperature)
            return ad.mix(t["base"], t["adaptors"], pi, plan)

        trainable = {"base": message["base"], "adaptors": message["adaptors"]}
        if learned:
            trainable["router"] = router_logits
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
            to_params=to_params,
            stochastic=True,
        )
        new_logits = trained["router"] if learned else router_logits
        pi = ad.mixture_weights(new_logits, temperature=router_temperature)
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
        pi = ad.mixture_weights(client_state["router"], temperature=router_temperature)
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


def oracle_init(num_components: int, num_clusters: int):
    """``init_client`` that sets a client's router to the oracle's logits."""

    def init_client(client_state, client_id):
        return {**client_state, "router": oracle_logits(client_id, num_components, num_clusters)}

    return init_client


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
