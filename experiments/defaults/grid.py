"""Every algorithm's defaults on every dataset's default model: two rounds each, a table.

    python experiments/defaults/grid.py [--out experiments/defaults/grid.md] [--data-dir DIR]
                                        [--datasets mnist,cifar10] [--algorithms fedavg,fedara]

Each image dataset is stood in for by the embedded digits resized to its shape (see
``tests/test_defaults.py``), unless ``--data-dir`` holds the real ``<dataset>.npz``; the
generated regression tasks are themselves. Every run has 6 clients, all sampled, 2 rounds and
the algorithm's own defaults. A cell is the personalized accuracy (MSE for regression) after the
two rounds, ``NaN`` where an update went non-finite, or the one-line refusal. The suite runs the
cheap part of this grid (every algorithm on digits, FedLoRU on the MNIST CNN).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from test_defaults import stand_in  # noqa: E402

from jaxfed.algorithms import registry  # noqa: E402
from jaxfed.data import default_model  # noqa: E402
from jaxfed.errors import ConfigError, NonFiniteUpdateError  # noqa: E402
from jaxfed.runs.build import build  # noqa: E402
from jaxfed.runs.config import Config  # noqa: E402

IMAGES = {"mnist": (28, 1), "fashion_mnist": (28, 1), "cifar10": (32, 3), "cifar100": (32, 3)}
DATASETS = ["digits", "mnist", "fashion_mnist", "cifar10", "cifar100", "synthetic_linear", "synthetic_mlp"]


def cell(algorithm: str, dataset: str, data_dir: str) -> str:
    config = Config(algorithm=algorithm, dataset=dataset, data_dir=data_dir, num_clients=6, participation=1.0)
    try:
        sim = build(config.validate()).simulation
        state, _ = sim.run_rounds(sim.init(), 2)
    except NonFiniteUpdateError as err:
        return f"NaN ({err})"
    except ConfigError as err:
        return f"refused: {err}"
    evaluation = sim.evaluate(state)
    key = "personalized_mse_mean" if "personalized_mse_mean" in evaluation else "personalized_acc_mean"
    return f"{evaluation[key]:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("grid.md")))
    parser.add_argument("--data-dir", help="real <dataset>.npz files (default: digits stand-ins)")
    parser.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated columns (default: all)")
    parser.add_argument("--algorithms", default="", help="comma-separated rows (default: every registered one)")
    args = parser.parse_args()
    datasets = args.datasets.split(",")
    algorithms = args.algorithms.split(",") if args.algorithms else registry.names()
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="jaxfed-stand-in-")
    if not args.data_dir:
        for name, (size, channels) in IMAGES.items():
            stand_in(name, Path(data_dir), size, channels)
    header = [f"{d} ({default_model(d)})" for d in datasets]
    lines = ["| algorithm | " + " | ".join(header) + " |", "|---" * (len(datasets) + 1) + "|"]
    start = time.perf_counter()
    for algorithm in algorithms:
        cells = [cell(algorithm, dataset, data_dir) for dataset in datasets]
        lines.append(f"| {algorithm} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    source = "real data in " + args.data_dir if args.data_dir else "digits stand-ins"
    note = f"\n6 clients, 2 rounds, each algorithm's defaults, {source}; {time.perf_counter() - start:.0f} s.\n"
    Path(args.out).write_text("\n".join(lines) + "\n" + note)
    print(note)


if __name__ == "__main__":
    main()
