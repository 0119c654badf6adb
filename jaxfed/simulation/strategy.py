"""The client-execution strategy: how a round's clients (and an evaluation's) run on the devices.

One object holds every choice of how work is laid out, so the round and the evaluation only say
what to compute: the order items run in (largest first: a vmapped chunk holds items of similar
size, the engine's bucketing by size), padding to a multiple of the device count, vmapping all
items at once or a scan over chunks of vmapped items (summing what the items contribute as
they run), and sharding the item axis over a
``Mesh`` axis named ``clients`` (each device runs its own share under ``shard_map``). In the
spirit of fedjax's ``for_each_client`` backends: pass another object with these methods to
:class:`~jaxfed.simulation.Simulation` as ``strategy`` to run clients differently.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxfed.errors import ConfigError, clip
from jaxfed.options import type_problem
from jaxfed.simulation import sampling

CLIENT_AXIS = "clients"


def default_client_chunk(platform: str) -> int:
    """The default strategy before client sizes and memory are considered: one client at a time
    (``1``) on CPU, where vmapping clients measured slower for every model tried
    (benchmarks/fedavg_round.py: MLP on digits and MNIST, CNN on MNIST); all sampled clients
    vmapped at once (``0``) on accelerators, then the chunk modeled fastest for the clients'
    sizes (:meth:`ClientStrategy.fit_sizes`) narrowed to what fits (:meth:`ClientStrategy.fitted`,
    :meth:`ClientStrategy.narrowed`)."""
    return 1 if platform == "cpu" else 0


def device_memory_bytes(devices: Sequence[jax.Device]) -> int | None:
    """The memory a program may use on this process's first device of ``devices`` (its
    allocator's limit), or None where the device does not say (CPU)."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    stats = local[0].memory_stats() if local else None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


STEP_WIDTH = 3.0  # on an accelerator a vmapped local step over w clients costs about 1 + w / 3
# steps of one client: fitted to W1's rounds at client_chunk 1, 5, 20 and all on an H100
# (22.0, 10.8, 9.6, 14.6 ms; 0.118 ms per step in sequence plus 0.040 ms per client-step run)


def size_ordered_groups(sizes: np.ndarray, chunk: int) -> list[np.ndarray]:
    """Clients' ``sizes`` (largest first) as the engine runs them with ``client_chunk=chunk``:
    vmapped groups of ``chunk`` (0: one group of all), each running as long as its largest
    client. Sorting by size is the engine's bucketing."""
    size = chunk or len(sizes)
    return np.array_split(sizes, range(size, len(sizes), size))


def device_shares(sizes, num_devices: int) -> list[np.ndarray]:
    """Each device's clients as the engine deals them (:meth:`ClientStrategy.run_order`): ``sizes``
    in size order, largest first, padded with size-0 dummies to a multiple of ``num_devices``, every
    ``num_devices``-th to each device. Device 0's share is the busiest (it never gets a dummy)."""
    order = np.sort(np.asarray(sizes))[::-1]
    padded = np.concatenate([order, np.zeros(-len(order) % num_devices, order.dtype)])
    return [padded[d::num_devices] for d in range(num_devices)]


def fastest_chunk(sizes_per_round: Sequence[np.ndarray], num_devices: int = 1) -> int:
    """The chunk (0: all at once) whose modeled time over these rounds' sampled client sizes is
    least. The sizes are training examples standing in for local steps (the engine does not know
    an algorithm's batch size and epochs; steps are examples / batch, rounded, times epochs, so
    the two agree up to that rounding). In size order, a chunk
    runs as long as its largest client and costs ``1 + width / STEP_WIDTH`` per step; a device
    runs every ``num_devices``-th client of the order. Candidates: the powers of two below the
    widest group, and all at once."""
    shares = [device_shares(s, num_devices)[0] for s in sizes_per_round]
    widest = max(len(s) for s in shares)
    candidates = [2**k for k in range((widest - 1).bit_length())] + [widest]

    def cost(chunk: int) -> float:
        groups = [g for sizes in shares for g in size_ordered_groups(sizes, chunk)]
        return float(sum(g[0] * (1.0 + len(g) / STEP_WIDTH) for g in groups if len(g)))

    best = min(candidates, key=cost)
    return 0 if best == widest else best


