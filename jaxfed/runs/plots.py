"""Accuracy (or MSE, or any per-round number) curves of run directories: against the round and against
cumulative bytes uploaded.

``plot_runs(dirs, out_file)`` draws one line per run, labelled by its algorithm and the config
keys in which the runs differ. ``jaxfed plot`` and the end of ``jaxfed run`` call it.
``plot_client_distribution(dirs, out_file)`` (``jaxfed plot --clients``) draws the per-client
values: their distribution after the last evaluation, and their spread over the rounds.
:func:`read_run`, :func:`read_clients` and :func:`read_json` read a run directory's files
(``jaxfed report`` and :func:`jaxfed.load_runs` too; :func:`run_dirs_below` finds a sweep's): a
damaged one, or an ``out_file`` that cannot be written, is a one-line ConfigError.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from pathlib import Path

import numpy as np

from jaxfed.errors import ConfigError, first_line, unknown_choice
from jaxfed.runs.keys import NEUTRAL_KEYS

METRICS = (
    "personalized_acc_mean",
    "personalized_acc_weighted",
    "global_acc",
    "personalized_mse_mean",
    "personalized_mse_weighted",
    "global_mse",
    "new_personalized_acc_mean",
    "new_global_acc_mean",
    "new_personalized_mse_mean",
    "new_global_mse_mean",
)
# Not worth a label: keys that change no number, the algorithm (a label's first word) and the
# rounds (the x axis).
UNLABELLED_KEYS = NEUTRAL_KEYS | {"algorithm", "rounds"}


def read_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    """``(config, rows)`` of a run directory; an unfinished last line of ``metrics.jsonl`` is
    ignored, and a run stopped before it wrote one (its ``config.json`` alone) has no rows."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    config_file = run_dir / "config.json"
    if not metrics.exists() and not config_file.exists():
        raise ConfigError(f"{run_dir}: no metrics.jsonl (not a jaxfed run directory)")
    rows = []
    for line in metrics.read_text(errors="replace").splitlines() if metrics.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    config = read_json(config_file) if config_file.exists() else {}
    return config, rows


CLIENTS_DIR = "clients"  # a run directory's per-client files: clients/<round>.npz


