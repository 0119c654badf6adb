"""Flax models by config name, and :class:`Model`: the pure ``init`` / ``apply`` pair algorithms use.

Every module here ends in a Dense layer named ``head`` (the classifier) and can return the
features that feed it (``features=True``). Algorithms take any Flax module through
:class:`Model`, which needs none of that. Normalization is
GroupNorm by default; with ``norm="batch"`` BatchNorm statistics live in the model's
``batch_stats`` collection, which algorithms keep as client state. BatchNorm takes the batch
mask, so padded examples never enter the statistics.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.errors import ConfigError, channels_first, first_line, unknown_choice
from jaxfed.nn import user
from jaxfed.nn.conv import CONV_IMPLS, Conv, max_pool_2x2
from jaxfed.nn.traced import abstract_variables, once_per_model

NORMS = ("group", "batch")
GROUPS = 2


class Norm(nn.Module):
    kind: str = "group"

    @nn.compact
    def __call__(self, x, train: bool, mask=None):
        if self.kind == "batch":
            bn_mask = None if mask is None else mask.reshape(mask.shape + (1,) * (x.ndim - 1))
            return nn.BatchNorm(use_running_average=not train, momentum=0.9)(x, mask=bn_mask)
        return nn.GroupNorm(num_groups=min(GROUPS, x.shape[-1]))(x)


class MLP(nn.Module):
    """ReLU layers of widths ``hidden`` then the head; the default is McMahan et al.'s 2NN."""

    num_classes: int
    hidden: Sequence[int] = (200, 200)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None, features: bool = False):
        h = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.hidden):
            h = nn.relu(nn.Dense(width, name=f"fc{i + 1}")(h))
        return h if features else nn.Dense(self.num_classes, name="head")(h)


class Linear(nn.Module):
    """One Dense layer (``head``): linear regression / multinomial logistic regression."""

    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None, features: bool = False):
        h = x.reshape(x.shape[0], -1)
        return h if features else nn.Dense(self.num_classes, name="head")(h)


class CNN(nn.Module):
    """The CNN of McMahan et al.'s FedAvg paper (PFLlib's FedAvgCNN), VALID padding."""

    num_classes: int
    conv: str = "patches"

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None, features: bool = False):
        h = max_pool_2x2(nn.relu(Conv(32, (5, 5), padding="VALID", impl=self.conv, name="conv1")(x)))
        h = max_pool_2x2(nn.relu(Conv(64, (5, 5), padding="VALID", impl=self.conv, name="conv2")(h)))
        h = nn.relu(nn.Dense(512, name="fc1")(h.reshape(h.shape[0], -1)))
        return h if features else nn.Dense(self.num_classes, name="head")(h)


class CNN4(nn.Module):
    """FedARA's homogeneous 4-layer CNN. The paper gives no layer table; ours: four 3x3 SAME convs
    (32, 64, 128, 256), each ReLU + 2x2 max-pool, global average pool, then the head."""

    num_classes: int
    widths: Sequence[int] = (32, 64, 128, 256)
    conv: str = "patches"

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None, features: bool = False):
        h = x
        for i, width in enumerate(self.widths):
            h = nn.relu(Conv(width, (3, 3), padding="SAME", impl=self.conv, name=f"conv{i + 1}")(h))
            h = max_pool_2x2(h, padding="SAME")
        h = h.mean(axis=(1, 2))
        return h if features else nn.Dense(self.num_classes, name="head")(h)


class HtCNN(nn.Module):
    """The heterogeneous CNNs of Yi et al. (FedGH, pFedES, pFedAFM; FedARA's CNN1-CNN5): two
    convs (``channels``, 5x5 VALID, each ReLU + 2x2 max-pool), two ReLU Dense layers (``hidden``)
    and the head. ``htcnn1``..``htcnn5`` differ only in conv2's filters and fc1's width, so each
    nests in ``htcnn1`` and all five give the head 500 features."""

    num_classes: int
    channels: Sequence[int] = (16, 32)
    hidden: Sequence[int] = (2000, 500)
    kernel: int = 5
    padding: str = "VALID"
    conv: str = "patches"

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None, features: bool = False):
        h = x
        for i, width in enumerate(self.channels):
            layer = Conv(width, (self.kernel, self.kernel), padding=self.padding, impl=self.conv, name=f"conv{i + 1}")
            h = max_pool_2x2(nn.relu(layer(h)))
        h = h.reshape(h.shape[0], -1)
        for i, width in enumerate(self.hidden):
            h = nn.relu(nn.Dense(width, name=f"fc{i + 1}")(h))
        return h if features else nn.Dense(self.num_classes, name="head")(h)