ROUND_BUFFERS = 4  # a training round holds about this many parameter-sized buffers per client
# (parameters, gradients, optimizer state, the update): see ClientStrategy.narrowed
_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _allocation_bytes(message: str) -> float | None:
    """The size of the allocation an out-of-memory message names (XLA's ``Out of memory while
    trying to allocate 149.03GiB``, ``... allocate 33762398024 bytes``, ``Failed to allocate
    request for 1.20GiB``), or None."""
    found = re.search(r"allocate (?:request for )?([0-9.]+)\s*(TiB|GiB|MiB|KiB|bytes|B)\b", message)
    return float(found[1]) * _UNITS[found[2]] if found else None


def given_chunk(chunk) -> int | None:
    """A caller's ``client_chunk``: None for the default (``None`` or ``-1``, the run key's auto),
    else the int >= 0 given; a one-line ConfigError for anything else."""
    if chunk is None or (type_problem(chunk, int) is None and chunk == -1):
        return None
    if type_problem(chunk, int) is not None or chunk < 0:
        raise ConfigError(
            f"client_chunk: 0 (every sampled client at once), k >= 1 (chunks of k) or -1 / None (auto), got {chunk!r}"
        )
    return int(chunk)


def chosen_devices(devices) -> list:
    """A caller's ``devices``: jax devices (a list, tuple, array such as ``mesh.devices``, any
    iterable), or an int N (the first N visible; 0 or None: all of them, as the run key's); a
    one-line ConfigError for anything else."""
    available = jax.devices()
    if devices is None:
        return list(available)
    if type_problem(devices, int) is None:
        if not 0 <= devices <= len(available):
            raise ConfigError(f"devices: {devices}; allowed: 0 (all) to {len(available)}, the devices visible")
        return list(available[: int(devices) or None])
    try:
        chosen = [] if isinstance(devices, str) else list(np.ravel(np.asarray(devices, dtype=object)))
    except TypeError:  # not iterable
        chosen = []
    if not chosen or not all(isinstance(d, jax.Device) for d in chosen):
        raise ConfigError(
            f"devices: jax devices (jax.devices()[:2]) or a count; got {type(devices).__name__} "
            f"{clip(' '.join(repr(devices).split()))}"
        )
    return chosen


