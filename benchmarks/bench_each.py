"""``jaxfed bench WORKLOAD`` for each value of one config key, in one process: the device starts
once and XLA's autotuning results carry over between the values' compilations (the GPU suite's
w3 step: the algorithms' rounds share FedAvg's CNN layers). One JSON per value, as ``jaxfed bench
--json`` writes it; a value that fails is reported and the others still run (exit 1 if any failed).

    python benchmarks/bench_each.py w3 --each algorithm=fedhm,fedara,mfedloru --data-dir DATA \\
        --rounds 10 --baseline none --json "OUT/w3_{}.json" [--profile "OUT/trace_w3_{}"] [--set KEY=VALUE ...]

``{}`` in ``--json`` and ``--profile`` is the value. The peak memory a JSON reports is the
process's: for every value after the first it is the peak over that value and the ones before it
(``peak_memory_scope`` says so).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

from jaxfed.cli.bench import run_benchmark, summary_lines


def parse_each(text: str) -> tuple[str, list[str]]:
    key, _, values = text.partition("=")
    if not key or not values:
        raise SystemExit(f"--each: expected KEY=VALUE,VALUE,..., got '{text}'")
    return key, values.split(",")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("--each", required=True, metavar="KEY=V1,V2,...")
    parser.add_argument("--data-dir")
    parser.add_argument("--set", nargs="*", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", default="none")
    parser.add_argument("--json", required=True, metavar="FILE_WITH_{}")
    parser.add_argument("--profile", default="", metavar="DIR_WITH_{}")
    args = parser.parse_args(argv)
    key, values = parse_each(args.each)
    for flag, path in (("--json", args.json), ("--profile", args.profile)):
        if path and len(values) > 1 and "{}" not in path:
            raise SystemExit(f"{flag}: '{path}' has no {{}} for the value: each value would overwrite the last")
    base = ([f"data_dir={args.data_dir}"] if args.data_dir else []) + args.overrides
    failed = []
    for i, value in enumerate(values):
        start = time.perf_counter()
        try:
            result = run_benchmark(
                args.workload,
                [*base, f"{key}={value}"],
                rounds=args.rounds,
                baseline=args.baseline,
                profile=args.profile.replace("{}", value),
            )
        except Exception:  # one value's failure leaves the others' results
            traceback.print_exc()
            failed.append(value)
            continue
        result["process_seconds"] = time.perf_counter() - start
        if i > 0:
            result["peak_memory_scope"] = f"this process's: {key}={','.join(values[: i + 1])}, not {value} alone"
        with open(args.json.replace("{}", value), "w") as f:
            json.dump(result, f, indent=2)
        print(f"== {key}={value} ({result['process_seconds']:.1f} s)\n" + "\n".join(summary_lines(result)), flush=True)
    if failed:
        print(f"failed: {key}={','.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
