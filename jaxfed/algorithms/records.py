"""Typed state records several algorithms share (each algorithm's own records live in its module).

States and messages are pytrees; a ``NamedTuple`` names their parts, so code reads
``server.params`` instead of ``server["params"]`` and a misspelt field fails at once.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class GlobalParams(NamedTuple):
    """A server state that is the global model alone (FedHM, FedDecomp's sigma)."""

    params: Any


def global_model(model):
    """A :class:`GlobalParams` algorithm's ``global_params``: its params as the model's variables;
    None for a model with BatchNorm statistics, which have no global value (no global model)."""
    from jaxfed.nn import model_template

    return None if model_template(model)[1] else (lambda server_state: {"params": server_state.params})


class ClientStats(NamedTuple):
    """A client state that is only the model's non-trainable collections (BatchNorm statistics;
    ``{}`` when the model has none): FedAvg, FedHM, the FedLoRU family."""

    model_state: Any
