"""Results with error bars: variants of an experiment, each run over several seeds, as one table,
one per-seed file and one plot of the curves with their spread.

A *variant* is one configuration over different seeds: a directory whose run directories
(``<variant>/<member>/summary.json``, e.g. the members ``seed0_lr0.05 ...`` of a ``jaxfed
sweep``) differ only in the seed and the keys that change no number
(:data:`~jaxfed.runs.rundir.NEUTRAL_KEYS`); a variant that is itself one run directory counts as
one seed. A directory whose runs differ in more (a sweep's grid: ``--grid lambda=0.1,1``) is
split by :func:`configurations` into one variant per combination of the keys that differ, named
``NAME[lambda=0.1]``; the seed is never one of those keys, so seeds are pooled only within a
variant. :func:`collect` reads them and refuses, in one line, a seed twice in one variant, a run
directory holding run directories too, variants of different tasks. :func:`summarize`
gives mean and sample standard deviation per metric, :func:`verdict` judges a claim "A above
B" (or "A above B minus a margin": "within a few points of B") against the seeds' spread (a
difference under two standard errors is inconclusive; unpaired, the conservative test, with
the paired standard error over shared seeds shown beside it), and :func:`write_report` writes
``report.md`` (with the papers' numbers beside ours where given, and traffic relative to a
reference variant), ``report.json``, ``report.csv`` and ``report.png``.
``jaxfed report`` is the command; every paper's experiment script uses it.
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from pathlib import Path
from typing import NamedTuple

from jaxfed.errors import ConfigError
from jaxfed.runs.plots import differing_keys, flat_config, read_json, read_run, run_dirs_below, show
from jaxfed.runs.rundir import NEUTRAL_KEYS, check_out_dir, finite_or_none, json_text, listed

SE_FACTOR = 2.0  # a difference under this many standard errors is inconclusive


class Variant(NamedTuple):
    name: str
    runs: list[Path]  # run directories, one per seed
    summaries: list[dict]
    rows: list[list[dict]]  # each run's metrics rows
    seeds: list[int | None]  # each run's seed, as its config.json gives it
    configs: list[dict]  # each run's config.json


def run_dirs(directory: Path) -> list[Path]:
    """The run directories of a variant: itself, or its subdirectories holding a summary (a
    ConfigError when it is both)."""
    directory = Path(directory)
    try:
        below = sorted(p for p in directory.iterdir() if _finished(p)) if directory.is_dir() else []
    except OSError as err:
        raise ConfigError(f"report: {directory} cannot be read ({err.strerror or err})") from None
    if not _finished(directory):
        return below
    if below:
        raise ConfigError(
            f"report: {directory} is a run directory (its own summary.json) and holds run directories too "
            f"({listed(below)}); move that run's files or the run directories elsewhere, and report each "
            "configuration as its own variant, NAME=DIR"
        )
    return [directory]


def unfinished_runs(directory: Path) -> list[Path]:
    """The run directories in or below ``directory`` without a ``summary.json`` (still running,
    or stopped): a report leaves them out."""
    directory = Path(directory)
    try:
        runs = [directory, *run_dirs_below(directory)]
    except OSError:  # a directory this process may not look into
        return []
    return [p for p in runs if (p / "config.json").is_file() and not _finished(p)]


def _finished(run: Path) -> bool:
    try:
        return (run / "summary.json").is_file()
    except OSError:  # a directory this process may not look into
        return False


def collect(variants: dict[str, Path]) -> list[Variant]:
    """``{name: directory}`` -> the variants' runs, summaries and rows: a directory of one
    configuration is the variant ``name``, a grid's is one variant per configuration,
    ``name[key=value,...]`` (:func:`configurations`). A ConfigError for a directory without
    finished runs, for a variant whose runs are not one configuration over distinct seeds, for
    two variants of one name, or for variants of different tasks."""
    collected, given = [], {}
    for name, directory in variants.items():
        runs = run_dirs(directory)
        if not runs:
            raise ConfigError(f"report: {directory} holds no finished run (no summary.json in it or below it)")
        read = [read_run(run) for run in runs]
        for label, members in configurations([config for config, _ in read]):
            variant = f"{name}[{label}]" if label else name
            if variant in given:
                raise ConfigError(
                    f"report: two variants named '{variant}' (from {given[variant]} and {directory}); "
                    "give each directory its own NAME=DIR"
                )
            given[variant] = directory
            members = sorted(members, key=lambda i: _seed_order(read[i][0].get("seed")))  # "per seed": in seed order
            these = [runs[i] for i in members]
            configs, rows = [read[i][0] for i in members], [read[i][1] for i in members]
            check_one_configuration(f"report: variant '{variant}' ({directory})", these, configs)
            summaries = [finite_or_none(read_json(run / "summary.json")) for run in these]  # NaN: null
            collected.append(Variant(variant, these, summaries, rows, [c.get("seed") for c in configs], configs))
    check_one_task(collected)
    return collected


def _seed_order(seed) -> tuple:
    return (seed is None, seed if isinstance(seed, int) else 0)


def configurations(configs: list[dict]) -> list[tuple[str, list[int]]]:
    """The runs of one directory (their ``configs``) grouped into configurations: ``[(label,
    indices)]``, ``label`` the keys that tell the group from the others, as ``key=value,...``
    (``""`` for one configuration). Those keys are the run keys whose values differ between the
    runs and the options that differ between the runs of one algorithm (the options of
    different algorithms are not compared, the algorithm is); never the seed or a key that
    changes no number (:data:`~jaxfed.runs.rundir.NEUTRAL_KEYS`). Ordered by value (numbers as
    numbers)."""
    ignored = NEUTRAL_KEYS | {"seed"}
    run_keys = set(differing_keys([{k: v for k, v in c.items() if k != "options"} for c in configs], ignored))
    by_algorithm: dict[str, list[dict]] = {}
    for config in configs:
        by_algorithm.setdefault(json.dumps(config.get("algorithm")), []).append(config)
    option_keys = {algorithm: set(differing_keys(same, ignored)) for algorithm, same in by_algorithm.items()}
    groups: dict[str, list[int]] = {}
    order: dict[str, tuple] = {}
    for i, config in enumerate(configs):
        flat = flat_config(config)
        keys = sorted(run_keys | option_keys[json.dumps(config.get("algorithm"))])
        label = ",".join(f"{key}={show(flat[key])}" for key in keys)
        groups.setdefault(label, []).append(i)
        order[label] = tuple((key, _by_value(flat[key])) for key in keys)
    return sorted(groups.items(), key=lambda group: order[group[0]])


def _by_value(value) -> tuple:
    """A sort key: numbers by value, before anything else by its JSON text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value, "")
    return (1, 0, json.dumps(value, sort_keys=True))


