"""FedSPU (Niu, Dong & Qin, AAAI 2025): every client keeps its whole model and, each round, trains
and shares a random part of its neurons (stochastic parameter update).

Each round a client draws, in every hidden Dense / Conv layer, ``max(1, int(rate * units))`` of
the layer's output units (neurons, a conv's filters) at random; the output layer keeps all its
units. Its sub-model is every kernel weight from a drawn unit of the previous layer (every input
of the first layer; a flattened conv output counts each position of a drawn channel) into a drawn
unit of the layer, the drawn units' biases, and a normalization layer's parameters at the drawn
units of the layer before it. The client puts the global values into its own model at the
sub-model's places, trains the sub-model alone (the rest of its model stays frozen, its own), and
uploads the sub-model: its values and the drawn units' indices. The server averages each weight over the
clients that trained it, by sample count; a weight no client of the round trained keeps its value.
A client is evaluated with its own model; the global model is the server's.

Clients sit in equal contiguous id blocks with one rate each (``rates``): the authors' code gives
five blocks 0.2, 0.4, 0.6, 0.8 and 1.0; a rate-1.0 client trains and sends the whole model.

Where this differs from the authors' code (Flower, PyTorch): there the server draws the units and
sends them; here each client draws them from its own round key (the same distribution, the same
numbers on 1 or 8 devices). BatchNorm statistics stay with each client (the authors average the
drawn units' running statistics). The early-stopping scheme (FedSPU-ES) is not included. The
chain of layers is the forward pass's call order, so FedSPU is for sequential models (the paper's
CNNs, jaxfed's cnn, mlp, cnn4 and vgg8): a layer whose inputs are not its predecessor's units (a
ResNet's projection shortcut) is refused, and a Dense layer after a Conv reads the conv's output
flattened in NHWC order (channel fastest), as jaxfed's models flatten. An identity shortcut adds no
layer, so it cannot be seen: a model with one is not refused, and its chain is not FedSPU's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.algorithms.records import GlobalParams, global_model
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import masked, train_parameters
from jaxfed.contract import Aggregation, FederatedAlgorithm
from jaxfed.core import WeightedSum, lowrank, mean_of, weighted_share
from jaxfed.errors import ConfigError
from jaxfed.nn import model_template, split_variables
from jaxfed.nn.layers import layers_in_call_order, no_adaptable_layers, norm_layers, parameter_layers
from jaxfed.options import TrainingOptions, each, option, ratio, resolve

AUTHORS = "the FedSPU authors' code (get_rate: five equal client blocks)"
VALUE_BYTES = 4  # a float32 value, or an int32 unit index


@dataclasses.dataclass(frozen=True)
class FedSPUOptions(TrainingOptions):
    """FedSPU's options: the share of each hidden layer's units a client trains, per client block."""

    rates: tuple[float, ...] = option(
        (0.2, 0.4, 0.6, 0.8, 1.0),
        "share of each hidden layer's units a client trains and sends each round, one rate per client block "
        "(equal contiguous id blocks); 1.0 = the whole model",
        source=AUTHORS,
        check=each(ratio),
    )


class Layer(NamedTuple):
    """A Dense / Conv layer's place in the chain (static)."""

    key: str
    inputs: str | None  # the layer whose drawn units feed this one's kernel; None: every input
    repeat: int  # kernel inputs per unit of ``inputs`` (a flattened conv output: its positions)
    drawn: bool  # its own units are drawn (a hidden layer), or all kept (the output layer)


class Chain(NamedTuple):
    """The model's neurons (static): the units of each hidden layer, and what each layer's
    parameters hang on."""

    units: dict[str, int]  # {hidden layer: its output units}, in call order
    layers: list[Layer]
    norms: dict[str, str | None]  # {normalization layer: the hidden layer whose units it normalizes}


class Message(NamedTuple):
    params: Any  # the global model
    counts: dict  # {hidden layer: int32 scalar}: how many of its units a client of the tier draws


