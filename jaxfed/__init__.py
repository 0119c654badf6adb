"""jaxfed: personalized and low-rank federated learning simulated at accelerator speed.

The public API in one place:

- ``jaxfed.Config``: every run setting, with defaults (``jaxfed list`` prints them).
- ``jaxfed.algorithms``: algorithms as records of pure functions (``FederatedAlgorithm``).
- ``jaxfed.data``: datasets, partitioners and the on-device federated dataset.
- ``jaxfed.nn``: Flax models by name.
- ``jaxfed.simulation``: the engine (``Simulation``) that vmaps client updates over clients.
- ``jaxfed.run(config)``: build everything from a config and run it.
"""

from jaxfed.config import Config
from jaxfed.errors import ConfigError
from jaxfed.experiment import run

__all__ = ["Config", "ConfigError", "run"]
__version__ = "0.1.0"
