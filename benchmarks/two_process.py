"""Two processes, one simulation: ``jax.distributed`` on loopback with CPU (gloo) collectives,
checked against one process.

    python benchmarks/two_process.py [--rounds 6] [--set key=value ...]

It starts two worker processes of one CPU device each (process 0 is the coordinator on
127.0.0.1), which build the same simulation over the two-process mesh: each process trains half
of the sampled clients, the server update reduces across processes. Then one process with two
forced host devices (the same mesh layout) and one process with one device run the same config.
It prints each run's time, the per-round train losses' and final evaluation's largest difference
between the two-process run and each single-process run, and exits 1 if the two-process result
differs from the single process with two devices by more than float32 rounding.

The simulation itself needs nothing special: with a mesh, ``Simulation`` replicates its data and
state on it, and the sampled-client axis is sharded over it whether its devices belong to one
process or several. A worker only calls ``jax.distributed.initialize`` first.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT = ["num_clients=40", "participation=0.5", "local_epochs=1"]


def simulate(overrides: list[str], rounds: int) -> dict:
    """Build ``overrides``' simulation over all visible devices, run ``rounds``, evaluate."""
    import jax
    import numpy as np

    from jaxfed.runs.build import build
    from jaxfed.runs.config import Config

    sim = build(Config().with_overrides([*DEFAULT, *overrides, "checkpoint_every=0"]).validate()).simulation
    state = sim.init()
    state, _ = sim.run_rounds(state, 1)  # compile + first round
    jax.block_until_ready(state)
    tick = time.perf_counter()
    state, metrics = sim.run_rounds(state, rounds - 1)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - tick
    return {
        "processes": jax.process_count(),
        "devices": sim.num_devices,
        "seconds_per_round": seconds / max(rounds - 1, 1),
        "train_loss": np.asarray(metrics["train_loss"]).tolist(),
        "evaluation": {k: v for k, v in sim.evaluate(state).items() if k != "clients"},  # summaries: JSON
    }


def worker(args) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=2, process_id=args.process)
    result = simulate(args.set, args.rounds)
    if args.process == 0:
        Path(args.result).write_text(json.dumps(result))
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _python(argv: list[str], devices: int) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen([sys.executable, __file__, *argv], env=env)


def _largest_difference(a: dict, b: dict) -> float:
    losses = [abs(x - y) for x, y in zip(a["train_loss"], b["train_loss"])]
    evaluation = [abs(a["evaluation"][k] - b["evaluation"][k]) for k in a["evaluation"]]
    return max(losses + evaluation)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--process", type=int, help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process is not None:
        worker(args)
        return 0

    passed = [a for s in args.set for a in ("--set", s)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        port, out = _free_port(), Path(tmp) / "two_process.json"
        common = ["--rounds", str(args.rounds), "--port", str(port), "--result", str(out), *passed]
        workers = [_python([*common, "--process", str(p)], devices=1) for p in (0, 1)]
        if any(w.wait(timeout=600) for w in workers):
            print("two_process: a worker failed", file=sys.stderr)
            return 1
        results["2 processes x 1 device"] = json.loads(out.read_text())
        for devices in (2, 1):
            single = Path(tmp) / f"single{devices}.json"
            code = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import two_process as t; "
            code += f"open({str(single)!r}, 'w').write(json.dumps(t.simulate({args.set!r}, {args.rounds})))"
            env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
            subprocess.run([sys.executable, "-c", code], env=env, check=True)
            results[f"1 process x {devices} device(s)"] = json.loads(single.read_text())

    reference = results["2 processes x 1 device"]
    for name, r in results.items():
        difference = _largest_difference(reference, r)
        print(
            f"{name}: {r['seconds_per_round']:.3f} s/round, personalized acc "
            f"{r['evaluation']['personalized_acc_mean']:.6f}, largest difference from 2 processes {difference:.2e}"
        )
    same = _largest_difference(reference, results["1 process x 2 device(s)"]) <= 1e-6
    print(f"two processes give the one-process (2 devices) result: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
