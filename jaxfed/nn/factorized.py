"""Factorized execution for any jaxfed model: a Dense or Conv layer whose parameters hold ``u``
and ``v`` (see :mod:`jaxfed.core.lowrank`) instead of ``kernel`` runs as two thin matmuls or a
``kh x 1`` then ``1 x kw`` conv, so its cost scales with its rank.

    with factorized_execution():
        logits, _ = model.apply({"params": factorize_layers(params, ranks)}, x)

Implemented as a Flax method interceptor, so the model definitions need no change. The same
mechanism gives :func:`layers_in_call_order`, from which :func:`interior_layers` picks the layers
the low-rank algorithms factorize by default.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax

from jaxfed.core import lowrank
from jaxfed.nn.conv import Conv


def _interceptor(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "__call__" or not isinstance(module, (Conv, nn.Dense)):
        return next_fun(*args, **kwargs)
    params = module.variables.get("params", {})
    if "u" not in params:
        return next_fun(*args, **kwargs)
    x = args[0]
    factors = lowrank.layer_factors(params)
    if isinstance(module, Conv):
        y = lowrank.factorized_conv(
            x, factors, lowrank.kernel_shape_of(params), module.strides, module.padding, module.impl
        )
    else:
        y = lowrank.factorized_dense(x, factors)
    return y + params["bias"] if "bias" in params else y


@contextlib.contextmanager
def factorized_execution():
    """Within this context, factorized layers (``u``, ``v`` params) run factorized."""
    with nn.intercept_methods(_interceptor):
        yield


def layers_in_call_order(model) -> list[str]:
    """Keys (``"a.b"``, as :mod:`jaxfed.core.lowrank` addresses layers) of the model's Dense and
    Conv layers in the order a forward pass calls them."""
    order = []

    def record(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "__call__" and isinstance(module, (Conv, nn.Dense)):
            key = ".".join(module.path)
            if key not in order:
                order.append(key)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(model.init, jax.random.key(0))
    return order


def interior_layers(model) -> list[str]:
    """The default layers to factorize: every Dense / Conv layer except the first one called and
    the last (the head), FedLoRU's and FedHM's choice; in a two-layer model, the first layer."""
    layers = layers_in_call_order(model)
    return layers[1:-1] or layers[:1]