# Yi et al.'s CNN-1..CNN-5 as (conv channels, hidden widths)
HTCNN = {
    "htcnn1": ((16, 32), (2000, 500)),
    "htcnn2": ((16, 16), (2000, 500)),
    "htcnn3": ((16, 32), (1000, 500)),
    "htcnn4": ((16, 32), (800, 500)),
    "htcnn5": ((16, 32), (500, 500)),
}


class BasicBlock(nn.Module):
    width: int
    stride: int
    norm: str
    conv: str = "patches"

    @nn.compact
    def __call__(self, x, train: bool, mask=None):
        h = Conv(
            self.width, (3, 3), (self.stride, self.stride), padding="SAME", use_bias=False, impl=self.conv, name="conv1"
        )(x)
        h = nn.relu(Norm(self.norm, name="norm1")(h, train, mask))
        h = Conv(self.width, (3, 3), padding="SAME", use_bias=False, impl=self.conv, name="conv2")(h)
        h = Norm(self.norm, name="norm2")(h, train, mask)
        if self.stride != 1 or x.shape[-1] != self.width:
            x = Conv(self.width, (1, 1), (self.stride, self.stride), use_bias=False, impl=self.conv, name="shortcut")(x)
            x = Norm(self.norm, name="shortcut_norm")(x, train, mask)
        return nn.relu(h + x)


class ResNet(nn.Module):
    """CIFAR-style ResNet (3x3 stem, no stem pooling) of basic blocks; stages named layer1..layerN."""

    num_classes: int
    blocks: Sequence[int]
    widths: Sequence[int]
    norm: str = "group"
    conv: str = "patches"

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None, features: bool = False):
        h = Conv(self.widths[0], (3, 3), padding="SAME", use_bias=False, impl=self.conv, name="stem")(x)
        h = nn.relu(Norm(self.norm, name="stem_norm")(h, train, mask))
        for stage, (count, width) in enumerate(zip(self.blocks, self.widths)):
            for j in range(count):
                stride = 2 if stage > 0 and j == 0 else 1
                h = BasicBlock(width, stride, self.norm, self.conv, name=f"layer{stage + 1}_{j}")(h, train, mask)
        h = h.mean(axis=(1, 2))
        return h if features else nn.Dense(self.num_classes, name="head")(h)


class VGG8(nn.Module):
    """A small VGG: five 3x3 convs (32, 64, 128, 128, 256) with max-pools, two Dense 256, the head."""

    num_classes: int
    norm: str = "group"
    conv: str = "patches"
    plan: Sequence[Any] = (32, "M", 64, "M", 128, 128, "M", 256, "M")

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None, features: bool = False):
        h, conv = x, 0
        for item in self.plan:
            if item == "M":
                h = max_pool_2x2(h, padding="SAME")
            else:
                conv += 1
                h = Conv(item, (3, 3), padding="SAME", use_bias=False, impl=self.conv, name=f"conv{conv}")(h)
                h = nn.relu(Norm(self.norm, name=f"norm{conv}")(h, train, mask))
        h = h.reshape(h.shape[0], -1)
        h = nn.relu(nn.Dense(256, name="fc1")(h))
        h = nn.relu(nn.Dense(256, name="fc2")(h))
        return h if features else nn.Dense(self.num_classes, name="head")(h)


def _resnet(blocks, widths):
    return lambda num_classes, norm, conv: ResNet(num_classes, blocks=blocks, widths=widths, norm=norm, conv=conv)


# The built-ins with normalization layers: the ones ``norm`` applies to
NORMED_MODELS = ("resnet8", "resnet10", "resnet18", "vgg8")

