"""The engine: gather -> vmapped client update -> scatter -> server step, rounds under ``lax.scan``.

Client states are one stacked pytree ``[num_clients, ...]``. A round samples client ids, orders
them by training-set size (largest first: a vmapped chunk holds clients of similar size),
gathers their states and data views, maps ``algorithm.client_update`` over them (``vmap`` over all,
or a scan over chunks of vmapped clients: ``client_chunk``), and scatters the new states back by
id. The server's step is a reduction: each client's upload becomes its contribution
(``aggregation.contribute``), summed as the chunks run and across devices, and
``aggregation.apply`` turns the sum into the new server state, so a round never holds every
upload at once. An algorithm with a ``server_update`` instead gets every upload stacked (in run
order, not by client id).
A client whose returned state, message or metrics hold NaN or inf is caught inside the round:
``nonfinite="error"`` rejects the whole round (state unchanged) and ``run_rounds`` raises
:class:`NonFiniteUpdateError` with the last good state; ``nonfinite="skip"`` gives that client
weight 0, keeps its previous state and counts it in the metrics.
A tiered algorithm's clients run per tier (each tier's sampled clients padded to a static size,
its own broadcast and shapes), or, where the algorithm pads every tier's message to one shape
(``pad_tier``) and clients run vmapped together (``client_chunk`` other than 1) or the tiers'
own messages already share one shape (``pad_tier`` is still what allows it), as one group in
which each client gets its tier's padded message; the server decodes each upload with
``receive`` into the shape every tier shares, see :class:`FederatedAlgorithm`.
Several rounds run inside one compiled call. With more than one device the sampled-client axis
is sharded over a ``Mesh`` axis named ``clients``; the sampled clients are padded to a multiple
of the device count with dummy clients that have no data, zero weight and are never scattered,
and each device runs its own share of them (``shard_map``), the contributions summed over the
devices (``psum``).
On a mesh of one process the stacked client states and the per-client index tables are split
over the ``clients`` axis (each device holds 1/D of the clients) when the client count divides
by the device count; the examples, the server state (and, across processes or with an uneven
count, everything) are replicated. The mesh may span several processes (``jax.distributed``;
see benchmarks/two_process.py).
With ``client_state="host"`` the stacked client states stay in host memory (numpy): a compiled
call gets the states of the clients its rounds sample (known ahead: sampling is a function of the
round), in ``min(num_clients, rounds * sampled)`` rows, and an id -> row table; the rows come
back to the host after the call. Evaluation moves them a round's width at a time. Training
gives the device-held numbers bit for bit.
"""

from __future__ import annotations

import copy
import functools
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxfed.contract import FederatedAlgorithm, RoundInfo, check_client_update, check_server_step
from jaxfed.core import (
    all_finite,
    concat_clients,
    gather_clients,
    human_bytes,
    scatter_clients,
    stack_clients,
    stack_trees,
    tree_bytes,
    tree_select,
    weighted_mean,
)
from jaxfed.data import ClientData, FederatedData
from jaxfed.errors import ConfigError, NonFiniteUpdateError, unknown_choice
from jaxfed.nn.models import Model, check_data_fits
from jaxfed.simulation import accounting, sampling, server
from jaxfed.simulation.evaluation import Evaluation
from jaxfed.simulation.sampling import COHORT_SAMPLINGS, EVAL_CLIENTS, SAMPLINGS, held_out, num_sampled, tier_bounds
from jaxfed.simulation.strategy import ClientStrategy

NONFINITE_POLICIES = ("error", "skip")
MATMUL_PRECISIONS = ("default", "highest")
CLIENT_STATES = ("device", "host")


class _ClientRow(NamedTuple):
    """What the round keeps of one client once its update ran (stacked over a group's clients)."""

    new_state: Any
    metrics: Any  # zero where skipped
    bad: jax.Array  # a real client whose update holds NaN / inf
    weight: jax.Array  # its training-set size; 0 for padding and (nonfinite=skip) a bad client
    up_bytes: jax.Array
    message_up: Any  # the decoded upload, kept only for a server_update (else ())


class _Group(NamedTuple):
    """One group of clients run together in a round (all sampled clients, or one tier's)."""

    tiers: jax.Array  # [clients]: each row's tier (0 without tiers)
    ids: jax.Array  # padded with num_clients
    is_real: jax.Array
    rows: _ClientRow
    total: Any  # the sum of the group's contributions (an aggregation), else ()
    down_sent: jax.Array  # the bytes broadcast to the group's real clients
    down_bytes: jax.Array  # [clients]: what each must download, keeping what it received before
    tier_up_bytes: list  # per tier (of the group's tiers): what one upload takes, where it is fixed

    @property
    def up_bytes(self) -> jax.Array:
        return self.rows.up_bytes


