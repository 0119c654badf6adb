"""Time per client per round as the sampled clients grow (the W2 model: the digits MLP, 64
training examples per client drawn from the pool, one epoch of batch 32). Prints a table and JSON,
and writes a PNG.

    python benchmarks/scaling.py [--clients 10,100,1000,10000] [--rounds 3] [--png F.png] [--json F] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json

from jaxfed.cli.bench import time_rounds, workload_config


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="10,100,1000,10000", help="sampled clients per round to time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--png", default="scaling.png")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    rows = []
    for sampled in (int(c) for c in args.clients.split(",")):
        config = workload_config("w2", [f"num_clients={sampled}", "participation=1", "rounds_per_call=1", *args.set])
        timed = time_rounds(config, args.rounds)
        rows.append(
            {
                "sampled_clients": sampled,
                "client_chunk": timed["sim"].client_chunk,
                "round_seconds": timed["round_seconds_median"],
                "ms_per_client": 1e3 * timed["round_seconds_median"] / sampled,
                "compile_seconds": timed["compile_seconds"],
            }
        )
        r = rows[-1]
        print(
            f"{sampled:>6} clients: {r['round_seconds']:.4f} s/round, {r['ms_per_client']:.3f} ms per client",
            flush=True,
        )
    print(json.dumps(rows, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8), constrained_layout=True)
    ax.plot([r["sampled_clients"] for r in rows], [r["ms_per_client"] for r in rows], marker="o")
    ax.set(xscale="log", xlabel="sampled clients per round", ylabel="ms per client per round", title="W2 scaling")
    ax.grid(alpha=0.3)
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
