"""Private feature extractors under one global head: LG-FedAvg and FedGH, two of the
heterogeneous-model baselines FedARA's paper measures (HtFLlib's, as its FedTGP and FedKD).

Every client keeps its own model (client state, never uploaded; all start at the same
initialization, or at their tier's model with ``model_tiers`` / ``tier_models``,
:mod:`jaxfed.algorithms.model_tiers`). Only the classifier head (the ``head`` layer, by default the
last Dense) is global. A round: the client puts the server's head in place of its own, trains the
whole model for ``local_epochs`` on cross-entropy, and uploads

- **LG-FedAvg** (Liang et al. 2020, "Think Locally, Act Globally"): its trained head. The server's
  new head is the sample-weighted mean of the round's heads.
- **FedGH** (Yi et al., ACM MM 2023, "Generalized Global Header"): the mean feature (the head's
  input, inference mode) of each class it holds under the trained model, with the class counts and
  its id (FedProto's prototypes). The server trains its head for ``server_epochs`` epochs of SGD at
  ``server_lr`` on the cross-entropy of the head's outputs for the round's prototypes, one example
  per client and class it holds (:func:`~jaxfed.algorithms.prototype_sgd.train_on_prototypes`:
  shuffled each epoch, batches of ``batch_size``, the last partial).

The server's first head is the shared initialization's (HtFLlib: client 0's). A client's
personalized model is its own extractor under the server's current head, the model it would start
its next round from (HtFLlib sends the head to every client, then evaluates: the same model). There
is no global model. Every tier's features must be as wide as the run's model's (the head is
shared). Defaults are HtFLlib's (``system/main.py``: lr 0.01, batch 10, one local epoch; FedGH
``-se 100 -slr 0.01``). Where jaxfed differs from HtFLlib: a client's batches are shuffled every
epoch and keep the last partial one (theirs: the same order, ``drop_last``; an option here), its
prototypes are means over all its training examples, and the server's key
derives from the run's seed and the round.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms.aggregation import averaging
from jaxfed.algorithms.client_rows import with_id
from jaxfed.algorithms.features import class_means
from jaxfed.algorithms.model_tiers import HTFLLIB, HtFLlibTraining, with_model_tiers
from jaxfed.algorithms.prototype_sgd import ClientState, Upload, held_prototypes, server_key, train_on_prototypes
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import train_classifier
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core import lowrank
from jaxfed.core.losses import masked_loss
from jaxfed.nn import split_variables
from jaxfed.nn.layers import dense, head_layer
from jaxfed.options import at_least, non_negative, option, resolve


@dataclasses.dataclass(frozen=True)
class GlobalHeadOptions(HtFLlibTraining):
    """LG-FedAvg's options (FedGH's extend them): the shared head layer, HtFLlib's training defaults,
    the client tiers."""

    head: str = option("", "the classifier head (a Dense layer's key) the clients share; empty = the last")


@dataclasses.dataclass(frozen=True)
class FedGHOptions(GlobalHeadOptions):
    """FedGH's options: LG-FedAvg's, and how the server trains the head on the prototypes."""

    tasks: typing.ClassVar[tuple[str, ...]] = ("classification",)  # prototypes are per class

    server_epochs: int = option(
        100, "epochs of SGD the server trains the global head on the round's prototypes",
        source=HTFLLIB + " (-se 100)", check=at_least(1),
    )  # fmt: skip
    server_lr: float = option(
        0.01, "the server's learning rate for the head (its batches are batch_size prototypes)",
        source=HTFLLIB + " (-slr 0.01)", check=non_negative,
    )  # fmt: skip


class GlobalHead(NamedTuple):
    """LG-FedAvg's server state."""

    head: Any  # the global head, the message down


class FedGHServer(NamedTuple):
    """FedGH's server state."""

    head: Any  # the global head, the message down
    key_data: Any  # the server's key (shuffling), as raw key data


def under_head(params, head: str, global_head):
    """``params`` with the layer ``head`` replaced by ``global_head``."""
    return lowrank.replace_layer(params, head, global_head)


def head_loss(layer, prototypes, labels, mask):
    """FedGH's server loss: the masked mean cross-entropy of the head's outputs for a batch of prototypes."""
    return masked_loss(dense(layer, prototypes), labels, mask)


def _global_head_algorithm(name, model, options, head, *, init_server, upload_of, **server) -> FederatedAlgorithm:
    """The shared client of LG-FedAvg and FedGH: the server's head in, the whole model trained on
    cross-entropy, ``upload_of(params, model_state, data, client_state)`` up; ``server`` its
    ``aggregation`` or ``server_update``, ``init_server(rng, head_layer)`` its first state."""

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        return init_server(rng, lowrank.get_layer(params, head)), ClientState(params, model_state, jnp.int32(0))

    def client_update(global_head, client_state, data, rng, info):
        variables = {"params": under_head(client_state.params, head, global_head), **client_state.model_state}
        variables, metrics = train_classifier(
            model, options.optimizer(info.round), variables, data, rng, **options.batching()
        )
        params, model_state = split_variables(variables)
        upload = upload_of(params, model_state, data, client_state)
        return client_state._replace(params=params, model_state=model_state), upload, metrics

    def eval_params(server_state, client_state):
        params = under_head(client_state.params, head, server_state.head)
        return {"params": params, **client_state.model_state}

    algorithm = FederatedAlgorithm(
        name=name,
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state.head,
        client_update=client_update,
        eval_params=eval_params,
        global_params=None,  # the extractors are private: there is no global model
        init_client=with_id,
        **server,
    )
    return with_model_tiers(algorithm, model, options, head, same_features=True)


def lg_fedavg(model, options: GlobalHeadOptions | None = None, **overrides) -> FederatedAlgorithm:
    """LG-FedAvg: private extractors, the head averaged FedAvg-style."""
    options = resolve(GlobalHeadOptions, options, overrides)
    head = head_layer(model, options.head, "lg_fedavg")
    return _global_head_algorithm(
        "lg_fedavg", model, options, head,
        init_server=lambda rng, layer: GlobalHead(layer),
        upload_of=lambda params, model_state, data, client_state: lowrank.get_layer(params, head),
        aggregation=averaging(lambda server_state, mean, info: GlobalHead(mean)),
    )  # fmt: skip


def fedgh(model, options: FedGHOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedGH: private extractors, a global head the server trains on their class prototypes."""
    options = resolve(FedGHOptions, options, overrides)
    head = head_layer(model, options.head, "fedgh", outputs=True)

    def upload_of(params, model_state, data, client_state):
        means, counts = class_means(model, head, {"params": params, **model_state}, data, options.batch_size)
        return Upload(means, counts, client_state.id)

    def server_update(server_state: FedGHServer, uploads: Upload, weights, info):
        layer = train_on_prototypes(
            server_state.head, head_loss, uploads.means, held_prototypes(uploads, weights), uploads.id,
            server_key(server_state.key_data, info.round),
            epochs=options.server_epochs, batch_size=options.batch_size, lr=options.server_lr,
        )  # fmt: skip
        return server_state._replace(head=layer)

    return _global_head_algorithm(
        "fedgh", model, options, head,
        init_server=lambda rng, layer: FedGHServer(layer, jax.random.key_data(jax.random.fold_in(rng, 2))),
        upload_of=upload_of,
        server_update=server_update,
    )  # fmt: skip


builtin("lg_fedavg", GlobalHeadOptions, lambda model, options, config: lg_fedavg(model, options))
builtin("fedgh", FedGHOptions, lambda model, options, config: fedgh(model, options))
