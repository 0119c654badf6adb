"""The simulation engine: sampling, vmapped client updates, server updates, evaluation."""

from jaxfed.simulation.engine import CLIENT_AXIS, SimState, Simulation, default_client_chunk
from jaxfed.simulation.sampling import SAMPLINGS

__all__ = ["CLIENT_AXIS", "SAMPLINGS", "SimState", "Simulation", "default_client_chunk"]