class Upload(NamedTuple):
    sub: Any  # the trained model at the sub-model's places, zero elsewhere
    units: dict  # {hidden layer: bool[units]}: the drawn units, which place ``sub``'s values


class ClientState(NamedTuple):
    params: Any  # the client's own model
    model_state: Any  # the model's non-trainable collections (BatchNorm statistics), {} when none


def neuron_chain(model) -> Chain:
    """The model's chain of layers in call order; a one-line ConfigError where a layer's inputs
    are not its predecessor's units."""
    params = model_template(model)[0]
    dense, norm = layers_in_call_order(model), set(norm_layers(model))
    layers = [(key, key in norm) for key in parameter_layers(model) if key in norm or key in dense]
    if not dense:
        raise no_adaptable_layers("fedspu", model)
    units = {key: lowrank.get_layer(params, key)["kernel"].shape[-1] for key in dense[:-1]}
    chain, norms, previous = [], {}, None
    for key, is_norm in layers:
        if is_norm:  # (one with scale or bias: parameter_layers leaves out those with neither)
            norms[key] = previous if previous in units else None
            sizes = {leaf.shape[-1] for leaf in lowrank.get_layer(params, key).values()}
            if norms[key] is not None and sizes != {units[previous]}:
                raise _not_a_chain(key, sizes.pop(), previous, units[previous])
            continue
        kernel = lowrank.get_layer(params, key)["kernel"]
        repeat = 1
        if previous is not None:
            before = lowrank.get_layer(params, previous)["kernel"]
            flattened = kernel.ndim == 2 and before.ndim > 2  # a Dense layer reading a conv's output map
            repeat, left = divmod(kernel.shape[-2], before.shape[-1])
            if left or (repeat != 1 and not flattened):
                raise _not_a_chain(key, kernel.shape[-2], previous, before.shape[-1])
        chain.append(Layer(key, previous, repeat, key in units))
        previous = key
    return Chain(units, chain, norms)


def _not_a_chain(key, takes, previous, gives) -> ConfigError:
    return ConfigError(
        f"model: fedspu's layer '{key}' takes {takes} inputs after '{previous}' gives {gives} units; FedSPU's "
        "neurons need a sequential model (a chain of layers, e.g. cnn or mlp)"
    )


def unit_counts(chain: Chain, rate: float) -> dict[str, int]:
    """How many units of each hidden layer a client of ``rate`` draws: the authors' ``max(1, int(n * rate))``."""
    return {key: max(1, int(n * rate)) for key, n in chain.units.items()}


def draw_units(rng, chain: Chain, counts: dict) -> dict:
    """``{hidden layer: bool[units]}``: ``counts[layer]`` of its units, uniformly at random
    (``counts`` may be traced)."""
    keys = jax.random.split(rng, max(len(chain.units), 1))
    drawn = {}
    for k, (key, n) in zip(keys, chain.units.items()):
        rank = jnp.argsort(jnp.argsort(jax.random.uniform(k, (n,))))
        drawn[key] = rank < counts[key]
    return drawn


def _on_units(shape, inputs, outputs):
    """A parameter's mask: its last axis on ``outputs`` and (a kernel) its input axis on ``inputs``;
    None = every unit."""
    mask = jnp.ones(shape, bool)
    if outputs is not None:
        mask = mask & outputs
    if inputs is not None:
        mask = mask & inputs[:, None]
    return mask


def submodel_mask(params, chain: Chain, drawn: dict):
    """A bool tree shaped like ``params``: True at the sub-model's places (every parameter outside
    Dense, Conv and normalization layers is in it)."""
    mask = jax.tree.map(lambda x: jnp.ones(jnp.shape(x), bool), params)
    for layer in chain.layers:
        outputs = drawn[layer.key] if layer.drawn else None
        inputs = None if layer.inputs is None else jnp.tile(drawn[layer.inputs], layer.repeat)
        leaves = lowrank.get_layer(params, layer.key)
        masks = {
            name: _on_units(jnp.shape(x), inputs if name == "kernel" else None, outputs) for name, x in leaves.items()
        }
        mask = lowrank.replace_layer(mask, layer.key, masks)
    for key, source in chain.norms.items():
        outputs = None if source is None else drawn[source]
        leaves = lowrank.get_layer(params, key)
        mask = lowrank.replace_layer(mask, key, {n: _on_units(jnp.shape(x), None, outputs) for n, x in leaves.items()})
    return mask


