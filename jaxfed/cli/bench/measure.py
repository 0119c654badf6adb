"""What a benchmark reports besides wall time: the machine's matmul peak, the useful FLOPs of a
local step, and peak memory."""

from __future__ import annotations

import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jaxfed.core.losses import masked_loss


def timed(fn, *args, repeats: int = 3):
    """Median seconds of ``fn(*args)`` (blocked until ready) over ``repeats`` calls, after one warm-up."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        tick = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - tick)
    return statistics.median(times)


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    """The device's float32 matmul throughput, GFLOP/s (best practical peak to compare against)."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
    seconds = timed(jax.jit(jnp.matmul), a, b, repeats=repeats)
    return 2 * size**3 / seconds / 1e9


def training_flops_per_example(model, input_shape, batch_size: int = 32) -> float:
    """FLOPs of one SGD step's forward and backward pass, per example, from XLA's cost analysis."""
    variables = model.init(jax.random.key(0))
    x = jnp.zeros((batch_size,) + tuple(input_shape), jnp.float32)
    y = jnp.zeros((batch_size,), jnp.int32)
    mask = jnp.ones((batch_size,), bool)

    def loss(params):
        out, _ = model.apply({**variables, "params": params}, x, train=True, mask=mask)
        return masked_loss(out, y, mask)

    compiled = jax.jit(jax.grad(loss)).lower(variables["params"]).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0)) / batch_size


def peak_memory_bytes() -> dict:
    """Peak host resident memory of this process, and the device's peak where it reports one."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = {"host_peak_rss_bytes": rss if sys.platform == "darwin" else rss * 1024}
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        peak["device_peak_bytes"] = stats["peak_bytes_in_use"]
    return peak
