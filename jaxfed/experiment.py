"""Build a simulation from a :class:`Config`, run it, and write the run directory.

``run(config, out_dir)`` is what ``jaxfed run`` calls. The run directory holds ``config.json``,
``metrics.jsonl`` (one row per evaluated round), ``summary.json``, ``accuracy.png`` and
``checkpoints/<round>`` (orbax; every ``checkpoint_every`` rounds and at the end). With
``resume=True`` the run continues from the newest readable checkpoint, bit for bit as if it had
never stopped; ``metrics.jsonl`` is rewritten from the checkpoint's rows, so it never holds a
partial line or a round twice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from jaxfed.algorithms import ALGORITHMS
from jaxfed.config import Config
from jaxfed.data import (
    SYNTHETIC_TASKS,
    apply_cluster_task,
    auto_samples_per_client,
    default_model,
    describe,
    federate,
    load_dataset,
    partition,
    reduce_parts,
    summarize,
    synthetic_task,
)
from jaxfed.data.synthetic import DEFAULT_OUTPUTS
from jaxfed.errors import ConfigError, NonFiniteUpdateError
from jaxfed.nn import get_model
from jaxfed.simulation import Simulation
from jaxfed.simulation.checkpoint import RunCheckpoints

# Keys a resumed run may change: they decide how long it runs, what it logs, where it reads data
# from and what happens on a NaN, never the numbers a round computes (rounds run bit-identically
# whatever the chunking of rounds into compiled calls).
RESUMABLE_KEYS = frozenset(
    {
        "rounds",
        "eval_every",
        "rounds_per_call",
        "member_chunk",
        "checkpoint_every",
        "keep_checkpoints",
        "nonfinite",
        "data_dir",
        "download",
    }
)
TIMING_KEYS = ("round_seconds", "wall_seconds")  # the only fields of a metrics row that vary between runs


class Built(NamedTuple):
    config: Config
    simulation: Simulation
    partition_summary: dict


def build(config: Config) -> Built:
    """Dataset, partition, model, algorithm and engine for ``config`` (validated)."""
    config.validate()
    if config.host_devices:
        split_host(config.host_devices)
    pooled_eval_model = None
    if config.dataset in SYNTHETIC_TASKS:
        dataset, model, train_parts, test_parts = _synthetic_task(config)
    else:
        dataset, model, train_parts, test_parts = _image_task(config)
        if config.conv != "xla":  # the global model's passes over the whole test set: XLA's conv is faster there
            pooled_eval_model = _model(
                dataclasses.replace(config, conv="xla"), dataset.input_shape, dataset.num_classes
            )
    algorithm = ALGORITHMS[config.algorithm](config, model)
    available = jax.devices()
    if config.devices > len(available):
        raise ConfigError(f"devices: {config.devices} requested but {len(available)} visible")
    devices = available[: config.devices or None]
    simulation = Simulation(
        algorithm,
        model,
        federate(dataset, train_parts, test_parts),
        participation=config.participation,
        sampling_mode=config.sampling,
        seed=config.seed,
        devices=devices,
        eval_batch_size=config.eval_batch_size,
        client_chunk=None if config.client_chunk < 0 else config.client_chunk,
        pooled_eval_model=pooled_eval_model,
        nonfinite=config.nonfinite,
    )
    return Built(config, simulation, summarize(train_parts, dataset.y_train))


def split_host(count: int) -> None:
    """Make the CPU show ``count`` JAX devices (``host_devices``). XLA reads the flag when JAX
    starts its backend, so this must run first; a ConfigError says so otherwise."""
    flag = "--xla_force_host_platform_device_count"
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
    os.environ["XLA_FLAGS"] = " ".join([*kept, f"{flag}={count}"])
    cpus = jax.devices("cpu")
    if len(cpus) != count:
        raise ConfigError(
            f"host_devices: JAX had started with {len(cpus)} CPU device(s) before {count} could be set; "
            f"set XLA_FLAGS={flag}={count} before starting Python instead"
        )


def _model(config: Config, input_shape, outputs: int, default_hidden=None):
    name = config.model or default_model(config.dataset)
    hidden = config.hidden_widths() or (default_hidden if name == "mlp" else None)
    return get_model(name, input_shape, outputs, config.norm, config.conv, hidden)


def _image_task(config: Config):
    """A dataset of images, partitioned, with its clustered-task transform applied."""
    dataset = load_dataset(config.dataset, config.data_dir or None, config.download)
    model = _model(config, dataset.input_shape, dataset.num_classes)
    train_parts, test_parts = partition(
        config.partition,
        dataset.y_train,
        dataset.y_test,
        config.num_clients,
        np.random.default_rng(config.seed),
        alpha=config.alpha,
        min_examples=config.min_examples,
        classes_per_client=config.classes_per_client,
        client_train_size=config.client_train_size,
        client_test_size=config.client_test_size,
        num_groups=config.num_clusters,
    )
    train_parts = reduce_parts(
        train_parts, config.train_reduction, config.min_examples, np.random.default_rng([config.seed, 1])
    )
    dataset = apply_cluster_task(dataset, train_parts, test_parts, config.cluster_task, config.num_clusters)
    return dataset, model, train_parts, test_parts


def _synthetic_task(config: Config):
    """FLoRAL's generated regression task; its client size defaults to the authors' ratio to the
    model's parameter count."""
    outputs = config.synthetic_outputs or DEFAULT_OUTPUTS[config.dataset]
    model = _model(config, (config.synthetic_dim,), outputs, default_hidden=(2 * config.synthetic_dim,))
    samples = config.samples_per_client or auto_samples_per_client(config.dataset, count_parameters(model))
    dataset, train_parts, test_parts = synthetic_task(
        config.dataset,
        config.num_clients,
        config.num_clusters,
        samples,
        np.random.default_rng(config.seed),
        dim=config.synthetic_dim,
        outputs=outputs,
        rank=config.synthetic_rank,
        scale=config.synthetic_scale,
    )
    return dataset, model, train_parts, test_parts


