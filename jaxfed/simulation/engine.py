"""The engine: gather -> vmapped client update -> scatter -> server update, rounds under ``lax.scan``.

Client states are one stacked pytree ``[num_clients, ...]``. A round samples client ids,
gathers their states and data views, maps ``algorithm.client_update`` over them (``vmap`` over all,
or ``lax.map`` over chunks of vmapped clients: ``client_chunk``), scatters the new states back by
id, and hands the stacked messages to ``algorithm.server_update``.
A client whose returned state, message or metrics hold NaN or inf is caught inside the round:
``nonfinite="error"`` rejects the whole round (state unchanged) and ``run_rounds`` raises
:class:`NonFiniteUpdateError` with the last good state; ``nonfinite="skip"`` gives that client
weight 0, keeps its previous state and counts it in the metrics.
A tiered algorithm's clients run per tier (each tier's sampled clients padded to a static size,
its own broadcast and shapes), see :class:`FederatedAlgorithm`.
Several rounds run inside one compiled call. With more than one device the sampled-client axis
is sharded over a ``Mesh`` axis named ``clients``; the sampled clients are padded to a multiple
of the device count with dummy clients that have no data, zero weight and are never scattered.
The data and the state are replicated on the mesh, which may span several processes
(``jax.distributed``; see benchmarks/two_process.py).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxfed.algorithms.base import FederatedAlgorithm
from jaxfed.algorithms.training import is_regression
from jaxfed.core import (
    finite_rows,
    gather_clients,
    scatter_clients,
    select_rows,
    stack_clients,
    tree_bytes,
    tree_select,
    weighted_mean,
)
from jaxfed.data import ClientData, FederatedData
from jaxfed.errors import NonFiniteUpdateError
from jaxfed.simulation import sampling
from jaxfed.simulation.evaluation import (
    client_eval_batch,
    client_totals,
    evaluate_examples,
    example_outcomes,
    personalized_metrics,
    pooled_view,
)

CLIENT_AXIS = "clients"
NONFINITE_POLICIES = ("error", "skip")


class _Group(NamedTuple):
    """One group of clients run together in a round (all sampled clients, or one tier's)."""

    tier: int
    ids: jax.Array  # padded with num_clients
    is_real: jax.Array
    count: jax.Array
    message_down: Any
    new_states: Any
    messages_up: Any
    client_metrics: Any
    bad: jax.Array  # a real client whose update holds NaN / inf
    kept: jax.Array | None = None  # whose update counts: set by the round's non-finite policy

    def without_bad_clients(self) -> _Group:
        """``nonfinite=skip``: bad clients send zeros, report zero metrics and are not scattered."""
        kept = ~self.bad
        return self._replace(
            kept=kept,
            messages_up=select_rows(kept, self.messages_up, jax.tree.map(jnp.zeros_like, self.messages_up)),
            client_metrics=select_rows(kept, self.client_metrics, jax.tree.map(jnp.zeros_like, self.client_metrics)),
        )


@struct.dataclass
class SimState:
    server: Any
    clients: Any  # stacked [num_clients, ...]
    round: jax.Array  # rounds completed


def default_client_chunk(platform: str) -> int:
    """The documented default strategy: one client at a time (``1``) on CPU, where vmapping
    clients measured slower for every model tried (benchmarks/fedavg_round.py: MLP on digits and
    MNIST, CNN on MNIST); all sampled clients vmapped at once (``0``) on accelerators."""
    return 1 if platform == "cpu" else 0


class Simulation:
    """One algorithm on one federated dataset.

    ``init()`` gives the starting :class:`SimState`; ``run_rounds(state, n)`` runs ``n`` rounds in
    one compiled call and returns per-round metrics; ``evaluate(state)`` evaluates every client.

    ``client_chunk`` picks how the sampled clients run: 0 vmaps them all at once; k > 0 runs
    ``lax.map`` over chunks of k vmapped clients (k = 1: one client at a time, each doing only
    its own steps); ``None`` picks :func:`default_client_chunk` for the devices.
    """

    def __init__(
        self,
        algorithm: FederatedAlgorithm,
        model,
        data: FederatedData,
        *,
        participation: float = 1.0,
        sampling_mode: str = "uniform",
        seed: int = 0,
        devices: Sequence[jax.Device] | None = None,
        eval_batch_size: int = 256,
        eval_examples_per_call: int = 256,
        client_chunk: int | None = None,
        nonfinite: str = "error",
    ):
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite: unknown '{nonfinite}'; allowed: {', '.join(NONFINITE_POLICIES)}")
        self.nonfinite = nonfinite
        self.algorithm = algorithm
        self.model = model
        self.num_clients = data.num_clients
        self.num_sampled = sampling.num_sampled(self.num_clients, participation)
        tiered = algorithm.num_tiers is not None
        self.tiers = sampling.tier_bounds(self.num_clients, algorithm.num_tiers) if tiered else None
        self.sampling_mode = sampling_mode
        self.root = jax.random.key(seed)
        devices = list(devices if devices is not None else jax.devices())
        self.mesh = Mesh(np.array(devices), (CLIENT_AXIS,)) if len(devices) > 1 else None
        self.num_devices = len(devices)
        # replicated on the mesh, which may span processes (jax.distributed)
        self.data = data if self.mesh is None else jax.device_put(data, self._replicated())
        self.eval_batch_size = eval_batch_size
        self.client_chunk = default_client_chunk(devices[0].platform) if client_chunk is None else client_chunk
        self.eval_examples_per_call = eval_examples_per_call
        self.client_eval_batch = client_eval_batch(data.test_count, eval_batch_size)
        self.compile_seconds = 0.0
        self._executables: dict[int, Any] = {}
        self._init_state = jax.jit(self._init)
        self._run = jax.jit(self._run_rounds, static_argnums=2)
        self._eval = jax.jit(self._evaluate)

    # ----- state -----------------------------------------------------------------------------

    def init(self) -> SimState:
        """The starting state: the algorithm's init, one client state stacked for every client
        (then ``init_client(state, client_id)`` per client, where the algorithm has one)."""
        state = self._init_state()
        return state if self.mesh is None else jax.device_put(state, self._replicated())

    def _replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def _init(self) -> SimState:
        server, client = self.algorithm.init(sampling.init_key(self.root))
        clients = stack_clients(client, self.num_clients)
        if self.algorithm.init_client is not None:
            clients = jax.vmap(self.algorithm.init_client)(clients, jnp.arange(self.num_clients, dtype=jnp.int32))
        return SimState(server=server, clients=clients, round=jnp.int32(0))

    def variant(self, root, algorithm: FederatedAlgorithm) -> Simulation:
        """This simulation with another root key and algorithm (same data layout, devices and
        strategy): a member of a vectorized sweep, whose seed and learning rate may be traced."""
        member = copy.copy(self)
        member.root, member.algorithm = root, algorithm
        return member

    def sampled_ids(self, round_index: int) -> np.ndarray:
        """The ids of the clients sampled in round ``round_index`` (0-based), as the round draws them."""
        key = sampling.round_key(self.root, round_index)
        ids = sampling.sample_clients(self.root, key, self.num_clients, self.num_sampled, self.sampling_mode)
        return np.asarray(ids)

    # ----- rounds ----------------------------------------------------------------------------

    def _on_client_axis(self, tree):
        if self.mesh is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, NamedSharding(self.mesh, PartitionSpec(CLIENT_AXIS)))

    def _map_clients(self, f, per_client, sizes):
        """``f`` over the leading (client) axis of ``per_client``.

        ``client_chunk=0`` vmaps all clients at once; k > 0 runs ``lax.map`` over chunks of k
        vmapped clients. Clients are ordered by ``sizes`` (largest first) so that a chunk holds
        clients of similar size: a vmapped chunk runs as many local steps as its largest client.
        With several devices the size-ordered clients are dealt round-robin to the devices.
        Results come back in the original order.
        """
        chunk, devices = self.client_chunk, self.num_devices
        order = jnp.argsort(-sizes, stable=True)
        if devices > 1:  # deal: device d gets ranks d, d + D, d + 2D, ...
            order = order.reshape(-1, devices).T.reshape(-1)
        inputs = jax.tree.map(lambda x: x[order], per_client)

        def mapped(xs):
            if chunk == 0:
                return jax.vmap(f)(xs)
            return jax.lax.map(f, xs, batch_size=chunk if chunk > 1 else None)

        if self.mesh is None:
            outputs = mapped(inputs)
        elif chunk == 0:
            outputs = mapped(self._on_client_axis(inputs))
        else:
            by_device = jax.tree.map(lambda x: x.reshape((devices, -1) + x.shape[1:]), inputs)
            outputs = jax.vmap(mapped)(self._on_client_axis(by_device))
            outputs = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), outputs)
        inverse = jnp.argsort(order)
        return jax.tree.map(lambda x: x[inverse], outputs)

    def _client_groups(self, real_ids):
        """``[(tier, ids)]`` with static sizes: all sampled clients for an untiered algorithm;
        for a tiered one, each tier's sampled clients padded to ``min(num_sampled, tier size)``.
        Every group is padded to a multiple of the device count with dummy ids (``num_clients``)."""
        fill = self.num_clients
        if self.tiers is None:
            groups = [(0, real_ids)]
        else:
            groups = [
                (t, sampling.tier_members(real_ids, lo, hi, min(self.num_sampled, hi - lo), fill))
                for t, (lo, hi) in enumerate(self.tiers)
            ]
        return [(t, sampling.pad_ids(ids, self.num_devices, fill=fill)) for t, ids in groups]

    def _update_group(self, state: SimState, data: FederatedData, key, tier: int, ids):
        """``client_update`` of the clients ``ids`` (one tier): their new states, messages, metrics."""
        alg = self.algorithm
        client_data = data.train_data(ids)
        message_down = alg.broadcast(state.server, tier)

        def update(args):
            client_state, indices, count, rng = args
            view = client_data.replace(indices=indices, count=count)
            return alg.client_update(message_down, client_state, view, rng)

        per_client = (
            gather_clients(state.clients, ids),
            client_data.indices,
            client_data.count,
            sampling.client_keys(key, ids),
        )
        new_states, messages_up, client_metrics = self._map_clients(update, per_client, client_data.count)
        is_real = ids < self.num_clients
        bad = is_real & ~finite_rows((new_states, messages_up, client_metrics), len(ids))
        return _Group(tier, ids, is_real, client_data.count, message_down, new_states, messages_up, client_metrics, bad)

    def _client_bytes(self, group: _Group) -> jax.Array:
        """``[clients]``: the bytes each client of ``group`` uploads."""
        if self.algorithm.message_bytes is None:
            return jnp.full(len(group.ids), float(tree_bytes(group.messages_up) // len(group.ids)), jnp.float32)
        return jax.vmap(self.algorithm.message_bytes)(group.messages_up).astype(jnp.float32)

    def round(self, state: SimState, data: FederatedData):
        """One round (pure): returns the new state and this round's metrics."""
        key = sampling.round_key(self.root, state.round)
        real_ids = sampling.sample_clients(self.root, key, self.num_clients, self.num_sampled, self.sampling_mode)
        groups = [self._update_group(state, data, key, t, ids) for t, ids in self._client_groups(real_ids)]

        any_bad = jnp.any(jnp.concatenate([g.bad for g in groups]))
        if self.nonfinite == "skip":  # a bad client keeps its old state and sends nothing
            groups = [g.without_bad_clients() for g in groups]
            round_ok = jnp.bool_(True)
        else:  # error: the whole round is rejected and the host raises
            round_ok = ~any_bad
            groups = [g._replace(kept=jnp.broadcast_to(round_ok, g.bad.shape)) for g in groups]

        weights = [jnp.where(g.is_real & g.kept, g.count, 0).astype(jnp.float32) for g in groups]
        messages = tuple(g.messages_up for g in groups)
        if self.tiers is None:
            server = self.algorithm.server_update(state.server, messages[0], weights[0])
        else:
            server = self.algorithm.server_update(state.server, messages, tuple(weights))
        any_weight = jnp.any(jnp.concatenate(weights) > 0)
        server = tree_select(round_ok & any_weight, server, state.server)
        clients = state.clients
        for g in groups:
            clients = scatter_clients(clients, jnp.where(g.kept, g.ids, self.num_clients), g.new_states)

        client_metrics = jax.tree.map(lambda *rows: jnp.concatenate(rows), *(g.client_metrics for g in groups))
        sent = [jnp.sum(g.is_real).astype(jnp.float32) for g in groups]
        client_bytes = [self._client_bytes(g) for g in groups]
        metrics = {
            **weighted_mean(client_metrics, jnp.concatenate(weights)),
            "bytes_up": sum(jnp.sum(jnp.where(g.is_real, b, 0.0)) for g, b in zip(groups, client_bytes)),
            "bytes_down": sum(n * tree_bytes(g.message_down) for n, g in zip(sent, groups)),
            "nonfinite_clients": jnp.sum(jnp.concatenate([g.bad for g in groups])).astype(jnp.float32),
            "nonfinite_ids": jnp.concatenate([jnp.where(g.bad, g.ids, -1) for g in groups]),
        }
        if self.tiers is not None:  # what one client of the tier uploads (the mean, if it varies)
            metrics.update(
                {
                    f"bytes_up_client_tier{g.tier}": jnp.sum(jnp.where(g.is_real, b, 0.0)) / jnp.maximum(n, 1.0)
                    if self.algorithm.message_bytes
                    else b[0]
                    for g, b, n in zip(groups, client_bytes, sent)
                }
            )
        next_round = state.round + round_ok.astype(state.round.dtype)
        return SimState(server=server, clients=clients, round=next_round), metrics

    def _run_rounds(self, state, data, num_rounds: int):
        return jax.lax.scan(lambda s, _: self.round(s, data), state, None, length=num_rounds)

    def run_rounds(self, state: SimState, num_rounds: int):
        """Run ``num_rounds`` rounds in one compiled call; metrics have a leading round axis.

        Under ``nonfinite="error"`` a round with a non-finite client update raises
        :class:`NonFiniteUpdateError` carrying the last good state and the good rounds' metrics
        (the rejected round leaves the state unchanged, so later rounds of the call repeat it).
        """
        if num_rounds not in self._executables:
            start = time.perf_counter()
            self._executables[num_rounds] = self._run.lower(state, self.data, num_rounds).compile()
            self.compile_seconds += time.perf_counter() - start
        new_state, metrics = self._executables[num_rounds](state, self.data)
        if self.nonfinite == "error":
            bad = np.asarray(metrics["nonfinite_clients"]) > 0
            if bad.any():
                first = int(np.argmax(bad))
                ids = sorted(int(c) for c in np.asarray(metrics["nonfinite_ids"][first]) if c >= 0)
                good = jax.tree.map(lambda m: m[:first], metrics)
                raise NonFiniteUpdateError(int(new_state.round) + 1, ids, new_state, good)
        return new_state, metrics

    # ----- evaluation ------------------------------------------------------------------------

    def _evaluate(self, state: SimState, data: FederatedData):
        alg, batch = self.algorithm, self.eval_batch_size
        model = alg.eval_model or self.model
        test = data.test_data(jnp.arange(self.num_clients, dtype=jnp.int32))
        eval_batch = self.client_eval_batch
        clients_per_chunk = max(1, self.eval_examples_per_call // eval_batch)

        def evaluate_block(server_view, lo, hi):
            def one_client(args):
                client_state, indices, count = args
                variables = alg.eval_params(server_view, client_state)
                view = ClientData(x=data.x_test, y=data.y_test, indices=indices, count=count)
                return evaluate_examples(model, variables, view, eval_batch)

            block = jax.tree.map(lambda x: x[lo:hi], (state.clients, test.indices, test.count))
            order = jnp.argsort(-block[2], stable=True)  # chunks of clients with similar test sizes
            results = jax.lax.map(one_client, jax.tree.map(lambda x: x[order], block), batch_size=clients_per_chunk)
            return jax.tree.map(lambda x: x[jnp.argsort(order)], results)

        regression = is_regression(data.y_test)
        if alg.evaluates_global:  # one pass over the pooled test set, each client's share summed
            outcomes = example_outcomes(model, alg.global_params(state.server), data.x_test, data.y_test, batch)
            correct, loss = (client_totals(o, test.indices, test.count) for o in outcomes)
            metrics = personalized_metrics(correct, loss, test.count.astype(jnp.float32), regression)
            examples = outcomes[1].shape[0]
            metrics["global_mse" if regression else "global_acc"] = jnp.sum(outcomes[1 if regression else 0]) / examples
            metrics["global_loss"] = jnp.sum(outcomes[1]) / examples
            return metrics
        if alg.eval_server is None:
            correct, loss, count = evaluate_block(state.server, 0, self.num_clients)
        else:  # each tier's clients against that tier's view of the server, computed once
            blocks = [evaluate_block(alg.eval_server(state.server, t), lo, hi) for t, (lo, hi) in enumerate(self.tiers)]
            correct, loss, count = (jnp.concatenate(parts) for parts in zip(*blocks))
        metrics = personalized_metrics(correct, loss, count, regression)
        if alg.global_params is not None:
            pooled = pooled_view(data.x_test, data.y_test)
            g_correct, g_loss, g_count = evaluate_examples(model, alg.global_params(state.server), pooled, batch)
            metrics["global_mse" if regression else "global_acc"] = (g_loss if regression else g_correct) / g_count
            metrics["global_loss"] = g_loss / g_count
        return metrics

    def evaluate(self, state: SimState) -> dict:
        """Personalized accuracy of every client (and global accuracy where there is a global model)."""
        return {k: float(v) for k, v in self._eval(state, self.data).items()}
