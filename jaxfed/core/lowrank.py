"""Low-rank primitives shared by every low-rank algorithm (FedLoRU family, FedHM, FedDecomp,
FedARA, FLoRAL, FedKD): conv-kernel matricization, truncated-SVD factorization (to a rank or to
an energy share), rank rules, LoRA factors and layer addressing in parameter trees (running a
factorized layer is :mod:`jaxfed.nn.factorized`'s).

A kernel is a Dense ``[in, out]`` or a Conv ``[kh, kw, cin, cout]`` (Flax layout). A conv kernel
is matricized as ``M[(kh*cin), (kw*cout)]`` (transpose to ``[kh, cin, kw, cout]``, reshape), the
layout in which ``M = U V^T`` runs as a ``kh x 1`` conv (cin -> r) followed by a ``1 x kw`` conv
(r -> cout). Every function here is pure and jit / vmap compatible; rank rules are static Python.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxfed.errors import ConfigError, unknown_choice


class Factors(NamedTuple):
    """``M ~= u @ v.T`` with ``u [rows, r]`` and ``v [cols, r]`` (matricized layout)."""

    u: jax.Array
    v: jax.Array


# ----- layout -----------------------------------------------------------------------------------


LAYOUTS = ("balanced", "im2col", "outcol")


def matrix_shape(kernel_shape: Sequence[int], layout: str = "balanced") -> tuple[int, int]:
    """``(rows, cols)`` of a kernel's matricized form (see :func:`matricize`)."""
    if len(kernel_shape) == 2:
        return tuple(kernel_shape)
    if len(kernel_shape) != 4:
        raise ValueError(f"kernel: expected a Dense [in, out] or Conv [kh, kw, cin, cout] shape, got {kernel_shape}")
    kh, kw, cin, cout = kernel_shape
    return {"balanced": (kh * cin, kw * cout), "im2col": (kh * kw * cin, cout), "outcol": (cin, kh * kw * cout)}[layout]


def matricize(kernel: jax.Array, layout: str = "balanced") -> jax.Array:
    """Dense kernels unchanged. Conv ``[kh, kw, cin, cout]``: ``balanced`` (the default) gives
    ``[(kh*cin), (kw*cout)]`` (a rank-r product runs as a kh x 1 then a 1 x kw conv); ``im2col``
    gives ``[(kh*kw*cin), cout]`` (a kh x kw conv to r channels then a 1 x 1 conv: FedLoRU's);
    ``outcol`` gives ``[cin, (kh*kw*cout)]`` (a 1 x 1 conv to r channels then a kh x kw conv)."""
    if kernel.ndim == 2:
        return kernel
    kh, kw, cin, cout = kernel.shape
    if layout == "im2col":
        return kernel.reshape(kh * kw * cin, cout)
    if layout == "outcol":
        return kernel.transpose(2, 0, 1, 3).reshape(cin, kh * kw * cout)
    return kernel.transpose(0, 2, 1, 3).reshape(kh * cin, kw * cout)


def fold(matrix: jax.Array, kernel_shape: Sequence[int], layout: str = "balanced") -> jax.Array:
    """The inverse of :func:`matricize` for a kernel of ``kernel_shape``."""
    if len(kernel_shape) == 2 or layout == "im2col":
        return matrix.reshape(kernel_shape)
    kh, kw, cin, cout = kernel_shape
    if layout == "outcol":
        return matrix.reshape(cin, kh, kw, cout).transpose(1, 2, 0, 3)
    return matrix.reshape(kh, cin, kw, cout).transpose(0, 2, 1, 3)


# ----- rank rules (static) ----------------------------------------------------------------------


def check_ratio(field: str, ratio: float) -> float:
    if not 0 < ratio <= 1:
        raise ConfigError(f"{field}: a rank ratio must be in (0, 1], got {ratio}")
    return ratio


def max_rank(kernel_shape: Sequence[int], layout: str = "balanced") -> int:
    return min(matrix_shape(kernel_shape, layout))


