"""Local training shared by every algorithm: minibatch epochs of one client in a ``lax.while_loop``.

A client's example list is padded to the largest client's. Padded examples carry a zero mask in
the loss and the loop runs only the client's own steps, so a client's result is exactly what it
would be alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxfed.core.losses import masked_loss
from jaxfed.data import Batch, ClientData
from jaxfed.nn import split_variables
from jaxfed.options import client_optimizer, sgd  # noqa: F401  (re-exported: the one client optimizer constructor)

STEP_KEY_STREAM = 0x5EED  # the per-step keys are fold_in(rng, this), apart from the shuffling keys


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    model_state: Any  # non-trainable collections (BatchNorm statistics), {} when none


def classification_loss(
    model,
    regularizer: Callable[[Any], jax.Array] | None = None,
    to_params: Callable[..., Any] | None = None,
    stochastic: bool = False,
):
    """``loss(params, model_state, batch) -> (loss, new_model_state)``: masked CE (MSE for float
    targets) plus ``regularizer(params)``.

    ``to_params`` maps the trained tree to the model's parameters (e.g. frozen kernels plus LoRA
    deltas); by default the trained tree is the model's parameters. With ``stochastic`` it is
    called as ``to_params(params, batch.key)``, a fresh key every step (e.g. router noise)."""

    def loss(params, model_state, batch: Batch):
        if to_params is None:
            model_params = params
        else:
            model_params = to_params(params, batch.key) if stochastic else to_params(params)
        logits, new_state = model.apply(
            {"params": model_params, **model_state}, batch.x, train=True, mask=batch.mask, rng=batch.key
        )
        value = masked_loss(logits, batch.y, batch.mask)
        if regularizer is not None:
            value = value + regularizer(params)
        return value, new_state

    return loss


def gradient_step(loss_fn, optimizer: optax.GradientTransformation):
    """One optimizer step on a batch: ``step(TrainState, batch) -> (TrainState, loss)``."""

    def step(state: TrainState, batch: Batch):
        (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, state.model_state, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return TrainState(optax.apply_updates(state.params, updates), opt_state, model_state), loss

    return step


def masked(optimizer: optax.GradientTransformation, mask) -> optax.GradientTransformation:
    """``optimizer`` training only the parts of the tree whose ``mask`` entry is 1 (``mask``: a
    prefix of the trained tree whose leaves are 0/1 scalars, traced or not): a 0 part's gradient is
    zeroed before the optimizer (it adds nothing to a clipped norm) and its update after (weight
    decay moves it neither), so it stays as it is. ``optax.masked`` with the mask a value, not a
    structure: one program trains a different part for each client (mFedLoRU's padded tiers)."""

    def times_mask(tree):  # a select, not a product: a frozen part's inf or NaN gradient stays out
        return jax.tree.map(
            lambda m, part: jax.tree.map(lambda x: jnp.where(jnp.asarray(m) > 0, x, jnp.zeros_like(x)), part),
            mask,
            tree,
        )

    def update(grads, state, params=None):
        updates, state = optimizer.update(times_mask(grads), state, params)
        return times_mask(updates), state

    return optax.GradientTransformation(optimizer.init, update)


def shuffled_positions(rng, count, max_examples: int, length: int):
    """A permutation of positions ``0..count-1`` followed by padding positions (>= count).

    The real positions' order depends only on ``rng`` and ``count``, not on how much padding
    follows, so a client shuffles identically whatever the largest client of its round is.
    """
    keys = jax.random.uniform(rng, (max_examples,))
    keys = jnp.where(jnp.arange(max_examples) < count, keys, 2.0)
    order = jnp.argsort(keys, stable=True).astype(jnp.int32)
    return jnp.pad(order, (0, length - max_examples), constant_values=max_examples)


def run_epochs(step, state, data: ClientData, rng, *, epochs: int, batch_size: int, drop_last: bool = False):
    """``epochs`` shuffled passes of ``step`` over one client's real examples.

    The steps run in a ``lax.while_loop`` whose trip count is this client's own number of steps,
    so a client computes exactly what it would alone. Vmapped, the loop runs until the group's
    largest client is done (finished clients keep their state); run one client at a time
    (``lax.map``), it does only real steps.

    Returns the final state and ``{"train_loss": mean batch loss, "steps": steps taken}``
    (``epochs=0``: the state unchanged and zero metrics).
    """
    if epochs == 0:
        return state, {"train_loss": jnp.float32(0), "steps": jnp.float32(0)}
    max_examples = data.indices.shape[0]
    padded_length = -(-max_examples // batch_size) * batch_size
    steps_per_epoch = data.count // batch_size if drop_last else -(-data.count // batch_size)
    total_steps = steps_per_epoch * epochs
    orders = jax.vmap(lambda key: shuffled_positions(key, data.count, max_examples, padded_length))(
        jax.random.split(rng, epochs)
    )
    step_keys = jax.random.fold_in(rng, STEP_KEY_STREAM)

    def body(carry):
        t, state, loss_sum = carry
        epoch, s = jnp.divmod(t, jnp.maximum(steps_per_epoch, 1))
        positions = jax.lax.dynamic_slice(orders[epoch], (s * batch_size,), (batch_size,))
        batch = data.batch(positions)._replace(key=jax.random.fold_in(step_keys, t))
        state, loss = step(state, batch)
        return t + 1, state, loss_sum + loss

    _, state, loss_sum = jax.lax.while_loop(
        lambda carry: carry[0] < total_steps, body, (jnp.int32(0), state, jnp.float32(0))
    )
    return state, {
        "train_loss": loss_sum / jnp.maximum(total_steps, 1),
        "steps": total_steps.astype(jnp.float32),
    }


def train_classifier(
    model,
    optimizer: optax.GradientTransformation,
    variables: dict,
    data: ClientData,
    rng,
    *,
    epochs: int,
    batch_size: int,
    drop_last: bool = False,
    regularizer=None,
    to_params=None,
    stochastic: bool = False,
):
    """Train all ``params`` of ``variables`` on one client's data with masked cross-entropy
    (mean squared error for float targets).

    ``to_params`` maps ``variables["params"]`` (what is trained) to the model's parameters
    (``to_params(params, key)`` with a fresh key every step when ``stochastic``).
    Returns ``(variables, metrics)``; the optimizer state starts fresh (local optimizers are
    re-created every round).
    """
    params, model_state = split_variables(variables)
    loss = classification_loss(model, regularizer, to_params, stochastic)
    params, model_state, metrics = fit(
        loss, optimizer, params, model_state, data, rng, epochs=epochs, batch_size=batch_size, drop_last=drop_last
    )
    return {"params": params, **model_state}, metrics


def fit(loss_fn, optimizer: optax.GradientTransformation, trainable, model_state: dict, data, rng, **batching):
    """Minimize ``loss_fn(trainable, model_state, batch) -> (loss, new_model_state)`` over one
    client's epochs (:func:`run_epochs`; ``batching``: ``epochs, batch_size, drop_last``) with a
    fresh ``optimizer`` state: ``(trained, model_state, metrics)``. The one training loop every
    algorithm with a loss of its own (FedARA's anchors, MOON's contrast, FedNTD's distillation) runs."""
    state = TrainState(trainable, optimizer.init(trainable), model_state)
    state, metrics = run_epochs(gradient_step(loss_fn, optimizer), state, data, rng, **batching)
    return state.params, state.model_state, metrics


def train_parameters(model, optimizer, trainable, model_state: dict, data: ClientData, rng, **options):
    """:func:`train_classifier` on a trainable tree kept apart from the model's non-trainable state:
    returns ``(trained, model_state, metrics)``. ``options``: ``epochs, batch_size, drop_last,
    regularizer, to_params, stochastic``."""
    variables, metrics = train_classifier(model, optimizer, {"params": trainable, **model_state}, data, rng, **options)
    trained, model_state = split_variables(variables)
    return trained, model_state, metrics


def train_routed(
    model,
    optimizer,
    shared: dict,
    router_logits,
    mix,
    model_state: dict,
    data,
    rng,
    *,
    learned: bool,
    mixture,
    **options,
):
    """Local training of ``shared`` parameters that a client's private router mixes (FLoRAL's
    adaptors, the ensemble's members): the model's parameters are ``mix(shared, pi)`` with
    ``pi = mixture(logits, step_key)`` (the router's noise drawn afresh at every step), and the
    router's logits train too when ``learned`` (under the optimizer's ``"router"`` key).

    Returns ``(trained_shared, logits, model_state, metrics)``. ``options``: ``epochs,
    batch_size, drop_last``.
    """

    def to_params(trainable, step_key):
        logits = trainable["router"] if learned else router_logits
        parts = {k: v for k, v in trainable.items() if k != "router"}
        return mix(parts, mixture(logits, step_key))

    trainable = {**shared, **({"router": router_logits} if learned else {})}
    trained, model_state, metrics = train_parameters(
        model, optimizer, trainable, model_state, data, rng, to_params=to_params, stochastic=True, **options
    )
    logits = trained["router"] if learned else router_logits
    trained_shared = {k: v for k, v in trained.items() if k != "router"}
    return trained_shared, logits, model_state, metrics


def projected(projection) -> optax.GradientTransformation:
    """Projected steps, chained after an optimizer: the update that takes the parameters to
    ``projection(params + update)`` (one of ``optax.projections``, e.g. ``projection_hypercube``
    for weights kept in [0, 1])."""

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("projected: the update needs the parameters")
        target = projection(optax.apply_updates(params, updates))
        return jax.tree.map(jnp.subtract, target, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def per_key(transforms: dict[str, optax.GradientTransformation]) -> optax.GradientTransformation:
    """One optax transformation per top-level key of a dict of parameters, each seeing only its
    own subtree. (``optax.multi_transform`` hands every transformation the whole tree with the
    other parts masked, so one written for a part, like FLoRAL's LoRA preconditioner, would not
    apply.)"""

    def init(params):
        return {k: t.init(params[k]) for k, t in transforms.items()}

    def update(updates, state, params=None):
        out, new_state = {}, {}
        for k, t in transforms.items():
            out[k], new_state[k] = t.update(updates[k], state[k], None if params is None else params[k])
        return out, new_state

    return optax.GradientTransformation(init, update)