def host_metrics(metrics: dict) -> dict:
    """Evaluation metrics on the host: the summaries as floats, the per-client arrays (under
    ``"clients"``) as numpy arrays."""
    return {k: {n: np.asarray(a) for n, a in v.items()} if k == "clients" else float(v) for k, v in metrics.items()}


def first_nonfinite(metrics):
    """``(round within the call, sorted client ids)`` of the first round whose metrics count a
    non-finite client update, or None (``metrics`` of one call, leading round axis)."""
    bad = np.asarray(metrics["nonfinite_clients"]) > 0
    if not bad.any():
        return None
    first = int(np.argmax(bad))
    return first, sorted(int(c) for c in np.asarray(metrics["nonfinite_ids"][first]) if c >= 0)


def _rows_of(ids, slots):
    """The rows of ``state.clients`` that hold clients ``ids``: the ids themselves, or (host-held
    client states) their slots in the working set (a padding id's slot is past its end)."""
    return ids if slots is None else slots[ids]


def _written_back(host_clients, ids, working, in_place: bool = False):
    """Host-held client states with the working set's first ``len(ids)`` rows written back at
    ``ids``: into ``host_clients``' own arrays where ``in_place`` and they are writable (the
    caller gives them up, as a donated buffer: no second copy of every client's state), else a
    new array per leaf (a state handed out before, e.g. to a checkpoint, is unchanged)."""

    def leaf(held, rows):
        writable = in_place and isinstance(held, np.ndarray) and held.flags.writeable
        out = held if writable else np.array(held, copy=True)
        out[ids] = rows[: len(ids)]
        return out

    return jax.tree.map(leaf, host_clients, jax.device_get(working))


HOST_INIT_BLOCK_BYTES = 64 * 2**20  # host-held states built on the device this much at a time (or a round's)


@struct.dataclass
class SimState:
    server: Any
    clients: Any  # stacked [num_clients, ...]
    round: jax.Array  # rounds completed


