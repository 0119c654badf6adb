"""The engine: gather -> vmapped client update -> scatter -> server update, rounds under ``lax.scan``.

Client states are one stacked pytree ``[num_clients, ...]``. A round samples client ids, orders
them by training-set size (largest first: a vmapped chunk holds clients of similar size),
gathers their states and data views, maps ``algorithm.client_update`` over them (``vmap`` over all,
or ``lax.map`` over chunks of vmapped clients: ``client_chunk``), scatters the new states back by
id, and hands the stacked messages (in that order) to ``algorithm.server_update``.
A client whose returned state, message or metrics hold NaN or inf is caught inside the round:
``nonfinite="error"`` rejects the whole round (state unchanged) and ``run_rounds`` raises
:class:`NonFiniteUpdateError` with the last good state; ``nonfinite="skip"`` gives that client
weight 0, keeps its previous state and counts it in the metrics.
A tiered algorithm's clients run per tier (each tier's sampled clients padded to a static size,
its own broadcast and shapes); the server decodes each tier's uploads with ``receive`` and
``server_update`` gets one stack of every tier's rows, see :class:`FederatedAlgorithm`.
Several rounds run inside one compiled call. With more than one device the sampled-client axis
is sharded over a ``Mesh`` axis named ``clients``; the sampled clients are padded to a multiple
of the device count with dummy clients that have no data, zero weight and are never scattered,
and each device runs its own share of them (``shard_map``).
The data and the state are replicated on the mesh, which may span several processes
(``jax.distributed``; see benchmarks/two_process.py).
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxfed.contract import FederatedAlgorithm, RoundInfo
from jaxfed.core import (
    concat_clients,
    finite_rows,
    gather_clients,
    scatter_clients,
    select_rows,
    stack_clients,
    tree_bytes,
    tree_select,
    weighted_mean,
)
from jaxfed.core.losses import is_regression
from jaxfed.data import ClientData, FederatedData
from jaxfed.errors import ConfigError, NonFiniteUpdateError
from jaxfed.simulation import sampling
from jaxfed.simulation.evaluation import (
    batch_outcomes,
    batch_positions,
    client_eval_batch,
    client_totals,
    evaluate_examples,
    global_metrics,
    personalized_metrics,
)

CLIENT_AXIS = "clients"
NONFINITE_POLICIES = ("error", "skip")
MATMUL_PRECISIONS = ("default", "highest")


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
    down_bytes: jax.Array  # [clients]: what each must download, keeping what it received before
    kept: jax.Array | None = None  # whose update counts: set by the round's non-finite policy

    def without_bad_clients(self) -> _Group:
        """``nonfinite=skip``: bad clients send zeros, report zero metrics and are not scattered."""
        kept = ~self.bad
        return self._replace(
            kept=kept,
            messages_up=select_rows(kept, self.messages_up, jax.tree.map(jnp.zeros_like, self.messages_up)),
            client_metrics=select_rows(kept, self.client_metrics, jax.tree.map(jnp.zeros_like, self.client_metrics)),
        )


def _real_total(group: _Group, per_client: jax.Array) -> jax.Array:
    """The sum of ``per_client`` over the group's real clients (padding rows left out)."""
    return jnp.sum(jnp.where(group.is_real, per_client, 0.0))


