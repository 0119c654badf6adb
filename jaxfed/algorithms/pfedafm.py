"""pFedAFM (Yi et al. 2024, "Adaptive Feature Mixture for Batch-Level Personalization in
Heterogeneous Federated Learning", arXiv 2404.17847): a small shared feature extractor beside each
client's private model, their features mixed by a private weight vector. One of the mutual-learning
baselines FedARA's paper sets itself against (with pFedES: "an extra small, homogeneous feature
extractor on each client").

Every client keeps its local model ``F`` (the run's model; with ``model_tiers`` its tier's rank
level, with ``tier_models`` its tier's model, :mod:`jaxfed.algorithms.model_tiers`) and a weight
vector ``alpha`` (one weight per feature, ones at the start). The server holds the global feature
extractor ``G``: the layers of ``global_model`` before its head (the authors': their smallest CNN,
``htcnn5``), which must give as many features as the local model's head takes. The client's
prediction mixes both extractors' features under its own head ``h``:

    h(alpha * f(x) + (1 - alpha) * g(x))

A round, from the server's ``G``: (1) ``G`` frozen (inference mode), the local model and ``alpha``
train for ``local_epochs`` on the cross-entropy of that prediction, ``alpha`` at ``mix_lr`` and
projected onto [0, 1] after every step; (2) the local model frozen, ``G`` trains for
``local_epochs`` on the cross-entropy of ``h(g(x))`` (the local head on ``G``'s features alone).
It uploads ``G`` (without its unused head); the server's new ``G`` is the sample-weighted mean. A
client's personalized model is the mixture with the server's current ``G``; there is no global
model (the heads are private).

Defaults are the authors' code (``pFedAFM_mh.py``: SGD lr 0.01, momentum 0.9, weight decay 1e-3,
gradients clipped to norm 50, batch 512, 10 epochs per phase; ``alpha``: lr 0.01, the same momentum
and decay, not clipped). Where jaxfed differs from the authors' code: each phase makes a fresh
optimizer (theirs keeps one for ``G`` and one for ``alpha`` across every client and round, the
momentum carried from one client to the next), the server weighs by training examples (theirs by
all of a client's examples), ``G``'s BatchNorm statistics, where it has any, stay on each client,
``G`` runs in inference mode in phase 1 and in evaluation (theirs never leaves train mode), each
client keeps its own ``alpha`` (theirs stores one shared parameter object, so each client starts
from the previous client's), and a client is evaluated with the server's ``G`` after the round's
mean (theirs right after phase 1).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxfed.algorithms.aggregation import averaging
from jaxfed.algorithms.model_tiers import (
    head_shape,
    model_like,
    model_name,
    model_tiers_option,
    tier_models_option,
    with_model_tiers,
)
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import fit, per_key, projected
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core import lowrank
from jaxfed.core.losses import masked_loss
from jaxfed.errors import ConfigError
from jaxfed.nn import model_template, split_variables
from jaxfed.nn.layers import dense, head_input, head_layer
from jaxfed.options import (
    TrainingOptions,
    at_least,
    client_optimizer,
    momentum_coefficient,
    non_negative,
    option,
    resolve,
)

CODE = "the authors' code (LipingYi/pFedAFM, pFedAFM_mh.py)"


@dataclasses.dataclass(frozen=True)
class PFedAFMOptions(TrainingOptions):
    """pFedAFM's options: the shared extractor's model, alpha's learning rate, the authors' training."""

    tasks: typing.ClassVar[tuple[str, ...]] = ("classification",)  # the head's cross-entropy on G's features

    lr: float = option(0.01, "client learning rate of F and G (0 freezes both; alpha trains at mix_lr)",
                       source=CODE + " (--lr)", check=non_negative)  # fmt: skip
    momentum: float = option(0.9, "client SGD momentum, in [0, 1)", source=CODE, check=momentum_coefficient)
    weight_decay: float = option(0.001, "client weight decay (the mixing weights' too)", source=CODE + " (--wd)",
                                 check=non_negative)  # fmt: skip
    clip_norm: float = option(
        50.0, "clip each gradient of the local model and of G to this norm; 0 = off", source=CODE, check=non_negative
    )
    batch_size: int = option(512, "local batch size", source=CODE + " (--batch-size)", check=at_least(1))
    local_epochs: int = option(10, "epochs of each phase per round", source=CODE + " (--epochs)", check=at_least(1))
    head: str = option("", "the local model's classifier head (a Dense layer's key); empty = the last")
    global_model: str = option(
        "", "the model whose layers before its head are the shared extractor G (empty = the run's model); "
        "its head input must be as wide as the local model's", source=CODE + " (CNN_5_homo_AFM: htcnn5)",
        check=lambda value: None if value == "" else model_name(value),
    )  # fmt: skip
    mix_lr: float = option(0.01, "learning rate of the mixing weights alpha", source=CODE + " (lr_alpha)",
                           check=non_negative)  # fmt: skip
    model_tiers: tuple[float, ...] = model_tiers_option()
    tier_models: tuple[str, ...] = tier_models_option()


class GlobalExtractor(NamedTuple):
    """The server state and the message down."""

    params: Any  # G's parameters, its head left out


class ClientState(NamedTuple):
    params: Any  # the local model, the client's own
    model_state: Any  # its non-trainable collections (BatchNorm statistics), {} when none
    mix: jax.Array  # alpha [features]: the local features' share, per feature
    extractor_state: Any  # G's non-trainable collections, kept on the client


class Extractor(NamedTuple):
    """A model's layers before its head, applied as the features its head would receive."""

    model: Any
    head: str
    head_template: Any  # zeros of the head layer: the forward pass needs one, its output is unused

    @classmethod
    def of(cls, model) -> Extractor:
        head = head_layer(model, "", "pfedafm")
        params = model_template(model)[0]
        template = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), lowrank.get_layer(params, head))
        return cls(model, head, template)

    def split(self, params):
        """``params`` without the head layer."""
        return lowrank.pop_layer(params, self.head)[0]

    def features(self, params, state, x, *, train: bool, mask=None, rng=None):
        """``(features, new state)`` of the extractor ``params`` (no head) for ``x``."""
        variables = {"params": lowrank.replace_layer(params, self.head, self.head_template), **state}
        (features, _), new_state = head_input(self.model, self.head, variables, x, train=train, mask=mask, rng=rng)
        return features, new_state


