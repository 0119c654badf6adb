"""The run directory: what a run has logged, and the files that make it resumable and readable.

A run directory holds ``config.json``, ``metrics.jsonl`` (one row per evaluated round),
``clients/<round>.npz`` (each evaluated round's per-client arrays, in client-id order:
:func:`~jaxfed.runs.plots.read_clients`), ``summary.json``, ``accuracy.png`` (and
``global_accuracy.png``) and ``checkpoints/<round>``
(orbax: the whole simulation state plus the :class:`RunRecord`). :class:`RunDirectory` writes
them; ``--resume`` reads the newest readable checkpoint back. Any run writes one: a
:class:`~jaxfed.Config` run (``jaxfed run``) or a simulation that research code built itself
(:func:`jaxfed.runs.driver.run_simulation`), whose ``config.json`` then records what the
simulation is (:func:`jaxfed.runs.fingerprint.describe`) and the loop settings. Each checkpoint's
record holds the simulation's fingerprint (:mod:`jaxfed.runs.fingerprint`), which a resume compares.

A process writing a run directory holds an exclusive lock on ``DIR/.lock`` (``fcntl.flock``,
released when the process ends, however it ends): a second process on the same directory is
refused with one line, so two runs never interleave their files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from jaxfed.errors import ConfigError, StorageFullError, clip, is_storage_full
from jaxfed.runs.checkpoint import RunCheckpoints
from jaxfed.runs.config import Config
from jaxfed.runs.distributed import is_primary
from jaxfed.runs.fingerprint import model_name
from jaxfed.runs.keys import DEVICE_KEYS, NEUTRAL_KEYS, RESUMABLE_KEYS  # noqa: F401  (NEUTRAL_KEYS: re-exported)
from jaxfed.runs.plots import (  # noqa: F401  (read_clients: re-exported)
    CLIENTS_DIR,
    client_files,
    is_regression_row,
    read_clients,
    read_json,
    run_dirs_below,
)

NAME_MAX = 255  # bytes in one file name, on the file systems runs are written to
TIMING_KEYS = ("round_seconds", "wall_seconds")  # the only fields of a metrics row that vary between runs


class LoopSettings(NamedTuple):
    """How long a run goes and what it records: the driver loop's settings."""

    rounds: int
    eval_every: int = 5
    rounds_per_call: int = 5
    checkpoint_every: int = 10
    keep_checkpoints: int = 3

    @classmethod
    def of(cls, config: Config) -> LoopSettings:
        return cls(*(getattr(config, key) for key in cls._fields))


# (running total, per-round metric): the sums a run record carries through resume.
TOTALS = (
    ("bytes_up", "bytes_up"),
    ("bytes_down", "bytes_down"),
    ("bytes_down_cached", "bytes_down_cached"),
    ("nonfinite", "nonfinite_clients"),
)
TOTALLED_METRICS = frozenset(metric for _, metric in TOTALS)


