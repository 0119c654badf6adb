"""Server steps several algorithms share, written as reductions (:class:`~jaxfed.contract.Aggregation`).

Every built-in's server step is a sum over clients: the sample-weighted mean of (part of) the
uploads, or a mean with one weight per position (FedCSPACK's packs, a mixture's components), so
the engine sums the clients' shares as they run and never holds a round's uploads at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxfed.algorithms.records import GlobalParams
from jaxfed.contract import Aggregation, RoundInfo
from jaxfed.core import mean_of, weighted_share


def averaging(finish: Callable[[Any, Any, RoundInfo], Any]) -> Aggregation:
    """The sample-weighted mean of the uploads, ``sum_k n_k x_k / sum_k n_k``, handed to
    ``finish(server_state, mean, info)``, which returns the new server state."""
    return Aggregation(
        contribute=lambda server_state, message, weight, info: weighted_share(message, weight),
        apply=lambda server_state, total, info: finish(server_state, mean_of(total), info),
    )


def model_averaging() -> Aggregation:
    """FedAvg's server step on a :class:`~jaxfed.algorithms.records.GlobalParams` server state: the
    sample-weighted mean of the uploaded models is the new global model."""
    return averaging(lambda server_state, mean, info: GlobalParams(mean))


def uniform_averaging(finish: Callable[[Any, Any, RoundInfo], Any]) -> Aggregation:
    """:func:`averaging` with every kept client counted once, whatever its size."""
    return Aggregation(
        contribute=lambda server_state, message, weight, info: weighted_share(message, 1.0),
        apply=lambda server_state, total, info: finish(server_state, mean_of(total), info),
    )
