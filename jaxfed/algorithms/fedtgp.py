"""FedTGP (Zhang, Liu, Hua and Cao, AAAI 2024): FedProto with trainable global prototypes.

The clients are FedProto's (:func:`~jaxfed.algorithms.fedproto.prototype_client_update`): each
trains its own model, never uploaded, on ``CE + lambda * || f(x) - P_y ||^2`` (torch's
``MSELoss``, no term before the first global prototypes) and uploads the mean feature of each
class it holds under the trained model, with its id. The server differs. It keeps a small network, the
trainable global prototypes (TGP): a class embedding ``[classes, features]``, then
``Linear(features, features)``, ReLU, ``Linear(features, features)`` (torch's initializations),
whose output for class ``c`` is the global prototype ``P_c``. Each round it trains the TGP for
``server_epochs`` epochs of SGD over the round's uploaded prototypes (one example per client and
class it holds, shuffled, in batches of ``batch_size``, the last one partial) on the
adaptive-margin contrastive loss

    CE(-(d(p, P) + margin * onehot(y)), y),   d(p, P_c) = || p - P_c ||_2,

``margin = min(max_c gap_c, margin_threshold)``, ``gap_c`` the distance from class ``c``'s mean
uploaded prototype (the unweighted mean over the clients that hold it) to the nearest other
class's. The new global prototypes are the TGP's outputs for every class.

A client is evaluated as the authors evaluate it: each test example goes to the class of the
global prototype nearest its features (the least mean squared difference;
:class:`NearestPrototype`); before the first global prototypes, by its model's own head (the
authors report 0 then).

Defaults are the authors' command (``run_me.sh``: lr 0.01, batch 10, one local epoch,
``-lam 10 -se 100 -mart 100``); the server's learning rate is the clients' lr, as in their
code (``server_learning_rate = args.local_learning_rate``). Where jaxfed differs from their code
(``TsingZ0/FedTGP``): the distance is ``sqrt(max(d^2, 1e-12))`` (theirs takes the square root of
a difference that rounding may make negative: NaN); the server's key derives from the run's seed
and the round (theirs from torch's global generator); the clients' models are one architecture
unless ``model_tiers`` / ``tier_models`` give tiers of them (the paper's: one architecture per
client group, :mod:`jaxfed.algorithms.model_tiers`); a client's batches are shuffled every epoch
and keep the last partial one (theirs: the same order, ``drop_last``; ``--set drop_last=true``
drops it); a client's prototypes are the means over all
its training examples (theirs go through the same ``drop_last`` loader: the last partial batch's
examples are left out); the server trains at ``lr`` itself, also under ``lr_schedule=cosine``
(theirs at the clients' initial lr: the same with their constant one). The loss reported at
evaluation is the cross-entropy of those outputs (minus the mean squared differences), and of the
model's own before the first global prototypes.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms import fedproto
from jaxfed.algorithms.client_rows import with_id
from jaxfed.algorithms.fedproto import FedProtoOptions, Prototypes
from jaxfed.algorithms.model_tiers import with_model_tiers
from jaxfed.algorithms.prototype_sgd import ClientState, Upload, held_prototypes, server_key, train_on_prototypes
from jaxfed.algorithms.registry import builtin
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core import lowrank
from jaxfed.core.losses import masked_loss
from jaxfed.nn import model_template, split_variables
from jaxfed.nn.layers import head_input, head_layer
from jaxfed.options import at_least, non_negative, option, resolve

CODE = "the authors' run_me.sh (TsingZ0/FedTGP)"
NO_GAP = 1e9  # the authors' initial class gap: a class without another class to measure to


@dataclasses.dataclass(frozen=True)
class FedTGPOptions(FedProtoOptions):
    """FedTGP's options: FedProto's client, the TGP's training and the margin's cap."""

    tasks: typing.ClassVar[tuple[str, ...]] = ("classification",)

    lambda_: float = option(
        10.0,
        "weight lambda of the distance of each example's features to its class's global prototype",
        source=CODE + " (-lam 10)",
        check=non_negative,
    )
    server_epochs: int = option(
        100,
        "epochs of SGD the server trains the global prototypes for each round",
        source=CODE + " (-se 100)",
        check=at_least(1),
    )
    margin_threshold: float = option(
        100.0,
        "the cap of the adaptive margin (the largest class gap)",
        source=CODE + " (-mart 100)",
        check=non_negative,
    )
    lr: float = option(
        0.01,
        "client learning rate (0 freezes the model); the server trains the prototypes at it too",
        source=CODE + " (-lr 0.01)",
        check=non_negative,
    )
    batch_size: int = option(
        10, "local batch size; the server's batches of prototypes too", source=CODE + " (-lbs 10)", check=at_least(1)
    )
    local_epochs: int = option(1, "local epochs per round", source=CODE + " (-ls 1)", check=at_least(1))


class ServerState(NamedTuple):
    tgp: Any  # the trainable global prototypes' parameters
    prototypes: Prototypes  # their outputs, the message down (``present`` False before the first round)
    key_data: Any  # the server's key (shuffling), as raw key data


def init_tgp(rng, num_classes: int, feature_dim: int) -> dict:
    """The TGP's parameters at torch's initialization: the embedding N(0, 1), each Linear's
    kernel and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    embedding, hidden, out = jax.random.split(rng, 3)

    def linear(key):
        kernel, bias = jax.random.split(key)
        return {
            "kernel": lowrank.kaiming_uniform(kernel, (feature_dim, feature_dim), feature_dim),
            "bias": lowrank.kaiming_uniform(bias, (feature_dim,), feature_dim),
        }

    return {
        "embedding": jax.random.normal(embedding, (num_classes, feature_dim)),
        "hidden": linear(hidden),
        "out": linear(out),
    }


