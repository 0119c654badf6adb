"""Vectorized sweeps: S configurations that differ only in ``seed`` and/or ``lr``, run as one
compiled program with an experiment axis over the whole simulation (vmapped on accelerators;
``member_chunk`` picks, as ``client_chunk`` does for clients).

``run_sweep(configs, out_dirs)`` is what ``jaxfed sweep`` calls. Each configuration gets its own
run directory, written as ``jaxfed run`` writes it (``config.json``, ``metrics.jsonl``,
``summary.json``, plots, ``checkpoints/``), so any member can be plotted with the others or
continued alone with ``jaxfed run --out DIR --resume``.

How the members are stacked: each configuration is built as ``jaxfed run`` would build it (its
seed partitions the data on the host); the per-client index tables are padded to a common width
(padding is masked and the shuffles do not depend on it, so a member computes what it would
alone) and only the data arrays that differ between members get the experiment axis. The root
key and the client learning rate are traced, so one compiled program serves every member.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.algorithms import registry
from jaxfed.build import build
from jaxfed.config import Config
from jaxfed.core import gather_clients
from jaxfed.data import FederatedData
from jaxfed.driver import drive
from jaxfed.errors import ConfigError
from jaxfed.rundir import LoopSettings, RunDirectory, RunRecord, summary
from jaxfed.simulation.engine import default_client_chunk

SWEEP_KEYS = ("seed", "lr")  # what may differ between the members of a sweep


def sweep_configs(base: Config, seeds=(), lrs=()) -> list[Config]:
    """The grid ``seeds x lrs`` over ``base`` (an empty list keeps ``base``'s value), validated."""
    seeds = list(seeds) or [base.seed]
    lrs = list(lrs) or [base.options.lr]
    for option, values in (("--seeds", seeds), ("--lrs", lrs)):
        if len(set(values)) < len(values):
            raise ConfigError(f"{option}: values repeat in {values}; each member needs its own directory")
    return [
        dataclasses.replace(base, seed=s, options=dataclasses.replace(base.options, lr=lr)).validate()
        for s, lr in itertools.product(seeds, lrs)
    ]


def member_name(config: Config) -> str:
    """A member's run directory name: ``seed<seed>_lr<lr>``."""
    return f"seed{config.seed}_lr{config.options.lr:g}"


def check_sweepable(configs: list[Config]) -> None:
    """One-line ConfigError unless the configs differ only in :data:`SWEEP_KEYS`."""
    if not configs:
        raise ConfigError("sweep: no configurations (give --seeds and/or --lrs)")
    first = configs[0]
    for config in configs[1:]:
        differ = [k for k in Config.run_keys() if k not in SWEEP_KEYS and getattr(config, k) != getattr(first, k)]
        if type(config.options) is not type(first.options):
            differ.append("algorithm")
        else:
            mine, theirs = config.options.to_dict(), first.options.to_dict()
            differ += [k for k in mine if k not in SWEEP_KEYS and mine[k] != theirs[k]]
        if differ:
            raise ConfigError(f"sweep: members may differ only in {', '.join(SWEEP_KEYS)}; they differ in {differ}")


def _pad_columns(table: np.ndarray, width: int) -> np.ndarray:
    return np.pad(table, ((0, 0), (0, width - table.shape[1])))


def stack_data(datas: list[FederatedData]) -> tuple[FederatedData, FederatedData]:
    """``(stacked, in_axes)``: the members' data with an experiment axis on the arrays that differ
    between them (index tables padded to a common width first) and none on the shared ones."""
    widths = {name: max(getattr(d, name).shape[1] for d in datas) for name in ("train_idx", "test_idx")}
    fields, axes = {}, {}
    for field in dataclasses.fields(FederatedData):
        if field.name == "num_classes":
            continue
        values = [np.asarray(getattr(d, field.name)) for d in datas]
        if field.name in widths:
            values = [_pad_columns(v, widths[field.name]) for v in values]
        same = all(v.shape == values[0].shape and np.array_equal(v, values[0]) for v in values[1:])
        fields[field.name] = jnp.asarray(values[0]) if same else jnp.asarray(np.stack(values))
        axes[field.name] = None if same else 0
    num_classes = datas[0].num_classes
    return FederatedData(**fields, num_classes=num_classes), FederatedData(**axes, num_classes=num_classes)


class Sweep:
    """The members' simulations as one: ``init()``, ``run_rounds(states, n)`` and
    ``evaluate(states)`` act on states stacked along a leading experiment axis."""

    def __init__(self, configs: list[Config]):
        check_sweepable(configs)
        self.configs = configs
        self.built = [build(c) for c in configs]
        self.template = self.built[0].simulation
        self.num_members, self.nonfinite = len(configs), self.template.nonfinite
        self.data, self.data_axes = stack_data([b.simulation.data for b in self.built])
        self.seeds = jnp.asarray([c.seed for c in configs], jnp.uint32)
        self.lrs = jnp.asarray([c.options.lr for c in configs], jnp.float32)
        chunk = configs[0].member_chunk
        self.member_chunk = default_client_chunk(jax.devices()[0].platform) if chunk < 0 else chunk
        self.compile_seconds = 0.0
        self._executables: dict[int, object] = {}
        self._init = jax.jit(self._over_members(lambda seed, lr, state, data: self._member(seed, lr).init_pure()))
        self._evaluate = jax.jit(
            self._over_members(lambda seed, lr, state, data: self._member(seed, lr).evaluate_pure(state, data))
        )

    def _over_members(self, member_fn):
        """``(seeds, lrs, states, data) -> outputs stacked over members`` of
        ``member_fn(seed, lr, state, data)``: vmapped over the experiment axis (``member_chunk=0``)
        or ``lax.map`` over chunks of ``member_chunk`` vmapped members (1: one after another, in
        the same compiled program; the default on CPU, where batched matmuls gain nothing)."""
        chunk = self.member_chunk
        if chunk == 0:
            return jax.vmap(member_fn, in_axes=(0, 0, 0, self.data_axes))
        own_fields = [name for name, axis in vars(self.data_axes).items() if axis == 0]

        def mapped(seeds, lrs, states, data):
            def one(args):
                seed, lr, state, own = args
                return member_fn(seed, lr, state, data.replace(**own))

            own = {name: getattr(data, name) for name in own_fields}
            return jax.lax.map(one, (seeds, lrs, states, own), batch_size=chunk if chunk > 1 else None)

        return mapped

    @property
    def num_devices(self) -> int:
        return self.template.num_devices

    def _member(self, seed, lr):
        """The template simulation with this member's root key and client learning rate (traced)."""
        config = self.configs[0]
        options = dataclasses.replace(config.options, lr=lr)
        algorithm = registry.get(config.algorithm).build(self.template.model, options, config)
        return self.template.variant(jax.random.key(seed), algorithm)

    def init(self):
        return self._init(self.seeds, self.lrs, None, self.data)

    def run_rounds(self, states, num_rounds: int):
        """``num_rounds`` rounds of every member in one compiled call: the stacked states and each
        member's metrics (arrays with a leading round axis)."""
        if num_rounds not in self._executables:
            start = time.perf_counter()
            lowered = jax.jit(self.members_run(num_rounds)).lower(self.seeds, self.lrs, states, self.data)
            self._executables[num_rounds] = lowered.compile()
            self.compile_seconds += time.perf_counter() - start
        states, metrics = self._executables[num_rounds](self.seeds, self.lrs, states, self.data)
        metrics = jax.device_get(metrics)
        return states, [jax.tree.map(lambda m, i=i: m[i], metrics) for i in range(self.num_members)]  # host rows

    def member(self, states, index: int):
        """Member ``index``'s :class:`~jaxfed.simulation.SimState`."""
        return gather_clients(states, index)

    def members_run(self, num_rounds: int):
        """``(seeds, lrs, states, data) -> (states, metrics)``: every member's ``num_rounds`` rounds
        (not jitted)."""
        return self._over_members(
            lambda seed, lr, state, data: self._member(seed, lr).rounds_pure(state, data, num_rounds)
        )

    def evaluate(self, states) -> list[dict]:
        metrics = jax.device_get(self._evaluate(self.seeds, self.lrs, states, self.data))
        return [{k: float(v[i]) for k, v in metrics.items()} for i in range(len(self.configs))]


def run_sweep(configs: list[Config], out_dirs: list[str | Path], *, progress: bool = True, log=None) -> list[dict]:
    """Run the members of a sweep together (:func:`jaxfed.driver.drive`, the loop ``jaxfed run``
    uses); write one run directory each; return their summaries.

    A member whose client update is non-finite under ``nonfinite=error`` stops the sweep after every
    member's state is checkpointed (raises :class:`NonFiniteUpdateError` naming that member's
    directory); the others can be continued with ``jaxfed run --resume``.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    start = time.perf_counter()
    config = configs[0]
    dirs = [RunDirectory(d, config.keep_checkpoints) for d in out_dirs]
    with contextlib.ExitStack() as locks:
        for directory in dirs:
            locks.enter_context(directory.locked())
            if directory.holds_run():
                raise ConfigError(f"--out {directory.path}: already holds a run; choose another --out")
        return _run_members(configs, dirs, start, progress, log)


def _run_members(configs, dirs, start, progress, log) -> list[dict]:
    config = configs[0]
    sweep = Sweep(configs)
    records = [RunRecord(c.to_dict()) for c in configs]
    for c, directory in zip(configs, dirs):
        directory.start(c.to_dict(), [])
    drive(
        sweep,
        sweep.init(),
        dirs,
        records,
        LoopSettings.of(config),
        start=start,
        progress=progress,
        desc=f"sweep of {len(configs)}",
    )
    summaries = []
    for built, record, directory in zip(sweep.built, records, dirs):
        built.simulation.compile_seconds = sweep.compile_seconds
        result = summary(built.simulation, record, time.perf_counter() - start, partition=built.partition_summary)
        result["sweep_members"] = len(configs)
        directory.finish(result, record.rows, log)
        summaries.append(result)
    return summaries