def count_parameters(model) -> int:
    shapes = jax.eval_shape(model.init, jax.random.key(0))["params"]
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))


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


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


class RunRecord:
    """Everything a run has logged so far, as JSON: stored in each checkpoint.

    ``pending`` holds the per-round metrics since the last evaluation (floats), ``rows`` the
    evaluated metrics rows, ``totals`` the running sums, ``round_times`` each round's seconds.
    """

    def __init__(self, config: Config, record: dict | None = None):
        record = record or {}
        self.config = config
        self.rows: list[dict] = record.get("rows", [])
        self.pending: dict[str, list[float]] = record.get("pending", {})
        self.totals: dict[str, float] = record.get("totals", {"bytes_up": 0.0, "bytes_down": 0.0, "nonfinite": 0.0})
        self.round_times: list[float] = record.get("round_times", [])
        self.wall_before = float(record.get("wall_seconds", 0.0))
        self.devices = record.get("devices")

    def add_rounds(self, metrics: dict, seconds_per_round: float) -> None:
        """Per-round metrics of one call (arrays with a leading round axis)."""
        count = len(metrics["train_loss"])
        for key, values in metrics.items():
            if key == "nonfinite_ids":
                continue
            self.pending.setdefault(key, []).extend(float(v) for v in np.asarray(values).reshape(count))
        for total, key in (("bytes_up", "bytes_up"), ("bytes_down", "bytes_down"), ("nonfinite", "nonfinite_clients")):
            self.totals[total] += float(np.sum(np.asarray(metrics[key], np.float64)))
        self.round_times += [seconds_per_round] * count

    def add_row(self, round_: int, evaluation: dict, wall: float) -> dict:
        window = len(self.pending.get("train_loss", []))
        global_key = "global_mse" if is_regression_row(evaluation) else "global_acc"
        row = {"round": round_, **evaluation, global_key: evaluation.get(global_key)}
        for key, values in self.pending.items():
            if key not in ("bytes_up", "bytes_down", "nonfinite_clients"):
                row[key] = float(np.mean(values)) if values else None
        row.update(
            bytes_up_round=self.pending["bytes_up"][-1] if window else 0.0,
            bytes_down_round=self.pending["bytes_down"][-1] if window else 0.0,
            bytes_up_total=self.totals["bytes_up"],
            bytes_down_total=self.totals["bytes_down"],
            nonfinite_skipped=float(sum(self.pending.get("nonfinite_clients", []))),
            round_seconds=float(np.mean(self.round_times[-window:])) if window else None,
            wall_seconds=self.wall_before + wall,
        )
        self.rows.append(row)
        self.pending = {}
        return row

    def to_json(self, round_: int, wall: float, devices: int) -> dict:
        return {
            "config": self.config.to_dict(),
            "round": round_,
            "rows": self.rows,
            "pending": self.pending,
            "totals": self.totals,
            "round_times": self.round_times,
            "wall_seconds": self.wall_before + wall,
            "devices": devices,
        }