def rank_from_ratio(kernel_shape: Sequence[int], ratio: float, field: str = "rank ratio") -> int:
    """``max(1, round(ratio * min(rows, cols)))`` on the matricized shape (halves round up)."""
    check_ratio(field, ratio)
    return max(1, math.floor(ratio * max_rank(kernel_shape) + 0.5))


def rank_from_budget(rows: int, cols: int, rho: float, field: str = "rho") -> int:
    """``max(1, floor(rho * rows * cols / (rows + cols)))``: the rank whose two factors hold a
    ``rho`` fraction of the ``rows x cols`` matrix's parameters (FLoRAL's budget)."""
    check_ratio(field, rho)
    return max(1, math.floor(rho * rows * cols / (rows + cols)))


def check_rank(
    kernel_shape: Sequence[int], rank: int, field: str = "rank", name: str = "", layout: str = "balanced"
) -> int:
    """``rank`` itself, or a ConfigError if the kernel matricized in ``layout`` cannot hold it."""
    limit = max_rank(kernel_shape, layout)
    if not 1 <= rank <= limit:
        where = f" for {name}" if name else ""
        raise ConfigError(
            f"{field}: {rank} is not a valid rank{where} (kernel {tuple(kernel_shape)}, matricized "
            f"{matrix_shape(kernel_shape, layout)}): allowed 1..{limit}"
        )
    return rank


# ----- factorization ----------------------------------------------------------------------------


FACTORIZATIONS = ("svd", "gram")
GRAM_MAX_CONDITION = 30.0  # above it the Gram route's small singular directions lose accuracy


class Decomposition(NamedTuple):
    """``M = left @ diag(singular) @ right.T`` in full: ``left = U`` ``[rows, n]``, ``singular``
    ``[n]`` in descending order, ``right = V`` ``[cols, n]``, with ``n = min(rows, cols)``."""

    left: jax.Array
    singular: jax.Array
    right: jax.Array


def _svd_decomposition(matrix: jax.Array) -> Decomposition:
    left, singular, right_t = jnp.linalg.svd(matrix, full_matrices=False)
    return Decomposition(left, singular, right_t.T)


def gram_eigendecomposition(matrix: jax.Array) -> Decomposition:
    """The SVD from the symmetric eigendecomposition of the smaller Gram matrix (``A^T A`` with
    ``A`` the matrix or its transpose, whichever is tall), with no check: ``V`` its eigenvectors,
    ``U S = A V``, each singular value the norm of its column of ``A V``, so ``U S V^T = A V V^T =
    A`` to float32 rounding for any orthonormal ``V``, at any condition. Only that product holds
    there: the eigenvectors of singular values below about ``sqrt(eps) ||A||`` mix, so those
    singular values are off by up to about 1e-4 of the largest, ``U``'s columns for them are
    nearly parallel, and a truncation among them can lose beyond the best of its rank (synthetic
    30 x 12 spectra of condition 1e8: up to 1.3e-4 of ``||A||``; FedHM's fc1 after 6 rounds of
    W1, condition 2e5: 6.5e-5, against the SVD's 6e-9: ``benchmarks/svd.py``'s ``gram_eigh``).
    :func:`decompose`'s ``gram`` route therefore checks the condition first."""
    tall = matrix.shape[0] >= matrix.shape[1]
    a = matrix if tall else matrix.T
    highest = jax.lax.Precision.HIGHEST  # float32 products even where the default is TF32
    _, right = jnp.linalg.eigh(jnp.matmul(a.T, a, precision=highest))
    scaled = jnp.matmul(a, right, precision=highest)
    singular = jnp.linalg.norm(scaled, axis=0)
    order = jnp.argsort(-singular)
    singular, scaled, right = singular[order], scaled[:, order], right[:, order]
    left = scaled / jnp.where(singular > 0, singular, 1.0)
    return Decomposition(left, singular, right) if tall else Decomposition(right, singular, left)


