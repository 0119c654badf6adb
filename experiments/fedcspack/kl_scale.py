"""How large is FedCSPACK's KL term beside the cosine, on real packs?

Runs a FedCSPACK configuration for some rounds, then lets every client of the next round train
from the global model and scores its packs as the algorithm does: the cosine ``theta_j`` and
``beta_j = KL(softmax(global_j) || softmax(local_j))`` of every selected pack. Prints quantiles of
``beta``, of ``|theta|`` and of their ratio, and the largest relative change the KL term makes to a
double weight ``|theta + beta|`` against ``|theta|`` (the paper's Table 3 compares the two).

    python experiments/fedcspack/kl_scale.py                        # embedded digits, defaults
    python experiments/fedcspack/kl_scale.py --config experiments/fedcspack/fmnist.conf \
        --data-dir DATA --set rounds=10
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.algorithms import RoundInfo
from jaxfed.algorithms.fedcspack import score_and_select
from jaxfed.cli import add_config_arguments, config_from_args
from jaxfed.core import packs as pk
from jaxfed.data import ClientData
from jaxfed.runs.build import build
from jaxfed.runs.distributed import split_host_for


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    args.algorithm = "fedcspack"
    config = config_from_args(args)
    split_host_for([config])  # this script is its process's entry
    sim = build(config).simulation
    state, _ = sim.run_rounds(sim.init(), config.rounds)
    alg, options = sim.algorithm, config.options
    info = RoundInfo(round=state.round, tier=0)  # the next round
    message = alg.broadcast(state.server, info)
    view = pk.pack_view(message.params, options.pack_size)
    update = jax.jit(alg.client_update)
    betas, thetas = [], []
    for k in range(sim.num_clients):
        data = sim.data.train_data(jnp.array([k]))
        client = jax.tree.map(lambda a, k=k: a[k], state.clients)
        view_k = ClientData(data.x, data.y, data.indices[0], data.count[0])
        new_client, upload, _ = update(message, client, view_k, jax.random.key(k), info)
        local, global_ = view.to_packs(new_client.params), view.to_packs(message.params)
        indices, sent, _ = score_and_select(local, global_, view.num_packs, options.weight)
        chosen = np.asarray(indices)[np.asarray(sent)]
        thetas.append(np.asarray(pk.pack_cosine(local, global_))[chosen])
        betas.append(np.asarray(pk.pack_kl(local, global_))[chosen])
    theta, beta = np.concatenate(thetas), np.concatenate(betas)
    change = np.abs(np.abs(theta + beta) - np.abs(theta)) / np.maximum(np.abs(theta), 1e-12)
    q = (0.5, 0.9, 1.0)
    print(f"fedcspack on {config.dataset}, after {config.rounds} rounds: {theta.size} packs below the threshold")
    print("quantiles 50% / 90% / max")
    print("  beta (KL)           " + " / ".join(f"{v:.3g}" for v in np.quantile(beta, q)))
    print("  |theta| (cosine)    " + " / ".join(f"{v:.3g}" for v in np.quantile(np.abs(theta), q)))
    print("  beta / |theta|      " + " / ".join(f"{v:.3g}" for v in np.quantile(beta / np.abs(theta), q)))
    print("  weight change by KL " + " / ".join(f"{v:.3g}" for v in np.quantile(change, q)))


if __name__ == "__main__":
    main()
