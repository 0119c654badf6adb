"""Which clients take part in a round, and the per-round / per-client keys.

All randomness derives from one root key, one stream per use: init ``fold_in(root, INIT)``; round t
``fold_in(fold_in(root, ROUNDS), t)`` and client k in it ``fold_in(fold_in(round_key, CLIENTS), k)``;
the fixed cohort ``fold_in(root, COHORT)``; the evaluation after t rounds, for an algorithm's
``personalize``, ``fold_in(fold_in(root, PERSONALIZE), t)`` and client k ``fold_in(that, k)``.
Numbers therefore do not depend on how many devices run the round, how the clients are padded,
or whether the run was resumed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.errors import ConfigError

SAMPLINGS = ("uniform", "fixed", "first")
COHORT_SAMPLINGS = ("fixed", "first")  # one cohort trains every round: eval_clients="cohort" needs one
EVAL_CLIENTS = ("all", "cohort")

_INIT, _ROUNDS, _COHORT, _PERSONALIZE = 0, 1, 2, 3
_SAMPLE, _CLIENTS = 0, 1


def init_key(root):
    return jax.random.fold_in(root, _INIT)


def round_key(root, round_index):
    return jax.random.fold_in(jax.random.fold_in(root, _ROUNDS), round_index)


def personalization_key(root, rounds_completed):
    """The key of the evaluation after ``rounds_completed`` rounds whose per-client fold-ins feed an
    algorithm's ``personalize``."""
    return jax.random.fold_in(jax.random.fold_in(root, _PERSONALIZE), rounds_completed)


def client_keys(round_key_, ids):
    base = jax.random.fold_in(round_key_, _CLIENTS)
    return jax.vmap(lambda k: jax.random.fold_in(base, k))(ids)


def num_sampled(num_clients: int, participation: float) -> int:
    """Clients per round: ``participation`` of ``num_clients`` (at least one); a ConfigError for a
    participation outside (0, 1]."""
    if not 0 < participation <= 1:
        raise ConfigError(f"participation: must be in (0, 1], got {participation}")
    return max(1, int(round(participation * num_clients)))


def sample_clients(root, round_key_, num_clients: int, count: int, sampling: str = "uniform"):
    """Sorted ids of ``count`` distinct clients: drawn anew each round (``uniform``) or one cohort
    every round (``fixed``, ``first``: :func:`cohort`)."""
    if sampling in COHORT_SAMPLINGS:
        return cohort(root, num_clients, count, sampling)
    return _draw(jax.random.fold_in(round_key_, _SAMPLE), num_clients, count)


def cohort(root, num_clients: int, count: int, sampling: str = "fixed"):
    """The sorted ids of the cohort that trains every round: drawn once from the root key
    (``fixed``), or clients ``0 .. count-1`` (``first``: PFLlib's and FedCSPACK's authors' "fix"
    selection, which with a partition file of theirs picks their clients)."""
    if sampling == "first":
        return jnp.arange(count, dtype=jnp.int32)
    return _draw(jax.random.fold_in(root, _COHORT), num_clients, count)


def _draw(key, num_clients: int, count: int):
    return jnp.sort(jax.random.choice(key, num_clients, (count,), replace=False)).astype(jnp.int32)


def held_out(new_clients, num_clients: int, field: str = "new_clients"):
    """The sorted ids (numpy int32) of the clients held out of training as new clients (given as
    ids, or as a fraction of the clients: :func:`fraction_ids`), or None for none; a ConfigError
    naming ``field`` (the caller's name for them) for ids that are not distinct integers in
    ``0..num_clients-1`` or that leave no client to train."""
    if isinstance(new_clients, (float, np.floating)):
        new_clients = fraction_ids(new_clients, num_clients)
    elif np.ndim(new_clients) == 0 and new_clients is not None:
        raise ConfigError(
            f"new_clients: client ids (a list) or a fraction of the clients in [0, 1), got {new_clients!r} "
            f"(client {new_clients} alone: [{new_clients}])"
        )
    if new_clients is None or len(new_clients) == 0:
        return None
    ids = np.asarray(new_clients)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"{field}: client ids must be a list of integers, got {ids.dtype} of shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= num_clients or len(np.unique(ids)) != len(ids):
        raise ConfigError(f"{field}: ids must be distinct and in 0..{num_clients - 1}, got {sorted(ids.tolist())}")
    if len(ids) >= num_clients:
        raise ConfigError(f"{field}: all {num_clients} clients held out; at least one must train")
    return np.sort(ids).astype(np.int32)


def fraction_ids(fraction: float, num_clients: int) -> tuple[int, ...]:
    """The ids of ``fraction`` of the clients held out as new clients: :func:`spread_ids` of at
    least one when ``fraction`` is above 0; a ConfigError outside ``[0, 1)``."""
    if not 0 <= fraction < 1:
        raise ConfigError(f"new_clients: a fraction of the clients must be in [0, 1), got {fraction}")
    if not fraction:
        return ()
    return tuple(int(i) for i in spread_ids(max(1, round(fraction * num_clients)), num_clients))


def spread_ids(count: int, num_clients: int):
    """``count`` client ids spread evenly over ``0..num_clients-1`` (over contiguous tiers and the
    ``k mod C`` clusters alike), the same for every seed: ``floor((j + 1/2) * N / count)``."""
    return ((np.arange(count) + 0.5) * num_clients / count).astype(np.int64)


def tier_bounds(num_clients: int, num_tiers: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` client-id ranges of ``num_tiers`` equal contiguous blocks: client k is in tier
    ``k * num_tiers // num_clients``. Raises :class:`ConfigError` when a tier would be empty."""
    if not 1 <= num_tiers <= num_clients:
        raise ConfigError(
            f"tiers: {num_tiers} tiers for {num_clients} clients; allowed 1..{num_clients} (every tier needs a client)"
        )
    starts = [-(-t * num_clients // num_tiers) for t in range(num_tiers + 1)]
    return list(zip(starts[:-1], starts[1:]))


def tier_of(ids, bounds: list[tuple[int, int]]):
    """Each id's tier under ``bounds`` (:func:`tier_bounds`); an id past the last client (padding)
    gets the last tier's."""
    ends = jnp.asarray([hi for _, hi in bounds], ids.dtype)
    return jnp.minimum(jnp.searchsorted(ends, ids, side="right"), len(bounds) - 1).astype(jnp.int32)


def tier_members(ids, lo: int, hi: int, size: int, fill: int):
    """The ids in ``[lo, hi)``, first, in a fixed-size array padded with ``fill``."""
    inside = (ids >= lo) & (ids < hi)
    (positions,) = jnp.nonzero(inside, size=size, fill_value=0)
    return jnp.where(jnp.arange(size) < jnp.sum(inside), ids[positions], fill).astype(ids.dtype)


def pad_ids(ids, multiple: int, fill: int):
    """Pad ``ids`` to a multiple of ``multiple`` with ``fill`` (an out-of-range id: a dummy client)."""
    pad = -len(ids) % multiple
    return jnp.concatenate([ids, jnp.full((pad,), fill, ids.dtype)]) if pad else ids
