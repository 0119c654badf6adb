"""One run across several processes: ``jax.distributed`` started from flags or the environment.

Every process runs the same program over a mesh of all processes' devices (the engine shards the
sampled clients over it); orbax writes each checkpoint from all of them; the primary process
(id 0) alone writes ``config.json``, ``metrics.jsonl``, ``summary.json`` and the plots, holds the
run directory's lock and prints. :func:`start` must run before anything starts JAX's backend.
"""

from __future__ import annotations

import os

from jaxfed.errors import ConfigError

ENVIRONMENT = {
    "coordinator": "JAXFED_COORDINATOR",
    "num_processes": "JAXFED_NUM_PROCESSES",
    "process_id": "JAXFED_PROCESS_ID",
}
_process = {"id": 0, "count": 1}


def settings_from(coordinator=None, num_processes=None, process_id=None) -> tuple[str, int, int] | None:
    """``(coordinator, num_processes, process_id)`` from the arguments, else the environment
    (``JAXFED_COORDINATOR``, ``JAXFED_NUM_PROCESSES``, ``JAXFED_PROCESS_ID``); None for one process."""
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    values = {k: v if v is not None else os.environ.get(ENVIRONMENT[k]) for k, v in given.items()}
    if all(v is None for v in values.values()):
        return None
    missing = [f"--{k.replace('_', '-')}" for k, v in values.items() if v is None]
    if missing:
        names = ", ".join(f"${name}" for name in ENVIRONMENT.values())
        raise ConfigError(f"{', '.join(missing)}: needed too for a run across processes (flags or {names})")
    try:
        count, index = int(values["num_processes"]), int(values["process_id"])
    except ValueError:
        raise ConfigError("--num-processes, --process-id: expected integers") from None
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"--process-id: must be in 0..{count - 1} for --num-processes {count}, got {index}")
    if ":" not in str(values["coordinator"]):
        raise ConfigError(f"--coordinator: expected HOST:PORT, got '{values['coordinator']}'")
    return str(values["coordinator"]), count, index


def start(coordinator: str, num_processes: int, process_id: int) -> None:
    """``jax.distributed.initialize`` (CPU collectives over gloo), before JAX's backend starts."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    _process.update(id=process_id, count=num_processes)


def is_primary() -> bool:
    """Whether this process writes the run directory's files (process 0, or a single process)."""
    return _process["id"] == 0


def process_count() -> int:
    return _process["count"]


def to_host(tree):
    """``tree``'s arrays as numpy on this process: ``jax.device_get``, or across processes an
    all-gather of the arrays whose shards live on other processes' devices."""
    import jax

    if _process["count"] == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def split_host(count: int) -> None:
    """Make the CPU show ``count`` JAX devices (``host_devices``). XLA reads the flag when JAX
    starts its backend, so this must run first; a ConfigError says so otherwise."""
    flag = "--xla_force_host_platform_device_count"
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
    os.environ["XLA_FLAGS"] = " ".join([*kept, f"{flag}={count}"])
    import jax

    cpus = jax.devices("cpu")
    if len(cpus) != count:
        raise ConfigError(
            f"host_devices: JAX had started with {len(cpus)} CPU device(s) before {count} could be set; "
            f"set XLA_FLAGS={flag}={count} before starting Python instead"
        )


def split_host_for(configs) -> None:
    """Split the host into the configs' ``host_devices`` (where set) before anything starts JAX's
    backend: what a process entry does with the configs it runs (one process has one device
    count, so they must share it)."""
    counts = sorted({c.host_devices for c in configs})
    if len(counts) > 1:
        raise ConfigError(f"host_devices: one process runs on one set of devices, got {counts}; run one per value")
    if counts and counts[0]:
        split_host(counts[0])
