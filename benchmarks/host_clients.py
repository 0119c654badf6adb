"""Client states in host memory (``client_state=host``) against on the device, one run each.

    python benchmarks/host_clients.py [--limit-mb 64] [--calls 5] [--set KEY=VALUE ...]

FedDecomp (each client keeps private low-rank parts) with many clients: the stacked client states
exceed the device memory limit set with ``--limit-mb``. For each layout it prints the compiled
call's memory (XLA's memory analysis: arguments, outputs and temporaries, which on a real
accelerator must fit the limit), the seconds per round (median over ``--calls`` timed calls of
``rounds_per_call`` rounds, after one untimed call that compiles) and whether the two layouts'
states and metrics are identical, and their evaluations. ``--set`` is applied over
:data:`DEFAULT` (FedDecomp, 2000 resampled digits clients, 20 a round). Each call donates the
host-held states, as the run loop does (they are written back in place). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from jaxfed.core import tree_bytes
from jaxfed.runs.build import build
from jaxfed.runs.config import Config

DEFAULT = [
    "algorithm=feddecomp",
    "num_clients=2000",
    "participation=0.01",
    "partition=resample",
    "client_train_size=16",
    "local_epochs=2",
    "batch_size=16",
]


def run(config: Config, calls: int, rounds: int):
    sim = build(config.validate()).simulation
    state = sim.init()
    memory = sim.compiled(state, rounds).memory_analysis()
    peak = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    state, _ = sim.run_rounds(state, rounds, donate=True)  # compiles
    seconds, metrics = [], []
    for _ in range(calls):
        start = time.perf_counter()
        state, m = sim.run_rounds(state, rounds, donate=True)
        jax.block_until_ready(state)
        seconds.append((time.perf_counter() - start) / rounds)
        metrics.append(m)
    return sim, state, metrics, peak, statistics.median(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit-mb", type=float, default=64.0, help="the device memory limit to compare against")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds-per-call", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="run keys over the defaults (DEFAULT)")
    args = parser.parse_args()
    base = Config().with_overrides(DEFAULT + args.set)
    results, runs = {}, {}
    for where in ("device", "host"):
        sim, state, metrics, peak, per_round = run(
            base.with_overrides([f"client_state={where}"]), args.calls, args.rounds_per_call
        )
        runs[where] = (state, metrics, sim.evaluate(state))
        results[where] = {"call_bytes": int(peak), "seconds_per_round": round(per_round, 4)}
    (a, ma, ea), (b, mb, eb) = runs["device"], runs["host"]
    same = all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves((a, ma)), jax.tree.leaves((b, mb)))
    )
    limit = int(args.limit_mb * 2**20)
    client_bytes = tree_bytes(a.clients)
    print(
        json.dumps(
            {
                "set": DEFAULT + args.set,
                "platform": jax.devices()[0].platform,
                "limit_bytes": limit,
                "client_state_bytes": client_bytes,
                "client_state_exceeds_limit": client_bytes > limit,
                **{f"{where}_{k}": v for where, r in results.items() for k, v in r.items()},
                "host_call_fits_limit": results["host"]["call_bytes"] <= limit,
                "device_call_fits_limit": results["device"]["call_bytes"] <= limit,
                "states_and_metrics_identical": bool(same),
                "evaluation_identical": all(
                    np.array_equal(x, y, equal_nan=True) for x, y in zip(jax.tree.leaves(ea), jax.tree.leaves(eb))
                ),
                "personalized_acc_mean": eb["personalized_acc_mean"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
