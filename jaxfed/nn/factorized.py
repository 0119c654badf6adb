"""Factorized execution for any Flax model: a Dense or Conv layer (stock ``nn.Dense`` / ``nn.Conv``
or jaxfed's :class:`~jaxfed.nn.conv.Conv`) whose parameters hold ``u`` and ``v`` (see
:mod:`jaxfed.core.lowrank`) instead of ``kernel`` runs as two thin matmuls or a ``kh x 1`` then
``1 x kw`` conv, so its cost scales with its rank.

    with factorized_execution():
        logits, _ = model.apply({"params": factorize_layers(params, ranks)}, x)

Implemented as a Flax method interceptor, so the model definitions need no change.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import flax.linen as nn
import jax

from jaxfed.core import lowrank
from jaxfed.errors import ConfigError
from jaxfed.nn.conv import Conv, conv2d
from jaxfed.nn.layers import DENSE_OR_CONV


def factorized_dense(x: jax.Array, factors: lowrank.Factors) -> jax.Array:
    """``x @ (u v^T)`` as two thin matmuls: ``(x @ u) @ v.T``."""
    return (x @ factors.u) @ factors.v.T


def factorized_conv(
    x: jax.Array,
    factors: lowrank.Factors,
    kernel_shape: Sequence[int],
    strides: Sequence[int] = (1, 1),
    padding="SAME",
    impl: str = "patches",
) -> jax.Array:
    """The conv with kernel ``fold(u v^T)`` as a ``kh x 1`` conv (cin -> r; the row stride and
    padding) followed by a ``1 x kw`` conv (r -> cout; the column stride and padding)."""
    kh, kw, cin, cout = kernel_shape
    rank = factors.u.shape[1]
    pads = (
        jax.lax.padtype_to_pads(x.shape[1:3], (kh, kw), tuple(strides), padding)
        if isinstance(padding, str)
        else padding
    )
    (top, bottom), (left, right) = pads
    first = factors.u.reshape(kh, 1, cin, rank)  # u rows are (kh, cin)
    second = factors.v.reshape(1, kw, cout, rank).transpose(0, 1, 3, 2)  # v rows are (kw, cout)
    h = conv2d(x, first, (strides[0], 1), ((top, bottom), (0, 0)), impl)
    return conv2d(h, second, (1, strides[1]), ((0, 0), (left, right)), impl)


def _stock_conv_geometry(module: nn.Conv):
    """``(strides, padding)`` of a stock ``nn.Conv`` in :func:`factorized_conv`'s form; a
    ConfigError for what a factorized conv cannot express."""
    name = ".".join(module.path)
    if len(module.kernel_size) != 2:
        raise ConfigError(f"layer {name}: only 2-D convolutions can run factorized")
    for attribute in ("input_dilation", "kernel_dilation"):
        value = getattr(module, attribute)
        if value not in (None, 1) and tuple(value) != (1, 1):
            raise ConfigError(f"layer {name}: {attribute} {value} cannot run factorized (only 1)")
    if module.feature_group_count != 1:
        raise ConfigError(f"layer {name}: grouped convolutions cannot run factorized")
    strides = module.strides or 1
    strides = (strides, strides) if isinstance(strides, int) else tuple(strides)
    padding = module.padding
    if isinstance(padding, str):
        if padding not in ("SAME", "VALID"):
            raise ConfigError(f"layer {name}: padding {padding} cannot run factorized (SAME, VALID or explicit)")
    elif isinstance(padding, int):
        padding = ((padding, padding), (padding, padding))
    else:
        padding = tuple((p, p) if isinstance(p, int) else tuple(p) for p in padding)
    return strides, padding


def padded_conv(x, kernel, factors: lowrank.Factors, strides, padding, impl: str) -> jax.Array:
    """A padded layer's conv (see :func:`jaxfed.core.lowrank.pad_to_union`): one conv with the
    kernel ``kernel + fold(u v^T)`` (composing it costs ``rows * cols * r`` per step, a small
    part of a conv over a batch of images)."""
    return conv2d(x, kernel + lowrank.reconstruct_kernel(factors, kernel.shape), strides, padding, impl)


def padded_dense(x, kernel, factors: lowrank.Factors) -> jax.Array:
    """A padded layer's dense: ``x @ kernel + (x @ u) @ v.T`` (composing ``u v^T`` would cost
    ``in * out * r`` per step, more than the batch's own matmul)."""
    return x @ kernel + factorized_dense(x, factors)


def _interceptor(kernel_on, next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "__call__" or not isinstance(module, DENSE_OR_CONV):
        return next_fun(*args, **kwargs)
    params = module.variables.get("params", {})
    if "u" not in params:
        return next_fun(*args, **kwargs)
    x = args[0]
    factors = lowrank.layer_factors(params)
    shape = lowrank.kernel_shape_of(params)
    if isinstance(module, Conv):
        strides, padding, impl = module.strides, module.padding, module.impl
    elif isinstance(module, nn.Conv):
        (strides, padding), impl = _stock_conv_geometry(module), "xla"
    if "kernel" in params:  # a padded layer: its kernel counts where kernel_on says so
        kernel = params["kernel"] * _kernel_on(kernel_on, module)
        if isinstance(module, nn.Dense):
            y = padded_dense(x, kernel, factors)
        else:
            y = padded_conv(x, kernel, factors, strides, padding, impl)
    elif isinstance(module, nn.Dense):
        y = factorized_dense(x, factors)
    else:
        y = factorized_conv(x, factors, shape, strides, padding, impl)
    return y + params["bias"] if "bias" in params else y


def _kernel_on(kernel_on, module) -> jax.Array:
    key = ".".join(module.path)
    if kernel_on is None or key not in kernel_on:
        raise ValueError(f"layer {key}: a padded layer (kernel, u, v) runs with factorized_execution(kernel_on)")
    return kernel_on[key]


@contextlib.contextmanager
def factorized_execution(kernel_on: dict | None = None):
    """Within this context, factorized layers (``u``, ``v`` params) run factorized; a padded
    layer (``kernel``, ``u``, ``v``: :func:`jaxfed.core.lowrank.pad_to_union`) runs as
    ``kernel_on[key] * kernel + fold(u v^T)``."""
    with nn.intercept_methods(functools.partial(_interceptor, kernel_on)):
        yield
