"""FedLoRU (Park et al.) and its family: clients train low-rank updates of a frozen global model.

Each adapted kernel W runs as ``W + s * (down @ up - down0 @ up0)`` with ``s = lora_alpha / r``
(conv: ``im2col`` layout, a kh x kw conv to r channels then a 1 x 1 conv, as the paper); the
other parameters (the first layer, the head, biases, norms) train in full. The server averages
``down`` and ``up`` separately (and the full parameters) with sample weights. Every
``accumulate_every`` rounds FedLoRU folds the update into W: ``W <- W + s * (down @ up - down0 @ up0)``;
with ``reinit`` the factors restart (``down`` Kaiming, ``up`` 0), otherwise they continue and
``(down0, up0)`` remembers what W already holds, so nothing is counted twice.

- ``fedlora``: never accumulates (W stays at its init).
- ``init=authors``: the adapted kernels W start at zero and both factors random (Kaiming), so the
  model starts as a pure rank-r model, as the authors' code builds its FedLoRA baseline; the
  default ``init=lora`` starts from the model's own init with ``up = 0`` (a zero update). Factors
  restarted after an accumulation always start at a zero update.
- ``pfedloru``: each client also holds a private personal pair (rank ``personal_rank``) added to
  the model; every round it trains the personal pair ``personal_epochs``, then the global pair
  and the full parameters ``global_epochs``. Only the global pair is uploaded.
- ``mfedloru``: clients in tiers of rank ``r_k = round(ratio * r)``. A tier with ``r_k < r`` trains
  nested factors of the updates of both factors, ``down + D1 D2`` and ``up + U1 U2`` with
  ``down, up`` frozen, and uploads ``(D1, D2, U1, U2)``; a tier with ``r_k = r`` trains ``down, up``
  as FedLoRU. The server recovers each client's rank-r factors and aggregates as FedLoRU.

:class:`FamilyOptions` (the paper's App. D training, ``lora_alpha``, ``layers``),
:func:`adapted_ranks` and :func:`lora_scale` are the family's rules, which pFedLoRA
(:mod:`jaxfed.algorithms.pfedlora`) follows too.

Download (``download_bytes``): a client keeps the W it last received, so it downloads the frozen
kernels only once, then, after accumulations it missed, their folded factors (``reinit``: one
rank-r set per accumulation; without ``reinit`` none, W - W_old = s (merged - merged_old) comes
with the broadcast) or W again when that is smaller. ``bytes_down`` still counts W every round.

``server_optimizer`` (FedLoRA, FedLoRU, pFedLoRU, mFedLoRU; :mod:`jaxfed.algorithms.fedopt`)
steps the full parameters and the factors from the clients' averages as FedAvg's server does its
model: "FedLoRU techniques can be easily integrated into other federated learning schemes such as
FedAdam and FedAdagrad" (the paper, §5). The factors' optimizer state restarts with the factors
(``reinit``) at each accumulation; the full parameters' carries on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms.fedopt import ServerOptimizerOptions, step_toward_average
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import masked, train_parameters
from jaxfed.contract import Aggregation, FederatedAlgorithm
from jaxfed.core import lowrank, mean_of, tree_bytes, tree_select, weighted_share
from jaxfed.nn import model_template, split_variables
from jaxfed.nn.layers import choose_layers
from jaxfed.options import (
    CLIENT_OPTIMIZER_HELP,
    TrainingOptions,
    at_least,
    each,
    non_negative,
    one_of,
    option,
    rank_ratio,
    resolve,
)

LAYOUT = "im2col"
MFEDLORU_DEFAULT_TIERS = (1.0, 0.5, 0.25)
INITS = ("lora", "authors")
SETUP = "FedLoRU paper App. D (image datasets)"
AUTHORS_CODE = "the authors' code (haemPark/fedloru_official, main.py)"


@dataclasses.dataclass(frozen=True)
class FamilyOptions(TrainingOptions):
    """What the whole FedLoRU family shares (pFedLoRA too): the paper's App. D training, the LoRA
    scale and the adapted layers."""

    local_epochs: int = option(5, "local epochs per round", source=SETUP)
    batch_size: int = option(32, "local batch size", source=SETUP)
    lr: float = option(0.1, "client learning rate (the paper grid-searches 0.01-0.3)", source=SETUP)
    client_optimizer: str = option("sgd", CLIENT_OPTIMIZER_HELP, source=SETUP + ": SGD with momentum 0.9")
    momentum: float = option(0.9, "client SGD momentum", source=SETUP)
    clip_norm: float = option(
        0.1,
        "clip each local gradient to this global norm before the optimizer's step; 0 = off (without it lr 0.1 with "
        "momentum 0.9 diverges in round 1 on the MNIST CNN, measured)",
        source=AUTHORS_CODE + " (--max_grad_norm 0.1; the paper does not state it)",
    )
    weight_decay: float = option(
        1e-4, "client weight decay (added to the gradient)", source=AUTHORS_CODE + " (--weight_decay 1e-4)"
    )
    lr_schedule: str = option(
        "cosine",
        "learning rate over rounds: constant, or cosine from lr to lr_min over lr_decay_rounds (then lr_min; "
        "torch's CosineAnnealingLR, which the authors use, rises again after its cycle)",
        source=SETUP + ": cosine annealing",
    )
    lr_min: float = option(1e-3, "cosine: the learning rate it decays to", source=SETUP)
    lr_decay_rounds: int = option(
        50, "cosine: rounds from lr to lr_min (the paper: 50 or the total rounds)", source=SETUP
    )
    lora_alpha: float = option(
        0.0,
        "LoRA alpha: scale = alpha / r; 0 = alpha r (scale 1)",
        source="FedLoRU paper §4 (alpha = r)",
        check=non_negative,
    )
    layers: tuple[str, ...] = option(
        (), "layers to adapt (comma-separated); empty = every Dense/Conv but the first called and the last"
    )


@dataclasses.dataclass(frozen=True)
class FedLoRAOptions(FamilyOptions, ServerOptimizerOptions):
    """Low-rank client updates of a frozen global model (FedLoRA: never accumulated), and the
    server optimizer of their average."""

    lora_rank: int = option(
        16,
        "rank r of every LoRA update (at most the layer's matricized min dim); the paper's 128 is for "
        "ResNet-18 layers, larger than the CNN's (64 at most)",
        source="jaxfed default (the paper: 128 on ResNet-18)",
        check=at_least(1),
    )
    init: str = option(
        "lora",
        "lora (W the model's init, up = 0: a zero update) or authors (adapted W = 0, both factors random: "
        "a pure rank-r model, the authors' FedLoRA baseline)",
        source="FedLoRU authors' code (authors)",
        check=one_of(*INITS),
    )


@dataclasses.dataclass(frozen=True)
class FedLoRUOptions(FedLoRAOptions):
    """FedLoRA's options plus the accumulation of the updates into the global model."""

    accumulate_every: int = option(
        50,
        "fold the LoRA updates into the global model every this many rounds; 0 = never (FedLoRA)",
        source="FedLoRU paper App. D",
        check=non_negative,
    )
    reinit: bool = option(
        True,
        "restart the LoRA factors after accumulating (false: continue them, 'momentum' init)",
        source="FedLoRU paper App. D (random init)",
    )


