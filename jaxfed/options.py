"""Typed, documented options: the base of every algorithm's options and of the run's settings.

An options class is a frozen dataclass whose fields are declared with :func:`option`: a default,
a help line, where the default comes from (``source``: a paper's section or table, or the
authors' code) and a check. Validation is declarative and lives here, once::

    @dataclasses.dataclass(frozen=True)
    class ScaffoldOptions(TrainingOptions):
        server_lr: float = option(1.0, "global step size eta_g", source="Karimireddy et al. Alg. 1", check=positive)

``Options.validate()`` runs every field's check (then the class's own ``check()`` for rules
that span fields) and raises :class:`~jaxfed.errors.ConfigError` naming the field and what it
allows. Checks skip traced values, so a sweep can trace ``lr`` through the same options.
``parse(key, text)`` turns a ``--set`` string into the field's type (int, float, bool, str or a
tuple of them, written comma-separated).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import typing
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from jaxfed.errors import ConfigError, clip, unknown_choice

Check = Callable[[Any], "str | None"]  # None when the value is allowed, else what is allowed
CHECK_SIGNATURE = "check(value) -> str | None (None: allowed; else what is wrong, e.g. 'must be >= 0')"
LR_SCHEDULES = ("constant", "cosine")
CLIENT_OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
CLIENT_OPTIMIZER_HELP = (
    "client optimizer: sgd (with momentum when momentum > 0, as torch's SGD), momentum (sgd that needs "
    "momentum > 0), adam or adamw (optax's b1 0.9, b2 0.999, eps 1e-8; adamw's weight decay is decoupled); "
    "its state starts fresh every round"
)


def option(default, help: str, *, source: str = "", check: Check | None = None):
    """A documented options field: ``default``, one ``help`` line, the ``source`` of the default
    and a ``check`` (e.g. :func:`positive`, :func:`one_of`)."""
    return dataclasses.field(default=default, metadata={"help": help, "source": source, "check": check})


# ----- checks ------------------------------------------------------------------------------------


def _finite(value) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def finite(value):
    return None if _finite(value) else "must be a finite number"


def positive(value):
    if not _finite(value):
        return "must be a finite number > 0"
    return None if value > 0 else "must be > 0"


def non_negative(value):
    if not _finite(value):
        return "must be a finite number >= 0"
    if _too_large(value):
        return f"must be in 0..{INT32_MAX}"
    return None if value >= 0 else "must be >= 0"


INT32_MAX = 2**31 - 1  # counts reach compiled code as int32: a larger one overflows inside jit


def _too_large(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > INT32_MAX


def at_least(low: int) -> Check:
    def check(value):
        if _too_large(value):
            return f"must be in {low}..{INT32_MAX}"
        return None if value >= low else f"must be >= {low}"

    return check


def ratio(value):
    return None if 0 < value <= 1 else "must be in (0, 1]"


def momentum_coefficient(value):
    if not _finite(value):
        return "must be a finite number in [0, 1)"
    return None if 0 <= value < 1 else "must be in [0, 1) (1 or more never forgets a gradient and diverges)"


def rank_ratio(value):
    return None if 0 < value <= 1 else "a rank ratio must be in (0, 1]"


def unit_interval(value):
    return None if 0 <= value < 1 else "must be in [0, 1)"


def weight_share(value):
    """A check: a weight of one term against its complement (``w A + (1 - w) B``), in [0, 1]."""
    return None if 0 <= value <= 1 else "must be in [0, 1]"


def one_of(*allowed: str) -> Check:
    def check(value):
        return None if value in allowed else unknown_choice(value, allowed)

    check.allowed = allowed
    return check


def each(check: Check) -> Check:
    """A check applied to every element of a tuple (e.g. rank ratios)."""

    def check_all(values):
        for value in values:
            problem = check(value)
            if problem:
                every = problem[2:] if problem.startswith("a ") else f"element {problem}"
                shown = _show(float(value) if isinstance(value, int) else value)
                return f"every {every}, got {shown} in '{_show(values)}'"
        return None

    return check_all


# ----- the base class ----------------------------------------------------------------------------


TASKS = ("classification", "regression")


class DatasetDefaults(typing.NamedTuple):
    """Defaults that replace an options class's own on one dataset (``{key: value}``), with
    where they come from: e.g. the authors' CIFAR-10 recipe where it differs from their MNIST one."""

    values: dict[str, Any]
    source: str


