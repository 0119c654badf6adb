"""The algorithm contract: a federated algorithm is a record of pure functions.

In the spirit of optax's ``GradientTransformation`` and fedjax's ``FederatedAlgorithm``. The
full contract, with the engine's rules, is ``docs/contract.md``; in short:

- ``init(rng) -> (server_state, client_state)``: ``client_state`` is ONE client's state; the
  engine stacks it along a leading client axis.
- ``broadcast(server_state, tier) -> message_down``: what a client of ``tier`` receives
  (``tier`` is 0 for an algorithm without tiers).
- ``client_update(message_down, client_state, data, rng) -> (client_state, message_up, metrics)``
  written for one client (``data``: :class:`jaxfed.data.ClientData`); the engine vmaps it.
  ``metrics`` is a dict of scalars; the engine reports their sample-weighted mean.
- ``server_update(server_state, messages_up, weights) -> server_state``: aggregation over the
  leading axis of the stacked ``messages_up``. Rows come in the engine's run order (not by id)
  and may include padding or skipped clients: those rows have weight 0, so aggregate with the
  weights (:func:`jaxfed.core.weighted_mean`). The server sees nothing but the messages.
- ``eval_params(server_state, client_state) -> variables``: a client's personalized model as
  Flax variables; ``global_params(server_state) -> variables`` where there is a global model.

Optional:

- ``num_tiers``: clients sit in static tiers of equal contiguous id blocks (client k of N is in
  tier ``k * num_tiers // N``); each tier's clients run with their own ``broadcast`` and shapes.
- ``receive(server_state, message_up, tier) -> message``: the server's decoding of one upload
  of ``tier`` into the common shape every tier shares (FedHM: factors to full kernels), applied
  before ``server_update``; so tiered and untiered algorithms have the same ``server_update``.
- ``eval_server(server_state, tier)``: what ``eval_params`` receives for the clients of ``tier``,
  computed once per tier at evaluation (default: the server state itself).
- ``message_bytes(message_up)``: the bytes one client's upload really takes (default: its arrays).
- ``download_bytes(message_down, client_state, round) -> bytes``: what one client of this round
  must download when it keeps what it received before (its ``client_state``, before the update,
  says what that is): the engine's ``bytes_down_cached``. Default: the whole ``message_down``.
- ``init_client(client_state, client_id) -> client_state``: a client's own starting state.
- ``eval_model``: the model ``eval_params``' variables belong to when it is not the run's model.
- ``evaluates_global``: True where every client's personalized model is the global model; the
  engine then evaluates the global model once over the pooled test examples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax

PyTree = Any


class InitFn(Protocol):
    def __call__(self, rng: jax.Array) -> tuple[PyTree, PyTree]: ...


class BroadcastFn(Protocol):
    def __call__(self, server_state: PyTree, tier: int) -> PyTree: ...


class ClientUpdateFn(Protocol):
    def __call__(
        self, message_down: PyTree, client_state: PyTree, data: Any, rng: jax.Array
    ) -> tuple[PyTree, PyTree, dict[str, jax.Array]]: ...


class ServerUpdateFn(Protocol):
    def __call__(self, server_state: PyTree, messages_up: PyTree, weights: jax.Array) -> PyTree: ...


class EvalParamsFn(Protocol):
    def __call__(self, server_state: PyTree, client_state: PyTree) -> dict: ...


class GlobalParamsFn(Protocol):
    def __call__(self, server_state: PyTree) -> dict: ...


class ReceiveFn(Protocol):
    def __call__(self, server_state: PyTree, message_up: PyTree, tier: int) -> PyTree: ...


class FederatedAlgorithm(NamedTuple):
    name: str
    init: InitFn
    broadcast: BroadcastFn
    client_update: ClientUpdateFn
    server_update: ServerUpdateFn
    eval_params: EvalParamsFn
    global_params: GlobalParamsFn | None = None
    num_tiers: int | None = None
    message_bytes: Callable[[PyTree], jax.Array] | None = None
    download_bytes: Callable[[PyTree, PyTree, jax.Array], jax.Array] | None = None
    eval_server: Callable[[PyTree, int], PyTree] | None = None
    init_client: Callable[[PyTree, jax.Array], PyTree] | None = None
    eval_model: Any = None
    evaluates_global: bool = False
    receive: ReceiveFn | None = None
