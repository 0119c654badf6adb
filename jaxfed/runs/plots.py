"""Accuracy (or MSE) curves of run directories: against the round and against cumulative bytes uploaded.

``plot_runs(dirs, out_file)`` draws one line per run, labelled by its algorithm and the config
keys in which the runs differ. ``jaxfed plot`` and the end of ``jaxfed run`` call it.
:func:`read_run` and :func:`read_json` read a run directory's files (``jaxfed report`` and
:func:`jaxfed.load_runs` too; :func:`run_dirs_below` finds a sweep's): a damaged one, or an
``out_file`` that cannot be written, is a one-line ConfigError.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxfed.errors import ConfigError, first_line
from jaxfed.runs.keys import NEUTRAL_KEYS

METRICS = (
    "personalized_acc_mean",
    "personalized_acc_weighted",
    "global_acc",
    "personalized_mse_mean",
    "personalized_mse_weighted",
    "global_mse",
)
# Not worth a label: keys that change no number, the algorithm (a label's first word) and the
# rounds (the x axis).
UNLABELLED_KEYS = NEUTRAL_KEYS | {"algorithm", "rounds"}


def read_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    """``(config, rows)`` of a run directory; an unfinished last line of ``metrics.jsonl`` is ignored."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise ConfigError(f"{run_dir}: no metrics.jsonl (not a jaxfed run directory)")
    rows = []
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    config_file = run_dir / "config.json"
    config = read_json(config_file) if config_file.exists() else {}
    return config, rows


def run_dirs_below(path: str | Path) -> list[Path]:
    """The run directories (holding a ``config.json``) right below ``path``: a sweep's members."""
    path = Path(path)
    return sorted(p for p in path.iterdir() if (p / "config.json").is_file()) if path.is_dir() else []


def read_json(path: Path) -> dict:
    """A run directory's ``config.json`` or ``summary.json``; a one-line ConfigError naming the
    file when it cannot be read or is damaged."""
    try:
        value = json.loads(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err})") from None
    except ValueError as err:  # not JSON, not UTF-8
        value, problem = None, first_line(err)
    else:
        problem = None if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"
    if problem is not None:
        raise ConfigError(
            f"{path}: damaged ({problem}); `jaxfed run --out {Path(path).parent} --resume` writes it again "
            "from the run's newest checkpoint"
        )
    return value


def run_labels(configs: list[dict]) -> list[str]:
    """The algorithm, then ``key=value`` for every key (run key or algorithm option) that every
    run has and whose value differs between them."""
    differing = differing_keys(configs, UNLABELLED_KEYS)
    flat = [flat_config(config) for config in configs]
    return [" ".join([str(f.get("algorithm", "?"))] + [f"{k}={show(f[k])}" for k in differing]) for f in flat]


def differing_keys(configs: list[dict], ignore=frozenset()) -> list[str]:
    """The keys (run keys and algorithm options) outside ``ignore`` that every config has and whose
    value differs between them."""
    flat = [flat_config(config) for config in configs]
    shared = set.intersection(*(set(f) for f in flat)) if flat else set()
    return [k for k in sorted(shared - ignore) if len({json.dumps(f[k], sort_keys=True) for f in flat}) > 1]


def flat_config(config: dict) -> dict:
    """A config's run keys and its algorithm's options in one dict."""
    return {**(config.get("options") or {}), **{k: v for k, v in config.items() if k != "options"}}


def show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


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
    if log_x:  # plain labels at 1, 2, 5 x 10^k, none on the minor ticks: they overlapped
        from matplotlib import ticker

        by_bytes.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        by_bytes.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        by_bytes.xaxis.set_minor_formatter(ticker.NullFormatter())
    for ax in (by_round, by_bytes):
        ax.grid(alpha=0.3)
    by_round.legend(fontsize="small")
    out_file = Path(out_file)
    try:
        if not out_file.parent.exists():  # a file there: saving says "Not a directory"
            out_file.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_file, dpi=110, format="png")  # at out_file as named, without a suffix too
    except OSError as err:
        raise ConfigError(f"{out_file}: cannot be written ({err.strerror or err})") from None
    finally:
        plt.close(fig)
    return out_file
