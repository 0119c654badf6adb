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

With ``tier_models`` instead (one model per tier, e.g. ``htcnn1,...,htcnn5``: the five CNNs of
decreasing complexity that FedARA's heterogeneous baselines run), tier k's clients own a model
of its own architecture: it sits in the run's model (the largest, of the same layer names) with
its parameters in the leading units and zeros elsewhere (:mod:`jaxfed.nn.nesting`), so the tiers
again share one shape and one vmapped group, and the padding gets no gradient. A client starts
at its tier model's own initialization (one draw per tier and run) and is evaluated on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxfed.algorithms.fedara import default_decomposed_layers
from jaxfed.algorithms.fedhm import tier_ranks
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core import lowrank, stack_trees
from jaxfed.errors import ConfigError
from jaxfed.nn import CONV_IMPLS, MODELS, NORMS, Model, built_in_setting, get_model, model_template, user
from jaxfed.nn.factorized import factorized_execution
from jaxfed.nn.layers import head_layer
from jaxfed.nn.models import NORMED_MODELS
from jaxfed.nn.nesting import nesting
from jaxfed.options import TrainingOptions, at_least, each, non_negative, option, rank_ratio

HTFLLIB = "HtFLlib (TsingZ0/HtFLlib, FedARA's heterogeneous baselines) system/main.py"


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


def model_name(value):
    """A check: ``value`` names a built-in model or a user's Flax module spec."""
    if value in MODELS or user.is_spec(value):
        return None
    return f"a model must be a built-in ({', '.join(MODELS)}) or {user.FORMS}"


def tier_models_option():
    """The ``tier_models`` option field of an algorithm wrapped by :func:`with_model_tiers`."""
    return option(
        (),
        "heterogeneous client models by architecture: one model per tier (e.g. htcnn1,htcnn2,htcnn3,htcnn4,htcnn5, "
        "FedARA's CNN1-CNN5); each sits in the run's model, which must be the largest with the same layer names; "
        "empty = every client owns the run's model",
        source="FedARA paper §5 (its baselines' five CNNs of decreasing complexity: Yi et al.'s CNN-1..CNN-5)",
        check=each(model_name),
    )


@dataclasses.dataclass(frozen=True)
class HtFLlibTraining(TrainingOptions):
    """The client training of HtFLlib's heterogeneous baselines (``system/main.py``: lr 0.01, batch
    10, one local epoch) and the client tiers: the options LG-FedAvg, FedGH and FML build on."""

    lr: float = option(0.01, "client learning rate (0 freezes what the client trains)", source=HTFLLIB + " (-lr 0.01)",
                       check=non_negative)  # fmt: skip
    batch_size: int = option(10, "local batch size", source=HTFLLIB + " (-lbs 10)", check=at_least(1))
    local_epochs: int = option(1, "local epochs per round", source=HTFLLIB + " (-ls 1)", check=at_least(1))
    model_tiers: tuple[float, ...] = model_tiers_option()
    tier_models: tuple[str, ...] = tier_models_option()


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


class ArchitectureClient(NamedTuple):
    """A client state of an algorithm with tiers of different architectures: the wrapped
    algorithm's (its model in the run's model's shapes), and the key its tier's start was drawn from."""

    inner: Any
    start_key: jax.Array  # uint32 key data: tier k's model starts at its initialization from fold_in(key, k)


class ArchitectureTiers:
    """One model per tier, each nested in the run's model (:func:`jaxfed.nn.nesting.nesting`)."""

    FIELD = "tier_models"

    def __init__(self, model: Model, names, head: str, same_features: bool):
        features, classes = head_shape(model, head)
        self.models = [model_like(name, model, classes, self.FIELD) for name in names]
        self.nestings = [nesting(tier, model, self.FIELD, name) for tier, name in zip(self.models, names)]
        for name, tier in zip(names, self.models):
            width = head_shape(tier, head)[0]
            if same_features and width != features:
                raise ConfigError(
                    f"{self.FIELD}: {name} gives its head {width} features, the run's model {model.name} {features}; "
                    "this algorithm's losses span the run's features, so every tier's must match"
                )
        for name, nested in zip(names, self.nestings):
            nested.check(head, self.FIELD, name)
        self.num_tiers = len(self.models)

    def start(self, key_data, tier):
        """The embedded parameters a client of ``tier`` (traced) starts at."""
        key = jax.random.wrap_key_data(key_data)
        starts = [
            nested.embed(tier_model.init(jax.random.fold_in(key, k))["params"])
            for k, (tier_model, nested) in enumerate(zip(self.models, self.nestings))
        ]
        return jax.tree.map(lambda stacked: stacked[tier], stack_trees(starts))


def head_shape(model: Model, head: str) -> tuple[int, int]:
    """``(features, outputs)`` of ``model``'s head layer."""
    return tuple(lowrank.get_layer(model_template(model)[0], head)["kernel"].shape)


def model_like(name: str, model: Model, classes: int, field: str) -> Model:
    """The model ``name`` for the run's inputs and ``classes`` outputs, with the run's model's
    normalization and convolutions where it is a built-in (a ConfigError naming ``field``)."""
    norm = built_in_setting(model, "norm", NORMS, "group") if name in NORMED_MODELS else "group"
    conv = built_in_setting(model, "conv", CONV_IMPLS, "patches")
    try:
        return get_model(name, model.input_shape, classes, norm=norm, conv=conv)
    except ConfigError as err:  # "model: ..." about the tier's model
        raise ConfigError(f"{field}: {str(err).removeprefix('model: ')}") from None


# a hook that would read the wrapped client's model, which the wrapper holds padded
UNWRAPPED_HOOKS = ("personalize",)


def with_model_tiers(
    algorithm: FederatedAlgorithm,
    model,
    options,
    head: str = "",
    *,
    same_features: bool = False,
    params_of: Callable[[Any], Any] = lambda state: state.params,
    with_params: Callable[[Any, Any], Any] = lambda state, params: state._replace(params=params),
) -> FederatedAlgorithm:
    """``algorithm`` with heterogeneous client models over the tiers its ``options`` give: rank
    levels of the run's model (``model_tiers``) or models (``tier_models``; both empty:
    ``algorithm`` itself). The wrapped
    client state holds the client's model parameters (``params_of`` / ``with_params`` read and
    replace them; default: a ``params`` field), and the server never sees them; ``head`` is the
    classifier layer's key (empty: the last Dense). ``same_features``: the algorithm's losses span
    the run's features (exchanged prototypes, FedKD's projection), so every tier model must give
    the head as many as the run's model (a narrower one's padded features would enter them)."""
    ratios, tier_models = options.model_tiers, options.tier_models
    if not ratios and not tier_models:
        return algorithm
    if ratios and tier_models:
        raise ConfigError("model_tiers, tier_models: set one (rank levels of the run's model, or models per tier)")
    field = "model_tiers" if ratios else ArchitectureTiers.FIELD
    for hook in UNWRAPPED_HOOKS:
        if getattr(algorithm, hook) is not None:
            raise ConfigError(f"{field}: {algorithm.name} has a {hook} hook, which model tiers do not support")
    head = head_layer(model, head, algorithm.name)
    if tier_models:
        tiers = ArchitectureTiers(model, tier_models, head, same_features)
        return _with_architectures(algorithm, tiers, with_params)
    tiers = ModelTiers(model, ratios, head)

    def init(rng):
        server_state, client = algorithm.init(rng)
        padded = tiers.padded(params_of(client))
        return server_state, TieredClient(with_params(client, padded.params), padded.kernel_on)

    def init_client(client: TieredClient, client_id, tier):
        inner = _inner_init(algorithm, client.inner, client_id, tier)
        own = tiers.start(params_of(inner), tier)
        return TieredClient(with_params(inner, own.params), own.kernel_on)

    def client_update(message, client: TieredClient, data, rng, info):
        with factorized_execution(client.kernel_on):
            inner, upload, metrics = algorithm.client_update(message, client.inner, data, rng, info)
        return TieredClient(inner, client.kernel_on), upload, metrics

    def eval_params(server_state, client: TieredClient):
        whole = lowrank.reconstruct_padded(lowrank.Padded(params_of(client.inner), client.kernel_on))
        return algorithm.eval_params(server_state, with_params(client.inner, whole))

    return _tiered(algorithm, tiers.num_tiers, init, init_client, client_update, eval_params)


def _with_architectures(algorithm: FederatedAlgorithm, tiers: ArchitectureTiers, with_params):
    """``algorithm`` whose tier-k clients own ``tiers.models[k]``, held in the run's model's shapes:
    the wrapped algorithm trains and evaluates it unchanged (the padding stays zero)."""

    def init(rng):
        server_state, client = algorithm.init(rng)
        return server_state, ArchitectureClient(client, jax.random.key_data(jax.random.fold_in(rng, 1)))

    def init_client(client: ArchitectureClient, client_id, tier):
        inner = _inner_init(algorithm, client.inner, client_id, tier)
        return ArchitectureClient(with_params(inner, tiers.start(client.start_key, tier)), client.start_key)

    def client_update(message, client: ArchitectureClient, data, rng, info):
        inner, upload, metrics = algorithm.client_update(message, client.inner, data, rng, info)
        return client._replace(inner=inner), upload, metrics

    def eval_params(server_state, client: ArchitectureClient):
        return algorithm.eval_params(server_state, client.inner)

    return _tiered(algorithm, tiers.num_tiers, init, init_client, client_update, eval_params)


def _inner_init(algorithm: FederatedAlgorithm, inner, client_id, tier):
    """The wrapped algorithm's own start of a client (its ``init_client``, where it has one)."""
    return inner if algorithm.init_client is None else algorithm.init_client(inner, client_id, tier)


def _tiered(algorithm: FederatedAlgorithm, num_tiers: int, init, init_client, client_update, eval_params):
    """``algorithm`` over ``num_tiers`` tiers of client models, its client state wrapped (the
    wrapped algorithm's as ``.inner``) by the given hooks. Every tier receives the same message, so
    the tiers run as one group; an accounting hook (message, client_state, info) sees the wrapped
    state (FedKD's counts read only its round counter; personalize, which would train the model,
    is refused)."""

    def on_inner(hook):
        return None if hook is None else (lambda message, client, info: hook(message, client.inner, info))

    return algorithm._replace(
        init=init,
        init_client=init_client,
        client_update=client_update,
        eval_params=eval_params,
        download_bytes=on_inner(algorithm.download_bytes),
        sent_bytes=on_inner(algorithm.sent_bytes),
        num_tiers=num_tiers,
        pad_tier=lambda message, info: message,
    )
