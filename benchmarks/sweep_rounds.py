"""A sweep's round against one member's: the compiled round of M members (seeds 0..M-1) per
member, vmapped (``member_chunk=0``) and one after another in the program (``member_chunk=1``),
against one member's own compiled round, plus the fraction of local steps that are useful when
the members' clients run nested (each member as many steps as the member with the largest client
at that rank) and as one client axis (the default for vmapped members).

    python benchmarks/sweep_rounds.py [--members 8] [--workload digits|w1] [--data-dir DIR] [--set key=value ...]

``w1`` is ``jaxfed bench``'s W1 (MNIST CNN, 1000 clients, 100 a round; needs ``--data-dir``).
Compile time is left out: every figure is the median of ``--calls`` calls of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from jaxfed.cli.bench import local_steps, workload_config
from jaxfed.cli.bench.measure import timed
from jaxfed.runs.build import build
from jaxfed.runs.config import Config
from jaxfed.runs.sweep import Sweep, sweep_configs


def useful_fractions(configs: list[Config], rounds: int, client_chunk: int) -> dict:
    """Useful local steps over steps run, for the members' clients nested (a vmapped chunk of
    each member side by side) and as one client axis (the members' k-th clients side by side),
    with clients largest first in chunks of ``client_chunk`` (0: all at once); a vmapped chunk
    runs as many steps as its largest client."""
    steps = []  # [member, round, rank]
    for config in configs:
        sim = build(config).simulation
        steps.append(np.stack([local_steps(sim, config, r) for r in range(rounds)]).astype(float))
    steps = np.stack(steps)
    members, _, n = steps.shape

    def steps_run(items, width):  # items: [rounds, k] in run order, in vmapped blocks of width
        items = np.concatenate([items, np.zeros((rounds, -items.shape[1] % width))], axis=1)
        return float(np.sum(items.reshape(rounds, -1, width).max(-1)) * width)

    chunk = client_chunk or n
    ranks = np.concatenate([steps, np.zeros((members, rounds, -n % chunk))], axis=2)
    nested = ranks.reshape(members, rounds, -1, chunk).transpose(1, 2, 0, 3).reshape(rounds, -1)
    one_axis = steps.transpose(1, 2, 0).reshape(rounds, -1)
    useful = float(steps.sum())
    return {
        "nested": useful / steps_run(nested, members * chunk),
        "one_axis": useful / steps_run(one_axis, client_chunk or members * n),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--workload", choices=("digits", "w1"), default="digits")
    parser.add_argument("--data-dir", default="")
    parser.add_argument("--set", nargs="*", default=[], dest="overrides")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    overrides = [*([f"data_dir={args.data_dir}"] if args.data_dir else []), *args.overrides]
    base = workload_config("w1", overrides) if args.workload == "w1" else Config().with_overrides(overrides)
    base = base.validate()
    results = {
        "device": str(jax.devices()[0]),
        "workload": args.workload,
        "overrides": args.overrides,
        "members": args.members,
    }

    alone = build(base).simulation
    state = alone.init()
    seconds = timed(lambda: alone.run_rounds(state, args.rounds), repeats=args.calls)
    results["one_member_round_s"] = seconds / args.rounds
    configs = sweep_configs(base, list(range(args.members)))
    for member_chunk in (0, 1):
        sweep = Sweep([c.with_overrides([f"member_chunk={member_chunk}"]) for c in configs])
        states = sweep.init()
        sweep.run_rounds(states, args.rounds)  # compiles
        executable = sweep._executables[args.rounds]
        seconds = timed(executable, sweep.seeds, sweep.values, states, sweep.data, repeats=args.calls)
        results[f"member_chunk={member_chunk}_round_s_per_member"] = seconds / args.rounds / args.members
    results["useful_steps"] = useful_fractions(configs, args.rounds, alone.client_chunk)
    one = results["one_member_round_s"]
    print(
        f"{args.members} members, {args.workload} {' '.join(args.overrides)} ({results['device']}, client_chunk "
        f"{alone.client_chunk}): one member {one * 1e3:.1f} ms/round; per member vmapped "
        f"{results['member_chunk=0_round_s_per_member'] * 1e3:.1f} ms "
        f"({results['member_chunk=0_round_s_per_member'] / one:.2f}x), one after another "
        f"{results['member_chunk=1_round_s_per_member'] * 1e3:.1f} ms "
        f"({results['member_chunk=1_round_s_per_member'] / one:.2f}x); useful steps nested "
        f"{results['useful_steps']['nested']:.3f}, one axis {results['useful_steps']['one_axis']:.3f}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