def check_one_configuration(variant: str, runs: list[Path], configs: list[dict]) -> None:
    """A one-line ConfigError unless ``runs`` (with their ``configs``) are one configuration over
    distinct seeds: they may differ in the seed and in :data:`~jaxfed.runs.rundir.NEUTRAL_KEYS`, nothing
    else (the options of runs of different algorithms are not compared, the algorithm is)."""
    compared = configs
    if len({c.get("algorithm") for c in configs}) > 1:
        compared = [{k: v for k, v in c.items() if k != "options"} for c in configs]
    keys = differing_keys(compared, NEUTRAL_KEYS | {"seed"})
    if keys:
        flat = [flat_config(c) for c in configs]
        shown = ", ".join(f"{key} ({_values_by_run(key, runs, flat)})" for key in keys)
        raise ConfigError(
            f"{variant} holds runs that differ in more than the seed: {shown}; report each configuration as its "
            "own variant, NAME=DIR (a run directory, or a directory of one configuration's seeds)"
        )
    seeds = [0 if c.get("seed") is None else c["seed"] for c in configs]
    for seed in dict.fromkeys(seeds):
        same = [run for run, s in zip(runs, seeds) if s == seed]
        if len(same) > 1:
            raise ConfigError(
                f"{variant} holds {len(same)} runs of seed {seed} ({listed(same)}); a variant is one configuration "
                "over distinct seeds: keep one of them, or report each as its own variant, NAME=DIR"
            )


