"""FedBABU (Oh et al., ICLR 2022): only the body is trained and averaged; the head is fine-tuned at evaluation.

The classifier ``head`` (a Dense layer) stays at its random initialization through federated
training, the same for every client: a round trains the body alone with the head fixed, uploads
the body, and the server averages the bodies by sample count (FedAvg's rule). At evaluation each
client fine-tunes the global model on its own training data for ``finetune_epochs`` (the whole
model by default, or only the head or the body: ``finetune``) with the client optimizer
(``client_optimizer``, fresh) at the client learning rate ``lr``
(not a schedule's value at the last round, which a cosine may have taken to ``lr_min``) and is
evaluated with the result
(the algorithm's ``personalize``); nothing of the fine-tuning is kept or uploaded. The global
model is the averaged body with the initial head.
"""

from __future__ import annotations

import dataclasses
import typing

from jaxfed.algorithms.aggregation import averaging
from jaxfed.algorithms.partial import merge_layers, split_layers
from jaxfed.algorithms.records import ClientStats, GlobalParams, global_model
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import train_parameters
from jaxfed.contract import FederatedAlgorithm
from jaxfed.nn import split_variables
from jaxfed.nn.layers import head_layer
from jaxfed.options import TrainingOptions, non_negative, one_of, option, resolve

PAPER = "Oh et al. (ICLR 2022), FedBABU"
FINETUNED = ("full", "head", "body")


@dataclasses.dataclass(frozen=True)
class FedBABUOptions(TrainingOptions):
    """FedBABU's options: the fixed head, and the fine-tuning each client does before evaluation."""

    tasks: typing.ClassVar[tuple[str, ...]] = ("classification",)  # a classifier head

    head: str = option("", "the head fixed at its initialization (a Dense layer's key); empty = the last Dense")
    finetune_epochs: int = option(
        5,
        "epochs each client fine-tunes the global model on its training data before it is evaluated (with the "
        "client optimizer at lr)",
        source=PAPER + " §4: personalization by fine-tuning for tau_f = 5 epochs",
        check=non_negative,
    )
    finetune: str = option(
        "full",
        "what the fine-tuning trains: full (the whole model), head or body",
        source=PAPER + " (the whole model, the paper's FedBABU; head and body are its ablations)",
        check=one_of(*FINETUNED),
    )


def fedbabu(model, options: FedBABUOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedBABU: the body trained and averaged under a fixed random head, fine-tuned per client for evaluation."""
    options = resolve(FedBABUOptions, options, overrides)
    head = head_layer(model, options.head, "fedbabu")

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        return GlobalParams(params), ClientStats(model_state)

    def train_part(params, part: str, model_state, data, rng, optimizer, epochs):
        """``params`` with ``part`` (full, head or body) trained for ``epochs``, the rest fixed."""
        batching = {**options.batching(), "epochs": epochs}
        if part == "full":
            return train_parameters(model, optimizer, params, model_state, data, rng, **batching)
        body, head_params = split_layers(params, [head])
        if part == "body":
            trainable, merge = body, lambda trained: merge_layers(trained, head_params)
        else:
            trainable, merge = head_params, lambda trained: merge_layers(body, trained)
        trained, model_state, metrics = train_parameters(
            model, optimizer, trainable, model_state, data, rng, to_params=merge, **batching
        )
        return merge(trained), model_state, metrics

    def client_update(params, client_state, data, rng, info):
        optimizer = options.optimizer(info.round)
        trained, model_state, metrics = train_part(
            params, "body", client_state.model_state, data, rng, optimizer, options.local_epochs
        )
        return ClientStats(model_state), split_layers(trained, [head])[0], metrics

    def finish(server_state, mean_body, info):
        return GlobalParams(merge_layers(mean_body, split_layers(server_state.params, [head])[1]))

    def personalize(server_state, client_state, data, rng, info):
        params, model_state, _ = train_part(
            server_state.params, options.finetune, client_state.model_state, data, rng,
            options.optimizer(), options.finetune_epochs,
        )  # fmt: skip
        return {"params": params, **model_state}

    return FederatedAlgorithm(
        name="fedbabu",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state.params,
        client_update=client_update,
        aggregation=averaging(finish),
        eval_params=lambda server_state, client_state: {"params": server_state.params, **client_state.model_state},
        global_params=global_model(model),
        personalize=personalize,
    )


builtin("fedbabu", FedBABUOptions, lambda model, options, config: fedbabu(model, options))
