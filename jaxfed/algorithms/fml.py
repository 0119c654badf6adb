"""FML (Shen et al. 2020, Federated Mutual Learning): a private model and a shared "meme" model
learn from each other on each client; only the meme is averaged. One of FedARA's heterogeneous-model
baselines (HtFLlib's, as its FedTGP and FedKD).

Every client keeps its local model (the run's model; with ``model_tiers`` its tier's rank level,
with ``tier_models`` its tier's model, :mod:`jaxfed.algorithms.model_tiers`). The meme is the run's
model, shared. A round: the client takes the global meme and trains both models together for
``local_epochs`` on the sum of their losses (deep mutual learning)

    L_local = alpha CE_local + (1 - alpha) KL(p_meme || p_local)
    L_meme  = beta  CE_meme  + (1 - beta)  KL(p_local || p_meme)

``p`` each model's softmax, the KL summed over classes and averaged over the batch (the paper's); as
in HtFLlib's code neither model's softmax is detached in the other's loss, so one gradient of the
sum trains both. It uploads the trained meme; the server's new meme is the plain mean of the
round's memes (HtFLlib's ``serverfml``: each client counted once, whatever its size). A client's
personalized model is its local model; the global model is the meme (none with BatchNorm
statistics, which stay on the clients, each its own for the meme).

``alpha`` and ``beta`` are the options ``local_ce_weight`` and ``meme_ce_weight`` (``alpha`` is the
run's Dirichlet concentration). Defaults: the paper's ``alpha = beta = 0.5``, HtFLlib's training
(``system/main.py``: lr 0.01, batch 10, one local epoch). Where jaxfed differs from HtFLlib: its
defaults ``-al 1 -bt 1`` turn the distillation off (jaxfed takes the paper's 0.5); its KL is
torch's ``KLDivLoss()`` mean over batch and classes (1/C of the paper's); it clips each model's
gradient norm to 10 (jaxfed: ``clip_norm``, one norm over both, by default 0: no clipping); its
loaders keep one order and drop the last partial batch (``drop_last`` is an option).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, NamedTuple

import jax

from jaxfed.algorithms.aggregation import uniform_averaging
from jaxfed.algorithms.model_tiers import HtFLlibTraining, with_model_tiers
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import fit
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core.losses import kl_divergence, masked_loss, masked_mean
from jaxfed.nn import model_template, split_variables
from jaxfed.options import option, resolve, weight_share

PAPER = "Shen et al. 2020, Federated Mutual Learning (alpha = beta = 0.5)"


@dataclasses.dataclass(frozen=True)
class FMLOptions(HtFLlibTraining):
    """FML's options: each model's weight on its own cross-entropy against the distillation."""

    tasks: typing.ClassVar[tuple[str, ...]] = ("classification",)  # distillation between softmaxes

    local_ce_weight: float = option(
        0.5, "the paper's alpha: the local model's weight on its cross-entropy (1 - alpha on the KL from the meme)",
        source=PAPER + "; HtFLlib's -al default 1 turns the distillation off", check=weight_share,
    )  # fmt: skip
    meme_ce_weight: float = option(
        0.5, "the paper's beta: the meme's weight on its cross-entropy (1 - beta on the KL from the local model)",
        source=PAPER + "; HtFLlib's -bt default 1 turns the distillation off", check=weight_share,
    )  # fmt: skip


class Meme(NamedTuple):
    """The server state and the message down."""

    params: Any  # the global meme's parameters


class ClientState(NamedTuple):
    params: Any  # the local model: the client's own
    model_state: Any  # its non-trainable collections (BatchNorm statistics), {} when none
    meme_state: Any  # the meme's, kept on the client


class Pair(NamedTuple):
    local: Any
    meme: Any


def mutual_learning(model, options: FMLOptions):
    """``loss(pair, states, batch)``: ``L_local + L_meme`` (the module's docstring) of a :class:`Pair`
    on a batch, and both models' new non-trainable collections."""

    def loss(pair: Pair, states, batch):
        logits_local, local_state = model.apply(
            {"params": pair.local, **states["local"]}, batch.x, train=True, mask=batch.mask, rng=batch.key
        )
        logits_meme, meme_state = model.apply(
            {"params": pair.meme, **states["meme"]}, batch.x,
            train=True, mask=batch.mask, rng=jax.random.fold_in(batch.key, 1),
        )  # fmt: skip
        log_local, log_meme = jax.nn.log_softmax(logits_local), jax.nn.log_softmax(logits_meme)
        alpha, beta = options.local_ce_weight, options.meme_ce_weight
        ce_local, ce_meme = (
            masked_loss(logits_local, batch.y, batch.mask),
            masked_loss(logits_meme, batch.y, batch.mask),
        )
        kl_from_meme = masked_mean(kl_divergence(log_meme, log_local), batch.mask)
        kl_from_local = masked_mean(kl_divergence(log_local, log_meme), batch.mask)
        local = alpha * ce_local + (1 - alpha) * kl_from_meme
        meme = beta * ce_meme + (1 - beta) * kl_from_local
        return local + meme, {"local": local_state, "meme": meme_state}

    return loss


def fml(model, options: FMLOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FML: a private local model and the shared meme learn from each other; the memes are averaged."""
    options = resolve(FMLOptions, options, overrides)
    private_stats = model_template(model)[1]
    loss = mutual_learning(model, options)

    def init(rng):
        local_rng, meme_rng = jax.random.split(rng)
        params, model_state = split_variables(model.init(local_rng))
        meme, meme_state = split_variables(model.init(meme_rng))
        return Meme(meme), ClientState(params, model_state, meme_state)

    def client_update(message: Meme, client: ClientState, data, rng, info):
        states = {"local": client.model_state, "meme": client.meme_state}
        trained, states, metrics = fit(
            loss, options.optimizer(info.round), Pair(client.params, message.params), states, data, rng,
            **options.batching(),
        )  # fmt: skip
        return ClientState(trained.local, states["local"], states["meme"]), trained.meme, metrics

    algorithm = FederatedAlgorithm(
        name="fml",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state,
        client_update=client_update,
        aggregation=uniform_averaging(lambda server_state, mean, info: Meme(mean)),  # HtFLlib's plain mean
        eval_params=lambda server_state, client: {"params": client.params, **client.model_state},
        global_params=None if private_stats else (lambda server_state: {"params": server_state.params}),
    )
    return with_model_tiers(algorithm, model, options)


builtin("fml", FMLOptions, lambda model, options, config: fml(model, options))