def _values_by_run(key: str, runs: list[Path], flat: list[dict]) -> str:
    """``"10 in seed0, seed1; 50 in seed2"``: each value of ``key`` and the runs that have it."""
    by_value: dict[str, list[Path]] = {}
    for run, config in zip(runs, flat):
        by_value.setdefault(show(config[key]), []).append(run)
    return "; ".join(f"{value} in {listed(holders)}" for value, holders in by_value.items())


def check_one_task(variants: list[Variant]) -> None:
    """A one-line ConfigError unless every run is of the first variant's task (classification or
    regression: one table has one headline metric)."""
    first = variants[0]
    for variant in variants:
        for summary in variant.summaries:
            if _task(summary) != _task(first.summaries[0]):
                raise ConfigError(
                    f"report: variant '{variant.name}' is a {_task(summary)} task and '{first.name}' a "
                    f"{_task(first.summaries[0])} task; one jaxfed report per task"
                )


def _task(summary: dict) -> str:
    return "regression" if summary.get("task") == "regression" else "classification"


SETTING_KEYS = ("dataset", "model", "num_clients", "participation", "partition", "alpha", "rounds")


def setting(variants: list[Variant]) -> tuple[str, list[str]]:
    """The runs' setting as one line (each of :data:`SETTING_KEYS` with its value, or the variants
    holding each value where they differ), and the keys that differ between variants."""
    parts, differing = [], []
    for key in SETTING_KEYS:
        holders: dict[str, list[str]] = {}
        for v in variants:
            for config in v.configs:
                value = flat_config(config).get(key)
                if value is not None and v.name not in holders.setdefault(show(value, key), []):
                    holders[show(value, key)].append(v.name)
        if len(holders) == 1:
            parts.append(f"{key} {next(iter(holders))}")
        elif holders:
            differing.append(key)
            parts.append(f"{key} " + " / ".join(f"{value} ({', '.join(names)})" for value, names in holders.items()))
    return "; ".join(parts), differing


def headline_metric(variant: Variant) -> str:
    """``personalized_acc_mean``, or ``personalized_mse_mean`` for a regression task."""
    return "personalized_mse_mean" if _task(variant.summaries[0]) == "regression" else "personalized_acc_mean"


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def summarize(variant: Variant, metrics: tuple[str, ...]) -> dict[str, tuple[float, float] | None]:
    """``{metric: (mean, std)}`` over the variant's seeds (None where a run lacks the metric)."""
    out = {}
    for metric in metrics:
        values = [s.get(metric) for s in variant.summaries]
        out[metric] = mean_std(values) if all(v is not None for v in values) else None
    return out


class Verdict(NamedTuple):
    difference: float  # mean(A) - mean(B), in the claim's direction
    standard_error: float
    outcome: str  # reproduced, not reproduced or inconclusive


def verdict(a: list[float], b: list[float], higher_is_better: bool = True, margin: float = 0.0) -> Verdict:
    """The claim "A is better than B" (with a ``margin``: "A is no more than ``margin`` worse
    than B") judged against the seeds' spread: reproduced when the difference (plus the margin)
    exceeds :data:`SE_FACTOR` standard errors, not reproduced when it is that far the other way,
    inconclusive otherwise (always inconclusive with one seed on either side)."""
    (mean_a, std_a), (mean_b, std_b) = mean_std(a), mean_std(b)
    difference = (mean_a - mean_b) * (1 if higher_is_better else -1) + margin
    se = math.sqrt(std_a**2 / len(a) + std_b**2 / len(b))
    if len(a) < 2 or len(b) < 2:
        return Verdict(difference, se, "inconclusive")
    if difference > SE_FACTOR * se:
        return Verdict(difference, se, "reproduced")
    if difference < -SE_FACTOR * se:
        return Verdict(difference, se, "not reproduced")
    return Verdict(difference, se, "inconclusive")