@dataclasses.dataclass(frozen=True)
class PFedLoRUOptions(FedLoRUOptions):
    """FedLoRU's options plus a private personal LoRA pair."""

    local_epochs: int = option(
        5,
        "epochs on the global pair (and the full-rank layers) each round, after the personal pair",
        source=SETUP,
        check=non_negative,
    )
    personal_rank: int = option(8, "rank of the personal LoRA pair", source="jaxfed default", check=at_least(1))
    personal_epochs: int = option(
        1,
        "epochs on the personal pair each round, first",
        source="jaxfed default (the paper gives no split)",
        check=non_negative,
    )


@dataclasses.dataclass(frozen=True)
class MFedLoRUOptions(FedLoRUOptions):
    """FedLoRU's options plus client tiers of nested ranks."""

    tiers: tuple[float, ...] = option(
        MFEDLORU_DEFAULT_TIERS,
        "one ratio in (0, 1] per client tier: nested rank round(ratio * lora_rank)",
        source="jaxfed default (the paper's tiers are per experiment)",
        check=each(rank_ratio),
    )


class _Adapted(NamedTuple):
    """The static description of a model's adapted layers, shared by the whole family."""

    template: dict  # parameter shapes
    has_private_stats: bool  # the model has BatchNorm statistics (no global model then)
    ranks: dict[str, int]  # adapted layer -> rank
    scale: float

    def fresh(self, rng, ranks=None):
        return lowrank.init_loras(rng, self.template, self.ranks if ranks is None else ranks, LAYOUT)

    def effective(self, params, loras, merged=None):
        """W + s * (down @ up - down0 @ up0) on every adapted layer (``merged`` None: nothing
        of the factors is in W yet, ``down0 @ up0 = 0``)."""
        with_update = lowrank.add_loras(params, loras, self.scale, LAYOUT)
        return with_update if merged is None else lowrank.add_loras(with_update, merged, -self.scale, LAYOUT)

    def split(self, params):
        """``(free, frozen)``: the parameters trained in full, and the adapted kernels."""
        return lowrank.split_kernels(params, list(self.ranks))