def _gram_decomposition(matrix: jax.Array) -> Decomposition:
    """:func:`gram_eigendecomposition` where the matrix's condition number is at most
    :data:`GRAM_MAX_CONDITION`; a matrix above it (or singular) is decomposed by ``jnp.linalg.svd``
    instead, after the eigendecomposition that measured it (a ``lax.cond``, one branch runs;
    vmapped, as in a sweep's server step, the cond is a select and both run). Trained kernels
    pass the bound quickly (W1's FedHM fc1: 5.6 at initialization, 30 after one round, 2e5 after
    six), and there this route costs the eigendecomposition plus the SVD."""
    gram = gram_eigendecomposition(matrix)
    singular = gram.singular
    well_conditioned = (singular[-1] > 0) & (singular[0] <= GRAM_MAX_CONDITION * singular[-1])
    return jax.lax.cond(well_conditioned, lambda: gram, lambda: _svd_decomposition(matrix))


def decompose(matrix: jax.Array, method: str = "svd") -> Decomposition:
    """The thin SVD of ``matrix`` (:class:`Decomposition`), computed by ``method``: ``svd``
    (``jnp.linalg.svd``: LAPACK on CPU, cuSOLVER on GPU) or ``gram`` (the Gram matrix's
    symmetric eigendecomposition, :func:`_gram_decomposition`). The two agree to float32
    rounding, up to the signs of singular-vector pairs."""
    if method == "svd":
        return _svd_decomposition(matrix)
    if method == "gram":
        return _gram_decomposition(matrix)
    raise ValueError(f"factorization: {unknown_choice(method, FACTORIZATIONS)}")


def factorize(matrix: jax.Array, rank: int, method: str = "svd") -> Factors:
    """Truncated SVD: ``u = U_r sqrt(S_r)``, ``v = V_r sqrt(S_r)`` so ``u @ v.T`` is the best
    rank-``rank`` approximation (Eckart-Young); ``method`` as :func:`decompose`."""
    parts = decompose(matrix, method)
    root = jnp.sqrt(parts.singular[:rank])
    return Factors(u=parts.left[:, :rank] * root, v=parts.right[:, :rank] * root)


def reconstruct(factors: Factors) -> jax.Array:
    return factors.u @ factors.v.T


def energy_rank(singular: jax.Array, energy) -> jax.Array:
    """The smallest ``k`` with ``sum_{i<=k} s_i^2 >= energy * sum_i s_i^2`` (int32; 0 for a zero
    matrix): how many of the singular values ``singular`` (descending) keep an ``energy`` share of
    the matrix's squared Frobenius norm. ``energy`` may be traced."""
    squared = jnp.square(singular)
    total = jnp.sum(squared)
    below = jnp.sum(jnp.cumsum(squared) < energy * total)  # the prefixes short of the share
    return jnp.where(total > 0, jnp.minimum(below + 1, singular.shape[0]), 0).astype(jnp.int32)


def energy_truncation(matrix: jax.Array, energy, method: str = "svd") -> tuple[jax.Array, jax.Array]:
    """``(M_k, k)``: ``matrix``'s SVD truncated to its :func:`energy_rank` ``k`` largest singular
    values (FedKD's dynamic gradient approximation), in the matrix's shape; ``method`` as :func:`decompose`."""
    parts = decompose(matrix, method)
    k = energy_rank(parts.singular, energy)
    kept = jnp.where(jnp.arange(parts.singular.shape[0]) < k, parts.singular, 0.0)
    return (parts.left * kept) @ parts.right.T, k


@jax.custom_vjp
def product_norm_sq(u: jax.Array, v: jax.Array) -> jax.Array:
    """``||u v^T||_F^2 = sum((u^T u) * (v^T v))`` without forming ``u v^T``. Its gradient,
    ``(2 u (v^T v), 2 v (u^T u))``, reuses the two Gram matrices of the value: ``2 (rows + cols)
    r^2`` multiply-adds in all, where differentiating the value's expression costs 1.5 times that.
    Reverse mode only (a ``custom_vjp``: ``jax.grad``, not ``jax.jvp``)."""
    return jnp.sum((u.T @ u) * (v.T @ v))


