"""The algorithm contract: a federated algorithm is a record of pure functions.

In the spirit of optax's ``GradientTransformation`` and fedjax's ``FederatedAlgorithm``: the
record is :class:`FederatedAlgorithm`, each of its functions has a typed ``Protocol`` below, and
the round being run and the tier being served reach every function in one record,
:class:`RoundInfo`. The engine's rules (weight-0 rows, tiers, bytes) are ``docs/contract.md``;
``tests/test_contract_doc.py`` checks that page's signatures against this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from jaxfed.errors import ConfigError, clip

PyTree = Any


@dataclasses.dataclass(frozen=True)
class RoundInfo:
    """Where a call stands: the round being run and the tier being served, in one place.

    The engine makes one per call from its own state (``SimState.round``), so every function of a
    round sees the same round: no algorithm keeps a round counter of its own.

    Attributes:
      round: int32 scalar, the 0-based index of the round being run (= the rounds completed
        before it). At evaluation: the rounds completed. A traced array inside the round.
      tier: the tier of the clients this call serves, a static Python int (0 for an algorithm
        without tiers); None in ``server_update``, which aggregates every tier at once, and
        (an algorithm with ``pad_tier``) in ``client_update``, ``receive`` and ``contribute``,
        which then serve every tier's clients in one program.

    A pytree whose only leaf is ``round``: ``tier`` is static (pytree metadata), so it can index
    Python lists and pick shapes inside ``jit`` and ``vmap``. Outside the engine (tests,
    experiments) write ``RoundInfo(round=jnp.int32(0), tier=0)``.
    """

    round: jax.Array
    tier: int | None


jax.tree_util.register_dataclass(RoundInfo, data_fields=["round"], meta_fields=["tier"])


class InitFn(Protocol):
    def __call__(self, rng: jax.Array) -> tuple[PyTree, PyTree]:
        """The starting states.

        Args:
          rng: a PRNG key.

        Returns:
          ``(server_state, client_state)``: ``client_state`` is ONE client's state; the engine
          stacks it once per client along a new leading axis.
        """


class BroadcastFn(Protocol):
    def __call__(self, server_state: PyTree, info: RoundInfo) -> PyTree:
        """What every client of ``info.tier`` receives this round.

        Args:
          server_state: the server's state.
          info: the round being run and the tier served (0 without tiers).

        Returns:
          ``message_down``, the same for every client of the tier (its bytes are ``bytes_down``,
          unless ``sent_bytes`` says each client is sent only its own part).
        """


class ClientUpdateFn(Protocol):
    def __call__(
        self, message_down: PyTree, client_state: PyTree, data: Any, rng: jax.Array, info: RoundInfo
    ) -> tuple[PyTree, PyTree, dict[str, jax.Array]]:
        """One client's local update, written for ONE client: the engine vmaps (or maps) it.

        Args:
          message_down: what ``broadcast`` sent the client's tier.
          client_state: this client's state (private: it never reaches the server).
          data: the client's training data, a :class:`jaxfed.data.ClientData`.
          rng: a key from the root seed, the round and the client id.
          info: the round being run (``options.optimizer(info.round)``: that round's learning
            rate) and the client's tier.

        Returns:
          ``(client_state, message_up, metrics)``: the client's new state, its upload, and a dict
          of scalars whose sample-weighted mean the engine reports.
        """


class ContributeFn(Protocol):
    def __call__(self, server_state: PyTree, message_up: PyTree, weight: jax.Array, info: RoundInfo) -> PyTree:
        """One upload's share of what the server sums over the round's clients.

        Args:
          server_state: the server's state.
          message_up: one client's upload (decoded by ``receive`` where there is one).
          weight: float32 scalar, the client's training-set size. A row of weight 0 (padding, a
            skipped client) counts as contributing zero, whatever this returns.
          info: the round being run and the client's tier (None where every tier's clients run
            as one group: an algorithm with ``pad_tier``).

        Returns:
          a pytree of arrays of one structure and shape for every client of every tier (e.g.
          :func:`jaxfed.core.weighted_share`); the engine sums them leafwise, chunk by chunk and
          across devices, and never holds every upload of a round at once.
        """


class ApplyFn(Protocol):
    def __call__(self, server_state: PyTree, total: PyTree, info: RoundInfo) -> PyTree:
        """The server's new state from the round's summed contributions.

        Args:
          server_state: the server's state.
          total: the leafwise sum of every kept client's ``contribute``.
          info: the round being run; ``tier`` is None (every tier's clients are in the sum).

        Returns:
          the new server state. The engine keeps the old one when no client carried weight.
        """


class Aggregation(NamedTuple):
    """Server aggregation as a reduction: ``contribute`` per upload, summed, then ``apply``.

    Attributes:
      contribute: :class:`ContributeFn`.
      apply: :class:`ApplyFn`.
    """

    contribute: ContributeFn
    apply: ApplyFn


class ServerUpdateFn(Protocol):
    def __call__(self, server_state: PyTree, messages_up: PyTree, weights: jax.Array, info: RoundInfo) -> PyTree:
        """The server's aggregation of the round's uploads, all at once: for an algorithm whose
        step is not a sum over clients (every built-in's is: they give an :class:`Aggregation`).

        Args:
          server_state: the server's state.
          messages_up: every upload of the round (decoded by ``receive`` where there is one),
            stacked along a leading axis in the engine's run order, not by client id.
          weights: ``[rows]`` float32, each row's training-set size; 0 for padding rows and for
            skipped clients (aggregate with the weights, never by row position).
          info: the round being run; ``tier`` is None (every tier's rows are here).

        Returns:
          the new server state. The engine keeps the old one when every weight is 0.
        """


class EvalParamsFn(Protocol):
    def __call__(self, server_state: PyTree, client_state: PyTree) -> dict:
        """A client's personalized model.

        Args:
          server_state: the server's state (or, with ``eval_server``, the tier's view of it).
          client_state: the client's state.

        Returns:
          Flax variables, ``{"params": ..., **collections}``.
        """


class PersonalizeFn(Protocol):
    def __call__(self, server_state: PyTree, client_state: PyTree, data: Any, rng: jax.Array, info: RoundInfo) -> dict:
        """A client's personalized model made at evaluation from its training data (FedBABU's
        fine-tuning): its own local training, with nothing uploaded and nothing kept.

        Args:
          server_state: the server's state (or, with ``eval_server``, the tier's view of it).
          client_state: the client's state.
          data: the client's training data, a :class:`jaxfed.data.ClientData`.
          rng: a key from the root seed, the rounds completed and the client id.
          info: the rounds completed and the client's tier.

        Returns:
          Flax variables, ``{"params": ..., **collections}``: the model evaluated on the client's
          test split in place of ``eval_params``'.
        """


class GlobalParamsFn(Protocol):
    def __call__(self, server_state: PyTree) -> dict:
        """The global model, for an algorithm that has one.

        Args:
          server_state: the server's state.

        Returns:
          Flax variables, ``{"params": ..., **collections}``.
        """


class ReceiveFn(Protocol):
    def __call__(self, server_state: PyTree, message_up: PyTree, info: RoundInfo) -> PyTree:
        """The server's decoding of one upload of tier ``info.tier`` into the shape every tier shares.

        Args:
          server_state: the server's state.
          message_up: one client's upload (the engine vmaps this over a tier's uploads).
          info: the round being run and the tier of the client that sent it.

        Returns:
          the decoded upload (FedHM: factors reconstructed to full kernels).
        """


class PadTierFn(Protocol):
    def __call__(self, message_down: PyTree, info: RoundInfo) -> PyTree:
        """Tier ``info.tier``'s broadcast in the one shape every tier's padded broadcast has.

        Args:
          message_down: what ``broadcast`` sent the tier.
          info: the round being run and the tier.

        Returns:
          the message padded (FedHM: factors zero-padded to the largest tier's rank, a kernel
          switch per layer) so that ``client_update`` on it computes what it computes on the
          tier's own message, and its upload decodes (``receive``) to the same value.
        """


class EvalServerFn(Protocol):
    def __call__(self, server_state: PyTree, info: RoundInfo) -> PyTree:
        """What ``eval_params`` receives for the clients of ``info.tier``, once per tier at evaluation.

        Args:
          server_state: the server's state.
          info: the rounds completed and the tier evaluated.

        Returns:
          the tier's view of the server state (FedARA: the global extractor truncated to the
          tier's rank).
        """


class MessageBytesFn(Protocol):
    def __call__(self, message_up: PyTree) -> jax.Array:
        """The bytes one upload really takes, where only part of a fixed-shape message is sent.

        Args:
          message_up: one client's upload.

        Returns:
          a scalar (the engine's ``bytes_up`` sums it over the round's real clients).
        """


class DownloadBytesFn(Protocol):
    def __call__(self, message_down: PyTree, client_state: PyTree, info: RoundInfo) -> jax.Array:
        """The bytes one client of this round must download when it keeps what it received before.

        Args:
          message_down: what ``broadcast`` sent the client's tier.
          client_state: the client's state BEFORE this round's update (what it holds).
          info: the round being run and the client's tier.

        Returns:
          a scalar (the engine's ``bytes_down_cached`` sums it over the round's real clients).
        """


class SentBytesFn(Protocol):
    def __call__(self, message_down: PyTree, client_state: PyTree, info: RoundInfo) -> jax.Array:
        """The bytes the server sends one client, where each client is sent only its own part of
        ``message_down`` (a table of every client's rows the server holds: FedAMP's cloud models).

        Args:
          message_down: what ``broadcast`` sent the client's tier.
          client_state: the client's state BEFORE this round's update (it may say which part is its own).
          info: the round being run and the client's tier.

        Returns:
          a scalar (the engine's ``bytes_down`` sums it over the round's real clients; it is also
          ``bytes_down_cached``'s default).
        """


class InitClientFn(Protocol):
    def __call__(self, client_state: PyTree, client_id: jax.Array, tier: jax.Array) -> PyTree:
        """A client's own starting state, applied once per client at init.

        Args:
          client_state: the state ``init`` made (the same for every client).
          client_id: int32 scalar, the client's id.
          tier: int32 scalar, the client's tier (0 for an algorithm without tiers).

        Returns:
          the client's starting state.
        """


class FederatedAlgorithm(NamedTuple):
    """A federated algorithm: a name and pure functions the engine calls every round.

    A round: ``broadcast`` per tier, ``client_update`` per sampled client (vmapped), ``receive``
    per upload (tiers only), then the server's step: ``aggregation`` (``contribute`` per upload,
    summed over the clients as they run, then ``apply``), or ``server_update`` over every upload
    at once. Give exactly one of the two. The server sees the uploads (``message_up``) and nothing
    else: what a client keeps private stays in its ``client_state``. States and messages are
    pytrees of arrays (``NamedTuple`` records read best).

    Construct it with keywords: the optional fields come in groups (server, evaluation, tiers,
    accounting, client init) whose order may change. A minimal FedAvg::

        def init(rng):
            return model.init(rng)["params"], ()

        def broadcast(server_state, info):
            return server_state

        def client_update(params, client_state, data, rng, info):
            variables, metrics = train_classifier(
                model, options.optimizer(info.round), {"params": params}, data, rng, **options.batching()
            )
            return client_state, variables["params"], metrics

        fedavg = FederatedAlgorithm(
            name="fedavg", init=init, broadcast=broadcast, client_update=client_update,
            aggregation=Aggregation(
                contribute=lambda server_state, params, weight, info: weighted_share(params, weight),
                apply=lambda server_state, total, info: mean_of(total),  # sum w x / sum w
            ),
            eval_params=lambda server_state, client_state: {"params": server_state},
            global_params=lambda server_state: {"params": server_state},
        )

    Attributes:
      name: the algorithm's name (metrics, checkpoints).
      init: :class:`InitFn`.
      broadcast: :class:`BroadcastFn`.
      client_update: :class:`ClientUpdateFn`.
      eval_params: :class:`EvalParamsFn`.
      aggregation: (server) :class:`Aggregation`: the server's step as a sum over clients; a
        round's memory then grows with the chunk of clients run together, not with the clients.
      server_update: (server) :class:`ServerUpdateFn`: the server's step over every upload at once.
      global_params: (evaluation) :class:`GlobalParamsFn`; None: no global model, no global accuracy.
      evaluates_global: (evaluation) every client's personalized model is the global one: the
        engine evaluates it once over the pooled test examples.
      eval_model: (evaluation) the model ``eval_params``' variables belong to when it is not the
        run's model (the ensemble's mixture).
      personalize: (evaluation) :class:`PersonalizeFn`; with it the engine evaluates the model it
        makes from each client's training data instead of ``eval_params``' (FedBABU's fine-tuning).
      num_tiers: (tiers) clients sit in this many static tiers of equal contiguous id blocks
        (client k of N in tier ``k * num_tiers // N``); each tier runs with its own broadcast and
        shapes, its sampled clients padded with weight-0 rows.
      receive: (tiers) :class:`ReceiveFn`; without it every tier's uploads share one shape.
      pad_tier: (tiers) :class:`PadTierFn`; with it, where clients run vmapped together
        (``client_chunk`` other than 1) or every tier's own broadcast already has one shape, the
        clients of every tier run as one group (one vmapped / chunked program), each client
        getting its tier's padded broadcast, and ``client_update``, ``receive`` and
        ``contribute`` are called with ``info.tier`` None (what a client needs of its tier travels in its message); the
        bytes counted are the tier's own.
      eval_server: (tiers) :class:`EvalServerFn`; default: the server state itself.
      message_bytes: (accounting) :class:`MessageBytesFn`; default: the upload's arrays.
      download_bytes: (accounting) :class:`DownloadBytesFn`; default: ``sent_bytes``, else all of
        ``message_down``.
      sent_bytes: (accounting) :class:`SentBytesFn`; default: all of ``message_down``.
      init_client: (client init) :class:`InitClientFn`; default: every client starts alike.
      options: (description) the algorithm's options (a :class:`jaxfed.options.Options`) the
        record was built with, for the record only: the engine never reads it. Every built-in's
        constructor and the registry's build set it; run directories record it (``config.json``)
        and a resume compares it with the checkpoint's (:mod:`jaxfed.runs.fingerprint`). None: unknown.
    """

    name: str
    init: InitFn
    broadcast: BroadcastFn
    client_update: ClientUpdateFn
    eval_params: EvalParamsFn
    # server: exactly one of
    aggregation: Aggregation | None = None
    server_update: ServerUpdateFn | None = None
    # evaluation
    global_params: GlobalParamsFn | None = None
    evaluates_global: bool = False
    eval_model: Any = None
    personalize: PersonalizeFn | None = None
    # tiers
    num_tiers: int | None = None
    receive: ReceiveFn | None = None
    pad_tier: PadTierFn | None = None
    eval_server: EvalServerFn | None = None
    # accounting
    message_bytes: MessageBytesFn | None = None
    download_bytes: DownloadBytesFn | None = None
    sent_bytes: SentBytesFn | None = None
    # client init
    init_client: InitClientFn | None = None
    # description
    options: Any = None


def check_server_step(algorithm: FederatedAlgorithm) -> None:
    """A ValueError unless ``algorithm`` gives exactly one of ``aggregation`` and ``server_update``."""
    given = [f for f in ("aggregation", "server_update") if getattr(algorithm, f) is not None]
    if len(given) != 1:
        raise ValueError(
            f"{algorithm.name}: give exactly one of aggregation (a sum over clients) and server_update "
            f"(every upload at once); got {' and '.join(given) if given else 'neither'}"
        )


# ----- the contract's rules on what the functions return, checked where the engine traces them ---
# Each check reads shapes and structures only (no computation): the engine calls them as it traces
# a round or an evaluation, so a function that breaks the contract is named there, in one line,
# instead of failing later inside JAX, Flax or the run directory.


def check_client_update(result, client_state) -> tuple:
    """``client_update``'s ``result`` as ``(client_state, message_up, metrics)``; a ConfigError
    unless it is that triple, its client state has the structure and shapes of the one it was
    given (``init``'s), and its metrics are a dict of scalars."""
    if not (isinstance(result, tuple) and len(result) == 3):
        raise ConfigError(f"client_update: must return (client_state, message_up, metrics), got {_kind(result)}")
    new_state, message_up, metrics = result
    _check_same_tree("client_update", "client state", client_state, new_state)
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"client_update: its metrics must be a dict of scalars, got {_kind(metrics)}")
    for key, value in metrics.items():
        if jnp.shape(value) != ():
            raise ConfigError(
                f"client_update: metric '{key}' has shape {jnp.shape(value)}; metrics must be scalars "
                "(one number per client, averaged over the round's clients)"
            )
    return result


def check_server_state(function: str, new_state, server_state):
    """``new_state``, what ``function`` (``aggregation.apply`` or ``server_update``) returned; a
    ConfigError unless it has the structure and shapes of ``server_state``, the one it was given."""
    _check_same_tree(function, "server state", server_state, new_state)
    return new_state


def check_variables(function: str, variables):
    """``variables``, what ``function`` (``eval_params``, ``personalize``, ``global_params``)
    returned; a ConfigError unless they are Flax variables, a dict with a ``"params"`` entry."""
    if not isinstance(variables, Mapping) or "params" not in variables:
        keys = f" with keys {clip(', '.join(map(str, variables)))}" if isinstance(variables, Mapping) else ""
        raise ConfigError(
            f"{function}: must return Flax variables {{'params': ..., **collections}}, "
            f"got {_kind(variables) if not keys else 'a dict'}{keys}"
        )
    return variables


def _check_same_tree(function: str, what: str, given, returned) -> None:
    difference = first_difference(given, returned)
    if difference is not None:
        raise ConfigError(
            f"{function}: the {what} it returns differs from the one it was given (init's) {difference}; "
            f"return a {what} of the same structure and shapes"
        )


def first_difference(expected, got, path: tuple = ()) -> str | None:
    """Where pytree ``got`` first differs from ``expected`` in structure or leaf shape
    (``at .personal['fc1']: ...``), or None where they agree."""
    node, other = (jax.tree.structure(t, is_leaf=lambda x, t=t: x is not t) for t in (expected, got))
    if node != other:
        return f"at {_place(path)}: {_kind(got)}, not {_kind(expected)}"
    if node.num_nodes == 1 and node.num_leaves == 1:  # a leaf
        shapes = jnp.shape(expected), jnp.shape(got)
        return None if shapes[0] == shapes[1] else f"at {_place(path)}: shape {shapes[1]}, not {shapes[0]}"
    children = (jax.tree_util.tree_flatten_with_path(t, is_leaf=lambda x, t=t: x is not t)[0] for t in (expected, got))
    for (key, e), (_, g) in zip(*children):
        found = first_difference(e, g, path + key)
        if found is not None:
            return found
    return None


def _place(path: tuple) -> str:
    return jax.tree_util.keystr(path) if path else "the top"


def _kind(value) -> str:
    """A pytree node described for an error: ``ClientState(personal, model_state)``, ``a dict
    with keys a, b``, ``an array of shape (3,)``."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return clip(f"{type(value).__name__}({', '.join(value._fields)})")
    if isinstance(value, Mapping):
        return clip(f"a {type(value).__name__} with keys {', '.join(map(str, value))}")
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if value is None:
        return "None"
    if hasattr(value, "shape") or isinstance(value, (int, float, complex, bool)):
        return f"an array of shape {jnp.shape(value)}"
    return f"a {type(value).__name__}"