# name -> constructor(num_classes, norm, conv implementation)
MODELS: dict[str, Callable[[int, str, str], nn.Module]] = {
    "linear": lambda num_classes, norm, conv: Linear(num_classes),
    "mlp": lambda num_classes, norm, conv: MLP(num_classes),
    "cnn": lambda num_classes, norm, conv: CNN(num_classes, conv=conv),
    "cnn4": lambda num_classes, norm, conv: CNN4(num_classes, conv=conv),
    "resnet8": _resnet((1, 1, 1), (16, 32, 64)),
    "resnet10": _resnet((1, 1, 1, 1), (64, 128, 256, 512)),
    "resnet18": _resnet((2, 2, 2, 2), (64, 128, 256, 512)),
    "vgg8": lambda num_classes, norm, conv: VGG8(num_classes, norm=norm, conv=conv),
    **{
        name: functools.partial(lambda c, h, num_classes, norm, conv: HtCNN(num_classes, c, h, conv=conv), c, h)
        for name, (c, h) in HTCNN.items()
    },
}


class Model(NamedTuple):
    """Any Flax module behind two pure functions on Flax variable dicts.

    The module's ``__call__(x)`` may also take ``train`` (BatchNorm, dropout), ``mask`` (the
    batch's real examples) and ``features`` (return the head's input): each is passed only when
    the signature has it. ``Model(name, module, input_shape)``, or ``Model.wrap(module, shape)``;
    ``input_dtype`` for inputs that are not float32 (token ids for an ``nn.Embed``).
    """

    name: str
    module: nn.Module
    input_shape: tuple[int, ...]
    input_dtype: Any = jnp.float32

    @classmethod
    def wrap(cls, module: nn.Module, input_shape, name: str = "", input_dtype=jnp.float32) -> Model:
        """A :class:`Model` of ``module`` (an instance) for examples of ``input_shape`` (no batch axis)."""
        check_instance(module)
        return cls(name or type(module).__name__, module, tuple(input_shape), input_dtype)

    def accepts(self, argument: str) -> bool:
        """Whether the module's ``__call__`` takes the keyword ``argument``."""
        return _call_accepts(type(self.module), argument)

    def _keywords(self, **wanted) -> dict:
        if wanted.get("features") and not self.accepts("features"):
            raise ValueError(f"model {self.name}: __call__ has no 'features' argument; use jaxfed.nn.layers.head_input")
        return {k: v for k, v in wanted.items() if self.accepts(k) and (v is not None or k == "mask")}

    def init(self, rng) -> dict:
        """Variables ``{"params": ..., ["batch_stats": ...]}`` for one example shape."""
        return self.module.init(
            rng, jnp.zeros((1,) + self.input_shape, self.input_dtype), **self._keywords(train=False)
        )

    def apply(self, variables, x, *, train: bool = False, mask=None, features: bool = False, rng=None):
        """``(outputs, model_state)``: outputs (or features) and the updated non-param collections.
        ``rng``: in training, the key of the module's ``"dropout"`` stream (a fresh one each step)."""
        keywords = self._keywords(train=train, mask=mask, features=features)
        if train and rng is not None:
            keywords["rngs"] = {"dropout": rng}
        state = {k: v for k, v in variables.items() if k != "params"}
        if train and state:
            out, new_state = self.module.apply(variables, x, **keywords, mutable=list(state))
            return out, dict(new_state)
        return self.module.apply(variables, x, **keywords), state


@functools.cache
def _call_accepts(module_type: type, argument: str) -> bool:
    parameters = inspect.signature(module_type.__call__).parameters
    return argument in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def split_variables(variables: dict):
    """``(params, model_state)`` of a Flax variables dict (``model_state``: the non-param
    collections, e.g. BatchNorm statistics; ``{}`` when there are none)."""
    return variables["params"], {k: v for k, v in variables.items() if k != "params"}


def model_template(model):
    """``(params, model_state)`` of ``model``'s variables as shapes (``jax.ShapeDtypeStruct``),
    without computing them: what an algorithm sizes its states and factors by."""
    return split_variables(abstract_variables(model))


def built_in_setting(model: Model, name: str, allowed, default: str) -> str:
    """``model``'s module's ``name`` attribute (a built-in model's ``norm`` or ``conv``) where it is
    one of ``allowed``, else ``default``: what a model the library builds beside it (a tier's, an
    algorithm's own) runs with, whatever a user's module means by that attribute."""
    value = getattr(model.module, name, default)
    return value if value in allowed else default


def check_model_name(name: str) -> None:
    """A one-line ConfigError unless ``name`` is a built-in model or has a user's module's form."""
    if user.is_spec(name) or name in MODELS:
        return
    if str(name).endswith(".py"):  # a file without its class
        raise ConfigError(f"model: '{name}' names a file, not its class; write {name}:ClassName")
    raise ConfigError(f"model: {unknown_choice(name, MODELS)}, or {user.FORMS}")