class RunRecord:
    """Everything a run has logged so far, as JSON: stored in each checkpoint.

    ``pending`` holds the per-round metrics since the last evaluation (floats), ``rows`` the
    evaluated metrics rows, ``totals`` the running sums, ``round_times`` each round's seconds;
    ``config`` is the run's config as a dict (:meth:`Config.to_dict`, or what ``run_simulation``
    describes); ``fingerprint`` the simulation's (:func:`jaxfed.runs.fingerprint.fingerprint`;
    None: not recorded, as in records from before fingerprints).
    """

    def __init__(self, config: dict, record: dict | None = None, fingerprint: dict | None = None):
        record = record or {}
        self.config = config
        self.fingerprint = fingerprint if fingerprint is not None else record.get("fingerprint")
        self.rows: list[dict] = finite_or_none(record.get("rows", []))  # a record from before null for NaN
        self.pending: dict[str, list[float]] = record.get("pending", {})
        self.totals: dict[str, float] = record.get("totals", {total: 0.0 for total, _ in TOTALS})
        # A record from before bytes_down_cached: every download was counted whole then.
        self.totals.setdefault("bytes_down_cached", self.totals["bytes_down"])
        self.round_times: list[float] = record.get("round_times", [])
        self.wall_before = float(record.get("wall_seconds", 0.0))
        self.devices = record.get("devices")

    def add_rounds(self, metrics: dict, seconds_per_round: float) -> None:
        """Per-round metrics of one call (arrays with a leading round axis)."""
        count = len(metrics["bytes_up"])
        for key, values in metrics.items():
            if key == "nonfinite_ids":
                continue
            self.pending.setdefault(key, []).extend(float(v) for v in np.asarray(values).reshape(count))
        for total, key in TOTALS:
            self.totals[total] += float(np.sum(np.asarray(metrics[key], np.float64)))
        self.round_times += [seconds_per_round] * count

    def add_row(self, round_: int, evaluation: dict, wall: float) -> dict:
        window = len(self.pending.get("bytes_up", []))
        global_key = "global_mse" if is_regression_row(evaluation) else "global_acc"
        row = {"round": round_, **evaluation, global_key: evaluation.get(global_key)}
        for key, values in self.pending.items():
            if key not in TOTALLED_METRICS:
                used = [v for v in values if not np.isnan(v)]  # NaN: a round where no client's update was used
                row[key] = float(np.mean(used)) if used else None
        row.update(
            bytes_up_round=self.pending["bytes_up"][-1] if window else 0.0,
            bytes_down_round=self.pending["bytes_down"][-1] if window else 0.0,
            bytes_down_cached_round=self.pending.get("bytes_down_cached", [0.0])[-1] if window else 0.0,
            bytes_up_total=self.totals["bytes_up"],
            bytes_down_total=self.totals["bytes_down"],
            bytes_down_cached_total=self.totals["bytes_down_cached"],
            bytes_total=self.totals["bytes_up"] + self.totals["bytes_down"],
            bytes_total_cached=self.totals["bytes_up"] + self.totals["bytes_down_cached"],
            nonfinite_skipped=float(sum(self.pending.get("nonfinite_clients", []))),
            round_seconds=float(np.mean(self.round_times[-window:])) if window else None,
            wall_seconds=self.wall_before + wall,
        )
        row = finite_or_none(row)  # a diverging model's NaN loss, as metrics.jsonl will hold it
        self.rows.append(row)
        self.pending = {}
        return row

    def to_json(self, round_: int, wall: float, devices: int) -> dict:
        fingerprint = {} if self.fingerprint is None else {"fingerprint": self.fingerprint}
        return {
            "config": self.config,
            **fingerprint,
            "round": round_,
            "rows": self.rows,
            "pending": self.pending,
            "totals": self.totals,
            "round_times": self.round_times,
            "wall_seconds": self.wall_before + wall,
            "devices": devices,
        }


