"""Vectorized sweeps: configurations that differ in ``seed`` and in algorithm options a round can
take as traced numbers (``lr``, ``mu``, ``lambda``, ...), run as one compiled program with an
experiment axis over the whole simulation (vmapped on accelerators; ``member_chunk`` picks, as
``client_chunk`` does for clients). A grid over keys that change shapes or Python control flow
(ranks, tiers, pack sizes, ``momentum``, run keys) runs as one such program per group of members
sharing those keys' values (:func:`shape_groups`), from one command.

``run_sweep(configs, out_dirs)`` runs one group; ``run_grid`` every group; ``jaxfed sweep`` calls
it. Each configuration gets its own run directory, written as ``jaxfed run`` writes it
(``config.json``, ``metrics.jsonl``, ``summary.json``, plots, ``checkpoints/``), so any member can
be plotted with the others or continued alone with ``jaxfed run --out DIR --resume``.
``run_grid(..., resume=True)`` (``jaxfed sweep ... --resume``) continues an interrupted sweep:
finished members are skipped, the others go on from their newest checkpoints (or from the start)
as compiled sweeps again, one per shape group and round (:func:`resume_point`,
:func:`resume_batches`), with the numbers of the sweep left alone. ``Sweep.of_simulation(sim,
seeds, values, algorithm)`` sweeps a :class:`~jaxfed.simulation.Simulation` research code built
itself (its algorithm built from the traced values); :func:`run_simulation_sweep` drives it into
one run directory per member, as ``run_simulation`` drives one simulation.

How the members are stacked: each configuration is built as ``jaxfed run`` would build it (its
seed partitions the data on the host); the per-client index tables are padded to a common width
(padding is masked and the shuffles do not depend on it, so a member computes what it would
alone) and only the data arrays that differ between members get the experiment axis. The root
key and the traced option values are arguments of the compiled program, so one program serves
every member of a group.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.algorithms import registry
from jaxfed.core import gather_clients, tree_bytes
from jaxfed.data import FederatedData
from jaxfed.errors import ConfigError
from jaxfed.options import field_types, key_of
from jaxfed.runs.build import build, build_algorithm, build_data, build_model, build_simulation, load_config_dataset
from jaxfed.runs.config import Config
from jaxfed.runs.distributed import split_host_for
from jaxfed.runs.driver import drive, recorded_config
from jaxfed.runs.fingerprint import (
    check_same_simulation,
    fingerprint,
    option_defaults,
    options_dict,
    seed_of,
    warn_changed_code,
)
from jaxfed.runs.plots import read_json, run_dirs_below, show
from jaxfed.runs.rundir import (
    LoopSettings,
    RunDirectory,
    RunRecord,
    check_resumable,
    check_rounds,
    summary,
    warn_other_devices,
    written_config,
)
from jaxfed.simulation.engine import host_metrics
from jaxfed.simulation.strategy import default_client_chunk


def sweep_configs(base: Config, seeds=(), lrs=(), grid: dict[str, list[str]] | None = None) -> list[Config]:
    """The grid ``seeds x lrs x grid`` over ``base`` (an empty list keeps ``base``'s value; ``grid``
    maps any key, run key or option, to its values as text), validated."""
    require_lr(base)
    seeds = list(seeds) or [base.seed]
    axes = {"lr": [repr(float(lr)) for lr in lrs]} if lrs else {}
    axes.update(grid or {})
    for option, values in (("--seeds", seeds), *((f"--grid {k}", v) for k, v in axes.items())):
        if len(set(values)) < len(values):
            raise ConfigError(f"{option}: values repeat in {list(values)}; each member needs its own directory")
    configs = []
    for seed in seeds:
        for combination in itertools.product(*axes.values()):
            pairs = [f"{key}={value}" for key, value in zip(axes, combination)]
            configs.append(dataclasses.replace(base.with_overrides(pairs), seed=seed).validate())
    return configs


def member_name(config: Config, keys=()) -> str:
    """A member's run directory name: ``seed<seed>_lr<lr>``, then ``_<key><value>`` for each
    other swept key."""
    values = {**config.options.to_dict(), **{k: getattr(config, k) for k in Config.run_keys()}}
    extra = "".join(f"_{key}{name_part(key, values[key])}" for key in keys if key not in ("seed", "lr"))
    return f"seed{config.seed}_lr{show(config.options.lr)}{extra}"


def name_part(key: str, value) -> str:
    """A swept value in a member's directory name: as plot labels show it (a model file by its
    file name, not its path), a path's separators as ``-``; an empty value empty."""
    return "" if value == "" else show(value, key).replace("/", "-").replace("\\", "-")