def saved_config(out_dir: str | Path, log=None) -> Config:
    """The config of the newest readable checkpoint in ``out_dir`` (what ``--resume`` starts from)."""
    found = _newest_record(RunCheckpoints(Path(out_dir) / "checkpoints"), log)
    if found is None:
        raise ConfigError(f"--resume: no checkpoint in {Path(out_dir) / 'checkpoints'}")
    return _config_from_dict(found[1]["config"])


def _newest_record(checkpoints: RunCheckpoints, log=None):
    return checkpoints.newest(checkpoints.read_record, warn=log)


def _config_from_dict(values: dict) -> Config:
    known = {k: v for k, v in values.items() if k in Config.keys()}
    return Config(**known)


def check_resumable(saved: Config, config: Config) -> None:
    """Refuse (ConfigError) a resume whose config changes what a round computes."""
    changed = [
        f"{key} ({getattr(saved, key)!r} -> {getattr(config, key)!r})"
        for key in Config.keys()
        if key not in RESUMABLE_KEYS and getattr(saved, key) != getattr(config, key)
    ]
    if changed:
        raise ConfigError(
            "--resume: the config differs from the checkpoint's in "
            + ", ".join(changed)
            + f"; only {', '.join(sorted(RESUMABLE_KEYS))} may change"
        )


def run(config: Config, out_dir: str | Path, *, resume: bool = False, progress: bool = True, log=None) -> dict:
    """Run ``config`` end to end (or continue it from its newest checkpoint); write the run
    directory; return the summary.

    Raises :class:`NonFiniteUpdateError` (``nonfinite=error``) after checkpointing the last good
    state; its ``checkpoint`` attribute says where.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    start = time.perf_counter()
    out = Path(out_dir)
    config.validate()
    if config.host_devices:  # before anything below starts JAX's backend (build splits it too, for direct callers)
        split_host(config.host_devices)
    checkpoints = RunCheckpoints(out / "checkpoints", keep=config.keep_checkpoints)
    _check_run_dir(out, checkpoints, config, resume, log)  # refuses before anything is written

    built = build(config)
    sim = built.simulation
    state, record = _resume_point(config, sim, checkpoints, log) if resume else (sim.init(), RunRecord(config))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    _write_rows(out / "metrics.jsonl", record.rows)
    log(f"partition: {describe(built.partition_summary)}")

    _run_rounds(config, sim, state, record, checkpoints, out / "metrics.jsonl", start, progress)
    summary = _summary(config, built, record, sim, time.perf_counter() - start)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _write_plots(out, record.rows, log)
    return summary


def _check_run_dir(out: Path, checkpoints: RunCheckpoints, config: Config, resume: bool, log) -> None:
    if resume:
        found = _newest_record(checkpoints, log)
        if found is None:
            raise ConfigError(f"--resume: no checkpoint in {checkpoints.directory}")
        check_resumable(_config_from_dict(found[1]["config"]), config)
    elif checkpoints.rounds() or (out / "metrics.jsonl").exists():
        raise ConfigError(f"--out {out}: already holds a run; pass --resume to continue it, or choose another --out")


def _resume_point(config: Config, sim: Simulation, checkpoints: RunCheckpoints, log):
    """State and record of the newest readable checkpoint; unreadable newer ones are set aside."""
    like = sim.init()
    restored = checkpoints.newest(lambda r: checkpoints.restore(r, like=like), warn=log)
    if restored is None:
        raise ConfigError(f"--resume: no readable checkpoint in {checkpoints.directory}")
    round_, (state, saved) = restored
    check_resumable(_config_from_dict(saved["config"]), config)
    for newer in [r for r in checkpoints.rounds() if r > round_]:
        log(f"moved the unreadable checkpoint to {checkpoints.set_aside(newer)}")
    log(f"resuming from round {round_} ({checkpoints.directory / str(round_)})")
    record = RunRecord(config, saved)
    if record.devices is not None and record.devices != sim.num_devices:
        log(
            f"warning: checkpoint written on {record.devices} device(s), resuming on {sim.num_devices}: "
            "results match to float tolerance, not bit for bit"
        )
    return state, record


def _run_rounds(config, sim, state, record: RunRecord, checkpoints: RunCheckpoints, metrics_path, start, progress):
    """The rounds still to run: compiled calls, evaluations appended to ``metrics_path``, checkpoints."""
    from tqdm import tqdm

    def save(state):
        round_ = int(state.round)
        checkpoints.save(round_, state, record.to_json(round_, time.perf_counter() - start, sim.num_devices))

    done = int(state.round)
    bar = tqdm(
        total=config.rounds,
        initial=min(done, config.rounds),
        desc=config.algorithm,
        unit="round",
        disable=not progress,
        file=sys.stderr,
    )
    schedule = chunk_schedule(done, config.rounds, config.eval_every, config.rounds_per_call, config.checkpoint_every)
    try:
        with open(metrics_path, "a") as metrics_file:
            for length, evaluate, checkpoint in schedule:
                compile_before, tick = sim.compile_seconds, time.perf_counter()
                try:
                    state, metrics = sim.run_rounds(state, length)
                except NonFiniteUpdateError as err:  # keep the good rounds, then stop
                    record.add_rounds(jax.device_get(err.metrics), 0.0)
                    save(err.state)
                    checkpoints.wait()
                    err.checkpoint = checkpoints.directory / str(int(err.state.round))
                    raise
                metrics = jax.device_get(metrics)
                record.add_rounds(
                    metrics, (time.perf_counter() - tick - (sim.compile_seconds - compile_before)) / length
                )
                bar.update(length)
                if evaluate:
                    row = record.add_row(int(state.round), sim.evaluate(state), time.perf_counter() - start)
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
                    name, value = headline(row)
                    bar.set_postfix({name: f"{value:.3f}", "up": human_bytes(row["bytes_up_total"])})
                if checkpoint:
                    save(state)
        checkpoints.wait()
    finally:
        bar.close()


def _write_rows(path: Path, rows: list[dict]) -> None:
    """Replace ``path`` atomically with ``rows`` as JSON lines."""
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)


def _write_plots(out: Path, rows: list[dict], log) -> None:
    """``accuracy.png`` (personalized) and, where there is a global model, ``global_accuracy.png``."""
    from jaxfed.plots import plot_runs

    kind = "mse" if rows and is_regression_row(rows[0]) else "acc"
    plots = {"accuracy.png": f"personalized_{kind}_mean"}
    if any(r.get(f"global_{kind}") is not None for r in rows):
        plots["global_accuracy.png"] = f"global_{kind}"
    for name, metric in plots.items():
        try:
            plot_runs([out], out / name, metric)
        except Exception as err:  # a plot must never cost the run its results
            log(f"warning: could not write {out / name}: {err}")


def is_regression_row(row: dict) -> bool:
    """Whether an evaluation row is a regression task's (MSE metrics instead of accuracies)."""
    return "personalized_mse_mean" in row