class RunDirectory:
    """The files of one run directory (see the module docstring)."""

    def __init__(self, path: str | Path, keep_checkpoints: int = 3):
        self.path = Path(path)
        self.checkpoints = RunCheckpoints(self.path / "checkpoints", keep=keep_checkpoints)

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def logged_rows(self) -> int:
        """Evaluation rows in ``metrics.jsonl`` (0 when there is none)."""
        if not self.metrics_path.exists():
            return 0
        with open(self.metrics_path, "rb") as f:
            return sum(1 for line in f if line.strip())

    def holds_run(self) -> bool:
        """Whether a run has left results here: a checkpoint or a logged evaluation. A directory
        whose run stopped before either (config.json alone) holds nothing to lose."""
        return bool(self.checkpoints.rounds()) or self.logged_rows() > 0

    def stopped_before_first_checkpoint(self) -> bool:
        """A run that checkpoints, stopped before its first checkpoint completed: what it logged
        is recomputed by starting it again."""
        return not self.checkpoints.rounds() and written_config(self.path).get("checkpoint_every", 0) > 0

    def finished(self) -> bool:
        """Whether a run ended here (its ``summary.json`` is written)."""
        return (self.path / "summary.json").exists()

    def finished_at(self, rounds: int) -> dict | None:
        """The summary of the run that ended here after ``rounds`` rounds; None when none did (a
        resume to those rounds has nothing to do: it leaves the directory as it is)."""
        if not self.finished():
            return None
        summary = read_json(self.path / "summary.json")
        return summary if summary.get("rounds") == rounds else None

    def refuse_existing(self) -> None:
        """A ConfigError if a run is here already (a new run must not overwrite it)."""
        if self.checkpoints.rounds():
            raise ConfigError(
                f"--out {self.path}: already holds a run; pass --resume (resume=True from Python) to continue it, "
                "or choose another --out"
            )
        below = run_dirs_below(self.path)
        if below:
            raise ConfigError(
                f"--out {self.path}: holds run directories ({listed(below)}: a sweep's?); "
                "choose another --out for a run"
            )
        if self.holds_run() and not self.stopped_before_first_checkpoint():
            raise ConfigError(
                f"--out {self.path}: holds the results of a run without checkpoints (checkpoint_every=0), "
                "which cannot be resumed; choose another --out, or delete it to start again"
            )
        if self.finished():
            raise ConfigError(
                f"--out {self.path}: holds a finished run (summary.json) whose checkpoints are gone, so it cannot "
                "be resumed; choose another --out, or delete it to start again"
            )

    @contextlib.contextmanager
    def locked(self):
        """Hold this directory's lock (creating the directory) for the ``with`` block: a
        ConfigError if another process holds it (or this one: a run locks its directory once).
        In a run across processes the primary alone locks: the others are part of its run."""
        if not is_primary():
            yield self
            return
        check_out_dir(self.path)
        empty = not self.path.is_dir() or not any(self.path.iterdir())
        fd = _acquire_lock(self.path)
        try:
            yield self
        finally:
            if empty and [p.name for p in self.path.iterdir()] == [LOCK_FILE]:
                (self.path / LOCK_FILE).unlink()  # a run that wrote nothing leaves no directory
                self.path.rmdir()
            os.close(fd)  # closing the descriptor releases the flock

    def newest_record(self, log=None):
        """``(round, record)`` of the newest checkpoint whose record reads, or None."""
        return self.checkpoints.newest(self.checkpoints.read_record, warn=log)

    def newest_checkpoint_record(self, log=None) -> tuple[int, dict]:
        """``(round, record)`` of the newest readable checkpoint; a ConfigError saying what to do
        when there is none."""
        found = self.newest_record(log)
        if found is not None:
            return found
        if not self.path.is_dir():
            raise ConfigError(f"--resume: {self.path} does not exist; start the run without --resume")
        members = run_dirs_below(self.path)
        if members and not self.checkpoints.rounds():
            raise ConfigError(
                f"--resume: {self.path} is a sweep's directory (it holds the run directories {listed(members)}); "
                f"continue the sweep with `jaxfed sweep ... --out {self.path} --resume` (its command plus --resume), "
                f"or one member with `jaxfed run --out {members[0]} --resume`"
            )
        if self.holds_run() and not self.stopped_before_first_checkpoint():
            again = "delete it or choose another --out to run again"
        elif self.finished():
            again = "it finished and its checkpoints are gone; delete it or choose another --out to run again"
        else:
            again = "start it again without --resume (it stopped before its first checkpoint)"
        raise ConfigError(f"--resume: no readable checkpoint in {self.checkpoints.directory}; {again}")

    def restore(self, like, log, at_most: int | None = None):
        """``(state, RunRecord)`` of the newest readable checkpoint (of a round ``<= at_most``,
        where given: the newest found readable under this run's lock, so every newer one is
        unreadable). The unreadable newer checkpoints are set aside. A checkpoint of another
        structure than ``like`` is a :class:`~jaxfed.runs.checkpoint.StateStructureError`, with
        every checkpoint left in place."""
        load = lambda r: self.checkpoints.restore(r, like=like)  # noqa: E731
        restored = self.checkpoints.newest(load, warn=log, at_most=at_most)
        if restored is None:
            self.newest_checkpoint_record(log)  # raises, saying what to do, when no record reads
            raise ConfigError(
                f"--resume: no checkpoint in {self.checkpoints.directory} restores into this simulation's state (see "
                "the warnings above): resume with the simulation that wrote it; if this is it, the checkpoints are "
                "damaged: delete the directory or choose another --out to run again"
            )
        round_, (state, saved) = restored
        for newer in [r for r in self.checkpoints.rounds() if r > round_] if is_primary() else []:
            log(f"moved the unreadable checkpoint to {self.checkpoints.set_aside(newer)}")
        log(f"resuming from round {round_} ({self.checkpoints.directory / str(round_)})")
        return state, RunRecord(saved["config"], saved)

    def start(self, config: dict, rows: list[dict]) -> None:
        """Create the directory, write ``config.json`` and ``metrics.jsonl`` (the rows so far).
        This and the other writes of files are the primary process's alone."""
        if not is_primary():
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / "config.json").write_text(json_text(config, indent=2) + "\n")
            write_rows(self.metrics_path, rows)
            self.drop_clients_after(rows[-1]["round"] if rows else -1)
            # a resumed run is unfinished until finish() writes its summary again: an earlier end's
            # summary.json beside the new config.json would pass for the result of rounds not done
            (self.path / "summary.json").unlink(missing_ok=True)
        except OSError as err:
            raise _unwritable(self.path, err) from None

    def append_row(self, row: dict) -> None:
        if not is_primary():
            return
        with open(self.metrics_path, "a") as f:
            f.write(json_text(row) + "\n")

    @property
    def clients_path(self) -> Path:
        return self.path / CLIENTS_DIR

    def write_clients(self, round_: int, arrays: dict | None) -> None:
        """``clients/<round>.npz``: the per-client arrays of the evaluation after ``round_`` rounds
        (written whole, then renamed: a reader never sees half a file)."""
        if not arrays or not is_primary():
            return
        self.clients_path.mkdir(exist_ok=True)
        tmp = self.clients_path / f"{round_}.tmp.npz"
        np.savez_compressed(tmp, **{k: np.asarray(v) for k, v in arrays.items()})
        tmp.replace(self.clients_path / f"{round_}.npz")

    def drop_clients_after(self, round_: int) -> None:
        """Remove the per-client files of rounds after ``round_`` (a resumed run evaluates them again)."""
        for round_file, path in client_files(self.path):
            if round_file > round_:
                path.unlink()
        for leftover in self.clients_path.glob("*.tmp.npz"):  # a write a killed run left half done
            leftover.unlink()

    def save(self, state, record: RunRecord, wall: float, devices: int) -> None:
        round_ = int(state.round)
        self.checkpoints.save(round_, state, record.to_json(round_, wall, devices))

    def finish(self, summary: dict, rows: list[dict], log) -> None:
        """Write ``summary.json`` and the plots."""
        if not is_primary():
            return
        (self.path / "summary.json").write_text(json_text(summary, indent=2) + "\n")
        write_plots(self.path, rows, log)


