"""FedLoRU (Park et al.) and FedLoRA: clients train low-rank updates of a frozen global model.

Each factorized kernel W runs as ``W + s * (down @ up - down0 @ up0)`` with ``s = lora_alpha / r``
(conv: ``im2col`` layout, a kh x kw conv to r channels then a 1 x 1 conv, as the paper); the
non-factorized parameters (the first layer, the head, biases, norms) train in full. The server
averages ``down`` and ``up`` separately (and the full parameters) with sample weights. Every
``accumulate_every`` rounds FedLoRU folds the update into W: ``W <- W + s * (down @ up - down0 @ up0)``;
with ``reinit`` the factors restart (``down`` Kaiming, ``up`` 0), otherwise they continue and
``(down0, up0)`` remembers what W already holds, so nothing is counted twice. FedLoRA never
accumulates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxfed.algorithms.base import FederatedAlgorithm
from jaxfed.algorithms.training import client_optimizer, local_training_options, split_variables, train_classifier
from jaxfed.core import lowrank, tree_select, weighted_mean
from jaxfed.errors import ConfigError

LAYOUT = "im2col"


def default_lora_layers(params) -> list[str]:
    """Every Dense / Conv kernel except the first layer and the head (the paper's choice); in a
    model that has nothing else, every kernel but the head."""
    layers = [k for k in lowrank.factorizable_layers(params) if k != "head"]
    return layers[1:] or layers


def fedloru(
    model,
    optimizer: optax.GradientTransformation,
    *,
    local_epochs: int,
    batch_size: int,
    drop_last: bool = False,
    rank: int = 16,
    lora_alpha: float = 0.0,
    accumulate_every: int = 50,
    reinit: bool = True,
    layers: list[str] | None = None,
    name: str = "fedloru",
) -> FederatedAlgorithm:
    """``accumulate_every=0`` is FedLoRA. ``lora_alpha=0`` means ``alpha = rank`` (scale 1)."""
    scale = (lora_alpha or rank) / rank
    template, private_stats = split_variables(jax.eval_shape(model.init, jax.random.key(0)))
    keys = default_lora_layers(template) if layers is None else list(layers)
    if not keys:
        raise ConfigError("lora_layers: no Dense or Conv layer to adapt in this model")
    ranks = {}
    for key in keys:
        shape = lowrank.get_layer(template, key)["kernel"].shape
        ranks[key] = lowrank.check_rank(lowrank.matrix_shape(shape, LAYOUT), rank, field="lora_rank", name=key)

    def fresh_loras(rng):
        return lowrank.init_loras(rng, template, ranks, LAYOUT)

    def init(rng):
        init_rng, lora_rng, server_rng = jax.random.split(rng, 3)
        params, model_state = split_variables(model.init(init_rng))
        loras = fresh_loras(lora_rng)
        server = {
            "params": params,
            "loras": loras,
            "merged": loras_zero_like(loras),
            "round": jnp.int32(0),
            "key_data": jax.random.key_data(server_rng),  # raw bits (checkpointable); reinit folds in the round
        }
        return server, {"model_state": model_state}

    def broadcast(server_state, tier=0):
        return {k: server_state[k] for k in ("params", "loras", "merged")}

    def effective_params(params, loras, merged):
        """W + s * (down @ up - down0 @ up0) on every adapted layer."""
        with_update = lowrank.add_loras(params, loras, scale, LAYOUT)
        return lowrank.add_loras(with_update, merged, -scale, LAYOUT)

    def client_update(message, client_state, data, rng):
        free, frozen = lowrank.split_kernels(message["params"], keys)
        trainable = {"free": free, "loras": message["loras"]}

        def to_params(t):
            return effective_params(lowrank.merge_kernels(t["free"], frozen), t["loras"], message["merged"])

        variables, metrics = train_classifier(
            model,
            optimizer,
            {"params": trainable, **client_state["model_state"]},
            data,
            rng,
            epochs=local_epochs,
            batch_size=batch_size,
            drop_last=drop_last,
            to_params=to_params,
        )
        trained, model_state = split_variables(variables)
        return {"model_state": model_state}, trained, metrics

    def server_update(server_state, messages, weights):
        average = weighted_mean(messages, weights)  # down, up and the full parameters, each on its own
        _, frozen = lowrank.split_kernels(server_state["params"], keys)
        params = lowrank.merge_kernels(average["free"], frozen)
        loras, merged = average["loras"], server_state["merged"]
        round_ = server_state["round"] + 1
        lora_rng = jax.random.fold_in(jax.random.wrap_key_data(server_state["key_data"]), round_)
        if accumulate_every:
            accumulated = effective_params(params, loras, merged)
            restarted = fresh_loras(lora_rng) if reinit else loras
            now = round_ % accumulate_every == 0
            params = tree_select(now, accumulated, params)
            merged = tree_select(now, loras_zero_like(loras) if reinit else loras, merged)
            loras = tree_select(now, restarted, loras)
        received = jnp.sum(weights) > 0
        new = {**server_state, "params": params, "loras": loras, "merged": merged, "round": round_}
        return tree_select(received, new, server_state)

    def eval_params(server_state, client_state):
        params = effective_params(server_state["params"], server_state["loras"], server_state["merged"])
        return {"params": params, **client_state["model_state"]}

    def global_params(server_state):
        return {"params": effective_params(server_state["params"], server_state["loras"], server_state["merged"])}

    return FederatedAlgorithm(
        name=name,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        server_update=server_update,
        eval_params=eval_params,
        global_params=None if private_stats else global_params,
    )


def loras_zero_like(loras):
    return jax.tree.map(jnp.zeros_like, loras)


def from_config(config, model, name: str = "fedloru") -> FederatedAlgorithm:
    return fedloru(
        model,
        client_optimizer(config),
        **local_training_options(config),
        rank=config.lora_rank,
        lora_alpha=config.lora_alpha,
        accumulate_every=0 if name == "fedlora" else config.accumulate_every,
        reinit=config.reinit,
        name=name,
    )


def fedlora_from_config(config, model) -> FederatedAlgorithm:
    return from_config(config, model, name="fedlora")
