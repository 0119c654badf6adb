"""Tree operations over a stacked client axis (axis 0 of every leaf).

Client states live as one pytree whose leaves have a leading ``[num_clients, ...]`` axis;
a round gathers the sampled clients' rows, updates them, and scatters them back. Server
aggregation is a reduction over that axis.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def path_name(path) -> str:
    """``server.params.fc1.kernel``: a tree path (of ``jax.tree_util.tree_flatten_with_path``:
    dict keys, attribute and field names, sequence positions) joined with dots."""
    parts = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return ".".join(str(part) for part in parts)


def leaves_by_path(tree) -> dict:
    """``{path_name: leaf}`` of every leaf of ``tree``."""
    return {path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def stack_clients(tree, num_clients: int):
    """Repeat one client's pytree ``num_clients`` times along a new leading axis."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_clients,) + jnp.shape(x)), tree)


def stack_trees(trees):
    """Trees of one structure stacked along a new leading axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def gather_clients(stacked, ids):
    """Rows ``ids`` of a stacked pytree; out-of-range ids (padding) read a clipped row."""
    return jax.tree.map(lambda x: jnp.take(x, ids, axis=0, mode="clip"), stacked)


def scatter_clients(stacked, ids, rows):
    """Write ``rows`` back at ``ids``; out-of-range ids (padding) are dropped."""
    return jax.tree.map(lambda x, r: x.at[ids].set(r.astype(x.dtype), mode="drop"), stacked, rows)


def weighted_mean(stacked, weights):
    """``sum_k w_k x_k / sum_k w_k`` over the client axis of every leaf.

    Weights need not be normalized; a zero weight removes a client. An integer or bool leaf is
    averaged in float32 (float leaves keep their dtype). With all weights zero the result is zero
    (the engine keeps the previous server state in a round where every weight is 0).
    """
    weights = jnp.asarray(weights, jnp.float32)
    total = jnp.sum(weights)
    scale = weights / jnp.where(total > 0, total, 1.0)

    def reduce(x):
        dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.float32  # a mean of counts is not a count
        return jnp.tensordot(scale.astype(dtype), x.astype(dtype), axes=(0, 0))

    return jax.tree.map(reduce, stacked)


def uniform_mean(stacked, weights):
    """The plain mean over the client axis of the rows that carry weight (``weights > 0``): every
    kept client counts once, whatever its weight; padding and skipped rows (weight 0) drop out.
    With no such row the result is zero, like :func:`weighted_mean`'s."""
    return weighted_mean(stacked, (jnp.asarray(weights) > 0).astype(jnp.float32))


class WeightedSum(NamedTuple):
    """Clients' shares of a weighted mean, summed: ``total = sum_k w_k x_k``, ``weight = sum_k w_k``.

    ``weight`` is a scalar, or one weight per position of the leading axes every leaf of
    ``total`` shares (FedCSPACK: one per pack; a mixture: one per component).
    """

    total: Any
    weight: jax.Array


def weighted_share(x, weight) -> WeightedSum:
    """One client's share of the weighted mean of ``x``: ``(w x, w)``; ``weight`` a scalar or
    per-position weights over the leading axes of every leaf of ``x``."""
    weight = jnp.asarray(weight, jnp.float32)
    return WeightedSum(jax.tree.map(lambda leaf: _over_leading(weight, leaf) * leaf, x), weight)


def mean_of(summed: WeightedSum, previous=None):
    """``total / weight`` where the summed weight is positive; elsewhere ``previous`` (default
    zero: the engine keeps the old server state in a round where no client carried weight)."""
    positive = summed.weight > 0
    safe = jnp.where(positive, summed.weight, 1.0)

    def mean(total, prev):
        value = (total / _over_leading(safe, total)).astype(total.dtype)
        return jnp.where(_over_leading(positive, total), value, prev if prev is not None else 0)

    if previous is None:
        return jax.tree.map(lambda total: mean(total, None), summed.total)
    return jax.tree.map(mean, summed.total, previous)


def _over_leading(weight, leaf):
    """``weight`` shaped to broadcast over the trailing axes of ``leaf``."""
    return jnp.reshape(weight, jnp.shape(weight) + (1,) * (jnp.ndim(leaf) - jnp.ndim(weight)))


def tree_add(a, b):
    """Leafwise ``a + b`` (sums of contributions); a ValueError naming both shapes when they differ."""
    shapes = [jax.tree.map(jnp.shape, t) for t in (a, b)]
    if jax.tree.structure(a) != jax.tree.structure(b) or shapes[0] != shapes[1]:
        raise ValueError(
            f"contributions differ in structure or shape ({shapes[0]} vs {shapes[1]}); every client and every "
            "tier must contribute one shape (decode a tier's upload with receive)"
        )
    return jax.tree.map(jnp.add, a, b)


def all_finite(tree) -> jax.Array:
    """Whether every floating value of ``tree`` is finite (a bool scalar)."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


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


def tree_select(predicate, on_true, on_false):
    """Leafwise ``where(predicate, on_true, on_false)`` for a scalar predicate."""
    return jax.tree.map(lambda a, b: jnp.where(predicate, a, b), on_true, on_false)


def tree_bytes(tree) -> int:
    """Bytes of all array leaves of ``tree`` (static: from shapes and dtypes)."""
    return int(sum(np.prod(np.shape(x), dtype=np.int64) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def human_bytes(n: float) -> str:
    """``n`` bytes for people: ``"512 B"``, ``"12.3 KB"``, ``"66.3 MB"``, ... (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"
