"""The algorithm contract: a federated algorithm is a record of pure functions.

In the spirit of optax's ``GradientTransformation`` and fedjax's ``FederatedAlgorithm``:

- ``init(rng) -> (server_state, client_state)``: ``client_state`` is ONE client's state; the
  engine stacks it along a leading client axis.
- ``broadcast(server_state, tier) -> message_down``: what a client of ``tier`` receives.
- ``client_update(message_down, client_state, client_data, rng) -> (client_state, message_up, metrics)``
  written for one client; the engine vmaps it over the sampled clients.
- ``server_update(server_state, messages_up, weights) -> server_state``: aggregation over the
  stacked client axis of ``messages_up``. The server sees nothing but the messages.
- ``eval_params(server_state, client_state) -> variables``: a client's personalized model as
  Flax variables; ``global_params(server_state) -> variables`` where there is a global model.

Optional hooks:

- ``init_client(client_state, client_id) -> client_state``: a client's own starting state (e.g.
  FLoRAL's ground-truth router, ``router=oracle``), applied once per client at init.
- ``eval_model``: the model ``eval_params``' variables belong to when it is not the run's model
  (the ensemble baseline evaluates a mixture of C copies of it).
- ``message_bytes(message_up)``: the bytes one client's message really takes (default: its arrays' size).
- ``eval_server(server_state, tier)``: what ``eval_params`` receives for the clients of ``tier``,
  computed once per tier at evaluation (default: the server state itself).
- ``evaluates_global``: True where every client's personalized model is the global model
  (``eval_params(s, c) == global_params(s)``: FedAvg, FedProx, FedLoRU without private norm
  statistics). The engine then runs the model once over the pooled test examples and sums each
  client's share, instead of once per client.

A *tiered* algorithm (``num_tiers`` set; FedHM, mFedLoRU, FedARA) has clients in static tiers
of equal contiguous id blocks (client k of N is in tier ``k * num_tiers // N``). The engine runs
each tier's sampled clients as their own group with their own shapes: ``broadcast(server, t)``
per tier, and ``server_update`` receives a tuple with one stacked message per tier and a tuple
of their weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class FederatedAlgorithm(NamedTuple):
    name: str
    init: Callable[..., tuple[Any, Any]]
    broadcast: Callable[[Any, int], Any]
    client_update: Callable[[Any, Any, Any, Any], tuple[Any, Any, dict]]
    server_update: Callable[[Any, Any, Any], Any]
    eval_params: Callable[[Any, Any], Any]
    global_params: Callable[[Any], Any] | None = None
    num_tiers: int | None = None
    message_bytes: Callable[[Any], Any] | None = None
    eval_server: Callable[[Any, int], Any] | None = None
    init_client: Callable[[Any, Any], Any] | None = None
    eval_model: Any = None
    evaluates_global: bool = False