def _product_norm_sq_fwd(u, v):
    gram_u, gram_v = u.T @ u, v.T @ v
    return jnp.sum(gram_u * gram_v), (u, v, gram_u, gram_v)


def _product_norm_sq_bwd(residuals, g):
    u, v, gram_u, gram_v = residuals
    return 2 * g * (u @ gram_v), 2 * g * (v @ gram_u)


product_norm_sq.defvjp(_product_norm_sq_fwd, _product_norm_sq_bwd)


def factorize_kernel(kernel: jax.Array, rank: int, method: str = "svd") -> Factors:
    return factorize(matricize(kernel), rank, method)


def reconstruct_kernel(factors: Factors, kernel_shape: Sequence[int]) -> jax.Array:
    return fold(reconstruct(factors), kernel_shape)


# ----- LoRA -------------------------------------------------------------------------------------


class LoRA(NamedTuple):
    """``delta = scale * down @ up`` in a kernel's matricized ``[rows, cols]`` form.

    ``down [rows, r]`` is the input-side factor (LoRA's A: Kaiming-uniform at init) and
    ``up [r, cols]`` the output-side one (LoRA's B: zero at init), so the delta starts at 0 and
    the first step trains ``up``, as in LoRA. (Flax kernels are ``[in, out]``: rows are inputs.)
    """

    down: jax.Array
    up: jax.Array


def lora_init(rng: jax.Array, kernel_shape: Sequence[int], rank: int, layout: str = "balanced", dtype=jnp.float32):
    """A zero-delta :class:`LoRA`: ``down`` uniform in ``+-1/sqrt(rows)`` (torch's
    ``kaiming_uniform_(a=sqrt(5))`` on LoRA's A), ``up`` zero."""
    rows, cols = matrix_shape(kernel_shape, layout)
    return LoRA(down=kaiming_uniform(rng, (rows, rank), rows, dtype), up=jnp.zeros((rank, cols), dtype))


def kaiming_uniform(rng: jax.Array, shape, fan_in: int, dtype=jnp.float32) -> jax.Array:
    """Uniform in ``+-1/sqrt(fan_in)``: torch's ``kaiming_uniform_(a=sqrt(5))``, LoRA's factor init."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(rng, shape, dtype, -bound, bound)


def lora_delta(lora: LoRA, kernel_shape: Sequence[int], scale: float = 1.0, layout: str = "balanced") -> jax.Array:
    """``fold(scale * down @ up)``: the LoRA update in the kernel's own shape."""
    return fold(scale * (lora.down @ lora.up), kernel_shape, layout)


# ----- parameter trees --------------------------------------------------------------------------
# A layer is addressed by its Flax module path joined with dots ("layer1_0.conv1"). A factorized
# layer holds ``u`` and ``v`` instead of ``kernel``: Dense ``u [in, r]``, ``v [out, r]``; Conv
# ``u [kh, cin, r]``, ``v [kw, cout, r]`` (the matricized factors, reshaped so that the kernel's
# shape can be read back from them).


def _layers(params, prefix=()):
    """``(key, layer_dict)`` for every dict of ``params`` that holds a ``kernel`` or ``u``/``v``."""
    for name, child in params.items():
        if not isinstance(child, dict):
            continue
        path = prefix + (name,)
        if "kernel" in child or "u" in child:
            yield ".".join(path), child
        else:
            yield from _layers(child, path)


def replace_layer(params, key: str, layer: dict):
    head, _, rest = key.partition(".")
    if not rest:
        return {**params, head: layer}
    return {**params, head: replace_layer(params[head], rest, layer)}


def pop_layer(params, key: str):
    """``(params without the layer key, that layer)``."""
    head, _, rest = key.partition(".")
    if not rest:
        return {k: v for k, v in params.items() if k != head}, params[head]
    inner, layer = pop_layer(params[head], rest)
    return {**params, head: inner}, layer


