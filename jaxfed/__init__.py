"""jaxfed: personalized and low-rank federated learning simulated at accelerator speed.

The public API in one place:

- ``jaxfed.Config``: a run's settings (run-level keys plus the algorithm's options section).
- ``jaxfed.register``: add an algorithm (its options class and builder) from research code;
  it then has the CLI, config files, ``--set``, checkpoints, resume, metrics, plots and sweeps.
- ``jaxfed.algorithms``: algorithms as records of pure functions (``FederatedAlgorithm``), each
  built as ``name(model, options=None, **overrides)``; the contract is ``docs/contract.md``.
- ``jaxfed.options``: ``option``, ``Options``, ``TrainingOptions``: typed options with checks.
- ``jaxfed.data``: datasets, partitioners and the on-device federated dataset.
- ``jaxfed.nn``: Flax models by name, and ``Model`` that wraps any Flax module.
- ``jaxfed.simulation``: the engine (``Simulation``) that vmaps client updates over clients.
- The run driver, three pieces: ``jaxfed.build`` (config -> Simulation), ``jaxfed.rundir`` (the
  run directory), ``jaxfed.driver`` (``run(config, out_dir)`` and ``run_simulation(sim, out_dir,
  settings)`` for a Simulation built in research code).
- ``jaxfed.save_state`` / ``jaxfed.load_state``: orbax checkpoints of a simulation state.
"""

from jaxfed.algorithms.registry import register
from jaxfed.config import Config
from jaxfed.driver import run, run_simulation
from jaxfed.errors import ConfigError, NonFiniteUpdateError
from jaxfed.rundir import LoopSettings
from jaxfed.simulation.checkpoint import load_state, save_state

__all__ = [
    "Config",
    "ConfigError",
    "LoopSettings",
    "NonFiniteUpdateError",
    "load_state",
    "register",
    "run",
    "run_simulation",
    "save_state",
]
__version__ = "0.1.0"