def submodel_bytes(params, chain: Chain, drawn: dict, *, indices: bool) -> jax.Array:
    """The bytes of a sub-model's values and, with ``indices``, of its drawn units' indices where a
    layer keeps only part of its units (a whole layer needs none)."""
    count = sum(jnp.sum(m) for m in jax.tree.leaves(submodel_mask(params, chain, drawn)))
    if indices:
        count = count + sum(jnp.where(jnp.all(d), 0, jnp.sum(d)) for d in drawn.values())
    return jnp.asarray(count, jnp.float32) * VALUE_BYTES


def fedspu(model, options: FedSPUOptions | None = None, **overrides) -> FederatedAlgorithm:
    """FedSPU over ``len(options.rates)`` client blocks."""
    options = resolve(FedSPUOptions, options, overrides)
    chain = neuron_chain(model)
    counts = [unit_counts(chain, rate) for rate in options.rates]
    tiered = len(options.rates) > 1

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        return GlobalParams(params), ClientState(params, model_state)

    def broadcast(server_state, info):
        tier_counts = counts[info.tier if tiered else 0]
        return Message(server_state.params, {key: jnp.int32(c) for key, c in tier_counts.items()})

    def client_update(message, client_state, data, rng, info):
        draw_rng, train_rng = jax.random.split(rng)
        drawn = draw_units(draw_rng, chain, message.counts)
        mask = submodel_mask(client_state.params, chain, drawn)
        start = jax.tree.map(jnp.where, mask, message.params, client_state.params)
        optimizer = masked(options.optimizer(info.round), mask)
        params, model_state, metrics = train_parameters(
            model, optimizer, start, client_state.model_state, data, train_rng, **options.batching()
        )
        sub = jax.tree.map(lambda m, x: jnp.where(m, x, jnp.zeros_like(x)), mask, params)
        return ClientState(params, model_state), Upload(sub, drawn), metrics

    def contribute(server_state, upload, weight, info):
        mask = submodel_mask(upload.sub, chain, upload.units)
        return jax.tree.map(lambda m, x: weighted_share(x, weight * m), mask, upload.sub)

    def apply(server_state, total, info):  # a weight no client trained keeps its value
        is_sum = lambda node: isinstance(node, WeightedSum)  # noqa: E731
        return GlobalParams(jax.tree.map(mean_of, total, server_state.params, is_leaf=is_sum))

    def download_bytes(message, client_state, info):  # a client needs its sub-model's global values
        # (the client draws its units: any draw of the tier's counts has the sub-model's size)
        drawn = draw_units(jax.random.key(0), chain, message.counts)
        return submodel_bytes(message.params, chain, drawn, indices=False)

    return FederatedAlgorithm(
        name="fedspu",
        options=options,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        aggregation=Aggregation(contribute, apply),
        eval_params=lambda server_state, client_state: {"params": client_state.params, **client_state.model_state},
        global_params=global_model(model),
        num_tiers=len(options.rates) if tiered else None,
        pad_tier=(lambda message, info: message) if tiered else None,  # every tier's message has one shape
        message_bytes=lambda upload: submodel_bytes(upload.sub, chain, upload.units, indices=True),
        download_bytes=download_bytes,
    )


def _build(model, options: FedSPUOptions, config) -> FederatedAlgorithm:
    if len(options.rates) > config.num_clients:
        raise ConfigError(
            f"rates: {len(options.rates)} client blocks for {config.num_clients} clients; give at most "
            f"{config.num_clients} rates"
        )
    return fedspu(model, options)


builtin("fedspu", FedSPUOptions, _build)
