"""pFedGate (Chen, Yao, Gao, Ding and Li, ICML 2023): a shared model that each client's private
gating layer scales, block by block, into its own (sparse) model.

FedDecomp's last Table 1 baseline. The model is shared and averaged by sample count (FedAvg's
rule). A parameter *block* is one of ``block_split`` contiguous pieces of a parameter tensor (its
elements in torch's layout, as the authors' ``fine_grained_block_split`` cuts their torch
tensors; a tensor of fewer elements is cut into single elements). Each client keeps a gating
layer: a batch of its inputs is normalized by a SwitchNorm (a softmax-weighted mix of instance,
layer and batch statistics, with a learned scale and offset), flattened, and mapped by one Dense
layer and a BatchNorm to one logit per block; a block's gate is the sigmoid of its logit,
averaged over the batch's real examples. The client's model for that batch is the shared model
with every block multiplied by its gate.

``sparse_factor`` s < 1 (the authors' ``block_wise_prune``) keeps only some blocks, the rest zero:
separately among the blocks of Dense layers and the others, the blocks but each tensor's first
are ranked by their integer importance ``round(10 max(gate, s_min))`` (``s_min = min(max(1 /
block_split, 0.1), s)``) and taken greedily in that order while their sizes sum to at most
``round((s - s_min) x`` the group's ranked size``)``; a tensor's first block is always kept. A kept
block's weight is its gate, and in training its gradient is also the clipped gate's,
``max(gate, s_min)``, by the authors' straight-through mask ``(1 - stop_gradient(g)) + g``.

Local training (the authors' published commands, ``bi_level_opt 0``): each step trains the shared
model and the gating layer together on the gated model's loss, each gradient clipped to norm
``clip_norm`` on its own, the gating layer at ``gate_lr_scale`` times the model's learning rate.
The client uploads its trained model (ungated) and keeps it with its gating layer, the gating
layer's statistics and the model's BatchNorm statistics. A client's personalized model is its last
trained model (before aggregation, as the authors evaluate a client right after its training,
``online_aggregate``) gated by its mean gate over its training examples (the gating layer in
inference mode); before its first round (a new client, held out of training), the global model
with its untrained gating layer. There is no global model to evaluate: the shared model is only
ever used gated.

Where jaxfed differs from the authors' code: their published runs evaluate each test batch gated
by that batch's own mean gate (with FedDecomp's 100 test examples a client, the mean over its test
split), where jaxfed gates by the training examples' mean, so that no test statistic enters a
model and a client's accuracy does not depend on how its test examples are batched (their
``client_level_adapt``, of another training mode, averages the batches' means, each batch's
selection made on its own); a client not sampled in a round is evaluated on its last trained
model (theirs on the new global model); their server counts the clients not sampled with the old
global model in its mean, jaxfed's the sampled clients only (the same under full participation);
their optimizer's momentum persists on the client across rounds, jaxfed's starts afresh every
round; their CIFAR loaders drop a client's last partial batch and the server weighs a client by
the examples it trained on (``drop_last`` is an option here; the weight is its example count);
their shared model's BatchNorm statistics are averaged with it, jaxfed's stay on the client (as for
every algorithm); their greedy order breaks ties by numpy's unstable sort over torch's parameter
order, jaxfed's by its block order; their learning rate drops 10x at 3/4 of the rounds
(``multi_step``), jaxfed's follows ``lr_schedule``; torch's BatchNorm keeps the unbiased batch
variance in its running statistics, Flax's the biased. A flat input (a vector) is one channel for
the SwitchNorm.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.algorithms.aggregation import model_averaging
from jaxfed.algorithms.records import GlobalParams
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import fit, per_key
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core import lowrank, weighted_mean
from jaxfed.core.losses import masked_loss
from jaxfed.errors import ConfigError
from jaxfed.nn import model_template, split_variables
from jaxfed.nn.layers import dense_layers
from jaxfed.options import (
    TrainingOptions,
    at_least,
    client_optimizer,
    momentum_coefficient,
    non_negative,
    option,
    ratio,
    resolve,
)

PAPER = "Chen et al. (ICML 2023), pFedGate"
CODE = "the authors' code (yxdyc/pFedGate)"
COMMAND = CODE + ", scripts/README.md: CIFAR-10 at sparse_factor 1"
OPTIMIZER = CODE + ", utils/optim.py: SGD(momentum=0.9, weight_decay=5e-4)"
IMPORTANCE_LEVELS = 10  # the authors' gated_scores_scale_factor: gates ranked as integers 0..10


@dataclasses.dataclass(frozen=True)
class PFedGateOptions(TrainingOptions):
    """pFedGate's options: the blocks, their sparsity, the gating layer's learning rate."""

    local_epochs: int = option(1, "local epochs per round", source=COMMAND + " (local_steps=1)", check=at_least(1))
    batch_size: int = option(128, "local batch size", source=COMMAND + " (bz=128)", check=at_least(1))
    lr: float = option(
        0.05, "client learning rate (the shared model's)", source=COMMAND + " (lr_model=0.05)", check=non_negative
    )
    momentum: float = option(0.9, "client SGD momentum, in [0, 1)", source=OPTIMIZER, check=momentum_coefficient)
    weight_decay: float = option(
        5e-4, "client weight decay (added to the gradient)", source=OPTIMIZER, check=non_negative
    )
    clip_norm: float = option(
        10.0,
        "clip the shared model's and the gating layer's gradients, each to this global norm; 0 = off",
        source=CODE + ", gated_learner.py: clip_grad_norm_(max_norm=10) on each",
        check=non_negative,
    )
    sparse_factor: float = option(
        1.0,
        "s in (0, 1]: besides each tensor's first block, a client's model keeps blocks of about s - s_min of the "
        "other blocks' elements (s_min = min(max(1 / block_split, 0.1), s)); 1 = every block, scaled by its gate",
        source=PAPER + " (s); " + COMMAND + " (sparse_factor=1)",
        check=ratio,
    )
    block_split: int = option(
        5,
        "blocks each parameter tensor is cut into (contiguous, in torch's layout)",
        source=COMMAND + " (fine_grained_block_split=5)",
        check=at_least(1),
    )
    gate_lr_scale: float = option(
        1.0,
        "the gating layer's learning rate as a multiple of lr",
        source=COMMAND + " (lr_gating = lr_model)",
        check=non_negative,
    )


class ClientState(NamedTuple):
    params: Any  # its last trained model (its upload), which it evaluates gated
    trained: jax.Array  # bool scalar: it has trained (else it evaluates the global model gated)
    gate: Any  # the gating layer's parameters
    gate_state: Any  # its statistics (SwitchNorm's and BatchNorm's running means and variances)
    model_state: Any  # the model's non-trainable collections (BatchNorm statistics), {} when none


# ----- the gating layer -------------------------------------------------------------------------


def masked_row_mean(values, mask):
    """The mean of the rows of ``values`` where ``mask`` is True (None: every row)."""
    return weighted_mean(values, jnp.ones(values.shape[0]) if mask is None else mask)


class SwitchNorm(nn.Module):
    """The authors' SwitchNorm2d on channels-last inputs ``[batch, positions, channels]``: each
    example's channels normalized by softmax-weighted mixes of their instance, layer and batch
    means and variances (running batch statistics in inference mode, momentum 0.9), then scaled
    and offset per channel."""

    momentum: float = 0.9
    epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x, train: bool, mask=None):
        channels = x.shape[-1]
        mean_in = jnp.mean(x, axis=1)
        var_in = jnp.var(x, axis=1, ddof=1 if x.shape[1] > 1 else 0)  # torch's unbiased Tensor.var
        mean_ln = jnp.mean(mean_in, axis=-1, keepdims=True)
        second_moment = var_in + mean_in**2
        var_ln = jnp.mean(second_moment, axis=-1, keepdims=True) - mean_ln**2
        running_mean = self.variable("batch_stats", "mean", jnp.zeros, (channels,))
        running_var = self.variable("batch_stats", "var", jnp.zeros, (channels,))
        if train:
            mean_bn = masked_row_mean(mean_in, mask)
            var_bn = masked_row_mean(second_moment, mask) - mean_bn**2
            if not self.is_initializing():
                m = self.momentum
                running_mean.value = m * running_mean.value + (1 - m) * jax.lax.stop_gradient(mean_bn)
                running_var.value = m * running_var.value + (1 - m) * jax.lax.stop_gradient(var_bn)
        else:
            mean_bn, var_bn = running_mean.value, running_var.value
        mean_weight = jax.nn.softmax(self.param("mean_weight", nn.initializers.ones, (3,)))
        var_weight = jax.nn.softmax(self.param("var_weight", nn.initializers.ones, (3,)))
        mean = mean_weight[0] * mean_in + mean_weight[1] * mean_ln + mean_weight[2] * mean_bn
        var = var_weight[0] * var_in + var_weight[1] * var_ln + var_weight[2] * var_bn
        y = (x - mean[:, None]) / jnp.sqrt(var[:, None] + self.epsilon)
        return y * self.param("scale", nn.initializers.ones, (channels,)) + self.param(
            "bias", nn.initializers.zeros, (channels,)
        )


def torch_linear_bias(fan_in: int):
    """torch's ``nn.Linear`` bias initializer: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return lambda key, shape, dtype=jnp.float32: lowrank.kaiming_uniform(key, shape, fan_in, dtype)