def differing_keys(configs: list[Config]) -> list[str]:
    """The run keys and option keys whose values differ between ``configs`` (``algorithm`` when the
    option classes do)."""
    first = configs[0]
    keys = {k for c in configs for k in Config.run_keys() if getattr(c, k) != getattr(first, k)}
    if any(type(c.options) is not type(first.options) for c in configs):
        return sorted(keys | {"algorithm"})
    firsts = first.options.to_dict()
    keys |= {k for c in configs for k, v in c.options.to_dict().items() if v != firsts[k]}
    return sorted(keys)


def traceable_keys(configs: list[Config]) -> list[str]:
    """The float options among ``configs``' differing keys that a round accepts as traced
    numbers: each but ``lr`` (traced in every sweep, tests/test_sweep.py checks every algorithm)
    is tried by tracing one round with it traced (a key used in Python control flow or for a
    shape, e.g. ``momentum`` (``momentum or None``), is not)."""
    traced = [
        k
        for k in differing_keys(configs)
        if k not in Config.run_keys() and isinstance(configs[0].options.to_dict().get(k), float)
    ]

    @functools.cache
    def traces(i: int, key: str) -> bool:  # one trace per member tried and key
        return _traces(configs[i], key)

    while True:  # tried in each shape group: e.g. server_momentum traces under server_optimizer none, not sgd
        firsts = [group[0] for group in shape_groups(configs, traced)]
        kept = [k for k in traced if k == "lr" or all(traces(i, k) for i in firsts)]  # every algorithm traces lr
        if kept == traced:
            return traced
        traced = kept


def _traces(config: Config, key: str) -> bool:
    template = build(config).simulation
    name = type(config.options).field_for(key).name

    def one_round(value):
        options = dataclasses.replace(config.options, **{name: value})
        algorithm = registry.get(config.algorithm).build(template.model, options, config)
        member = template.variant(jax.random.key(0), algorithm)
        return member.rounds_pure(member.init_pure(), template.data, 1)

    try:
        jax.eval_shape(one_round, jnp.float32(getattr(config.options, name)))
        return True
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError, TypeError):
        return False


def shape_groups(configs: list[Config], traced=()) -> list[list[int]]:
    """Indices of ``configs`` grouped so that a group differs only in ``seed`` and the ``traced``
    options (:func:`traceable_keys`): one compiled sweep each."""
    static = [k for k in differing_keys(configs) if k not in ("seed", *traced)]
    groups: dict[str, list[int]] = {}
    for i, config in enumerate(configs):
        values = {**config.options.to_dict(), **{k: getattr(config, k) for k in Config.run_keys()}}
        groups.setdefault(repr([values.get(k) for k in static]), []).append(i)
    return list(groups.values())


def check_sweepable(configs: list[Config], traced=()) -> None:
    """One-line ConfigError unless the configs differ only in ``seed``, ``lr`` and the ``traced`` options."""
    if not configs:
        raise ConfigError("sweep: no configurations (give --seeds, --lrs and/or --grid)")
    require_lr(configs[0])
    if configs[0].client_state == "host":
        raise ConfigError(
            "client_state: host is for single runs (jaxfed run); a sweep's members keep their client states on "
            "the device (client_state=device)"
        )
    allowed = dict.fromkeys(("seed", "lr", *traced))  # lr is traced in every sweep
    differ = [k for k in differing_keys(configs) if k not in allowed]
    if differ:
        shown = ", ".join(allowed)
        raise ConfigError(f"sweep: members of one compiled sweep may differ only in {shown}; they differ in {differ}")


def require_lr(config: Config) -> None:
    """What a sweep needs of an algorithm: a float option ``lr`` (every member's learning rate is
    traced, and names its directory), as :class:`jaxfed.options.TrainingOptions` has."""
    field = type(config.options).field_for("lr")
    if field is None or field_types(type(config.options))[field.name] is not float:
        raise ConfigError(
            f"sweep: algorithm {config.algorithm} has no float option lr, which a sweep traces and names its members "
            "by; give its options an `lr: float` (jaxfed.options.TrainingOptions has one), or use jaxfed run"
        )


def _member_data(configs: list[Config]) -> list:
    """Each member's :class:`~jaxfed.runs.build.DataPart` for the members of one compiled sweep
    (:func:`check_sweepable`: they differ only in seed and traced options, so a member's data
    depends on its seed alone): the dataset loaded once, each seed's partition built once."""
    loaded, parts = {}, {}

    def load(config: Config):
        key = (config.dataset, config.data_dir, config.download)
        if key not in loaded:
            loaded[key] = load_config_dataset(config)
        return loaded[key]

    for config in configs:
        if config.seed not in parts:
            parts[config.seed] = build_data(config, load)
    return [parts[config.seed] for config in configs]


