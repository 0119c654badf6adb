"""Private per-client routers over C mixture components (FLoRAL's adaptors, the ensemble's models).

A client's router is a vector of logits ``w`` (client state, never uploaded); its mixture weights
are ``pi = softmax((w + noise) / T)``, optionally clamped from below at a floor. The server
averages component c over the clients with ``p(k|c) = p_k pi_kc / sum_k' p_k' pi_k'c``
(:func:`mixture_average`). ``oracle`` routers sit on the client's ground-truth cluster
``k mod num_clusters``: logits 0 there and -100 elsewhere, as in the authors' code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfed.errors import ConfigError

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


def component_weights(pi: jax.Array, weights: jax.Array) -> jax.Array:
    """``[clients, C]``: ``p(k|c) = p_k pi_kc / sum_k' p_k' pi_k'c`` (0 for a component nobody used)."""
    joint = weights[:, None] * pi
    return joint / jnp.where(jnp.sum(joint, axis=0) > 0, jnp.sum(joint, axis=0), 1.0)


def mixture_average(components, pi: jax.Array, weights: jax.Array, previous):
    """Component c of the stacked uploads ``components`` (leaves ``[clients, C, ...]``) averaged with
    weights ``p(k|c)``; a component no client used keeps its ``previous`` value (leaves ``[C, ...]``)."""
    per_client = component_weights(pi, weights)
    used = jnp.sum(weights[:, None] * pi, axis=0) > 0  # [C]

    def average(x, old):
        w = per_client.reshape(per_client.shape + (1,) * (x.ndim - 2))
        return jnp.where(used.reshape((-1,) + (1,) * (old.ndim - 1)), jnp.sum(w * x, axis=0), old)

    return jax.tree.map(average, components, previous)


def check_router(router: str, num_components: int, num_clusters: int) -> None:
    if router not in ROUTERS:
        raise ConfigError(f"router: unknown '{router}'; allowed: {', '.join(ROUTERS)}")
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
    """An ``init_client(client_state, client_id)`` hook that sets the ``router`` field of a client
    state record (a ``NamedTuple``) to the oracle's logits."""

    def init_client(client_state, client_id):
        return client_state._replace(router=oracle_logits(client_id, num_components, num_clusters))

    return init_client
