"""FedAS (Yang, Huang and Ye, CVPR 2024): federated parameter-alignment and client-synchronization.

FedARA's strongest homogeneous baseline. Every client keeps its whole model; the body (every
layer but the classifier ``head``) is shared, the head stays on the client. A sampled client's
round, as the authors' code runs it (``clientas.py``, ``serveras.py``):

1. **Prototypes.** The mean feature (the head's input, inference mode) of each class over the
   client's training examples under its own model, before the round.
2. **Parameter alignment.** The received global body trains for ``align_epochs`` epochs of plain
   SGD at ``align_lr`` (batch ``align_batch_size``) on ``sum_c MSE(f(x_c), P_c)``: for each class
   ``c`` in the batch, the squared distance of the global body's features of its examples to the
   client's prototype ``P_c``, averaged over those examples and the feature dimensions (torch's
   ``MSELoss``), summed over the batch's classes. The aligned body replaces the client's body.
3. **Local training.** The whole model (aligned body, the client's own head) trains for
   ``local_epochs`` with the client optimizer.
4. **Client synchronization.** The trace of the client's empirical Fisher information after
   training: the sum over its batches of the squared norm of the gradient of the batch's mean
   negative log-likelihood with respect to every parameter (inference mode).

The client uploads its body and that trace; the server's body is the trace-weighted mean of the
round's bodies (``fisher_weighting=False``: the sample-weighted mean, the authors' ``wo_global``
ablation). A client's personalized model is its own model: no global model is evaluated. The
round's ``steps`` count the alignment's steps and the trace's batches besides training's (each a
gradient on one batch), and ``fisher_trace`` is reported as a metric.

Where jaxfed differs from the authors' code: each sampled client aligns its own copy of the global
body (their repository hands every client the server's model itself, so a client received the body
as the clients sampled before it had aligned it; PFLlib's FedAS, updated by the same author,
copies it, as jaxfed does); their loader runs every pass in stored order and drops the last
partial batch (``n mod 16`` examples never reach the prototypes or the alignment), where jaxfed
shuffles every pass and keeps every example (``drop_last`` applies to the alignment, training and
the trace); the server averages only the bodies (theirs also averages the heads, which it never
sends back); BatchNorm statistics stay on the client, as for every algorithm (their alignment
normalizes with the first uploading client's statistics).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxfed.algorithms.features import class_means
from jaxfed.algorithms.partial import merge_layers, split_layers
from jaxfed.algorithms.records import GlobalParams
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import fit, run_epochs, train_parameters
from jaxfed.contract import Aggregation, FederatedAlgorithm
from jaxfed.core import mean_of, weighted_share
from jaxfed.core.losses import masked_loss
from jaxfed.nn import split_variables
from jaxfed.nn.layers import head_input, head_layer
from jaxfed.options import TrainingOptions, at_least, non_negative, option, resolve

PAPER = "Yang, Huang and Ye (CVPR 2024), FedAS"
CODE = "the authors' code (xiyuanyang45/FedAS; PFLlib's FedAS)"
SETUP = f"FedARA paper §5 (FedAS is its homogeneous baseline, run in its setup: E=5, B=16, lr 5e-3; {CODE}: the same)"


@dataclasses.dataclass(frozen=True)
class FedASOptions(TrainingOptions):
    """FedAS's options: the global body's alignment to the client's prototypes; the server's weights."""

    tasks: typing.ClassVar[tuple[str, ...]] = ("classification",)  # prototypes are per class

    local_epochs: int = option(5, "local epochs per round", source=SETUP)
    batch_size: int = option(16, "local batch size (and the Fisher trace's batches)", source=SETUP)
    lr: float = option(5e-3, "client learning rate", source=SETUP)
    align_lr: float = option(
        0.01,
        "learning rate of the alignment's plain SGD on the received global body (0: no alignment)",
        source=CODE + ", clientas.py: SGD(lr=0.01)",
        check=non_negative,
    )
    align_epochs: int = option(
        1,
        "epochs of alignment of the global body to the client's prototypes; 0 = none (the authors' wo_local ablation)",
        source=CODE + ", clientas.py: 1 epoch",
        check=at_least(0),
    )
    align_batch_size: int = option(
        16, "batch size of the prototypes' and the alignment's passes", source=CODE + ", clientas.py: 16",
        check=at_least(1),
    )  # fmt: skip
    fisher_weighting: bool = option(
        True,
        "the server weighs each body by its client's Fisher trace; false: by sample count (the authors' wo_global)",
        source=PAPER + " (client synchronization); " + CODE + ", serveras.py: aggregate_wrt_fisher",
    )
    head: str = option("", "the private classifier head (a Dense layer's key); empty = the last Dense called")


class ClientState(NamedTuple):
    params: Any  # the client's whole model (its body is replaced by the aligned global body when sampled)
    model_state: Any  # its non-trainable collections (BatchNorm statistics), {} when none


class Upload(NamedTuple):
    body: Any  # the trained body (every layer but the head)
    fisher: jax.Array  # float32: the trace of the client's empirical Fisher information


def alignment_loss(features, prototypes, labels, mask):
    """``sum_c MSE(features[labels == c], prototypes[c])`` over the classes ``c`` of the batch's
    real examples: each class's squared distances averaged over its examples and the feature
    dimensions (torch's ``MSELoss``), the classes' means summed (the authors' per-label loop)."""
    squared = jnp.mean(jnp.square(features - prototypes[labels]), axis=-1)
    members = jax.nn.one_hot(labels, prototypes.shape[0]) * mask[:, None]
    counts = jnp.sum(members, axis=0)
    per_class = (members.T @ squared) / jnp.maximum(counts, 1.0)
    return jnp.sum(jnp.where(counts > 0, per_class, 0.0))


def fisher_trace(model, params, model_state, data, rng, *, batch_size: int, drop_last: bool):
    """The trace of one client's empirical Fisher information as the authors compute it: over one
    shuffled pass of its batches, the sum of ``||grad_params mean_batch NLL||^2`` (inference mode).
    Returns ``(trace, batches)``."""

    def nll(p, batch):
        logits, _ = model.apply({"params": p, **model_state}, batch.x, train=False, mask=batch.mask)
        return masked_loss(logits, batch.y, batch.mask)

    def step(total, batch):
        value, grads = jax.value_and_grad(nll)(params, batch)
        return total + sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)), value

    total, metrics = run_epochs(step, jnp.float32(0), data, rng, epochs=1, batch_size=batch_size, drop_last=drop_last)
    return total, metrics["steps"]


