"""FedARA: resource-adaptive low-rank feature extractors with anchor-driven representation alignment.

The model is a feature extractor (FE: every layer but ``head``) and a classifier ``head``. The
FE is shared; the head is private client state and never uploaded. Clients sit in static tiers,
each with a rank ratio ``r_k`` (``tiers``) over the decomposed layers ``Q`` (``layers``,
default: every FE layer but the first, which holds the fewest parameters).

- Stage 1, server: for each tier, the truncated SVD of each layer of ``Q`` in the global FE at
  ``round(r_k * min dim)`` of its matricized kernel; the other FE layers are sent full.
- Stage 2, client: anchors first, the per-class mean feature of the client's training examples
  under the received, frozen FE (classes absent locally have none); then ``local_epochs`` of
  ``CE + lambda_t * MSE(f(x_i), a_{y_i}) + mu_fro * sum_q ||U_q V_q^T||_F^2`` on the FE factors
  and the head, run factorized (``factorized_execution``: compute scales with ``r_k``). The MSE
  averages over examples and feature dimensions (``anchor_loss="mean"``, torch's ``MSELoss``);
  ``anchor_loss="sum"`` sums over the dimensions, ``mean_i ||f(x_i) - a_{y_i}||^2``.
  ``lambda_t`` ramps linearly from 0 in round 1 to ``lam`` in round ``lambda_warmup_rounds + 1``.
- Stage 3, server: every upload reconstructed to full kernels, then the sample-weighted mean.

A client's personalized model is the global FE truncated to its tier's rank plus its head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxfed.algorithms.base import FederatedAlgorithm
from jaxfed.algorithms.fedhm import reconstruct_and_average, tier_ranks
from jaxfed.algorithms.training import (
    TrainState,
    client_optimizer,
    gradient_step,
    masked_loss,
    run_epochs,
    split_variables,
)
from jaxfed.core import lowrank
from jaxfed.data import Batch, ClientData
from jaxfed.errors import ConfigError
from jaxfed.nn.factorized import factorized_execution, layers_in_call_order

HEAD = "head"
ANCHOR_LOSSES = ("mean", "sum")
DEFAULT_TIERS = (1.0, 0.5, 0.25, 0.125, 0.0625)


def default_decomposed_layers(model) -> list[str]:
    """Every feature-extractor layer but the first one called (the smallest in these models)."""
    extractor = [key for key in layers_in_call_order(model) if key != HEAD]
    return extractor[1:] or extractor


def check_decomposed_layers(template, layers) -> list[str]:
    extractor = [key for key in lowrank.factorizable_layers(template) if key != HEAD]
    for key in layers:
        if key not in extractor:
            raise ConfigError(
                f"decompose_layers: '{key}' is not a layer of the feature extractor; allowed: {', '.join(extractor)}"
            )
    if not layers:
        raise ConfigError(f"decompose_layers: no layer to decompose; allowed: {', '.join(extractor)}")
    return list(layers)


def lambda_at(round_: jax.Array, lam: float, warmup_rounds: int) -> jax.Array:
    """``lambda_t`` of round ``round_`` (1-based): 0 in round 1, ``lam`` from round ``warmup + 1``."""
    if warmup_rounds <= 0:
        return jnp.where(round_ > 1, lam, 0.0)
    return lam * jnp.clip((round_ - 1) / warmup_rounds, 0.0, 1.0)


def frobenius_penalty(fe_params) -> jax.Array:
    """``sum_q ||U_q V_q^T||_F^2 = sum_q sum((U_q^T U_q) * (V_q^T V_q))`` over the factorized layers."""
    total = jnp.float32(0)
    for layer in lowrank.layers_with_factors(fe_params).values():
        u, v = lowrank.layer_factors(layer)
        total = total + jnp.sum((u.T @ u) * (v.T @ v))
    return total


def class_anchors(model, variables, data: ClientData, batch_size: int):
    """``(anchors [classes, features], present [classes])``: the mean feature of each class over the
    client's real training examples (``present`` False, anchor 0, for a class it does not hold)."""
    feature_dim, num_classes = variables["params"][HEAD]["kernel"].shape
    steps = -(-data.count // batch_size)

    def one_batch(b, totals):
        sums, counts = totals
        batch = data.batch(b * batch_size + jnp.arange(batch_size, dtype=jnp.int32))
        features, _ = model.apply(variables, batch.x, train=False, features=True)
        members = jax.nn.one_hot(batch.y, num_classes) * batch.mask[:, None]
        return sums + members.T @ features, counts + jnp.sum(members, axis=0)

    zeros = (jnp.zeros((num_classes, feature_dim)), jnp.zeros((num_classes,)))
    sums, counts = jax.lax.fori_loop(0, steps, one_batch, zeros)
    return sums / jnp.maximum(counts, 1.0)[:, None], counts > 0


def anchored_loss(model, anchors, lam_t, mu_fro, anchor_loss: str = "mean"):
    """``loss(params, model_state, batch)`` of FedARA's local objective; ``params = {"fe", "head"}``."""
    per_dimension = 1.0 / anchors.shape[-1] if anchor_loss == "mean" else 1.0

    def loss(params, model_state, batch: Batch):
        variables = {"params": {**params["fe"], HEAD: params["head"]}, **model_state}
        features, new_state = model.apply(variables, batch.x, train=True, mask=batch.mask, features=True)
        logits = features @ params["head"]["kernel"] + params["head"]["bias"]
        weight = batch.mask.astype(jnp.float32)
        drift = jnp.sum((features - anchors[batch.y]) ** 2, axis=-1) * per_dimension
        alignment = jnp.sum(drift * weight) / jnp.maximum(jnp.sum(weight), 1.0)
        value = masked_loss(logits, batch.y, batch.mask) + lam_t * alignment
        return value + mu_fro * frobenius_penalty(params["fe"]), new_state

    return loss


def fedara(
    model,
    optimizer: optax.GradientTransformation,
    *,
    local_epochs: int,
    batch_size: int,
    drop_last: bool = False,
    tiers=DEFAULT_TIERS,
    lam: float = 2.0,
    lambda_warmup_rounds: int = 10,
    mu_fro: float = 1e-3,
    anchor_loss: str = "mean",
    layers: list[str] | None = None,
    name: str = "fedara",
) -> FederatedAlgorithm:
    """FedARA over ``len(tiers)`` client tiers (rank ratios); ``layers`` are decomposed (by name)."""
    if anchor_loss not in ANCHOR_LOSSES:
        raise ConfigError(f"anchor_loss: unknown '{anchor_loss}'; allowed: {', '.join(ANCHOR_LOSSES)}")
    template, _ = split_variables(jax.eval_shape(model.init, jax.random.key(0)))
    if HEAD not in template:
        raise ConfigError(f"fedara: model '{getattr(model, 'name', model)}' has no '{HEAD}' layer to keep private")
    keys = check_decomposed_layers(template, default_decomposed_layers(model) if layers is None else layers)
    ranks = tier_ranks(template, keys, tuple(tiers))

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        extractor = {k: v for k, v in params.items() if k != HEAD}
        return {"fe": extractor, "round": jnp.int32(0)}, {"head": params[HEAD], "model_state": model_state}

    def broadcast(server_state, tier):
        return {"fe": lowrank.factorize_layers(server_state["fe"], ranks[tier]), "round": server_state["round"] + 1}

    def client_update(message, client_state, data, rng):
        received = {"params": {**message["fe"], HEAD: client_state["head"]}, **client_state["model_state"]}
        with factorized_execution():
            anchors, _ = class_anchors(model, received, data, batch_size)
            lam_t = lambda_at(message["round"], lam, lambda_warmup_rounds)
            step = gradient_step(anchored_loss(model, anchors, lam_t, mu_fro, anchor_loss), optimizer)
            trainable = {"fe": message["fe"], "head": client_state["head"]}
            state = TrainState(trainable, optimizer.init(trainable), client_state["model_state"])
            state, metrics = run_epochs(
                step, state, data, rng, epochs=local_epochs, batch_size=batch_size, drop_last=drop_last
            )
        new_client = {"head": state.params["head"], "model_state": state.model_state}
        return new_client, state.params["fe"], {**metrics, "lambda": lam_t}

    def server_update(server_state, messages, weights):
        fe = reconstruct_and_average(server_state["fe"], messages, weights)
        return {"fe": fe, "round": server_state["round"] + 1}

    def eval_server(server_state, tier):
        """The global FE truncated to the tier's rank (as the tier's clients run it), once per tier."""
        return {"fe": lowrank.reconstruct_layers(lowrank.factorize_layers(server_state["fe"], ranks[tier]))}

    def eval_params(server_view, client_state):
        return {"params": {**server_view["fe"], HEAD: client_state["head"]}, **client_state["model_state"]}

    return FederatedAlgorithm(
        name=name,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        server_update=server_update,
        eval_params=eval_params,
        global_params=None,  # the heads are private: there is no global model
        num_tiers=len(ranks),
        eval_server=eval_server,
    )


def from_config(config, model) -> FederatedAlgorithm:
    layers = [name.strip() for name in config.decompose_layers.split(",") if name.strip()] or None
    return fedara(
        model,
        client_optimizer(config),
        local_epochs=config.local_epochs,
        batch_size=config.batch_size,
        drop_last=config.drop_last,
        tiers=config.tier_ratios(DEFAULT_TIERS),
        lam=config.lambda_,
        lambda_warmup_rounds=config.lambda_warmup_rounds,
        mu_fro=config.mu_fro,
        anchor_loss=config.anchor_loss,
        layers=layers,
    )
