"""The results table of a FLoRAL run.sh: one row per variant, one column per task.

    python experiments/floral/table.py runs/floral

Each cell is the last evaluation's personalized metric (MSE on the synthetic tasks, accuracy on
the image tasks) from ``<runs>/<task>/<variant>/``: one run directory, or a sweep's seeds (then
mean ± sample std, through ``jaxfed.cli.report``; each task's ``report/`` holds the verdicts).
"""

from __future__ import annotations

import sys
from pathlib import Path

from jaxfed.cli.report import collect, headline_metric, run_dirs, summarize

VARIANTS = [
    "fedavg",
    "local_adaptor",
    "floral",
    "floral_oracle",
    "floral_10",
    "floral_10_oracle",
    "ensemble",
    "ensemble_oracle",
    "ditto",
    "ifca",
]


def cell(directory: Path) -> str:
    if not directory.is_dir() or not run_dirs(directory):
        return "-"
    (variant,) = collect({directory.name: directory})
    metric = headline_metric(variant)
    mean, std = summarize(variant, (metric,))[metric]
    return f"{mean:.4f} ± {std:.4f}" if len(variant.runs) > 1 else f"{mean:.4f}"


def main(runs: str) -> None:
    root = Path(runs)
    tasks = sorted(p.name for p in root.iterdir() if p.is_dir())
    print("| variant | " + " | ".join(tasks) + " |")
    print("|---" * (len(tasks) + 1) + "|")
    for variant in VARIANTS:
        if any((root / t / variant).exists() for t in tasks):
            print(f"| {variant} | " + " | ".join(cell(root / t / variant) for t in tasks) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/floral")
