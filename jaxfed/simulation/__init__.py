"""The simulation engine: sampling, vmapped client updates, server updates, evaluation."""

from jaxfed.simulation.engine import CLIENT_AXIS, NONFINITE_POLICIES, SimState, Simulation, default_client_chunk
from jaxfed.simulation.sampling import EVAL_CLIENTS, SAMPLINGS

__all__ = [
    "CLIENT_AXIS",
    "EVAL_CLIENTS",
    "NONFINITE_POLICIES",
    "SAMPLINGS",
    "SimState",
    "Simulation",
    "default_client_chunk",
]
