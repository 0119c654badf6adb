"""Evaluation: every client's personalized model on its own test split, vmapped in chunks of
clients, and the global model (where there is one) on the pooled test set.

Classification (integer labels) reports accuracies; regression (float targets) reports mean
squared errors, under ``personalized_mse_*`` and ``global_mse``. Besides the summary numbers, the
metrics hold ``"clients"``: per-client arrays in client-id order (:func:`per_client`), from which
the summaries are computed.

New clients (held out of training: ``Simulation(new_clients=ids)``) are evaluated twice: with the
global model (where there is one), and with the model the algorithm's own personalization makes
from their training split, never uploaded: its ``personalize`` where it has one, else its
``client_update`` from a fresh client state and the round's broadcast, evaluated with
``eval_params``. An algorithm whose clients all use the global model (``evaluates_global``) has no
personalization: its new clients' personalized results are the global model's."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.contract import RoundInfo, check_client_update, check_variables
from jaxfed.core.losses import example_losses, is_regression
from jaxfed.data import ClientData
from jaxfed.simulation import sampling


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


def per_client(correct, loss, count, regression: bool = False, prefix: str = "") -> dict:
    """Per-client arrays (client-id order): accuracy (mean squared error for ``regression``), mean
    loss and test examples counted; NaN for a client without counted test examples."""
    has_test = count > 0
    mean = lambda total: jnp.where(has_test, total / jnp.maximum(count, 1), jnp.nan)  # noqa: E731
    return {
        f"{prefix}{'mse' if regression else 'acc'}": mean(loss if regression else correct),
        f"{prefix}loss": mean(loss),
        f"{prefix}examples": count.astype(jnp.float32),
    }


def _summarize(per_client_total, count, name: str, prefix: str = "personalized") -> dict:
    """Per-client means of ``per_client_total``: unweighted mean, sample-weighted mean and std
    across clients (clients without test examples excluded; NaN where no client has one)."""
    has_test = count > 0
    value = jnp.where(has_test, per_client_total / jnp.maximum(count, 1), 0.0)
    n = jnp.maximum(jnp.sum(has_test), 1)
    mean = jnp.sum(value) / n
    return _nan_without_examples(
        count,
        {
            f"{prefix}_{name}_mean": mean,
            f"{prefix}_{name}_weighted": jnp.sum(per_client_total) / jnp.maximum(jnp.sum(count), 1),
            f"{prefix}_{name}_std": jnp.sqrt(jnp.sum(jnp.where(has_test, (value - mean) ** 2, 0.0)) / n),
        },
    )


def _nan_without_examples(count, metrics: dict) -> dict:
    """``metrics`` as NaN where no client has a test example (a mean of nothing; 0 would read as a
    result), as a client's own metrics are NaN without one."""
    return {k: jnp.where(jnp.sum(count) > 0, v, jnp.nan) for k, v in metrics.items()}


def personalized_metrics(correct, loss, count, regression: bool = False, prefix: str = "personalized") -> dict:
    """Per-client accuracies (mean squared errors for ``regression``) summarized; plus the pooled loss."""
    name, total = ("mse", loss) if regression else ("acc", correct)
    metrics = _summarize(total, count, name, prefix)
    metrics.update(_nan_without_examples(count, {f"{prefix}_loss": jnp.sum(loss) / jnp.maximum(jnp.sum(count), 1)}))
    return metrics


def global_metrics(correct, loss, regression: bool = False) -> dict:
    """The global model's accuracy (mean squared error for ``regression``) and loss from its
    per-example outcomes on the pooled test set."""
    n = loss.shape[0]
    return {
        "global_mse" if regression else "global_acc": jnp.sum(loss if regression else correct) / n,
        "global_loss": jnp.sum(loss) / n,
    }


