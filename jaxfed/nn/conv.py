"""2-D convolution as shifted slices and one matmul, the ``Conv`` layer the models use, and 2x2
max pooling as a reshape.

XLA's CPU convolution is slow in two places this library lives in: inside loop bodies (local
steps under ``lax.scan``: about 8x slower than the same conv outside a loop, jax-ml/jax#12868)
and under ``vmap`` over per-client kernels (a grouped convolution). Written as ``kh * kw``
strided slices of the padded input, concatenated on the channel axis, and one matmul against the
reshaped kernel, a conv is a plain (batched) matmul in both places. ``impl="xla"`` keeps ``lax.conv_general_dilated``.
Parameters are Flax ``nn.Conv``'s: ``kernel [kh, kw, cin, cout]`` and ``bias [cout]``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

CONV_IMPLS = ("patches", "xla")
_AS_XLA = contextvars.ContextVar("jaxfed_conv_as_xla", default=False)


@contextlib.contextmanager
def traced_as_xla():
    """Within it, :func:`conv2d` traces every convolution as ``lax.conv_general_dilated``
    whatever its ``impl`` (the same convolution): how :mod:`jaxfed.cli.bench.flops` counts a
    ``patches`` convolution as the convolution it computes, without its padding's multiply-adds."""
    token = _AS_XLA.set(True)
    try:
        yield
    finally:
        _AS_XLA.reset(token)


def conv2d(x, kernel, strides: Sequence[int] = (1, 1), padding="SAME", impl: str = "patches"):
    """``x [B, H, W, cin]`` convolved with ``kernel [kh, kw, cin, cout]`` (cross-correlation, as
    ``lax.conv_general_dilated`` with NHWC / HWIO)."""
    strides = tuple(strides)
    if impl == "xla" or _AS_XLA.get():
        return jax.lax.conv_general_dilated(x, kernel, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))
    kh, kw, cin, cout = kernel.shape
    pads = jax.lax.padtype_to_pads(x.shape[1:3], (kh, kw), strides, padding) if isinstance(padding, str) else padding
    x = jnp.pad(x, ((0, 0), tuple(pads[0]), tuple(pads[1]), (0, 0)))
    sh, sw = strides
    out_h = (x.shape[1] - kh) // sh + 1
    out_w = (x.shape[2] - kw) // sw + 1
    shifted = [
        x[:, i : i + sh * (out_h - 1) + 1 : sh, j : j + sw * (out_w - 1) + 1 : sw, :]
        for i in range(kh)
        for j in range(kw)
    ]
    # One plain matmul: [B, out_h, out_w, kh*kw*cin] @ [kh*kw*cin, cout]. (An einsum over the
    # stacked [.., kh*kw, cin] patches contracts two axes and ran 3x slower on CPU, measured.)
    patches = jnp.concatenate(shifted, axis=-1)
    return jnp.dot(patches, kernel.reshape(kh * kw * cin, cout))


def max_pool_2x2(x, padding: str = "VALID"):
    """2x2 max pooling with stride 2 on ``x [B, H, W, C]`` (``SAME``: odd edges padded with -inf),
    as ``nn.max_pool(x, (2, 2), (2, 2), padding)``. Written as a reshape and a max, its gradient
    is a mask; XLA's reduce-window gradient (select-and-scatter) is 2.6x slower on CPU."""
    _, h, w, _ = x.shape
    if padding == "SAME":
        x = jnp.pad(x, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), constant_values=-jnp.inf)
    else:
        x = x[:, : h // 2 * 2, : w // 2 * 2]
    b, h, w, c = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


class Conv(nn.Module):
    """A drop-in for ``flax.linen.Conv`` (same parameters, initializers and ``kernel_init`` /
    ``bias_init`` fields) computed by :func:`conv2d`."""

    features: int
    kernel_size: Sequence[int]
    strides: Sequence[int] = (1, 1)
    padding: str = "SAME"
    use_bias: bool = True
    impl: str = "patches"
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x):
        kh, kw = self.kernel_size
        kernel = self.param("kernel", self.kernel_init, (kh, kw, x.shape[-1], self.features))
        y = conv2d(x, kernel, self.strides, self.padding, self.impl)
        if self.use_bias:
            y = y + self.param("bias", self.bias_init, (self.features,))
        return y
