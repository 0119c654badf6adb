"""jaxfed: personalized and low-rank federated learning simulated at accelerator speed.

The package is in layers, each a folder importing only those below it:

- ``jaxfed.core``: pure building blocks on pytrees (tree reductions, factorizations, packs,
  routers, losses); ``jaxfed.nn``: Flax models; ``jaxfed.data``: datasets, partitioners and the
  on-device federated dataset.
- ``jaxfed.contract``: the algorithm record (``FederatedAlgorithm``), its Protocols and the round
  information; ``jaxfed.options``: typed options with checks (``option``, ``Options``,
  ``TrainingOptions``).
- ``jaxfed.algorithms``: one module per algorithm, registered by name and loaded when named.
- ``jaxfed.simulation``: the engine (``Simulation``) that vmaps client updates over clients.
- ``jaxfed.runs``: config, build (config -> Simulation), the run directory, the loop, sweeps.
- ``jaxfed.cli``: the ``jaxfed`` command.

The public API, importable from here:

- ``Config``: a run's settings (run-level keys plus the algorithm's options section).
- ``register``: add an algorithm (its options class and builder) from research code; it then
  has the CLI, config files, ``--set``, checkpoints, resume, metrics, plots and sweeps.
- ``build(config)``: the data, model, algorithm and ``Simulation`` of a config.
- ``run(config, out_dir)``: ``jaxfed run``; ``run_simulation(sim, out_dir, settings)`` drives a
  ``Simulation`` built in research code with ``LoopSettings``; both take ``on_evaluation=fn``,
  called with each evaluated metrics row.
- ``load_runs(dirs)``: run directories (or a sweep's directory) as flat records, one per
  evaluated row (or per run): ``pandas.DataFrame(jaxfed.load_runs(dirs))``.
- ``save_state`` / ``load_state``: orbax checkpoints of a simulation state.
- ``FederatedAlgorithm``, ``Aggregation``, ``RoundInfo``: the algorithm contract;
  ``server_step(algorithm, server_state, uploads, weights)``: the server's step on stacked uploads.
"""

import importlib

from jaxfed.algorithms.registry import register
from jaxfed.errors import ConfigError, NonFiniteUpdateError
from jaxfed.runs.config import Config

_LAZY = {  # name -> module: the heavier pieces (the engine, orbax) load when first used
    "Aggregation": "jaxfed.contract",
    "FederatedAlgorithm": "jaxfed.contract",
    "LoopSettings": "jaxfed.runs.rundir",
    "RoundInfo": "jaxfed.contract",
    "Simulation": "jaxfed.simulation",
    "build": "jaxfed.runs.build",
    "load_runs": "jaxfed.runs.results",
    "load_state": "jaxfed.runs.checkpoint",
    "run": "jaxfed.runs.driver",
    "run_simulation": "jaxfed.runs.driver",
    "save_state": "jaxfed.runs.checkpoint",
    "server_step": "jaxfed.simulation",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxfed' has no attribute '{name}'")


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = [
    "Aggregation",
    "Config",
    "ConfigError",
    "FederatedAlgorithm",
    "LoopSettings",
    "NonFiniteUpdateError",
    "RoundInfo",
    "Simulation",
    "build",
    "load_runs",
    "load_state",
    "register",
    "run",
    "run_simulation",
    "save_state",
    "server_step",
]
__version__ = "0.1.0"
