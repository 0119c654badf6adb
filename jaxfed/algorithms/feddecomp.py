"""FedDecomp (Wu et al.): every kernel is a shared full-rank part plus a private low-rank part.

Each factorizable kernel of client k is ``theta_k = sigma + tau_k``: ``sigma`` is shared (the
global model; biases and norm parameters belong to it too) and ``tau_k = fold(down @ up)`` is the
client's private low-rank part, zero at init (``down`` Kaiming, ``up`` 0; conv kernels in the
``balanced`` layout ``[(kh*cin), (kw*cout)]``). Ranks: ``round(rank_dense * min(in, out))`` for
Dense and ``round(rank_conv * min(kh*cin, kw*cout))`` for Conv kernels.

``tau_k`` is scaled as the authors' code (loralib) scales it (``lora_scaling=authors``, the
default): ``lora_alpha / rank`` for Dense, and ``lora_alpha / int(rank_conv * cout)`` for Conv,
whose LoRA there has rank ``int(rank_conv * cout) * k``, so the divisor is the rank over ``k``.
``lora_scaling=rank`` divides every layer by its rank; ``none`` is the paper's text, ``tau = B A``.
BatchNorm statistics are averaged with ``sigma`` (``batch_stats=shared``, the authors' code, whose
server averages every non-LoRA entry of the state dict) or stay with each client (``private``).

A round: the client sets ``sigma`` to the global model, trains ``tau_k`` alone for ``lora_epochs``
epochs, then ``sigma`` alone for the remaining ``local_epochs - lora_epochs`` (a fresh optimizer
each phase, every round), and uploads ``sigma``; ``tau_k`` never leaves the client.
``schedule="simultaneous"`` trains both together for ``local_epochs`` (the paper's ablation).
The server averages the uploads uniformly (the paper) or by sample count (``aggregation="samples"``).

:func:`decomposed` is this mechanism given its ranks, scales, layout, schedule, server mean and
BatchNorm rule; :func:`feddecomp` and pFedLoRA (:mod:`jaxfed.algorithms.pfedlora`) both build on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxfed.algorithms.aggregation import averaging, uniform_averaging
from jaxfed.algorithms.fedopt import ServerOptimizerOptions, step_toward_average
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import train_parameters
from jaxfed.contract import Aggregation, FederatedAlgorithm
from jaxfed.core import lowrank
from jaxfed.errors import ConfigError
from jaxfed.nn import model_template, split_variables
from jaxfed.nn.layers import no_adaptable_layers
from jaxfed.options import (
    CLIENT_OPTIMIZER_HELP,
    TrainingOptions,
    at_least,
    momentum_coefficient,
    one_of,
    option,
    positive,
    rank_ratio,
    resolve,
    split_keys,
)

LAYOUT = "balanced"
SCHEDULES = ("alternating", "simultaneous")
AGGREGATIONS = ("uniform", "samples")
SCALINGS = ("authors", "rank", "none")
BATCH_STATS = ("shared", "private")
PAPER = "FedDecomp paper §5.1"
AUTHORS = "the FedDecomp authors' code"


@dataclasses.dataclass(frozen=True)
class FedDecompOptions(ServerOptimizerOptions):
    """FedDecomp's options: the private low-rank part's ranks, the alternating schedule and the
    server optimizer of ``sigma`` (none: the paper's mean)."""

    local_epochs: int = option(5, "local epochs per round (tau first, then sigma)", source=PAPER)
    batch_size: int = option(100, "local batch size", source=PAPER)
    lr: float = option(0.1, "client learning rate", source=PAPER)
    client_optimizer: str = option(
        "sgd",
        CLIENT_OPTIMIZER_HELP + " and phase",
        source=AUTHORS + " (src/client.py: --optimizer sgd, one torch.optim.SGD per part, made anew each round; "
        "the paper's Eq. 5-6 leave the optimizer open)",
    )
    momentum: float = option(
        0.0,
        "client SGD momentum (the authors': 0.9, with ResNet-8's normalization; on the un-normalized FedAvg CNN, "
        "mnist's default model, 0.9 at lr 0.1 does not learn: 0.1665 against 0.6099 without, measured)",
        source=AUTHORS + " use 0.9 (--momentum 0.9); 0 here so the defaults learn on every default model",
        check=momentum_coefficient,
    )
    lora_epochs: int = option(
        -1,
        "epochs on the private low-rank part before the shared part; -1 = round(0.4 * local_epochs)",
        source="FedDecomp paper §5.1 (E_lora = 2 of E = 5)",
        check=at_least(-1),
    )
    rank_dense: float = option(
        0.6,
        "rank ratio R_l of the private part of Dense kernels, in (0, 1]",
        source="FedDecomp paper §5.1 (CIFAR-10)",
        check=rank_ratio,
    )
    rank_conv: float = option(
        0.6,
        "rank ratio R_c of the private part of Conv kernels, in (0, 1]",
        source="FedDecomp paper §5.1 (CIFAR-10)",
        check=rank_ratio,
    )
    schedule: str = option(
        "alternating",
        "alternating (private part, then shared) or simultaneous (the paper's ablation)",
        source="FedDecomp paper §4",
        check=one_of(*SCHEDULES),
    )
    aggregation: str = option(
        "uniform",
        "server mean over uploads: uniform (paper) or samples (weighted by sample count)",
        source="FedDecomp paper Eq. 7",
        check=one_of(*AGGREGATIONS),
    )
    lora_scaling: str = option(
        "authors",
        "scale of the private part: authors (Dense alpha/rank, Conv alpha/int(rank_conv*cout)), "
        "rank (alpha/rank everywhere) or none (the paper's tau = B A)",
        source=AUTHORS + " (loralib)",
        check=one_of(*SCALINGS),
    )
    lora_alpha: float = option(
        1.0, "alpha of lora_scaling authors and rank", source=AUTHORS + " (loralib)", check=positive
    )
    batch_stats: str = option(
        "shared",
        "BatchNorm statistics: shared (averaged with sigma) or private (each client's own)",
        source=AUTHORS + " (the server averages every non-LoRA state entry)",
        check=one_of(*BATCH_STATS),
    )
    layers: tuple[str, ...] = option((), "layers given a private part (comma-separated); empty = every Dense/Conv")

    def check(self):
        super().check()
        if self.lora_epochs < 0 and self.local_epochs < 2:
            raise ConfigError(
                f"lora_epochs: the auto rule needs local_epochs >= 2 (at least one epoch on tau and one on sigma), "
                f"got local_epochs={self.local_epochs}; set lora_epochs explicitly (0 = FedAvg, 1 = tau only)"
            )
        if self.lora_epochs > self.local_epochs:
            raise ConfigError(
                f"lora_epochs: must be -1 (auto) or in 0..local_epochs ({self.local_epochs}), got {self.lora_epochs}"
            )

    def tau_epochs(self) -> int:
        return auto_lora_epochs(self.local_epochs) if self.lora_epochs < 0 else self.lora_epochs


class ClientState(NamedTuple):
    tau: Any  # {layer: LoRA}: the private low-rank part of each decomposed kernel
    model_state: Any  # the client's BatchNorm statistics with batch_stats=private, else {}


class SharedModel(NamedTuple):
    """The server state, and the message both ways: ``sigma`` and, with ``batch_stats=shared``,
    the averaged BatchNorm statistics (``{}`` otherwise)."""

    params: Any
    model_state: Any


class OptimizedSharedModel(NamedTuple):
    """:class:`SharedModel` with a server optimizer's state (``server_optimizer`` other than none:
    without one the server state, and the checkpoints written before the option, stay as they were)."""

    params: Any
    model_state: Any
    opt_state: Any  # the server optimizer's, of sigma


def decomposition_ranks(template, rank_dense: float, rank_conv: float, layers=None) -> dict[str, int]:
    """``{layer: rank}`` of the private part of every Dense and Conv kernel (or of ``layers``)."""
    lowrank.check_ratio("rank_dense", rank_dense)
    lowrank.check_ratio("rank_conv", rank_conv)
    keys = lowrank.factorizable_layers(template) if layers is None else list(layers)
    ranks = {}
    for key in keys:
        shape = lowrank.get_layer(template, key)["kernel"].shape
        field, ratio = ("rank_dense", rank_dense) if len(shape) == 2 else ("rank_conv", rank_conv)
        ranks[key] = lowrank.rank_from_ratio(shape, ratio, field)
    return ranks


def auto_lora_epochs(local_epochs: int) -> int:
    """The paper's split of its 5 epochs (2 on tau) scaled to ``local_epochs``, halves rounding up,
    and at least one epoch for each part (``local_epochs >= 2``; the options refuse 1)."""
    return min(local_epochs - 1, max(1, int(0.4 * local_epochs + 0.5)))


def layer_scales(template, ranks: dict[str, int], options: FedDecompOptions) -> dict[str, float]:
    """The factor on each layer's ``down @ up`` under ``options.lora_scaling``."""
    if options.lora_scaling == "none":
        return {key: 1.0 for key in ranks}
    scales = {}
    for key, rank in ranks.items():
        shape = lowrank.get_layer(template, key)["kernel"].shape
        if options.lora_scaling == "authors" and len(shape) == 4:
            # loralib's ConvLoRA: scaling = alpha / r with r = int(R_c * cout), its rank being r * k.
            scales[key] = options.lora_alpha / max(1, int(options.rank_conv * shape[-1]))
        else:
            scales[key] = options.lora_alpha / rank
    return scales


def _combine(first: dict, second: dict) -> dict:
    steps = first["steps"] + second["steps"]
    loss = (first["train_loss"] * first["steps"] + second["train_loss"] * second["steps"]) / jnp.maximum(steps, 1)
    return {"train_loss": loss, "steps": steps}


class Alternating(NamedTuple):
    """A client's round: ``tau_epochs`` on the private part alone, then ``sigma_epochs`` on the
    shared part alone, a fresh optimizer each phase."""

    tau_epochs: int
    sigma_epochs: int


class Simultaneous(NamedTuple):
    """A client's round: ``epochs`` on both parts together."""

    epochs: int


def schedule_of(options: FedDecompOptions) -> Alternating | Simultaneous:
    """FedDecomp's round: ``lora_epochs`` on tau, the rest of ``local_epochs`` on sigma (or all
    of them on both, ``schedule=simultaneous``)."""
    if options.schedule == "simultaneous":
        return Simultaneous(options.local_epochs)
    return Alternating(options.tau_epochs(), options.local_epochs - options.tau_epochs())


def decomposed(
    model,
    options: TrainingOptions,
    *,
    ranks: dict[str, int],
    scales: dict[str, float],
    layout: str,
    schedule: Alternating | Simultaneous,
    aggregation: Callable[..., Aggregation],
    shared_stats: bool,
    name: str,
    server_optimizer: optax.GradientTransformation | None = None,
) -> FederatedAlgorithm:
    """A shared full-rank model ``sigma`` plus, on each layer of ``ranks``, a private low-rank
    part ``tau_k = scales[layer] * fold(down @ up)`` of that rank in ``layout`` (zero at init),
    trained on the client's data by ``schedule`` with ``options``' optimizer and batching. The
    server takes ``aggregation(finish)`` of the uploaded ``sigma`` (:func:`averaging` or
    :func:`uniform_averaging`), stepped toward by ``server_optimizer`` when there is one
    (:func:`~jaxfed.algorithms.fedopt.step_toward_average`); BatchNorm statistics go with ``sigma``
    (their mean) when ``shared_stats``, else stay with each client. FedDecomp, and pFedLoRA
    (:mod:`jaxfed.algorithms.pfedlora`)."""
    template, model_stats = model_template(model)
    if not ranks:
        raise no_adaptable_layers(name, model)

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        tau = lowrank.init_loras(jax.random.fold_in(rng, 1), template, ranks, layout)
        shared, private = (model_state, {}) if shared_stats else ({}, model_state)
        if server_optimizer is None:
            return SharedModel(params, shared), ClientState(tau, private)
        return OptimizedSharedModel(params, shared, server_optimizer.init(params)), ClientState(tau, private)

    def statistics(server_state, client_state):
        return server_state.model_state if shared_stats else client_state.model_state

    def personalized(sigma, tau):
        """A client's model parameters: ``sigma`` plus each decomposed kernel's scaled ``fold(down @ up)``."""
        return lowrank.add_loras(sigma, tau, scales, layout)

    def train(optimizer, trainable, model_state, to_params, data, rng, epochs):
        return train_parameters(
            model,
            optimizer,
            trainable,
            model_state,
            data,
            rng,
            epochs=epochs,
            to_params=to_params,
            batch_size=options.batch_size,
            drop_last=options.drop_last,
        )

    def client_update(message, client_state, data, rng, info):
        optimizer = options.optimizer(info.round)  # this round's learning rate
        sigma, tau, model_state = message.params, client_state.tau, statistics(message, client_state)
        # The sigma phase shuffles with ``rng`` itself, as FedAvg does: no tau epochs is FedAvg.
        tau_rng = jax.random.fold_in(rng, 1)
        if isinstance(schedule, Simultaneous):
            both, model_state, metrics = train(
                optimizer,
                {"sigma": sigma, "tau": tau},
                model_state,
                lambda t: personalized(t["sigma"], t["tau"]),
                data,
                rng,
                schedule.epochs,
            )
            sigma, tau = both["sigma"], both["tau"]
        else:
            tau, model_state, tau_metrics = train(
                optimizer, tau, model_state, lambda t: personalized(sigma, t), data, tau_rng, schedule.tau_epochs
            )
            sigma, model_state, sigma_metrics = train(
                optimizer, sigma, model_state, lambda s: personalized(s, tau), data, rng, schedule.sigma_epochs
            )
            metrics = _combine(tau_metrics, sigma_metrics)
        if shared_stats:
            return ClientState(tau, {}), SharedModel(sigma, model_state), metrics
        return ClientState(tau, model_state), SharedModel(sigma, {}), metrics

    def broadcast(server_state, info):
        return SharedModel(server_state.params, server_state.model_state)

    def finish(server_state, average, info):
        if server_optimizer is None:
            return average
        params, opt_state = step_toward_average(
            server_optimizer, server_state.params, average.params, server_state.opt_state
        )
        return OptimizedSharedModel(params, average.model_state, opt_state)

    def eval_params(server_state, client_state):
        tau = client_state.tau
        return {"params": personalized(server_state.params, tau), **statistics(server_state, client_state)}

    def global_params(server_state):
        return {"params": server_state.params, **server_state.model_state}

    return FederatedAlgorithm(
        name=name,
        options=options,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        aggregation=aggregation(finish),
        eval_params=eval_params,
        # With private BatchNorm statistics there is no global model to evaluate.
        global_params=global_params if shared_stats or not model_stats else None,
    )


def feddecomp(model, options: FedDecompOptions | None = None, *, name: str = "feddecomp", **overrides):
    """FedDecomp: every layer of ``options.layers`` (default: every Dense and Conv kernel) gets a
    private low-rank part."""
    options = resolve(FedDecompOptions, options, overrides)
    template, _ = model_template(model)
    layers = list(split_keys(options.layers)) or None
    ranks = decomposition_ranks(template, options.rank_dense, options.rank_conv, layers)
    return decomposed(
        model,
        options,
        ranks=ranks,
        scales=layer_scales(template, ranks, options),
        layout=LAYOUT,
        schedule=schedule_of(options),
        # each kept client once (uniform), or by its training-set size
        aggregation=uniform_averaging if options.aggregation == "uniform" else averaging,
        shared_stats=options.batch_stats == "shared",
        name=name,
        server_optimizer=options.server(),
    )


builtin("feddecomp", FedDecompOptions, lambda model, options, config: feddecomp(model, options))
