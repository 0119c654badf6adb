"""The engine, by job: the round's semantics (``engine.Simulation``: sampling, tiers, the
non-finite policy, aggregation, the compile cache), the client-execution strategy
(``strategy.ClientStrategy``: order, padding, vmap or chunks, devices), communication accounting
(``accounting``), the server's step (``server``: decode, contribute, apply; ``server_step`` on
stacked uploads) and evaluation (``evaluation.Evaluation``)."""

from jaxfed.simulation.engine import NONFINITE_POLICIES, SimState, Simulation
from jaxfed.simulation.evaluation import Evaluation
from jaxfed.simulation.sampling import COHORT_SAMPLINGS, EVAL_CLIENTS, SAMPLINGS
from jaxfed.simulation.server import server_step
from jaxfed.simulation.strategy import CLIENT_AXIS, ClientStrategy, default_client_chunk

__all__ = [
    "CLIENT_AXIS",
    "COHORT_SAMPLINGS",
    "EVAL_CLIENTS",
    "NONFINITE_POLICIES",
    "SAMPLINGS",
    "ClientStrategy",
    "Evaluation",
    "SimState",
    "Simulation",
    "default_client_chunk",
    "server_step",
]
