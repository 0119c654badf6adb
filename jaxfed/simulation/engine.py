"""The engine: gather -> vmapped client update -> scatter -> server update, rounds under ``lax.scan``.

Client states are one stacked pytree ``[num_clients, ...]``. A round samples client ids,
gathers their states and data views, maps ``algorithm.client_update`` over them (``vmap`` over all,
or ``lax.map`` over chunks of vmapped clients: ``client_chunk``), scatters the new states back by
id, and hands the stacked messages to ``algorithm.server_update``.
A client whose returned state, message or metrics hold NaN or inf is caught inside the round:
``nonfinite="error"`` rejects the whole round (state unchanged) and ``run_rounds`` raises
:class:`NonFiniteUpdateError` with the last good state; ``nonfinite="skip"`` gives that client
weight 0, keeps its previous state and counts it in the metrics.
Several rounds run inside one compiled call. With more than one device the sampled-client axis
is sharded over a ``Mesh`` axis named ``clients``; the sampled clients are padded to a multiple
of the device count with dummy clients that have no data, zero weight and are never scattered.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxfed.algorithms.base import FederatedAlgorithm
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
from jaxfed.simulation.evaluation import evaluate_examples, personalized_metrics, pooled_view

CLIENT_AXIS = "clients"
NONFINITE_POLICIES = ("error", "skip")


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
        eval_examples_per_call: int = 8192,
        client_chunk: int | None = None,
        nonfinite: str = "error",
    ):
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite: unknown '{nonfinite}'; allowed: {', '.join(NONFINITE_POLICIES)}")
        self.nonfinite = nonfinite
        self.algorithm = algorithm
        self.model = model
        self.data = data
        self.num_clients = data.num_clients
        self.num_sampled = sampling.num_sampled(self.num_clients, participation)
        self.sampling_mode = sampling_mode
        self.root = jax.random.key(seed)
        devices = list(devices if devices is not None else jax.devices())
        self.mesh = Mesh(np.array(devices), (CLIENT_AXIS,)) if len(devices) > 1 else None
        self.num_devices = len(devices)
        self.eval_batch_size = eval_batch_size
        self.client_chunk = default_client_chunk(devices[0].platform) if client_chunk is None else client_chunk
        self.eval_examples_per_call = eval_examples_per_call
        self.compile_seconds = 0.0
        self._executables: dict[int, Any] = {}
        self._init_state = jax.jit(self._init)
        self._run = jax.jit(self._run_rounds, static_argnums=2)
        self._eval = jax.jit(self._evaluate)

    # ----- state -----------------------------------------------------------------------------

    def init(self) -> SimState:
        """The starting state: the algorithm's init, one client state stacked for every client."""
        return self._init_state()

    def _init(self) -> SimState:
        server, client = self.algorithm.init(sampling.init_key(self.root))
        return SimState(server=server, clients=stack_clients(client, self.num_clients), round=jnp.int32(0))

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

    def round(self, state: SimState, data: FederatedData):
        """One round (pure): returns the new state and this round's metrics."""
        alg = self.algorithm
        key = sampling.round_key(self.root, state.round)
        real_ids = sampling.sample_clients(self.root, key, self.num_clients, self.num_sampled, self.sampling_mode)
        ids = sampling.pad_ids(real_ids, self.num_devices, fill=self.num_clients)
        is_real = ids < self.num_clients

        client_data = data.train_data(ids)
        message_down = alg.broadcast(state.server, 0)

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

        bad = is_real & ~finite_rows((new_states, messages_up, client_metrics), len(ids))
        if self.nonfinite == "skip":  # a bad client keeps its old state and sends nothing
            kept = ~bad
            messages_up = select_rows(kept, messages_up, jax.tree.map(jnp.zeros_like, messages_up))
            client_metrics = select_rows(kept, client_metrics, jax.tree.map(jnp.zeros_like, client_metrics))
            round_ok = jnp.bool_(True)
        else:  # error: the whole round is rejected and the host raises
            kept = jnp.broadcast_to(~jnp.any(bad), bad.shape)
            round_ok = ~jnp.any(bad)

        weights = jnp.where(is_real & kept, client_data.count, 0).astype(jnp.float32)
        server = alg.server_update(state.server, messages_up, weights)
        server = tree_select(round_ok & jnp.any(weights > 0), server, state.server)
        clients = scatter_clients(state.clients, jnp.where(kept, ids, self.num_clients), new_states)

        per_client_up = tree_bytes(messages_up) // len(ids)
        metrics = {
            **weighted_mean(client_metrics, weights),
            "bytes_up": jnp.float32(per_client_up * self.num_sampled),
            "bytes_down": jnp.float32(tree_bytes(message_down) * self.num_sampled),
            "nonfinite_clients": jnp.sum(bad).astype(jnp.float32),
            "nonfinite_ids": jnp.where(bad, ids, -1),
        }
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
        alg, model, batch = self.algorithm, self.model, self.eval_batch_size
        test = data.test_data(jnp.arange(self.num_clients, dtype=jnp.int32))
        eval_batch = min(batch, test.indices.shape[1])
        clients_per_chunk = max(1, self.eval_examples_per_call // eval_batch)

        def one_client(args):
            client_state, indices, count = args
            variables = alg.eval_params(state.server, client_state)
            view = ClientData(x=data.x_test, y=data.y_test, indices=indices, count=count)
            return evaluate_examples(model, variables, view, eval_batch)

        correct, loss, count = jax.lax.map(
            one_client, (state.clients, test.indices, test.count), batch_size=clients_per_chunk
        )
        metrics = personalized_metrics(correct, loss, count)
        if alg.global_params is not None:
            pooled = pooled_view(data.x_test, data.y_test)
            g_correct, g_loss, g_count = evaluate_examples(model, alg.global_params(state.server), pooled, batch)
            metrics["global_acc"] = g_correct / g_count
            metrics["global_loss"] = g_loss / g_count
        return metrics

    def evaluate(self, state: SimState) -> dict:
        """Personalized accuracy of every client (and global accuracy where there is a global model)."""
        return {k: float(v) for k, v in self._eval(state, self.data).items()}