def paired_standard_error(a: dict[int, float], b: dict[int, float]) -> float | None:
    """The standard error of the per-seed differences ``a[seed] - b[seed]`` when both variants
    ran the same seeds (at least two): the runs of one seed share their partition and
    initialization, so pairing removes what the seeds do to both. None otherwise."""
    if set(a) != set(b) or len(a) < 2:
        return None
    return mean_std([a[seed] - b[seed] for seed in a])[1] / math.sqrt(len(a))


def by_seed(variant: Variant, metric: str) -> dict[int, float]:
    """``{seed: metric}`` over the variant's runs (a run without a seed in its config counts as
    seed 0, as ``jaxfed run`` defaults)."""
    return {0 if seed is None else seed: s[metric] for seed, s in zip(variant.seeds, variant.summaries)}


class Claim(NamedTuple):
    better: str  # variant A
    than: str  # variant B
    margin: float = 0.0  # "A > B - margin": A within ``margin`` of B, or above it

    def __str__(self) -> str:
        return f"{self.better} > {self.than}" + (f" − {self.margin:g}" if self.margin else "")


_CLAIM = re.compile(r"^\s*(?P<a>[^>]+?)\s*>\s*(?P<b>[^>]+?)(?:\s*-\s*(?P<margin>\d+(?:\.\d*)?|\.\d+))?\s*$")


def parse_claim(text: str) -> Claim:
    """``"A>B"`` -> ``Claim("A", "B")``; ``"A>B-0.03"`` -> ``Claim("A", "B", 0.03)`` (A at most
    0.03 worse than B). A variant name ending in ``-NUMBER`` cannot be the B of a claim."""
    if ">=" in text:
        raise ConfigError(f"--claim: '{text}': write 'A>B' (A above B; a tie within the seeds' spread is inconclusive)")
    match = _CLAIM.match(text)
    if not match:
        raise ConfigError(f"--claim: expected 'VARIANT>VARIANT' or 'VARIANT>VARIANT-MARGIN', got '{text}'")
    return Claim(match["a"], match["b"], float(match["margin"] or 0.0))


def parse_paper_value(text: str) -> tuple[str, str]:
    """``"fedavg=84.39"`` -> ``("fedavg", "84.39")``: a paper's reported number for a variant,
    shown as written (papers report percent, fractions or "n/a")."""
    name, sep, value = text.rpartition("=")  # a grid's variant names hold "=" too
    if not sep or not name.strip() or not value.strip():
        raise ConfigError(f"--paper: expected 'VARIANT=NUMBER', got '{text}'")
    return name.strip(), value.strip()


def _fmt(stat: tuple[float, float] | None, digits: int = 4, seeds: int = 2) -> str:
    """``mean ± std``; the value alone for one seed (it has no spread)."""
    if stat is None:
        return "n/a"
    return f"{stat[0]:.{digits}f}" + (f" ± {stat[1]:.{digits}f}" if seeds > 1 else "")


def _bytes(stat: tuple[float, float] | None) -> str:
    from jaxfed.core import human_bytes

    return "n/a" if stat is None else human_bytes(stat[0])


def _ratio(value: float | None, reference: float | None) -> str:
    return "" if value is None or not reference else f" ({value / reference:.3f})"


def _variant_named(by_name: dict[str, Variant], name: str, option: str) -> Variant:
    if name not in by_name:
        raise ConfigError(f"{option}: unknown variant '{name}'; variants: {', '.join(by_name)}")
    return by_name[name]