def scattered(values: dict, ids, num_clients: int) -> dict:
    """Arrays over ``ids`` as ``[num_clients]`` arrays in client-id order: the others' metrics
    NaN and their examples counted 0, as :func:`per_client` gives a client without test examples."""

    def fill(key):
        return 0.0 if key.endswith("examples") else jnp.nan

    return {k: jnp.full(num_clients, fill(k), v.dtype).at[ids].set(v) for k, v in values.items()}


class Evaluation:
    """Every client's personalized model on its own test split (chunks of clients with similar
    test sizes under ``lax.map``, spread over the strategy's devices) and, where the algorithm has
    one, the global model on the pooled test set; held-out new clients after the algorithm's
    personalization (see the module docstring). The algorithm is given per call (a sweep's member
    has its own)."""

    def __init__(
        self,
        model,
        pooled_model,
        strategy,
        tiers,
        test_counts,
        batch_size: int,
        examples_per_call: int,
        new_client_updates: int = 1,
    ):
        self.model, self.pooled_model, self.strategy, self.tiers = model, pooled_model, strategy, tiers
        self.new_client_updates = new_client_updates
        self.batch_size = batch_size
        self.client_batch = client_eval_batch(test_counts, batch_size)
        self.clients_per_chunk = max(1, examples_per_call // self.client_batch)

    def __call__(self, algorithm, state, data, counted=None, root=None, new_clients=None) -> dict:
        """The metrics (as arrays; per-client ones under ``"clients"``) of ``state`` (a
        :class:`~jaxfed.simulation.SimState`) on ``data``'s test splits; ``counted``:
        ``[num_clients]`` bool, the clients whose results count (the others count as clients
        without test examples), default all; ``root``: the run's root key (the keys of an
        algorithm's ``personalize``); ``new_clients``: the ids (numpy) of the clients held out of
        training, evaluated as new clients (they should not be ``counted``)."""
        pooled = self.global_outcomes(algorithm, state.server, data)
        if algorithm.evaluates_global:  # one pass over the pooled test set, each client's share summed
            metrics = self.pooled(algorithm, state.server, data, counted, pooled)
        else:
            blocks = [
                self.block(
                    algorithm,
                    state.server,
                    state.round,
                    tier,
                    jax.tree.map(lambda x: x[lo:hi], state.clients),
                    jnp.arange(lo, hi, dtype=jnp.int32),
                    data,
                    counted,
                    root,
                )
                for tier, lo, hi in self.spans(data.num_clients)
            ]
            correct, loss, count = (jnp.concatenate(parts) for parts in zip(*blocks))
            metrics = self.summary(correct, loss, count, data, pooled)
        if new_clients is not None and len(new_clients):
            held = jax.tree.map(lambda x: x[jnp.asarray(new_clients)], state.clients)
            new = self.new_clients(algorithm, state.server, state.round, held, new_clients, data, root, pooled)
            metrics = {**metrics, **new, "clients": {**metrics["clients"], **new["clients"]}}
        return metrics

    def spans(self, num_clients: int) -> list[tuple[int | None, int, int]]:
        """``[(tier, lo, hi)]``: the client id ranges evaluated against one view of the server
        (each tier's, for an algorithm with ``eval_server``; else all clients, tier None)."""
        if self.tiers is None:
            return [(None, 0, num_clients)]
        return [(t, lo, hi) for t, (lo, hi) in enumerate(self.tiers)]

    def block(self, algorithm, server, round_, tier, states, ids, data, counted=None, root=None, adapt=False):
        """``(correct, loss, count)`` of the clients ``ids`` (of one span) whose states are
        ``states``; an id past ``data.num_clients`` or not ``counted`` has count 0. An algorithm
        with ``personalize`` makes each client's model from its training split and a key of
        ``root``, the rounds completed and its id; with ``adapt`` (new clients), an algorithm
        without one runs its ``client_update`` from ``states`` on the broadcast instead."""
        info = RoundInfo(round=round_, tier=tier)
        view = server if algorithm.eval_server is None else algorithm.eval_server(server, info)
        test = data.test_data(ids)  # an id past the clients has count 0
        count = test.count if counted is None else jnp.where(jnp.take(counted, ids, mode="clip"), test.count, 0)
        own, personalizing = None, None
        if algorithm.personalize is not None or adapt:
            assert root is not None, "personalizing needs the run's root key"
            train = data.train_data(ids)
            own = (ids, train.indices, train.count)
            message = algorithm.broadcast(server, info) if algorithm.personalize is None else None
            personalizing = (data.x_train, data.y_train, sampling.personalization_key(root, round_), info, message)
        clients = (states, test.indices, count, own)
        return self.clients(algorithm, algorithm.eval_model or self.model, view, clients, data, personalizing)

    def global_outcomes(self, algorithm, server, data):
        """``(correct, loss)`` per pooled test example of the global model, or None without one."""
        if algorithm.global_params is None:
            return None
        variables = check_variables("global_params", algorithm.global_params(server))
        return self.pooled_outcomes(algorithm.eval_model or self.pooled_model, variables, data)

    def summary(self, correct, loss, count, data, pooled) -> dict:
        """The personalized summaries of per-client outcomes (and the per-client arrays) and,
        where there is a global model, its metrics from ``pooled`` (:meth:`global_outcomes`)."""
        regression = is_regression(data.y_test)
        metrics = personalized_metrics(correct, loss, count, regression)
        metrics["clients"] = per_client(correct, loss, count, regression)
        if pooled is not None:
            metrics.update(global_metrics(*pooled, regression))
        return metrics

    def pooled(self, algorithm, server, data, counted=None, pooled=None) -> dict:
        """An algorithm that evaluates its global model for every client: one pass over the
        pooled test set (``pooled``: its outcomes, computed here unless given), each client's
        share of it summed."""
        test = data.test_data(jnp.arange(data.num_clients, dtype=jnp.int32))
        count = test.count if counted is None else jnp.where(counted, test.count, 0)
        outcomes = pooled if pooled is not None else self.global_outcomes(algorithm, server, data)
        correct, loss = (client_totals(o, test.indices, count) for o in outcomes)
        regression = is_regression(data.y_test)
        metrics = personalized_metrics(correct, loss, count.astype(jnp.float32), regression)
        # the per-client arrays from their own copy of the sums: sharing these would let XLA fuse
        # the summaries' reductions otherwise, moving them by a float32 rounding
        own_outcomes, own_indices, own_count = jax.lax.optimization_barrier((outcomes, test.indices, count))
        own_correct, own_loss = (client_totals(o, own_indices, own_count) for o in own_outcomes)
        metrics["clients"] = per_client(own_correct, own_loss, own_count.astype(jnp.float32), regression)
        return {**metrics, **global_metrics(*outcomes, regression)}

    def new_clients(self, algorithm, server, round_, states, new_ids, data, root, pooled) -> dict:
        """New clients ``new_ids`` (numpy, held out of training; ``states``: theirs, as initialized)
        after the algorithm's personalization on their training splits, and with the global model
        (``pooled``: its outcomes, or None): summaries ``new_personalized_*`` and
        ``new_global_*``, per-client arrays ``new_*`` and ``new_global_*`` (NaN for the others)."""
        regression = is_regression(data.y_test)
        ids = jnp.asarray(new_ids, jnp.int32)
        test = data.test_data(ids)
        count = test.count.astype(jnp.float32)
        metrics, clients = {}, {}
        if pooled is not None:
            correct, loss = (client_totals(o, test.indices, test.count) for o in pooled)
            metrics.update(personalized_metrics(correct, loss, count, regression, prefix="new_global"))
            global_arrays = per_client(correct, loss, count, regression, prefix="new_global_")
            clients.update({k: v for k, v in global_arrays.items() if not k.endswith("examples")})
        if algorithm.evaluates_global:  # no personalization: the global model
            correct, loss = (client_totals(o, test.indices, test.count) for o in pooled)
        else:
            parts = []
            for tier, lo, hi in self.spans(data.num_clients):
                inside = np.flatnonzero((new_ids >= lo) & (new_ids < hi))
                if len(inside):
                    span_states = jax.tree.map(lambda x, rows=inside: x[rows], states)
                    parts.append(
                        self.block(algorithm, server, round_, tier, span_states, ids[inside], data, None, root, True)
                    )
            correct, loss, _ = (jnp.concatenate(p) for p in zip(*parts))  # new_ids are sorted: spans in order
        metrics.update(personalized_metrics(correct, loss, count, regression, prefix="new_personalized"))
        clients.update(per_client(correct, loss, count, regression, prefix="new_"))
        metrics["clients"] = scattered(clients, ids, data.num_clients)
        return metrics

    def clients(self, algorithm, model, server_view, clients, data, personalizing=None):
        """``(correct, loss, count)`` per client of ``clients = (states, test indices, test counts,
        own)``, each on its own test split, in the order given (they run largest first: the
        summaries then add the same numbers in the same order however the clients were grouped).
        With ``personalize`` (or an adapting new client's ``client_update``), ``own = (ids, train
        indices, train counts)`` and ``personalizing = (x_train, y_train, key, info, message)``
        (``message``: the broadcast a new client adapts from, else None); else both None."""
        batch = self.client_batch

        def personalized_model(server_view, client_state, own, personalizing):
            if own is None:
                return check_variables("eval_params", algorithm.eval_params(server_view, client_state))
            (client_id, indices, count), (x, y, key, info, message) = own, personalizing
            own_data, rng = ClientData(x, y, indices, count), jax.random.fold_in(key, client_id)
            if algorithm.personalize is not None:
                variables = algorithm.personalize(server_view, client_state, own_data, rng, info)
                return check_variables("personalize", variables)

            def local_update(step, state):  # its upload is dropped: a new client sends nothing
                result = algorithm.client_update(message, state, own_data, jax.random.fold_in(rng, step), info)
                return check_client_update(result, state)[0]

            adapted = jax.lax.fori_loop(0, self.new_client_updates, local_update, client_state)
            return check_variables("eval_params", algorithm.eval_params(server_view, adapted))

        def one_client(shared, args):
            server_view, x, y, personalizing = shared
            client_state, indices, count, own = args
            variables = personalized_model(server_view, client_state, own, personalizing)
            return evaluate_examples(model, variables, ClientData(x, y, indices, count), batch)

        def evaluate_all(shared, xs):
            return jax.lax.map(functools.partial(one_client, shared), xs, batch_size=self.clients_per_chunk)

        n = clients[2].shape[0]
        states, indices, counts, own = self.strategy.padded_rows(clients)
        counts = jnp.where(jnp.arange(counts.shape[0]) < n, counts, 0)  # padding clients: no test examples
        order = self.strategy.run_order(counts)
        clients = jax.tree.map(lambda x: x[order], (states, indices, counts, own))
        shared = (server_view, data.x_test, data.y_test, personalizing)
        outcomes = self.strategy.over_devices(evaluate_all, shared, clients)
        return jax.tree.map(lambda o: jnp.zeros_like(o).at[order].set(o)[:n], outcomes)

    def pooled_outcomes(self, model, variables, data):
        """``(correct, loss)`` of ``variables`` on every test example (``[N]`` each), in batches of
        ``batch_size`` shared out to the devices."""
        n = data.x_test.shape[0]
        positions = batch_positions(n, min(self.batch_size, n))  # a larger batch would only pad

        def outcomes(shared, batches):
            return jax.lax.map(functools.partial(batch_outcomes, model, *shared), batches)

        shared = (variables, data.x_test, data.y_test)
        per_batch = self.strategy.over_devices(outcomes, shared, self.strategy.padded_rows(positions))
        return tuple(o.reshape(-1)[:n] for o in per_batch)  # padding batches last
