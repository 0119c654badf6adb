"""What several algorithms compute from a client's data through the model's features (the head's
input): per-class mean features (FedARA's anchors, FedProto's prototypes) and per-class counts
(FedRoD's balanced softmax, FedProto's weights)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfed.core import lowrank
from jaxfed.data import ClientData
from jaxfed.nn.layers import head_input


def class_counts(data: ClientData, num_classes: int):
    """``[classes]`` float32: how many of the client's real examples hold each label."""
    real = jnp.arange(data.indices.shape[0]) < data.count
    labels = jnp.take(data.y, data.indices, axis=0)
    return jnp.zeros((num_classes,), jnp.float32).at[labels].add(real.astype(jnp.float32))


def class_feature_sums(model, head: str, variables, data: ClientData, batch_size: int):
    """``(sums [classes, features], counts [classes])``: the summed feature (the input of the Dense
    layer ``head``, inference mode) of each class over the client's real training examples."""
    feature_dim, num_classes = lowrank.get_layer(variables["params"], head)["kernel"].shape
    steps = -(-data.count // batch_size)

    def one_batch(b, totals):
        sums, counts = totals
        batch = data.batch(b * batch_size + jnp.arange(batch_size, dtype=jnp.int32))
        (features, _), _ = head_input(model, head, variables, batch.x, train=False)
        members = jax.nn.one_hot(batch.y, num_classes) * batch.mask[:, None]
        return sums + members.T @ features, counts + jnp.sum(members, axis=0)

    zeros = (jnp.zeros((num_classes, feature_dim)), jnp.zeros((num_classes,)))
    return jax.lax.fori_loop(0, steps, one_batch, zeros)


def class_means(model, head: str, variables, data: ClientData, batch_size: int):
    """``(means [classes, features], counts [classes])``: the mean feature of each class over the
    client's real training examples (0 for a class it does not hold) and how many it holds."""
    sums, counts = class_feature_sums(model, head, variables, data, batch_size)
    return sums / jnp.maximum(counts, 1.0)[:, None], counts


def class_anchors(model, head: str, variables, data: ClientData, batch_size: int):
    """``(anchors [classes, features], present [classes])``: FedARA's anchors, :func:`class_means`
    with ``present`` False (anchor 0) for a class the client does not hold."""
    means, counts = class_means(model, head, variables, data, batch_size)
    return means, counts > 0
