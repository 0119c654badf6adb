"""Communication accounting: the bytes a round's clients upload and download, counted from the
messages actually sent (an algorithm's ``message_bytes`` / ``download_bytes`` where it says what
one upload or download really takes, else the arrays' sizes), over the real clients only."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfed.contract import FederatedAlgorithm, RoundInfo
from jaxfed.core import tree_bytes


def sent_bytes(algorithm: FederatedAlgorithm, message_down, client_states, info: RoundInfo, count: int):
    """``[count]``: the bytes the server sends each client (``sent_bytes`` where each is sent its
    own part of ``message_down``); default: all of ``message_down``."""
    return _per_client(algorithm.sent_bytes, message_down, client_states, info, count)


def download_bytes(algorithm: FederatedAlgorithm, message_down, client_states, info: RoundInfo, count: int):
    """``[count]``: the bytes each client must download when it keeps what it received in earlier
    rounds (its state before the update says what that is); default: what it is sent."""
    if algorithm.download_bytes is None:
        return sent_bytes(algorithm, message_down, client_states, info, count)
    return _per_client(algorithm.download_bytes, message_down, client_states, info, count)


def _per_client(count_bytes, message_down, client_states, info: RoundInfo, count: int):
    if count_bytes is None:
        return jnp.full(count, float(tree_bytes(message_down)), jnp.float32)
    per_client = jax.vmap(count_bytes, in_axes=(None, 0, None))
    return per_client(message_down, client_states, info).astype(jnp.float32)


def upload_bytes(algorithm: FederatedAlgorithm, message_up) -> jax.Array:
    """The bytes one upload takes (float32 scalar)."""
    if algorithm.message_bytes is None:
        return jnp.float32(tree_bytes(message_up))
    return jnp.asarray(algorithm.message_bytes(message_up), jnp.float32)


def real_total(is_real, per_client):
    """The sum of ``per_client`` over the real clients (padding rows left out)."""
    return jnp.sum(jnp.where(is_real, per_client, 0.0))


def traffic(algorithm: FederatedAlgorithm, groups, tiers) -> tuple[dict, dict]:
    """A round's traffic metrics from its client groups (each with ``tiers`` (each row's),
    ``is_real``, ``rows.bad``, ``up_bytes``, ``down_sent``, ``down_bytes`` and ``tier_up_bytes``): ``(totals,
    per_tier)``. ``totals``: ``bytes_up``, ``bytes_down`` (every sampled client downloads its
    tier's whole message), ``bytes_down_cached`` (what it must download, keeping what it received
    before); ``per_tier`` (``tiers``: a tiered algorithm's bounds): what one client of each tier
    uploads (``bytes_up_client_tier<t>``, the mean where it varies; NaN where no client of the
    tier uploaded)."""
    totals = {
        "bytes_up": sum(real_total(g.is_real, g.up_bytes) for g in groups),
        "bytes_down": sum(g.down_sent for g in groups),
        "bytes_down_cached": sum(real_total(g.is_real, g.down_bytes) for g in groups),
    }
    per_tier = {}
    if tiers is not None:
        fixed = [size for g in groups for size in g.tier_up_bytes]  # one per tier, in tier order
        for t in range(len(tiers)):
            if algorithm.message_bytes is None:
                per_tier[f"bytes_up_client_tier{t}"] = jnp.asarray(fixed[t], jnp.float32)
                continue
            members = [g.is_real & ~g.rows.bad & (g.tiers == t) for g in groups]  # the tier's uploads
            n = sum(jnp.sum(m).astype(jnp.float32) for m in members)
            up = sum(real_total(m, g.up_bytes) for m, g in zip(members, groups))
            # NaN, not 0, in a round without an upload of the tier (the rows' means leave NaN out)
            per_tier[f"bytes_up_client_tier{t}"] = jnp.where(n > 0, up / jnp.maximum(n, 1.0), jnp.nan)
    return totals, per_tier