class ClientStrategy:
    """Clients vmapped all at once (``chunk=0``) or a scan over chunks of ``chunk`` vmapped
    clients (1: one at a time, each doing only its own steps), on ``devices`` (default: every
    visible device; more than one: the item axis is sharded over them, the per-client tables
    split over them where they divide (:meth:`client_sharding`), the rest replicated, possibly
    across processes).

    ``chunk=None`` is the default that fits: with a memory budget (``memory_bytes``, default the
    device's own limit; CPU devices have none), the chunk modeled fastest for the round's client
    sizes (:meth:`fit_sizes`), narrowed until the compiled round fits in the budget
    (:meth:`fitted`, from XLA's memory analysis of the compiled round; :meth:`narrowed`, where
    compiling ran out of memory); without one, :func:`default_client_chunk` (one at a time on
    CPU).
    """

    def __init__(
        self,
        chunk: int | None = None,
        devices: Sequence[jax.Device] | int | None = None,
        memory_bytes: int | None = None,
    ):
        chunk = given_chunk(chunk)
        self.devices = chosen_devices(devices)
        self.num_devices = len(self.devices)
        self.mesh = Mesh(np.array(self.devices), (CLIENT_AXIS,)) if self.num_devices > 1 else None
        self.memory_bytes = memory_bytes if memory_bytes is not None else device_memory_bytes(self.devices)
        self.fits_memory = chunk is None and self.memory_bytes is not None  # the chunk is chosen to fit
        self.members_as_clients = False  # a sweep sets it: see map_clients
        self.sized = False  # fit_sizes has chosen the chunk
        if chunk is not None:
            self.chunk = chunk
        else:
            self.chunk = 0 if self.fits_memory else default_client_chunk(self.devices[0].platform)

    @property
    def usable_bytes(self) -> float:
        """The memory budget a compiled round may fill: a tenth is kept free."""
        return 0.9 * self.memory_bytes

    def fitted(self, memory, clients: int) -> int | None:
        """The chunk to compile again with when the round compiled with this strategy's chunk
        does not fit the memory budget (``memory``: the compiled round's ``memory_analysis()``;
        ``clients``: the widest group of clients a device runs); None when it fits or the chunk
        was given. The temporary memory is taken to grow with the chunk (a round's memory is
        the chunk's, :mod:`~jaxfed.simulation.server`), within :attr:`usable_bytes`."""
        if not self.fits_memory or memory is None:
            return None
        free = self.usable_bytes - memory.argument_size_in_bytes - memory.output_size_in_bytes
        if memory.temp_size_in_bytes <= free:
            return None
        width = self.chunk or clients
        if width <= 1:
            return None  # one client at a time is the narrowest there is
        return max(1, min(width - 1, int(width * max(free, 0) / memory.temp_size_in_bytes)))

    def fit_sizes(self, sizes_per_round: Callable[[], Sequence[np.ndarray]]) -> None:
        """Where the chunk is the default's to choose and a device budget exists (an accelerator),
        the chunk :func:`fastest_chunk` models fastest for the sampled client sizes of some rounds
        (``sizes_per_round()``, read only then; a vmapped group runs as long as its largest
        client: W1 at 100 clients all at once does 40% useful steps). Chosen once, in one
        process; :meth:`fitted` may then narrow it to fit the memory."""
        if self.fits_memory and self.chunk == 0 and not self.sized and jax.process_count() == 1:
            self.chunk = fastest_chunk(sizes_per_round(), self.num_devices)
        self.sized = True

    def narrowed(self, clients: int, error: Exception) -> int | None:
        """The chunk to compile again with when compiling with this strategy's chunk ran out of
        device memory (``error``: the compiler's). An accelerator's compiler can fail before a
        memory analysis exists: XLA's GPU autotuner allocates the round's buffers while it tunes
        (W2 with 1 000 000 clients vmapped asked an H100 for 149 GiB). None when the chunk was
        given, it is one client at a time already, or the error is not about memory. Narrowed
        by the failed allocation against the budget, taken as one of
        :data:`ROUND_BUFFERS` such buffers (10x where the error names no size);
        :meth:`fitted` then checks the narrower round's memory analysis."""
        if not self.fits_memory or "RESOURCE_EXHAUSTED" not in str(error) or jax.process_count() > 1:
            return None  # processes must compile the same program: none narrows alone
        width = self.chunk or clients
        if width <= 1:
            return None
        asked = _allocation_bytes(str(error))
        shrink = 10.0 if asked is None else max(2.0, ROUND_BUFFERS * asked / self.usable_bytes)
        return max(1, int(width / shrink))

    def replicate(self, tree):
        """``tree`` placed on every device of the mesh (as it is on one device)."""
        return tree if self.mesh is None else jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))

    def client_sharding(self, num_rows: int, leading: int = 0) -> NamedSharding | None:
        """Where a per-client table of ``num_rows`` rows (its axis ``leading``: 1 for a sweep's
        tables, stacked over members) lives on the mesh: its rows split over the ``clients`` axis
        (each device holds 1/D of them) when they divide evenly over the devices of one process;
        else replicated. None without a mesh."""
        if self.mesh is None:
            return None
        split = PartitionSpec(*[None] * leading, CLIENT_AXIS)
        return NamedSharding(self.mesh, split if self.splits(num_rows) else PartitionSpec())

    def splits(self, num_rows: int) -> bool:
        """Whether per-client tables of ``num_rows`` rows are split over the mesh's devices: they
        divide evenly over the devices of one process."""
        return self.mesh is not None and num_rows % self.num_devices == 0 and jax.process_count() == 1

    def place_clients(self, tree, leading: int = 0):
        """A stacked per-client pytree (client states, per-client index tables; its client axis
        ``leading``) placed by :meth:`client_sharding`."""
        if self.mesh is None:
            return tree
        return jax.tree.map(lambda x: jax.device_put(x, self.client_sharding(x.shape[leading], leading)), tree)

    def keep_clients_placed(self, tree):
        """Inside a compiled round: a stacked per-client pytree kept where :meth:`place_clients`
        put it (the round's gathers and scatters would otherwise leave it replicated)."""
        if self.mesh is None:
            return tree
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self.client_sharding(x.shape[0])), tree)

    def run_order(self, sizes: jax.Array) -> jax.Array:
        """The order to run items of ``sizes`` in: largest first, so that a vmapped chunk holds
        items of similar size (a chunk runs as many local steps as its largest client), then dealt
        round-robin to the devices (device d gets ranks d, d + D, ...). ``len(sizes)`` is a
        multiple of the device count."""
        order = jnp.argsort(-sizes, stable=True)
        if self.num_devices > 1:
            order = order.reshape(-1, self.num_devices).T.reshape(-1)
        return order

    def padded_ids(self, ids: jax.Array, fill: int) -> jax.Array:
        """``ids`` padded with ``fill`` (a dummy client) to a multiple of the device count."""
        return sampling.pad_ids(ids, self.num_devices, fill)

    def padded_rows(self, tree):
        """Rows appended to the leading axis up to a multiple of the device count (copies of the
        last row)."""
        n = jax.tree.leaves(tree)[0].shape[0]
        pad = -n % self.num_devices
        if not pad:
            return tree
        return jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[-1:], pad, axis=0)]), tree)

    def map_clients(self, f, shared, per_client):
        """``f(shared, client) -> (row, share)`` over the leading (client) axis of ``per_client``,
        in the order given: all vmapped at once, or a scan over chunks of vmapped clients.
        Returns ``(rows, total)``: the rows stacked in that order, and the shares summed (within a
        chunk, over the chunks, then across devices), so no more than a chunk's shares are ever
        held at once.

        With :attr:`members_as_clients` set and one client at a time, a ``vmap`` of this call
        over an experiment axis (a sweep's members) still runs one client at a time
        (:func:`_members_as_clients`); nested, the members' clients would run in vmapped chunks of
        one per member, each as many steps as the largest. Vmapped chunks of clients need no such
        care: nested, the members' chunks simply run side by side as one wider chunk."""
        if self.members_as_clients and self.chunk == 1:
            return _members_as_clients(self._map_items, f, shared, per_client)
        return self._map_items(f, shared, per_client)

    def _map_items(self, f, shared, per_client, num_segments: int | None = None):
        """:meth:`map_clients`; with ``num_segments`` (one item at a time only), ``f`` returns
        ``(row, (segment, share))`` and the total is the shares summed per segment (a leading axis
        of ``num_segments``)."""
        chunk = self.chunk
        assert num_segments is None or chunk == 1

        def mapped(shared, xs):
            one = functools.partial(f, shared)
            if chunk == 0:
                rows, shares = jax.vmap(one)(xs)
                return rows, _sum_rows(shares)
            return _scan_chunks(one, xs, chunk, num_segments)

        if self.mesh is None:
            return mapped(shared, per_client)

        def on_device(shared, xs):
            rows, total = mapped(shared, xs)
            return rows, jax.lax.psum(total, CLIENT_AXIS)

        spec = PartitionSpec(CLIENT_AXIS)
        per_device = jax.shard_map(
            on_device,
            mesh=self.mesh,
            in_specs=(PartitionSpec(), spec),
            out_specs=(spec, PartitionSpec()),
            check_vma=False,
        )
        return per_device(shared, jax.lax.with_sharding_constraint(per_client, NamedSharding(self.mesh, spec)))

    def over_devices(self, f, shared, items):
        """``f(shared, items)``; on several devices each device runs ``f`` on its own contiguous
        block of ``items`` (``shard_map``: no cross-device step inside, so a device stops when its
        own items are done) with ``shared`` replicated. The item axis is a multiple of the
        device count."""
        if self.mesh is None:
            return f(shared, items)
        spec = PartitionSpec(CLIENT_AXIS)
        per_device = jax.shard_map(f, mesh=self.mesh, in_specs=(PartitionSpec(), spec), out_specs=spec, check_vma=False)
        return per_device(shared, jax.lax.with_sharding_constraint(items, NamedSharding(self.mesh, spec)))


