"""What a benchmark reports besides wall time: the machine's matmul peak and peak memory (the
useful FLOPs of a local step are :mod:`jaxfed.cli.bench.flops`')."""

from __future__ import annotations

import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp


def timed(fn, *args, repeats: int = 3):
    """Median seconds of ``fn(*args)`` (blocked until ready) over ``repeats`` calls, after one warm-up."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        tick = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - tick)
    return statistics.median(times)


# The peak's square matrices: large enough to reach it (the suite's bench tests, which check what
# is reported and not the machine, shrink the CPU side: 3 s a bench at 2048 on one test thread).
CPU_PEAK_SIDE, ACCELERATOR_PEAK_SIDE = 2048, 8192


def matmul_gflops(precision: str = "float32", size: int | None = None, repeats: int = 10) -> float:
    """The device's matmul throughput, GFLOP/s, the median of ``repeats`` timed calls: at full
    float32 (``precision="float32"``, XLA's HIGHEST) or at the default precision (``"default"``:
    TF32 on recent NVIDIA GPUs). ``size``: the square matrices' side (default
    :data:`CPU_PEAK_SIDE` on CPU, :data:`ACCELERATOR_PEAK_SIDE` on accelerators)."""
    size = size or (CPU_PEAK_SIDE if jax.devices()[0].platform == "cpu" else ACCELERATOR_PEAK_SIDE)
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
    level = {"float32": jax.lax.Precision.HIGHEST, "default": jax.lax.Precision.DEFAULT}[precision]
    seconds = timed(jax.jit(lambda a, b: jnp.matmul(a, b, precision=level)), a, b, repeats=repeats)
    return 2 * size**3 / seconds / 1e9


def peak_memory_bytes() -> dict:
    """Peak host resident memory of this process, and the device's peak where it reports one."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = {"host_peak_rss_bytes": rss if sys.platform == "darwin" else rss * 1024}
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        peak["device_peak_bytes"] = stats["peak_bytes_in_use"]
    return peak
