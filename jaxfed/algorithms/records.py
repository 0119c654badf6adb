"""Typed state records several algorithms share (each algorithm's own records live in its module).

States and messages are pytrees; a ``NamedTuple`` names their parts, so code reads
``server.params`` instead of ``server["params"]`` and a misspelt field fails at once.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class GlobalParams(NamedTuple):
    """A server state that is the global model alone (FedHM, FedDecomp's sigma)."""

    params: Any


class ClientStats(NamedTuple):
    """A client state that is only the model's non-trainable collections (BatchNorm statistics;
    ``{}`` when the model has none): FedAvg, FedHM, the FedLoRU family."""

    model_state: Any
