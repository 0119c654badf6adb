"""Layer discovery on any Flax model, by watching one forward pass (Flax method interception).

A layer is addressed as :mod:`jaxfed.core.lowrank` does, by its module path joined with dots
(``"layer1_0.conv1"``). Dense and Conv layers are stock ``nn.Dense`` / ``nn.Conv`` and jaxfed's
:class:`~jaxfed.nn.conv.Conv`. :func:`interior_layers` is the low-rank algorithms' default
choice; :func:`head_input` gives the features a classifier head receives (FedARA's anchors).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from jaxfed.nn.conv import Conv
from jaxfed.nn.traced import abstract_variables, once_per_model

DENSE_OR_CONV = (nn.Dense, nn.Conv, Conv)
NORMALIZATION = (nn.BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm, nn.InstanceNorm)


@once_per_model
def _called_modules(model) -> tuple[tuple[str, nn.Module], ...]:
    """``(key, module)`` of every submodule one forward pass calls, in call order (first call);
    each module unbound (kept past the trace: it holds its fields, not the trace's variables)."""
    order: dict[str, nn.Module] = {}

    def record(next_fun, args, kwargs, context):
        key = ".".join(context.module.path)
        if context.method_name == "__call__" and key and key not in order:
            order[key] = context.module.clone(parent=None)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(model.init, jax.random.key(0))
    return tuple(order.items())


def _calls(model) -> list[tuple[str, nn.Module]]:
    """``(key, module)`` of the model's Dense and Conv layers in call order."""
    return [(key, module) for key, module in _called_modules(model) if isinstance(module, DENSE_OR_CONV)]


def layers_in_call_order(model) -> list[str]:
    """Keys of the model's Dense and Conv layers in the order a forward pass calls them."""
    return [key for key, _ in _calls(model)]


def interior_layers(model) -> list[str]:
    """The default layers to factorize: every Dense / Conv layer except the first one called and
    the last (the head), FedLoRU's and FedHM's choice; in a two-layer model, the first layer."""
    layers = layers_in_call_order(model)
    return layers[1:-1] or layers[:1]


def _dense_calls(model) -> dict[str, nn.Dense]:
    """``{key: module}`` of the model's ``nn.Dense`` layers in call order."""
    return {key: module for key, module in _calls(model) if isinstance(module, nn.Dense)}


def dense_layers(model) -> list[str]:
    """Keys of the model's ``nn.Dense`` layers in the order a forward pass calls them."""
    return list(_dense_calls(model))


def last_dense_layer(model) -> str:
    """The key of the last ``nn.Dense`` layer called (a classifier's head), or ``""`` if none."""
    dense = dense_layers(model)
    return dense[-1] if dense else ""


def head_layer(model, head: str = "", algorithm: str = "", *, outputs: bool = False) -> str:
    """The classifier head's key: ``head`` if it is a Dense layer the forward pass calls, else (empty)
    the last one called; one-line ConfigErrors naming the Dense layers there are. ``outputs``: the
    algorithm computes the model's outputs from the head's parameters (:func:`dense`), so the head
    must be the last Dense layer called, with a bias."""
    from jaxfed.errors import ConfigError

    modules = _dense_calls(model)  # one traced forward pass
    dense = list(modules)
    if not dense:
        raise no_adaptable_layers(algorithm or "head", model)
    head = head or dense[-1]
    if head not in dense:
        raise ConfigError(f"head: '{head}' is not a Dense layer of the model; allowed: {', '.join(dense)}")
    if outputs and head != dense[-1]:
        raise ConfigError(
            f"head: {algorithm} computes the model's outputs from its head, so it must be the last Dense layer "
            f"('{dense[-1]}'), not '{head}'"
        )
    if outputs and not modules[head].use_bias:
        raise ConfigError(
            f"head: {algorithm} computes the model's outputs as features @ kernel + bias; '{head}' has no bias"
        )
    return head


def norm_layers(model) -> list[str]:
    """Keys of the model's normalization layers (``nn.BatchNorm``, ``nn.GroupNorm``,
    ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.InstanceNorm``) that hold a scale or an offset, in
    call order: FedBN's local layers, FLoRAL's norm adaptors. (One with neither has nothing to
    keep or adapt.)"""
    return [key for key, module in _parameter_modules(model) if isinstance(module, NORMALIZATION)]


def head_input(model, head: str, variables, x, *, train: bool = False, mask=None, rng=None):
    """``((features, outputs), model_state)``: the input the layer ``head`` receives (the
    model's features) and the model's outputs, from one forward pass."""
    captured = []

    def capture(next_fun, args, kwargs, context):
        if context.method_name == "__call__" and ".".join(context.module.path) == head:
            captured.append(args[0])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(capture):
        outputs, model_state = model.apply(variables, x, train=train, mask=mask, rng=rng)
    if not captured:
        raise ValueError(f"head: the forward pass never called the layer '{head}'")
    return (captured[-1], outputs), model_state


def parameter_layers(model) -> list[str]:
    """Keys of the modules that hold parameter arrays of their own (Dense, Conv, normalization
    layers), in the order a forward pass calls them: the model's layers counted as its parameters
    list them, layer by layer, the output side last (FedALA's top layers)."""
    return [key for key, _ in _parameter_modules(model)]


def _parameter_modules(model) -> list[tuple[str, nn.Module]]:
    """``(key, module)`` of the called modules that hold parameter arrays of their own, in call order."""
    params = abstract_variables(model)["params"]

    def own_arrays(key: str) -> bool:
        node = params
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return isinstance(node, dict) and any(not isinstance(v, dict) for v in node.values())

    return [(key, module) for key, module in _called_modules(model) if own_arrays(key)]


def all_layers(model) -> list[tuple[str, str]]:
    """``(key, module type)`` of every submodule a forward pass calls (for error messages)."""
    return [(key, type(module).__name__) for key, module in _called_modules(model)]


def no_adaptable_layers(algorithm: str, model):
    """The one-line ConfigError of a low-rank algorithm that finds no layer to adapt: it names the
    model's layers, so the user sees what was there."""
    from jaxfed.errors import ConfigError

    found = ", ".join(f"{key} ({kind})" for key, kind in all_layers(model)) or "none"
    return ConfigError(
        f"{algorithm}: the model has no nn.Dense / nn.Conv layer to adapt (2-D kernels only); its layers: {found}"
    )


def choose_layers(model, layers, algorithm: str, field: str = "layers") -> list[str]:
    """The layers a low-rank algorithm adapts: ``layers`` (keys; each must be a Dense / Conv layer
    the forward pass calls) or, when empty, :func:`interior_layers`; one-line ConfigErrors."""
    from jaxfed.errors import ConfigError

    available = layers_in_call_order(model)
    keys = [key.strip() for key in layers if key.strip()] or interior_layers(model)
    if not keys:
        raise no_adaptable_layers(algorithm, model)
    unknown = [key for key in keys if key not in available]
    if unknown:
        raise ConfigError(
            f"{field}: {', '.join(unknown)} not Dense/Conv layers of the model; allowed: {', '.join(available)}"
        )
    return keys


def dense(layer, x):
    """A Dense layer's outputs for ``x`` from its parameters: ``x @ kernel + bias``."""
    return x @ layer["kernel"] + layer["bias"]