def _pad_columns(table: np.ndarray, width: int) -> np.ndarray:
    return np.pad(table, ((0, 0), (0, width - table.shape[1])))


def stack_data(datas: list[FederatedData]) -> tuple[FederatedData, FederatedData]:
    """``(stacked, in_axes)``: the members' data with an experiment axis on the arrays that differ
    between them (index tables padded to a common width first) and none on the shared ones."""
    widths = {name: max(getattr(d, name).shape[1] for d in datas) for name in ("train_idx", "test_idx")}
    fields, axes = {}, {}
    statics = {f.name: getattr(datas[0], f.name) for f in dataclasses.fields(FederatedData) if _is_static(f)}
    for field in dataclasses.fields(FederatedData):
        if _is_static(field):
            continue
        values = [np.asarray(getattr(d, field.name)) for d in datas]
        if field.name in widths:
            values = [_pad_columns(v, widths[field.name]) for v in values]
        same = all(v.shape == values[0].shape and np.array_equal(v, values[0]) for v in values[1:])
        fields[field.name] = jnp.asarray(values[0]) if same else jnp.asarray(np.stack(values))
        axes[field.name] = None if same else 0
    return FederatedData(**fields, **statics), FederatedData(**axes, **statics)


def _is_static(field: dataclasses.Field) -> bool:
    """A field of a Flax struct that is metadata (``pytree_node=False``), not an array."""
    return not field.metadata.get("pytree_node", True)


