"""The server's step of a round, in one place for the engine and for code that calls it directly.

An upload is decoded (``receive``, tiers only) into the shape every tier shares; with an
``aggregation`` it becomes its contribution (zero for a row of weight 0: padding, a skipped
client) and the contributions' sum is applied; with a ``server_update`` every decoded upload is
stacked and handed over at once; a round in which no row carried weight keeps the old server
state. :func:`server_step` runs this on stacked uploads (tests, research code); the engine sums
contributions as the clients run instead, then applies the same :func:`apply`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfed.contract import FederatedAlgorithm, RoundInfo, check_server_state, check_server_step
from jaxfed.core import concat_clients, tree_add, tree_select


def decode(algorithm: FederatedAlgorithm, server_state, message_up, info: RoundInfo):
    """One upload as the server reads it: ``receive`` where there is one."""
    return message_up if algorithm.receive is None else algorithm.receive(server_state, message_up, info)


def contribution(algorithm: FederatedAlgorithm, server_state, decoded, weight, info: RoundInfo):
    """One decoded upload's share of the aggregation's sum; zero for a row of weight 0."""
    share = algorithm.aggregation.contribute(server_state, decoded, weight, info)
    return tree_select(weight > 0, share, jax.tree.map(jnp.zeros_like, share))


def apply(algorithm: FederatedAlgorithm, server_state, totals, decoded, weights, round_):
    """The new server state from each group's summed contributions (``totals``, an aggregation)
    or each group's stacked decoded uploads and weights (a ``server_update``); the old one where
    no row carried weight (every client padding or skipped), whatever the algorithm returns."""
    info = RoundInfo(round=jnp.asarray(round_, jnp.int32), tier=None)  # the step aggregates every tier
    if algorithm.aggregation is not None:
        new_state = algorithm.aggregation.apply(server_state, functools.reduce(tree_add, totals), info)
        new_state = check_server_state("aggregation.apply", new_state, server_state)
    else:
        new_state = algorithm.server_update(server_state, concat_clients(decoded), jnp.concatenate(weights), info)
        new_state = check_server_state("server_update", new_state, server_state)
    return tree_select(jnp.any(jnp.concatenate(weights) > 0), new_state, server_state)


def server_step(algorithm: FederatedAlgorithm, server_state, uploads, weights, round_=0):
    """The server's step on stacked uploads, as a round makes it (the engine's own step:
    :func:`apply`, so a round in which every weight is 0 keeps ``server_state`` here too).

    Args:
      algorithm: the algorithm.
      server_state: the server's state.
      uploads: the clients' uploads stacked along a leading axis (every client of tier 0), or a
        list of such stacks, one per tier.
      weights: ``[clients]`` training-set sizes (0: the row counts for nothing), or a list, one per tier.
      round_: the round being run (0-based).

    Returns:
      the new server state; one equal to ``server_state`` where every weight is 0.
    """
    check_server_step(algorithm)
    if not isinstance(uploads, list):
        uploads, weights = [uploads], [weights]
    weights = [jnp.asarray(w, jnp.float32) for w in weights]
    totals, decoded = [], []
    for tier, (stack, w) in enumerate(zip(uploads, weights)):
        info = RoundInfo(round=jnp.asarray(round_, jnp.int32), tier=tier)
        rows = jax.vmap(lambda m: decode(algorithm, server_state, m, info))(stack)  # noqa: B023
        decoded.append(rows)
        if algorithm.aggregation is not None:
            shares = jax.vmap(lambda m, x: contribution(algorithm, server_state, m, x, info))(rows, w)  # noqa: B023
            totals.append(jax.tree.map(lambda s: jnp.sum(s, axis=0), shares))
    return apply(algorithm, server_state, totals, decoded, weights, round_)
