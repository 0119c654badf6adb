"""pFedES (Yi, Yu, Wang and Liu, "pFedES: Model Heterogeneous Personalized Federated Learning with
Feature Extractor Sharing", arXiv 2311.06879): a small shared proxy extractor in front of each
client's private model. The other mutual-learning baseline FedARA's paper sets itself against
(with pFedAFM: "an extra small, homogeneous feature extractor on each client").

Every client keeps its local model ``F`` (the run's model; with ``model_tiers`` its tier's rank
level, with ``tier_models`` its tier's model, :mod:`jaxfed.algorithms.model_tiers`). The server
holds the proxy extractor ``G`` (:class:`ProxyExtractor`, the authors' ``Generator``): two 3x3
SAME convolutions, ``proxy_width`` filters then the input's channels, each ReLU, so ``G(x)`` has
the input's shape and any client model takes it. A round, from the server's ``G`` (the authors'
iterative learning): (1) ``G`` frozen, ``F`` trains for ``local_epochs`` on
``(1 - mu) CE(F(x)) + mu CE(F(G(x)))``; (2) ``F`` frozen (inference mode), ``G`` trains for
``local_epochs + extractor_extra_epochs`` on ``CE(F(G(x)))``. The client uploads ``G``; the
server's new ``G`` is the sample-weighted mean. A client's personalized model is ``F`` alone;
there is no global model (``G`` is no classifier).

Defaults are the authors' code (``pFedES_mh.py``): SGD lr 0.01, momentum 0.9, weight decay 1e-3,
gradients clipped to norm 50, batch 512, 10 epochs on ``F`` and 20 on ``G`` (``epochs + 10``),
``mu`` 0.5, ``G`` of 8 filters. Where jaxfed differs from that code: each phase makes a fresh
optimizer (theirs keeps ``G``'s across every client and round, its momentum carried from one
client to the next), the server weighs by training examples (theirs by all of a client's
examples), ``F`` runs in inference mode in phase 2 (theirs stays in train mode: the same for their
CNNs, which have no BatchNorm or dropout), ``G``'s parameters start at Flax's initializers (theirs
at torch's), and no training image is augmented (theirs are flipped, erased and cropped at
random). The ``+ 10`` epochs are their heterogeneous-model script's; their homogeneous one
(``pFedES.py``) trains ``G`` for ``epochs`` (``extractor_extra_epochs=0``). A flat input (a
vector) is one row of one channel for ``G``'s convolutions, each a 1x3 window.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxfed.algorithms.aggregation import averaging
from jaxfed.algorithms.model_tiers import model_tiers_option, tier_models_option, with_model_tiers
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import fit
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core.losses import masked_loss
from jaxfed.errors import ConfigError
from jaxfed.nn import CONV_IMPLS, Conv, built_in_setting, split_variables
from jaxfed.options import (
    TrainingOptions,
    at_least,
    momentum_coefficient,
    non_negative,
    option,
    resolve,
    weight_share,
)

CODE = "the authors' code (LipingYi/pFedES, pFedES_mh.py)"


@dataclasses.dataclass(frozen=True)
class PFedESOptions(TrainingOptions):
    """pFedES's options: the proxy extractor's width, its loss weight and epochs, the authors' training."""

    tasks: typing.ClassVar[tuple[str, ...]] = ("classification",)  # cross-entropy through G

    lr: float = option(0.01, "client learning rate of F and G (0 freezes both)", source=CODE + " (lr_net, lr_gen)",
                       check=non_negative)  # fmt: skip
    momentum: float = option(0.9, "client SGD momentum, in [0, 1)", source=CODE, check=momentum_coefficient)
    weight_decay: float = option(0.001, "client weight decay", source=CODE + " (--wd)", check=non_negative)
    clip_norm: float = option(
        50.0, "clip each gradient of the local model and of G to this norm; 0 = off", source=CODE, check=non_negative
    )
    batch_size: int = option(512, "local batch size", source=CODE + " (--batch-size)", check=at_least(1))
    local_epochs: int = option(10, "epochs on the local model per round", source=CODE + " (--epochs)",
                               check=at_least(1))  # fmt: skip
    extractor_extra_epochs: int = option(
        10, "G trains local_epochs + this many epochs per round", source=CODE + " (epoch_generator = epochs + 10)",
        check=at_least(0),
    )  # fmt: skip
    mu: float = option(0.5, "weight of CE(F(G(x))) in the local model's loss (1 - mu on CE(F(x))), in [0, 1]",
                       source=CODE + " (miu)", check=weight_share)  # fmt: skip
    proxy_width: int = option(8, "filters of G's first convolution", source=CODE + " (Generator n_kernels)",
                              check=at_least(1))  # fmt: skip
    model_tiers: tuple[float, ...] = model_tiers_option()
    tier_models: tuple[str, ...] = tier_models_option()