def adapted_ranks(model, template, rank: int, layers, field: str = "lora_rank") -> dict[str, int]:
    """``{layer: rank}`` over ``layers`` (empty: every Dense/Conv but the first called and the
    last) of ``model`` (``template``: its parameter shapes); a one-line ConfigError naming
    ``field`` where a layer matricized in ``LAYOUT`` cannot hold ``rank``."""
    ranks = {}
    for key in choose_layers(model, layers or (), "the FedLoRU family"):
        shape = lowrank.get_layer(template, key)["kernel"].shape
        ranks[key] = lowrank.check_rank(lowrank.matrix_shape(shape, LAYOUT), rank, field=field, name=key)
    return ranks


def lora_scale(rank: int, lora_alpha: float) -> float:
    """The family's factor on ``down @ up``: ``lora_alpha / rank``, 1 with ``lora_alpha = 0``."""
    return (lora_alpha or rank) / rank


def _adapted(model, rank: int, lora_alpha: float, layers, field: str = "lora_rank") -> _Adapted:
    template, private_stats = model_template(model)
    ranks = adapted_ranks(model, template, rank, layers, field)
    return _Adapted(template, bool(private_stats), ranks, lora_scale(rank, lora_alpha))


class ServerState(NamedTuple):
    params: Any  # W: the global model (adapted kernels frozen during a round)
    loras: Any  # {layer: LoRA}: the global factors (down, up)
    merged: Any  # {layer: LoRA}: what W already holds of the factors (zeros with reinit)
    key_data: jax.Array  # raw PRNG bits (checkpointable), folded with the round for re-initialization


class OptimizedServerState(NamedTuple):
    """:class:`ServerState` with a server optimizer (``server_optimizer`` other than none: without
    one the state, and the checkpoints written before the option, stay as they were)."""

    params: Any
    loras: Any
    merged: Any
    key_data: jax.Array
    opt_state: Any  # the server optimizer's: (of the full parameters, of the factors)


class Broadcast(NamedTuple):
    """What a FedLoRU-family client receives: W, the global factors, what W already holds of them
    (None, not sent, when that is always zero: with ``reinit`` and in FedLoRA) and, for
    mFedLoRU's nested tiers, the nested pairs' start."""

    params: Any
    loras: Any
    merged: Any = None
    nested: Any = None
    trains_loras: Any = None  # mFedLoRU's padded tiers: 1.0 where the tier trains the rank-r factors, else 0.0


