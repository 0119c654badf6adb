"""Round time of FedAvg: the engine (jit + vmap over clients, rounds under lax.scan) against the
same work as a Python loop over a jitted per-client update.

Default workload (the foundation issue's): MNIST, model `cnn`, 1000 clients, 100 per round,
1 local epoch, batch 32, Dirichlet 0.5, SGD lr 0.005. Needs mnist.npz in --data-dir
(on the offline machines: `python ../shared/data/unpack.py DIR`).

    python benchmarks/fedavg_round.py --data-dir DIR [--rounds 5] [--set key=value ...]

The loop baseline gives each client only its own steps (its index list padded to a multiple of
the batch size, one compiled executable per distinct step count, all compiled before timing),
then averages the uploads weighted by sample count: the way a per-client framework trains.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.algorithms import RoundInfo
from jaxfed.data import ClientData
from jaxfed.runs.build import build
from jaxfed.runs.config import Config
from jaxfed.runs.distributed import split_host_for
from jaxfed.simulation import sampling, server_step

WORKLOAD = [
    "dataset=mnist",
    "model=cnn",
    "num_clients=1000",
    "participation=0.1",
    "local_epochs=1",
    "batch_size=32",
    "partition=dirichlet",
    "alpha=0.5",
    "min_examples=10",
    "lr=0.005",
]


def engine_round_seconds(sim, rounds: int, rounds_per_call: int):
    state = sim.init()
    state, _ = sim.run_rounds(state, rounds_per_call)  # compile + warm up
    jax.block_until_ready(state)
    times = []
    for _ in range(max(1, rounds // rounds_per_call)):
        tick = time.perf_counter()
        state, metrics = sim.run_rounds(state, rounds_per_call)
        jax.block_until_ready((state, metrics))
        times.append((time.perf_counter() - tick) / rounds_per_call)
    return statistics.median(times), sim.compile_seconds


def loop_round_seconds(sim, rounds: int, batch_size: int):
    """A Python loop over the sampled clients, each running the jitted per-client update alone."""
    alg, data = sim.algorithm, sim.data
    counts = np.asarray(data.train_count)
    table = np.asarray(data.train_idx)
    update = jax.jit(alg.client_update)

    def view(k):
        padded = -(-int(counts[k]) // batch_size) * batch_size
        indices = np.zeros(padded, np.int32)
        indices[: counts[k]] = table[k, : counts[k]]
        return ClientData(x=data.x_train, y=data.y_train, indices=jnp.asarray(indices), count=jnp.int32(counts[k]))

    state = sim.init()
    client_state = jax.tree.map(lambda x: x[0], state.clients)
    server = state.server
    compile_start = time.perf_counter()
    for steps in sorted({-(-int(c) // batch_size) for c in counts}):
        k = int(np.flatnonzero(-(-counts // batch_size) == steps)[0])
        first = RoundInfo(round=jnp.int32(0), tier=0)
        jax.block_until_ready(update(alg.broadcast(server, first), client_state, view(k), jax.random.key(0), first))
    compile_seconds = time.perf_counter() - compile_start
    server_update = jax.jit(lambda server, stacked, weights, t: server_step(alg, server, stacked, weights, t))

    times, useful = [], []
    for t in range(rounds):
        tick = time.perf_counter()
        key = sampling.round_key(sim.root, t)
        ids = np.asarray(sampling.sample_clients(sim.root, key, sim.num_clients, sim.num_sampled))
        info = RoundInfo(round=jnp.int32(t), tier=0)
        message = alg.broadcast(server, info)
        rngs = sampling.client_keys(key, jnp.asarray(ids))  # the engine's per-client keys
        uploads = []
        for k, rng in zip(ids, rngs):
            _, up, _ = update(message, client_state, view(int(k)), rng, info)
            uploads.append(up)
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *uploads)
        server = server_update(server, stacked, jnp.asarray(counts[ids], jnp.float32), info.round)
        jax.block_until_ready(server)
        times.append(time.perf_counter() - tick)
        real = -(-counts[ids] // batch_size)
        useful.append(real.sum() / (real.max() * len(ids)))  # if all sampled clients were vmapped
    return statistics.median(times), compile_seconds, float(np.mean(useful))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="", help="directory with mnist.npz (not needed for digits)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rounds-per-call", type=int, default=1)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--skip-loop", action="store_true")
    args = parser.parse_args()

    config = Config().with_overrides(WORKLOAD + [f"data_dir={args.data_dir}"] + args.set)
    split_host_for([config])  # this script is its process's entry
    sim = build(config).simulation
    engine_s, engine_compile = engine_round_seconds(sim, args.rounds, args.rounds_per_call)
    result = {
        "workload": WORKLOAD + args.set,
        "devices": [str(d) for d in jax.devices()][: sim.num_devices],
        "engine_round_seconds_median": engine_s,
        "engine_compile_seconds": engine_compile,
        "rounds_per_call": args.rounds_per_call,
    }
    if not args.skip_loop:
        loop_s, loop_compile, useful = loop_round_seconds(sim, args.rounds, config.options.batch_size)
        result.update(
            loop_round_seconds_median=loop_s,
            loop_compile_seconds=loop_compile,
            speedup_engine_vs_loop=loop_s / engine_s,
            vmap_all_useful_step_fraction=useful,
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
