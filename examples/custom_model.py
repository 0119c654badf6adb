"""A custom Flax model through two low-rank algorithms, from research code.

The model is written with stock ``nn.Conv`` / ``nn.Dense`` layers and a plain ``__call__(x)``;
``Model.wrap`` makes it a jaxfed model. FedHM factorizes its interior layers (the second conv
and the first Dense run as two thin convs / matmuls) and FedDecomp gives every kernel a
private low-rank part. Each run writes a run directory (metrics, checkpoints, summary, plots)
through ``jaxfed.run_simulation``, as ``jaxfed run`` does::

    python examples/custom_model.py --rounds 10 --out runs/custom_model
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import numpy as np

import jaxfed
from jaxfed.algorithms.feddecomp import feddecomp
from jaxfed.algorithms.fedhm import FedHMOptions, fedhm
from jaxfed.data import federate, load_dataset, partition
from jaxfed.nn import Model
from jaxfed.simulation import Simulation


class SmallConvNet(nn.Module):
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))
        x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
        return nn.Dense(self.classes)(x)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="runs/custom_model")
    parser.add_argument("--clients", type=int, default=10, help="clients (at least 3: FedHM's three tiers)")
    parser.add_argument("--algorithms", default="fedhm,feddecomp", help="comma-separated: fedhm, feddecomp")
    args = parser.parse_args(argv)

    digits = load_dataset("digits")  # embedded: no download
    train, test = partition(
        "dirichlet", digits.y_train, digits.y_test, args.clients, np.random.default_rng(0), alpha=0.5
    )
    data = federate(digits, train, test)
    model = Model.wrap(SmallConvNet(digits.num_classes), digits.input_shape)

    algorithms = {
        "fedhm": fedhm(model, FedHMOptions(tiers=(1.0, 0.5, 0.25), local_epochs=1, batch_size=32, lr=0.05)),
        "feddecomp": feddecomp(model, local_epochs=2, batch_size=32, lr=0.05),
    }
    summaries = {}
    for name in args.algorithms.split(","):
        algorithm = algorithms[name]
        sim = Simulation(algorithm, model, data, participation=1.0, seed=0)
        settings = jaxfed.LoopSettings(rounds=args.rounds, eval_every=5, checkpoint_every=5)
        summaries[name] = jaxfed.run_simulation(sim, f"{args.out}/{name}", settings, progress=False)
        print(f"{name}: personalized acc {summaries[name]['personalized_acc_mean']:.4f} -> {args.out}/{name}")
    return summaries


if __name__ == "__main__":
    main()