class Upload(NamedTuple):
    """The trained full-rank parameters and either the rank-r factors or (mFedLoRU's nested
    tiers) the nested pairs ``(D1 D2, U1 U2)`` per layer."""

    free: Any
    loras: Any = None
    nested: Any = None


NO_W = -1  # a client's w_round before its first download


class LowRankClient(NamedTuple):
    """A FedLoRU-family client: model statistics and the round whose W it holds (the index of the
    round it last received W in; ``NO_W``: none)."""

    model_state: Any
    w_round: jax.Array


class PersonalClient(NamedTuple):
    """pFedLoRU's client: model statistics, the private personal pair and the round whose W it holds."""

    model_state: Any
    personal: Any  # {layer: LoRA}
    w_round: jax.Array


def _broadcaster(options):
    """``broadcast(server_state, info)`` of the family: ``merged`` travels only when it can be
    non-zero (accumulation without ``reinit``, the 'momentum' init)."""
    accumulate_every, reinit = _accumulation(options)
    sends_merged = bool(accumulate_every) and not reinit

    def broadcast(server_state, info) -> Broadcast:
        return Broadcast(server_state.params, server_state.loras, server_state.merged if sends_merged else None)

    return broadcast


def _download_counter(adapted: _Adapted, options):
    """``download_bytes(message, client_state, info)``: the broadcast without the frozen kernels
    W, plus what brings the client's W (from round ``client_state.w_round``) up to round ``info.round``'s:
    all of W on a first download, else ``min(W, missed accumulations x rank-r factors)`` (with
    ``reinit``; without it ``merged`` in the broadcast already carries the change)."""
    accumulate_every, reinit = _accumulation(options)

    def download_bytes(message: Broadcast, client_state, info):
        frozen = tree_bytes(adapted.split(message.params)[1])
        held = client_state.w_round
        refresh = jnp.float32(0.0)
        if accumulate_every and reinit:
            # the accumulations since W of round w_round: those with rounds completed in (w_round, info.round]
            missed = info.round // accumulate_every - held // accumulate_every
            refresh = jnp.minimum(frozen, missed.astype(jnp.float32) * tree_bytes(message.loras))
        refresh = jnp.where(held == NO_W, jnp.float32(frozen), refresh)
        return tree_bytes(message) - frozen + refresh

    return download_bytes


def _upload(trained: dict) -> Upload:
    return Upload(free=trained["free"], loras=trained.get("loras"), nested=trained.get("nested"))


