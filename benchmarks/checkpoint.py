"""Checkpoint cost: size and save / restore time of a simulation state, and the overhead of
``checkpoint_every`` on a whole run. Prints JSON.

    python benchmarks/checkpoint.py --data-dir DATA            # MNIST cnn, 1000 clients
    python benchmarks/checkpoint.py --data-dir DATA --part overhead
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

import jax

from jaxfed.core import tree_bytes
from jaxfed.runs.build import build
from jaxfed.runs.checkpoint import RunCheckpoints, load_state, save_state
from jaxfed.runs.config import Config
from jaxfed.runs.distributed import split_host_for
from jaxfed.runs.driver import run


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def state_cost(config: Config, repeats: int) -> dict:
    """Save (blocking, and the run's asynchronous save: time until training may go on) and
    restore of ``config``'s initial state, median of ``repeats``."""
    split_host_for([config])  # this script is its process's entry
    sim = build(config).simulation
    state = jax.block_until_ready(sim.init())
    saves, async_returns, async_totals, restores = [], [], [], []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        for i in range(repeats):
            path = Path(tmp) / f"state{i}"
            tick = time.perf_counter()
            save_state(path, state)
            saves.append(time.perf_counter() - tick)
            tick = time.perf_counter()
            jax.block_until_ready(load_state(path, like=state))
            restores.append(time.perf_counter() - tick)
            size = directory_bytes(path)
            shutil.rmtree(path)
            checkpoints = RunCheckpoints(Path(tmp) / f"run{i}", keep=1)
            tick = time.perf_counter()
            checkpoints.save(1, state, {"rows": []})
            async_returns.append(time.perf_counter() - tick)
            checkpoints.wait()
            async_totals.append(time.perf_counter() - tick)
            checkpoints.close()
            shutil.rmtree(Path(tmp) / f"run{i}")

    def median(xs):
        return sorted(xs)[len(xs) // 2]

    return {
        "algorithm": config.algorithm,
        "num_clients": config.num_clients,
        "state_bytes": tree_bytes(state),
        "checkpoint_bytes": size,
        "save_seconds": median(saves),
        "restore_seconds": median(restores),
        "async_save_blocks_seconds": median(async_returns),
        "async_save_total_seconds": median(async_totals),
    }


def overhead(config: Config) -> list[dict]:
    results = []
    for every in (0, 10):
        with tempfile.TemporaryDirectory(dir=".") as tmp:
            tick = time.perf_counter()
            summary = run(dataclasses.replace(config, checkpoint_every=every), Path(tmp) / "run", progress=False)
            results.append(
                {
                    "algorithm": config.algorithm,
                    "checkpoint_every": every,
                    "wall_seconds": time.perf_counter() - tick,
                    "compile_seconds": summary["compile_seconds"],
                    "round_seconds_median": summary["round_seconds_median"],
                }
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="")
    parser.add_argument("--part", choices=("state", "overhead", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    base = Config(dataset="mnist", data_dir=args.data_dir, num_clients=1000, participation=0.1, min_examples=10)
    base = base.with_overrides(["local_epochs=1", "lr=0.005", *args.set])
    if args.part in ("state", "both"):
        for algorithm in ("fedavg", "local"):
            print(
                json.dumps(
                    state_cost(
                        base.with_overrides([f"algorithm={algorithm}", "local_epochs=1", "lr=0.005", *args.set]),
                        args.repeats,
                    )
                )
            )
    if args.part in ("overhead", "both"):
        small = dataclasses.replace(base, num_clients=100, rounds=30, eval_every=10).with_overrides(args.set)
        for algorithm in ("fedavg", "local"):
            for row in overhead(
                small.with_overrides([f"algorithm={algorithm}", "local_epochs=1", "lr=0.005", *args.set])
            ):
                print(json.dumps(row))


if __name__ == "__main__":
    main()