LOCK_FILE = ".lock"


def _acquire_lock(path: Path) -> int:
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise _unwritable(path, err) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK) and holder == str(os.getpid()):
            raise ConfigError(f"--out {path}: this process is writing this run directory already") from None
        if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise ConfigError(
                f"--out {path}: another jaxfed process (pid {holder}) is writing this run directory; "
                "wait for it to end or choose another --out"
            ) from None
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError as err:
        os.close(fd)
        raise _unwritable(path, err) from None
    return fd


def _unwritable(path: Path, err: OSError) -> Exception:
    """The one-line error of a run directory that cannot be written: a full disk (exit 1) or a
    user's mistake (exit 2)."""
    if is_storage_full(err):
        return StorageFullError(f"no space left to start {path} ({err.strerror}); free space and run again")
    return ConfigError(f"--out {clip(str(path))}: cannot be written ({err.strerror or err})")


def check_out_dir(path: str | Path) -> None:
    """A ConfigError, before any work, if ``path`` cannot become a run directory: a file, under a
    file, or under a directory this process cannot write."""
    path = Path(path)
    shown = clip(str(path))
    long = [part for part in path.parts if len(part.encode()) > NAME_MAX]
    if long:
        raise ConfigError(f"--out {shown}: a name in the path is {len(long[0].encode())} bytes; at most {NAME_MAX}")
    try:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--out {shown}: is a file, not a directory; choose another --out")
        parent = path
        while not parent.exists():
            parent = parent.parent
    except OSError as err:  # a path too long in all, a symlink loop
        raise ConfigError(f"--out {shown}: cannot be used ({err.strerror or err})") from None
    if not parent.is_dir():
        raise ConfigError(f"--out {shown}: {parent} is a file, so no directory can be made under it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {shown}: {parent} is not writable")


