"""Parameter packs: a pytree seen as ``[num_packs, pack_size]`` rows, scored and selected per pack.

FedCSPACK's primitives, pure and vmappable (one client's packs in, static shapes out):

- :class:`PackView` flattens a parameter tree (``jax.flatten_util.ravel_pytree``), zero-pads it
  to a multiple of ``pack_size`` and reshapes it to packs; ``view.to_tree`` inverts it.
- :func:`cosine` of two vectors (the whole-model threshold ``theta_a``) and
  :func:`pack_cosine` per pack (``theta_j``); :func:`pack_kl` per pack,
  ``KL(softmax(reference_j) || softmax(local_j))`` (the authors' ``F.kl_div(log softmax(local),
  softmax(global), "sum")``).
- :func:`select_packs`: the ``k`` packs with the lowest ``theta_j`` among those below the
  threshold, as ``k`` indices and a validity mask (fewer than ``k`` may qualify).
- :func:`pack_weights`: the double weight ``|theta + beta|`` (or ``|theta|``, ``|beta|``).
- :func:`pack_share` / :func:`aggregated_packs`: a client's share of each pack's weighted mean
  over the clients that sent it, summed by the engine; a pack nobody sent keeps its value
  (:func:`aggregate_packs`: the same over stacked uploads).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from jaxfed.core.tree import WeightedSum, mean_of, weighted_share
from jaxfed.errors import ConfigError, unknown_choice

WEIGHTS = ("cos_kl", "cos", "kl")
EPS = 1e-8  # torch.cosine_similarity's eps


class PackView(NamedTuple):
    """How a parameter tree maps to ``[num_packs, pack_size]`` (static)."""

    size: int  # parameters in the tree
    pack_size: int
    num_packs: int
    unravel: Callable[[jax.Array], Any]

    def to_packs(self, tree) -> jax.Array:
        flat, _ = ravel_pytree(tree)
        return jnp.pad(flat, (0, self.num_packs * self.pack_size - self.size)).reshape(self.num_packs, self.pack_size)

    def to_tree(self, packs: jax.Array):
        return self.unravel(packs.reshape(-1)[: self.size])


def pack_view(tree, pack_size: int) -> PackView:
    """The :class:`PackView` of ``tree`` (arrays or shape structs) for packs of ``pack_size``."""
    if pack_size < 1:
        raise ConfigError(f"pack_size: must be >= 1, got {pack_size}")
    example = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)
    flat, unravel = ravel_pytree(example)
    return PackView(flat.size, pack_size, max(1, math.ceil(flat.size / pack_size)), unravel)


def num_selected(num_packs: int, share_ratio: float) -> int:
    """``K = ceil(share_ratio * num_packs)`` (``share_ratio`` in (0, 1])."""
    if not 0 < share_ratio <= 1:
        raise ConfigError(f"share_ratio: must be in (0, 1], got {share_ratio}")
    return max(1, min(num_packs, math.ceil(share_ratio * num_packs - 1e-9)))


def cosine(a: jax.Array, b: jax.Array, axis: int = -1) -> jax.Array:
    """Cosine similarity along ``axis``: ``a.b / (max(|a|, eps) max(|b|, eps))``."""
    dot = jnp.sum(a * b, axis=axis)
    norms = jnp.maximum(jnp.linalg.norm(a, axis=axis), EPS) * jnp.maximum(jnp.linalg.norm(b, axis=axis), EPS)
    return dot / norms


def pack_cosine(local_packs: jax.Array, reference_packs: jax.Array) -> jax.Array:
    """``[num_packs]``: the cosine similarity of each local pack with the reference pack."""
    return cosine(local_packs, reference_packs, axis=-1)


def pack_kl(local_packs: jax.Array, reference_packs: jax.Array) -> jax.Array:
    """``[num_packs]``: ``KL(softmax(reference_j) || softmax(local_j))`` of each pack.

    Computed from the difference ``d = local - reference`` as ``log E_p[exp(e)]`` with
    ``p = softmax(reference)`` and ``e = d - E_p[d]`` (equal to the textbook sum, which in float32
    loses the result to cancellation when the packs are close: half its values come out negative
    at a delta of 1e-4). ``E_p[exp(e)] = 1 + E_p[exp(e) - 1 - e]`` with a series for small ``e``,
    so the value is >= 0 and about ``Var_p(d) / 2``, accurate to float32 rounding."""
    p = jax.nn.softmax(reference_packs, axis=-1)
    d = local_packs - reference_packs
    e = d - jnp.sum(p * d, axis=-1, keepdims=True)
    return jnp.log1p(jnp.sum(p * _exp_minus_linear(e), axis=-1))


def _exp_minus_linear(e: jax.Array) -> jax.Array:
    """``exp(e) - 1 - e`` without cancellation near 0 (a series below |e| = 1e-2)."""
    series = e * e * (0.5 + e * (1.0 / 6.0 + e / 24.0))
    return jnp.where(jnp.abs(e) < 1e-2, series, jnp.expm1(e) - e)


def select_packs(theta: jax.Array, threshold: jax.Array, k: int):
    """``(indices [k], valid [k])``: the packs with the ``k`` lowest ``theta`` (ascending), valid
    where ``theta < threshold``. ``k = num_packs`` selects every pack below the threshold."""
    neg_top, indices = jax.lax.top_k(-theta, k)
    return indices.astype(jnp.int32), -neg_top < threshold


def pack_weights(theta: jax.Array, beta: jax.Array, weight: str = "cos_kl") -> jax.Array:
    """The double weight ``|theta + beta|`` (``cos_kl``), or ``|theta|`` (``cos``), ``|beta|`` (``kl``)."""
    if weight not in WEIGHTS:
        raise ConfigError(f"weight: {unknown_choice(weight, WEIGHTS)}")
    return jnp.abs({"cos_kl": theta + beta, "cos": theta, "kl": beta}[weight])


def scatter_packs(num_packs: int, indices: jax.Array, rows: jax.Array) -> jax.Array:
    """``[num_packs, ...]`` zeros with ``rows`` at ``indices`` (indices distinct)."""
    return jnp.zeros((num_packs,) + rows.shape[1:], rows.dtype).at[indices].set(rows)


def pack_share(packs: jax.Array, indices: jax.Array, deltas: jax.Array, weights: jax.Array) -> WeightedSum:
    """One client's share of the double-weight aggregation: its sent packs (global pack plus
    delta) at their positions, weighted by its pack weights ``m_kj`` (``[P]``, 0 where not sent).

    ``packs [P, S]`` the global packs; ``indices [k]``, ``deltas [k, S]`` (sent pack minus global
    pack) and ``weights [k]`` (0 = not sent) the client's upload. Summed over the clients, the
    shares' ``weight`` is ``M_j = sum_k m_kj`` (FedCSPACK's next global mask) and
    :func:`aggregated_packs` gives each pack ``PW_j + sum_k (m_kj / M_j) delta_kj``.
    """
    num_packs = packs.shape[0]
    sent = scatter_packs(num_packs, indices, packs[indices] + deltas)
    return weighted_share(sent, scatter_packs(num_packs, indices, weights))


def aggregated_packs(packs: jax.Array, total: WeightedSum) -> jax.Array:
    """The new global packs from the summed :func:`pack_share`: the ``m``-weighted mean of the
    senders' packs; a pack nobody sent is unchanged."""
    return mean_of(total, packs)


def aggregate_packs(packs: jax.Array, indices: jax.Array, deltas: jax.Array, weights: jax.Array):
    """:func:`pack_share` summed over a stacked client axis (``indices [n, k]``, ``deltas [n, k,
    S]``, ``weights [n, k]``) and aggregated: ``(new packs, M)``."""
    shares = jax.vmap(lambda i, d, w: pack_share(packs, i, d, w))(indices, deltas, weights)
    total = jax.tree.map(lambda x: jnp.sum(x, axis=0), shares)
    return aggregated_packs(packs, total), total.weight