def _sum_rows(shares):
    return jax.tree.map(lambda x: jnp.sum(x, axis=0), shares)


def _summed_dtype(dtype):
    """The dtype of a share of ``dtype`` summed over items, as :func:`_sum_rows` (all at once)
    sums it: ``jnp.sum`` widens bool and small integers (a bool flag sums to a count)."""
    return jax.eval_shape(_sum_rows, jax.ShapeDtypeStruct((1,), dtype)).dtype


def _add_one(total, share, num_segments: int | None = None):
    """One item's share added to the running total (to its segment's row, with ``num_segments``)."""
    if num_segments is None:
        return jax.tree.map(lambda t, s: t + s.astype(t.dtype), total, share)
    segment, share = share
    return jax.tree.map(lambda t, s: t.at[segment].add(s.astype(t.dtype)), total, share)


def _traced_once(f, example):
    """``(replay, out_shape)``: ``f`` traced once on ``example``'s shapes, and a function that
    replays that trace (the same pytrees in and out). The scan needs the shares' shapes before it
    traces its body: with ``jax.eval_shape`` a round traced a client's whole update twice."""
    closed, out_shape = jax.make_jaxpr(f, return_shape=True)(example)
    run, out_tree = jax.extend.core.jaxpr_as_fun(closed), jax.tree.structure(out_shape)
    return (lambda x: jax.tree.unflatten(out_tree, run(*jax.tree.leaves(x)))), out_shape


