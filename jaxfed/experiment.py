"""Build a simulation from a :class:`Config`, run it, and write the run directory.

``run(config, out_dir)`` is what ``jaxfed run`` calls: it writes ``config.json``,
``metrics.jsonl`` (one row per evaluated round) and ``summary.json`` into ``out_dir``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from jaxfed.algorithms import ALGORITHMS
from jaxfed.config import Config
from jaxfed.data import default_model, describe, federate, load_dataset, partition, summarize
from jaxfed.errors import ConfigError
from jaxfed.nn import get_model
from jaxfed.simulation import Simulation


class Built(NamedTuple):
    config: Config
    simulation: Simulation
    partition_summary: dict


def build(config: Config) -> Built:
    """Dataset, partition, model, algorithm and engine for ``config`` (validated)."""
    config.validate()
    dataset = load_dataset(config.dataset, config.data_dir or None, config.download)
    model = get_model(
        config.model or default_model(config.dataset),
        dataset.input_shape,
        dataset.num_classes,
        config.norm,
        config.conv,
    )
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
    )
    return Built(config, simulation, summarize(train_parts, dataset.y_train))


def chunk_schedule(rounds: int, eval_every: int, rounds_per_call: int):
    """``(chunk_length, evaluate_after)`` pairs covering ``rounds``: chunks never cross an evaluation."""
    done = 0
    while done < rounds:
        next_eval = min((done // eval_every + 1) * eval_every, rounds)
        length = min(rounds_per_call, next_eval - done)
        done += length
        yield length, done == next_eval


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def run(config: Config, out_dir: str | Path, *, progress: bool = True, log=None) -> dict:
    """Run ``config`` end to end; write the run directory; return the summary."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    start = time.perf_counter()
    built = build(config)
    sim = built.simulation
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    log(f"partition: {describe(built.partition_summary)}")

    from tqdm import tqdm

    state = sim.init()
    rows, totals, round_times, since_eval = [], {"bytes_up": 0.0, "bytes_down": 0.0}, [], []
    bar = tqdm(total=config.rounds, desc=config.algorithm, unit="round", disable=not progress, file=sys.stderr)
    with open(out / "metrics.jsonl", "w") as metrics_file:
        for length, evaluate in chunk_schedule(config.rounds, config.eval_every, config.rounds_per_call):
            compile_before = sim.compile_seconds
            tick = time.perf_counter()
            state, metrics = sim.run_rounds(state, length)
            metrics = jax.device_get(metrics)
            elapsed = time.perf_counter() - tick - (sim.compile_seconds - compile_before)
            round_times += [elapsed / length] * length
            since_eval.append(metrics)
            for key in totals:
                totals[key] += float(np.sum(metrics[key]))
            bar.update(length)
            if not evaluate:
                continue
            row = _metrics_row(int(state.round), sim.evaluate(state), since_eval, totals, round_times, start)
            since_eval = []
            rows.append(row)
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            bar.set_postfix(acc=f"{row['personalized_acc_mean']:.3f}", up=human_bytes(row["bytes_up_total"]))
    bar.close()
    summary = _summary(config, built, rows, sim, round_times, time.perf_counter() - start)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _metrics_row(round_, evaluation, chunks, totals, round_times, start) -> dict:
    def last(key):
        return float(chunks[-1][key][-1])

    rounds_in_window = sum(len(c["train_loss"]) for c in chunks)
    return {
        "round": round_,
        **evaluation,
        "global_acc": evaluation.get("global_acc"),
        "train_loss": float(np.mean(np.concatenate([c["train_loss"] for c in chunks]))),
        "bytes_up_round": last("bytes_up"),
        "bytes_down_round": last("bytes_down"),
        "bytes_up_total": totals["bytes_up"],
        "bytes_down_total": totals["bytes_down"],
        "round_seconds": float(np.mean(round_times[-rounds_in_window:])),
        "wall_seconds": time.perf_counter() - start,
    }


def _summary(config, built, rows, sim, round_times, wall) -> dict:
    final = rows[-1]
    global_accs = [r["global_acc"] for r in rows if r["global_acc"] is not None]
    return {
        "algorithm": config.algorithm,
        "dataset": config.dataset,
        "model": sim.model.name,
        "num_clients": config.num_clients,
        "clients_per_round": sim.num_sampled,
        "rounds": int(final["round"]),
        "personalized_acc_mean": final["personalized_acc_mean"],
        "personalized_acc_weighted": final["personalized_acc_weighted"],
        "personalized_acc_std": final["personalized_acc_std"],
        "global_acc": final["global_acc"],
        "best_personalized_acc": max(r["personalized_acc_mean"] for r in rows),
        "best_global_acc": max(global_accs) if global_accs else None,
        "bytes_up_total": final["bytes_up_total"],
        "bytes_down_total": final["bytes_down_total"],
        "round_seconds_median": float(np.median(round_times)),
        "compile_seconds": sim.compile_seconds,
        "wall_seconds": wall,
        "devices": sim.num_devices,
        "partition": built.partition_summary,
    }
