"""jaxfed: personalized and low-rank federated learning simulated at accelerator speed.

The public API in one place:

- ``jaxfed.Config``: every run setting, with defaults (``jaxfed list`` prints them).
- ``jaxfed.algorithms``: algorithms as records of pure functions (``FederatedAlgorithm``).
- ``jaxfed.data``: datasets, partitioners and the on-device federated dataset.
- ``jaxfed.nn``: Flax models by name.
- ``jaxfed.simulation``: the engine (``Simulation``) that vmaps client updates over clients.
- ``jaxfed.run(config, out_dir)``: build everything from a config and run it (``resume=True``
  continues from the run directory's newest checkpoint).
- ``jaxfed.save_state`` / ``jaxfed.load_state``: orbax checkpoints of a simulation state.
"""

from jaxfed.config import Config
from jaxfed.errors import ConfigError, NonFiniteUpdateError
from jaxfed.experiment import run
from jaxfed.simulation.checkpoint import load_state, save_state

__all__ = ["Config", "ConfigError", "NonFiniteUpdateError", "load_state", "run", "save_state"]
__version__ = "0.1.0"
