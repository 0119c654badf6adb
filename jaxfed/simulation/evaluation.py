"""Evaluation: every client's personalized model on its own test split, vmapped in chunks of
clients, and the global model (where there is one) on the pooled test set.

Classification (integer labels) reports accuracies; regression (float targets) reports mean
squared errors, under ``personalized_mse_*`` and ``global_mse``."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.contract import RoundInfo
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


class Evaluation:
    """Every client's personalized model on its own test split (chunks of clients with similar
    test sizes under ``lax.map``, spread over the strategy's devices) and, where the algorithm has
    one, the global model on the pooled test set. The algorithm is given per call (a sweep's
    member has its own)."""

    def __init__(self, model, pooled_model, strategy, tiers, test_counts, batch_size: int, examples_per_call: int):
        self.model, self.pooled_model, self.strategy, self.tiers = model, pooled_model, strategy, tiers
        self.batch_size = batch_size
        self.client_batch = client_eval_batch(test_counts, batch_size)
        self.clients_per_chunk = max(1, examples_per_call // self.client_batch)

    def __call__(self, algorithm, state, data, counted=None) -> dict:
        """The metrics (as arrays) of ``state`` (a :class:`~jaxfed.simulation.SimState`) on
        ``data``'s test splits; ``counted``: ``[num_clients]`` bool, the clients whose results
        count (the others count as clients without test examples), default all."""
        model = algorithm.eval_model or self.model
        pooled_model = algorithm.eval_model or self.pooled_model
        num_clients = data.num_clients
        test = data.test_data(jnp.arange(num_clients, dtype=jnp.int32))
        if counted is not None:
            test = test.replace(count=jnp.where(counted, test.count, 0))
        regression = is_regression(data.y_test)
        if algorithm.evaluates_global:  # one pass over the pooled test set, each client's share summed
            outcomes = self.pooled_outcomes(pooled_model, algorithm.global_params(state.server), data)
            correct, loss = (client_totals(o, test.indices, test.count) for o in outcomes)
            metrics = personalized_metrics(correct, loss, test.count.astype(jnp.float32), regression)
            return {**metrics, **global_metrics(*outcomes, regression)}

        def evaluate_block(server_view, lo, hi):
            block = jax.tree.map(lambda x: x[lo:hi], (state.clients, test.indices, test.count))
            return self.clients(algorithm, model, server_view, block, data)

        if algorithm.eval_server is None:
            correct, loss, count = evaluate_block(state.server, 0, num_clients)
        else:  # each tier's clients against that tier's view of the server, computed once
            blocks = [
                evaluate_block(algorithm.eval_server(state.server, RoundInfo(round=state.round, tier=t)), lo, hi)
                for t, (lo, hi) in enumerate(self.tiers)
            ]
            correct, loss, count = (jnp.concatenate(parts) for parts in zip(*blocks))
        metrics = personalized_metrics(correct, loss, count, regression)
        if algorithm.global_params is not None:
            outcomes = self.pooled_outcomes(pooled_model, algorithm.global_params(state.server), data)
            metrics.update(global_metrics(*outcomes, regression))
        return metrics

    def clients(self, algorithm, model, server_view, clients, data):
        """``(correct, loss, count)`` per client of ``clients = (states, test indices, test counts)``,
        each on its own test split. The rows come in run order, with padding clients (count 0)
        appended: the summaries that follow do not depend on the order and skip clients without
        test examples."""
        batch = self.client_batch

        def one_client(shared, args):
            server_view, x, y = shared
            client_state, indices, count = args
            variables = algorithm.eval_params(server_view, client_state)
            return evaluate_examples(model, variables, ClientData(x, y, indices, count), batch)

        def evaluate_all(shared, xs):
            return jax.lax.map(functools.partial(one_client, shared), xs, batch_size=self.clients_per_chunk)

        states, indices, counts = self.strategy.padded_rows(clients)
        real = jnp.arange(counts.shape[0]) < clients[2].shape[0]
        counts = jnp.where(real, counts, 0)  # padding clients have no test examples: not counted
        order = self.strategy.run_order(counts)
        clients = jax.tree.map(lambda x: x[order], (states, indices, counts))
        return self.strategy.over_devices(evaluate_all, (server_view, data.x_test, data.y_test), clients)

    def pooled_outcomes(self, model, variables, data):
        """``(correct, loss)`` of ``variables`` on every test example (``[N]`` each), in batches of
        ``batch_size`` shared out to the devices."""
        n = data.x_test.shape[0]
        positions = batch_positions(n, self.batch_size)

        def outcomes(shared, batches):
            return jax.lax.map(functools.partial(batch_outcomes, model, *shared), batches)

        shared = (variables, data.x_test, data.y_test)
        per_batch = self.strategy.over_devices(outcomes, shared, self.strategy.padded_rows(positions))
        return tuple(o.reshape(-1)[:n] for o in per_batch)  # padding batches last
