"""The client axis over 1, 2 and 8 forced CPU devices: seconds per round and speedup.

    python benchmarks/devices.py [--workloads w2,w1] [--devices 1,2,8] [--data-dir DATA] [--rounds 3]

Each point is ``jaxfed bench WORKLOAD --baseline none`` in a fresh process with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (the device count is fixed when JAX starts).
The sampled clients are dealt to the devices by size (``ClientStrategy.map_clients``); each device
runs its share with the default strategy. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def bench(workload: str, devices: int, rounds: int, data_dir: str | None, extra: list[str]) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = ["-m", "jaxfed.cli", "bench", workload, "--baseline", "none", "--rounds", str(rounds)]
        argv += ["--json", str(out), *(["--data-dir", data_dir] if data_dir else [])]
        argv += [a for s in extra for a in ("--set", s)]
        subprocess.run([sys.executable, *argv], env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="w2,w1")
    parser.add_argument("--devices", default="1,2,8")
    parser.add_argument("--data-dir")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    print("| workload | devices | s/round | speedup vs 1 device | evaluate all clients (s) |")
    print("|---|---|---|---|---|")
    for workload in args.workloads.split(","):
        base = None
        for devices in (int(d) for d in args.devices.split(",")):
            r = bench(workload, devices, args.rounds, args.data_dir, args.set)
            seconds = r["round_seconds_median"]
            base = base or seconds
            print(
                f"| {workload} | {r['devices']} | {seconds:.3f} | {base / seconds:.2f}x | "
                f"{r['eval_all_clients_seconds']:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