class FeatureMixture(NamedTuple):
    """A client's pFedAFM model: ``h(alpha f(x) + (1 - alpha) g(x))``.

    Variables: ``{"params": {"local": F's params, "extractor": G's, "mix": alpha}, "state":
    {"local": F's collections, "extractor": G's}}``."""

    model: Any
    head: str
    extractor: Extractor

    @property
    def name(self) -> str:
        return f"{self.model.name} mixed with {self.extractor.model.name}'s features"

    def apply(self, variables, x, *, train: bool = False, mask=None, rng=None):
        params, state = variables["params"], variables["state"]
        local_rng, extractor_rng = (None, None) if rng is None else jax.random.split(rng)
        local_variables = {"params": params["local"], **state["local"]}
        (local, _), local_state = head_input(
            self.model, self.head, local_variables, x, train=train, mask=mask, rng=local_rng
        )
        shared, extractor_state = self.extractor.features(
            params["extractor"], state["extractor"], x, train=train, mask=mask, rng=extractor_rng
        )
        outputs = mixed_outputs(lowrank.get_layer(params["local"], self.head), params["mix"], local, shared)
        return outputs, {"local": local_state, "extractor": extractor_state}


def mixed_outputs(head, mix, local, shared):
    """The head's outputs for the features ``mix * local + (1 - mix) * shared``."""
    return dense(head, mix * local + (1 - mix) * shared)


def check_global_model(model, head: str, extractor: Extractor, field: str = "global_model") -> None:
    """A one-line ConfigError unless G gives as many features as the local model's head takes."""
    width, shared = head_shape(model, head)[0], head_shape(extractor.model, extractor.head)[0]
    if width != shared:
        raise ConfigError(
            f"{field}: {extractor.model.name} gives {shared} features, the run's model {model.name}'s head takes "
            f"{width}; pFedAFM mixes the two, so they must match"
        )