@dataclasses.dataclass(frozen=True)
class Options:
    """Base of every options class (see the module docstring). ``tasks`` names the tasks an
    algorithm can run (FedARA's class anchors: classification only); ``dataset_defaults`` maps a
    dataset to the :class:`DatasetDefaults` its runs start from (see :meth:`for_dataset`)."""

    tasks: typing.ClassVar[tuple[str, ...]] = TASKS
    dataset_defaults: typing.ClassVar[dict[str, DatasetDefaults]] = {}

    @classmethod
    def for_dataset(cls, dataset: str):
        """The defaults for a run on ``dataset``: the class's own, with that dataset's
        :attr:`dataset_defaults` applied where it has any."""
        recipe = cls.dataset_defaults.get(dataset)
        return cls().with_values(recipe.values) if recipe else cls()

    def rebased(self, old_dataset: str, new_dataset: str):
        """These options moved from ``old_dataset``'s defaults to ``new_dataset``'s: every value
        that differs from ``old_dataset``'s defaults (what a user set) is kept, the rest follow
        the new dataset."""
        if old_dataset == new_dataset:
            return self
        old = type(self).for_dataset(old_dataset)
        changed = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not _same(getattr(self, f.name), getattr(old, f.name))
        }
        return dataclasses.replace(type(self).for_dataset(new_dataset), **changed)

    def check(self) -> None:
        """Rules that span several fields; raise :class:`ConfigError`. Override where needed."""

    def validate(self):
        """Raise :class:`ConfigError` on the first invalid field; return self otherwise. An
        instance is checked once (it is frozen): validating it again, as each layer it passes
        through may, costs nothing."""
        if self.__dict__.get("_validated"):
            return self
        check_declarations(type(self))
        kinds = field_types(type(self))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not _traced(value):
                _check_field(type(self), field.name, value, kinds.get(field.name))
        self.check()
        object.__setattr__(self, "_validated", True)
        return self

    @classmethod
    def keys(cls) -> list[str]:
        """The keys users write (``--set``): field names without a trailing underscore."""
        return [key_of(f.name) for f in dataclasses.fields(cls)]

    @classmethod
    def describe(cls) -> list[tuple[str, Any, str, str]]:
        """``(key, default, help, source)`` of every field; a field with per-dataset defaults
        says so after its help (``cifar10: 0.03``) and names their source."""
        rows = []
        for f in dataclasses.fields(cls):
            help_, source = f.metadata.get("help", ""), f.metadata.get("source", "")
            others = [(name, d) for name, d in cls.dataset_defaults.items() if f.name in d.values]
            if others:
                help_ += " (" + "; ".join(f"{name}: {_show(d.values[f.name])}" for name, d in others) + ")"
                source = "; ".join([source, *(f"{name}: {d.source}" for name, d in others)])
            rows.append((key_of(f.name), f.default, help_, source))
        return rows

    @classmethod
    def field_for(cls, key: str) -> dataclasses.Field | None:
        """The field a user key names (``lambda`` is the field ``lambda_``), or None."""
        for f in dataclasses.fields(cls):
            if key in (f.name, key_of(f.name)):
                return f
        return None

    @classmethod
    def parse(cls, key: str, text: str):
        """``text`` (a ``--set`` value) as the type of the field ``key`` names."""
        field = cls.field_for(key)
        return parse_value(key, text, field_types(cls)[field.name])

    @classmethod
    def parse_checked(cls, key: str, text: str):
        """:meth:`parse`, and the field's own check on the value (:meth:`validate`'s, alone)."""
        value = cls.parse(key, text)
        name = cls.field_for(key).name
        _check_field(cls, name, value, field_types(cls)[name])
        return value

    def with_values(self, values: dict[str, Any]):
        """A copy with ``{key: value}`` applied (values already typed, or strings to parse)."""
        changes = {}
        for key, value in values.items():
            field = self.field_for(key)
            if field is None:
                raise ConfigError(f"unknown option '{key}' of {type(self).__name__}")
            changes[field.name] = self.parse(key, value) if isinstance(value, str) else _typed(self, field, value)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """``{key: value}`` (JSON-ready: tuples become lists)."""
        return {key_of(f.name): _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def defaults_dict(cls) -> dict[str, Any]:
        """:meth:`to_dict` of the class's defaults, for the fields that have one (a research
        code's options class may declare a field without a default)."""
        defaults = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                defaults[key_of(f.name)] = _jsonable(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                defaults[key_of(f.name)] = _jsonable(f.default_factory())
        return defaults

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        """The inverse of :meth:`to_dict` (unknown keys are an error)."""
        return cls().with_values(values)


def _check_field(cls, name: str, value, kind) -> None:
    """A ConfigError naming the key when ``value`` is not of field ``name``'s type or fails its check."""
    check = field_check(cls, name)
    problem = type_problem(value, kind) or (check(value) if check else None)
    if problem:
        named = f"'{value}'" in problem or ", got " in problem  # the message names the value already
        raise ConfigError(f"{key_of(name)}: {problem}" + ("" if named else f", got {_show(value)}"))


@functools.cache
def check_declarations(cls) -> None:
    """A ConfigError naming ``Class.key`` for a field whose ``check`` cannot be called as
    ``check(value)``, or whose default (the class's own) fails its type or its check: mistakes of
    the options class, not of its user (checked once per class: ``register`` and :meth:`Options.validate`)."""
    kinds = field_types(cls)
    for field in dataclasses.fields(cls):
        where = f"{cls.__name__}.{key_of(field.name)}"
        check = field_check(cls, field.name)
        if check is not None and not _takes_one_value(check):
            shown = f"{getattr(check, '__name__', type(check).__name__)}{_signature(check)}"
            raise ConfigError(f"{where}: its check {shown} must take the value alone: {CHECK_SIGNATURE}")
        if field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING:
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            problem = type_problem(default, kinds.get(field.name)) or (check(default) if check else None)
            if problem:
                raise ConfigError(
                    f"{where}: the default {_show(default)} the options class declares fails its own check "
                    f"({problem}); declare an allowed default"
                )


def _takes_one_value(check) -> bool:
    if not callable(check):
        return False
    try:
        inspect.signature(check).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a C function): trusted
        return True
    return True


def _signature(check) -> str:
    try:
        return str(inspect.signature(check))
    except (TypeError, ValueError):
        return ""


@functools.cache
def field_check(cls, name: str) -> Check | None:
    """The check of field ``name``: its own, or (a subclass that only changes a default) the
    nearest base class's."""
    for klass in cls.__mro__:
        fields = getattr(klass, "__dataclass_fields__", {})
        if name in fields and fields[name].metadata.get("check") is not None:
            return fields[name].metadata["check"]
    return None


def key_of(name: str) -> str:
    """The key users write for the field ``name`` (``--set``, config files, ``config.json``,
    ``jaxfed list``): the name without its trailing underscore. An option named by a Python
    keyword is declared with one (``lambda_``, ``global_``, ``in_``, as PEP 8 has it) and written
    without (``--set lambda=0.5``); :meth:`Options.field_for` maps a key back to its field."""
    return name.rstrip("_")


@functools.cache
def field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_value(key: str, text: str, kind):
    """A string as ``kind``: int, float, bool, str, or ``tuple[T, ...]`` written comma-separated."""
    text = text.strip()
    if typing.get_origin(kind) is tuple:
        (element, *_) = typing.get_args(kind)
        if not text:
            return ()
        return tuple(parse_value(key, part, element) for part in text.split(","))
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        return text
    except ValueError:
        raise ConfigError(f"{key}: expected {getattr(kind, '__name__', kind)}, got '{clip(text)}'") from None


def type_problem(value, kind) -> str | None:
    """What is wrong with ``value``'s type for a field of type ``kind`` (None when it fits): a
    value set from Python (``Config(rounds="2")``) is checked as ``--set`` text is parsed."""
    if typing.get_origin(kind) is tuple:
        (element, *_) = typing.get_args(kind)
        if not isinstance(value, tuple):
            return f"expected a tuple of {element.__name__}, got {clip(repr(value))} ({type(value).__name__})"
        wrong = next((type_problem(v, element) for v in value if type_problem(v, element)), None)
        return wrong
    expected = {bool: (bool, np.bool_), int: numbers.Integral, float: numbers.Real, str: str}.get(kind)
    if expected is None:
        return None
    fits = isinstance(value, expected) and (kind is bool or not isinstance(value, (bool, np.bool_)))
    return None if fits else f"expected {kind.__name__}, got {clip(repr(value))} ({type(value).__name__})"


def _typed(options, field, value):
    """A JSON value (lists for tuples) as the field's type; other values unchanged."""
    kind = field_types(type(options))[field.name]
    if typing.get_origin(kind) is tuple and isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


def _traced(value) -> bool:
    return isinstance(value, jax.core.Tracer)


def _same(a, b) -> bool:
    """Equal values (a traced value is never the same as a default: a sweep set it)."""
    return a is b or (not _traced(a) and not _traced(b) and type(a) is type(b) and a == b)


def _show(value) -> str:
    if isinstance(value, tuple):
        return clip(",".join(str(v) for v in value))
    return clip(repr(value) if isinstance(value, str) else str(value))


# ----- local training: the fields every algorithm that trains on clients shares ----------------


@dataclasses.dataclass(frozen=True)
class LocalTraining(Options):
    """Client training (each algorithm's options subclass this, overriding the defaults its paper
    states). ``optimizer()`` is the optax transformation they describe, made by
    :func:`client_optimizer`."""

    batch_size: int = option(32, "local batch size", source="jaxfed default", check=at_least(1))
    lr: float = option(
        0.05, "client learning rate (0 freezes the model)", source="jaxfed default", check=non_negative
    )  # 0 is a legitimate experiment (evaluate the initialization); negative or non-finite is not
    client_optimizer: str = option(
        "sgd", CLIENT_OPTIMIZER_HELP, source="the papers' local SGD (jaxfed default)", check=one_of(*CLIENT_OPTIMIZERS)
    )
    momentum: float = option(
        0.0,
        "client SGD momentum, in [0, 1) (sgd and momentum only)",
        source="jaxfed default",
        check=momentum_coefficient,
    )
    weight_decay: float = option(
        0.0,
        "client weight decay: added to the gradient (sgd, momentum, adam), decoupled (adamw)",
        source="jaxfed default",
        check=non_negative,
    )
    drop_last: bool = option(False, "drop each client's last partial batch (PFLlib's convention)")
    lr_schedule: str = option(
        "constant",
        "learning rate over rounds: constant, or cosine (optax.cosine_decay_schedule from lr at round 0 to "
        "lr_min at round lr_decay_rounds, lr_min after)",
        source="jaxfed default",
        check=one_of(*LR_SCHEDULES),
    )
    lr_min: float = option(0.0, "cosine: the learning rate it decays to", source="jaxfed default", check=non_negative)
    lr_decay_rounds: int = option(100, "cosine: rounds from lr to lr_min", source="jaxfed default", check=at_least(1))
    clip_norm: float = option(
        0.0,
        "clip each local gradient to this global norm before the optimizer's step; 0 = off",
        source="jaxfed default",
        check=non_negative,
    )

    def check(self) -> None:
        if self.client_optimizer == "momentum" and not _traced(self.momentum) and self.momentum == 0:
            raise ConfigError(
                "client_optimizer: momentum needs momentum > 0 (e.g. momentum=0.9); with momentum=0 it is sgd"
            )

    def learning_rate(self, round_=None):
        """The client learning rate of round ``round_`` (0-based; None: round 0), from an optax schedule."""
        if self.lr_schedule == "constant" or round_ is None:
            return self.lr
        decay = optax.cosine_decay_schedule(self.lr - self.lr_min, self.lr_decay_rounds)
        return self.lr_min + decay(round_)

    def optimizer(self, round_=None) -> optax.GradientTransformation:
        """The client optimizer at round ``round_``'s learning rate (:func:`client_optimizer` with
        these options' kind, momentum, weight decay and clipping). Local training makes it anew
        every round (and every phase of a round that trains parts in turn): its state never
        outlives one ``fit``."""
        return client_optimizer(
            self.client_optimizer,
            self.learning_rate(round_),
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            clip_norm=self.clip_norm,
        )

    def batching(self) -> dict:
        """The keyword arguments of :func:`jaxfed.algorithms.training.run_epochs` these options set."""
        return {"batch_size": self.batch_size, "drop_last": self.drop_last}


@dataclasses.dataclass(frozen=True)
class TrainingOptions(LocalTraining):
    """:class:`LocalTraining` plus the number of local epochs per round."""

    local_epochs: int = option(2, "local epochs per round", source="jaxfed default", check=at_least(1))

    def batching(self) -> dict:
        return {"epochs": self.local_epochs, **super().batching()}


def client_optimizer(
    kind: str, learning_rate, *, momentum: float = 0.0, weight_decay: float = 0.0, clip_norm: float = 0.0
) -> optax.GradientTransformation:
    """The one constructor of every client optimizer (each parameter group of every algorithm's
    local training: :meth:`LocalTraining.optimizer`, FLoRAL's and the ensemble's routers).

    ``kind`` (:data:`CLIENT_OPTIMIZERS`) at ``learning_rate`` (a number, or a traced scalar in a
    sweep): ``sgd`` and ``momentum`` are ``optax.sgd`` with heavy-ball ``momentum`` when it is
    > 0 (torch's ``SGD``); ``adam`` is ``optax.adam`` and ``adamw`` ``optax.adamw`` at optax's
    defaults (``b1=0.9, b2=0.999, eps=1e-8``). ``weight_decay`` is added to the gradient first
    (torch's ``weight_decay`` of ``SGD`` and ``Adam``), except for ``adamw``, whose decay is
    decoupled (``p <- p - lr (adam_step + weight_decay p)``). ``clip_norm`` > 0 clips each
    gradient to that global norm before anything else."""
    if kind in ("sgd", "momentum"):
        opt = optax.sgd(learning_rate, momentum=momentum or None)
    elif kind == "adam":
        opt = optax.adam(learning_rate)
    elif kind == "adamw":
        opt = optax.adamw(learning_rate, weight_decay=weight_decay)
    else:
        raise ConfigError(f"client_optimizer: {one_of(*CLIENT_OPTIMIZERS)(kind)}")
    if weight_decay and kind != "adamw":
        opt = optax.chain(optax.add_decayed_weights(weight_decay), opt)
    return optax.chain(optax.clip_by_global_norm(clip_norm), opt) if clip_norm else opt


def sgd(lr, momentum: float = 0.0, weight_decay: float = 0.0) -> optax.GradientTransformation:
    """Client SGD (:func:`client_optimizer`'s ``sgd``): optional weight decay added to the
    gradient, optional momentum."""
    return client_optimizer("sgd", lr, momentum=momentum, weight_decay=weight_decay)


def split_keys(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"a, b"`` or ``("a", "b")`` -> ``("a", "b")`` (empty entries dropped)."""
    parts = text.split(",") if isinstance(text, str) else text
    return tuple(p.strip() for p in parts if p.strip())


def resolve(cls: type[Options], options: Options | None = None, overrides: dict[str, Any] | None = None):
    """``options`` (default ``cls()``) with ``overrides`` (``{key: value}``) applied, validated:
    what every algorithm constructor does with its ``(options=None, **overrides)`` arguments."""
    options = cls() if options is None else options
    if not isinstance(options, cls):
        raise TypeError(f"options: expected {cls.__name__}, got {type(options).__name__}")
    if overrides:
        unknown = [k for k in overrides if cls.field_for(k) is None]
        if unknown:
            raise TypeError(f"{cls.__name__} has no option(s) {', '.join(unknown)}; options: {', '.join(cls.keys())}")
        fields = {k: cls.field_for(k) for k in overrides}
        options = dataclasses.replace(options, **{f.name: _typed(options, f, overrides[k]) for k, f in fields.items()})
    return options.validate()