def get_model(
    name: str, input_shape, num_classes: int, norm: str = "group", conv: str = "patches", hidden=None
) -> Model:
    """The model ``name`` for inputs of ``input_shape`` (HWC); a clear error if it cannot fit them.

    ``name`` is a built-in (:data:`MODELS`) or a user's Flax module, ``module:Class`` or
    ``path/to/file.py:Class`` (:mod:`jaxfed.nn.user`; the model is named by that spec).
    ``num_classes`` is the output size (the number of targets for a regression task). ``conv``
    picks the convolution implementation (see :mod:`jaxfed.nn.conv`); ``hidden`` the hidden
    widths of ``mlp`` (default 200, 200). ``norm`` and ``conv`` apply to the built-ins only."""
    check_model_name(name)
    if norm not in NORMS:
        raise ConfigError(f"norm: {unknown_choice(norm, NORMS)}")
    if conv not in CONV_IMPLS:
        raise ConfigError(f"conv: {unknown_choice(conv, CONV_IMPLS)}")
    shown = user.label(name) if user.is_spec(name) else name
    if hidden is not None and name != "mlp":
        raise ConfigError(f"mlp_hidden: applies to model mlp only, not '{shown}'")
    if norm != "group" and name not in NORMED_MODELS:  # it would be ignored: a run the user thinks normalized
        raise ConfigError(
            f"norm: {norm} applies to the built-in models with normalization layers ({', '.join(NORMED_MODELS)}), "
            f"not '{shown}'"
        )
    if user.is_spec(name):
        model = Model(name, user.construct(name, num_classes), tuple(input_shape))
        _check_fits(model, f"'{user.label(name)}'", num_classes)
        return model
    module = MLP(num_classes, tuple(hidden)) if hidden is not None else MODELS[name](num_classes, norm, conv)
    model = Model(name, module, tuple(input_shape))
    _check_fits(model, f"'{name}'")
    return model


def _image_layout_hint(input_shape: tuple) -> str:
    """How to fix inputs that look like images in a layout no built-in takes (data from Python)."""
    if len(input_shape) == 2:
        return ", or give the images a channel axis: x[..., None] (channels last, (N, H, W, 1))"
    if channels_first(input_shape):
        return ", or give the images channels last: x.transpose(0, 2, 3, 1)"
    return ""


def check_instance(module) -> None:
    """A ConfigError for a module class given where its instance is needed (``Model.wrap(Net, ...)``)."""
    if isinstance(module, type):
        raise ConfigError(
            f"model: got the class {module.__name__}, not a module; pass an instance: "
            f"Model.wrap({module.__name__}(), ...)"
        )


def check_data_fits(model: Model, example_shape: tuple, example_dtype, outputs: int) -> None:
    """What :class:`~jaxfed.simulation.Simulation` checks of a :class:`Model` and its data before
    anything compiles: :func:`_check_fits` for examples of ``example_shape`` and ``example_dtype``
    and ``outputs`` outputs (classes, or targets of a regression), and a warning for a model that
    takes images channels first (Flax's convolutions take them channels last; a model may
    transpose them itself, so it is not refused)."""
    if channels_first(model.input_shape):
        warnings.warn(
            f"model: '{model.name}' takes inputs of shape {model.input_shape}, images with their channels first "
            "(C, H, W) by the look of them; Flax convolutions take channels last (H, W, C): give the data "
            "x.transpose(0, 2, 3, 1) and wrap the model for that shape, unless the model transposes them itself",
            stacklevel=3,
        )
    _data_fits(model, tuple(example_shape), np.dtype(example_dtype), outputs)


@once_per_model  # a model and data seen before fit
def _data_fits(model: Model, example_shape: tuple, example_dtype, outputs: int) -> None:
    hint = "the data's num_classes, or its targets per example in a regression"
    _check_fits(model, f"'{model.name}'", outputs, example_shape, example_dtype, hint)


