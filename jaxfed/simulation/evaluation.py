"""Evaluation: every client's personalized model on its own test split, vmapped in chunks of
clients, and the global model (where there is one) on the pooled test set.

Classification (integer labels) reports accuracies; regression (float targets) reports mean
squared errors, under ``personalized_mse_*`` and ``global_mse``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.core.losses import example_losses, is_regression
from jaxfed.data import ClientData


def evaluate_examples(model, variables, data: ClientData, batch_size: int):
    """``(correct, loss_sum, count)`` of ``variables`` on all real examples of ``data``, in
    ``ceil(count / batch_size)`` batches (a ``lax.while_loop``: vmapped, a group of clients runs as
    many batches as its largest)."""
    steps = -(-data.count // batch_size)

    def one_batch(carry):
        i, correct, loss = carry
        batch = data.batch(i * batch_size + jnp.arange(batch_size, dtype=jnp.int32))
        logits, _ = model.apply(variables, batch.x, train=False)
        weight = batch.mask.astype(jnp.float32)
        if not is_regression(batch.y):
            correct = correct + jnp.sum((jnp.argmax(logits, -1) == batch.y) * weight)
        return i + 1, correct, loss + jnp.sum(example_losses(logits, batch.y) * weight)

    _, correct, loss = jax.lax.while_loop(
        lambda carry: carry[0] < steps, one_batch, (jnp.int32(0), jnp.float32(0), jnp.float32(0))
    )
    return correct, loss, data.count.astype(jnp.float32)


def batch_positions(n: int, batch_size: int):
    """``[ceil(n / batch_size), batch_size]`` example positions ``0..n-1``, the last batch padded
    with ``n - 1`` (its outcomes are sliced off)."""
    steps = -(-n // batch_size)
    return jnp.minimum(jnp.arange(steps * batch_size, dtype=jnp.int32), n - 1).reshape(steps, batch_size)


def batch_outcomes(model, variables, x, y, positions):
    """``(correct, loss)`` of ``variables`` on the examples at ``positions`` (correct is 0 for
    regression)."""
    logits, _ = model.apply(variables, jnp.take(x, positions, axis=0), train=False)
    labels = jnp.take(y, positions, axis=0)
    correct = jnp.zeros(positions.shape) if is_regression(y) else (jnp.argmax(logits, -1) == labels)
    return correct.astype(jnp.float32), example_losses(logits, labels)


def client_totals(per_example, indices, counts):
    """``[clients]``: each client's sum of ``per_example`` over its examples ``indices[k, :counts[k]]``."""
    real = jnp.arange(indices.shape[1]) < counts[:, None]
    return jnp.sum(jnp.where(real, per_example[indices], 0.0), axis=1)


def client_eval_batch(test_counts, largest: int) -> int:
    """A per-client evaluation batch: the mean test split rounded up to a power of two (at least
    8, at most ``largest`` and the biggest split), so small clients do not pad to the largest."""
    counts = np.asarray(test_counts)
    mean = max(float(counts.mean()) if counts.size else 1.0, 1.0)
    return int(min(largest, max(int(counts.max()) if counts.size else 1, 1), max(8, 2 ** math.ceil(math.log2(mean)))))


def _summarize(per_client_total, count, name: str) -> dict:
    """Per-client means of ``per_client_total``: unweighted mean, sample-weighted mean and std
    across clients (clients without test examples excluded)."""
    has_test = count > 0
    value = jnp.where(has_test, per_client_total / jnp.maximum(count, 1), 0.0)
    n = jnp.maximum(jnp.sum(has_test), 1)
    mean = jnp.sum(value) / n
    return {
        f"personalized_{name}_mean": mean,
        f"personalized_{name}_weighted": jnp.sum(per_client_total) / jnp.maximum(jnp.sum(count), 1),
        f"personalized_{name}_std": jnp.sqrt(jnp.sum(jnp.where(has_test, (value - mean) ** 2, 0.0)) / n),
    }


def personalized_metrics(correct, loss, count, regression: bool = False) -> dict:
    """Per-client accuracies (mean squared errors for ``regression``) summarized; plus the pooled loss."""
    metrics = _summarize(loss, count, "mse") if regression else _summarize(correct, count, "acc")
    metrics["personalized_loss"] = jnp.sum(loss) / jnp.maximum(jnp.sum(count), 1)
    return metrics


def global_metrics(correct, loss, regression: bool = False) -> dict:
    """The global model's accuracy (mean squared error for ``regression``) and loss from its
    per-example outcomes on the pooled test set."""
    n = loss.shape[0]
    return {
        "global_mse" if regression else "global_acc": jnp.sum(loss if regression else correct) / n,
        "global_loss": jnp.sum(loss) / n,
    }