def pfedafm(model, options: PFedAFMOptions | None = None, **overrides) -> FederatedAlgorithm:
    """pFedAFM: a shared small feature extractor mixed into private models by private weights."""
    options = resolve(PFedAFMOptions, options, overrides)
    head = head_layer(model, options.head, "pfedafm", outputs=True)
    classes = head_shape(model, head)[1]
    global_model = model_like(options.global_model, model, classes, "global_model") if options.global_model else model
    extractor = Extractor.of(global_model)
    check_global_model(model, head, extractor)
    mixture = FeatureMixture(model, head, extractor)

    def init(rng):
        local_rng, extractor_rng = jax.random.split(rng)
        params, model_state = split_variables(model.init(local_rng))
        shared, extractor_state = split_variables(global_model.init(extractor_rng))
        mix = jnp.ones((head_shape(model, head)[0],), jnp.float32)
        return GlobalExtractor(extractor.split(shared)), ClientState(params, model_state, mix, extractor_state)

    def local_loss(trainable, states, batch):  # phase 1: G frozen, in inference mode
        shared, _ = extractor.features(states["shared"], states["extractor"], batch.x, train=False)
        (local, _), local_state = head_input(
            model, head, {"params": trainable["local"], **states["local"]}, batch.x,
            train=True, mask=batch.mask, rng=batch.key,
        )  # fmt: skip
        outputs = mixed_outputs(lowrank.get_layer(trainable["local"], head), trainable["mix"], local, shared)
        return masked_loss(outputs, batch.y, batch.mask), {**states, "local": local_state}

    def extractor_loss(shared, states, batch):  # phase 2: the local model frozen, its head on G's features
        features, extractor_state = extractor.features(
            shared, states["extractor"], batch.x, train=True, mask=batch.mask, rng=batch.key
        )
        outputs = dense(states["head"], features)
        return masked_loss(outputs, batch.y, batch.mask), {**states, "extractor": extractor_state}

    def mix_optimizer():
        kind, decay = options.client_optimizer, options.weight_decay
        step = client_optimizer(kind, options.mix_lr, momentum=options.momentum, weight_decay=decay)
        return optax.chain(step, projected(optax.projections.projection_hypercube))

    def client_update(message: GlobalExtractor, client: ClientState, data, rng, info):
        local_rng, extractor_rng = jax.random.split(rng)
        optimizer = per_key({"local": options.optimizer(info.round), "mix": mix_optimizer()})
        frozen_extractor = {"shared": message.params, "local": client.model_state, "extractor": client.extractor_state}
        trained, states, metrics = fit(
            local_loss, optimizer, {"local": client.params, "mix": client.mix}, frozen_extractor, data, local_rng,
            **options.batching(),
        )  # fmt: skip
        frozen_model = {"head": lowrank.get_layer(trained["local"], head), "extractor": client.extractor_state}
        shared, frozen_model, extractor_metrics = fit(
            extractor_loss, options.optimizer(info.round), message.params, frozen_model, data, extractor_rng,
            **options.batching(),
        )  # fmt: skip
        client = ClientState(trained["local"], states["local"], trained["mix"], frozen_model["extractor"])
        return client, shared, {**metrics, "steps": metrics["steps"] + extractor_metrics["steps"]}

    def eval_params(server_state: GlobalExtractor, client: ClientState):
        return {
            "params": {"local": client.params, "extractor": server_state.params, "mix": client.mix},
            "state": {"local": client.model_state, "extractor": client.extractor_state},
        }

    algorithm = FederatedAlgorithm(
        name="pfedafm",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state,
        client_update=client_update,
        aggregation=averaging(lambda server_state, mean, info: GlobalExtractor(mean)),
        eval_params=eval_params,
        global_params=None,  # the heads are private: there is no global model
        eval_model=mixture,
    )
    return with_model_tiers(algorithm, model, options, head, same_features=True)


builtin("pfedafm", PFedAFMOptions, lambda model, options, config: pfedafm(model, options))
