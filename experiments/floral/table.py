"""The results table of a FLoRAL sweep: one row per variant, one column per task.

    python experiments/floral/table.py runs/floral

Each cell is the last evaluation's personalized metric (MSE on the synthetic tasks, accuracy on
the image tasks), from ``<runs>/<task>/<variant>/summary.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VARIANTS = [
    "fedavg",
    "local_adaptor",
    "floral",
    "floral_oracle",
    "floral_10",
    "floral_10_oracle",
    "ensemble",
    "ensemble_oracle",
]


def cell(summary_file: Path) -> str:
    if not summary_file.exists():
        return "-"
    s = json.loads(summary_file.read_text())
    kind = "mse" if s.get("task") == "regression" else "acc"
    return f"{s[f'personalized_{kind}_mean']:.4f}"


def main(runs: str) -> None:
    root = Path(runs)
    tasks = sorted(p.name for p in root.iterdir() if p.is_dir())
    print("| variant | " + " | ".join(tasks) + " |")
    print("|---" * (len(tasks) + 1) + "|")
    for variant in VARIANTS:
        if any((root / t / variant).exists() for t in tasks):
            print(f"| {variant} | " + " | ".join(cell(root / t / variant / "summary.json") for t in tasks) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/floral")
