"""Bytes of client state each device holds: the stacked client states and per-client index tables
are split over the devices of a one-process mesh (``host_devices`` CPU devices here).

    python benchmarks/client_state_bytes.py [--devices 8] [--set algorithm=feddecomp num_clients=16 ...]

Prints JSON: the devices, the client state's total bytes and the bytes on device 0, and the
accuracy after two rounds (compare with ``--devices 1``: equal to float tolerance).
"""

from __future__ import annotations

import argparse
import json

from jaxfed.runs.distributed import split_host


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8, help="CPU devices to split the host into")
    parser.add_argument("--set", nargs="*", default=["algorithm=feddecomp", "num_clients=16", "participation=0.5"])
    args = parser.parse_args()
    if args.devices > 1:
        split_host(args.devices)  # before JAX starts its backend
    import jax

    from jaxfed.runs.build import build
    from jaxfed.runs.config import Config

    host = [f"host_devices={args.devices}"] if args.devices > 1 else []
    sim = build(Config().with_overrides([*args.set, *host]).validate()).simulation
    state, _ = sim.run_rounds(sim.init(), 2)
    per_client = jax.tree.leaves(state.clients) + [sim.data.train_idx, sim.data.test_idx]
    first = jax.devices()[0]
    on_first = sum(s.data.nbytes for x in per_client for s in x.addressable_shards if s.device == first)
    print(
        json.dumps(
            {
                "devices": sim.num_devices,
                "client_bytes": sum(x.nbytes for x in per_client),
                "client_bytes_on_device_0": on_first,
                "personalized_acc_mean": sim.evaluate(state)["personalized_acc_mean"],
            }
        )
    )


if __name__ == "__main__":
    main()
