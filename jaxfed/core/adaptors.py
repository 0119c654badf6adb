"""Mixtures of low-rank adaptors with a router (FLoRAL's parameterization), for any Flax model.

Every adapted layer keeps its shared base weight and gets ``C`` adaptors; a client's router
logits ``w`` give mixture weights ``pi = softmax(w)`` (:mod:`jaxfed.core.routing`), and the model
runs ONE forward pass with the mixed parameters (:func:`mix`):

- kernel: ``W + alpha * fold(sum_c pi_c down_c @ up_c)``, rank ``rank_from_budget(rows, cols,
  rho)`` (or a fixed rank) of the kernel's matricized form. Dense kernels are matrices; a Conv
  kernel uses its adaptor kind's layout: ``balanced_2d`` (the default: a ``kh x 1`` conv to r
  channels then a ``1 x kw`` conv, lowrank's ``balanced``), ``in_layer`` (a ``kh x kw`` conv then
  a 1 x 1 conv, ``im2col``), ``out_layer`` (1 x 1 then ``kh x kw``, ``outcol``), ``channel``
  (whichever of in_layer / out_layer has fewer parameters).
- bias: ``b + alpha * sum_c pi_c b_c`` (the authors scale bias adaptors by alpha too); norm
  (opt-in): ``scale + sum_c pi_c scale_c``, ``bias + sum_c pi_c bias_c``.

At init ``down`` is uniform in ``+-sqrt(6 / rows)`` and ``up``, the bias and the norm adaptors
are 0, so the adapted model starts as the base model. :func:`lora_preconditioner` is FLoRAL's
LoRA gradient preconditioning as an optax transformation.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxfed.core import lowrank
from jaxfed.errors import ConfigError, unknown_choice

CONV_ADAPTORS = ("balanced_2d", "channel", "in_layer", "out_layer")
CONV_PRECONDITIONERS = ("per_tap", "matricized")
_LAYOUT = {"balanced_2d": "balanced", "in_layer": "im2col", "out_layer": "outcol"}


class KernelAdaptor(NamedTuple):
    kind: str  # "dense" or a conv kind of CONV_ADAPTORS
    layout: str  # lowrank layout of the matricized kernel
    rank: int
    kernel_shape: tuple[int, ...]


class AdaptorPlan(NamedTuple):
    """Which layers get adaptors, of what kind and rank (static)."""

    kernels: dict[str, KernelAdaptor]
    biases: tuple[str, ...]  # layers whose bias gets adaptors
    norms: tuple[str, ...]  # norm layers whose scale and offset (those they have) get adaptors
    num_adaptors: int
    alpha: float


def conv_layout(kind: str, kernel_shape) -> str:
    """The lowrank layout of a conv adaptor kind (``channel``: the cheaper of in / out layer)."""
    if kind not in CONV_ADAPTORS:
        raise ConfigError(f"conv_adaptor: {unknown_choice(kind, CONV_ADAPTORS)}")
    if kind == "channel":
        _, _, cin, cout = kernel_shape
        return "outcol" if cin > cout else "im2col"
    return _LAYOUT[kind]


def adaptor_plan(
    template,
    num_adaptors: int,
    *,
    rho: float = 0.01,
    rank: int = 0,
    conv_adaptor: str = "balanced_2d",
    layers=None,
    bias: bool = True,
    norms: tuple[str, ...] | list[str] = (),
    alpha: float = 1.0,
) -> AdaptorPlan:
    """The plan for a parameter tree (arrays or shape structs): every Dense / Conv kernel (or
    ``layers``) with ``rank`` (a ConfigError where a layer cannot hold it) or, when 0, the rank
    of the relative budget ``rho``; and adaptors on the scale and offset (whichever it has) of each
    normalization layer in ``norms`` (:func:`jaxfed.nn.layers.norm_layers` of the model: layers
    known by their module type, not by their parameters' names)."""
    if num_adaptors < 1:
        raise ConfigError(f"num_adaptors: must be >= 1, got {num_adaptors}")
    if rank < 0:
        raise ConfigError(f"adaptor_rank: must be >= 0 (0 = from rho), got {rank}")
    if not rank:
        lowrank.check_ratio("rho", rho)
    keys = lowrank.factorizable_layers(template) if layers is None else list(layers)
    kernels = {}
    for key in keys:
        shape = tuple(lowrank.get_layer(template, key)["kernel"].shape)
        kind = "dense" if len(shape) == 2 else conv_adaptor
        layout = "balanced" if kind == "dense" else conv_layout(kind, shape)
        if rank:
            r = lowrank.check_rank(shape, rank, "adaptor_rank", key, layout)
        else:
            r = lowrank.rank_from_budget(*lowrank.matrix_shape(shape, layout), rho)
        kernels[key] = KernelAdaptor(kind, layout, r, shape)
    biases = tuple(k for k in keys if bias and "bias" in lowrank.get_layer(template, k))
    return AdaptorPlan(kernels, biases, tuple(norms), num_adaptors, alpha)


def init_adaptors(rng: jax.Array, template, plan: AdaptorPlan, dtype=jnp.float32) -> dict:
    """``{"kernels": {key: {"down" [C, rows, r], "up" [C, r, cols]}}, "biases": {key: [C, n]},
    "norms": {key: {"scale", "bias"}}}`` (a norm layer's
    parameters of these two: RMSNorm has no offset) with zero deltas."""
    c = plan.num_adaptors
    keys = jax.random.split(rng, max(len(plan.kernels), 1))
    kernels = {}
    for k, (key, spec) in zip(keys, sorted(plan.kernels.items())):
        rows, cols = lowrank.matrix_shape(spec.kernel_shape, spec.layout)
        bound = math.sqrt(6.0 / rows)
        kernels[key] = {
            "down": jax.random.uniform(k, (c, rows, spec.rank), dtype, -bound, bound),
            "up": jnp.zeros((c, spec.rank, cols), dtype),
        }

    def zeros_like_leaf(key, name):
        return jnp.zeros((c,) + tuple(lowrank.get_layer(template, key)[name].shape), dtype)

    return {
        "kernels": kernels,
        "biases": {key: zeros_like_leaf(key, "bias") for key in plan.biases},
        "norms": {
            key: {n: zeros_like_leaf(key, n) for n in ("scale", "bias") if n in lowrank.get_layer(template, key)}
            for key in plan.norms
        },
    }


def mix(params, adaptors: dict, weights: jax.Array, plan: AdaptorPlan):
    """The model parameters of mixture weights ``weights [C]``: base plus the weighted adaptors."""
    for key, spec in plan.kernels.items():
        a = adaptors["kernels"][key]
        product = jnp.einsum("c,cir,crj->ij", weights, a["down"], a["up"])
        layer = lowrank.get_layer(params, key)
        delta = lowrank.fold(plan.alpha * product, spec.kernel_shape, spec.layout)
        params = lowrank.replace_layer(params, key, {**layer, "kernel": layer["kernel"] + delta})
    for key in plan.biases:
        layer = lowrank.get_layer(params, key)
        params = lowrank.replace_layer(
            params, key, {**layer, "bias": layer["bias"] + plan.alpha * (weights @ adaptors["biases"][key])}
        )
    for key in plan.norms:
        layer, extra = lowrank.get_layer(params, key), adaptors["norms"][key]
        mixed = {name: layer[name] + weights @ extra[name] for name in ("scale", "bias") if name in layer}
        params = lowrank.replace_layer(params, key, {**layer, **mixed})
    return params


def solve_spd(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a^-1 b`` for symmetric positive definite ``a [..., r, r]`` and ``b [..., r, n]``.

    On CPU this is Gauss-Jordan elimination in plain XLA ops (no pivoting: the pivots of an SPD
    matrix are positive), not ``jnp.linalg.solve``: jaxlib's CPU LAPACK kernels (0.10) split a
    batched call into tasks on XLA's intra-op thread pool and block one of its threads waiting for
    them, so as many concurrent batched solves as the pool has threads deadlock the program (the
    preconditioner of a vmapped client update runs several). Other platforms use
    ``jnp.linalg.solve``.
    """
    return jax.lax.platform_dependent(a, b, cpu=_gauss_jordan, default=jnp.linalg.solve)


def _gauss_jordan(a: jax.Array, b: jax.Array) -> jax.Array:
    r = a.shape[-1]

    def eliminate(j, m):
        pivot_row = jax.lax.dynamic_index_in_dim(m, j, axis=-2, keepdims=False)
        row = pivot_row / jax.lax.dynamic_index_in_dim(pivot_row, j, axis=-1)
        m = m - jax.lax.dynamic_index_in_dim(m, j, axis=-1) * row[..., None, :]
        return jnp.where((jnp.arange(r) == j)[:, None], row[..., None, :], m)

    return jax.lax.fori_loop(0, r, eliminate, jnp.concatenate([a, b], axis=-1))[..., r:]


def lora_preconditioner(plan: AdaptorPlan, eps: float = 1e-5, conv: str = "per_tap") -> optax.GradientTransformation:
    """FLoRAL's LoRA preconditioning of the ``kernels`` gradients of an adaptor tree, per adaptor c.

    Dense (``A = down^T``, ``B = up^T``): ``g_down <- g_down (up up^T + eps I)^-1`` and
    ``g_up <- (down^T down + eps I)^-1 g_up``. Conv: ``g_down / (||P_up|| + eps)`` and
    ``g_up / (||P_down|| + eps)``, where ``P`` is, with ``conv="per_tap"`` (the authors' code),
    the Gram tensor of the factor's conv weight with one ``r x r`` Gram per kernel tap (the norm
    runs over all taps), or with ``conv="matricized"`` the Gram matrix of the matricized factor
    (the taps summed: up to sqrt(taps) times larger). Bias and norm gradients pass unchanged.
    """
    if conv not in CONV_PRECONDITIONERS:
        raise ConfigError(f"conv_precondition: {unknown_choice(conv, CONV_PRECONDITIONERS)}")

    def conv_grams(spec, p):
        """``(P_down, P_up)``, each ``[C, taps, r, r]`` (one tap when matricized)."""
        rows, cols = lowrank.matrix_shape(spec.kernel_shape, spec.layout)
        cin, cout = spec.kernel_shape[2], spec.kernel_shape[3]
        in_taps, out_taps = (rows // cin, cols // cout) if conv == "per_tap" else (1, 1)
        down = p["down"].reshape(p["down"].shape[0], in_taps, rows // in_taps, spec.rank)
        up = p["up"].reshape(p["up"].shape[0], spec.rank, out_taps, cols // out_taps)
        return jnp.einsum("ctir,ctis->ctrs", down, down), jnp.einsum("crtj,cstj->ctrs", up, up)

    def precondition(spec, g, p):
        if spec.kind == "dense":
            gram_up = jnp.einsum("crj,csj->crs", p["up"], p["up"])  # [C, r, r]
            gram_down = jnp.einsum("cir,cis->crs", p["down"], p["down"])
            eye = eps * jnp.eye(gram_up.shape[-1], dtype=gram_up.dtype)
            g_down = jnp.swapaxes(solve_spd(gram_up + eye, jnp.swapaxes(g["down"], 1, 2)), 1, 2)
            return {"down": g_down, "up": solve_spd(gram_down + eye, g["up"])}
        gram_down, gram_up = conv_grams(spec, p)

        def norm(gram):
            return jnp.sqrt(jnp.sum(gram**2, axis=(1, 2, 3)))[:, None, None] + eps

        return {"down": g["down"] / norm(gram_up), "up": g["up"] / norm(gram_down)}

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("lora_preconditioner needs the parameters (optax update(..., params))")
        kernels = {
            key: precondition(plan.kernels[key], g, params["kernels"][key]) for key, g in updates["kernels"].items()
        }
        return {**updates, "kernels": kernels}, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
