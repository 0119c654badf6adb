"""Accuracy (or MSE) curves of run directories: against the round and against cumulative bytes uploaded.

``plot_runs(dirs, out_file)`` draws one line per run, labelled by its algorithm and the config
keys in which the runs differ. ``jaxfed plot`` and the end of ``jaxfed run`` call it.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxfed.errors import ConfigError

METRICS = (
    "personalized_acc_mean",
    "personalized_acc_weighted",
    "global_acc",
    "personalized_mse_mean",
    "personalized_mse_weighted",
    "global_mse",
)
# Keys that never change what a run computes: not worth a label.
UNLABELLED_KEYS = frozenset(
    {
        "algorithm",
        "data_dir",
        "download",
        "eval_every",
        "rounds_per_call",
        "checkpoint_every",
        "keep_checkpoints",
        "nonfinite",
        "devices",
        "client_chunk",
        "eval_batch_size",
        "rounds",
    }
)


def read_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    """``(config, rows)`` of a run directory; an unfinished last line of ``metrics.jsonl`` is ignored."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise ConfigError(f"{run_dir}: no metrics.jsonl (not a jaxfed run directory)")
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    config_file = run_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    return config, rows


def run_labels(configs: list[dict]) -> list[str]:
    """The algorithm, then ``key=value`` for every config key whose value differs between runs."""
    keys = sorted({k for c in configs for k in c} - UNLABELLED_KEYS)
    differing = [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]
    labels = []
    for config in configs:
        parts = [str(config.get("algorithm", "?"))] + [f"{k}={config.get(k)}" for k in differing]
        labels.append(" ".join(parts))
    return labels


def plot_runs(run_dirs, out_file: str | Path, metric: str = "personalized_acc_mean") -> Path:
    """Write a two-panel PNG (``metric`` vs round, vs cumulative bytes up) for ``run_dirs``."""
    if metric not in METRICS:
        raise ConfigError(f"--metric: unknown '{metric}'; allowed: {', '.join(METRICS)}")
    runs = [read_run(d) for d in run_dirs]
    labels = run_labels([config for config, _ in runs])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_round, by_bytes) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    drawn, smallest_mb = 0, float("inf")
    for (_, rows), label in zip(runs, labels):
        points = [r for r in rows if r.get(metric) is not None]
        if not points:
            continue
        accuracy = [r[metric] for r in points]
        line = by_round.plot([r["round"] for r in points], accuracy, marker=".", label=label)[0]
        megabytes = [r["bytes_up_total"] / 1e6 for r in points]
        by_bytes.plot(megabytes, accuracy, marker=".", color=line.get_color())
        smallest_mb = min(smallest_mb, *megabytes)
        drawn += 1
    if not drawn:
        plt.close(fig)
        raise ConfigError(f"--metric: no run has {metric} rows to plot")
    name = metric.replace("_", " ")
    by_round.set(xlabel="round", ylabel=name, title=f"{name} vs round")
    log_x = smallest_mb > 0  # runs that upload nothing (local) need a linear axis
    by_bytes.set(
        xlabel="cumulative MB uploaded" + (" (log)" if log_x else ""),
        ylabel=name,
        title=f"{name} vs communication",
        xscale="log" if log_x else "linear",
    )
    for ax in (by_round, by_bytes):
        ax.grid(alpha=0.3)
    by_round.legend(fontsize="small")
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_file, dpi=110)
    plt.close(fig)
    return out_file