class ProxyExtractor(nn.Module):
    """The proxy extractor ``G``: ``[batch, H, W, C]`` -> the same shape, by a 3x3 SAME convolution
    of ``width`` filters and one of ``C``, each ReLU. ``[batch, L, C]`` is one row of ``L``
    positions, ``[batch, D]`` one row of ``D`` positions and one channel; a row's kernels are 1x3."""

    width: int = 8
    conv: str = "patches"

    @nn.compact
    def __call__(self, x):
        image = as_image(x)
        window = (3, 3) if x.ndim == 4 else (1, 3)
        h = nn.relu(Conv(self.width, window, padding="SAME", impl=self.conv, name="conv1")(image))
        h = nn.relu(Conv(image.shape[-1], window, padding="SAME", impl=self.conv, name="conv2")(h))
        return h.reshape(x.shape)


def as_image(x):
    """``x`` (batch first) as ``[batch, H, W, C]``: a vector is one row of one channel, ``[batch, L,
    C]`` one row of ``L`` positions."""
    if x.ndim == 2:
        return x.reshape(x.shape[0], 1, x.shape[1], 1)
    if x.ndim == 3:
        return x.reshape(x.shape[0], 1, *x.shape[1:])
    return x


def proxy_extractor(model, width: int) -> ProxyExtractor:
    """``G`` for ``model``'s inputs, with the run's convolution (a one-line ConfigError for inputs it
    cannot transform: token ids, or more than two positional axes)."""
    if jnp.issubdtype(model.input_dtype, jnp.integer):
        raise ConfigError(f"pfedes: the proxy extractor transforms float inputs; model {model.name} takes integer ids")
    if len(model.input_shape) > 3:
        raise ConfigError(
            f"pfedes: the proxy extractor takes vectors, sequences or images; model {model.name}'s inputs are "
            f"{model.input_shape}"
        )
    return ProxyExtractor(width, conv=built_in_setting(model, "conv", CONV_IMPLS, "patches"))


class Proxy(NamedTuple):
    """The server state and the message down."""

    params: Any  # G's parameters


class ClientState(NamedTuple):
    params: Any  # the local model, the client's own
    model_state: Any  # its non-trainable collections (BatchNorm statistics), {} when none


def pfedes(model, options: PFedESOptions | None = None, **overrides) -> FederatedAlgorithm:
    """pFedES: a shared proxy extractor in front of private models, trained in turn with them."""
    options = resolve(PFedESOptions, options, overrides)
    proxy = proxy_extractor(model, options.proxy_width)
    mu = options.mu

    def init(rng):
        local_rng, proxy_rng = jax.random.split(rng)
        params, model_state = split_variables(model.init(local_rng))
        proxy_params = proxy.init(proxy_rng, jnp.zeros((1,) + model.input_shape, jnp.float32))["params"]
        return Proxy(proxy_params), ClientState(params, model_state)

    def local_loss(params, states, batch):  # phase 1: G frozen
        keys = jax.random.split(batch.key)  # each pass its own dropout masks, as torch's two forward calls
        transformed = proxy.apply({"params": states["proxy"]}, batch.x)
        logits, model_state = model.apply(
            {"params": params, **states["model"]}, batch.x, train=True, mask=batch.mask, rng=keys[0]
        )
        proxy_logits, model_state = model.apply(
            {"params": params, **model_state}, transformed, train=True, mask=batch.mask, rng=keys[1]
        )
        loss = (1 - mu) * masked_loss(logits, batch.y, batch.mask) + mu * masked_loss(proxy_logits, batch.y, batch.mask)
        return loss, {**states, "model": model_state}

    def proxy_loss(proxy_params, local, batch):  # phase 2: the local model frozen, in inference mode
        transformed = proxy.apply({"params": proxy_params}, batch.x)
        logits, _ = model.apply(local, transformed, mask=batch.mask)
        return masked_loss(logits, batch.y, batch.mask), local

    def client_update(message: Proxy, client: ClientState, data, rng, info):
        local_rng, proxy_rng = jax.random.split(rng)
        optimizer = options.optimizer(info.round)
        params, states, metrics = fit(
            local_loss, optimizer, client.params, {"proxy": message.params, "model": client.model_state}, data,
            local_rng, **options.batching(),
        )  # fmt: skip
        proxy_epochs = {**options.batching(), "epochs": options.local_epochs + options.extractor_extra_epochs}
        local = {"params": params, **states["model"]}
        proxy_params, _, proxy_metrics = fit(proxy_loss, optimizer, message.params, local, data, proxy_rng,
                                             **proxy_epochs)  # fmt: skip
        steps = metrics["steps"] + proxy_metrics["steps"]
        return ClientState(params, states["model"]), proxy_params, {**metrics, "steps": steps}

    algorithm = FederatedAlgorithm(
        name="pfedes",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state,
        client_update=client_update,
        aggregation=averaging(lambda server_state, mean, info: Proxy(mean)),
        eval_params=lambda server_state, client: {"params": client.params, **client.model_state},
        global_params=None,  # the models are private and G is no classifier: there is no global model
    )
    return with_model_tiers(algorithm, model, options)


builtin("pfedes", PFedESOptions, lambda model, options, config: pfedes(model, options))