def first_nonfinite(metrics):
    """``(round within the call, sorted client ids)`` of the first round whose metrics count a
    non-finite client update, or None (``metrics`` of one call, leading round axis)."""
    bad = np.asarray(metrics["nonfinite_clients"]) > 0
    if not bad.any():
        return None
    first = int(np.argmax(bad))
    return first, sorted(int(c) for c in np.asarray(metrics["nonfinite_ids"][first]) if c >= 0)


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

    ``pooled_eval_model`` (default: ``model``) runs the passes of one model over the whole test
    set (the global model): the same parameters in another implementation, e.g. XLA's
    convolution, which is faster than the patches convolution outside loops and vmaps.

    ``client_chunk`` picks how the sampled clients run: 0 vmaps them all at once; k > 0 runs
    ``lax.map`` over chunks of k vmapped clients (k = 1: one client at a time, each doing only
    its own steps); ``None`` picks :func:`default_client_chunk` for the devices.

    ``matmul_precision`` is this simulation's own (``"default"``: XLA's, TF32 on recent NVIDIA
    GPUs; ``"highest"``: full float32), applied where its programs are traced (:meth:`precision`),
    not to the process.
    """

    def __init__(
        self,
        algorithm: FederatedAlgorithm,
        model,
        data: FederatedData,
        *,
        participation: float = 1.0,
        sampling_mode: str = "uniform",
        eval_clients: str = "all",
        seed: int = 0,
        devices: Sequence[jax.Device] | None = None,
        eval_batch_size: int = 256,
        eval_examples_per_call: int = 256,
        pooled_eval_model=None,
        client_chunk: int | None = None,
        nonfinite: str = "error",
        matmul_precision: str = "default",
    ):
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite: unknown '{nonfinite}'; allowed: {', '.join(NONFINITE_POLICIES)}")
        if matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision: unknown '{matmul_precision}'; allowed: {', '.join(MATMUL_PRECISIONS)}")
        self.matmul_precision = matmul_precision
        self.nonfinite = nonfinite
        self.algorithm = algorithm
        self.model = model
        self.pooled_eval_model = pooled_eval_model or model
        self.num_clients = data.num_clients
        self.num_sampled = sampling.num_sampled(self.num_clients, participation)
        tiered = algorithm.num_tiers is not None
        self.tiers = sampling.tier_bounds(self.num_clients, algorithm.num_tiers) if tiered else None
        self.sampling_mode = sampling_mode
        if eval_clients not in sampling.EVAL_CLIENTS or (eval_clients == "cohort" and sampling_mode != "fixed"):
            raise ValueError(f"eval_clients: '{eval_clients}' with sampling '{sampling_mode}'; cohort needs fixed")
        self.eval_clients = eval_clients
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
        self._new_compiled_calls()

    def _new_compiled_calls(self) -> None:
        """The jitted entry points, bound to this object (its algorithm and root key), and an
        empty compile cache."""
        self.compile_seconds = 0.0
        self._executables: dict[int, Any] = {}
        self._init_state = jax.jit(self.init_pure)
        self._run = jax.jit(self.rounds_pure, static_argnums=2)
        self._eval = jax.jit(self.evaluate_pure)

    # ----- state -----------------------------------------------------------------------------

    def precision(self):
        """A context in which JAX traces with this simulation's matmul precision: the compiled
        calls run inside it, and so should a program that composes the ``*_pure`` methods."""
        return jax.default_matmul_precision(None if self.matmul_precision == "default" else "highest")

    def init(self) -> SimState:
        """The starting state: the algorithm's init, one client state stacked for every client
        (then ``init_client(state, client_id)`` per client, where the algorithm has one)."""
        with self.precision():
            state = self._init_state()
        return state if self.mesh is None else jax.device_put(state, self._replicated())

    def check_state(self, state: SimState) -> None:
        """A ConfigError unless ``state`` holds one client state per client of this simulation's
        data (a state from a simulation of another client count must not run or evaluate here)."""
        leaves = jax.tree.leaves(state.clients)
        held = leaves[0].shape[0] if leaves else self.num_clients
        if held != self.num_clients:
            raise ConfigError(
                f"state: holds {held} client states, but this simulation's data has {self.num_clients} clients; "
                "run a state with the simulation (and data) it was made for"
            )

    def _replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def init_pure(self) -> SimState:
        """The starting state (pure, not jitted: for composing, e.g. vmapped over a sweep's members)."""
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
        member._new_compiled_calls()  # the copied ones would run this simulation's algorithm and key
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

    def _run_order(self, sizes):
        """The order to run items of ``sizes`` in: largest first, so that a vmapped chunk holds
        items of similar size (a chunk runs as many local steps as its largest client: this is
        the engine's bucketing by size), then dealt round-robin to the devices (device d gets
        ranks d, d + D, ...). ``len(sizes)`` is a multiple of the device count."""
        order = jnp.argsort(-sizes, stable=True)
        if self.num_devices > 1:
            order = order.reshape(-1, self.num_devices).T.reshape(-1)
        return order

    def _map_clients(self, f, shared, per_client):
        """``f(shared, client)`` over the leading (client) axis of ``per_client``, in run order:
        ``client_chunk=0`` vmaps all clients at once; k > 0 runs ``lax.map`` over chunks of k
        vmapped clients."""
        chunk = self.client_chunk

        def mapped(shared, xs):
            one = functools.partial(f, shared)
            if chunk == 0:
                return jax.vmap(one)(xs)
            return jax.lax.map(one, xs, batch_size=chunk if chunk > 1 else None)

        return self._over_devices(mapped, shared, per_client)

    def _over_devices(self, f, shared, items):
        """``f(shared, items)``; on several devices each device runs ``f`` on its own contiguous
        block of ``items`` (``shard_map``: no cross-device step inside, so a device stops when its
        own items are done) with ``shared`` replicated. The item axis is a multiple of the
        device count."""
        if self.mesh is None:
            return f(shared, items)
        spec = PartitionSpec(CLIENT_AXIS)
        per_device = jax.shard_map(f, mesh=self.mesh, in_specs=(PartitionSpec(), spec), out_specs=spec, check_vma=False)
        return per_device(shared, self._on_client_axis(items))

    def _pad_to_devices(self, tree):
        """Rows appended to the leading axis up to a multiple of the device count (copies of the
        last row)."""
        n = jax.tree.leaves(tree)[0].shape[0]
        pad = -n % self.num_devices
        if not pad:
            return tree
        return jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[-1:], pad, axis=0)]), tree)

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
        ids = ids[self._run_order(data.train_data(ids).count)]  # the group runs (and reports) in this order
        client_data = data.train_data(ids)
        info = RoundInfo(round=state.round, tier=tier)  # the round's one home is the engine's state
        message_down = alg.broadcast(state.server, info)

        def update(shared, args):
            message_down, x, y, info = shared
            client_state, indices, count, rng = args
            return alg.client_update(message_down, client_state, ClientData(x, y, indices, count), rng, info)

        per_client = (
            gather_clients(state.clients, ids),
            client_data.indices,
            client_data.count,
            sampling.client_keys(key, ids),
        )
        shared = (message_down, client_data.x, client_data.y, info)
        new_states, messages_up, client_metrics = self._map_clients(update, shared, per_client)
        is_real = ids < self.num_clients
        updated = (new_states, messages_up, client_metrics)
        bad = is_real & ~finite_rows(updated, len(ids))
        down_bytes = self._download_bytes(message_down, per_client[0], info, len(ids))
        return _Group(tier, ids, is_real, client_data.count, message_down, *updated, bad, down_bytes)

    def _download_bytes(self, message_down, client_states, info: RoundInfo, count: int) -> jax.Array:
        """``[clients]``: the bytes each of ``count`` clients must download when it keeps what it
        received in earlier rounds (``download_bytes``; default: all of ``message_down``)."""
        if self.algorithm.download_bytes is None:
            return jnp.full(count, float(tree_bytes(message_down)), jnp.float32)
        per_client = jax.vmap(self.algorithm.download_bytes, in_axes=(None, 0, None))
        return per_client(message_down, client_states, info).astype(jnp.float32)

    def _received(self, server, group: _Group, round_):
        """The group's uploads as the server decodes them (``receive``, per client), in the shape
        every tier shares."""
        if self.algorithm.receive is None:
            return group.messages_up
        info = RoundInfo(round=round_, tier=group.tier)
        return jax.vmap(lambda message: self.algorithm.receive(server, message, info))(group.messages_up)

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
        messages = concat_clients([self._received(state.server, g, state.round) for g in groups])
        info = RoundInfo(round=state.round, tier=None)  # server_update aggregates every tier
        server = self.algorithm.server_update(state.server, messages, jnp.concatenate(weights), info)
        any_weight = jnp.any(jnp.concatenate(weights) > 0)
        server = tree_select(round_ok & any_weight, server, state.server)
        clients = state.clients
        for g in groups:
            clients = scatter_clients(clients, jnp.where(g.kept, g.ids, self.num_clients), g.new_states)

        client_metrics = concat_clients([g.client_metrics for g in groups])
        trained = weighted_mean(client_metrics, jnp.concatenate(weights))  # NaN: no client's update was used
        trained = jax.tree.map(lambda m: jnp.where(any_weight, m, jnp.nan), trained)
        sent = [jnp.sum(g.is_real).astype(jnp.float32) for g in groups]
        client_bytes = [self._client_bytes(g) for g in groups]
        uploaded = [_real_total(g, b) for g, b in zip(groups, client_bytes)]  # per group
        metrics = {
            **trained,
            "bytes_up": sum(uploaded),
            "bytes_down": sum(n * tree_bytes(g.message_down) for n, g in zip(sent, groups)),
            "bytes_down_cached": sum(_real_total(g, g.down_bytes) for g in groups),
            "nonfinite_clients": jnp.sum(jnp.concatenate([g.bad for g in groups])).astype(jnp.float32),
            "nonfinite_ids": jnp.concatenate([jnp.where(g.bad, g.ids, -1) for g in groups]),
        }
        if self.tiers is not None:  # what one client of the tier uploads (the mean, if it varies)
            metrics.update(
                {
                    f"bytes_up_client_tier{g.tier}": up / jnp.maximum(n, 1.0) if self.algorithm.message_bytes else b[0]
                    for g, b, up, n in zip(groups, client_bytes, uploaded, sent)
                }
            )
        next_round = state.round + round_ok.astype(state.round.dtype)
        return SimState(server=server, clients=clients, round=next_round), metrics

    def rounds_pure(self, state, data, num_rounds: int):
        """``num_rounds`` rounds on ``data`` (pure, not jitted): ``(state, metrics [rounds, ...])``."""
        return jax.lax.scan(lambda s, _: self.round(s, data), state, None, length=num_rounds)

    def run_rounds(self, state: SimState, num_rounds: int, *, raise_nonfinite: bool = True):
        """Run ``num_rounds`` rounds in one compiled call; metrics have a leading round axis.

        Under ``nonfinite="error"`` a round with a non-finite client update leaves the state
        unchanged (so later rounds of the call repeat it) and counts the clients in the round's
        ``nonfinite_clients``; with ``raise_nonfinite`` this raises
        :class:`NonFiniteUpdateError` carrying the last good state and the good rounds' metrics.
        """
        self.check_state(state)
        if num_rounds not in self._executables:
            start = time.perf_counter()
            with self.precision():
                self._executables[num_rounds] = self._run.lower(state, self.data, num_rounds).compile()
            self.compile_seconds += time.perf_counter() - start
        new_state, metrics = self._executables[num_rounds](state, self.data)
        failure = first_nonfinite(metrics) if self.nonfinite == "error" and raise_nonfinite else None
        if failure is not None:
            first, ids = failure
            good = jax.tree.map(lambda m: m[:first], metrics)
            raise NonFiniteUpdateError(int(new_state.round) + 1, ids, new_state, good)
        return new_state, metrics

    # ----- evaluation ------------------------------------------------------------------------

    def evaluate_pure(self, state: SimState, data: FederatedData):
        """Every client's evaluation on ``data`` (pure, not jitted): metrics as arrays."""
        alg = self.algorithm
        model = alg.eval_model or self.model
        pooled_model = alg.eval_model or self.pooled_eval_model
        test = data.test_data(jnp.arange(self.num_clients, dtype=jnp.int32))
        if self.eval_clients == "cohort":  # the others count as clients without test examples
            test = test.replace(count=jnp.where(self._in_cohort(), test.count, 0))
        regression = is_regression(data.y_test)
        if alg.evaluates_global:  # one pass over the pooled test set, each client's share summed
            outcomes = self._pooled_outcomes(pooled_model, alg.global_params(state.server), data)
            correct, loss = (client_totals(o, test.indices, test.count) for o in outcomes)
            metrics = personalized_metrics(correct, loss, test.count.astype(jnp.float32), regression)
            return {**metrics, **global_metrics(*outcomes, regression)}

        def evaluate_block(server_view, lo, hi):
            block = jax.tree.map(lambda x: x[lo:hi], (state.clients, test.indices, test.count))
            return self._evaluate_clients(model, server_view, block, data)

        if alg.eval_server is None:
            correct, loss, count = evaluate_block(state.server, 0, self.num_clients)
        else:  # each tier's clients against that tier's view of the server, computed once
            blocks = [
                evaluate_block(alg.eval_server(state.server, RoundInfo(round=state.round, tier=t)), lo, hi)
                for t, (lo, hi) in enumerate(self.tiers)
            ]
            correct, loss, count = (jnp.concatenate(parts) for parts in zip(*blocks))
        metrics = personalized_metrics(correct, loss, count, regression)
        if alg.global_params is not None:
            metrics.update(
                global_metrics(*self._pooled_outcomes(pooled_model, alg.global_params(state.server), data), regression)
            )
        return metrics

    def _in_cohort(self) -> jax.Array:
        """``[num_clients]`` bool: the clients of the fixed cohort."""
        ids = sampling.cohort(self.root, self.num_clients, self.num_sampled)
        return jnp.zeros(self.num_clients, bool).at[ids].set(True)

    def _evaluate_clients(self, model, server_view, clients, data: FederatedData):
        """``(correct, loss, count)`` per client of ``clients = (states, test indices, test counts)``,
        each on its own test split: chunks of clients with similar test sizes under ``lax.map``.
        The rows come in run order, with padding clients (count 0) appended: the summaries that
        follow do not depend on the order and skip clients without test examples."""
        eval_batch = self.client_eval_batch
        clients_per_chunk = max(1, self.eval_examples_per_call // eval_batch)

        def one_client(shared, args):
            server_view, x, y = shared
            client_state, indices, count = args
            variables = self.algorithm.eval_params(server_view, client_state)
            return evaluate_examples(model, variables, ClientData(x, y, indices, count), eval_batch)

        def evaluate_all(shared, xs):
            return jax.lax.map(functools.partial(one_client, shared), xs, batch_size=clients_per_chunk)

        states, indices, counts = self._pad_to_devices(clients)
        real = jnp.arange(counts.shape[0]) < clients[2].shape[0]
        counts = jnp.where(real, counts, 0)  # padding clients have no test examples: not counted
        order = self._run_order(counts)
        clients = jax.tree.map(lambda x: x[order], (states, indices, counts))
        return self._over_devices(evaluate_all, (server_view, data.x_test, data.y_test), clients)

    def _pooled_outcomes(self, model, variables, data: FederatedData):
        """``(correct, loss)`` of ``variables`` on every test example (``[N]`` each), in batches of
        ``eval_batch_size`` shared out to the devices."""
        n = data.x_test.shape[0]
        positions = batch_positions(n, self.eval_batch_size)

        def outcomes(shared, batches):
            return jax.lax.map(functools.partial(batch_outcomes, model, *shared), batches)

        per_batch = self._over_devices(outcomes, (variables, data.x_test, data.y_test), self._pad_to_devices(positions))
        return tuple(o.reshape(-1)[:n] for o in per_batch)  # padding batches last

    def evaluate(self, state: SimState) -> dict:
        """Personalized accuracy of every client (and global accuracy where there is a global model)."""
        self.check_state(state)
        with self.precision():
            return {k: float(v) for k, v in self._eval(state, self.data).items()}
