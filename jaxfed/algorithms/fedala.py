"""FedALA (Zhang et al., AAAI 2023): FedAvg whose clients start each round from an adaptive local
aggregation (ALA) of the global model into their own model.

Each client keeps its local model ``theta`` (the global initialization at first) and element-wise
aggregation weights ``W`` (ones at first) for the model's ``top_layers`` layers nearest the output.
A round: the client receives the global model ``Theta`` and starts from

    theta_hat(W) = theta + (Theta - theta) * W   on the top layers,   Theta   on the layers below.

``W`` is learned first, ``theta`` and ``Theta`` fixed: SGD steps of size ``eta`` (the paper's own
rule, not the ``client_optimizer``, which trains ``theta_hat`` after) on the loss of
``theta_hat(W)`` over a random ``rand_percent`` of the client's training examples, ``W`` clipped to
``[0, 1]`` after each step. A round makes one pass over that subset, except the first ALA of a
client, which passes until the standard deviation of the last ``num_pre_loss`` passes' losses (each
pass's last batch) is below ``threshold`` (at most ``max_passes``). Then ``theta_hat`` trains as
FedAvg's client does; the trained model is the client's new ``theta`` and its upload, and the server
averages the uploads by sample count. A client's personalized model is its ``theta``.

A client's first round has nothing of its own to aggregate (its ``theta`` is the initialization):
it starts from ``Theta``, as FedAvg's client does, and leaves ``W`` untouched, as the authors' code
skips ALA while the local model equals the global one. Its first ALA (``W`` trained to convergence)
is then its second round.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms.aggregation import model_averaging
from jaxfed.algorithms.records import GlobalParams, global_model
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import classification_loss, shuffled_positions, train_parameters
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core import lowrank
from jaxfed.errors import ConfigError
from jaxfed.nn import split_variables
from jaxfed.nn.layers import parameter_layers
from jaxfed.options import TrainingOptions, at_least, non_negative, option, resolve

PAPER = "Zhang et al. (AAAI 2023), FedALA"
CODE = "the authors' code (TsingZ0/FedALA)"
MAIN = CODE + ", main.py"


def percent(value):
    return None if 1 <= value <= 100 else "must be in 1..100"


@dataclasses.dataclass(frozen=True)
class FedALAOptions(TrainingOptions):
    """FedALA's options: how the aggregation weights W are learned, and on which layers."""

    eta: float = option(
        1.0,
        "learning rate of the aggregation weights W, plain SGD steps clipped to [0, 1] whatever client_optimizer "
        "is (the paper's rule); 0 keeps W at ones: the client starts from the global model",
        source=PAPER + " and " + MAIN + ": eta = 1.0",
        check=non_negative,
    )
    rand_percent: int = option(
        80,
        "s: the percent of the client's training examples W learns on, drawn at random each round",
        source=PAPER + " and " + MAIN + ": s = 80 (the code takes a random contiguous slice of the client's "
        "examples in their stored order; here a uniformly random subset)",
        check=percent,
    )
    top_layers: int = option(
        1,
        "p: the layers nearest the output that ALA aggregates (layers holding parameters, in call order); "
        "the layers below take the global model",
        source=MAIN + ": layer_idx = 2, which counts parameter tensors ('more fine-grained than its original "
        "paper'): the head's weight and bias, one layer",
        check=at_least(1),
    )
    threshold: float = option(
        0.01,
        "a client's first ALA trains W until the std of its last num_pre_loss passes' losses is below this",
        source=CODE + ", README: 0.01 in the paper (ALA.py's default, which the authors' client keeps, is 0.1)",
        check=non_negative,
    )
    num_pre_loss: int = option(
        10,
        "how many of the last passes' losses the first ALA's stopping rule looks at",
        source=CODE + ", ALA.py",
        check=at_least(1),
    )
    max_passes: int = option(
        100,
        "the most passes a client's first ALA makes (if its losses never settle)",
        source="jaxfed default (" + CODE + " loops until the rule holds, with no cap)",
        check=at_least(1),
    )


class ClientState(NamedTuple):
    params: Any  # theta: the client's local model (its last trained model; the initialization at first)
    weights: dict  # {layer key: W}: the aggregation weights of the top layers, shaped as those layers
    rounds: jax.Array  # int32: the rounds this client has trained (0: theta is still the initialization)
    model_state: Any  # the model's non-trainable collections (BatchNorm statistics), {} when none


def top_layer_keys(model, count: int) -> list[str]:
    """The ``count`` layers holding parameters nearest the output; a ConfigError if there are fewer."""
    layers = parameter_layers(model)
    if count > len(layers):
        raise ConfigError(f"top_layers: {count} is more than the model's {len(layers)} layers ({', '.join(layers)})")
    return layers[-count:]


def aggregate(local, global_params, weights: dict):
    """``theta_hat``: ``global_params`` with each layer in ``weights`` replaced by
    ``theta + (Theta - theta) * W`` (``theta`` the layer of ``local``)."""
    for key, w in weights.items():
        mixed = jax.tree.map(
            lambda t, g, a: t + (g - t) * a, lowrank.get_layer(local, key), lowrank.get_layer(global_params, key), w
        )
        global_params = lowrank.replace_layer(global_params, key, mixed)
    return global_params


