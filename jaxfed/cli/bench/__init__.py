"""``jaxfed bench``: throughput of the engine on fixed workloads, against a PyTorch per-client loop.

Per workload it reports the compile time apart, the steady-state seconds per round (median over
at least 5 compiled calls), client updates and examples per second, the achieved GFLOP/s of the
useful training work (the FLOPs of one local step of the algorithm per example, counted from the
step's own arithmetic by :mod:`jaxfed.cli.bench.flops`, whatever XLA lowers a convolution to,
times the examples of a round) against the machine's measured matmul GFLOP/s (at full float32
and at the default precision, medians of 10 calls), peak memory, and the time to evaluate every
client. ``--strategies`` times the client-parallel strategies (``client_chunk``: 0 vmaps all
sampled clients, k runs ``lax.map`` over chunks of k vmapped clients). ``--baseline torch`` runs
the same rounds as a PyTorch per-client loop on the same accelerator (CUDA where JAX runs on a
GPU; threads from the CPU affinity) and reports the ratio, with both accuracies to show equal
work. ``--profile DIR`` traces the timed calls again under the profiler and summarizes the
device's kernels (:mod:`jaxfed.cli.bench.profile`: kernels a round and per local step in
sequence, the device's busy fraction, the costliest kernels).

Workloads (``--set key=value`` changes any config key):

- ``w1``: FedAvg, MNIST, ``cnn``, 1000 clients, Dirichlet 0.5 (min 10 examples), 100 per round,
  1 local epoch, batch 32 (last partial batch dropped, as PFLlib), SGD lr 0.005.
- ``w2``: FedAvg, ``mlp`` on digits, 10 000 clients of 64 training / 16 test examples drawn from
  the pool (``partition=resample``), 1000 per round.
- ``w3``: W1's setting with ``--set algorithm=NAME`` (any algorithm; default floral).
- ``w4``: FedDecomp's CIFAR-10 setting with FedAvg: ``resnet8`` (GroupNorm), 40 clients of 500
  training / 100 test examples (``client_dirichlet`` 0.5), all of them every round, 5 local
  epochs of batch 100, SGD lr 0.1 with momentum 0.9 (``--set algorithm=feddecomp`` for its
  own round, ``--baseline none``).
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from jaxfed.cli.bench.flops import local_step_flops
from jaxfed.cli.bench.measure import matmul_gflops, peak_memory_bytes
from jaxfed.data.datasets import default_model
from jaxfed.errors import ConfigError, unknown_choice
from jaxfed.runs.config import Config
from jaxfed.runs.distributed import split_host_for
from jaxfed.simulation.strategy import device_shares, size_ordered_groups

W1 = [
    "algorithm=fedavg",
    "dataset=mnist",
    "model=cnn",
    "num_clients=1000",
    "partition=dirichlet",
    "alpha=0.5",
    "min_examples=10",
    "participation=0.1",
    "local_epochs=1",
    "batch_size=32",
    "drop_last=true",
    "lr=0.005",
]
WORKLOADS = {
    "w1": W1,
    "w2": [
        "algorithm=fedavg",
        "dataset=digits",
        "model=mlp",
        "num_clients=10000",
        "partition=resample",
        "client_train_size=64",
        "client_test_size=16",
        "participation=0.1",
        "local_epochs=1",
        "batch_size=32",
        "drop_last=true",
        "lr=0.005",
    ],
    "w3": [*W1, "algorithm=floral"],
    "w4": [
        "algorithm=fedavg",
        "dataset=cifar10",
        "model=resnet8",
        "partition=client_dirichlet",
        "alpha=0.5",
        "num_clients=40",
        "participation=1.0",
        "client_train_size=500",
        "client_test_size=100",
        "local_epochs=5",
        "batch_size=100",
        "lr=0.1",
        "momentum=0.9",
    ],
}


def workload_config(name: str, overrides=()) -> Config:
    if name not in WORKLOADS:
        raise ConfigError(f"workload: {unknown_choice(name, WORKLOADS)}")
    return Config().with_overrides([*WORKLOADS[name], "checkpoint_every=0", *overrides]).validate()


def examples_per_round(sim, config: Config, rounds: range) -> float:
    """Mean examples a round's sampled clients train on (epochs x each client's steps x batch)."""
    counts = np.asarray(sim.data.train_count)
    per_round = []
    for t in rounds:
        ids = sim.sampled_ids(t)
        n = counts[ids]
        used = (n // config.options.batch_size) * config.options.batch_size if config.options.drop_last else n
        per_round.append(float(used.sum()) * config.options.local_epochs)
    return float(np.mean(per_round))


def local_steps(sim, config: Config, round_index: int) -> np.ndarray:
    """Each of round ``round_index``'s sampled clients' local steps (an epoch's batches, the last
    partial one dropped with ``drop_last``, times the epochs), largest first."""
    n = np.asarray(sim.data.train_count)[sim.sampled_ids(round_index)]
    batch = config.options.batch_size
    per_epoch = n // batch if config.options.drop_last else -(-n // batch)
    return np.sort(per_epoch * config.options.local_epochs)[::-1]


def useful_step_fraction(sim, config: Config, rounds: range, chunk: int = 0) -> float:
    """Real local steps / executed steps over ``rounds`` with ``client_chunk=chunk``
    (:func:`~jaxfed.simulation.strategy.size_ordered_groups`), on each of ``sim``'s devices its
    own share of the clients: every ``num_devices``-th of the size order, padded to a multiple of
    the devices (:meth:`~jaxfed.simulation.strategy.ClientStrategy.run_order`)."""
    real, executed = 0, 0
    for t in rounds:
        real += local_steps(sim, config, t).sum()
        for share in device_steps(sim, config, t):
            executed += sum(group.max() * len(group) for group in size_ordered_groups(share, chunk))
    return float(real / max(executed, 1))


def device_steps(sim, config: Config, round_index: int) -> list[np.ndarray]:
    """Each of ``sim``'s devices' clients of round ``round_index`` as their local steps, as the
    engine deals them (:func:`~jaxfed.simulation.strategy.device_shares`)."""
    return device_shares(local_steps(sim, config, round_index), sim.num_devices)


def sequential_steps(sim, config: Config, rounds: range, chunk: int = 0) -> float:
    """Local steps a round runs one after another with ``client_chunk=chunk``, the mean over
    ``rounds``: on the busiest device (:func:`device_steps`), the sum over its groups of each
    group's largest client's (:func:`~jaxfed.simulation.strategy.size_ordered_groups`)."""
    per_round = [
        max(sum(g.max() for g in size_ordered_groups(share, chunk)) for share in device_steps(sim, config, t))
        for t in rounds
    ]
    return float(np.mean(per_round))


MIN_TIMED_CALLS = 5


def time_rounds(config: Config, rounds: int) -> dict:
    """Build ``config``'s simulation and time it: compile, steady rounds (at least ``rounds``, in
    at least :data:`MIN_TIMED_CALLS` compiled calls), evaluation."""
    from jaxfed.runs.build import build

    tick = time.perf_counter()
    sim = build(config).simulation
    build_seconds = time.perf_counter() - tick
    per_call = max(1, min(config.rounds_per_call, rounds // MIN_TIMED_CALLS))
    state = sim.init()
    state, _ = sim.run_rounds(state, per_call)  # compiles, then warms up
    jax.block_until_ready(state)
    done, times = per_call, []
    while done < per_call + max(rounds, per_call * MIN_TIMED_CALLS):
        tick = time.perf_counter()
        state, metrics = sim.run_rounds(state, per_call)
        jax.block_until_ready((state, metrics))
        times.append((time.perf_counter() - tick) / per_call)
        done += per_call
    sim.evaluate(state)  # compiles the evaluation (its own path and precision, as the timed call runs it)
    tick = time.perf_counter()
    evaluation = sim.evaluate(state)
    eval_seconds = time.perf_counter() - tick
    seconds = statistics.median(times)
    measured = range(per_call, done)
    examples = examples_per_round(sim, config, measured)
    return {
        "sim": sim,
        "build_seconds": build_seconds,
        "compile_seconds": sim.compile_seconds,
        "round_seconds_median": seconds,
        "client_updates_per_second": sim.num_sampled / seconds,
        "examples_per_second": examples / seconds,
        "examples_per_round": examples,
        "useful_step_fraction_vmap_all": useful_step_fraction(sim, config, measured, 0),
        "useful_step_fraction": useful_step_fraction(sim, config, measured, sim.client_chunk),
        "eval_all_clients_seconds": eval_seconds,
        "rounds_timed": len(times) * per_call,
        "timed_calls": len(times),
        "rounds_per_timed_call": per_call,
        "global_acc": evaluation.get("global_acc"),
        "personalized_acc_mean": evaluation.get("personalized_acc_mean"),
    }


def step_flops_per_example(sim, config: Config) -> float:
    """FLOPs of one local step of ``sim``'s algorithm per example of its batch, from the step's
    own arithmetic (:func:`~jaxfed.cli.bench.flops.local_step_flops`); a tiered algorithm's is the
    mean over its clients."""
    tiers = sim.tiers or [(0, sim.num_clients)]  # a tiered algorithm: each tier's step, by its share of clients
    flops = sum((hi - lo) / sim.num_clients * local_step_flops(sim, t) for t, (lo, hi) in enumerate(tiers))
    return flops / config.options.batch_size


# What the PyTorch loop does not implement, at the value where FedAvg's jaxfed round does the same
TORCH_LOOP_FIXED = {"weight_decay": 0.0, "clip_norm": 0.0, "lr_schedule": "constant", "server_optimizer": "none"}


def run_benchmark(
    workload: str,
    overrides=(),
    *,
    rounds: int = 5,
    baseline: str = "torch",
    strategies=(),
    baseline_rounds: int = 0,
    profile: str = "",
) -> dict:
    """Every measurement of one workload, as a JSON-ready dict. The PyTorch loop runs
    ``baseline_rounds`` rounds (0: as many as jaxfed ran, so the global accuracies compare).
    ``profile``: a directory to trace as many calls as were timed into, summarized under
    ``"profile"`` (:mod:`jaxfed.cli.bench.profile`)."""
    config = workload_config(workload, overrides)
    split_host_for([config])  # the process entry of `jaxfed bench`: before anything starts JAX's backend
    if baseline not in ("torch", "none"):
        raise ConfigError(f"--baseline: unknown '{baseline}'; allowed: torch, none")
    if rounds < 1:
        raise ConfigError(f"--rounds: {rounds}; allowed: 1 or more (rounds timed)")
    if baseline_rounds < 0:
        raise ConfigError(f"--baseline-rounds: {baseline_rounds}; allowed: 0 (as many as jaxfed ran) or more")
    if baseline_rounds and baseline != "torch":
        raise ConfigError(f"--baseline-rounds: {baseline_rounds} rounds of no baseline; it needs --baseline torch")
    if baseline == "torch" and config.algorithm != "fedavg":
        raise ConfigError(f"--baseline: torch runs fedavg only, not '{config.algorithm}'; use --baseline none")
    if baseline == "torch":
        from jaxfed.cli.bench.torch_loop import TWINS, require_torch

        model = config.model or default_model(config.dataset)
        if model not in TWINS:
            raise ConfigError(
                f"--baseline: torch has a twin of {', '.join(TWINS)} only, not model '{model}'; use --baseline none"
            )
        given = {key: getattr(config.options, key) for key in TORCH_LOOP_FIXED}
        untwinned = [f"{key}={value}" for key, value in given.items() if value != TORCH_LOOP_FIXED[key]]
        if config.options.client_optimizer not in ("sgd", "momentum"):
            untwinned.insert(0, f"client_optimizer={config.options.client_optimizer}")
        if untwinned:
            raise ConfigError(
                f"--baseline: the torch loop runs plain SGD (momentum allowed) with a constant lr and a plain "
                f"average; it has no {', '.join(untwinned)}: use --baseline none"
            )
        require_torch()  # before minutes of timing, not after
    engine = time_rounds(config, rounds)
    sim = engine.pop("sim")
    flops = step_flops_per_example(sim, config)
    peak, peak_default = matmul_gflops("float32"), matmul_gflops("default")
    achieved = flops * engine["examples_per_second"] / 1e9
    result = {
        "workload": workload,
        "config": [*WORKLOADS[workload], *overrides],
        "device": str(jax.devices()[0]),
        "devices": sim.num_devices,
        "client_chunk": sim.client_chunk,
        **engine,
        "training_gflop_per_round": flops * engine["examples_per_round"] / 1e9,
        "achieved_gflops": achieved,
        "step_flops_per_example": flops,
        "matmul_peak_gflops": peak,
        "matmul_peak_gflops_default_precision": peak_default,
        "fraction_of_matmul_peak": achieved / peak,
        **peak_memory_bytes(),
    }
    if profile:
        result["profile"] = profile_rounds(sim, config, engine, profile)
    if strategies:
        result["strategies"] = {}
        for chunk in strategies:
            timed = time_rounds(config.with_overrides([f"client_chunk={chunk}"]).validate(), rounds)
            timed.pop("sim")
            keys = ("round_seconds_median", "compile_seconds", "useful_step_fraction")
            result["strategies"][str(chunk)] = {k: timed[k] for k in keys}
    if baseline == "torch":
        from jaxfed.cli.bench.torch_loop import fedavg_rounds

        rounds_run = engine["rounds_per_timed_call"] + engine["rounds_timed"]  # the warm-up call's rounds too
        initial = sim.algorithm.global_params(sim.init().server)["params"]
        hidden = config.hidden_widths() or (200, 200)
        torch_rounds = baseline_rounds or rounds_run
        torch_result = fedavg_rounds(sim, config, torch_rounds, hidden, initial_params=initial)
        result["torch"] = {**torch_result, "rounds": torch_rounds, "jaxfed_rounds": rounds_run}
        result["speedup_vs_torch"] = torch_result["round_seconds_median"] / engine["round_seconds_median"]
        result["eval_speedup_vs_torch"] = torch_result["eval_all_clients_seconds"] / engine["eval_all_clients_seconds"]
    return result


def profile_rounds(sim, config: Config, timed: dict, directory: str) -> dict:
    """Trace as many calls as :func:`time_rounds` timed (``timed``: its result), of as many
    rounds, after a warm-up call, into ``directory``; their device events summarized, with the
    kernels' time against the timed round's (the traced round runs slower: see
    :mod:`jaxfed.cli.bench.profile`)."""
    from jaxfed.cli.bench.profile import summarize, trace_calls

    per_call, calls = timed["rounds_per_timed_call"], timed["timed_calls"]
    state, _ = sim.run_rounds(sim.init(), per_call)
    jax.block_until_ready(state)

    def call():
        nonlocal state
        state, metrics = sim.run_rounds(state, per_call)
        return state, metrics

    events, wall = trace_calls(call, calls, directory)
    traced = range(per_call, per_call * (calls + 1))
    profile = summarize(events, per_call * calls, wall, sequential_steps(sim, config, traced, sim.client_chunk))
    if profile["device_events"]:
        profile["kernel_share_of_timed_round"] = profile["kernel_ms_per_round"] / (1e3 * timed["round_seconds_median"])
    return {**profile, "trace_dir": str(directory)}


def summary_lines(result: dict) -> list[str]:
    """A short human-readable account of :func:`run_benchmark`'s result."""
    r = result
    lines = [
        f"{r['workload']} on {r['device']} x{r['devices']} (client_chunk {r['client_chunk']}): "
        f"{r['round_seconds_median']:.3f} s/round (compile {r['compile_seconds']:.1f} s), "
        f"{r['client_updates_per_second']:.1f} client updates/s, {r['examples_per_second']:.0f} examples/s",
        f"  {r['training_gflop_per_round']:.1f} GFLOP/round -> {r['achieved_gflops']:.1f} GFLOP/s "
        f"({100 * r['fraction_of_matmul_peak']:.1f}% of the {r['matmul_peak_gflops']:.0f} GFLOP/s float32 matmul peak, "
        f"{r['matmul_peak_gflops_default_precision']:.0f} at the default precision); "
        f"useful steps {100 * r['useful_step_fraction']:.0f}% "
        f"(if all vmapped {100 * r['useful_step_fraction_vmap_all']:.0f}%)",
        f"  evaluation of all {'clients'}: {r['eval_all_clients_seconds']:.2f} s; "
        f"peak host memory {r['host_peak_rss_bytes'] / 1e9:.2f} GB",
    ]
    if "profile" in r:
        from jaxfed.cli.bench.profile import summary_lines as profile_lines

        lines.extend(profile_lines(r["profile"]))
    for chunk, s in r.get("strategies", {}).items():
        lines.append(
            f"  client_chunk={chunk}: {s['round_seconds_median']:.3f} s/round (compile {s['compile_seconds']:.1f} s), "
            f"useful steps {100 * s['useful_step_fraction']:.0f}%"
        )
    if "torch" in r:
        t = r["torch"]
        lines.append(
            f"  PyTorch per-client loop ({t['device']}, {t['threads']} threads): "
            f"{t['round_seconds_median']:.3f} s/round "
            f"-> jaxfed {r['speedup_vs_torch']:.2f}x; "
            f"evaluation {t['eval_all_clients_seconds']:.2f} s -> {r['eval_speedup_vs_torch']:.1f}x; "
            + (
                f"global acc after the same rounds: jaxfed {r['global_acc']:.4f}, torch {t['global_acc']:.4f}"
                if t.get("rounds") == t.get("jaxfed_rounds")  # (both absent in results from before --baseline-rounds)
                else f"global acc: jaxfed {r['global_acc']:.4f} after {t['jaxfed_rounds']} rounds, "
                f"torch {t['global_acc']:.4f} after {t['rounds']}"
            )
        )
    return lines
