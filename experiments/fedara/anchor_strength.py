"""How strongly does FedARA's anchor term hold the features, and how far apart are its readings?

Runs a FedARA configuration for some rounds, then lets a few clients run their next round from
the same state at several lambdas (one ``client_update`` each, same key). Per client it prints the
features' scale, the anchor distance before training (``anchor_loss=mean``), how far the tier's
truncated FE is from the full-rank global FE in feature space (what ``anchor_model=global``
changes), cos(feature, anchor) (what ``anchor_loss=normalized`` sees), and, per lambda, the
distance to the anchors after the local epochs, how far the features moved and the training CE.

    python experiments/fedara/anchor_strength.py --config experiments/fedara/reduced.conf \
        --data-dir DATA --set rounds=10 lambda=0
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.algorithms import RoundInfo
from jaxfed.algorithms.features import class_anchors
from jaxfed.algorithms.fedara import anchor_drift, fedara
from jaxfed.cli import add_config_arguments, config_from_args
from jaxfed.core import lowrank
from jaxfed.core.losses import masked_loss
from jaxfed.data import ClientData
from jaxfed.nn.factorized import factorized_execution
from jaxfed.nn.layers import head_input
from jaxfed.runs.build import build
from jaxfed.runs.distributed import split_host_for


def features_of(model, fe, head_params, x):
    """``(features, logits)`` of ``x`` under the FE ``fe`` (factorized or full) and the head."""
    with factorized_execution():
        (features, logits), _ = head_input(model, "head", {"params": lowrank.replace_layer(fe, "head", head_params)}, x)
    return features, logits


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser)
    parser.add_argument("--clients", default="0,5,10,15,19", help="comma-separated client ids")
    parser.add_argument("--lambdas", default="0,2,20", help="comma-separated lambdas of the next round")
    args = parser.parse_args(argv)
    args.algorithm = "fedara"
    config = config_from_args(args)
    split_host_for([config])  # this script is its process's entry
    sim = build(config).simulation
    state, _ = sim.run_rounds(sim.init(), config.rounds)
    accuracy = sim.evaluate(state)["personalized_acc_mean"]
    print(f"fedara on {config.dataset}, after {config.rounds} rounds: personalized acc {accuracy:.4f}")
    model, alg, num_tiers = sim.model, sim.algorithm, sim.algorithm.num_tiers
    lambdas = [float(v) for v in args.lambdas.split(",")]
    options = {lam: config.options.with_values({"lambda": lam}) for lam in lambdas}
    updates = {lam: jax.jit(fedara(model, options[lam]).client_update) for lam in lambdas}
    for k in (int(v) for v in args.clients.split(",")):
        tier = k * num_tiers // sim.num_clients
        data = sim.data.train_data(jnp.array([k]))
        data = ClientData(data.x, data.y, data.indices[0], data.count[0])
        info = RoundInfo(round=state.round, tier=tier)  # the next round, for this client's tier
        client = jax.tree.map(lambda a, k=k: a[k], state.clients)
        message = alg.broadcast(state.server, info)
        positions = np.asarray(data.indices)[: int(data.count)]
        x, y = jnp.asarray(np.asarray(data.x)[positions]), jnp.asarray(np.asarray(data.y)[positions])
        with factorized_execution():
            frozen = {"params": lowrank.replace_layer(message.fe, "head", client.head)}
            anchors, _ = class_anchors(model, "head", frozen, data, config.options.batch_size)
        before, _ = features_of(model, message.fe, client.head, x)
        full, _ = features_of(model, state.server.fe, client.head, x)
        cosine = 1 - anchor_drift(before, anchors[y], "normalized") / 2
        print(
            f"client {k} (tier {tier}): |f|^2/D {float(jnp.mean(before**2)):.4g}, "
            f"mean-MSE to anchor {float(jnp.mean(anchor_drift(before, anchors[y], 'mean'))):.4g}, "
            f"truncated vs full FE {float(jnp.mean((before - full) ** 2)):.3g}, cos {float(jnp.mean(cosine)):.4f}"
        )
        for lam in lambdas:
            new_client, upload, metrics = updates[lam](message, client, data, jax.random.key(1), info)
            after, logits = features_of(model, upload, new_client.head, x)
            print(
                f"  lambda {lam:g} (lambda_t {float(metrics['lambda']):g}): "
                f"mean-MSE to anchor {float(jnp.mean(anchor_drift(after, anchors[y], 'mean'))):.4g}, "
                f"moved {float(jnp.mean((after - before) ** 2)):.4g}, "
                f"CE {float(masked_loss(logits, y, jnp.ones_like(y, bool))):.4f}"
            )


if __name__ == "__main__":
    main()