def tgp_prototypes(tgp: dict):
    """``[classes, features]``: the TGP's output for every class."""
    hidden = jax.nn.relu(tgp["embedding"] @ tgp["hidden"]["kernel"] + tgp["hidden"]["bias"])
    return hidden @ tgp["out"]["kernel"] + tgp["out"]["bias"]


def class_gaps(means, held):
    """``[classes]``: each held class's distance from its mean prototype to the nearest other held
    class's (:data:`NO_GAP` where there is none); ``means`` ``[clients, classes, features]``,
    ``held`` ``[clients, classes]`` bool (the clients' uploads that count)."""
    holders = jnp.sum(held, axis=0)
    mean = jnp.sum(jnp.where(held[..., None], means, 0.0), axis=0) / jnp.maximum(holders, 1)[:, None]
    distance = jnp.linalg.norm(mean[:, None] - mean[None], axis=-1)
    present = holders > 0
    pairs = present[:, None] & present[None] & ~jnp.eye(len(present), dtype=bool)
    return jnp.min(jnp.where(pairs, distance, NO_GAP), axis=1)


def adaptive_margin(gaps, threshold):
    """``min(max gap, threshold)``, a missing gap counted as the smallest (the authors' ``min_gap``)."""
    smallest = jnp.min(gaps)
    return jnp.minimum(jnp.max(jnp.where(gaps >= NO_GAP, smallest, gaps)), threshold)


def margin_loss(tgp, prototypes, labels, mask, margin):
    """The adaptive-margin contrastive loss of a batch of uploaded ``prototypes`` ``[B, features]``:
    the masked mean of ``CE(-(d + margin * onehot(y)), y)``, ``d`` the Euclidean distance to each
    class's prototype (``sqrt(max(d^2, 1e-12))``: finite gradients where a prototype meets one)."""
    centers = tgp_prototypes(tgp)
    squared = jnp.sum(jnp.square(prototypes[:, None] - centers[None]), axis=-1)
    distance = jnp.sqrt(jnp.maximum(squared, 1e-12))
    distance = distance + margin * jax.nn.one_hot(labels, centers.shape[0])
    return masked_loss(-distance, labels, mask)