class GatingLayer(nn.Module):
    """The gating layer: ``[batch, ...]`` inputs -> ``[batch, num_blocks]`` logits (SwitchNorm,
    flatten, Dense with torch's ``nn.Linear`` initialization, BatchNorm)."""

    num_blocks: int

    @nn.compact
    def __call__(self, x, train: bool, mask=None):
        batch = x.shape[0]
        channels = x.shape[-1] if x.ndim > 2 else 1
        x = SwitchNorm()(x.reshape(batch, -1, channels), train, mask).reshape(batch, -1)
        fan_in = x.shape[-1]
        logits = nn.Dense(
            self.num_blocks,
            kernel_init=nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),  # U(+-1/sqrt(fan_in))
            bias_init=torch_linear_bias(fan_in),
        )(x)
        bn_mask = None if mask is None else mask[:, None]
        return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)(logits, mask=bn_mask)


# ----- blocks -----------------------------------------------------------------------------------


class Blocks(NamedTuple):
    """The model's parameter blocks (numpy, static)."""

    ids: Any  # a tree like the params: each element's block
    sizes: np.ndarray  # [blocks] int: elements per block
    dense: np.ndarray  # [blocks] bool: the block belongs to a Dense layer
    first: np.ndarray  # [blocks] bool: a tensor's first block (never dropped)


