"""``jaxfed sweep`` against running the same configurations one after another.

    python benchmarks/sweep.py [--seeds 0,1,2,3] [--lrs 0.05] [--set key=value ...]

Both write every member's run directory (evaluations, checkpoints, plots included); the
sequential side is ``jaxfed run``'s ``run()`` per configuration in this process. Prints the wall
time of each, the speedup, and the largest difference of the members' final personalized
accuracy between the two (the same computation, so float32 rounding only).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from jaxfed.runs.config import Config
from jaxfed.runs.driver import run
from jaxfed.runs.sweep import member_name, run_sweep, sweep_configs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--lrs", default="")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    base = Config().with_overrides(args.set).validate()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    lrs = [float(v) for v in args.lrs.split(",") if v]
    configs = sweep_configs(base, seeds, lrs)
    with tempfile.TemporaryDirectory() as tmp:
        tick = time.perf_counter()
        swept = run_sweep(configs, [Path(tmp, "sweep", member_name(c)) for c in configs], progress=False)
        sweep_seconds = time.perf_counter() - tick
        tick = time.perf_counter()
        alone = [run(c, Path(tmp, "alone", member_name(c)), progress=False) for c in configs]
        sequential_seconds = time.perf_counter() - tick
    key = "personalized_acc_mean" if "personalized_acc_mean" in swept[0] else "personalized_mse_mean"
    difference = max(abs(a[key] - b[key]) for a, b in zip(swept, alone))
    print(
        f"{len(configs)} members ({', '.join(member_name(c) for c in configs)}; {' '.join(args.set) or 'defaults'}): "
        f"sweep {sweep_seconds:.1f} s, one after another {sequential_seconds:.1f} s -> "
        f"{sequential_seconds / sweep_seconds:.2f}x; largest {key} difference {difference:.1e}"
    )
    print(
        f"  sweep compile {swept[0]['compile_seconds']:.1f} s, round {swept[0]['round_seconds_median']:.4f} s "
        f"(all members); one run: compile {alone[0]['compile_seconds']:.1f} s, "
        f"round {alone[0]['round_seconds_median']:.4f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
