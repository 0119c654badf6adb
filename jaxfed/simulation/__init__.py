"""The simulation engine: sampling, vmapped client updates, server updates, evaluation."""

from jaxfed.simulation.engine import CLIENT_AXIS, SimState, Simulation
from jaxfed.simulation.sampling import SAMPLINGS

__all__ = ["CLIENT_AXIS", "SAMPLINGS", "SimState", "Simulation"]
