"""The server's SGD over a round's uploaded class prototypes: FedTGP trains its global prototypes
on them, FedGH its global head.

The examples are the prototypes the round's clients uploaded, one per client and class it holds
(``means [clients, classes, features]`` where ``held``), labelled by their class. Each epoch visits
them in a new shuffle, in batches of ``batch_size``, the last one partial (torch's ``DataLoader``
with ``shuffle=True, drop_last=False``, as both authors' servers do). The shuffle is a function of
who sent what (:func:`held_order`), not of the order the uploads come in or of the padding rows
among them, so the engine's client order and chunking leave it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class ClientState(NamedTuple):
    """A client of FedTGP or FedGH: its own model, and its id, which its upload carries."""

    params: Any  # the client's own model
    model_state: Any  # its non-trainable collections (BatchNorm statistics), {} when none
    id: jax.Array  # int32 scalar: the client's id


class Upload(NamedTuple):
    """What a FedTGP or FedGH client sends: its class prototypes, with who sent them."""

    means: Any  # [classes, features]: the client's mean feature of each class (0 where it has none)
    counts: Any  # [classes]: its training examples of each class
    id: jax.Array  # int32 scalar: who sent it (the server's shuffle is one of (client, class) pairs)


def held_prototypes(uploads: Upload, weights):
    """``[clients, classes]`` bool: the uploaded prototypes the server trains on, those of a class
    the client holds from a row that carries weight (not padding, not a skipped client)."""
    return (uploads.counts > 0) & (weights[:, None] > 0)


def server_key(key_data, round_):
    """The server's key for round ``round_``, from its key data (the run's seed)."""
    return jax.random.fold_in(jax.random.wrap_key_data(key_data), round_)


def held_order(valid, pair, bits):
    """The order a server epoch visits the prototypes in: the held ones (``valid``) by their
    random ``bits``, a tie broken by ``pair`` (``id * classes + class``), then the others."""
    return jnp.lexsort((pair, bits, ~valid))


def train_on_prototypes(params, loss: Callable, means, held, ids, key, *, epochs: int, batch_size: int, lr):
    """``params`` after ``epochs`` epochs of SGD at ``lr`` on ``loss(params, prototypes [B, features],
    labels [B], mask [B])`` over the held prototypes (``ids`` ``[clients]`` the senders). Each
    epoch's shuffle sorts the held prototypes by random bits from ``fold_in(epoch_key, id * classes
    + class)`` (:func:`held_order`)."""
    num_clients, num_classes, feature_dim = means.shape
    examples = means.reshape(-1, feature_dim)
    labels = jnp.tile(jnp.arange(num_classes), num_clients)
    valid = held.reshape(-1)
    pair = (ids[:, None] * num_classes + jnp.arange(num_classes)).reshape(-1)
    num_held = jnp.sum(valid)
    steps = (num_held + batch_size - 1) // batch_size  # the batches that hold a prototype
    grad = jax.grad(loss)
    sgd = optax.sgd(lr)

    def epoch(params, epoch_key):
        bits = jax.vmap(lambda n: jax.random.bits(jax.random.fold_in(epoch_key, n)))(pair)
        order = jnp.concatenate([held_order(valid, pair, bits), jnp.zeros((batch_size,), jnp.int32)])

        def step(b, params):
            rows = jax.lax.dynamic_slice(order, (b * batch_size,), (batch_size,))
            real = (b * batch_size + jnp.arange(batch_size)) < num_held  # the last batch: partial
            updates, _ = sgd.update(grad(params, examples[rows], labels[rows], real), sgd.init(params))
            return optax.apply_updates(params, updates)

        return jax.lax.fori_loop(0, steps, step, params), None

    return jax.lax.scan(epoch, params, jax.random.split(key, epochs))[0]