def _check_fits(
    model: Model,
    shown: str,
    num_classes: int | None = None,
    example_shape: tuple | None = None,
    example_dtype=None,
    outputs_hint: str = "give the class a num_classes field",
) -> None:
    """A ConfigError when ``model`` cannot take its input shape, cannot take examples of
    ``example_shape`` (where given: the data's, which may differ from the model's input shape in
    a model that takes both), or (where ``num_classes`` is given) does not give one output per
    class (``outputs_hint``: what to do then); checked on shapes, nothing computed."""
    check_instance(model.module)
    example_shape = model.input_shape if example_shape is None else example_shape
    x = jax.ShapeDtypeStruct((1,) + example_shape, example_dtype or model.input_dtype)
    applied = num_classes is not None or example_shape != model.input_shape
    try:
        variables = abstract_variables(model)
    except Exception as err:  # shape errors from Flax/XLA for inputs the model cannot take
        _cannot_take(model, shown, err, num_classes is not None)
    try:
        out = jax.eval_shape(lambda v, x: model.apply(v, x)[0], variables, x) if applied else None
    except Exception as err:  # Flax's ScopeParamShapeError for another shape
        data_dtype, model_dtype = np.dtype(x.dtype), np.dtype(model.input_dtype)
        if data_dtype != model_dtype:  # e.g. float token ids for an Embed: the data's dtype is the problem
            raise ConfigError(
                f"model: {shown} takes {model_dtype} inputs but the data's examples are {data_dtype} "
                f"({type(err).__name__}: {first_line(err, 100)}); cast them: x.astype(np.{model_dtype})"
            ) from None
        if example_shape == model.input_shape:
            _cannot_take(model, shown, err, num_classes is not None)
        raise ConfigError(
            f"model: {shown} was made for inputs of shape {model.input_shape} but the data's examples have shape "
            f"{example_shape}; wrap it for the data's: "
            "Model.wrap(module, dataset.input_shape)"
        ) from None
    if num_classes is not None and (not hasattr(out, "shape") or out.shape != (1, num_classes)):
        got = out.shape if hasattr(out, "shape") else type(out).__name__
        raise ConfigError(
            f"model: {shown} returns {got} for a batch of 1; expected (1, {num_classes}) (one output per class: "
            f"{outputs_hint})"
        )


# Flax's errors for a layer stuck in training mode where jaxfed initializes and evaluates a model
# (its __call__ takes no ``train``, or ignores it): the layer they come from
_TRAINING_MODE = {
    "InvalidRngError": "a layer that asks for an rng (a Dropout)",
    "ModifyScopeVariableError": "a BatchNorm",
}


def _cannot_take(model: Model, shown: str, err: Exception, with_reason: bool):
    reason = f"{type(err).__name__}: {first_line(err, 120)}" if with_reason else type(err).__name__
    if type(err).__name__ in _TRAINING_MODE:
        raise ConfigError(
            f"model: {shown} runs {_TRAINING_MODE[type(err).__name__]} in training mode where jaxfed initializes "
            "and evaluates it: give its __call__ a train argument and pass it on (nn.Dropout(rate, deterministic="
            f"not train), nn.BatchNorm(use_running_average=not train)) ({type(err).__name__})"
        ) from None
    raise ConfigError(
        f"model: {shown} cannot take inputs of shape {model.input_shape} ({reason}); pick another model"
        + _image_layout_hint(model.input_shape)
    ) from None


class Mixture(NamedTuple):
    """``C`` copies of ``member`` whose outputs are mixed: ``sum_c w_c f_c(x)`` (FLoRAL's ensemble).

    Variables: ``{"params": {"members": member params stacked [C, ...], "weights": [C]}}`` plus
    the member's non-param collections stacked along the same leading axis."""

    member: Model

    @property
    def name(self) -> str:
        return f"mixture of {self.member.name}"

    def apply(self, variables, x, *, train: bool = False, mask=None, features: bool = False, rng=None):
        if features:
            raise ValueError("a Mixture has no single feature vector; apply its member instead")
        params = variables["params"]
        state = {k: v for k, v in variables.items() if k != "params"}

        def one(member_params, member_state, member_rng):
            variables = {"params": member_params, **member_state}
            return self.member.apply(variables, x, train=train, mask=mask, rng=member_rng)

        count = jax.tree.leaves(params["members"])[0].shape[0]
        rngs = None if rng is None else jax.random.split(rng, count)
        outputs, new_state = jax.vmap(one, in_axes=(0, 0, None if rng is None else 0))(params["members"], state, rngs)
        mixed = jnp.tensordot(params["weights"].astype(outputs.dtype), outputs, axes=1)
        return mixed, new_state
