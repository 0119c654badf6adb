"""The driver loop: compiled calls of rounds, evaluations, checkpoints, for one run or a sweep.

``run_simulation(sim, out_dir, LoopSettings(rounds=...))`` runs any
:class:`~jaxfed.simulation.Simulation`, including one research code built itself, into a run
directory (:mod:`jaxfed.runs.rundir`) with metrics, checkpoints, ``resume=True`` and plots.
``run(config, out_dir)`` is ``jaxfed run``: :func:`jaxfed.runs.build.build` then the same loop.
``jaxfed sweep`` runs its members through :func:`drive` too: the loop sees "members", one for a
run, S for a sweep, each with its own run directory.

A resume is refused, in one line and before anything is written, when the simulation differs from
the one that wrote the checkpoint (:mod:`jaxfed.runs.fingerprint`; ``jaxfed run`` compares its
config first) or its state is of another structure. ``on_evaluation(row)`` receives each
evaluated metrics row as it is appended to ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax

from jaxfed.algorithms import registry
from jaxfed.core import human_bytes, tree_bytes
from jaxfed.data import describe as describe_partition
from jaxfed.errors import (
    ConfigError,
    DeviceMemoryError,
    NonFiniteUpdateError,
    StorageFullError,
    first_line,
    is_device_out_of_memory,
    is_storage_full,
)
from jaxfed.runs import interrupts
from jaxfed.runs.build import build
from jaxfed.runs.config import Config
from jaxfed.runs.distributed import split_host, split_host_for, to_host
from jaxfed.runs.fingerprint import (
    check_same_simulation,
    describe,
    fingerprint,
    option_defaults,
    warn_changed_code,
)
from jaxfed.runs.rundir import (
    LoopSettings,
    RunDirectory,
    RunRecord,
    check_out_dir,
    check_resumable,
    check_rounds,
    headline,
    summary,
    warn_other_devices,
    written_config,
)
from jaxfed.simulation.engine import first_nonfinite


class Members(Protocol):
    """What the loop drives: S simulations stepped together (S = 1 for a run)."""

    num_members: int
    num_devices: int
    nonfinite: str

    def run_rounds(self, state, num_rounds: int) -> tuple[Any, list[dict]]: ...  # never raises on NaN

    def evaluate(self, state) -> list[dict]: ...

    def member(self, state, index: int): ...  # one member's SimState


class OneSimulation:
    """A :class:`~jaxfed.simulation.Simulation` as the loop's single member."""

    num_members = 1

    def __init__(self, sim):
        self.sim = sim
        self.num_devices, self.nonfinite = sim.num_devices, sim.nonfinite

    @property
    def compile_seconds(self) -> float:
        return self.sim.compile_seconds

    def run_rounds(self, state, num_rounds):
        state, metrics = self.sim.run_rounds(state, num_rounds, raise_nonfinite=False, donate=True)
        return state, [to_host(metrics)]

    def evaluate(self, state):
        return [self.sim.evaluate(state)]

    def member(self, state, index):
        return state