def markdown(
    variants: list[Variant],
    claims: list[Claim] = (),
    paper: dict[str, str] | None = None,
    relative_to: str | None = None,
) -> str:
    """The table (mean ± std over seeds; the paper's number per variant where ``paper`` gives
    one; upload and total traffic, as a fraction of ``relative_to``'s too; where some variant's
    clients keep part of the broadcast between rounds, the total traffic with that cache too) and
    each claim's verdict."""
    metric = headline_metric(variants[0])
    kind = "mse" if metric.endswith("mse_mean") else "acc"
    for claim in claims:
        if kind == "acc" and claim.margin >= 1:
            raise ConfigError(
                f"--claim '{claim}': the margin is in accuracy's units, a fraction (0.03 is 3 points), "
                f"got {claim.margin:g}"
            )
    by_name = {v.name: v for v in variants}
    paper = paper or {}
    for name in paper:
        _variant_named(by_name, name, "--paper")
    traffic = ("bytes_up_total", "bytes_total") + (("bytes_total_cached",) if _any_cache(variants) else ())
    reference = {}
    if relative_to is not None:
        stats = summarize(_variant_named(by_name, relative_to, "--relative-to"), traffic)
        reference = {m: stats[m][0] if stats[m] else None for m in traffic}
    columns = ["variant", "seeds", f"personalized {kind} (mean ± std)"] + (["paper"] if paper else [])
    columns += [f"global {kind}", "uploaded", "total traffic"]
    columns += ["total traffic, clients caching"] if "bytes_total_cached" in traffic else []
    columns += ["per seed (in seed order)"]
    summary_line, _ = setting(variants)
    lines = [f"{metric} after each run's last round (summary.json); {summary_line}", ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for v in variants:
        stats = summarize(v, (metric, f"global_{kind}", *traffic))
        seeds = len(v.runs)
        cells = [v.name, str(seeds), _fmt(stats[metric], seeds=seeds)] + ([paper.get(v.name, "")] if paper else [])
        cells.append(_fmt(stats[f"global_{kind}"], seeds=seeds))
        cells += [_bytes(stats[m]) + _ratio(stats[m] and stats[m][0], reference.get(m)) for m in traffic]
        cells.append(", ".join("null" if s[metric] is None else f"{s[metric]:.4f}" for s in v.summaries))
        lines.append("| " + " | ".join(cells) + " |")
    if relative_to is not None:
        sent = any(reference.values())
        lines += [
            "",
            f"Traffic in brackets: the fraction of {relative_to}'s."
            if sent
            else f"{relative_to} sent nothing: no fractions of its traffic.",
        ]
    if "bytes_total_cached" in traffic:
        lines += [
            "",
            "Total traffic, clients caching: each client downloads only what it needs (the algorithm's "
            "download_bytes: a FedLoRU-family client keeps the frozen W and downloads what changed since; a "
            "FedSPU client downloads its sub-model) (summary: bytes_total_cached).",
        ]
    if claims:
        better = "lower" if kind == "mse" else "higher"
        columns = ["difference", "standard error", "verdict", "paired standard error"]
        header = f"| claim ({better} {metric} is better) | " + " | ".join(columns) + " |"
        lines += ["", header, "|" + "---|" * (len(columns) + 1)]
        for claim in claims:
            a, b = (_variant_named(by_name, name, "--claim") for name in (claim.better, claim.than))
            values_a, values_b = [s[metric] for s in a.summaries], [s[metric] for s in b.summaries]
            if None in values_a + values_b:  # null: a run's metric was not finite (NaN, inf)
                lines.append(f"| {claim} | n/a | n/a | not judged: a run's {metric} is null (not finite) | n/a |")
                continue
            result = verdict(values_a, values_b, kind == "acc", claim.margin)
            paired = paired_standard_error(by_seed(a, metric), by_seed(b, metric))
            one_seed = min(len(values_a), len(values_b)) < 2  # no spread to judge against
            se = "n/a" if one_seed else f"{result.standard_error:.4f}"
            cells = [str(claim), f"{result.difference:+.4f}", se, result.outcome]
            cells.append("n/a" if paired is None else f"{paired:.4f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _any_cache(variants: list[Variant]) -> bool:
    """Whether some run's clients download less when they keep what they received before."""
    return any(
        s.get("bytes_total_cached") is not None and s["bytes_total_cached"] != s["bytes_total"]
        for v in variants
        for s in v.summaries
    )


def per_seed_records(variants: list[Variant]) -> list[dict]:
    """One record per run: the variant, the run directory and its summary's numbers."""
    keep = (
        "seed", "personalized_acc_mean", "personalized_mse_mean", "global_acc", "global_mse",
        "best_personalized_acc", "best_personalized_mse", "bytes_up_total", "bytes_total", "bytes_total_cached",
        "rounds",
    )  # fmt: skip
    records = []
    for v in variants:
        for run, summary, seed in zip(v.runs, v.summaries, v.seeds):
            records.append({"variant": v.name, "run": str(run), **{k: summary.get(k) for k in keep}, "seed": seed})
    return records


def plot(variants: list[Variant], out_file: Path) -> Path:
    """The headline metric against the round: each variant's mean over seeds, its spread (±1
    std) shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = headline_metric(variants[0])
    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    for v in variants:
        # the rounds every seed evaluated (eval_every may differ between them): a mean over all of them
        rounds = sorted(set.intersection(*({r["round"] for r in rows if r.get(metric) is not None} for rows in v.rows)))
        stats = []
        for round_ in rounds:
            values = [r[metric] for rows in v.rows for r in rows if r["round"] == round_ and r.get(metric) is not None]
            stats.append(mean_std(values))
        means = [m for m, _ in stats]
        line = ax.plot(rounds, means, marker=".", label=f"{v.name} (n={len(v.runs)})")[0]
        ax.fill_between(rounds, [m - s for m, s in stats], [m + s for m, s in stats], color=line.get_color(), alpha=0.2)
    name = metric.replace("_", " ")
    ax.set(xlabel="round", ylabel=name, title=f"{name}: mean over seeds, ±1 std shaded")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(out_file, dpi=110)
    plt.close(fig)
    return out_file


def write_report(
    variants: dict[str, Path],
    out_dir: Path,
    claims: list[str] = (),
    paper: list[str] = (),
    relative_to: str | None = None,
    log=None,
) -> dict[str, Path]:
    """``report.md`` (the table and the verdicts), ``report.json`` and ``report.csv`` (per seed),
    ``report.png`` (the curves with their spread) in ``out_dir``. ``claims`` as ``"A>B"`` or
    ``"A>B-MARGIN"``, ``paper`` as ``"VARIANT=NUMBER"``. ``log(line)`` (default: stderr) is told
    of runs left out unfinished and of variants on different datasets."""
    log = log or (lambda line: print(line, file=sys.stderr))
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    collected = collect(variants)
    parsed = [parse_claim(c) for c in claims]
    table = markdown(collected, parsed, dict(parse_paper_value(p) for p in paper), relative_to)
    for name, directory in variants.items():
        left = unfinished_runs(directory)
        if left:
            log(f"report: {name}: {len(left)} unfinished run(s) left out (no summary.json): " + listed(left))
    if "dataset" in setting(collected)[1]:
        log("report: the variants ran on different datasets (report.md's first line says which); verdicts compare them")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {name: out_dir / f"report.{name}" for name in ("md", "json", "csv", "png")}
    files["md"].write_text(table)
    records = per_seed_records(collected)
    files["json"].write_text(json_text(records, indent=2) + "\n")
    with open(files["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    plot(collected, files["png"])
    return files
