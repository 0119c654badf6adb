"""The losses the engine and every algorithm share: cross-entropy for labels, squared error for
float targets, their mean over an example mask, and the KL divergence the distillations take."""

from __future__ import annotations

import jax.numpy as jnp
import optax


def is_regression(targets) -> bool:
    """Float targets are a regression task (mean squared error); integer labels a classification."""
    return jnp.issubdtype(targets.dtype, jnp.floating)


def example_losses(outputs, targets):
    """Per-example loss: cross-entropy for integer labels, squared error averaged over the outputs
    (torch's ``MSELoss``) for float targets."""
    if is_regression(targets):
        return jnp.mean(jnp.square(outputs - targets.reshape(outputs.shape)), axis=-1)
    return optax.softmax_cross_entropy_with_integer_labels(outputs, targets)


def masked_mean(values, mask):
    """The mean of per-example ``values`` over the examples where ``mask`` is True (0 when there are none)."""
    weight = mask.astype(values.dtype)
    return jnp.sum(values * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def masked_loss(outputs, targets, mask):
    """Mean :func:`example_losses` over the examples where ``mask`` is True (0 when there are none)."""
    return masked_mean(example_losses(outputs, targets), mask)


def kl_divergence(log_p, log_q):
    """Per example ``KL(p || q) = sum_c p_c (log p_c - log q_c)`` from log-probabilities over the last axis."""
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
