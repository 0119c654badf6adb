"""Partial sharing: FedAvg over part of the model while the rest stays on each client.

One implementation serves three baselines, which differ only in what stays private and how a
round trains:

- **FedPer** (Arivazhagan et al. 2019): the personalization layers (``personal_layers``, by
  default the classifier ``head``) never leave the client; the base is averaged; every layer
  trains together.
- **FedRep** (Collins et al., ICML 2021): the head is private. A round trains the head for
  ``head_epochs`` with the body frozen, then the body for ``local_epochs`` with the head frozen
  (a fresh optimizer each phase); only the body is uploaded and averaged.
- **FedBN** (Li et al., ICLR 2021): the normalization layers (their scale and bias, and their
  BatchNorm statistics) stay local; everything else is FedAvg. Needs a model with normalization
  layers (``norm=batch`` or ``group`` on resnet8 / vgg8).

The server averages the shared part by sample count (FedAvg's rule). There is no global model:
a client's model is the shared part with its own private layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxfed.algorithms.aggregation import model_averaging
from jaxfed.algorithms.records import GlobalParams
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import train_parameters
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core import lowrank
from jaxfed.errors import ConfigError
from jaxfed.nn import split_variables
from jaxfed.nn.layers import all_layers, head_layer, norm_layers
from jaxfed.options import TrainingOptions, at_least, option, resolve, split_keys

FEDPER = "Arivazhagan et al. 2019, Federated Learning with Personalization Layers"
FEDREP = "Collins et al. (ICML 2021) §5: 10 epochs on the head, 1 on the representation"
FEDBN = "Li et al. (ICLR 2021), FedBN"


class ClientState(NamedTuple):
    personal: dict  # {layer key: that layer's parameters}: the client's private layers
    model_state: Any  # the model's non-trainable collections (BatchNorm statistics), {} when none


def split_layers(params, keys) -> tuple[dict, dict]:
    """``(shared, private)``: ``params`` without the layers ``keys``, and ``{key: layer}`` of them."""
    private = {}
    for key in keys:
        params, private[key] = lowrank.pop_layer(params, key)
    return params, private


def merge_layers(shared, private: dict):
    """The model's parameters: ``shared`` with each private layer put back in its place."""
    for key, layer in private.items():
        shared = lowrank.replace_layer(shared, key, layer)
    return shared


# A round's local training: (model, options, shared, private, model_state, data, rng, round) ->
# (shared, private, model_state, metrics)
LocalTraining = Callable[..., tuple[Any, dict, Any, dict]]


def train_together(model, options, shared, private, model_state, data, rng, round_):
    """Every layer trains together (FedPer, FedBN)."""
    trainable = {"shared": shared, "private": private}
    trained, model_state, metrics = train_parameters(
        model,
        options.optimizer(round_),
        trainable,
        model_state,
        data,
        rng,
        to_params=lambda t: merge_layers(t["shared"], t["private"]),
        **options.batching(),
    )
    return trained["shared"], trained["private"], model_state, metrics


def train_head_then_body(model, options, shared, private, model_state, data, rng, round_):
    """FedRep's round: the private head for ``head_epochs`` with the body frozen, then the body for
    ``local_epochs`` with the head frozen; a fresh optimizer each phase."""
    head_rng, body_rng = jax.random.split(rng)
    batching = {**options.batching(), "epochs": options.head_epochs}

    def phase(trainable, to_params, key, **batching):
        return train_parameters(
            model, options.optimizer(round_), trainable, model_state, data, key, to_params=to_params, **batching
        )

    private, model_state, head_metrics = phase(private, lambda head: merge_layers(shared, head), head_rng, **batching)
    batching["epochs"] = options.local_epochs
    shared, model_state, metrics = phase(shared, lambda body: merge_layers(body, private), body_rng, **batching)
    return shared, private, model_state, {**metrics, "steps": metrics["steps"] + head_metrics["steps"]}