def next_multiple(done: int, every: int) -> int:
    return (done // every + 1) * every


def chunk_schedule(start: int, rounds: int, eval_every: int, rounds_per_call: int, checkpoint_every: int = 0):
    """``(length, evaluate, checkpoint)`` for each compiled call from round ``start`` to ``rounds``.

    A call never crosses an evaluation or checkpoint round (multiples of ``eval_every`` and
    ``checkpoint_every``, counted from round 0, and the last round), so a run resumed from a
    checkpoint makes the same calls as the run left alone.
    """
    done = start
    while done < rounds:
        end = min(rounds, done + rounds_per_call, next_multiple(done, eval_every))
        if checkpoint_every:
            end = min(end, next_multiple(done, checkpoint_every))
        yield (
            end - done,
            end % eval_every == 0 or end == rounds,
            bool(checkpoint_every) and (end % checkpoint_every == 0 or end == rounds),
        )
        done = end


def _failures(nonfinite: str, metrics: list[dict]) -> list:
    """Each member's ``(round within the call, client ids)`` of its first non-finite update under
    ``nonfinite=error`` (None for a member without one); all None under another policy."""
    if nonfinite != "error":
        return [None] * len(metrics)
    return [first_nonfinite(m) for m in metrics]


def drive(
    members: Members,
    state,
    dirs: list[RunDirectory],
    records: list[RunRecord],
    settings: LoopSettings,
    *,
    start: float,
    progress: bool = True,
    desc: str = "",
    on_evaluation: Callable[[dict], Any] | None = None,
) -> Any:
    """Run the rounds still to do; append evaluations to each member's ``metrics.jsonl`` (and
    pass a copy of each row to ``on_evaluation``, once the call's checkpoint is under way), save
    checkpoints. Returns the final (stacked) state.

    An ``on_evaluation`` that raises stops the loop with its exception once every checkpoint
    begun is complete: the run directory is as a run stopped there leaves it (``resume`` goes on
    from the newest checkpoint, and rewrites ``metrics.jsonl`` up to it).

    Under ``nonfinite=error`` a member whose client update is non-finite stops the loop after
    every member's last good state is checkpointed: :class:`NonFiniteUpdateError` names the round
    and clients, and its ``checkpoint`` attribute where that member's state is. A full disk
    during a checkpoint or metrics write raises :class:`StorageFullError` (one line; the newest
    complete checkpoint stays readable for ``--resume``).
    """
    from tqdm import tqdm

    def save_all(state):
        wall = time.perf_counter() - start
        for i, (directory, record) in enumerate(zip(dirs, records)):
            directory.save(members.member(state, i), record, wall, members.num_devices)

    def notify(rows):
        try:
            for row in rows:
                on_evaluation(json.loads(json.dumps(row)))  # a copy: the callback cannot change the record
        except BaseException:
            for directory in dirs:
                directory.checkpoints.wait()
            raise

    def evaluate_members(state, round_, which=None):
        """Append the evaluation after ``round_`` rounds of the members ``which`` (default: all)
        to their records and run directories; their rows."""
        rows, wall = [], time.perf_counter() - start
        for i, (directory, record, evaluation) in enumerate(zip(dirs, records, members.evaluate(state))):
            if which is None or which[i]:
                per_client = evaluation.pop("clients", None)
                rows.append(record.add_row(round_, evaluation, wall))
                directory.append_row(rows[-1])
                directory.write_clients(round_, per_client)
        return rows

    done = int(members.member(state, 0).round)
    bar = tqdm(
        total=settings.rounds,
        initial=min(done, settings.rounds),
        desc=desc,
        unit="round",
        disable=not progress,
        file=sys.stderr,
    )
    schedule = chunk_schedule(
        done, settings.rounds, settings.eval_every, settings.rounds_per_call, settings.checkpoint_every
    )

    def run_calls(state, done):
        unevaluated = [not r.rows or r.rows[-1]["round"] != done for r in records]
        if done >= settings.rounds and any(unevaluated):
            # a resume that stops at its checkpoint's round, which was not an evaluation round: the run
            # left alone with these rounds evaluates its last one
            rows = evaluate_members(state, done, unevaluated)
            if on_evaluation is not None:
                notify(rows)
        for call, (length, evaluate, checkpoint) in enumerate(schedule):
            interrupts.check()  # an interrupt Python dropped (docs: jaxfed.runs.interrupts)
            compiling = " (compiling first)" if call == 0 else ""
            bar.set_description(f"{desc}: rounds {done + 1}-{done + length}{compiling}")  # what runs now
            compile_before, tick = members.compile_seconds, time.perf_counter()
            state, metrics = members.run_rounds(state, length)
            seconds = (time.perf_counter() - tick - (members.compile_seconds - compile_before)) / length
            failures = _failures(members.nonfinite, metrics)
            for record, m, failed in zip(records, metrics, failures):  # the rounds each member's state did
                good = length if failed is None else failed[0]
                record.add_rounds(jax.tree.map(lambda a: a[:good], m), seconds)
            if any(f is not None for f in failures):
                if evaluate:  # the members that did the whole call stand at an evaluation round: log it first
                    evaluate_members(state, done + length, [f is None for f in failures])
                save_all(state)
                for directory in dirs:
                    directory.checkpoints.wait()
                i = next(i for i, f in enumerate(failures) if f is not None)
                first, ids = failures[i]
                good_metrics = jax.tree.map(lambda a: a[:first], metrics[i])
                err = NonFiniteUpdateError(done + first + 1, ids, members.member(state, i), good_metrics)
                err.checkpoint = dirs[i].checkpoints.directory / str(done + first)
                raise err
            done += length
            bar.update(length)
            rows = []
            if evaluate:
                rows = evaluate_members(state, done)
                name, value = headline(records[0].rows[-1])
                shown = "null" if value is None else f"{value:.3f}"
                bar.set_postfix({name: shown, "up": human_bytes(records[0].rows[-1]["bytes_up_total"])})
            if checkpoint:
                save_all(state)
            if on_evaluation is not None:
                notify(rows)
        for directory in dirs:
            directory.checkpoints.wait()
        return state

    try:
        return run_calls(state, done)
    except KeyboardInterrupt as err:
        err.intact = finish_checkpoints(dirs)
        raise
    except Exception as err:
        if is_device_out_of_memory(err):
            raise device_out_of_memory(dirs[0], err, _lighter_setting(members, state)) from None
        if not is_storage_full(err):
            raise
        raise storage_full(dirs[0], err) from None
    finally:
        bar.close()


def _intact(directory: RunDirectory) -> str:
    """What a run stopped by a failure keeps: its newest complete checkpoint, in words."""
    intact = directory.checkpoints.rounds()
    return f"the checkpoint of round {intact[-1]} is intact" if intact else "no checkpoint was completed"


def finish_checkpoints(dirs: list[RunDirectory]) -> str:
    """Complete the checkpoints begun in ``dirs`` (an interrupted run would otherwise lose one
    being written in the background); what the (first) run keeps, in words."""
    for directory in dirs:
        directory.checkpoints.wait()
    intact = _intact(dirs[0])
    return f"{intact} (--resume continues from it)" if dirs[0].checkpoints.rounds() else intact


def device_out_of_memory(directory: RunDirectory, err: BaseException, lighter: str | None) -> DeviceMemoryError:
    """The one-line error of a round or an evaluation that ran out of device memory, once the
    checkpoints begun are complete, with what needs less: ``lighter`` (a resumable setting,
    :func:`_lighter_setting`), where there is one, and a smaller ``client_chunk`` or
    ``eval_batch_size`` (a new run: a resume keeps them)."""
    directory.checkpoints.wait()
    smaller = "a smaller client_chunk or eval_batch_size"
    if not directory.checkpoints.rounds():
        advice = f"start it again with {lighter + ' or ' if lighter else ''}{smaller}"
    elif lighter:
        advice = f"continue with --resume --set {lighter}, or start anew with {smaller}"
    else:
        advice = f"start anew with {smaller} (a resume keeps them)"
    return DeviceMemoryError(f"out of device memory ({first_line(err, 160)}); {_intact(directory)}: {advice}")


def _lighter_setting(members: Members, state) -> str | None:
    """A resumable setting that needs less device memory, in words: for one simulation holding
    client states on the device, ``client_state=host``; for a sweep running members together,
    ``member_chunk=1``; else None."""
    sim = getattr(members, "sim", None)
    if sim is not None and sim.client_state == "device" and tree_bytes(state.clients):
        return "client_state=host (client states in host memory)"
    if getattr(members, "member_chunk", 1) != 1:
        return "member_chunk=1 (the members one after another)"
    return None


def storage_full(directory: RunDirectory, err: BaseException) -> StorageFullError:
    """The one-line error of a full disk, after closing the checkpointer (its background writes
    would otherwise print tracebacks at exit)."""
    try:
        directory.checkpoints.close()
    except Exception:  # the failed write again: already being reported
        pass
    return StorageFullError(
        f"no space left while writing {directory.path} ({first_line(err, 160)}); {_intact(directory)}: "
        f"free space, then continue with `jaxfed run --out {directory.path} --resume`"
    )


class ResumePoint(NamedTuple):
    """Where a resumed run goes on: its newest readable checkpoint's round and run record (read
    once, before anything is built)."""

    round: int
    record: dict


def resume_point(
    out_dir: str | Path, log=None, plugins=(), host_devices: int | None = None
) -> tuple[Config, ResumePoint]:
    """``(config, point)`` of the run in ``out_dir`` that ``--resume`` continues: the config of its
    newest readable checkpoint, with ``plugins`` (where given) instead of the recorded ones (a
    plugin file that moved). The host is split into ``host_devices`` (the resume's, where it sets
    them, else those of the run's ``config.json``) first, before reading the checkpoint starts
    JAX's backend."""
    log = log or _to_stderr
    check_out_dir(out_dir)
    if host_devices is None:
        host_devices = written_config(out_dir).get("host_devices")
    if host_devices:
        split_host(int(host_devices))
    point = ResumePoint(*RunDirectory(out_dir).newest_checkpoint_record(log))
    values = point.record["config"]
    if "data" in values:  # describe()'s key: a simulation built in research code, not from a config
        raise ConfigError(
            f"--resume: {out_dir} was written by jaxfed.run_simulation (a simulation built in Python, not from a "
            "config); resume it from Python: run_simulation(sim, out_dir, settings, resume=True)"
        )
    return Config.from_dict({**values, "plugins": list(plugins)} if plugins else values), point


def run(
    config: Config | dict,
    out_dir: str | Path,
    *,
    resume: bool | ResumePoint = False,
    progress: bool = True,
    log=None,
    on_evaluation: Callable[[dict], Any] | None = None,
) -> dict:
    """``jaxfed run``: build ``config`` (a :class:`Config`, or a dict of its keys:
    :meth:`Config.of`) and run it into ``out_dir`` (``resume``: continue it, from its newest
    readable checkpoint or the :class:`ResumePoint` given); return the summary.
    ``on_evaluation(row)`` receives each evaluated metrics row as ``metrics.jsonl`` gets it.
    ``progress`` is the progress bar alone: ``log(line)`` (default: stderr) still receives the
    partition's line and any warning, as ``jaxfed run --quiet`` prints them; pass
    ``log=lambda line: None`` for silence.

    Raises :class:`NonFiniteUpdateError` (``nonfinite=error``) after checkpointing the last good
    state; its ``checkpoint`` attribute says where.
    """
    log = log or _to_stderr
    config = Config.of(config).validate()
    split_host_for([config])  # the process entry for research code: before anything starts JAX's backend
    directory = RunDirectory(out_dir, config.keep_checkpoints)
    with directory.locked():  # refuse before anything is built or written; held until the run ends
        at_most = None
        if resume:
            point = resume if isinstance(resume, ResumePoint) else None
            if point is None or point.round != max(directory.checkpoints.rounds(), default=-1):
                point = ResumePoint(*directory.newest_checkpoint_record(log))  # read under the lock
            saved = Config.from_dict({**point.record["config"], "plugins": list(config.plugins)})
            check_resumable(saved, config)
            check_rounds(point.round, config.rounds)
            at_most = point.round
            finished = directory.finished_at(config.rounds)
            if finished is not None and point.round == config.rounds:
                log(f"{directory.path}: finished its {config.rounds} rounds already; left as it is")
                return finished
        else:
            directory.refuse_existing()
        built = build(config)
        current = fingerprint(built.simulation)
        if resume:  # the config is the checkpoint's: the data it reads, or a run_simulation directory, may not be
            check_same_simulation(
                point.record.get("fingerprint"),
                current,
                directory.path,
                field="--resume",
                defaults=option_defaults(built.simulation.algorithm.options),
            )  # no log: check_resumable compared the config already, its warnings would mislead
            warn_changed_code(point.record.get("fingerprint"), current, directory.path, log)
        log(f"partition: {describe_partition(built.partition_summary)}")
        for line in config.ignored_partition_keys():
            log(f"warning: {line}")
        job = Run(LoopSettings.of(config), config.recorded(), current, on_evaluation)
        return _run_in(directory, built.simulation, job, resume, at_most, progress, log, built.partition_summary)


def run_simulation(
    sim,
    out_dir: str | Path,
    settings: LoopSettings | int,
    *,
    config: dict | None = None,
    resume: bool = False,
    progress: bool = True,
    log=None,
    partition: Any = None,
    on_evaluation: Callable[[dict], Any] | None = None,
) -> dict:
    """Run ``sim`` into the run directory ``out_dir`` (or continue it from its newest checkpoint
    with ``resume``): metrics, checkpoints, summary, plots. Returns the summary.

    ``settings`` is a :class:`~jaxfed.runs.rundir.LoopSettings` (or just the number of rounds).
    ``config.json`` records what ``sim`` is (:func:`jaxfed.runs.fingerprint.describe`: the
    algorithm and its options, model, clients, participation, sampling, seed, data sizes) and the
    loop settings, with the keys of ``config`` (what research code wants recorded besides, e.g.
    ``{"dataset": "digits", "alpha": 0.1}``) added over them. ``resume`` refuses, in one line, a
    simulation that differs from the checkpoint's (:func:`~jaxfed.runs.fingerprint.check_same_simulation`)
    or whose state is of another structure. ``on_evaluation(row)`` receives each evaluated metrics
    row as ``metrics.jsonl`` gets it; ``partition`` is what ``summary.json`` records of the partition.
    """
    log = log or _to_stderr
    settings = LoopSettings(settings) if isinstance(settings, int) else settings
    current = fingerprint(sim)
    job = Run(settings, recorded_config(sim, settings, config), current, on_evaluation)
    directory = RunDirectory(out_dir, settings.keep_checkpoints)
    with directory.locked():
        at_most = None
        if resume:
            point = ResumePoint(*directory.newest_checkpoint_record(log))
            defaults = option_defaults(sim.algorithm.options)
            check_same_simulation(point.record.get("fingerprint"), current, directory.path, log, defaults=defaults)
            check_rounds(point.round, settings.rounds)
            at_most = point.round
        else:
            directory.refuse_existing()
        return _run_in(directory, sim, job, resume, at_most, progress, log, partition)


def recorded_config(sim, settings: LoopSettings, config: dict | None = None) -> dict:
    """``config.json`` of a simulation built in research code: what it is, the loop settings,
    then the caller's ``config`` keys (its ``options`` added to the algorithm's)."""
    recorded = {**describe(sim), **settings._asdict()}
    plugins = registry.plugins_to_record(sim.algorithm.name, ())
    if plugins:
        recorded["plugins"] = list(plugins)
    config = dict(config or {})
    if isinstance(config.get("options"), dict) and "options" in recorded:
        config["options"] = {**recorded["options"], **config["options"]}
    return {**recorded, **config}


class Run(NamedTuple):
    """What one run records beside its simulation: its loop settings, ``config.json``, the
    simulation's fingerprint, and who hears of each evaluation."""

    settings: LoopSettings
    config: dict
    fingerprint: dict
    on_evaluation: Callable[[dict], Any] | None = None


def _run_in(directory: RunDirectory, sim, job: Run, resume, at_most, progress, log, partition):
    """The loop of one run in its locked ``directory``: from the start, or (``resume``) from its
    newest readable checkpoint of a round ``<= at_most`` (where given)."""
    start = time.perf_counter()
    state = sim.init(warn=lambda message: log(f"warning: {message}"))
    if not resume:
        record = RunRecord(job.config, fingerprint=job.fingerprint)
    else:
        state, record = directory.restore(state, log, at_most=at_most)
        check_rounds(int(state.round), job.settings.rounds)
        warn_other_devices(record, sim.num_devices, log)
        record.config, record.fingerprint = job.config, job.fingerprint
    directory.start(job.config, record.rows)
    drive(
        OneSimulation(sim),
        state,
        [directory],
        [record],
        job.settings,
        start=start,
        progress=progress,
        desc=sim.algorithm.name,
        on_evaluation=job.on_evaluation,
    )
    result = summary(sim, record, time.perf_counter() - start, partition=partition)
    directory.finish(result, record.rows, log)
    return result


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)