def sample_positions(data, rng, rand_percent, batch_size: int):
    """``(positions, batches)``: a random ``rand_percent``% of the client's examples (at least one),
    in a random order, padded to whole batches with padding positions; and how many batches that is."""
    max_examples = data.indices.shape[0]
    length = -(-max_examples // batch_size) * batch_size
    size = jnp.maximum(data.count * rand_percent // 100, jnp.minimum(data.count, 1))
    order = shuffled_positions(rng, data.count, max_examples, length)
    return jnp.where(jnp.arange(length) < size, order, max_examples), -(-size // batch_size)


def weight_step(loss, eta):
    """One ALA step on a batch: ``W <- clip(W - eta * dL(theta_hat(W))/dW, 0, 1)``; returns ``(W, loss)``."""

    def step(weights, batch):
        value, grads = jax.value_and_grad(loss)(weights, batch)
        return jax.tree.map(lambda w, g: jnp.clip(w - eta * g, 0.0, 1.0), weights, grads), value

    return step


def learn_weights(step, weights, data, positions, batches, *, batch_size, max_passes, until_settled, threshold, window):
    """Passes of ``step`` over the batches of ``positions`` (the same batches, in the same order,
    each pass): at most ``max_passes``, and with ``until_settled`` no more once the last ``window``
    passes' losses (each pass's last batch's) have a standard deviation below ``threshold`` (checked
    after more than ``window`` passes). Returns ``(weights, passes)``."""

    def one_pass(weights):
        def body(carry):
            b, weights, _ = carry
            batch = data.batch(jax.lax.dynamic_slice(positions, (b * batch_size,), (batch_size,)))
            weights, value = step(weights, batch)
            return b + 1, weights, value

        _, weights, last = jax.lax.while_loop(lambda c: c[0] < batches, body, (jnp.int32(0), weights, jnp.float32(0)))
        return weights, last

    def going(carry):
        passes, _, losses = carry
        settled = (passes > window) & (jnp.std(losses) < threshold)
        return (passes < max_passes) & ~(until_settled & settled)

    def body(carry):
        passes, weights, losses = carry
        weights, last = one_pass(weights)
        return passes + 1, weights, losses.at[passes % window].set(last)

    passes, weights, _ = jax.lax.while_loop(going, body, (jnp.int32(0), weights, jnp.zeros(window, jnp.float32)))
    return weights, passes


def fedala(model, options: FedALAOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedALA: FedAvg whose clients start from an adaptive local aggregation of the global model."""
    options = resolve(FedALAOptions, options, overrides)
    keys = top_layer_keys(model, options.top_layers)

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        weights = {key: jax.tree.map(jnp.ones_like, lowrank.get_layer(params, key)) for key in keys}
        return GlobalParams(params), ClientState(params, weights, jnp.int32(0), model_state)

    def broadcast(server_state, info):
        return server_state.params

    def adaptive_local_aggregation(global_params, state: ClientState, data, rng):
        """``(theta_hat, W, passes, steps)`` of the client's ALA this round."""
        loss = classification_loss(model, to_params=lambda w: aggregate(state.params, global_params, w))
        step = weight_step(lambda w, batch: loss(w, state.model_state, batch)[0], options.eta)
        positions, batches = sample_positions(data, rng, options.rand_percent, options.batch_size)
        first_time = state.rounds == 1  # the first round with a theta of its own
        limit = jnp.where(state.rounds == 0, 0, jnp.where(first_time, options.max_passes, 1))
        weights, passes = learn_weights(
            step, state.weights, data, positions, batches, batch_size=options.batch_size,
            max_passes=jnp.where(batches > 0, limit, 0), until_settled=first_time,
            threshold=options.threshold, window=options.num_pre_loss,
        )  # fmt: skip
        mixed = aggregate(state.params, global_params, weights)
        start = jax.tree.map(lambda g, m: jnp.where(state.rounds > 0, m, g), global_params, mixed)
        return start, weights, passes, (passes * batches).astype(jnp.float32)

    def client_update(global_params, state, data, rng, info):
        ala_rng, train_rng = jax.random.split(rng)
        start, weights, passes, ala_steps = adaptive_local_aggregation(global_params, state, data, ala_rng)
        params, model_state, metrics = train_parameters(
            model, options.optimizer(info.round), start, state.model_state, data, train_rng, **options.batching()
        )
        metrics = {**metrics, "steps": metrics["steps"] + ala_steps, "ala_passes": passes.astype(jnp.float32)}
        return ClientState(params, weights, state.rounds + 1, model_state), params, metrics

    def eval_params(server_state, client_state):
        return {"params": client_state.params, **client_state.model_state}

    return FederatedAlgorithm(
        name="fedala",
        options=options,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        aggregation=model_averaging(),
        eval_params=eval_params,
        global_params=global_model(model),
    )


builtin("fedala", FedALAOptions, lambda model, options, config: fedala(model, options))