class Sweep:
    """The members' simulations as one: ``init()``, ``run_rounds(states, n)`` and
    ``evaluate(states)`` act on states stacked along a leading experiment axis.

    ``Sweep(configs)`` builds the members from :class:`Config` s or dicts of run keys (registered
    datasets, algorithms and models: :meth:`Config.of`); :meth:`of_simulation` from a
    :class:`~jaxfed.simulation.Simulation` research code built itself. Either way a member is a
    template simulation with its own root key (its seed), its own traced option values (the
    algorithm built from them) and its own data where it has some (:func:`stack_data`):
    ``members`` lists each one's seed and values."""

    def __init__(self, configs: list[Config | dict], traced=None):
        traced = ["lr", *(k for k in (traced or ()) if k != "lr")]
        configs = [Config.of(c).validate() for c in configs]
        check_sweepable(configs, traced)
        self.configs = configs
        first = configs[0]
        self.parts = _member_data(configs)
        model = build_model(first, self.parts[0])
        template = build_simulation(first, build_algorithm(first, model), model, self.parts[0])
        names = [type(first.options).field_for(key).name for key in traced]

        def algorithm(**values):
            options = dataclasses.replace(first.options, **values)
            return registry.get(first.algorithm).build(model, options, first)

        members = [{"seed": c.seed, **{name: getattr(c.options, name) for name in names}} for c in configs]
        self._stack(template, [part.data for part in self.parts], members, algorithm, first.member_chunk)

    @classmethod
    def of_simulation(
        cls, sim, seeds=(0,), values: dict | None = None, algorithm=None, *, data: dict | None = None, member_chunk=-1
    ) -> Sweep:
        """A sweep whose members are ``sim`` (a :class:`~jaxfed.simulation.Simulation` built by
        hand: any algorithm, model and data) over ``seeds x`` every combination of ``values``
        (``{name: [numbers]}``), seed first, run as one compiled program.

        A member of seed ``s`` and values ``v`` computes what ``sim`` built with ``seed=s`` and
        the algorithm ``algorithm(**v)`` computes alone, on ``sim``'s data (or ``data[s]``:
        each seed's own :class:`~jaxfed.data.FederatedData`, of ``sim``'s clients and example
        arrays). ``algorithm`` is called once, with the values as traced float32 scalars: it
        may compute with them (learning rates, penalties, ...), not branch on them or make
        shapes of them (sweep such a value with one Sweep per value). Without ``values`` the
        members are ``sim``'s algorithm over ``seeds``. ``member_chunk`` as the run key (-1:
        one member after another on CPU, vmapped on accelerators)."""
        values = {name: list(given) for name, given in (values or {}).items()}
        check_simulation_sweep(sim, seeds, values, algorithm, data)
        values = {name: [float(v) for v in given] for name, given in values.items()}  # as config.json records
        members = [
            {"seed": int(seed), **dict(zip(values, combination))}
            for seed in seeds
            for combination in itertools.product(*values.values())
        ]
        template = sim.variant(sim.root, sim.algorithm)
        template.strategy = copy.copy(sim.strategy)  # the sweep sets how its members' clients run
        if template.strategy.fits_memory:  # the default's chunk, as before sim ran (fit to one member)
            template.strategy.chunk, template.strategy.sized = 0, False
        datas = [sim.data if data is None else data[m["seed"]] for m in members]
        sweep = cls.__new__(cls)
        sweep.configs, sweep.parts = [], []
        build = algorithm or (lambda: sim.algorithm)
        sweep._stack(template, datas, members, build, member_chunk)
        return sweep

    def _stack(self, template, datas: list[FederatedData], members: list[dict], algorithm, member_chunk: int):
        """The members (``{"seed": s, name: value, ...}`` each, the same names in each) of
        ``template`` as one program: ``algorithm(**values)`` builds a member's algorithm from
        its traced values."""
        self.template, self.members, self._algorithm = template, members, algorithm
        self.num_members, self.nonfinite = len(members), template.nonfinite
        self._member_datas = datas
        self.data, self.data_axes = stack_data(datas)
        self.seeds = jnp.asarray([m["seed"] for m in members], jnp.uint32)
        self.values = {  # option field -> [members]: the traced values
            name: jnp.asarray([m[name] for m in members], jnp.float32) for name in members[0] if name != "seed"
        }
        self.member_chunk = default_client_chunk(jax.devices()[0].platform) if member_chunk < 0 else member_chunk
        self.template.strategy.members_as_clients = self.member_chunk != 1  # vmapped members: one client axis
        narrow_vmapped_clients(self.template, self.member_chunk, len(members))
        self.compile_seconds = 0.0
        self._executables: dict[int, object] = {}
        self._init = jax.jit(
            self._over_members(lambda seed, values, state, data: self._member(seed, values).init_pure())
        )
        self._evaluate = jax.jit(
            self._over_members(lambda seed, values, state, data: self._member(seed, values).evaluate_pure(state, data))
        )

    def _over_members(self, member_fn):
        """``(seeds, values, states, data) -> outputs stacked over members`` of
        ``member_fn(seed, values, state, data)``: vmapped over the experiment axis (``member_chunk=0``)
        or ``lax.map`` over chunks of ``member_chunk`` vmapped members (1: one after another, in
        the same compiled program; the default on CPU, where batched matmuls gain nothing)."""
        chunk = self.member_chunk
        if chunk == 0:
            return jax.vmap(member_fn, in_axes=(0, 0, 0, self.data_axes))
        own_fields = [name for name, axis in vars(self.data_axes).items() if axis == 0]

        def mapped(seeds, values, states, data):
            def one(args):
                seed, member_values, state, own = args
                return member_fn(seed, member_values, state, data.replace(**own))

            own = {name: getattr(data, name) for name in own_fields}
            return jax.lax.map(one, (seeds, values, states, own), batch_size=chunk if chunk > 1 else None)

        return mapped

    def fingerprints(self) -> list[dict]:
        """Each member's :func:`~jaxfed.runs.fingerprint.fingerprint`: a config sweep's member's is
        what ``jaxfed run`` of its config computes (so ``jaxfed run --resume`` continues a member
        alone); a simulation sweep's member's holds its swept ``values``, and its options with
        them where they are options of the template's algorithm (unknown otherwise)."""
        prints, digests = [], {}
        for i, (member, data) in enumerate(zip(self.members, self._member_datas)):
            keys = {"seed": seed_of(jax.random.key(member["seed"]))}
            values = {key_of(name): value for name, value in member.items() if name != "seed"}
            if self.configs:
                keys["options"] = self.configs[i].options.to_dict()
            elif values:
                options = options_dict(getattr(self.template.algorithm, "options", None))
                # the member's values are its options where they name some, else its options are unknown
                known = options is not None and values.keys() <= options.keys()
                keys["options"] = {**options, **values} if known else None
                keys["values"] = values
            if id(data) not in digests:  # members of one seed share their data
                digests[id(data)] = fingerprint(self.template, data)
            prints.append({**digests[id(data)], **keys})
        return prints

    @property
    def num_devices(self) -> int:
        return self.template.num_devices

    def _member(self, seed, values):
        """The template simulation with this member's root key and traced option values."""
        return self.template.variant(jax.random.key(seed), self._algorithm(**values))

    @contextlib.contextmanager
    def _tracing(self):
        """The template's matmul precision, and a one-line ConfigError where the algorithm needs a
        swept value as a Python number (a shape, a loop count, an ``if``): JAX's error names the
        value (``...['lr']``); any other error passes as it is."""
        with self.template.precision():
            try:
                yield
            except jax.errors.ConcretizationTypeError as err:
                named = [name for name in self.values if f"['{name}']" in str(err)]
                if not named:
                    raise
                raise ConfigError(
                    f"values: the algorithm uses the swept {', '.join(named)} as a Python number (a shape, a loop "
                    "count or an if), so the members cannot be one program: run one program per value "
                    "(a Sweep.of_simulation each, or jaxfed run each)"
                ) from None

    def init(self, *, warn: Callable[[str], Any] | None = None):
        """Every member's starting state, stacked, placed as a run's (client states split over the
        mesh's devices where the clients divide over them; else ``warn(message)``, default
        :func:`warnings.warn`, hears of it)."""
        with self._tracing():
            states = self._init(self.seeds, self.values, None, self.data)
        held = tree_bytes(states.clients)  # every member's
        self.template.warn_unsplit_clients(held, warn or functools.partial(warnings.warn, stacklevel=3))
        return self.template.place(states, leading=1)

    def run_rounds(self, states, num_rounds: int):
        """``num_rounds`` rounds of every member in one compiled call: the stacked states and each
        member's metrics (arrays with a leading round axis)."""
        if num_rounds not in self._executables:
            start = time.perf_counter()
            with self._tracing():
                program = jax.jit(self.members_run(num_rounds))
                lowered = program.lower(self.seeds, self.values, _unplaced(states), self.data)
                self._executables[num_rounds] = lowered.compile()
            self.compile_seconds += time.perf_counter() - start
        executable = self._executables[num_rounds]
        states = jax.device_put(states, executable.input_shardings[0][2])  # where it was compiled for them
        states, metrics = executable(self.seeds, self.values, states, self.data)
        metrics = jax.device_get(metrics)
        return states, [jax.tree.map(lambda m, i=i: m[i], metrics) for i in range(self.num_members)]  # host rows

    def member(self, states, index: int):
        """Member ``index``'s :class:`~jaxfed.simulation.SimState`."""
        return gather_clients(states, index)

    def members_run(self, num_rounds: int):
        """``(seeds, values, states, data) -> (states, metrics)``: every member's ``num_rounds``
        rounds (not jitted)."""
        return self._over_members(
            lambda seed, values, state, data: self._member(seed, values).rounds_pure(state, data, num_rounds)
        )

    def evaluate(self, states) -> list[dict]:
        with self._tracing():
            metrics = jax.device_get(self._evaluate(self.seeds, self.values, states, self.data))
        return [host_metrics(jax.tree.map(lambda v, i=i: v[i], metrics)) for i in range(self.num_members)]