def torch_positions(shape, is_kernel: bool) -> np.ndarray:
    """Each element's index in its tensor flattened in torch's layout: a Flax kernel
    ``[*spatial, in, out]`` is torch's ``[out, in, *spatial]``; any other array is laid out alike."""
    size = math.prod(shape)
    if not is_kernel or len(shape) < 2:
        return np.arange(size).reshape(shape)
    torch_shape = (shape[-1], shape[-2], *shape[:-2])
    return np.arange(size).reshape(torch_shape).transpose(*range(2, len(shape)), 1, 0)


def parameter_blocks(params_template, dense_keys, block_split: int) -> Blocks:
    """Every parameter tensor cut into ``block_split`` contiguous blocks as the authors cut theirs:
    pieces of ``ceil(n / split)`` elements (``split = min(block_split, n)``), the last one shorter."""
    ids, sizes, dense, first = [], [], [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params_template)[0]:
        keys = [str(getattr(p, "key", p)) for p in path]
        n = math.prod(leaf.shape)
        piece = -(-n // min(block_split, n))
        count = -(-n // piece)
        ids.append(len(sizes) + torch_positions(leaf.shape, keys[-1] == "kernel") // piece)
        sizes += [piece] * (count - 1) + [n - (count - 1) * piece]
        dense += [".".join(keys[:-1]) in dense_keys] * count
        first += [True] + [False] * (count - 1)
    tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params_template), ids)
    return Blocks(tree, np.asarray(sizes), np.asarray(dense), np.asarray(first))


def greedy_keep(importance, sizes, candidates, capacity):
    """The authors' greedy knapsack: the ``candidates`` in decreasing ``importance`` (ties: block
    order) each taken while the taken sizes sum to at most ``capacity``. ``[blocks]`` bool."""
    order = jnp.argsort(jnp.where(candidates, -importance, jnp.inf), stable=True)

    def take(total, block):
        fits = candidates[block] & (total + sizes[block] <= capacity)
        return total + jnp.where(fits, sizes[block], 0), fits

    _, taken = jax.lax.scan(take, jnp.int32(0), order)
    return jnp.zeros(importance.shape, bool).at[order].set(taken)


def selection_floor(block_split: int, sparse_factor: float) -> float:
    """The authors' ``min_sparse_factor``: the least gate a block is ranked by."""
    return min(max(1 / block_split, 0.1), sparse_factor)


def kept_blocks(gates, blocks: Blocks, sparse_factor: float, floor: float):
    """``[blocks]`` bool: the blocks a client's model keeps at ``sparse_factor`` < 1, of the
    ``[blocks]`` ``gates`` (ranked at least ``floor``): each tensor's first block and, among
    the Dense layers' other blocks and apart among the rest, the greedy knapsack's choice."""
    importance = jnp.round(jnp.maximum(gates, floor) * IMPORTANCE_LEVELS)
    sizes = jnp.asarray(blocks.sizes, jnp.int32)
    keep = jnp.asarray(blocks.first)
    for group in (blocks.dense, ~blocks.dense):
        candidates = group & ~blocks.first
        capacity = round(int(blocks.sizes[candidates].sum()) * (sparse_factor - floor))
        keep = keep | greedy_keep(importance, sizes, jnp.asarray(candidates), capacity)
    return keep


def gated(params, blocks: Blocks, weights):
    """``params`` with every element multiplied by its block's weight (``[blocks]``)."""
    return jax.tree.map(lambda p, ids: p * weights[ids].astype(p.dtype), params, blocks.ids)


# ----- the algorithm ----------------------------------------------------------------------------


def pfedgate(model, options: PFedGateOptions | None = None, **overrides) -> FederatedAlgorithm:
    """pFedGate: the shared model averaged; each client's private gating layer scales (and at
    ``sparse_factor`` < 1 prunes) its blocks."""
    options = resolve(PFedGateOptions, options, overrides)
    if jnp.issubdtype(model.input_dtype, jnp.integer):
        raise ConfigError(
            f"pfedgate: the gating layer reads float inputs (images, vectors); model {model.name} takes integer ids"
        )
    template, _ = model_template(model)
    blocks = parameter_blocks(template, set(dense_layers(model)), options.block_split)
    blocks = blocks._replace(ids=jax.tree.map(jnp.asarray, blocks.ids))
    gating = GatingLayer(int(blocks.sizes.size))
    sparse = options.sparse_factor < 1
    if sparse and options.block_split == 1:
        raise ConfigError(
            "block_split: sparse_factor < 1 needs block_split >= 2 (with one block a tensor, every block is a "
            "tensor's first, which is always kept)"
        )
    floor = selection_floor(options.block_split, options.sparse_factor)

    def block_weights(gates):
        """The gate of every block the client's model keeps, 0 for the others; a kept block's
        gradient also flows through its clipped gate (the authors' straight-through mask)."""
        if not sparse:
            return gates
        clipped = jnp.maximum(gates, floor)
        mask = (1.0 - jax.lax.stop_gradient(clipped)) + clipped
        return gates * (mask * kept_blocks(gates, blocks, options.sparse_factor, floor))

    def batch_gates(gate, gate_state, batch):
        """``([blocks] mean gate over the batch's real examples, new gate state)``, in training mode."""
        variables = {"params": gate, **gate_state}
        logits, new_state = gating.apply(variables, batch.x, True, batch.mask, mutable=list(gate_state))
        return masked_row_mean(jax.nn.sigmoid(logits), batch.mask), dict(new_state)

    def init(rng):
        model_rng, gate_rng = jax.random.split(rng)
        params, model_state = split_variables(model.init(model_rng))
        gate, gate_state = split_variables(
            gating.init(gate_rng, jnp.zeros((2, *model.input_shape), jnp.float32), False)
        )
        return GlobalParams(params), ClientState(params, jnp.bool_(False), gate, gate_state, model_state)

    def loss(trainable, states, batch):
        gates, gate_state = batch_gates(trainable["gate"], states["gate"], batch)
        variables = {"params": gated(trainable["model"], blocks, block_weights(gates)), **states["model"]}
        outputs, model_state = model.apply(variables, batch.x, train=True, mask=batch.mask, rng=batch.key)
        return masked_loss(outputs, batch.y, batch.mask), {"gate": gate_state, "model": model_state}

    def optimizer(round_):
        gate_lr = options.learning_rate(round_) * options.gate_lr_scale
        gate_optimizer = client_optimizer(
            options.client_optimizer,
            gate_lr,
            momentum=options.momentum,
            weight_decay=options.weight_decay,
            clip_norm=options.clip_norm,
        )
        return per_key({"model": options.optimizer(round_), "gate": gate_optimizer})

    def client_update(params, client: ClientState, data, rng, info):
        trainable = {"model": params, "gate": client.gate}
        states = {"model": client.model_state, "gate": client.gate_state}
        trained, states, metrics = fit(loss, optimizer(info.round), trainable, states, data, rng, **options.batching())
        client = ClientState(trained["model"], jnp.bool_(True), trained["gate"], states["gate"], states["model"])
        return client, trained["model"], metrics

    def client_gates(client: ClientState, data):
        """The mean gate over the client's real training examples (inference mode)."""
        size = options.batch_size
        steps = -(-data.count // size)

        def one_batch(b, total):
            batch = data.batch(b * size + jnp.arange(size, dtype=jnp.int32))
            logits = gating.apply({"params": client.gate, **client.gate_state}, batch.x, False)
            return total + jnp.tensordot(batch.mask.astype(jnp.float32), jax.nn.sigmoid(logits), axes=1)

        total = jax.lax.fori_loop(0, steps, one_batch, jnp.zeros(blocks.sizes.shape, jnp.float32))
        return total / jnp.maximum(data.count, 1).astype(jnp.float32)

    def own_model(server_state, client: ClientState):
        """Its last trained model, or (before it trains: a new client) the global model."""
        return jax.tree.map(lambda own, glob: jnp.where(client.trained, own, glob), client.params, server_state.params)

    def personalize(server_state, client: ClientState, data, rng, info):
        weights = block_weights(client_gates(client, data))
        return {"params": gated(own_model(server_state, client), blocks, weights), **client.model_state}

    return FederatedAlgorithm(
        name="pfedgate",
        options=options,
        init=init,
        broadcast=lambda server_state, info: server_state.params,
        client_update=client_update,
        aggregation=model_averaging(),
        # the engine evaluates personalize's gated model; this is the client's model ungated
        eval_params=lambda server_state, client: {"params": own_model(server_state, client), **client.model_state},
        global_params=None,  # the shared model is only ever used gated
        personalize=personalize,
    )


builtin("pfedgate", PFedGateOptions, lambda model, options, config: pfedgate(model, options))
