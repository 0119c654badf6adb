"""Where a round's device time goes (``jaxfed bench --profile DIR``): a profiler trace of a few
compiled calls, summarized from its device events, the kernels an accelerator ran.

Per round: how many kernels ran and for how long, the device's busy fraction (kernel time over
the round's wall time: low means the round waits on launches and loop control, not arithmetic),
the kernels per local step run in sequence, and the kernels that took the most time. The trace
(Perfetto JSON, readable at ui.perfetto.dev, and XPlane for TensorBoard) stays in ``DIR``. A CPU
has no device events (XLA runs its thunks on host threads): the summary says so.
"""

from __future__ import annotations

import gzip
import json
import time
from collections import defaultdict
from pathlib import Path

import jax

TOP_KERNELS = 12


def trace_calls(call, calls: int, directory: str | Path) -> tuple[list[dict], float]:
    """Run ``call()`` (blocked until ready) ``calls`` times under the profiler, writing the trace
    into ``directory``; returns the trace's events and the wall seconds of the calls."""
    with jax.profiler.trace(str(directory), create_perfetto_trace=True):
        tick = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(call())
        wall = time.perf_counter() - tick
    newest = max(Path(directory).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    with gzip.open(newest) as f:
        trace = json.load(f)
    return (trace["traceEvents"] if isinstance(trace, dict) else trace), wall


def device_threads(events: list[dict]) -> dict[tuple, str]:
    """``{(pid, tid): "process / thread"}`` of the threads of device processes (``/device:...``)."""
    names = {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") in ("process_name", "thread_name"):
            key = event["pid"] if event["name"] == "process_name" else (event["pid"], event.get("tid"))
            names[key] = event.get("args", {}).get("name", "")
    return {
        key: f"{names.get(key[0], '')} / {name}"
        for key, name in names.items()
        if isinstance(key, tuple) and str(names.get(key[0], "")).startswith("/device:")
    }


def summarize(events: list[dict], rounds: int, wall_seconds: float, sequential_steps: float) -> dict:
    """The device events of ``rounds`` traced rounds (``wall_seconds`` in all), per round.

    Kernels are the complete events (``ph`` X) on a device's stream threads (``Stream #...``, as
    a GPU's trace names them), or on all its threads where it names none so.
    """
    threads = device_threads(events)
    streams = {key for key, name in threads.items() if name.split(" / ", 1)[1].startswith("Stream")}
    kernel_threads = streams or set(threads)
    per_thread = defaultdict(lambda: [0, 0.0])
    per_kernel = defaultdict(lambda: [0, 0.0])
    for event in events:
        key = (event.get("pid"), event.get("tid"))
        if event.get("ph") != "X" or key not in threads:
            continue
        per_thread[threads[key]][0] += 1
        per_thread[threads[key]][1] += event.get("dur", 0.0)
        if key in kernel_threads:
            per_kernel[event["name"]][0] += 1
            per_kernel[event["name"]][1] += event.get("dur", 0.0)
    if not per_kernel:
        return {
            "device_events": 0,
            "note": "no device events in the trace (on a CPU, XLA runs on host threads; on a GPU, the profiler "
            "records kernels through CUPTI, which may be missing)",
        }
    count = sum(n for n, _ in per_kernel.values())
    micros = sum(us for _, us in per_kernel.values())
    top = sorted(per_kernel.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
    return {
        "device_events": sum(n for n, _ in per_thread.values()),
        "kernels_per_round": count / rounds,
        "kernel_ms_per_round": micros / rounds / 1e3,
        "round_ms_traced": wall_seconds / rounds * 1e3,
        "device_busy_fraction": micros / 1e6 / wall_seconds,
        "sequential_steps_per_round": sequential_steps,
        "kernels_per_sequential_step": count / rounds / sequential_steps if sequential_steps else None,
        "top_kernels": [
            {"name": name, "per_round": n / rounds, "us_per_round": us / rounds, "us_each": us / n}
            for name, (n, us) in top
        ],
        "threads": {name: {"events": n, "ms": us / 1e3} for name, (n, us) in sorted(per_thread.items())},
    }


def summary_lines(profile: dict) -> list[str]:
    """A short human-readable account of :func:`summarize`'s result."""
    if not profile.get("device_events"):
        return [f"  profile: {profile.get('note', 'no device events')}"]
    p = profile
    per_step = p["kernels_per_sequential_step"]
    lines = [
        f"  profile: {p['kernels_per_round']:.0f} kernels a round"
        + (
            f" ({per_step:.1f} per local step in sequence, {p['sequential_steps_per_round']:.1f} steps)"
            if per_step
            else ""
        )
        + f", {p['kernel_ms_per_round']:.2f} ms of kernels in a {p['round_ms_traced']:.2f} ms round "
        f"(device busy {100 * p['device_busy_fraction']:.0f}%); most time:"
    ]
    for kernel in p["top_kernels"][:5]:
        lines.append(
            f"    {kernel['us_per_round']:.0f} us/round, {kernel['per_round']:.1f}x of {kernel['us_each']:.1f} us: "
            f"{kernel['name'][:90]}"
        )
    return lines
