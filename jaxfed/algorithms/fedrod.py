"""FedRoD (Chen & Chao, ICLR 2022): a generic model trained for every client, a personal head for each.

The model's body and its classifier ``head`` (a Dense layer) are the generic model, shared and
averaged by sample count (FedAvg's rule). A client trains them with the balanced softmax loss,
the cross-entropy of the logits shifted by the log of its class counts
(``softmax(g(z) + log n_c)``; a class it does not hold gets no probability), so every client
optimizes an estimate of the class-balanced risk. Each client also keeps a personal head ``p``
(a Dense layer like the generic one, zero at the start) whose logits are added to the generic
head's: ``g(z) + p(z)``, trained with the plain cross-entropy on the client's data, on the body's
features and the generic logits with their gradients stopped (the personal loss moves ``p``
alone). Both losses train in one step on the same batch.

Evaluation: a client's personalized model is the body with one head whose kernel and bias are the
generic and personal heads' sums (``g(z) + p(z)``, both linear); the global model is the generic
model.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms.aggregation import model_averaging
from jaxfed.algorithms.features import class_counts
from jaxfed.algorithms.records import GlobalParams, global_model
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import fit
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core import lowrank
from jaxfed.core.losses import masked_loss
from jaxfed.nn import model_template, split_variables
from jaxfed.nn.layers import dense, head_input, head_layer
from jaxfed.options import TrainingOptions, option, resolve

PAPER = "Chen & Chao (ICLR 2022), Fed-RoD §4"
NO_CLASS = -1e9  # log 0 in the balanced softmax


@dataclasses.dataclass(frozen=True)
class FedRoDOptions(TrainingOptions):
    """FedRoD's options: which Dense layer is the (generic and personal) head."""

    tasks: typing.ClassVar[tuple[str, ...]] = ("classification",)  # the balanced softmax needs classes

    head: str = option(
        "",
        "the head (a Dense layer's key), generic and personal; empty = the last Dense called",
        source=PAPER + " (the personal head starts at zero, so a client's model starts as the generic one; "
        "PFLlib copies the generic head's init)",
    )


class ClientState(NamedTuple):
    personal: Any  # the personal head {kernel, bias}, added to the generic head's outputs
    model_state: Any  # the model's non-trainable collections (BatchNorm statistics), {} when none


def balanced_softmax_loss(logits, labels, counts, mask):
    """The masked mean cross-entropy of ``logits + log(counts)``. A class with count 0 gets a
    finite ``log 0`` (``NO_CLASS``): no probability, and a padding row's loss stays finite under its zero mask."""
    log_prior = jnp.where(counts > 0, jnp.log(jnp.maximum(counts, 1.0)), NO_CLASS)
    return masked_loss(logits + log_prior, labels, mask)


def summed_head(params, head: str, personal):
    """The model's parameters with one head computing ``g(z) + p(z)``: the heads' kernels and biases summed."""
    generic = lowrank.get_layer(params, head)
    return lowrank.replace_layer(params, head, jax.tree.map(jnp.add, generic, personal))


def fedrod(model, options: FedRoDOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedRoD: the generic model averaged (balanced softmax), a personal head per client."""
    options = resolve(FedRoDOptions, options, overrides)
    head = head_layer(model, options.head, "fedrod", outputs=True)
    template, model_stats = model_template(model)
    num_classes = lowrank.get_layer(template, head)["kernel"].shape[-1]

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        personal = jax.tree.map(jnp.zeros_like, lowrank.get_layer(params, head))
        return GlobalParams(params), ClientState(personal, model_state)

    def loss_for(counts):
        def loss(trainable, model_state, batch):
            variables = {"params": trainable["generic"], **model_state}
            (z, logits), new_state = head_input(
                model, head, variables, batch.x, train=True, mask=batch.mask, rng=batch.key
            )
            generic = balanced_softmax_loss(logits, batch.y, counts, batch.mask)
            frozen_z, frozen_logits = jax.lax.stop_gradient((z, logits))
            personal = masked_loss(frozen_logits + dense(trainable["personal"], frozen_z), batch.y, batch.mask)
            return generic + personal, new_state

        return loss

    def client_update(params, client_state, data, rng, info):
        trainable = {"generic": params, "personal": client_state.personal}
        loss = loss_for(class_counts(data, num_classes))
        trained, model_state, metrics = fit(
            loss, options.optimizer(info.round), trainable, client_state.model_state, data, rng, **options.batching()
        )
        return ClientState(trained["personal"], model_state), trained["generic"], metrics

    def eval_params(server_state, client_state):
        return {"params": summed_head(server_state.params, head, client_state.personal), **client_state.model_state}

    return FederatedAlgorithm(
        name="fedrod",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state.params,
        client_update=client_update,
        aggregation=model_averaging(),
        eval_params=eval_params,
        global_params=global_model(model),  # the generic model
    )


builtin("fedrod", FedRoDOptions, lambda model, options, config: fedrod(model, options))