def client_files(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``[(round, path)]`` of a run directory's per-client files, by round."""
    folder = Path(run_dir) / CLIENTS_DIR
    # <round>.npz only: a <round>.tmp.npz is a write that a killed run left half done (write_clients)
    found = [(p.name.removesuffix(".npz"), p) for p in folder.glob("*.npz")] if folder.is_dir() else []
    return sorted((int(r), p) for r, p in found if r.isdigit())


def read_clients(run_dir: str | Path) -> dict[int, dict[str, np.ndarray]]:
    """``{round: {name: array}}``: every evaluated round's per-client arrays of a run directory, in
    client-id order (``acc`` or ``mse``, ``loss``, ``examples``; ``new_*`` and ``new_global_*``
    where clients were held out; NaN for a client without counted test examples). Empty for a
    run written before per-client files existed."""
    out = {}
    for round_, path in client_files(run_dir):
        try:
            with np.load(path, allow_pickle=False) as arrays:
                out[round_] = {name: arrays[name] for name in arrays.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
            raise ConfigError(f"{path}: damaged ({first_line(err)})") from None
    return out


def run_dirs_below(path: str | Path) -> list[Path]:
    """The run directories (holding a ``config.json``) right below ``path``: a sweep's members."""
    path = Path(path)
    return sorted(p for p in path.iterdir() if (p / "config.json").is_file()) if path.is_dir() else []


def with_members(paths) -> list[Path]:
    """``paths`` with each sweep's directory (no ``metrics.jsonl``, run directories below it)
    replaced by its members, in order: what ``jaxfed plot`` and :func:`jaxfed.load_runs` take
    (``jaxfed report`` takes a sweep's finished members)."""
    expanded = []
    for path in map(Path, paths):
        members = [] if (path / "metrics.jsonl").is_file() else run_dirs_below(path)
        expanded += members or [path]
    return expanded


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
    run has and whose value differs between them; a user's own model (``model=net.py:Net``) is
    named whether or not it differs, so no plot passes it off as a built-in."""
    from jaxfed.nn.user import is_spec

    flat = [flat_config(config) for config in configs]
    labelled = set(differing_keys(configs, UNLABELLED_KEYS))
    if any(is_spec(f.get("model", "")) for f in flat):
        labelled.add("model")
    words = [[str(f.get("algorithm", "?"))] + [f"{k}={show(f.get(k, ''), k)}" for k in sorted(labelled)] for f in flat]
    return [" ".join(w) for w in words]


def plot_labels(run_dirs: list[Path], configs: list[dict]) -> list[str]:
    """:func:`run_labels`, with the run directory's name after a label two runs share (runs of one
    configuration, e.g. a run and its copy)."""
    labels = run_labels(configs)
    return [f"{label} ({Path(d).name})" if labels.count(label) > 1 else label for label, d in zip(labels, run_dirs)]


def differing_keys(configs: list[dict], ignore=frozenset()) -> list[str]:
    """The keys (run keys and algorithm options) outside ``ignore`` that every config has and whose
    value differs between them."""
    flat = [flat_config(config) for config in configs]
    shared = set.intersection(*(set(f) for f in flat)) if flat else set()
    return [k for k in sorted(shared - ignore) if len({json.dumps(f[k], sort_keys=True) for f in flat}) > 1]


def flat_config(config: dict) -> dict:
    """A config's run keys and its algorithm's options in one dict."""
    return {**(config.get("options") or {}), **{k: v for k, v in config.items() if k != "options"}}


def show(value, key: str = "") -> str:
    """A config value as a label or a name: a model by :func:`jaxfed.nn.user.label` (a user's file
    by its name, not its absolute path), an empty one as the dataset's default; a float as ``:g``
    writes it (``0.05``, ``1e-05``, ``2``) where that reads back as the same number, else its
    shortest exact form (``0.1234567``), so distinct values get distinct names; a list
    comma-separated."""
    if key == "model":
        from jaxfed.nn.user import label

        return label(str(value)) if value else "default"
    if isinstance(value, float):
        return f"{value:g}" if float(f"{value:g}") == value else repr(value)
    return ",".join(map(show, value)) if isinstance(value, (tuple, list)) else str(value)


# Fixed margins for the two-panel figures: matplotlib's constrained layout measured every tick label
# first and took half of a run's plotting time (0.19 of 0.41 s a figure), paid at the end of every
# run and sweep member. These fit the labels the panels have (tick labels up to about 6 characters).
TWO_PANELS = {"left": 0.065, "right": 0.985, "bottom": 0.13, "top": 0.92, "wspace": 0.22}


def is_regression_row(row: dict) -> bool:
    """Whether an evaluation row is a regression task's (MSE metrics instead of accuracies)."""
    return "personalized_mse_mean" in row


def plottable_metrics(rows_of_runs) -> list[str]:
    """What ``plot_runs`` may draw of runs with these rows: :data:`METRICS`, then every other number
    their rows hold but the round (losses, steps, bytes, seconds, non-finite counts; null where a
    round had none, as ``train_loss`` when every update was skipped)."""
    numbers = {
        key
        for rows in rows_of_runs
        for row in rows
        for key, value in row.items()
        if (value is None or isinstance(value, int | float)) and not isinstance(value, bool) and key != "round"
    }
    return [*METRICS, *sorted(numbers - set(METRICS))]


def plot_runs(run_dirs, out_file: str | Path, metric: str | None = None) -> Path:
    """Write a two-panel PNG (``metric`` vs round, vs cumulative bytes up) for ``run_dirs``;
    ``metric`` None: the runs' personalized accuracy, or their MSE for a regression task; else
    one of :func:`plottable_metrics` (a one-line ConfigError naming them otherwise)."""
    run_dirs = with_members(run_dirs)
    runs = [read_run(d) for d in run_dirs]
    if not any(rows for _, rows in runs):
        raise ConfigError("plot: no run has evaluated yet (metrics.jsonl is empty or missing)")
    if metric is not None and metric not in (allowed := plottable_metrics(rows for _, rows in runs)):
        raise ConfigError(f"--metric: {unknown_choice(metric, allowed)}")
    if metric is None:
        tasks = {any(map(is_regression_row, rows)) for _, rows in runs if rows}
        if len(tasks) > 1:  # one axis cannot hold accuracy and MSE
            raise ConfigError("plot: the runs mix regression (MSE) and classification (accuracy); plot each task apart")
        metric = "personalized_mse_mean" if True in tasks else "personalized_acc_mean"
    labels = plot_labels(run_dirs, [config for config, _ in runs])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_round, by_bytes) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw=TWO_PANELS)
    drawn, smallest_mb = 0, float("inf")
    for (_, rows), label in zip(runs, labels):
        points = [r for r in rows if r.get(metric) is not None]
        if not points:
            continue
        values = [r[metric] for r in points]
        line = by_round.plot([r["round"] for r in points], values, marker=".", label=label)[0]
        megabytes = [r["bytes_up_total"] / 1e6 for r in points]
        by_bytes.plot(megabytes, values, marker=".", color=line.get_color())
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
    return _save(fig, out_file)