def train_tgp(tgp, means, held, ids, margin, key, *, epochs: int, batch_size: int, lr):
    """The TGP after ``epochs`` epochs of SGD at ``lr`` on :func:`margin_loss` over the held
    prototypes (``means`` ``[clients, classes, features]`` where ``held``; ``ids`` ``[clients]`` the
    senders), shuffled each epoch and batched as :func:`~jaxfed.algorithms.prototype_sgd.train_on_prototypes` does."""

    def loss(tgp, prototypes, labels, mask):
        return margin_loss(tgp, prototypes, labels, mask, margin)

    return train_on_prototypes(tgp, loss, means, held, ids, key, epochs=epochs, batch_size=batch_size, lr=lr)


class NearestPrototype(NamedTuple):
    """A client's model evaluated by the nearest global prototype: the outputs are minus the mean
    squared difference between the features (the input of ``head``) and each class's prototype
    (-inf for a class without one, as the authors' ``inf`` distance); before there are any
    prototypes, the model's own outputs.

    Variables: ``{"params": {"model": the model's params, "prototypes": Prototypes}, **model state}``."""

    model: Any
    head: str

    @property
    def name(self) -> str:
        return f"{self.model.name} by the nearest prototype"

    def apply(self, variables, x, *, train: bool = False, mask=None, rng=None):
        params = variables["params"]
        state = {k: v for k, v in variables.items() if k != "params"}
        model_variables = {"params": params["model"], **state}
        (features, outputs), new_state = head_input(
            self.model, self.head, model_variables, x, train=train, mask=mask, rng=rng
        )
        prototypes = params["prototypes"]
        nearness = -jnp.mean(jnp.square(features[:, None] - prototypes.means[None]), axis=-1)
        nearness = jnp.where(prototypes.present[None], nearness, -jnp.inf)  # a class without one: never
        return jnp.where(jnp.any(prototypes.present), nearness, outputs), new_state


def fedtgp(model, options: FedTGPOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedTGP: FedProto's clients and a server that trains the global prototypes."""
    options = resolve(FedTGPOptions, options, overrides)
    head = head_layer(model, options.head, "fedtgp")
    feature_dim, num_classes = lowrank.get_layer(model_template(model)[0], head)["kernel"].shape

    def init(rng):
        params, model_state = split_variables(model.init(rng))  # FedProto's clients' start, seed for seed
        tgp = init_tgp(jax.random.fold_in(rng, 1), num_classes, feature_dim)
        none_yet = Prototypes(jnp.zeros((num_classes, feature_dim)), jnp.zeros((num_classes,), bool))
        client = ClientState(params, model_state, jnp.int32(0))
        return ServerState(tgp, none_yet, jax.random.key_data(jax.random.fold_in(rng, 2))), client

    train_client = fedproto.prototype_client_update(model, head, options)

    def client_update(prototypes, client_state, data, rng, info):
        own = fedproto.ClientState(client_state.params, client_state.model_state)
        new, upload, metrics = train_client(prototypes, own, data, rng, info)
        me = client_state.id
        return ClientState(new.params, new.model_state, me), Upload(upload.means, upload.counts, me), metrics

    def server_update(server_state, uploads: Upload, weights, info):
        held = held_prototypes(uploads, weights)
        margin = adaptive_margin(class_gaps(uploads.means, held), options.margin_threshold)
        key = server_key(server_state.key_data, info.round)
        tgp = train_tgp(
            server_state.tgp, uploads.means, held, uploads.id, margin, key,
            epochs=options.server_epochs, batch_size=options.batch_size, lr=options.lr,
        )  # fmt: skip
        prototypes = Prototypes(tgp_prototypes(tgp), jnp.ones((num_classes,), bool))
        return ServerState(tgp, prototypes, server_state.key_data)

    def eval_params(server_state, client_state):
        params = {"model": client_state.params, "prototypes": server_state.prototypes}
        return {"params": params, **client_state.model_state}

    algorithm = FederatedAlgorithm(
        name="fedtgp",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state.prototypes,
        client_update=client_update,
        server_update=server_update,
        eval_params=eval_params,
        global_params=None,  # the models are private: there is no global model
        eval_model=NearestPrototype(model, head),
        init_client=with_id,
    )
    return with_model_tiers(algorithm, model, options, head, same_features=True)


builtin("fedtgp", FedTGPOptions, lambda model, options, config: fedtgp(model, options))