def headline(row: dict) -> tuple[str, float]:
    """The metric a run is judged by: personalized accuracy, or MSE for a regression task."""
    return ("mse", row["personalized_mse_mean"]) if is_regression_row(row) else ("acc", row["personalized_acc_mean"])


def _task_summary(rows: list[dict]) -> dict:
    """Last and best personalized / global metrics: accuracy (best = max), or MSE (best = min)."""
    final = rows[-1]
    kind, best = ("mse", min) if is_regression_row(final) else ("acc", max)
    global_values = [r[f"global_{kind}"] for r in rows if r.get(f"global_{kind}") is not None]
    return {
        "task": "regression" if kind == "mse" else "classification",
        **{f"personalized_{kind}_{s}": final[f"personalized_{kind}_{s}"] for s in ("mean", "weighted", "std")},
        f"global_{kind}": final.get(f"global_{kind}"),
        f"best_personalized_{kind}": best(r[f"personalized_{kind}_mean"] for r in rows),
        f"best_global_{kind}": best(global_values) if global_values else None,
    }


def _summary(config, built, record: RunRecord, sim, wall) -> dict:
    rows = record.rows
    final = rows[-1]
    return {
        "algorithm": config.algorithm,
        "dataset": config.dataset,
        "model": sim.model.name,
        "num_clients": config.num_clients,
        "clients_per_round": sim.num_sampled,
        "rounds": int(final["round"]),
        **_task_summary(rows),
        "bytes_up_total": final["bytes_up_total"],
        "bytes_down_total": final["bytes_down_total"],
        "nonfinite_skipped_total": record.totals["nonfinite"],
        "round_seconds_median": float(np.median(record.round_times)),
        "compile_seconds": sim.compile_seconds,
        "wall_seconds": record.wall_before + wall,
        "devices": sim.num_devices,
        "partition": built.partition_summary,
    }
