"""FedHM (Yao et al.): clients of different capacity train low-rank factorizations of one global model.

Clients sit in static tiers, each with a rank ratio. Every round the server truncated-SVD
factorizes each factorized kernel of the global model to the tier's rank
(``rank = round(ratio * min dim)`` of the matricized kernel) and sends each tier its factors;
clients train the factors (and the unfactorized parameters) with cross-entropy, running each
factorized Conv as a ``kh x 1`` then ``1 x kw`` conv and each Dense as two thin matmuls, so a
client's compute and upload scale with its rank. The server reconstructs every upload to full
kernels and averages them with sample weights over all tiers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxfed.algorithms.base import FederatedAlgorithm
from jaxfed.algorithms.training import client_optimizer, local_training_options, split_variables, train_classifier
from jaxfed.core import lowrank, tree_select, weighted_mean
from jaxfed.errors import ConfigError
from jaxfed.nn.factorized import factorized_execution, interior_layers

DEFAULT_TIERS = (1.0, 0.5, 0.25, 0.125, 0.0625)


def tier_ranks(template, layers: list[str], tiers) -> list[dict[str, int]]:
    """``{layer: rank}`` of each tier's rank ratio (static; a ratio outside (0, 1] is a ConfigError)."""
    return [
        {
            key: lowrank.rank_from_ratio(lowrank.get_layer(template, key)["kernel"].shape, ratio, "tiers")
            for key in layers
        }
        for ratio in tiers
    ]


def reconstruct_and_average(previous, messages, weights):
    """Every tier's uploads reconstructed to full kernels, then their sample-weighted mean over all
    tiers (``previous`` when nobody contributed): FedHM's and FedARA's server step."""
    full = [jax.vmap(lowrank.reconstruct_layers)(tier_messages) for tier_messages in messages]
    stacked = jax.tree.map(lambda *rows: jnp.concatenate(rows), *full)
    all_weights = jnp.concatenate(weights)
    return tree_select(jnp.sum(all_weights) > 0, weighted_mean(stacked, all_weights), previous)


def fedhm(
    model,
    optimizer: optax.GradientTransformation,
    *,
    local_epochs: int,
    batch_size: int,
    drop_last: bool = False,
    tiers=DEFAULT_TIERS,
    layers: list[str] | None = None,
    name: str = "fedhm",
) -> FederatedAlgorithm:
    """FedHM over ``len(tiers)`` client tiers; ``layers`` (default: all kernels but the first
    layer and the head) are factorized, the rest trains in full."""
    template, private_stats = split_variables(jax.eval_shape(model.init, jax.random.key(0)))
    keys = interior_layers(model) if layers is None else list(layers)
    if not keys:
        raise ConfigError("fedhm: no Dense or Conv layer to factorize in this model")
    ranks = tier_ranks(template, keys, tuple(tiers))

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        return {"params": params}, {"model_state": model_state}

    def broadcast(server_state, tier):
        return lowrank.factorize_layers(server_state["params"], ranks[tier])

    def client_update(factorized, client_state, data, rng):
        with factorized_execution():
            variables, metrics = train_classifier(
                model,
                optimizer,
                {"params": factorized, **client_state["model_state"]},
                data,
                rng,
                epochs=local_epochs,
                batch_size=batch_size,
                drop_last=drop_last,
            )
        trained, model_state = split_variables(variables)
        return {"model_state": model_state}, trained, metrics

    def server_update(server_state, messages, weights):
        return {"params": reconstruct_and_average(server_state["params"], messages, weights)}

    def eval_params(server_state, client_state):
        return {"params": server_state["params"], **client_state["model_state"]}

    def global_params(server_state):
        return {"params": server_state["params"]}

    return FederatedAlgorithm(
        name=name,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        server_update=server_update,
        eval_params=eval_params,
        global_params=None if private_stats else global_params,
        num_tiers=len(ranks),
    )


def from_config(config, model) -> FederatedAlgorithm:
    tiers = config.tier_ratios(DEFAULT_TIERS)
    return fedhm(model, client_optimizer(config), **local_training_options(config), tiers=tiers)