def _zeros_like(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def pure_low_rank_start(rng, params, loras):
    """``init=authors``: ``(params, loras)`` with the adapted kernels at zero and each ``up``
    uniform in ``+-1/sqrt(rank)`` (torch's ``kaiming_uniform_(a=sqrt(5))`` on LoRA's B)."""
    keys = jax.random.split(rng, max(1, len(loras)))
    started = {}
    for key, k in zip(loras, keys):
        down, up = loras[key]
        started[key] = lowrank.LoRA(down, lowrank.kaiming_uniform(k, up.shape, up.shape[0], up.dtype))
        layer = lowrank.get_layer(params, key)
        params = lowrank.replace_layer(params, key, {**layer, "kernel": jnp.zeros_like(layer["kernel"])})
    return params, started


def _server_init(model, adapted: _Adapted, init: str = "lora", optimizer=None):
    """The family's server state (``optimizer``: the server optimizer, None without one) and the
    client state holding only model statistics."""

    def init_fn(rng):
        init_rng, lora_rng, server_rng = jax.random.split(rng, 3)
        params, model_state = split_variables(model.init(init_rng))
        loras = adapted.fresh(lora_rng)
        if init == "authors":
            params, loras = pure_low_rank_start(jax.random.fold_in(lora_rng, 1), params, loras)
        server = ServerState(params, loras, _zeros_like(loras), jax.random.key_data(server_rng))
        if optimizer is not None:
            opt_state = (optimizer.init(adapted.split(params)[0]), optimizer.init(loras))
            server = OptimizedServerState(*server, opt_state)
        return server, LowRankClient(model_state, jnp.int32(NO_W))

    return init_fn


def _aggregate(adapted: _Adapted, accumulate_every: int, reinit: bool, optimizer=None) -> Aggregation:
    """FedLoRU's server step from the uploads of the full parameters and the (rank-r) factors:
    separate sample-weighted means (stepped to by ``optimizer``, the server optimizer, if any),
    then accumulation after every ``accumulate_every``-th round (rounds completed a multiple of it)."""

    def contribute(server_state, message, weight, info):
        return weighted_share(message.free, weight), weighted_share(message.loras, weight)

    def apply(server_state, total, info):
        free, loras = (mean_of(part) for part in total)
        current, frozen = adapted.split(server_state.params)
        if optimizer is not None:
            free_state, lora_state = server_state.opt_state
            free, free_state = step_toward_average(optimizer, current, free, free_state)
            loras, lora_state = step_toward_average(optimizer, server_state.loras, loras, lora_state)
        params = lowrank.merge_kernels(free, frozen)
        merged = server_state.merged
        if accumulate_every:
            completed = info.round + 1  # the rounds completed after this one
            lora_rng = jax.random.fold_in(jax.random.wrap_key_data(server_state.key_data), completed)
            accumulated = adapted.effective(params, loras, merged)
            restarted = adapted.fresh(lora_rng) if reinit else loras
            now = completed % accumulate_every == 0
            params = tree_select(now, accumulated, params)
            merged = tree_select(now, _zeros_like(loras) if reinit else loras, merged)
            loras = tree_select(now, restarted, loras)
            if optimizer is not None and reinit:  # new factors: their optimizer state starts again
                lora_state = tree_select(now, optimizer.init(restarted), lora_state)
        stepped = server_state._replace(params=params, loras=loras, merged=merged)
        return stepped if optimizer is None else stepped._replace(opt_state=(free_state, lora_state))

    return Aggregation(contribute, apply)


def _global_model(adapted: _Adapted):
    def global_params(server_state):
        return {"params": adapted.effective(server_state.params, server_state.loras, server_state.merged)}

    return global_params


def _accumulation(options) -> tuple[int, bool]:
    """``(accumulate_every, reinit)``: FedLoRA's options never accumulate."""
    if isinstance(options, FedLoRUOptions):
        return options.accumulate_every, options.reinit
    return 0, True


def _low_rank_updates(model, options: FedLoRAOptions, name: str) -> FederatedAlgorithm:
    """FedLoRU (or, with :class:`FedLoRAOptions`, FedLoRA): clients train ``free`` and the factors."""
    adapted = _adapted(model, options.lora_rank, options.lora_alpha, options.layers)
    global_params = _global_model(adapted)
    server_optimizer = options.server()
    aggregate = _aggregate(adapted, *_accumulation(options), server_optimizer)

    def client_update(message, client_state, data, rng, info):
        optimizer = options.optimizer(info.round)  # this round's learning rate
        free, frozen = adapted.split(message.params)

        def to_params(t):
            return adapted.effective(lowrank.merge_kernels(t["free"], frozen), t["loras"], message.merged)

        trainable = {"free": free, "loras": message.loras}
        trained, model_state, metrics = train_parameters(
            model,
            optimizer,
            trainable,
            client_state.model_state,
            data,
            rng,
            to_params=to_params,
            **options.batching(),
        )
        return LowRankClient(model_state, info.round), _upload(trained), metrics

    return FederatedAlgorithm(
        name=name,
        options=options,
        init=_server_init(model, adapted, options.init, server_optimizer),
        broadcast=_broadcaster(options),
        client_update=client_update,
        aggregation=aggregate,
        eval_params=lambda server_state, client_state: {**global_params(server_state), **client_state.model_state},
        global_params=None if adapted.has_private_stats else global_params,
        evaluates_global=not adapted.has_private_stats,
        download_bytes=_download_counter(adapted, options),
    )


def fedloru(model, options: FedLoRUOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedLoRU: low-rank client updates accumulated into W every ``accumulate_every`` rounds."""
    return _low_rank_updates(model, resolve(FedLoRUOptions, options, overrides), "fedloru")


def fedlora(model, options: FedLoRAOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedLoRA (FedLoRU's baseline): the same low-rank updates, never accumulated (W stays at its init)."""
    return _low_rank_updates(model, resolve(FedLoRAOptions, options, overrides), "fedlora")


def pfedloru(model, options: PFedLoRUOptions | None = None, **overrides) -> FederatedAlgorithm:
    """pFedLoRU: the model is ``W + s_g down_g up_g + s_p down_p up_p`` (``s = alpha / rank`` of
    each pair; ``lora_alpha=0``: scale 1). The personal pair is client state."""
    options = resolve(PFedLoRUOptions, options, overrides)
    adapted = _adapted(model, options.lora_rank, options.lora_alpha, options.layers)
    personal = _adapted(model, options.personal_rank, options.lora_alpha, list(adapted.ranks), field="personal_rank")
    batching = {"batch_size": options.batch_size, "drop_last": options.drop_last}
    global_params = _global_model(adapted)
    server_optimizer = options.server()
    aggregate = _aggregate(adapted, options.accumulate_every, options.reinit, server_optimizer)
    server_init = _server_init(model, adapted, options.init, server_optimizer)

    def init(rng):
        server_rng, personal_rng = jax.random.split(rng)
        server, client = server_init(server_rng)
        return server, PersonalClient(client.model_state, personal.fresh(personal_rng), client.w_round)

    def client_update(message, client_state, data, rng, info):
        optimizer = options.optimizer(info.round)  # this round's learning rate
        personal_rng, global_rng = jax.random.split(rng)
        free, frozen = adapted.split(message.params)

        def model_params(free, global_pair, personal_pair):
            shared = adapted.effective(lowrank.merge_kernels(free, frozen), global_pair, message.merged)
            return lowrank.add_loras(shared, personal_pair, personal.scale, LAYOUT)

        personal_pair, model_state, personal_metrics = train_parameters(
            model,
            optimizer,
            client_state.personal,
            client_state.model_state,
            data,
            personal_rng,
            epochs=options.personal_epochs,
            to_params=lambda p: model_params(free, message.loras, p),
            **batching,
        )
        trained, model_state, metrics = train_parameters(
            model,
            optimizer,
            {"free": free, "loras": message.loras},
            model_state,
            data,
            global_rng,
            epochs=options.local_epochs,
            to_params=lambda t: model_params(t["free"], t["loras"], personal_pair),
            **batching,
        )
        metrics = {**metrics, "steps": metrics["steps"] + personal_metrics["steps"]}
        return PersonalClient(model_state, personal_pair, info.round), _upload(trained), metrics

    def eval_params(server_state, client_state):
        shared = global_params(server_state)["params"]
        params = lowrank.add_loras(shared, client_state.personal, personal.scale, LAYOUT)
        return {"params": params, **client_state.model_state}

    return FederatedAlgorithm(
        name="pfedloru",
        options=options,
        init=init,
        broadcast=_broadcaster(options),
        client_update=client_update,
        aggregation=aggregate,
        eval_params=eval_params,
        global_params=None if adapted.has_private_stats else global_params,
        download_bytes=_download_counter(adapted, options),
    )


def nested_rank(rank: int, ratio: float) -> int:
    """mFedLoRU's tier rank ``max(1, round(ratio * rank))`` (a ratio outside (0, 1] is a ConfigError)."""
    lowrank.check_ratio("tiers", ratio)
    return max(1, int(ratio * rank + 0.5))


def with_nested(loras, nested):
    """Each layer's rank-r factors ``(down + D1 D2, up + U1 U2)`` from ``nested[key] = (D, U)``,
    two :class:`LoRA` pairs (``D.down`` = D1 ``[rows, r_k]``, ``D.up`` = D2 ``[r_k, r]``, ...)."""
    combined = {}
    for key, lora in loras.items():
        down_update, up_update = nested[key]
        combined[key] = lowrank.LoRA(
            lora.down + down_update.down @ down_update.up, lora.up + up_update.down @ up_update.up
        )
    return combined


def mfedloru(model, options: MFedLoRUOptions | None = None, **overrides) -> FederatedAlgorithm:
    """mFedLoRU over ``len(options.tiers)`` client tiers, tier ``t`` with nested rank
    ``round(tiers[t] * lora_rank)``."""
    options = resolve(MFedLoRUOptions, options, overrides)
    rank = options.lora_rank
    adapted = _adapted(model, rank, options.lora_alpha, options.layers)
    global_params = _global_model(adapted)
    server_optimizer = options.server()
    aggregate = _aggregate(adapted, options.accumulate_every, options.reinit, server_optimizer)
    tiers = options.tiers
    tier_ranks = [nested_rank(rank, ratio) for ratio in tiers]

    def nested_start(rng, nested: int):
        """Fresh nested pairs of rank ``nested`` per layer: ``D1, U1`` Kaiming, ``D2, U2`` zero."""
        keys = jax.random.split(rng, len(adapted.ranks))
        starts = {}
        for k, (key, lora_shape) in zip(keys, _lora_shapes(adapted).items()):
            down_rng, up_rng = jax.random.split(k)
            starts[key] = (
                lowrank.lora_init(down_rng, lora_shape.down, nested),
                lowrank.lora_init(up_rng, lora_shape.up, nested),
            )
        return starts

    shared_message = _broadcaster(options)

    def broadcast(server_state, info):
        message = shared_message(server_state, info)
        if tier_ranks[info.tier] == rank:  # trains the rank-r factors themselves, as FedLoRU
            return message
        # The nested pairs' start, drawn from a key: counted as that key (_nested_start_as_seed).
        rng = jax.random.fold_in(jax.random.wrap_key_data(server_state.key_data), info.round)
        return message._replace(nested=nested_start(jax.random.fold_in(rng, info.tier + 1), tier_ranks[info.tier]))

    trains_factors = rank in tier_ranks  # some tier trains the rank-r factors themselves
    padded_rank = max((r for r in tier_ranks if r < rank), default=0)
    lora_shapes = _lora_shapes(adapted)

    def pad_tier(message, info):
        """Every tier's message in one shape: nested pairs at the largest nested rank (zero
        columns and rows beyond the tier's; all zero for a tier training the rank-r factors) and
        the switch saying which of the two the client trains."""
        if message.nested is None:
            nested = {
                key: (_zero_pair(s.down, padded_rank), _zero_pair(s.up, padded_rank)) for key, s in lora_shapes.items()
            }
        else:
            nested = {
                key: (_pad_pair(d, padded_rank), _pad_pair(u, padded_rank)) for key, (d, u) in message.nested.items()
            }
        return message._replace(nested=nested, trains_loras=jnp.float32(message.nested is None))

    def client_update(message, client_state, data, rng, info):
        optimizer = options.optimizer(info.round)  # this round's learning rate
        free, frozen = adapted.split(message.params)
        both = message.trains_loras is not None and trains_factors  # padded: one kind frozen by the mask
        trainable = {"free": free}
        if message.nested is None or both:
            trainable["loras"] = message.loras
        if message.nested is not None:
            trainable["nested"] = message.nested
        if both:
            on = message.trains_loras
            optimizer = masked(optimizer, {"free": 1.0, "loras": on, "nested": 1.0 - on})

        def to_params(t):
            loras = t.get("loras", message.loras)
            loras = with_nested(loras, t["nested"]) if "nested" in t else loras
            return adapted.effective(lowrank.merge_kernels(t["free"], frozen), loras, message.merged)

        trained, model_state, metrics = train_parameters(
            model, optimizer, trainable, client_state.model_state, data, rng, to_params=to_params, **options.batching()
        )
        return LowRankClient(model_state, info.round), _upload(trained), metrics

    def receive(server_state, message, info):
        """A client's upload as its rank-r factors ``(down + D1 D2, up + U1 U2)``, ``down, up``
        the server's (a padded tier's upload carries them, unchanged where it trained nested pairs)."""
        if message.nested is None:
            return message
        base = server_state.loras if message.loras is None else message.loras
        return Upload(free=message.free, loras=with_nested(base, message.nested))

    return FederatedAlgorithm(
        name="mfedloru",
        options=options,
        init=_server_init(model, adapted, options.init, server_optimizer),
        broadcast=broadcast,
        client_update=client_update,
        aggregation=aggregate,
        eval_params=lambda server_state, client_state: {**global_params(server_state), **client_state.model_state},
        global_params=None if adapted.has_private_stats else global_params,
        evaluates_global=not adapted.has_private_stats,
        num_tiers=len(tier_ranks),
        receive=receive,
        pad_tier=pad_tier if len(set(tier_ranks)) > 1 else None,  # one rank: one shape already
        sent_bytes=_nested_start_as_seed(None),
        download_bytes=_nested_start_as_seed(_download_counter(adapted, options)),
    )


SEED_BYTES = 8  # a PRNG key's data (uint32[2])


def _nested_start_as_seed(count_bytes):
    """``count_bytes`` (a ``sent_bytes`` / ``download_bytes``; None: all of the message) with
    mFedLoRU's nested pairs' start counted as the key a client draws it from (``SEED_BYTES``): a
    lower tier downloads no more than a tier training the rank-r factors themselves."""

    def counted(message: Broadcast, client_state, info):
        sent = tree_bytes(message) if count_bytes is None else count_bytes(message, client_state, info)
        return sent if message.nested is None else sent - tree_bytes(message.nested) + SEED_BYTES

    return counted


def _pad_pair(pair: lowrank.LoRA, rank: int) -> lowrank.LoRA:
    """A nested pair ``(D1 [rows, r_k], D2 [r_k, cols])`` zero-padded to rank ``rank``: the same product."""
    extra = rank - pair.down.shape[-1]
    return lowrank.LoRA(jnp.pad(pair.down, ((0, 0), (0, extra))), jnp.pad(pair.up, ((0, extra), (0, 0))))


def _zero_pair(shape, rank: int) -> lowrank.LoRA:
    """A zero nested pair of rank ``rank`` for a factor of ``shape`` (``(rows, cols)``)."""
    rows, cols = shape
    return lowrank.LoRA(jnp.zeros((rows, rank), jnp.float32), jnp.zeros((rank, cols), jnp.float32))


def _lora_shapes(adapted: _Adapted) -> dict[str, lowrank.LoRA]:
    """Each adapted layer's factor shapes as a LoRA of shapes ``(rows, r)`` and ``(r, cols)``."""
    shapes = {}
    for key, r in sorted(adapted.ranks.items()):
        rows, cols = lowrank.matrix_shape(lowrank.get_layer(adapted.template, key)["kernel"].shape, LAYOUT)
        shapes[key] = lowrank.LoRA(down=(rows, r), up=(r, cols))
    return shapes


builtin("fedlora", FedLoRAOptions, lambda model, options, config: fedlora(model, options))
builtin("fedloru", FedLoRUOptions, lambda model, options, config: fedloru(model, options))
builtin("pfedloru", PFedLoRUOptions, lambda model, options, config: pfedloru(model, options))
builtin("mfedloru", MFedLoRUOptions, lambda model, options, config: mfedloru(model, options))
