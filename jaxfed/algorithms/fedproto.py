"""FedProto (Tan et al., AAAI 2022): models stay on the clients, class prototypes are shared.

Every client keeps its own model (client state; all start at the same initialization) and
never uploads it. A round: the client trains its model for ``local_epochs`` on
``CE + lambda * || f(x) - P_y ||^2``, ``f(x)`` the model's features (the ``head``'s input) and
``P_y`` the global prototype of the example's class (the squared distance averaged over the
feature dimensions and the batch, torch's ``MSELoss`` as the authors use; no term for a class
without a global prototype, as in round 1). It then uploads its prototypes: the mean feature of
each class over its training examples under the trained model, with the class counts. The
server's prototype of a class is the count-weighted mean of the round's uploaded prototypes of
that class (Eq. 6); a class no client of the round holds has none that round.

A client's personalized model is its own model; there is no global model. With ``model_tiers``
(rank levels) or ``tier_models`` (architectures) the clients' models are heterogeneous
(:mod:`jaxfed.algorithms.model_tiers`). (The paper also classifies by the nearest global
prototype; jaxfed evaluates the model's own head.)
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxfed.algorithms.features import class_means
from jaxfed.algorithms.model_tiers import model_tiers_option, tier_models_option, with_model_tiers
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import fit
from jaxfed.contract import Aggregation, FederatedAlgorithm
from jaxfed.core import lowrank, mean_of, weighted_share
from jaxfed.core.losses import masked_loss, masked_mean
from jaxfed.nn import model_template, split_variables
from jaxfed.nn.layers import head_input, head_layer
from jaxfed.options import TrainingOptions, non_negative, option, resolve

PAPER = "Tan et al. (AAAI 2022), FedProto"


@dataclasses.dataclass(frozen=True)
class FedProtoOptions(TrainingOptions):
    """FedProto's options: the prototype term's weight and the layer whose input is the feature."""

    tasks: typing.ClassVar[tuple[str, ...]] = ("classification",)  # prototypes are per class

    lambda_: float = option(
        1.0,
        "weight lambda of the distance of each example's features to its class's global prototype",
        source=PAPER + " (the authors' code: --ld 1)",
        check=non_negative,
    )
    head: str = option("", "the classifier head (a Dense layer's key) whose input is the feature; empty = the last")
    model_tiers: tuple[float, ...] = model_tiers_option()
    tier_models: tuple[str, ...] = tier_models_option()


class Prototypes(NamedTuple):
    """The server state and the message down: a prototype per class, and which classes have one."""

    means: Any  # [classes, features]
    present: Any  # [classes] bool


class Upload(NamedTuple):
    means: Any  # [classes, features]: the client's mean feature of each class (0 where it has none)
    counts: Any  # [classes]: its training examples of each class


class ClientState(NamedTuple):
    params: Any  # the client's own model
    model_state: Any  # its non-trainable collections (BatchNorm statistics), {} when none


def prototype_distance(features, prototypes: Prototypes, labels, mask):
    """The masked mean over examples of ``mean_d (f_d - P_{y,d})^2``, 0 for classes without a prototype."""
    squared = jnp.mean(jnp.square(features - prototypes.means[labels]), axis=-1)
    return masked_mean(jnp.where(prototypes.present[labels], squared, 0.0), mask)


def prototype_client_update(model, head: str, options: FedProtoOptions):
    """FedProto's client step, which FedTGP's client takes too: train the client's own model on
    ``CE + lambda * prototype_distance`` for ``local_epochs``, then upload its class means (the
    features of its training examples under the trained model, inference mode) and counts.
    The message down is the global :class:`Prototypes`."""

    def loss_for(prototypes):
        def loss(params, model_state, batch):
            variables = {"params": params, **model_state}
            (z, logits), new_state = head_input(
                model, head, variables, batch.x, train=True, mask=batch.mask, rng=batch.key
            )
            pull = prototype_distance(z, prototypes, batch.y, batch.mask)
            return masked_loss(logits, batch.y, batch.mask) + options.lambda_ * pull, new_state

        return loss

    def client_update(prototypes, client_state, data, rng, info):
        params, model_state, metrics = fit(
            loss_for(prototypes), options.optimizer(info.round), client_state.params, client_state.model_state,
            data, rng, **options.batching(),
        )  # fmt: skip
        means, counts = class_means(model, head, {"params": params, **model_state}, data, options.batch_size)
        return ClientState(params, model_state), Upload(means, counts), metrics

    return client_update


def fedproto(model, options: FedProtoOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedProto: private models pulled toward the global class prototypes, which are all they share."""
    options = resolve(FedProtoOptions, options, overrides)
    head = head_layer(model, options.head, "fedproto")
    feature_dim, num_classes = lowrank.get_layer(model_template(model)[0], head)["kernel"].shape

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        empty = Prototypes(jnp.zeros((num_classes, feature_dim)), jnp.zeros((num_classes,), bool))
        return empty, ClientState(params, model_state)

    client_update = prototype_client_update(model, head, options)

    def contribute(server_state, upload, weight, info):
        return weighted_share(upload.means, upload.counts)  # each class's prototype weighted by its count

    def apply(server_state, total, info):
        return Prototypes(mean_of(total), total.weight > 0)

    algorithm = FederatedAlgorithm(
        name="fedproto",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state,
        client_update=client_update,
        aggregation=Aggregation(contribute, apply),
        eval_params=lambda server_state, client_state: {"params": client_state.params, **client_state.model_state},
        global_params=None,  # the models are private: there is no global model
    )
    return with_model_tiers(algorithm, model, options, head, same_features=True)


builtin("fedproto", FedProtoOptions, lambda model, options, config: fedproto(model, options))