def get_layer(params, key: str) -> dict:
    for part in key.split("."):
        params = params[part]
    return params


def factorizable_layers(params, include: Sequence[str] = (), exclude: Sequence[str] = (), min_size: int = 0):
    """Keys of the layers with a Dense or Conv ``kernel`` whose key contains one of ``include``
    (all when empty) and none of ``exclude``, with at least ``min_size`` kernel parameters."""
    keys = []
    for key, layer in _layers(params):
        kernel = layer.get("kernel")
        if kernel is None or kernel.ndim not in (2, 4) or math.prod(kernel.shape) < min_size:
            continue
        if include and not any(p in key for p in include):
            continue
        if any(p in key for p in exclude):
            continue
        keys.append(key)
    return keys


def layers_with_factors(params) -> dict[str, dict]:
    """``{key: layer}`` of the layers of ``params`` that hold factors ``u, v``."""
    return {key: layer for key, layer in _layers(params) if "u" in layer}


def kernel_shape_of(layer: dict) -> tuple[int, ...]:
    """The full kernel shape of a plain or factorized layer."""
    if "kernel" in layer:
        return tuple(layer["kernel"].shape)
    u, v = layer["u"], layer["v"]
    if u.ndim == 2:
        return u.shape[0], v.shape[0]
    return u.shape[0], v.shape[0], u.shape[1], v.shape[1]


def layer_factors(layer: dict) -> Factors:
    u, v = layer["u"], layer["v"]
    return Factors(u=u.reshape(-1, u.shape[-1]), v=v.reshape(-1, v.shape[-1]))


def factorize_layers(params, ranks: dict[str, int], method: str = "svd"):
    """``params`` with each layer in ``ranks`` replaced by its truncated-SVD factors ``u, v``
    (``method`` as :func:`decompose`)."""
    for key, rank in ranks.items():
        layer = get_layer(params, key)
        shape = tuple(layer["kernel"].shape)
        check_rank(shape, rank, name=key)
        factors = factorize_kernel(layer["kernel"], rank, method)
        if len(shape) == 4:
            kh, kw, cin, cout = shape
            factors = Factors(u=factors.u.reshape(kh, cin, rank), v=factors.v.reshape(kw, cout, rank))
        rest = {k: v for k, v in layer.items() if k != "kernel"}
        params = replace_layer(params, key, {**rest, "u": factors.u, "v": factors.v})
    return params


def reconstruct_layers(params):
    """``params`` with every factorized layer's ``u, v`` replaced by the full ``kernel`` (a padded
    layer's ``kernel + fold(u v^T)``, see :func:`pad_to_union`)."""
    for key, layer in list(_layers(params)):
        if "u" in layer:
            kernel = reconstruct_kernel(layer_factors(layer), kernel_shape_of(layer))
            if "kernel" in layer:
                kernel = layer["kernel"] + kernel
            rest = {k: v for k, v in layer.items() if k not in ("u", "v")}
            params = replace_layer(params, key, {**rest, "kernel": kernel})
    return params


# ----- padded layers: every rank in one shape ---------------------------------------------------
# A padded layer holds ``kernel``, ``u`` and ``v`` at once, the factors zero-padded to a rank
# shared by every tier: a layer factorized at rank r has a zero kernel and r non-zero factor
# columns; a layer kept whole has zero factors. Zero columns stay zero under gradient training
# (``du = x^T (g v)`` and ``dv = g^T (x u)`` vanish on them), so the padding changes no number;
# the kernel of a factorized layer is switched off by a 0/1 ``kernel_on`` flag, which
# :func:`jaxfed.nn.factorized.factorized_execution` multiplies it by (so its gradient is 0 too).