def new_run_dir(stem: str | Path) -> Path:
    """A fresh directory ``<stem>_<time>`` (``-2``, ``-3``, ... appended when another process made
    that name first): created here, so two runs started in the same second never share one."""
    check_out_dir(Path(stem).parent)
    base = f"{stem}_{time.strftime('%Y%m%d-%H%M%S')}"
    for attempt in range(1, 1000):
        path = Path(base if attempt == 1 else f"{base}-{attempt}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise ConfigError(f"--out: could not create a fresh directory named {base}-N; pass --out")


def listed(paths: list[Path], most: int = 3) -> str:
    """``"a, b, c and 2 more"``: the names of ``paths``, sorted, the first ``most`` of them."""
    names = sorted(p.name for p in paths)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_rounds(done: int, rounds: int) -> None:
    """A resumed run may go on or stop where it is, never end before the rounds it has done."""
    if rounds < done:
        raise ConfigError(
            f"rounds: {rounds} is fewer than the {done} rounds the checkpoint has done; resume with rounds >= {done}"
        )


def written_config(out_dir: str | Path) -> dict:
    """``config.json`` of a run directory as a dict ({} when missing or unreadable), read without JAX."""
    try:
        return json.loads((Path(out_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def warn_other_devices(record: RunRecord, num_devices: int, log, name: str = "") -> None:
    """A resume on another device count than its checkpoint's (``record.devices``) says it is one:
    its rounds match the run left alone to float tolerance, not bit for bit. ``name``: a sweep
    member's, before the line."""
    if record.devices is not None and record.devices != num_devices:
        log(
            f"warning: {name}{': ' if name else ''}checkpoint written on {record.devices} device(s), resuming on "
            f"{num_devices}: results match to float tolerance, not bit for bit"
        )


def check_resumable(saved: Config, config: Config, source: str = "the checkpoint's") -> None:
    """Refuse (ConfigError) a resume whose config changes what a round computes (``saved`` is
    ``source`` config, as the message names it)."""
    may_change = RESUMABLE_KEYS | DEVICE_KEYS
    changed = [
        f"{key} ({getattr(saved, key)!r} -> {getattr(config, key)!r})"
        for key in Config.run_keys()
        if key not in may_change and getattr(saved, key) != getattr(config, key)
    ]
    if saved.options != config.options:
        old, new = saved.options.to_dict(), config.options.to_dict()
        changed += [f"{key} ({old[key]!r} -> {new.get(key)!r})" for key in old if old[key] != new.get(key)]
    if changed:
        raise ConfigError(
            f"--resume: the config differs from {source} in "
            + ", ".join(changed)
            + f"; only {', '.join(sorted(may_change))} may change"
        )


def finite_or_none(value: Any) -> Any:
    """``value`` (dicts, lists, tuples of numbers and strings) with every float that is not finite
    (NaN, inf) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def json_text(value: Any, **dumps_options) -> str:
    """Standard JSON (RFC 8259, which has no NaN or Infinity) of what a run or a report writes:
    a number that is not finite, such as a diverging model's loss, is written ``null``, as a value
    that does not apply is. Every JSON reader (jq, JavaScript, pandas, Python) reads the files."""
    return json.dumps(finite_or_none(value), allow_nan=False, **dumps_options)


def write_rows(path: Path, rows: list[dict]) -> None:
    """Replace ``path`` atomically with ``rows`` as JSON lines."""
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json_text(row) + "\n" for row in rows))
    tmp.replace(path)


def write_plots(out: Path, rows: list[dict], log) -> None:
    """``accuracy.png`` (personalized) and, where there is a global model, ``global_accuracy.png``."""
    from jaxfed.runs.plots import plot_runs

    kind = "mse" if rows and is_regression_row(rows[0]) else "acc"
    plots = {"accuracy.png": f"personalized_{kind}_mean"}
    if any(r.get(f"global_{kind}") is not None for r in rows):
        plots["global_accuracy.png"] = f"global_{kind}"
    for name, metric in plots.items():
        try:
            plot_runs([out], out / name, metric)
        except Exception as err:  # a plot must never cost the run its results
            log(f"warning: could not draw {name}: {err}")


def headline(row: dict) -> tuple[str, float]:
    """The metric a run is judged by: personalized accuracy, or MSE for a regression task."""
    return ("mse", row["personalized_mse_mean"]) if is_regression_row(row) else ("acc", row["personalized_acc_mean"])


def task_summary(rows: list[dict]) -> dict:
    """Last and best personalized / global metrics: accuracy (best = max), or MSE (best = min)."""
    final = rows[-1]
    kind, pick = ("mse", min) if is_regression_row(final) else ("acc", max)

    def best(values):  # null or NaN (a diverged evaluation) is never the best, wherever it comes
        finite = [v for v in values if v is not None and math.isfinite(v)]
        return pick(finite) if finite else None

    global_values = [r[f"global_{kind}"] for r in rows if r.get(f"global_{kind}") is not None]
    return {
        "task": "regression" if kind == "mse" else "classification",
        **{f"personalized_{kind}_{s}": final[f"personalized_{kind}_{s}"] for s in ("mean", "weighted", "std")},
        f"global_{kind}": final.get(f"global_{kind}"),
        f"best_personalized_{kind}": best(r[f"personalized_{kind}_mean"] for r in rows),
        f"best_global_{kind}": best(global_values) if global_values else None,
        **{k: final[k] for k in (f"new_personalized_{kind}_mean", f"new_global_{kind}_mean") if k in final},
    }


def summary(sim, record: RunRecord, wall: float, *, partition: Any = None) -> dict:
    """``summary.json``: what ran, the final and best metrics, traffic, timing."""
    config, rows = record.config, record.rows
    final = rows[-1]
    return {
        "algorithm": config.get("algorithm", sim.algorithm.name),
        "dataset": config.get("dataset"),
        "model": model_name(sim.model),
        "num_clients": sim.num_clients,
        "clients_per_round": sim.num_sampled,
        "rounds": int(final["round"]),
        **task_summary(rows),
        "bytes_up_total": final["bytes_up_total"],
        "bytes_down_total": final["bytes_down_total"],
        "bytes_total": final["bytes_up_total"] + final["bytes_down_total"],
        "bytes_down_cached_total": final["bytes_down_cached_total"],
        "bytes_total_cached": final["bytes_up_total"] + final["bytes_down_cached_total"],
        "nonfinite_skipped_total": record.totals["nonfinite"],
        "round_seconds_median": float(np.median(record.round_times)),
        "compile_seconds": sim.compile_seconds,
        "wall_seconds": record.wall_before + wall,
        "devices": sim.num_devices,
        "partition": partition,
    }
