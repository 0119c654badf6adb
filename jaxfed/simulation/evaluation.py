"""Evaluation: every client's personalized model on its own test split, vmapped in chunks of
clients, and the global model (where there is one) on the pooled test set."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxfed.data import ClientData


def evaluate_examples(model, variables, data: ClientData, batch_size: int):
    """``(correct, loss_sum, count)`` of ``variables`` on all real examples of ``data``."""
    max_examples = data.indices.shape[0]
    steps = -(-max_examples // batch_size)
    positions = jnp.arange(steps * batch_size, dtype=jnp.int32).reshape(steps, batch_size)

    def one_batch(totals, pos):
        batch = data.batch(pos)
        logits, _ = model.apply(variables, batch.x, train=False)
        weight = batch.mask.astype(jnp.float32)
        correct = jnp.sum((jnp.argmax(logits, -1) == batch.y) * weight)
        loss = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, batch.y) * weight)
        return (totals[0] + correct, totals[1] + loss), None

    (correct, loss), _ = jax.lax.scan(one_batch, (jnp.float32(0), jnp.float32(0)), positions)
    return correct, loss, data.count.astype(jnp.float32)


def personalized_metrics(correct, loss, count) -> dict:
    """Per-client accuracies summarized: unweighted mean, sample-weighted mean, std across clients
    (clients without test examples excluded)."""
    has_test = count > 0
    acc = jnp.where(has_test, correct / jnp.maximum(count, 1), 0.0)
    n = jnp.maximum(jnp.sum(has_test), 1)
    mean = jnp.sum(acc) / n
    return {
        "personalized_acc_mean": mean,
        "personalized_acc_weighted": jnp.sum(correct) / jnp.maximum(jnp.sum(count), 1),
        "personalized_acc_std": jnp.sqrt(jnp.sum(jnp.where(has_test, (acc - mean) ** 2, 0.0)) / n),
        "personalized_loss": jnp.sum(loss) / jnp.maximum(jnp.sum(count), 1),
    }


def pooled_view(x, y) -> ClientData:
    """The whole test set as one client's data."""
    n = x.shape[0]
    return ClientData(x=x, y=y, indices=jnp.arange(n, dtype=jnp.int32), count=jnp.int32(n))