def plot_client_distribution(run_dirs, out_file: str | Path, name: str = "") -> Path:
    """Write a two-panel PNG of the per-client values ``name`` (default ``acc``, or ``mse`` for a
    regression run; ``new_acc`` etc. for held-out clients) of ``run_dirs``: their empirical
    distribution after the last evaluation, and their median with the 10-90% band over rounds."""
    run_dirs = with_members(run_dirs)
    runs = [(read_run(d)[0], read_clients(d)) for d in run_dirs]
    missing = [str(d) for d, (_, per_round) in zip(run_dirs, runs) if not per_round]
    if missing:
        raise ConfigError(f"--clients: {missing[0]} has no per-client results (clients/; runs before they existed)")
    name = name or ("mse" if "mse" in next(iter(runs[0][1].values())) else "acc")
    labels = plot_labels(run_dirs, [config for config, _ in runs])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (final, spread) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw=TWO_PANELS)
    drawn = 0
    for (_, per_round), label in zip(runs, labels):
        rounds = [r for r in sorted(per_round) if name in per_round[r]]
        values = [per_round[r][name][~np.isnan(per_round[r][name])] for r in rounds]
        if not rounds or not len(values[-1]):
            continue
        last = np.sort(values[-1])
        below = np.arange(len(last) + 1) / len(last)  # the fraction of clients at or below each value
        line = final.step(np.concatenate([last[:1], last]), below, where="post", label=label)[0]
        low, mid, high = (np.array([np.percentile(v, q) for v in values]) for q in (10, 50, 90))
        spread.plot(rounds, mid, marker=".", color=line.get_color())
        spread.fill_between(rounds, low, high, color=line.get_color(), alpha=0.2)
        drawn += 1
    if not drawn:
        plt.close(fig)
        allowed = sorted({k for _, per_round in runs for arrays in per_round.values() for k in arrays})
        raise ConfigError(f"--clients: no run has per-client '{name}'; allowed: {', '.join(allowed)}")
    shown = name.replace("_", " ")
    final.set(xlabel=f"client {shown}", ylabel="fraction of clients", title=f"client {shown}, last evaluation")
    spread.set(xlabel="round", ylabel=f"client {shown}", title="median and 10-90% of clients")
    for ax in (final, spread):
        ax.grid(alpha=0.3)
    final.legend(fontsize="small")
    return _save(fig, out_file)


def _save(fig, out_file: str | Path) -> Path:
    """Save ``fig`` as a PNG at ``out_file`` (its folder made), then close it; a one-line ConfigError
    when it cannot be written."""
    import matplotlib.pyplot as plt

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
