"""FedCSPACK's Fashion-MNIST clients as the authors' data script makes them, for jaxfed to run.

The authors' ``dataset/generate_FashionMNIST.py`` (PFLlib's generator) pools the 60 000 training
and 10 000 test images, splits the pool over 20 clients with PFLlib's Dirichlet rule (per class,
proportions ~ Dir(alpha); a client already holding n / clients gets none of the next class; the
draw repeats until every client has ``min(batch / (1 - train_ratio), n / clients / 2)`` = 64
examples), with numpy's legacy generator seeded 1, and then splits each client 75 / 25 into its
own training and test sets. Their runs train and evaluate the first 30% of the clients
(``sampling=first``).

This script repeats those draws in the same order (per class: a shuffle of its 7 000 examples,
then the Dirichlet proportions), so every client gets the class counts the authors' clients get.
Which images fill a count differs (the shared copy of Fashion-MNIST is sorted by class), and so
does each client's 75 / 25 split of its classes (the sizes are theirs: ceil(25%) for test).

Writes ``OUT/fashion_mnist.npz`` (training arrays: every client's training split, client by
client; test arrays: every client's test split, so the global accuracy is over the pooled
clients' test sets, images no client trained on) and ``OUT/authors_parts.npz`` (the partition
file). ``experiments/fedcspack/run.sh DATA fmnist_authors_data`` runs it before its runs; alone::

    python experiments/fedcspack/authors_data.py DATA_DIR OUT [--alpha 0.3]
    jaxfed run fedcspack --config experiments/fedcspack/fmnist_authors.conf --data-dir OUT \\
        --set partition=file partition_file=OUT/authors_parts.npz sampling=first
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from jaxfed.data import save_partition

NUM_CLIENTS = 20
BATCH_SIZE = 16
TRAIN_RATIO = 0.75
SEED = 1


def authors_clients(labels: np.ndarray, alpha: float, rng: np.random.RandomState) -> list[np.ndarray]:
    """Indices of ``labels`` per client, PFLlib's Dirichlet rule with ``rng``'s draws in its order."""
    n = len(labels)
    least = int(min(BATCH_SIZE / (1 - TRAIN_RATIO), n / NUM_CLIENTS / 2))
    smallest = 0
    while smallest < least:
        parts = [[] for _ in range(NUM_CLIENTS)]
        for c in range(int(labels.max()) + 1):
            members = np.flatnonzero(labels == c)
            rng.shuffle(members)
            shares = rng.dirichlet(np.repeat(alpha, NUM_CLIENTS))
            shares = shares * np.array([len(p) < n / NUM_CLIENTS for p in parts])
            cuts = (np.cumsum(shares / shares.sum()) * len(members)).astype(int)[:-1]
            for part, chunk in zip(parts, np.split(members, cuts)):
                part.extend(chunk.tolist())
        smallest = min(len(p) for p in parts)
    return [np.array(p, np.int64) for p in parts]


def split_client(indices: np.ndarray, rng: np.random.RandomState) -> tuple[np.ndarray, np.ndarray]:
    """A client's (train, test) indices: a shuffled 75 / 25 split, ceil(25%) for test."""
    order = rng.permutation(indices)
    num_test = math.ceil(len(indices) * (1 - TRAIN_RATIO))
    return order[num_test:], order[:num_test]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", type=Path, help="a directory with fashion_mnist.npz")
    parser.add_argument("out", type=Path, help="where to write fashion_mnist.npz and authors_parts.npz")
    parser.add_argument("--alpha", type=float, default=0.3, help="Dirichlet alpha (the paper's Table 1: 0.3)")
    args = parser.parse_args()
    with np.load(args.data_dir / "fashion_mnist.npz") as data:
        x = np.concatenate([data["x_train"], data["x_test"]])
        y = np.concatenate([data["y_train"], data["y_test"]])
    rng = np.random.RandomState(SEED)
    splits = [split_client(part, rng) for part in authors_clients(y, args.alpha, rng)]
    train = np.concatenate([tr for tr, _ in splits])
    test = np.concatenate([te for _, te in splits])
    train_sizes = np.cumsum([0] + [len(tr) for tr, _ in splits])
    test_sizes = np.cumsum([0] + [len(te) for _, te in splits])
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(args.out / "fashion_mnist.npz", x_train=x[train], y_train=y[train], x_test=x[test], y_test=y[test])
    save_partition(
        args.out / "authors_parts.npz",
        [np.arange(a, b) for a, b in zip(train_sizes[:-1], train_sizes[1:])],
        [np.arange(a, b) for a, b in zip(test_sizes[:-1], test_sizes[1:])],
    )
    for k, (tr, te) in enumerate(splits):
        counts = np.bincount(y[np.concatenate([tr, te])], minlength=10)
        print(f"client {k:2d}: {len(tr):5d} train, {len(te):4d} test, classes {counts.tolist()}")


if __name__ == "__main__":
    main()