def partially_shared(model, options, private_keys: list[str], train: LocalTraining, *, name: str) -> FederatedAlgorithm:
    """FedAvg over the layers not in ``private_keys``; those stay in each client's state.
    ``train`` is a round's local training (:func:`train_together`, :func:`train_head_then_body`)."""

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        shared, private = split_layers(params, private_keys)
        return GlobalParams(shared), ClientState(private, model_state)

    def broadcast(server_state, info):
        return server_state.params

    def client_update(shared, client_state, data, rng, info):
        shared, private, model_state, metrics = train(
            model, options, shared, client_state.personal, client_state.model_state, data, rng, info.round
        )
        return ClientState(private, model_state), shared, metrics

    def eval_params(server_state, client_state):
        return {"params": merge_layers(server_state.params, client_state.personal), **client_state.model_state}

    return FederatedAlgorithm(
        name=name,
        options=options,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        aggregation=model_averaging(),
        eval_params=eval_params,
        global_params=None,  # the private layers have no global value
    )


@dataclasses.dataclass(frozen=True)
class FedPerOptions(TrainingOptions):
    """FedPer's options: which layers stay on the client."""

    personal_layers: str = option(
        "",
        "the personalization layers (comma-separated layer keys); empty = the classifier head",
        source=FEDPER + " (the top layers; here the head by default)",
    )


@dataclasses.dataclass(frozen=True)
class FedRepOptions(TrainingOptions):
    """FedRep's options: the head's epochs before the body's (``local_epochs``)."""

    local_epochs: int = option(1, "epochs on the body (representation), after the head's", source=FEDREP)
    head_epochs: int = option(10, "epochs on the private head, body frozen, first", source=FEDREP, check=at_least(1))
    head: str = option("", "the private head (a Dense layer's key); empty = the last Dense called")


@dataclasses.dataclass(frozen=True)
class FedBNOptions(TrainingOptions):
    """FedAvg's client training; the normalization layers stay local."""


def personal_layer_keys(model, text: str) -> list[str]:
    """FedPer's private layers: the keys in ``text`` (each a Dense / Conv / normalization layer the
    forward pass calls), or the head when empty; one-line ConfigErrors otherwise."""
    keys = list(split_keys(text))
    if not keys:
        return [head_layer(model, algorithm="fedper")]
    known = [key for key, _ in all_layers(model)]
    unknown = [key for key in keys if key not in known]
    if unknown:
        raise ConfigError(f"personal_layers: {', '.join(unknown)} not layers of the model; allowed: {', '.join(known)}")
    return keys


def fedper(model, options: FedPerOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedPer: the base averaged, the personalization layers (default: the head) kept by each client."""
    options = resolve(FedPerOptions, options, overrides)
    return partially_shared(model, options, personal_layer_keys(model, options.personal_layers), train_together,
                            name="fedper")  # fmt: skip


def fedrep(model, options: FedRepOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedRep: the head trained first and kept private, then the body trained and averaged."""
    options = resolve(FedRepOptions, options, overrides)
    return partially_shared(model, options, [head_layer(model, options.head, "fedrep")], train_head_then_body,
                            name="fedrep")  # fmt: skip


def fedbn(model, options: FedBNOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedBN: FedAvg with every normalization layer (and its statistics) kept by each client."""
    options = resolve(FedBNOptions, options, overrides)
    keys = norm_layers(model)
    if not keys:
        raise ConfigError(
            f"fedbn: model {model.name or type(model.module).__name__} has no normalization layer; "
            "pick one that has (e.g. model=resnet8 or vgg8, with norm=batch or group)"
        )
    return partially_shared(model, options, keys, train_together, name="fedbn")


builtin("fedper", FedPerOptions, lambda model, options, config: fedper(model, options))
builtin("fedrep", FedRepOptions, lambda model, options, config: fedrep(model, options))
builtin("fedbn", FedBNOptions, lambda model, options, config: fedbn(model, options))