def run_grid(configs: list[Config | dict], root: str | Path, keys=(), *, progress: bool = True, log=None, resume=False):
    """Every member of ``configs`` into ``root/<member_name>``: one compiled sweep per
    :func:`shape_groups` group, one group after another. Returns ``(out_dirs, summaries)`` in the
    order of ``configs``. ``resume``: continue an interrupted sweep (:func:`resume_point` for
    each member, then one compiled sweep per :func:`resume_batches` batch); otherwise a member
    directory that holds a run already is refused before anything runs. ``configs``: Configs or
    dicts of run keys (:meth:`Config.of`)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    configs = [Config.of(c) for c in configs]
    split_host_for(configs)
    outs = [Path(root) / member_name(c, keys) for c in configs]
    if len(set(outs)) < len(outs):
        shared = next(out.name for i, out in enumerate(outs) if out in outs[:i])
        raise ConfigError(
            f"sweep: two members would share the run directory {shared}; give each swept key distinct values "
            "(model files: distinct file names)"
        )
    refuse_run_as_root(root)
    refuse_other_runs(root, outs, resume)
    for line in dict.fromkeys(line for config in configs for line in config.ignored_partition_keys()):
        log(f"warning: {line}")
    dirs = [RunDirectory(out, c.keep_checkpoints) for out, c in zip(outs, configs)]
    with contextlib.ExitStack() as locks:
        for directory in dirs:
            locks.enter_context(directory.locked())
        if resume:
            points = [resume_point(c, directory, log) for c, directory in zip(configs, dirs)]
        else:
            points = [refuse_taken(directory) for directory in dirs]
        summaries = [read_json(d.path / "summary.json") if p is None else None for d, p in zip(dirs, points)]
        traced = traceable_keys(configs) if any(p is not None for p in points) else []
        batches = resume_batches(shape_groups(configs, traced), points)
        for batch in batches:  # every group's refusal before any group runs
            check_sweepable([configs[i] for i in batch], traced)
        for number, batch in enumerate(batches, 1):
            if len(batches) > 1:
                since = f", from round {points[batch[0]]}" if points[batch[0]] else ""
                log(f"sweep group {number}/{len(batches)}: {len(batch)} member(s), one compiled program{since}")
            members, members_dirs = [configs[i] for i in batch], [dirs[i] for i in batch]
            results = _run_members(members, members_dirs, time.perf_counter(), progress, log, traced, resume)
            for i, result in zip(batch, results):
                summaries[i] = result
    return outs, summaries


def refuse_run_as_root(root: Path) -> None:
    """A ConfigError when ``root``, where a sweep writes its members, is itself a run directory:
    the members would sit inside that run (and ``jaxfed report`` could read neither)."""
    parent = RunDirectory(root)
    if parent.finished() or parent.holds_run():
        raise ConfigError(
            f"--out {root}: is a run directory (its own metrics, checkpoints or summary.json); "
            "choose another --out for a sweep"
        )


def refuse_other_runs(root: Path, outs: list[Path], resume: bool, resume_how: str = "") -> None:
    """A ConfigError for a resume of the sweep in ``root`` that names none of the members there
    (``outs`` are this sweep's): it would start a new sweep beside the one to continue. A resume
    may name some members only, or add new ones; a new sweep may sit beside another one (``jaxfed
    report`` tells them apart by the keys their ``config.json`` differ in). ``resume_how``: how
    to resume (default: the CLI's words)."""
    others = [p.name for p in run_dirs_below(root) if p not in outs]
    if not resume or not others or any(out.is_dir() for out in outs):
        return
    listed_others = f"{', '.join(others[:3])}{', ...' if len(others) > 3 else ''}"
    how = resume_how or (
        "resume with the command that started the sweep (its algorithm, --plugin, --seeds, --lrs, --grid and --set)"
    )
    raise ConfigError(
        f"--out {root}: none of this sweep's members ({outs[0].name}, ...) are there, it holds {listed_others}; {how}"
    )


def refuse_taken(directory: RunDirectory) -> int:
    """0 (the round a new member starts from); a ConfigError if a run has left results in
    ``directory``."""
    if directory.holds_run():
        raise ConfigError(
            f"--out {directory.path}: already holds a run; continue the sweep with --resume, or choose another --out"
        )
    return 0


def resume_point(config: Config, directory: RunDirectory, log) -> int | None:
    """Where a member of a resumed sweep goes on: None when it has finished ``config.rounds``
    (``summary.json`` says so), else the round of its newest readable checkpoint, or 0 when it
    never started or stopped before its first checkpoint. A one-line ConfigError when the
    member's saved config (its checkpoint's, else its ``config.json``) differs from ``config`` in
    a key a resume may not change, when it has done more rounds than ``config.rounds``, or when
    it holds results without a checkpoint to go on from."""
    done, saved = None, written_config(directory.path)
    if directory.checkpoints.rounds():
        done, record = directory.newest_checkpoint_record(log)
        saved = record["config"]
        check_rounds(done, config.rounds)
    if saved:
        check_resumable(Config.from_dict(saved), config, f"{directory.path}'s")
    if directory.finished_at(config.rounds) is not None:
        return None
    if done is not None:
        return done
    directory.refuse_existing()  # what a run without checkpoints left cannot be continued
    return 0


def resume_batches(groups: list[list[int]], points: list[int | None]) -> list[list[int]]:
    """The members still to run (``points[i]``, the round member ``i`` goes on from, not None),
    each shape group split by that round: one compiled sweep per batch."""
    batches = []
    for group in groups:
        by_round: dict[int, list[int]] = {}
        for i in group:
            if points[i] is not None:
                by_round.setdefault(points[i], []).append(i)
        batches += by_round.values()
    return batches


def run_sweep(
    configs: list[Config | dict], out_dirs: list[str | Path], *, progress: bool = True, log=None, traced=()
) -> list[dict]:
    """Run the members of a sweep together (:func:`jaxfed.runs.driver.drive`, the loop ``jaxfed run``
    uses); write one run directory each; return their summaries.

    A member whose client update is non-finite under ``nonfinite=error`` stops the sweep after every
    member's state is checkpointed (raises :class:`NonFiniteUpdateError` naming that member's
    directory); the sweep continues with ``run_grid(..., resume=True)`` (``jaxfed sweep ...
    --resume``), a member alone with ``jaxfed run --resume``.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    configs = [Config.of(c) for c in configs]
    split_host_for(configs)
    start = time.perf_counter()
    dirs = [RunDirectory(d, configs[0].keep_checkpoints) for d in out_dirs]
    with contextlib.ExitStack() as locks:
        for directory in dirs:
            locks.enter_context(directory.locked())
            refuse_taken(directory)
        return _run_members(configs, dirs, start, progress, log, traced)


def _run_members(configs, dirs, start, progress, log, traced, resume=False) -> list[dict]:
    sweep = Sweep(configs, traced)
    settings, partitions = LoopSettings.of(configs[0]), [part.partition_summary for part in sweep.parts]
    return _drive_members(
        sweep, [c.recorded() for c in configs], dirs, settings, start, progress, log, resume, partitions, "--resume"
    )


def _drive_members(
    sweep, configs: list[dict], dirs, settings, start, progress, log, resume, partitions, field: str = "resume"
) -> list[dict]:
    """Every member of ``sweep`` through :func:`~jaxfed.runs.driver.drive` into its locked run
    directory (``configs``: what each one's ``config.json`` records), from the start or
    (``resume``) from each one's newest checkpoint; each one's summary."""
    states, prints = sweep.init(warn=lambda message: log(f"warning: {message}")), sweep.fingerprints()
    if resume:
        states, records = restore_members(sweep, states, dirs, configs, prints, log, field)
    else:
        records = [RunRecord(c, fingerprint=p) for c, p in zip(configs, prints)]
    for c, directory, record in zip(configs, dirs, records):
        directory.start(c, record.rows)
    drive(sweep, states, dirs, records, settings, start=start, progress=progress, desc=f"sweep of {len(configs)}")
    summaries = []
    sweep.template.compile_seconds = sweep.compile_seconds
    for partition, record, directory in zip(partitions, records, dirs):
        result = summary(sweep.template, record, time.perf_counter() - start, partition=partition)
        result["sweep_members"] = len(configs)
        directory.finish(result, record.rows, log)
        summaries.append(result)
    return summaries


def restore_members(
    sweep: Sweep, states, dirs: list[RunDirectory], configs: list[dict], prints: list[dict], log, field: str = "resume"
):
    """``(states, records)``: each member's state and record from its newest readable checkpoint
    (a member without one keeps its initial state in ``states``; ``configs`` and ``prints``: what
    each records), stacked and placed as ``states`` is. A one-line ConfigError naming ``field``,
    before any checkpoint is read whole, if a checkpoint's fingerprint differs from its member's,
    or if the members come back at different rounds (one compiled sweep runs them together): a
    checkpoint whose record reads but whose state does not is set aside, so the same command run
    again plans from the round that reads."""
    defaults = option_defaults(sweep.template.algorithm.options)  # the members' algorithm is the template's
    checked = []
    for directory, current in zip(dirs, prints):  # every member checked before any checkpoint is touched
        if directory.checkpoints.rounds():
            _, record = directory.newest_checkpoint_record(log)
            saved = record.get("fingerprint")
            check_same_simulation(saved, current, directory.path, log, field, defaults, code_warning=False)
            checked.append((saved, current))
    if checked:  # the members run one program's code: one warning for the sweep
        warn_changed_code(*checked[0], dirs[0].path.parent, log)
    members, records = [], []
    for i, (config, directory, current) in enumerate(zip(configs, dirs, prints)):
        state, record = sweep.member(states, i), RunRecord(config, fingerprint=current)
        if directory.checkpoints.rounds():
            state, record = directory.restore(state, log)
            warn_other_devices(record, sweep.num_devices, log, name=directory.path.name)
            record.config, record.fingerprint = config, current
        members.append(state)
        records.append(record)
    rounds = [int(member.round) for member in members]
    if len(set(rounds)) > 1:
        shown = ", ".join(f"{d.path.name} {r}" for d, r in zip(dirs, rounds))
        raise ConfigError(
            f"sweep: members at different rounds ({shown}) cannot run as one compiled sweep: a member new to "
            "the grid starts at round 0 (run new members as a sweep into another out), or an unreadable checkpoint "
            "was set aside (run the same command again to go on from the rounds that read)"
        )

    def placed(like, *xs):
        # where a fresh sweep's states are (Sweep.init); committed to the one device they were read
        # onto, they would clash with a mesh of several
        stacked = jnp.stack(xs)
        return jax.device_put(stacked, like.sharding) if like.committed else jnp.asarray(jax.device_get(stacked))

    return jax.tree.map(placed, states, *members), records


def _unplaced(tree):
    """``tree``'s shapes and dtypes alone: a sweep's program is lowered from them, wherever
    :meth:`Sweep.init` or a restore placed the states (placed, vmapped members' programs fail to
    trace), and chooses where it takes them (:meth:`Sweep.run_rounds` puts them there)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type), tree)


def narrow_vmapped_clients(template, member_chunk: int, num_members: int) -> None:
    """Where vmapped members would each start from all their sampled clients at once (the
    accelerators' default before a single run fits the chunk to its client sizes, which a sweep
    does not), the members' clients side by side are one vmapped group whose local-step loop runs
    as long as the largest of them: W1, 8 members, 32% of the steps useful against 38% for a
    member alone (``benchmarks/sweep_rounds.py``). Then each member runs chunks of its share of
    one member's width instead (largest clients first, so the members' chunks side by side hold
    clients of similar sizes; W1: 73% useful). A chunk that was given stays."""
    strategy = template.strategy
    if member_chunk != 1 and strategy.fits_memory and strategy.chunk == 0:
        side_by_side = num_members if member_chunk == 0 else min(member_chunk, num_members)
        strategy.chunk = max(1, -(-template.num_sampled // side_by_side))


def check_simulation_sweep(sim, seeds, values: dict, algorithm, data) -> None:
    """One-line ConfigErrors for :meth:`Sweep.of_simulation`'s arguments."""
    if sim.client_state == "host":
        raise ConfigError(
            "client_state: host is for single runs; a sweep's members keep their client states on the device "
            "(build the simulation with client_state='device')"
        )
    seeds = list(seeds)
    if not seeds or any(
        isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < 2**32 for s in seeds
    ):
        raise ConfigError(f"seeds: expected one or more ints in [0, 2**32), got {seeds}")
    for name, given in (("seeds", seeds), *((f"values[{k!r}]", list(v)) for k, v in values.items())):
        if len(set(given)) < len(given):
            raise ConfigError(f"{name}: values repeat in {given}; each member needs its own run directory")
    for name, given in values.items():
        if name == "seed" or not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"values: {name!r} is not a keyword the algorithm can take (nor 'seed': give seeds=)")
        if not given or any(isinstance(v, bool) or not isinstance(v, (int, float, np.number)) for v in given):
            raise ConfigError(f"values[{name!r}]: expected one or more numbers (traced as float32), got {given}")
    if values and algorithm is None:
        raise ConfigError(
            f"algorithm: values {sorted(values)} are swept, so give algorithm=, a function of them that builds the "
            "FederatedAlgorithm (e.g. lambda lr: fedavg(model, lr=lr))"
        )
    if data is not None:
        missing = [seed for seed in seeds if seed not in data]
        if missing:
            raise ConfigError(f"data: no FederatedData for seed(s) {missing}; give one per seed, or none")
        for seed in seeds:
            shapes = {f: np.shape(getattr(data[seed], f)) for f in ("x_train", "y_train", "x_test", "y_test")}
            expected = {f: np.shape(getattr(sim.data, f)) for f in shapes}
            if data[seed].num_clients != sim.num_clients or shapes != expected:
                raise ConfigError(
                    f"data[{seed}]: {data[seed].num_clients} clients and examples {shapes}; every member's data holds "
                    f"the simulation's {sim.num_clients} clients and examples {expected}"
                )


def simulation_member_name(member: dict) -> str:
    """A :meth:`Sweep.of_simulation` member's run directory name: ``seed<seed>``, then
    ``_<name><value>`` for each swept value (as :func:`member_name` writes a config sweep's)."""
    values = (f"_{name}{name_part(name, v)}" for name, v in member.items() if name != "seed")
    return f"seed{member['seed']}" + "".join(values)


def run_simulation_sweep(
    sweep: Sweep,
    out: str | Path,
    settings: LoopSettings | int,
    *,
    config: dict | None = None,
    resume: bool = False,
    progress: bool = True,
    log=None,
) -> tuple[list[Path], list[dict]]:
    """Run a :meth:`Sweep.of_simulation` into one run directory per member,
    ``out/<simulation_member_name>``, as :func:`~jaxfed.runs.driver.run_simulation` runs one
    simulation (metrics, checkpoints, summary, plots; ``resume``: every member from its newest
    checkpoint). Each member's ``config.json`` is what ``run_simulation`` records of the
    template simulation (:func:`~jaxfed.runs.driver.recorded_config`: the algorithm and its
    options, model, clients, data, loop settings, and ``config``'s keys) with the member's
    ``seed`` and its values under ``options``, so ``jaxfed report out`` makes one variant per
    combination of values and tells two sweeps of other fixed settings apart. Returns
    ``(out_dirs, summaries)``."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    settings = LoopSettings(settings) if isinstance(settings, int) else settings
    start = time.perf_counter()
    base = recorded_config(sweep.template, settings, config)
    configs = [
        {
            **base,
            "seed": m["seed"],
            "options": {**base.get("options", {}), **{k: v for k, v in m.items() if k != "seed"}},
        }
        for m in sweep.members
    ]
    outs = [Path(out) / simulation_member_name(m) for m in sweep.members]
    refuse_run_as_root(Path(out))
    refuse_other_runs(Path(out), outs, resume, "resume with the sweep that wrote them (its seeds and values)")
    dirs = [RunDirectory(path, settings.keep_checkpoints) for path in outs]
    with contextlib.ExitStack() as locks:
        for directory in dirs:
            locks.enter_context(directory.locked())
            if not resume:
                refuse_taken(directory)
            elif not directory.checkpoints.rounds():
                directory.refuse_existing()  # results without a checkpoint cannot be continued
        partitions = [None] * sweep.num_members
        return outs, _drive_members(sweep, configs, dirs, settings, start, progress, log, resume, partitions)