def _scan_chunks(one, xs, chunk: int, num_segments: int | None = None):
    """``(rows, total)`` of ``one`` over ``xs`` in chunks of ``chunk`` vmapped items (1: each item
    alone, doing only its own work), the shares summed into a carry as the chunks run (one at a
    time with ``num_segments``: per segment, see :func:`_add_one`)."""
    n = jax.tree.leaves(xs)[0].shape[0]
    one, (_, share_shape) = _traced_once(one, jax.tree.map(lambda x: x[0], xs))
    if num_segments is not None:
        share_shape = jax.tree.map(lambda s: jax.ShapeDtypeStruct((num_segments, *s.shape), s.dtype), share_shape[1])
    # the total in the dtype summing every share at once gives (chunk 0), whatever the chunk
    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, _summed_dtype(s.dtype)), share_shape)
    if chunk == 1:

        def alone(total, x):
            row, share = one(x)
            return _add_one(total, share, num_segments), row

        total, rows = jax.lax.scan(alone, zero, xs)
        return rows, total
    whole = n - n % chunk

    def chunked(total, x):
        rows, shares = jax.vmap(one)(x)
        return jax.tree.map(jnp.add, total, _sum_rows(shares)), rows

    parts, total = [], zero
    if whole:
        blocks = jax.tree.map(lambda x: x[:whole].reshape((whole // chunk, chunk) + x.shape[1:]), xs)
        total, rows = jax.lax.scan(chunked, zero, blocks)
        parts.append(jax.tree.map(lambda r: r.reshape((whole,) + r.shape[2:]), rows))
    if whole < n:
        rows, shares = jax.vmap(one)(jax.tree.map(lambda x: x[whole:], xs))
        total = jax.tree.map(jnp.add, total, _sum_rows(shares))
        parts.append(rows)
    rows = parts[0] if len(parts) == 1 else jax.tree.map(lambda *r: jnp.concatenate(r), *parts)
    return rows, total


def _members_as_clients(map_items, f, shared, per_client):
    """``map_items(f, shared, per_client)`` (one client at a time) that, under a ``vmap`` over
    members (a sweep's experiment axis), runs every member's clients one at a time as one client
    axis: the members' k-th clients side by side (on a mesh, a device's share then holds its own
    ranks of every member), each seeing its own member's ``shared`` values and whatever ``f``
    closes over, each share added to its member's total in the member's own order, so a member's
    numbers are those it computes alone.

    Unbatched (no ``vmap``, or ``member_chunk=1``) it is ``map_items`` itself."""
    first = jax.tree.map(lambda x: x[0], per_client)
    plain_f, consts = jax.closure_convert(f, shared, first)  # closed-over values become arguments

    @custom_vmap
    def over_clients(consts, shared, per_client):
        return map_items(lambda s, c: plain_f(s, c, *consts), shared, per_client)

    @over_clients.def_vmap
    def over_members_clients(num_members, batched, consts, shared, per_client):
        consts_batched, shared_batched, clients_batched = batched

        def member_view(tree, flags, member):
            return jax.tree.map(lambda x, b: x[member] if b else x, tree, flags)

        def one(inputs, item):
            consts, shared = inputs
            member, client = item
            row, share = plain_f(
                member_view(shared, shared_batched, member), client, *member_view(consts, consts_batched, member)
            )
            return row, (member, share)

        clients = jax.tree.map(
            lambda x, b: x if b else jnp.broadcast_to(x, (num_members, *x.shape)), per_client, clients_batched
        )
        n = jax.tree.leaves(clients)[0].shape[1]
        items = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape((n * num_members, *x.shape[2:])), clients)
        members = jnp.tile(jnp.arange(num_members), n)
        rows, totals = map_items(one, (consts, shared), (members, items), num_segments=num_members)
        rows = jax.tree.map(lambda r: jnp.swapaxes(r.reshape((n, num_members, *r.shape[1:])), 0, 1), rows)
        out = (rows, totals)
        return out, jax.tree.map(lambda _: True, out)

    return over_clients(consts, shared, per_client)
