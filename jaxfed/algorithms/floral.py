"""FLoRAL (Almansoori et al.): a federated mixture of low-rank adaptors with per-client routers.

Every adapted layer has a shared base weight and ``C`` adaptors (:mod:`jaxfed.core.adaptors`:
dense LoRA, conv ``balanced_2d`` / ``channel`` / ``in_layer`` / ``out_layer``, bias and norm
adaptors). Client k holds private router logits ``w_k``; its model is the base mixed with
``pi_k = softmax(w_k)`` inside one forward pass. Local training is simultaneous, with the client
optimizer (SGD by default), on the base, the adaptors (LoRA-preconditioned by default; conv
adaptors per kernel tap, as the authors' code does) and the router (its own learning rate, no
weight decay; ``mixture_floor`` clamps the mixture weights). The server
averages the base with the sample weights ``p_k`` and adaptor c's factors with
``p(k|c) = p_k pi_kc / sum_k' p_k' pi_k'c``. The router logits never leave the client; a client
sends its mixture weights ``pi_k`` (C numbers) with its update, since the server weighs by them.
Stateless clients (``stateful=False``) restart their router from zero logits every round. The
router's training noise is drawn afresh at every local step, as in the authors' code.
``router="oracle"`` fixes client k's router on its ground-truth cluster ``k mod num_clusters``
(logits 0 there and -100 elsewhere, never trained): FLoRAL's optimal-router baseline.

Baseline ``local_adaptor``: one private adaptor per client (C = 1, never uploaded), the base
federated with sample weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxfed.algorithms.aggregation import model_averaging
from jaxfed.algorithms.records import GlobalParams
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import per_key, train_parameters, train_routed
from jaxfed.contract import Aggregation, FederatedAlgorithm
from jaxfed.core import adaptors as ad
from jaxfed.core import mean_of, weighted_share
from jaxfed.core.routing import ROUTERS, check_router, mixture_share, mixture_weights, oracle_init
from jaxfed.errors import ConfigError
from jaxfed.nn import model_template, split_variables
from jaxfed.nn.layers import no_adaptable_layers, norm_layers
from jaxfed.options import (
    DatasetDefaults,
    TrainingOptions,
    at_least,
    client_optimizer,
    non_negative,
    one_of,
    option,
    positive,
    ratio,
    resolve,
    unit_interval,
)

CODE = "the authors' code (zeligism/FLoRAL, conf/task/mnist.yaml)"
AUTHORS_OPTIMIZER = (
    "the authors' code (zeligism/FLoRAL, conf/base.yaml: torch.optim.SGD; floral/training/utils.py: the "
    "router's param group has its own lr and weight decay 0)"
)


@dataclasses.dataclass(frozen=True)
class FLoRALTraining(TrainingOptions):
    """Local training as the FLoRAL authors run it: their MNIST recipe, and their CIFAR-10 one on
    cifar10 (with the MNIST learning rate the preconditioned adaptors of ``local_adaptor`` diverge
    on our default cifar10 model in round 1; that model is not the authors' smaller CNN:
    docs/algorithms.md). CIFAR-100 keeps the
    MNIST recipe: the authors train a VGG-8 with a server-side Adam there, which jaxfed's
    default ResNet-10 and server do not match."""

    dataset_defaults = {
        "cifar10": DatasetDefaults(
            {"lr": 0.03, "batch_size": 64}, "the authors' code (zeligism/FLoRAL, conf/task/cifar10.yaml)"
        )
    }

    local_epochs: int = option(1, "local epochs per round", source=CODE)
    batch_size: int = option(32, "local batch size", source=CODE)
    lr: float = option(0.1, "client learning rate (base and adaptors)", source=CODE)
    client_optimizer: str = option(
        "sgd",
        "client optimizer: sgd (with momentum when momentum > 0), momentum, adam or adamw (optax's defaults), "
        "fresh every round; a learned router trains with it too, at router_lr without weight decay",
        source=AUTHORS_OPTIMIZER,
    )


@dataclasses.dataclass(frozen=True)
class AdaptorOptions(FLoRALTraining):
    """Low-rank adaptors on every Dense / Conv kernel, bias and norm layer."""

    rho: float = option(
        0.01,
        "adaptor rank from this relative parameter budget per adaptor, in (0, 1]",
        source="FLoRAL paper §5 ('1%')",
        check=ratio,
    )
    adaptor_rank: int = option(0, "a fixed adaptor rank instead of rho; 0 = from rho", check=non_negative)
    conv_adaptor: str = option(
        "balanced_2d",
        "conv adaptor kind: balanced_2d, channel, in_layer or out_layer",
        source="FLoRAL paper §3 (balanced 2D)",
        check=one_of(*ad.CONV_ADAPTORS),
    )
    adaptor_alpha: float = option(1.0, "scale alpha of the kernel adaptors", source=CODE, check=non_negative)
    precondition: bool = option(True, "LoRA gradient preconditioning of the adaptors", source="FLoRAL paper §3.2")
    conv_precondition: str = option(
        "per_tap",
        "conv adaptors' gradient scale: per_tap (the norm of the per-tap Gram tensor) or matricized "
        "(the norm of the matricized factor's Gram matrix)",
        source="the authors' code (zeligism/FLoRAL, precondlora_trainer.py: precond_tensor_lora_)",
        check=one_of(*ad.CONV_PRECONDITIONERS),
    )
    norm_adaptors: bool = option(
        False,
        "adaptors on norm layers' scale and offset too (the paper calls them exploratory)",
        source=CODE + ": off",
    )


@dataclasses.dataclass(frozen=True)
class RouterOptions(FLoRALTraining):
    """A private per-client router mixing C shared components."""

    router_lr: float = option(0.1, "learning rate of the private router logits", source=CODE, check=positive)
    router_noise: float = option(
        0.0,
        "router training noise, softmax((w + noise * U[0,1)) / T), fresh every step (the code: 1)",
        source="FLoRAL paper §3 (the authors' code uses 1)",
        check=non_negative,
    )
    router_temperature: float = option(1.0, "router softmax temperature T (> 0)", source=CODE, check=positive)
    stateful: bool = option(
        True, "clients keep their router between rounds (false: restart at 0)", source="FLoRAL paper §3"
    )
    router: str = option(
        "learned",
        "learned (private trained logits) or oracle (one-hot on the client's ground-truth cluster)",
        source="FLoRAL paper §5 (optimal-router baseline)",
        check=one_of(*ROUTERS),
    )
    mixture_floor: float = option(
        0.0,
        "clamp each mixture weight from below at this floor in the client's forward pass, without renormalizing; "
        "the server weighs by the unclamped weights (0: off)",
        source="the paper's plain softmax: off (the authors' code clamps at 0.01 in the forward pass alone)",
        check=unit_interval,
    )

    def router_optimizer(self) -> optax.GradientTransformation:
        """The router logits' optimizer: the client optimizer at ``router_lr`` (constant), without
        weight decay or clipping (the authors' router param group: its own lr, weight decay 0)."""
        return client_optimizer(self.client_optimizer, self.router_lr, momentum=self.momentum)

    def mixture(self, logits, rng=None):
        """The mixture weights of router ``logits`` a client computes with: with ``rng`` the
        training noise is drawn."""
        return mixture_weights(logits, rng, self.router_noise, self.router_temperature, self.mixture_floor)

    def uploaded_mixture(self, logits):
        """The mixture weights of router ``logits`` the server weighs a client's components by:
        without ``mixture_floor`` (the authors' server takes the softmax as it is)."""
        return mixture_weights(logits, None, 0.0, self.router_temperature)


@dataclasses.dataclass(frozen=True)
class FLoRALOptions(AdaptorOptions, RouterOptions):
    """FLoRAL's options: C adaptors per layer, mixed by a private router."""

    num_adaptors: int = option(4, "adaptors C per adapted layer (mixture components)", source=CODE, check=at_least(1))


@dataclasses.dataclass(frozen=True)
class LocalAdaptorOptions(AdaptorOptions):
    """FLoRAL's Local Adaptor baseline: one private adaptor per client."""


class ServerState(NamedTuple):
    base: Any  # the shared base model's parameters
    adaptors: Any  # the C adaptors of every adapted layer (stacked on a leading C axis)


class RoutedClient(NamedTuple):
    """A client with a private router (FLoRAL, the ensemble)."""

    router: jax.Array  # [C] logits
    model_state: Any  # non-trainable collections (BatchNorm statistics), {} when none


class Upload(NamedTuple):
    base: Any
    adaptors: Any
    mixture_weights: jax.Array  # [C]: pi_k, which the server weighs adaptor c's factors by


class AdaptorClient(NamedTuple):
    """A Local Adaptor client: its own adaptor, never uploaded."""

    adaptors: Any
    model_state: Any


def check_oracle(router: str, num_components: int, num_clusters: int) -> None:
    if router == "oracle" and not num_clusters:
        raise ConfigError(
            "router: oracle needs ground-truth clusters (a cluster_task, partition=label_groups or a synthetic dataset)"
        )
    check_router(router, num_components, num_clusters)


def _local_optimizer(plan, options: AdaptorOptions, round_, router: bool = False):
    """The client optimizer on the base and the adaptors (their gradients LoRA-preconditioned
    first) at round ``round_``'s learning rate, and with ``router`` on the router logits
    (:meth:`RouterOptions.router_optimizer`). ``clip_norm`` clips the base's and the adaptors'
    gradient together, to one global norm (the router's is not clipped)."""
    local = dataclasses.replace(options, clip_norm=0.0).optimizer(round_)
    transforms = {"base": local, "adaptors": local}
    if router:
        transforms["router"] = options.router_optimizer()
    steps = []
    if options.precondition:
        preconditioner = ad.lora_preconditioner(plan, conv=options.conv_precondition)
        steps.append(per_key({key: preconditioner if key == "adaptors" else optax.identity() for key in transforms}))
    if options.clip_norm:
        clip = optax.clip_by_global_norm(options.clip_norm)
        steps.append(optax.masked(clip, lambda grads: {key: key != "router" for key in grads}))
    return optax.chain(*steps, per_key(transforms))


def _plan(model, options: AdaptorOptions, num_adaptors: int):
    template, _ = model_template(model)
    plan = ad.adaptor_plan(
        template,
        num_adaptors,
        rho=options.rho,
        rank=options.adaptor_rank,
        conv_adaptor=options.conv_adaptor,
        alpha=options.adaptor_alpha,
        norms=norm_layers(model) if options.norm_adaptors else (),
    )
    if not plan.kernels:
        raise no_adaptable_layers("floral", model)
    return template, plan


def floral(
    model, options: FLoRALOptions | None = None, *, num_clusters: int = 0, name: str = "floral", **overrides
) -> FederatedAlgorithm:
    """FLoRAL; ``num_clusters`` is the task's ground-truth cluster count (``router="oracle"`` only)."""
    options = resolve(FLoRALOptions, options, overrides)
    num_adaptors = options.num_adaptors
    check_oracle(options.router, num_adaptors, num_clusters)
    learned = options.router == "learned"
    template, plan = _plan(model, options, num_adaptors)

    def init(rng):
        base_rng, adaptor_rng = jax.random.split(rng)
        params, model_state = split_variables(model.init(base_rng))
        server = ServerState(params, ad.init_adaptors(adaptor_rng, template, plan))
        return server, RoutedClient(jnp.zeros((num_adaptors,), jnp.float32), model_state)

    def client_update(message, client_state, data, rng, info):
        optimizer = _local_optimizer(plan, options, info.round, router=learned)
        router_logits = client_state.router
        if learned and not options.stateful:
            router_logits = jnp.zeros_like(router_logits)

        trained, new_logits, model_state, metrics = train_routed(
            model,
            optimizer,
            {"base": message.base, "adaptors": message.adaptors},
            router_logits,
            lambda shared, weights: ad.mix(shared["base"], shared["adaptors"], weights, plan),
            client_state.model_state,
            data,
            rng,
            learned=learned,
            mixture=options.mixture,
            **options.batching(),
        )
        upload = Upload(trained["base"], trained["adaptors"], options.uploaded_mixture(new_logits))
        return RoutedClient(new_logits, model_state), upload, metrics

    def contribute(server_state, message, weight, info):
        return weighted_share(message.base, weight), mixture_share(message.adaptors, message.mixture_weights, weight)

    def apply(server_state, total, info):
        base, adaptors = total
        return ServerState(base=mean_of(base), adaptors=mean_of(adaptors, server_state.adaptors))

    def eval_params(server_state, client_state):
        pi = options.mixture(client_state.router)
        return {
            "params": ad.mix(server_state.base, server_state.adaptors, pi, plan),
            **client_state.model_state,
        }

    return FederatedAlgorithm(
        name=name,
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state,
        client_update=client_update,
        aggregation=Aggregation(contribute, apply),
        eval_params=eval_params,
        global_params=None,  # every client mixes the adaptors with its own router
        init_client=None if learned else oracle_init(num_adaptors, num_clusters),
    )


def local_adaptor(model, options: LocalAdaptorOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FLoRAL's Local Adaptor baseline: the base is FedAvg's, each client's adaptor is its own."""
    options = resolve(LocalAdaptorOptions, options, overrides)
    template, plan = _plan(model, options, 1)
    only = jnp.ones((1,), jnp.float32)

    def init(rng):
        base_rng, adaptor_rng = jax.random.split(rng)
        params, model_state = split_variables(model.init(base_rng))
        return GlobalParams(params), AdaptorClient(ad.init_adaptors(adaptor_rng, template, plan), model_state)

    def client_update(message, client_state, data, rng, info):
        optimizer = _local_optimizer(plan, options, info.round)
        trainable = {"base": message.params, "adaptors": client_state.adaptors}
        trained, model_state, metrics = train_parameters(
            model,
            optimizer,
            trainable,
            client_state.model_state,
            data,
            rng,
            to_params=lambda t: ad.mix(t["base"], t["adaptors"], only, plan),
            **options.batching(),
        )
        return AdaptorClient(trained["adaptors"], model_state), trained["base"], metrics

    def eval_params(server_state, client_state):
        return {
            "params": ad.mix(server_state.params, client_state.adaptors, only, plan),
            **client_state.model_state,
        }

    return FederatedAlgorithm(
        name="local_adaptor",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state,
        client_update=client_update,
        aggregation=model_averaging(),
        eval_params=eval_params,
        global_params=None,
    )


builtin(
    "floral",
    FLoRALOptions,
    lambda model, options, config: floral(model, options, num_clusters=config.ground_truth_clusters()),
)
builtin("local_adaptor", LocalAdaptorOptions, lambda model, options, config: local_adaptor(model, options))
