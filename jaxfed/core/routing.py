"""Private per-client routers over C mixture components (FLoRAL's adaptors, the ensemble's models).

A client's router is a vector of logits ``w`` (client state, never uploaded); its mixture weights
are ``pi = softmax((w + noise) / T)``, optionally clamped from below at a floor. The server
averages component c over the clients with ``p(k|c) = p_k pi_kc / sum_k' p_k' pi_k'c``
(:func:`mixture_share`, summed and taken the mean of). ``oracle`` routers sit on the client's ground-truth cluster
``k mod num_clusters``: logits 0 there and -100 elsewhere, as in the authors' code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfed.core.tree import WeightedSum, weighted_share
from jaxfed.errors import ConfigError, unknown_choice

ROUTERS = ("learned", "oracle")
ORACLE_LOGIT_GAP = 100.0


def mixture_weights(
    logits: jax.Array,
    rng: jax.Array | None = None,
    noise_std: float = 0.0,
    temperature: float = 1.0,
    floor: float = 0.0,
):
    """``max(softmax((logits + noise_std * U[0, 1)) / temperature), floor)``; no noise without
    ``rng``. The floor clamps each weight without renormalizing (0: a plain softmax)."""
    if rng is not None and noise_std:
        logits = logits + noise_std * jax.random.uniform(rng, logits.shape, logits.dtype)
    pi = jax.nn.softmax(logits / temperature)
    return jnp.maximum(pi, floor) if floor else pi


def mixture_share(components, pi: jax.Array, weight) -> WeightedSum:
    """One client's share of the mixture average: component c of its upload ``components``
    (leaves ``[C, ...]``) weighted ``p_k pi_kc``. Summed over the clients k and taken
    :func:`~jaxfed.core.mean_of` (with the previous components: a component no client used keeps
    its value), component c is ``sum_k p(k|c) x_kc`` with ``p(k|c) = p_k pi_kc / sum_k' p_k' pi_k'c``."""
    return weighted_share(components, weight * pi)


def check_router(router: str, num_components: int, num_clusters: int) -> None:
    if router not in ROUTERS:
        raise ConfigError(f"router: {unknown_choice(router, ROUTERS)}")
    if router == "oracle" and num_clusters > num_components:
        raise ConfigError(
            f"router: oracle routes each of num_clusters={num_clusters} clusters to its own component; "
            f"needs num_adaptors >= {num_clusters}, got {num_components}"
        )


def oracle_logits(client_id, num_components: int, num_clusters: int) -> jax.Array:
    """Logits whose softmax is one-hot (to float precision) on cluster ``client_id mod num_clusters``."""
    cluster = client_id % num_clusters
    return jnp.where(jnp.arange(num_components) == cluster, 0.0, -ORACLE_LOGIT_GAP).astype(jnp.float32)


def oracle_init(num_components: int, num_clusters: int):
    """An ``init_client(client_state, client_id, tier)`` hook that sets the ``router`` field of a client
    state record (a ``NamedTuple``) to the oracle's logits."""

    def init_client(client_state, client_id, tier):
        return client_state._replace(router=oracle_logits(client_id, num_components, num_clusters))

    return init_client
