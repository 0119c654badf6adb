"""Tree operations over a stacked client axis (axis 0 of every leaf).

Client states live as one pytree whose leaves have a leading ``[num_clients, ...]`` axis;
a round gathers the sampled clients' rows, updates them, and scatters them back. Server
aggregation is a reduction over that axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def stack_clients(tree, num_clients: int):
    """Repeat one client's pytree ``num_clients`` times along a new leading axis."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_clients,) + jnp.shape(x)), tree)


def gather_clients(stacked, ids):
    """Rows ``ids`` of a stacked pytree; out-of-range ids (padding) read a clipped row."""
    return jax.tree.map(lambda x: jnp.take(x, ids, axis=0, mode="clip"), stacked)


def scatter_clients(stacked, ids, rows):
    """Write ``rows`` back at ``ids``; out-of-range ids (padding) are dropped."""
    return jax.tree.map(lambda x, r: x.at[ids].set(r.astype(x.dtype), mode="drop"), stacked, rows)


def weighted_mean(stacked, weights):
    """``sum_k w_k x_k / sum_k w_k`` over the client axis of every leaf.

    Weights need not be normalized; a zero weight removes a client. With all weights zero the
    result is zero (the engine keeps the previous server state in a round where every weight is 0).
    """
    weights = jnp.asarray(weights, jnp.float32)
    total = jnp.sum(weights)
    scale = weights / jnp.where(total > 0, total, 1.0)

    def reduce(x):
        return jnp.tensordot(scale.astype(x.dtype), x, axes=(0, 0))

    return jax.tree.map(reduce, stacked)


def uniform_mean(stacked, weights):
    """The plain mean over the client axis of the rows that carry weight (``weights > 0``): every
    kept client counts once, whatever its weight; padding and skipped rows (weight 0) drop out.
    With no such row the result is zero, like :func:`weighted_mean`'s."""
    return weighted_mean(stacked, (jnp.asarray(weights) > 0).astype(jnp.float32))


def masked_weighted_mean(previous, stacked, masks, weights):
    """Per position, ``sum_k w_k m_k x_k / sum_k w_k m_k`` over the client axis, where that
    denominator is positive; ``previous`` where no client (with positive weight) sent the position.

    ``masks`` has the structure of ``stacked``, each leaf broadcastable to its shape: which
    positions each client sent (bool or 0/1), or a per-position weight that is 0 where not sent.
    ``previous`` has the shapes of one client's row.
    """
    weights = jnp.asarray(weights, jnp.float32)

    def reduce(prev, x, m):
        w = weights.reshape((-1,) + (1,) * (x.ndim - 1)) * m.astype(jnp.float32)
        total = jnp.sum(w, axis=0)
        mean = jnp.sum(w * x, axis=0) / jnp.where(total > 0, total, 1.0)
        return jnp.where(total > 0, mean.astype(prev.dtype), prev)

    return jax.tree.map(reduce, previous, stacked, masks)


def concat_clients(stacks):
    """One stack from several stacks of the same tree structure, along the client axis. A
    ValueError when their rows differ in shape (tiers whose uploads were not decoded to one shape)."""
    if len(stacks) == 1:
        return stacks[0]
    rows = [jax.tree.map(lambda x: x.shape[1:], stack) for stack in stacks]
    if any(jax.tree.structure(r) != jax.tree.structure(rows[0]) or r != rows[0] for r in rows[1:]):
        raise ValueError(
            "the stacks' rows differ in shape; a tiered algorithm needs a receive(server_state, message, info) "
            "that decodes every tier's upload to one shape"
        )
    return jax.tree.map(lambda *parts: jnp.concatenate(parts), *stacks)


def finite_rows(stacked, num_rows: int):
    """``[num_rows]`` bool: whether every floating value in client row k (all leaves) is finite."""
    rows = jnp.ones((num_rows,), bool)
    for x in jax.tree.leaves(stacked):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            rows = rows & jnp.all(jnp.isfinite(x.reshape(num_rows, -1)), axis=1)
    return rows


def select_rows(keep, on_true, on_false):
    """Row k of ``on_true`` where ``keep[k]``, else row k of ``on_false`` (stacked pytrees)."""
    return jax.tree.map(lambda a, b: jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), on_true, on_false)


def tree_select(predicate, on_true, on_false):
    """Leafwise ``where(predicate, on_true, on_false)`` for a scalar predicate."""
    return jax.tree.map(lambda a, b: jnp.where(predicate, a, b), on_true, on_false)


def tree_bytes(tree) -> int:
    """Bytes of all array leaves of ``tree`` (static: from shapes and dtypes)."""
    return int(sum(np.prod(np.shape(x), dtype=np.int64) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
