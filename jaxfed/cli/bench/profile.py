"""Where a round's device time goes (``jaxfed bench --profile DIR``): a profiler trace of a few
compiled calls, summarized from its device events, the kernels an accelerator ran.

Per round: how many kernels (and copies) ran and for how long, the device's busy time (the union
of the kernels' intervals over all streams) against the traced round's wall time, the kernels
per local step run in sequence, and the kernels that took the most time. The trace (Perfetto
JSON, readable at ui.perfetto.dev) stays in ``DIR``.

A traced round is not the timed one: while the profiler runs, XLA's GPU backend runs a command
buffer's (CUDA graph's) kernels one launch at a time, and CUPTI adds its own cost, so the traced
round is slower and more launch-bound; ``jaxfed bench`` also reports the kernels' time against
the timed round. The trace's JSON export keeps at most about a million events: a summary near
that count is marked ``truncated``. A CPU has no device events (XLA runs its thunks on host
threads): the summary says so.
"""

from __future__ import annotations

import gzip
import json
import time
from collections import defaultdict
from pathlib import Path

import jax

TOP_KERNELS = 12
TRACE_EVENT_LIMIT = 1_000_000  # what the profiler's JSON export keeps at most
OP_LINES = ("XLA Ops",)  # a device's op-level line, where it names no streams (a TPU's)
SPAN_LINES = ("XLA Modules", "Steps")  # lines whose events each span many kernels


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


def device_threads(events: list[dict]) -> dict[tuple, tuple[str, str]]:
    """``{(pid, tid): (process name, thread name)}`` of the threads of device processes (named ``/device:...``)."""
    processes, threads = {}, {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            processes[event["pid"]] = str(event.get("args", {}).get("name", ""))
        elif event.get("ph") == "M" and event.get("name") == "thread_name":
            threads[(event["pid"], event.get("tid"))] = str(event.get("args", {}).get("name", ""))
    return {
        key: (processes[key[0]], name)
        for key, name in threads.items()
        if processes.get(key[0], "").startswith("/device:")
    }


def kernel_threads(threads: dict[tuple, tuple[str, str]]) -> set[tuple]:
    """The device threads whose events are single kernels: its streams (``Stream #...``, a GPU's),
    else its op lines, else every line but those whose events span many kernels."""
    streams = {key for key, (_, name) in threads.items() if name.startswith("Stream")}
    ops = {key for key, (_, name) in threads.items() if name in OP_LINES}
    return streams or ops or {key for key, (_, name) in threads.items() if name not in SPAN_LINES}


def is_copy(name: str) -> bool:
    """A memory copy or set on a device stream (CUPTI's ``MemcpyH2D``, ``Memset`` ...), not a kernel."""
    return name.startswith(("Memcpy", "Memset"))


def busy_microseconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, duration)`` intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for start, duration in sorted(intervals):
        stop = start + duration
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize(events: list[dict], rounds: int, wall_seconds: float, sequential_steps: float) -> dict:
    """The device events of ``rounds`` traced rounds (``wall_seconds`` in all), per round."""
    threads = device_threads(events)
    single = kernel_threads(threads)
    per_thread = defaultdict(lambda: [0, 0.0])
    per_kernel = defaultdict(lambda: [0, 0.0])
    copies, intervals = [0, 0.0], []
    for event in events:
        key = (event.get("pid"), event.get("tid"))
        if event.get("ph") != "X" or key not in threads:
            continue
        duration = event.get("dur", 0.0)
        line = " / ".join(threads[key])
        per_thread[line][0] += 1
        per_thread[line][1] += duration
        if key not in single:
            continue
        if is_copy(event["name"]):
            copies[0] += 1
            copies[1] += duration
        else:
            per_kernel[event["name"]][0] += 1
            per_kernel[event["name"]][1] += duration
            intervals.append((event.get("ts", 0.0), duration))
    if not per_kernel:
        return {
            "device_events": 0,
            "note": "no device events in the trace (on a CPU, XLA runs on host threads; on a GPU, the profiler "
            "records kernels through CUPTI, which may be missing)",
        }
    count = sum(n for n, _ in per_kernel.values())
    busy = busy_microseconds(intervals)
    top = sorted(per_kernel.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
    return {
        "device_events": sum(n for n, _ in per_thread.values()),
        "truncated": len(events) >= 0.99 * TRACE_EVENT_LIMIT,
        "kernels_per_round": count / rounds,
        "kernel_ms_per_round": sum(us for _, us in per_kernel.values()) / rounds / 1e3,
        "busy_ms_per_round": busy / rounds / 1e3,
        "copies_per_round": copies[0] / rounds,
        "copy_ms_per_round": copies[1] / rounds / 1e3,
        "round_ms_traced": wall_seconds / rounds * 1e3,
        "device_busy_fraction": busy / 1e6 / wall_seconds,
        "sequential_steps_per_round": sequential_steps,
        "kernels_per_sequential_step": count / rounds / sequential_steps if sequential_steps else None,
        "top_kernels": [
            {"name": name, "per_round": n / rounds, "us_per_round": us / rounds, "us_each": us / n}
            for name, (n, us) in top
        ],
        "threads": {name: {"events": n, "ms": us / 1e3} for name, (n, us) in sorted(per_thread.items())},
    }


def summary_lines(profile: dict) -> list[str]:
    """A short human-readable account of :func:`summarize`'s result (with ``jaxfed bench``'s
    ``kernel_share_of_timed_round`` where it added one)."""
    p = profile
    if not p.get("device_events"):
        return [f"  profile: {p.get('note', 'no device events')}"]
    per_step = p["kernels_per_sequential_step"]
    share = p.get("kernel_share_of_timed_round")
    head = f"  profile{' (TRUNCATED: the trace kept too few events)' if p.get('truncated') else ''}: "
    head += f"{p['kernels_per_round']:.0f} kernels a round"
    if per_step:
        head += f" ({per_step:.1f} per local step in sequence, {p['sequential_steps_per_round']:.1f} steps)"
    head += (
        f", busy {p['busy_ms_per_round']:.2f} ms of the traced {p['round_ms_traced']:.2f} ms round "
        f"({100 * p['device_busy_fraction']:.0f}%)"
    )
    if share is not None:
        head += f"; kernels {100 * share:.0f}% of the timed round"
    lines = [head + f"; {p['copies_per_round']:.0f} copies a round ({p['copy_ms_per_round']:.2f} ms); most time:"]
    for kernel in p["top_kernels"][:5]:
        lines.append(
            f"    {kernel['us_per_round']:.0f} us/round, {kernel['per_round']:.1f}x of {kernel['us_each']:.1f} us: "
            f"{kernel['name'][:90]}"
        )
    return lines
