"""What a run needs in memory against what its device has, checked from shapes before anything
is allocated or compiled.

A model far too large for the machine (e.g. the default CNN on 1024 x 1024 images: a 2.1 G
parameter dense layer) would otherwise sit for minutes allocating its state, or fail deep in XLA.
:func:`check_memory` refuses it with one line instead. The need is a lower bound (every
algorithm's compiled round holds at least its input state, its output state and one client's
copy of the model), so a run it refuses cannot fit, and one it lets through may still be tight.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from jaxfed.core import human_bytes, tree_bytes
from jaxfed.errors import ConfigError
from jaxfed.nn import model_template

CGROUP = Path("/sys/fs/cgroup")


def available_bytes(device) -> int | None:
    """Memory a run may still take on ``device``: an accelerator's ``bytes_limit - bytes_in_use``;
    on the host the kernel's estimate of available memory (free plus reclaimable caches), within
    the cgroup's limit. None when the device does not say."""
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0) if "bytes_limit" in stats else None
    found = [n for n in (_meminfo_available(), _cgroup_available()) if n is not None]
    return min(found) if found else _physical_memory()


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_available() -> int | None:
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def round_bytes(state, params, copies: int = 1) -> int:
    """A lower bound of the memory a compiled round needs: ``copies`` of its input and output
    states (the round does not donate its input) and one client's copy of the model ``params``."""
    return copies * 2 * tree_bytes(state) + tree_bytes(params)


def check_fits(state, params, model_name: str, device, copies: int = 1, available: int | None = None) -> None:
    """A one-line ConfigError when a round of ``state`` (arrays or shape structs) with a model of
    ``params`` cannot fit in ``available`` bytes (default: :func:`available_bytes` of ``device``)."""
    available = available_bytes(device) if available is None else available
    needed = round_bytes(state, params, copies)
    if available is None or needed <= available:
        return
    count = sum(leaf.size for leaf in jax.tree.leaves(params))
    raise ConfigError(
        f"model: {model_name} has {count:,} parameters ({human_bytes(tree_bytes(params))}); a round needs at "
        f"least {human_bytes(needed)} (the state in and out, and a client's copy of the model) but the "
        f"{device.platform} has {human_bytes(available)} available: use a smaller model or smaller images"
    )


def check_memory(simulation, device, available: int | None = None) -> None:
    """:func:`check_fits` for a :class:`~jaxfed.simulation.Simulation` on ``device`` (the first of
    its devices), from its shapes only (the host's devices share its memory: each holds the
    replicated state)."""
    model = simulation.model
    params, _ = model_template(model)
    copies = simulation.num_devices if device.platform == "cpu" else 1
    name = f"{model.name} on {tuple(model.input_shape)} inputs"
    state = jax.eval_shape(simulation.init_pure)
    if simulation.client_state == "host":  # the device holds the sampled clients' states, at least a round's
        rows = simulation.num_sampled
        state = state.replace(
            clients=jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), state.clients)
        )
    check_fits(state, params, name, device, copies, available)
