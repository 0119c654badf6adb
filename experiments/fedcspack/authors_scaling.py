"""The setting fmnist_authors_data with the authors' input scaling: images to [-1, 1]
(torchvision's ``Normalize([0.5], [0.5])``) where jaxfed's loader standardizes each channel.

Arrays passed from Python are used as given, so this script scales the authors' clients (written
by ``authors_data.py``) itself and runs one algorithm as ``run.sh DATA fmnist_authors_data`` would::

    python experiments/fedcspack/authors_data.py DATA /tmp/adata
    python experiments/fedcspack/authors_scaling.py /tmp/adata fedavg /tmp/scaled_fedavg [--seed 0] [--set k=v ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import jaxfed
from jaxfed.data import Dataset, federate, load_partition
from jaxfed.runs.build import DataPart, build_algorithm, build_model, build_simulation
from jaxfed.runs.config import read_config_file

HERE = Path(__file__).parent


def scaled(images: np.ndarray) -> np.ndarray:
    """uint8 images ``(N, H, W)`` as float32 ``(N, H, W, 1)`` in [-1, 1]."""
    return ((images.astype(np.float32) / 255.0 - 0.5) / 0.5)[..., None]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("authors_data", type=Path, help="authors_data.py's output directory")
    parser.add_argument("algorithm", help="fedavg, fedcspack, ...")
    parser.add_argument("out", help="the run directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override config keys")
    args = parser.parse_args()
    parts_file = args.authors_data / "authors_parts.npz"
    pairs = [
        *read_config_file(HERE / "fmnist_authors.conf"),
        *read_config_file(HERE / "fmnist_authors_data.conf"),
        f"algorithm={args.algorithm}",
        f"partition_file={parts_file}",
        f"model={HERE / 'models.py'}:AuthorsFMNISTCNN",
        f"seed={args.seed}",
        *args.set,
    ]
    config = jaxfed.Config().validated_with(pairs)
    with np.load(args.authors_data / "fashion_mnist.npz") as f:
        data = Dataset("fashion_mnist", scaled(f["x_train"]), f["y_train"], scaled(f["x_test"]), f["y_test"], 10)
    train, test = load_partition(parts_file, config.num_clients, len(data.y_train), len(data.y_test))
    part = DataPart(federate(data, train, test), data.input_shape, 10, len(data.y_train), {})
    model = build_model(config, part)
    simulation = build_simulation(config, build_algorithm(config, model), model, part)
    summary = jaxfed.run_simulation(
        simulation, args.out, jaxfed.LoopSettings.of(config), config={**config.to_dict(), "input_scaling": "[-1, 1]"}
    )
    accuracy, global_accuracy = summary["personalized_acc_mean"], summary["global_acc"]
    print(f"{args.algorithm}: personalized acc {accuracy:.4f}, global {global_accuracy:.4f}")


if __name__ == "__main__":
    main()
