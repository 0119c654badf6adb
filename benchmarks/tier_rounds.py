"""Tiered algorithms' rounds at W1 against FedAvg's: XLA's FLOP count of the compiled round
(cost analysis) and the round time, with every tier's clients in one group (``pad_tier``) and
with one group per tier (each padded to ``min(sampled, tier size)``).

    python benchmarks/tier_rounds.py --data-dir DIR [--set client_chunk=0] [--out FILE.json]

W1: MNIST CNN, 1000 clients, 100 a round (``jaxfed bench``'s). ``client_chunk=0`` vmaps every
sampled client at once (the accelerator's way); with chunks of one (CPU's default) the engine runs
tiers per group, as they cost less there. XLA counts a loop's body once, so the FLOP count is one
local step of every client plus the round's work outside the loops (broadcast, decoding uploads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

from jaxfed.cli.bench import workload_config
from jaxfed.runs.build import build

ALGORITHMS = ("fedavg", "fedhm", "fedara", "mfedloru")


def measure(sim, calls: int) -> dict:
    state = sim.init()
    compiled = sim.compiled(state, 1)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    state, _ = sim.run_rounds(state, 1)
    jax.block_until_ready(state)
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        state, _ = sim.run_rounds(state, 1)
        jax.block_until_ready(state)
        seconds.append(time.perf_counter() - start)
    return {"gflop": cost["flops"] / 1e9, "round_seconds": statistics.median(seconds), "chunk": sim.client_chunk}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--set", nargs="*", default=[], dest="overrides")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = {"device": str(jax.devices()[0]), "overrides": args.overrides}
    for name in ALGORITHMS:
        config = workload_config("w1", [f"algorithm={name}", f"data_dir={args.data_dir}", *args.overrides])
        sim = build(config).simulation
        modes = {"as_built": sim}
        if sim.algorithm.pad_tier is not None and sim._tiers_in_one_group():
            modes["per_tier"] = sim.variant(sim.root, sim.algorithm._replace(pad_tier=None))
        for member in modes.values():
            row = measure(member, args.calls)
            mode = "one_group" if member.tiers is None or member._tiers_in_one_group() else "per_tier"
            results[f"{name}/{mode}"] = row
            print(name, mode, json.dumps(row), flush=True)
    base = results["fedavg/one_group"]
    for key, row in results.items():
        if isinstance(row, dict) and "gflop" in row:
            row["flops_x_fedavg"] = row["gflop"] / base["gflop"]
            row["time_x_fedavg"] = row["round_seconds"] / base["round_seconds"]
            print(f"{key:24s} {row['flops_x_fedavg']:.2f}x flops  {row['time_x_fedavg']:.2f}x time")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