def fedas(model, options: FedASOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedAS: the global body aligned to each client's prototypes before it trains; bodies
    averaged by their clients' Fisher traces."""
    options = resolve(FedASOptions, options, overrides)
    head = head_layer(model, options.head, "fedas")

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        return GlobalParams(split_layers(params, [head])[0]), ClientState(params, model_state)

    def align(global_body, client_head, client: ClientState, data, rng):
        """The global body trained toward the client's prototypes (under its own model): ``(body, steps)``."""
        batch_size = options.align_batch_size
        prototypes, _ = class_means(model, head, {"params": client.params, **client.model_state}, data, batch_size)

        def loss(body, model_state, batch):
            variables = {"params": merge_layers(body, client_head), **model_state}
            (features, _), _ = head_input(model, head, variables, batch.x, train=False, mask=batch.mask)
            return alignment_loss(features, prototypes, batch.y, batch.mask), model_state

        body, _, metrics = fit(
            loss, optax.sgd(options.align_lr), global_body, client.model_state, data, rng,
            epochs=options.align_epochs, batch_size=batch_size, drop_last=options.drop_last,
        )  # fmt: skip
        return body, metrics["steps"]

    def client_update(global_body, client: ClientState, data, rng, info):
        align_rng, train_rng, fisher_rng = jax.random.split(rng, 3)
        client_head = split_layers(client.params, [head])[1]
        body, align_steps = align(global_body, client_head, client, data, align_rng)
        params, model_state, metrics = train_parameters(
            model, options.optimizer(info.round), merge_layers(body, client_head), client.model_state, data,
            train_rng, **options.batching(),
        )  # fmt: skip
        trace, fisher_steps = fisher_trace(
            model, params, model_state, data, fisher_rng, batch_size=options.batch_size, drop_last=options.drop_last
        )
        metrics = {**metrics, "steps": metrics["steps"] + align_steps + fisher_steps, "fisher_trace": trace}
        return ClientState(params, model_state), Upload(split_layers(params, [head])[0], trace), metrics

    def contribute(server_state, upload: Upload, weight, info):
        return weighted_share(upload.body, upload.fisher if options.fisher_weighting else weight)

    def apply(server_state, total, info):
        return GlobalParams(mean_of(total, server_state.params))  # no trace at all (every one 0): unchanged

    return FederatedAlgorithm(
        name="fedas",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state.params,
        client_update=client_update,
        aggregation=Aggregation(contribute, apply),
        eval_params=lambda server_state, client: {"params": client.params, **client.model_state},
        global_params=None,  # the heads are private: there is no global model
    )


builtin("fedas", FedASOptions, lambda model, options, config: fedas(model, options))