class Simulation:
    """One algorithm on one federated dataset.

    ``init()`` gives the starting :class:`SimState`; ``run_rounds(state, n)`` runs ``n`` rounds in
    one compiled call and returns per-round metrics; ``evaluate(state)`` evaluates every client.

    ``pooled_eval_model`` (default: ``model``) runs the passes of one model over the whole test
    set (the global model): the same parameters in another implementation, e.g. XLA's
    convolution, which is faster than the patches convolution outside loops and vmaps.

    How the clients run is the ``strategy``'s job (:class:`~jaxfed.simulation.strategy.ClientStrategy`,
    default built from ``client_chunk`` and ``devices``): ``client_chunk`` 0 vmaps the sampled
    clients all at once; k > 0 runs ``lax.map`` over chunks of k vmapped clients (k = 1: one
    client at a time, each doing only its own steps); ``None`` (or -1, the run key's auto) picks
    one at a time on CPU and, on an accelerator, the chunk modeled fastest for the sampled
    clients' sizes, narrowed to fit the device's memory
    (:class:`~jaxfed.simulation.strategy.ClientStrategy`). ``devices``: a list of ``jax.Device``,
    or a count (the first N visible; 0 or None: all), as the run key. Evaluation is
    :class:`~jaxfed.simulation.evaluation.Evaluation`'s, traffic :mod:`~jaxfed.simulation.accounting`'s;
    the round's semantics (sampling, tiers, the non-finite policy, aggregation) are this class's.

    ``client_state``: ``"device"`` (stacked client states on the device, split over a mesh) or
    ``"host"`` (in this process's memory; each call moves the clients it samples): for client
    states larger than the device's memory.

    ``new_clients``: ids of clients held out of training (never sampled, never uploading), or a
    fraction of the clients spread evenly over the ids (as the run key ``new_clients``): each
    evaluation reports them as new clients, with the global model and after the algorithm's own
    personalization on their training split (``new_client_updates`` local updates from a fresh
    client state where the algorithm has no ``personalize``), under ``new_*``; the personalized
    summaries count the trained clients only.

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
        sampling: str = "uniform",
        eval_clients: str = "all",
        seed: int = 0,
        devices: Sequence[jax.Device] | int | None = None,
        eval_batch_size: int = 256,
        eval_examples_per_call: int = 256,
        pooled_eval_model=None,
        client_chunk: int | None = None,
        nonfinite: str = "error",
        matmul_precision: str = "default",
        strategy: ClientStrategy | None = None,
        client_state: str = "device",
        new_clients: Sequence[int] | float | None = None,
        new_client_updates: int = 1,
        sampling_mode: str | None = None,
    ):
        if sampling_mode is not None:  # the keyword's name before it took the run key's
            warnings.warn("Simulation(sampling_mode=...) is now sampling=...", DeprecationWarning, stacklevel=2)
            sampling = sampling_mode
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite: {unknown_choice(nonfinite, NONFINITE_POLICIES)}")
        if matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision: {unknown_choice(matmul_precision, MATMUL_PRECISIONS)}")
        if client_state not in CLIENT_STATES:
            raise ValueError(f"client_state: {unknown_choice(client_state, CLIENT_STATES)}")
        if client_state == "host" and jax.process_count() > 1:
            raise ValueError("client_state: host keeps client states in this process's memory; one process only")
        check_server_step(algorithm)
        if isinstance(model, Model):
            check_data_fits(model, data.x_train.shape[1:], data.x_train.dtype, data.num_classes)
        if algorithm.personalize is not None and algorithm.evaluates_global:
            raise ValueError(
                f"{algorithm.name}: evaluates_global evaluates one model for every client; drop personalize"
            )
        self.client_state = client_state
        self.matmul_precision = matmul_precision
        self.nonfinite = nonfinite
        self.algorithm = algorithm
        self.model = model
        self.pooled_eval_model = pooled_eval_model or model
        self.num_clients = data.num_clients
        self.new_clients = held_out(new_clients, self.num_clients)
        self.trained_ids = None  # None: every client trains
        if self.new_clients is not None:
            self.trained_ids = np.setdiff1d(np.arange(self.num_clients), self.new_clients).astype(np.int32)
        self.num_trained = self.num_clients if self.trained_ids is None else len(self.trained_ids)
        self.num_sampled = num_sampled(self.num_trained, participation)
        tiered = algorithm.num_tiers is not None
        self.tiers = tier_bounds(self.num_clients, algorithm.num_tiers) if tiered else None
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling: {unknown_choice(sampling, SAMPLINGS)}")
        if sampling == "first" and tiered:  # tiers are blocks of ids: the first clients are the first tiers
            raise ConfigError(
                f"sampling: first trains clients 0..{self.num_sampled - 1} only, the first tiers of "
                f"{algorithm.num_tiers}; use sampling=fixed (a cohort drawn over all tiers)"
            )
        self.sampling = sampling
        if eval_clients not in EVAL_CLIENTS or (eval_clients == "cohort" and sampling not in COHORT_SAMPLINGS):
            need = " or ".join(COHORT_SAMPLINGS)
            raise ValueError(f"eval_clients: '{eval_clients}' with sampling '{sampling}'; cohort needs {need}")
        self.eval_clients = eval_clients
        self.root = jax.random.key(seed)
        if strategy is not None and (client_chunk is not None or devices is not None):
            raise ValueError("strategy: give a ClientStrategy or client_chunk / devices, not both")
        self.strategy = strategy or ClientStrategy(client_chunk, devices)
        self.data = self._placed(data)
        self.evaluation = Evaluation(
            model,
            pooled_eval_model or model,
            self.strategy,
            self.tiers,
            data.test_count,
            eval_batch_size,
            eval_examples_per_call,
            new_client_updates,
        )
        self._new_compiled_calls()

    def _new_compiled_calls(self) -> None:
        """The jitted entry points, bound to this object (its algorithm and root key), and an
        empty compile cache."""
        self.compile_seconds = 0.0
        self._executables: dict[int, Any] = {}
        self._init_state = jax.jit(self.init_pure)
        self._eval = jax.jit(self.evaluate_pure)
        self._eval_block = jax.jit(self._evaluate_block_pure, static_argnums=2)
        self._eval_summary = jax.jit(self.evaluation.summary)
        self._eval_pooled = jax.jit(self._evaluate_pooled_pure)
        self._eval_global = jax.jit(self._evaluate_global_pure)
        self._eval_new = jax.jit(self._evaluate_new_pure)

    def _placed(self, data: FederatedData) -> FederatedData:
        """``data`` on the mesh (which may span processes, ``jax.distributed``): the examples on
        every device, the per-client index tables split over the clients where they divide."""
        data = self.strategy.replicate(data)
        tables = self.strategy.place_clients((data.train_idx, data.train_count, data.test_idx, data.test_count))
        return data.replace(**dict(zip(("train_idx", "train_count", "test_idx", "test_count"), tables)))

    @property
    def num_devices(self) -> int:
        return self.strategy.num_devices

    @property
    def mesh(self):
        return self.strategy.mesh

    @property
    def client_chunk(self) -> int:
        return self.strategy.chunk

    # ----- state -----------------------------------------------------------------------------

    def precision(self):
        """A context in which JAX traces with this simulation's matmul precision: the compiled
        calls run inside it, and so should a program that composes the ``*_pure`` methods."""
        return jax.default_matmul_precision(None if self.matmul_precision == "default" else "highest")

    def init(self, *, warn: Callable[[str], Any] | None = None) -> SimState:
        """The starting state: the algorithm's init, one client state stacked for every client
        (then ``init_client(state, client_id, tier)`` per client, where the algorithm has one).
        ``warn(message)`` (default: :func:`warnings.warn`) hears of client states every device
        must hold in full (a client count the mesh's devices do not divide)."""
        if self.client_state == "host":
            return self._init_held()
        with self.precision():
            state = self._init_state()
        self.warn_unsplit_clients(tree_bytes(state.clients), warn or functools.partial(warnings.warn, stacklevel=3))
        return self.place(state)

    def place(self, state: SimState, leading: int = 0) -> SimState:
        """``state`` on the mesh: client states by :meth:`Strategy.place_clients` (their client axis
        ``leading``: 1 for a sweep's states, stacked over members), the rest on every device (each
        part moved once: the client states never whole on every device on the way)."""
        clients = self.strategy.place_clients(state.clients, leading)
        return self.strategy.replicate(state.replace(clients=None)).replace(clients=clients)

    def warn_unsplit_clients(self, held: int, warn: Callable[[str], Any]) -> None:
        """``warn(message)`` where client states of ``held`` bytes (all of them) stay whole on
        every device: a client count the mesh's devices do not divide."""
        if held and self.num_devices > 1 and jax.process_count() == 1 and not self.strategy.splits(self.num_clients):
            warn(
                f"client states: {self.num_clients} clients do not divide over {self.num_devices} devices, so every "
                f"device holds all of them ({human_bytes(held)} each); a multiple of {self.num_devices} clients "
                "splits them"
            )

    def _init_held(self) -> SimState:
        """:meth:`init` with the client states built into host memory a block of clients at a time
        (never all of them on the device: a round's width, or :data:`HOST_INIT_BLOCK_BYTES` of
        states where that is more), by the program :meth:`init_pure` is for every client: the
        same numbers."""
        one = jax.eval_shape(self.init_pure, jax.ShapeDtypeStruct((1,), jnp.int32)).clients
        width = min(self.num_clients, max(self.num_sampled, HOST_INIT_BLOCK_BYTES // max(tree_bytes(one), 1), 1))
        block = jax.jit(self.init_pure)
        held = first = None
        for lo in range(0, self.num_clients, width):
            ids = np.minimum(np.arange(lo, lo + width), self.num_clients - 1).astype(np.int32)  # the last padded
            with self.precision():
                state = block(ids)
            rows = jax.device_get(state.clients)
            if first is None:
                first = state
                held = jax.tree.map(lambda x: np.empty((self.num_clients,) + x.shape[1:], x.dtype), rows)
            count = min(width, self.num_clients - lo)
            for x, r in zip(jax.tree.leaves(held), jax.tree.leaves(rows)):
                x[lo : lo + count] = r[:count]
        return self.strategy.replicate(first.replace(clients=None)).replace(clients=held)

    def check_state(self, state: SimState, num_clients: int | None = None) -> None:
        """A ConfigError unless ``state`` holds one client state per client of this simulation's
        data (or of ``num_clients``: the data given): a state from a simulation of another client
        count must not run or evaluate here."""
        leaves = jax.tree.leaves(state.clients)
        held = leaves[0].shape[0] if leaves else self.num_clients
        if held != self.num_clients:
            raise ConfigError(
                f"state: holds {held} client states, but this simulation's data has {self.num_clients} clients; "
                "run a state with the simulation (and data) it was made for"
            )
        if num_clients is not None and num_clients != self.num_clients:
            raise ConfigError(
                f"data: has {num_clients} clients, but this simulation's state has {self.num_clients}: their states "
                "would pair with other clients' data; hold new clients out of training with new_clients= instead"
            )

    def init_pure(self, ids=None) -> SimState:
        """The starting state (pure, not jitted: for composing, e.g. vmapped over a sweep's members),
        of every client or of the clients ``ids`` only (a block of host-held states)."""
        server_state, client = self.algorithm.init(sampling.init_key(self.root))
        if self.algorithm.init_client is None:
            clients = stack_clients(client, self.num_clients if ids is None else ids.shape[0])
        else:  # the one starting state unbatched: what it alone decides (a model tier's SVD) runs once
            ids = jnp.arange(self.num_clients, dtype=jnp.int32) if ids is None else ids
            tiers = jnp.zeros_like(ids) if self.tiers is None else sampling.tier_of(ids, self.tiers)
            clients = jax.vmap(self.algorithm.init_client, in_axes=(None, 0, 0))(client, ids, tiers)
        return SimState(server=server_state, clients=clients, round=jnp.int32(0))

    def variant(self, root, algorithm: FederatedAlgorithm) -> Simulation:
        """This simulation with another root key and algorithm (same data layout, devices and
        strategy): a member of a vectorized sweep, whose seed and learning rate may be traced."""
        member = copy.copy(self)
        member.root, member.algorithm = root, algorithm
        member._new_compiled_calls()  # the copied ones would run this simulation's algorithm and key
        return member

    def sampled_ids(self, round_index: int) -> np.ndarray:
        """The ids of the clients sampled in round ``round_index`` (0-based), as the round draws them."""
        return np.asarray(self._sample(sampling.round_key(self.root, round_index)))

    def _sample(self, key):
        """The sorted ids of the clients a round of key ``key`` samples (never a new client)."""
        if self.trained_ids is None:
            return sampling.sample_clients(self.root, key, self.num_clients, self.num_sampled, self.sampling)
        drawn = sampling.sample_clients(self.root, key, self.num_trained, self.num_sampled, self.sampling)
        return jnp.asarray(self.trained_ids)[drawn]  # trained_ids is sorted: so are these

    # ----- rounds ----------------------------------------------------------------------------

    def _client_groups(self, real_ids):
        """``[(tier, ids)]`` with static sizes: all sampled clients for an untiered algorithm (or
        one with ``pad_tier``: tier None); for a tiered one, each tier's sampled clients padded to
        ``min(num_sampled, tier size)``.
        Every group is padded to a multiple of the device count with dummy ids (``num_clients``)."""
        fill = self.num_clients
        if self.tiers is None or self._tiers_in_one_group():
            groups = [(None if self.tiers else 0, real_ids)]  # padded tiers: all in one (tier None)
        else:
            groups = [
                (t, sampling.tier_members(real_ids, lo, hi, min(self.num_sampled, hi - lo), fill))
                for t, (lo, hi) in enumerate(self.tiers)
            ]
        return [(t, self.strategy.padded_ids(ids, fill)) for t, ids in groups]

    def _tiers_in_one_group(self) -> bool:
        """Whether a tiered round runs every tier's clients as one group: where the algorithm pads
        its tiers to one shape (``pad_tier``) and either clients run vmapped together or the tiers'
        own messages already share one shape (padding adds nothing: FedSPU's rates; FedHM with
        one ratio repeated). One client at a time with tiers of other shapes, per-tier groups do
        less work (a padding row costs nothing there, and each tier runs its own rank)."""
        if self.algorithm.pad_tier is None or not self.tiers:
            return False
        return self.client_chunk != 1 or self._tier_messages_share_shape()

    def _tier_messages_share_shape(self) -> bool:
        """Whether there are several tiers and every tier's ``broadcast`` has one structure, shapes
        and dtypes (traced for shapes only)."""
        if len(self.tiers) < 2:
            return False
        server = jax.eval_shape(self.algorithm.init, jax.random.key(0))[0]

        def shapes(tier):
            message = jax.eval_shape(lambda s: self.algorithm.broadcast(s, RoundInfo(jnp.int32(0), tier)), server)
            return jax.tree.structure(message), [(x.shape, x.dtype) for x in jax.tree.leaves(message)]

        first = shapes(0)
        return all(shapes(t) == first for t in range(1, len(self.tiers)))

    def _update_group(self, state: SimState, data: FederatedData, key, tier: int, ids, slots=None):
        """``client_update`` of the clients ``ids`` (one tier): their rows (new states, metrics,
        weights, ...) and the sum of their contributions to the server's step. ``slots`` (host-held
        client states): where each client id's state sits in ``state.clients``, the working set."""
        alg = self.algorithm
        ids = ids[self.strategy.run_order(data.train_data(ids).count)]  # the group runs (and reports) in this order
        client_data = data.train_data(ids)
        is_real = ids < self.num_clients
        info = RoundInfo(round=state.round, tier=tier)  # the round's one home is the engine's state
        states = gather_clients(state.clients, _rows_of(ids, slots))
        if tier is None and self.tiers is not None:  # padded tiers: each client gets its tier's message
            tiers = sampling.tier_of(ids, self.tiers)  # a padding id trains nothing
            messages = [alg.broadcast(state.server, RoundInfo(state.round, t)) for t in range(len(self.tiers))]
            message_down = stack_trees([alg.pad_tier(m, RoundInfo(state.round, t)) for t, m in enumerate(messages)])

            def by_tier(count_bytes):  # each client's bytes by its tier's message
                per_tier = [
                    count_bytes(alg, m, states, RoundInfo(state.round, t), len(ids)) for t, m in enumerate(messages)
                ]
                return jnp.stack(per_tier)[tiers, jnp.arange(len(ids))]

            down_sent = accounting.real_total(is_real, by_tier(accounting.sent_bytes))
            down_bytes = by_tier(accounting.download_bytes)
            tier_up_bytes = None  # message_bytes counts each upload itself
            if alg.message_bytes is None:
                tier_up_bytes = self._tier_upload_bytes(state, messages, states, client_data, key, ids)
        else:
            tiers = jnp.full(ids.shape, tier or 0, jnp.int32)
            message_down = alg.broadcast(state.server, info)
            if alg.sent_bytes is None:
                down_sent = jnp.sum(is_real).astype(jnp.float32) * tree_bytes(message_down)
            else:
                down_sent = accounting.real_total(
                    is_real, accounting.sent_bytes(alg, message_down, states, info, len(ids))
                )
            down_bytes = accounting.download_bytes(alg, message_down, states, info, len(ids))
            tier_up_bytes = None
        per_client = (ids, tiers, states, client_data.indices, client_data.count, sampling.client_keys(key, ids))
        shared = (state.server, message_down, client_data.x, client_data.y, info)
        rows, total = self.strategy.map_clients(self._one_client, shared, per_client)
        if tier_up_bytes is None:
            tier_up_bytes = [rows.up_bytes[0]]  # fixed per tier unless message_bytes says otherwise
        elif alg.message_bytes is None:  # the tier's own upload, not the padded one
            rows = rows._replace(up_bytes=jnp.asarray(tier_up_bytes, jnp.float32)[tiers])
        if self.nonfinite == "skip":  # a skipped client sends nothing
            rows = rows._replace(up_bytes=jnp.where(rows.bad, 0.0, rows.up_bytes))
        return _Group(tiers, ids, is_real, rows, total, down_sent, down_bytes, tier_up_bytes)

    def _tier_upload_bytes(self, state, messages, states, client_data, key, ids) -> list[int]:
        """The bytes of one upload of each tier, from the shapes ``client_update`` gives on the
        tier's own (unpadded) message (traced for its shapes only)."""
        client_state, indices, count = jax.tree.map(lambda x: x[0], (states, client_data.indices, client_data.count))
        data = ClientData(client_data.x, client_data.y, indices, count)
        rng = sampling.client_keys(key, ids)[0]
        sizes = []
        for t, message in enumerate(messages):
            info = RoundInfo(round=state.round, tier=t)
            _, upload, _ = jax.eval_shape(
                lambda m, c, d, r, i=info: self.algorithm.client_update(m, c, d, r, i), message, client_state, data, rng
            )
            sizes.append(tree_bytes(upload))
        return sizes

    def _one_client(self, shared, client):
        """One client's update and what the round keeps of it: ``(row, contribution)``. The
        contribution (an aggregation's share, zero for a row of weight 0) is summed by the strategy."""
        alg = self.algorithm
        server_state, message_down, x, y, info = shared
        client_id, tier, client_state, indices, count, rng = client
        if info.tier is None and self.tiers is not None:  # padded tiers: the client's tier's message
            message_down = jax.tree.map(lambda m: m[tier], message_down)
        new_state, message, metrics = check_client_update(
            alg.client_update(message_down, client_state, ClientData(x, y, indices, count), rng, info), client_state
        )
        real = client_id < self.num_clients
        bad = real & ~all_finite((new_state, message, metrics))
        kept = real & ~bad if self.nonfinite == "skip" else real  # error: the whole round is judged after
        if self.nonfinite == "skip":  # a bad client keeps its old state and sends nothing
            message, metrics = tree_select(bad, jax.tree.map(jnp.zeros_like, (message, metrics)), (message, metrics))
        weight = jnp.where(kept, count, 0).astype(jnp.float32)
        up_bytes = accounting.upload_bytes(alg, message)
        decoded = server.decode(alg, server_state, message, info)  # the shape every tier shares
        if alg.aggregation is None:
            return _ClientRow(new_state, metrics, bad, weight, up_bytes, decoded), ()
        share = server.contribution(alg, server_state, decoded, weight, info)
        return _ClientRow(new_state, metrics, bad, weight, up_bytes, ()), share

    def round(self, state: SimState, data: FederatedData, slots=None):
        """One round (pure): returns the new state and this round's metrics. ``slots``: see
        :meth:`_update_group` (None: ``state.clients`` holds every client, by id)."""
        key = sampling.round_key(self.root, state.round)
        real_ids = self._sample(key)
        groups = [self._update_group(state, data, key, t, ids, slots) for t, ids in self._client_groups(real_ids)]

        bad = jnp.concatenate([g.rows.bad for g in groups])
        # nonfinite=skip: the bad clients already weigh 0; error: a bad client rejects the round
        round_ok = jnp.bool_(True) if self.nonfinite == "skip" else ~jnp.any(bad)
        weights = [jnp.where(round_ok, g.rows.weight, 0.0) for g in groups]
        totals, decoded = [g.total for g in groups], [g.rows.message_up for g in groups]
        # a rejected round (nonfinite=error) has every weight 0: apply keeps the server state
        server_state = server.apply(self.algorithm, state.server, totals, decoded, weights, state.round)
        any_weight = jnp.any(jnp.concatenate(weights) > 0)
        clients = state.clients
        for g in groups:
            kept = g.is_real & ~g.rows.bad if self.nonfinite == "skip" else jnp.broadcast_to(round_ok, g.ids.shape)
            rows = _rows_of(jnp.where(kept, g.ids, self.num_clients), slots)
            clients = scatter_clients(clients, rows, g.rows.new_state)
        clients = self.strategy.keep_clients_placed(clients)

        client_metrics = concat_clients([g.rows.metrics for g in groups])
        trained = weighted_mean(client_metrics, jnp.concatenate(weights))  # NaN: no client's update was used
        trained = jax.tree.map(lambda m: jnp.where(any_weight, m, jnp.nan), trained)
        traffic, traffic_per_tier = accounting.traffic(self.algorithm, groups, self.tiers)
        metrics = {
            **trained,
            **traffic,
            "nonfinite_clients": jnp.sum(bad).astype(jnp.float32),
            "nonfinite_ids": jnp.concatenate([jnp.where(g.rows.bad, g.ids, -1) for g in groups]),
            **traffic_per_tier,
        }
        next_round = state.round + round_ok.astype(state.round.dtype)
        return SimState(server=server_state, clients=clients, round=next_round), metrics

    def rounds_pure(self, state, data, num_rounds: int, slots=None):
        """``num_rounds`` rounds on ``data`` (pure, not jitted): ``(state, metrics [rounds, ...])``."""
        return jax.lax.scan(lambda s, _: self.round(s, data, slots), state, None, length=num_rounds)

    def run_rounds(self, state: SimState, num_rounds: int, *, raise_nonfinite: bool = True, donate: bool = False):
        """Run ``num_rounds`` rounds in one compiled call; metrics have a leading round axis.

        ``donate`` (host-held client states): ``state``'s client arrays are updated in place and
        become the new state's, so ``state`` must not be used again (unlike a buffer donated to
        JAX, nothing stops it: run from again, it would pair its round's server state with the
        newer client states); without it they are copied, every client's state, on every call.
        The run loop donates.

        Under ``nonfinite="error"`` a round with a non-finite client update leaves the state
        unchanged (so later rounds of the call repeat it) and counts the clients in the round's
        ``nonfinite_clients``; with ``raise_nonfinite`` this raises
        :class:`NonFiniteUpdateError` carrying the last good state and the good rounds' metrics.
        """
        self.check_state(state)
        working, slots, ids = self._working_set(state, num_rounds)
        new_state, metrics = self._compiled(working, slots, num_rounds)(working, self.data, slots)
        if ids is not None:
            new_state = new_state.replace(clients=_written_back(state.clients, ids, new_state.clients, donate))
        failure = first_nonfinite(metrics) if self.nonfinite == "error" and raise_nonfinite else None
        if failure is not None:
            first, ids = failure
            good = jax.tree.map(lambda m: m[:first], metrics)
            raise NonFiniteUpdateError(int(new_state.round) + 1, ids, new_state, good)
        return new_state, metrics

    def compiled(self, state: SimState, num_rounds: int):
        """The compiled call of ``num_rounds`` rounds that :meth:`run_rounds` runs from ``state``
        (compiled on first use, then cached): its ``memory_analysis()`` and ``cost_analysis()``
        are what one call needs on the device."""
        working, slots, _ = self._working_set(state, num_rounds)
        return self._compiled(working, slots, num_rounds)

    def _compiled(self, working: SimState, slots, num_rounds: int):
        if num_rounds not in self._executables:
            self._executables[num_rounds] = self._compile(working, slots, num_rounds)
        return self._executables[num_rounds]

    def _working_set(self, state: SimState, num_rounds: int):
        """``(state, slots, ids)`` for a call of ``num_rounds`` rounds from ``state``: as it is
        (``None, None``) when client states live on the device; host-held, the states of the
        clients these rounds sample (``ids``, known ahead: sampling is a function of the round)
        moved to the device, in a static ``min(num_clients, num_rounds * num_sampled)`` rows, and
        ``slots`` (``[num_clients + 1]``: each id's row, the rest past the end)."""
        if self.client_state == "device":
            return state, None, None
        first = int(state.round)
        ids = np.unique(np.concatenate([self.sampled_ids(r) for r in range(first, first + num_rounds)]))
        rows = min(self.num_clients, num_rounds * self.num_sampled)
        slots = np.full(self.num_clients + 1, rows, np.int32)
        slots[ids] = np.arange(len(ids), dtype=np.int32)
        taken = np.concatenate([ids, np.full(rows - len(ids), ids[0])])  # the fill rows are never addressed
        working = jax.tree.map(lambda x: np.asarray(x)[taken], state.clients)
        return state.replace(clients=self.strategy.place_clients(jax.device_put(working))), jnp.asarray(slots), ids

    def _compile(self, state: SimState, slots, num_rounds: int):
        """The compiled call of ``num_rounds`` rounds; where the strategy picks its chunk to fit
        the device's memory and the round does not fit (its memory analysis says so, or its
        compilation ran out of memory), compiled again with a narrower chunk (every compiled call
        of this simulation then uses it)."""
        start = time.perf_counter()
        widest = -(-self.num_sampled // self.num_devices)
        first = int(state.round)
        rounds = range(first, first + min(num_rounds, 10))
        self.strategy.fit_sizes(lambda: [np.asarray(self.data.train_count)[self.sampled_ids(t)] for t in rounds])
        while True:
            with self.precision():
                lowered = jax.jit(self.rounds_pure, static_argnums=2).lower(state, self.data, num_rounds, slots)
                try:
                    compiled = lowered.compile()
                    chunk = self.strategy.fitted(compiled.memory_analysis(), widest)
                except jax.errors.JaxRuntimeError as error:
                    chunk = self.strategy.narrowed(widest, error)
                    if chunk is None:
                        raise
            if chunk is None:
                break
            self.strategy.chunk = chunk
            self._executables.clear()
        self.compile_seconds += time.perf_counter() - start
        return compiled

    # ----- evaluation ------------------------------------------------------------------------

    def evaluate_pure(self, state: SimState, data: FederatedData):
        """Every client's evaluation on ``data`` (pure, not jitted): metrics as arrays, the
        per-client ones (client-id order) under ``"clients"``. ``data`` must have as many clients
        as ``state`` holds (another client set is a ConfigError: its clients are not the ones
        whose states these are)."""
        self.check_state(state, data.num_clients)
        return self.evaluation(self.algorithm, state, data, self._counted(), self.root, self.new_clients)

    def _counted(self) -> jax.Array | None:
        """``[num_clients]`` bool: the clients whose personalized results count (the fixed cohort
        under ``eval_clients="cohort"``, the trained clients where some are new), or None: all."""
        if self.eval_clients == "cohort":
            ids = sampling.cohort(self.root, self.num_trained, self.num_sampled, self.sampling)
            ids = ids if self.trained_ids is None else jnp.asarray(self.trained_ids)[ids]
        elif self.trained_ids is not None:
            ids = jnp.asarray(self.trained_ids, jnp.int32)
        else:
            return None
        return jnp.zeros(self.num_clients, bool).at[ids].set(True)

    def evaluate(self, state: SimState) -> dict:
        """Every client's evaluation: the summary metrics as floats (personalized accuracy, and
        global accuracy where there is a global model; new clients' where some are held out),
        and ``"clients"``: per-client numpy arrays in client-id order (``acc`` or ``mse``,
        ``loss``, ``examples``; ``new_*`` and ``new_global_*`` for new clients), NaN for a client
        without counted test examples."""
        self.check_state(state)
        with self.precision():
            if self.client_state == "host":
                metrics = self._evaluate_held(state)
            else:
                metrics = self._eval(state, self.data)
            return host_metrics(metrics)

    def _evaluate_held(self, state: SimState) -> dict:
        """:meth:`evaluate` of host-held client states: their outcomes block by block (a block
        is at most as many clients as a round samples, moved to the device one block at a time),
        then the same summaries."""
        counted = self._counted()
        pooled = self._eval_global(state.server, self.data)
        if self.algorithm.evaluates_global:
            metrics = self._eval_pooled(state.server, self.data, counted, pooled)
        else:
            metrics = self._evaluate_held_blocks(state, counted, pooled)
        if self.new_clients is not None:
            held = jax.device_put(jax.tree.map(lambda x: np.asarray(x)[self.new_clients], state.clients))
            new = self._eval_new(state.server, state.round, held, self.data, pooled)
            metrics = {**metrics, **new, "clients": {**metrics["clients"], **new["clients"]}}
        return metrics

    def _evaluate_held_blocks(self, state: SimState, counted, pooled) -> dict:
        """The personalized evaluation of host-held client states, block by block."""
        width = self.num_sampled
        parts = []
        for tier, lo, hi in self.evaluation.spans(self.num_clients):
            for start in range(lo, hi, width):
                ids = np.arange(start, start + width)
                held = np.minimum(ids, hi - 1)  # past the span: a copy of its last client, counted 0
                states = jax.device_put(jax.tree.map(lambda x: np.asarray(x)[held], state.clients))
                ids = np.where(ids < hi, ids, self.num_clients).astype(np.int32)
                outcomes = self._eval_block(state.server, state.round, tier, states, ids, self.data, counted)
                parts.append(tuple(o[: min(hi, start + width) - start] for o in outcomes))
        correct, loss, count = (jnp.concatenate(p) for p in zip(*parts))
        return self._eval_summary(correct, loss, count, self.data, pooled)

    def _evaluate_block_pure(self, server, round_, tier, states, ids, data, counted):
        return self.evaluation.block(self.algorithm, server, round_, tier, states, ids, data, counted, self.root)

    def _evaluate_global_pure(self, server, data):
        return self.evaluation.global_outcomes(self.algorithm, server, data)

    def _evaluate_pooled_pure(self, server, data, counted, pooled):
        return self.evaluation.pooled(self.algorithm, server, data, counted, pooled)

    def _evaluate_new_pure(self, server, round_, states, data, pooled):
        return self.evaluation.new_clients(
            self.algorithm, server, round_, states, self.new_clients, data, self.root, pooled
        )