def union_ranks(ranks_per_tier: Sequence[dict[str, int]]) -> dict[str, int]:
    """``{layer: the largest rank any tier factorizes it to}``: the padded shape every tier shares."""
    union: dict[str, int] = {}
    for ranks in ranks_per_tier:
        for key, rank in ranks.items():
            union[key] = max(rank, union.get(key, 0))
    return union


class Padded(NamedTuple):
    """Parameters whose layers are padded (``kernel``, ``u``, ``v``) and each layer's kernel switch."""

    params: dict
    kernel_on: dict  # {layer: float32 scalar, 1.0: the kernel runs, 0.0: the factors}


def pad_to_union(params, union: dict[str, int]) -> Padded:
    """``params`` (some layers of ``union`` factorized, the others whole) with every layer of
    ``union`` padded (kernel, factors of rank ``union[key]``), and the layers' kernel switches."""
    kernel_on = {}
    for key, rank in union.items():
        layer = get_layer(params, key)
        shape = kernel_shape_of(layer)
        if "u" in layer:
            u, v = (jnp.pad(f, [(0, 0)] * (f.ndim - 1) + [(0, rank - f.shape[-1])]) for f in (layer["u"], layer["v"]))
            kernel, on = jnp.zeros(shape, u.dtype), 0.0
        else:
            kernel, on = layer["kernel"], 1.0
            rows = (shape[0],) if len(shape) == 2 else (shape[0], shape[2])
            cols = (shape[1],) if len(shape) == 2 else (shape[1], shape[3])
            u, v = jnp.zeros((*rows, rank), kernel.dtype), jnp.zeros((*cols, rank), kernel.dtype)
        rest = {k: x for k, x in layer.items() if k not in ("kernel", "u", "v")}
        params = replace_layer(params, key, {**rest, "kernel": kernel, "u": u, "v": v})
        kernel_on[key] = jnp.float32(on)
    return Padded(params, kernel_on)


def reconstruct_padded(padded: Padded):
    """The whole kernels of padded layers as they run (:func:`factorized_execution` with the
    switches): ``kernel_on * kernel + fold(u v^T)`` for each layer in ``padded.kernel_on``."""
    params = padded.params
    for key, on in padded.kernel_on.items():
        layer = get_layer(params, key)
        params = replace_layer(params, key, {**layer, "kernel": on * layer["kernel"]})
    return reconstruct_layers(params)


def init_loras(rng: jax.Array, params, ranks: dict[str, int], layout: str = "balanced") -> dict[str, LoRA]:
    """A fresh :class:`LoRA` (zero delta) for each layer in ``ranks``."""
    keys = jax.random.split(rng, max(len(ranks), 1))
    loras = {}
    for k, (key, rank) in zip(keys, sorted(ranks.items())):
        shape = kernel_shape_of(get_layer(params, key))
        check_rank(matrix_shape(shape, layout), rank, name=key)
        loras[key] = lora_init(k, shape, rank, layout)
    return loras


def add_loras(params, loras: dict[str, LoRA], scale: float | dict[str, float] = 1.0, layout: str = "balanced"):
    """``params`` with ``kernel + scale * fold(down @ up)`` for each layer in ``loras``."""
    for key, lora in loras.items():
        layer = get_layer(params, key)
        factor = scale[key] if isinstance(scale, dict) else scale
        delta = lora_delta(lora, layer["kernel"].shape, factor, layout)
        params = replace_layer(params, key, {**layer, "kernel": layer["kernel"] + delta})
    return params


def split_kernels(params, keys: Sequence[str]):
    """``(params without the kernels of layers keys, {key: kernel})``."""
    kernels = {}
    for key in keys:
        layer = get_layer(params, key)
        kernels[key] = layer["kernel"]
        params = replace_layer(params, key, {k: v for k, v in layer.items() if k != "kernel"})
    return params, kernels


def merge_kernels(params, kernels: dict):
    """The inverse of :func:`split_kernels`."""
    for key, kernel in kernels.items():
        params = replace_layer(params, key, {**get_layer(params, key), "kernel": kernel})
    return params
