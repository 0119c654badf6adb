"""Heterogeneous client models for the algorithms whose models never leave the client.

FedARA's heterogeneous setting (paper §5) gives its baselines five models of decreasing
complexity, and FedARA derives its own five levels from the largest one by rank ratios. With
``model_tiers`` (one rank ratio per tier; clients split into equal contiguous id blocks, as
FedARA's ``tiers``) a baseline's tier-k clients own the model with FedARA's decomposed layers
(every feature-extractor layer but the first) at tier k's rank: the same levels, so a
comparison with FedARA holds each client's capacity equal. A client's model starts as the
shared initialization truncated to its tier's rank (its truncated SVD), and trains its factors
(a layer its tier keeps at full rank trains its kernel).

Every client's model is held in one shape, padded to the largest tier's ranks
(:func:`~jaxfed.core.lowrank.pad_to_union`: each decomposed layer holds a kernel and factors,
and a switch per layer says whether its kernel runs). Zero factor columns and a switched-off
kernel get no gradient, so they stay zero and each client trains exactly its tier's model;
the tiers run as one vmapped group. Evaluation sees the reconstructed kernels, so any model
and evaluation run unchanged.

:func:`with_model_tiers` wraps an algorithm whose client state holds the client's own model
(FedProto, FedTGP, Local, FedKD's mentors); :func:`model_tiers_option` is the option field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxfed.algorithms.fedara import default_decomposed_layers
from jaxfed.algorithms.fedhm import tier_ranks
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core import lowrank, stack_trees
from jaxfed.errors import ConfigError
from jaxfed.nn import model_template
from jaxfed.nn.factorized import factorized_execution
from jaxfed.nn.layers import head_layer
from jaxfed.options import each, option, rank_ratio


def model_tiers_option():
    """The ``model_tiers`` option field of an algorithm wrapped by :func:`with_model_tiers`."""
    return option(
        (),
        "heterogeneous client models: one rank ratio in (0, 1] per tier (e.g. FedARA's 1,0.5,0.25,0.125,0.0625); "
        "tier k's clients own the model with every feature-extractor layer but the first at tier k's rank; "
        "empty = every client owns the full model",
        source="FedARA paper §5 (heterogeneous models of decreasing complexity)",
        check=each(rank_ratio),
    )


class TieredClient(NamedTuple):
    """A client state of a tiered algorithm: the wrapped algorithm's, and its model's kernel switches."""

    inner: Any  # the wrapped algorithm's client state; its model's decomposed layers padded
    kernel_on: Any  # {layer: float32 scalar}: 1 where the client's tier runs the layer's kernel


def rank_levels(model, ratios, head: str, field: str) -> list[dict[str, int]]:
    """``{layer: rank}`` of FedARA's decomposed layers (every feature-extractor layer but the first)
    at each rank ratio of ``ratios`` (a layer a ratio keeps whole is left out); a model without
    such a layer is a one-line ConfigError naming ``field``."""
    layers = default_decomposed_layers(model, head)
    if not layers:
        raise ConfigError(
            f"{field}: the model has no feature-extractor layer to decompose (a Dense or Conv before the "
            f"head, after the first); leave {field} at its default"
        )
    return tier_ranks(model_template(model)[0], [layers] * len(ratios), ratios)


class ModelTiers:
    """The tiers' ranks over a model's decomposed layers, and the padded form every tier shares."""

    def __init__(self, model, ratios, head: str):
        self.num_tiers = len(ratios)
        self.ranks = rank_levels(model, ratios, head, "model_tiers")
        self.union = lowrank.union_ranks(self.ranks)

    def padded(self, params) -> lowrank.Padded:
        """``params`` (every layer whole) in the shared padded form: kernels on, factors zero."""
        return lowrank.pad_to_union(params, self.union)

    def start(self, padded_params, tier) -> lowrank.Padded:
        """The model of a client of ``tier`` (traced): the whole model in ``padded_params``
        (:meth:`padded`) truncated to the tier's ranks, padded."""
        whole = lowrank.reconstruct_layers(padded_params)
        per_tier = [self.padded_tier(whole, t) for t in range(self.num_tiers)]
        return jax.tree.map(lambda stacked: stacked[tier], stack_trees(per_tier))

    def padded_tier(self, params, tier: int) -> lowrank.Padded:
        """``params`` truncated to tier ``tier``'s ranks (static), in the padded form."""
        return lowrank.pad_to_union(lowrank.factorize_layers(params, self.ranks[tier]), self.union)


# a hook that would read the wrapped client's model, which the wrapper holds padded
UNWRAPPED_HOOKS = ("personalize",)


def with_model_tiers(
    algorithm: FederatedAlgorithm,
    model,
    ratios,
    head: str = "",
    *,
    params_of: Callable[[Any], Any] = lambda state: state.params,
    with_params: Callable[[Any, Any], Any] = lambda state, params: state._replace(params=params),
) -> FederatedAlgorithm:
    """``algorithm`` with heterogeneous client models over ``len(ratios)`` tiers (``ratios``
    empty: ``algorithm`` itself). The wrapped client state holds the client's model parameters
    (``params_of`` / ``with_params`` read and replace them; default: a ``params`` field), and
    the server never sees them; ``head`` is the classifier layer's key (empty: the last Dense)."""
    if not ratios:
        return algorithm
    for hook in UNWRAPPED_HOOKS:
        if getattr(algorithm, hook) is not None:
            raise ConfigError(f"model_tiers: {algorithm.name} has a {hook} hook, which model tiers do not support")
    tiers = ModelTiers(model, ratios, head_layer(model, head, algorithm.name))

    def init(rng):
        server_state, client = algorithm.init(rng)
        padded = tiers.padded(params_of(client))
        return server_state, TieredClient(with_params(client, padded.params), padded.kernel_on)

    def init_client(client: TieredClient, client_id, tier):
        inner = client.inner
        if algorithm.init_client is not None:
            inner = algorithm.init_client(inner, client_id, tier)
        own = tiers.start(params_of(inner), tier)
        return TieredClient(with_params(inner, own.params), own.kernel_on)

    def client_update(message, client: TieredClient, data, rng, info):
        with factorized_execution(client.kernel_on):
            inner, upload, metrics = algorithm.client_update(message, client.inner, data, rng, info)
        return TieredClient(inner, client.kernel_on), upload, metrics

    def eval_params(server_state, client: TieredClient):
        whole = lowrank.reconstruct_padded(lowrank.Padded(params_of(client.inner), client.kernel_on))
        return algorithm.eval_params(server_state, with_params(client.inner, whole))

    # an accounting hook (message, client_state, info) sees the wrapped state, its model padded
    # (FedKD's counts read only its round counter; personalize, which would train the model, is refused)
    def on_inner(hook):
        return None if hook is None else (lambda message, client, info: hook(message, client.inner, info))

    return algorithm._replace(
        init=init,
        init_client=init_client,
        client_update=client_update,
        eval_params=eval_params,
        download_bytes=on_inner(algorithm.download_bytes),
        sent_bytes=on_inner(algorithm.sent_bytes),
        num_tiers=tiers.num_tiers,
        pad_tier=lambda message, info: message,  # every tier receives the same message: one group
    )
