"""A round's memory grows with the chunk of clients run together, not with the clients per round.

XLA's memory analysis of the compiled round (it works on CPU; nothing is allocated) for W2 (FedAvg,
the digits MLP, clients of ``client_train_size`` examples drawn from the pool, every client sampled)
at each client count in chunks of ``--chunk``: the engine's summed contributions against
stacking every upload of the round before the server's step (the engine before reductions,
rebuilt here as a ``server_update``). Then, with ``--run N``, one real round of N clients.

    python benchmarks/round_memory.py [--clients 10000,1000000] [--chunk 10000] [--stacked-up-to 100000]
                                      [--run 200000] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import jax
import jax.numpy as jnp

from jaxfed.cli.bench import workload_config
from jaxfed.contract import RoundInfo
from jaxfed.runs.build import build

GIB = 2**30


def stacking(alg):
    """``alg`` whose aggregation receives every upload stacked, reduced after all clients ran."""

    def server_update(server_state, messages, weights, info):
        row = RoundInfo(round=info.round, tier=0)
        shares = jax.vmap(lambda m, w: alg.aggregation.contribute(server_state, m, w, row))(messages, weights)
        kept = jax.tree.map(lambda s: jnp.where((weights > 0).reshape((-1,) + (1,) * (s.ndim - 1)), s, 0), shares)
        return alg.aggregation.apply(server_state, jax.tree.map(lambda s: jnp.sum(s, axis=0), kept), info)

    return alg._replace(aggregation=None, server_update=server_update)


def simulation(clients: int, chunk: int, overrides, stacked=False):
    config = workload_config(
        "w2", [f"num_clients={clients}", "participation=1", f"client_chunk={chunk}", "rounds_per_call=1", *overrides]
    )
    sim = build(config).simulation
    if stacked:
        sim = sim.variant(sim.root, stacking(sim.algorithm))
    return sim


def compiled_round(sim):
    start = time.perf_counter()
    with sim.precision():
        compiled = jax.jit(sim.rounds_pure, static_argnums=2).lower(sim.init(), sim.data, 1).compile()
    return compiled, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="10000,1000000", help="clients per round to analyse")
    parser.add_argument("--chunk", type=int, default=10000, help="clients vmapped together (client_chunk)")
    parser.add_argument("--stacked-up-to", type=int, default=100000, help="analyse the stacking path up to this")
    parser.add_argument("--run", type=int, default=0, help="then run one round of this many clients (0: none)")
    parser.add_argument("--set", action="append", default=["client_train_size=8", "client_test_size=2"])
    args = parser.parse_args()

    rows = []
    for clients in (int(c) for c in args.clients.split(",")):
        for stacked in (False, True):
            if stacked and clients > args.stacked_up_to:
                continue
            sim = simulation(clients, args.chunk, args.set, stacked)
            compiled, seconds = compiled_round(sim)
            memory = compiled.memory_analysis()
            rows.append(
                {
                    "clients": clients,
                    "path": "stacked uploads" if stacked else "summed contributions",
                    "temp_gib": memory.temp_size_in_bytes / GIB,
                    "argument_gib": memory.argument_size_in_bytes / GIB,
                    "compile_seconds": round(seconds, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            del sim, compiled
    summed = {r["clients"]: r["temp_gib"] for r in rows if r["path"] == "summed contributions"}
    smallest = min(summed)
    for clients, temp in sorted(summed.items()):
        print(f"summed contributions, {clients:>8} clients: temp {temp:.3f} GiB = {temp / summed[smallest]:.3f}x")

    if args.run:
        sim = simulation(args.run, args.chunk, args.set)
        state = sim.init()
        start = time.perf_counter()
        state, metrics = sim.run_rounds(state, 1)
        jax.block_until_ready(state)
        first = time.perf_counter() - start
        start = time.perf_counter()
        state, metrics = sim.run_rounds(state, 1)
        jax.block_until_ready(state)
        result = {
            "run_clients": args.run,
            "first_round_seconds (with compile)": round(first, 1),
            "round_seconds": round(time.perf_counter() - start, 1),
            "train_loss": float(metrics["train_loss"][0]),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2),
            "acc": sim.evaluate(state)["personalized_acc_mean"],
        }
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
