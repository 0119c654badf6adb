"""The public algorithm registry: a name -> (options class, builder).

A built-in algorithm's module registers it when imported, and this registry imports the module
the first time its name is asked for (``BUILTINS``), so naming one algorithm loads one module.
Research code registers its own the same way and gets the CLI, config files, ``--set``, checkpoints and resume, metrics,
plots and sweeps with no edit to jaxfed::

    @jaxfed.register("scaffold", ScaffoldOptions)
    def build(model, options, config):
        return scaffold(model, options)

A builder takes the model (:class:`jaxfed.nn.Model`), the algorithm's validated options and the
run's :class:`jaxfed.Config` (for run-level facts such as ``num_clusters``), and returns a
:class:`~jaxfed.contract.FederatedAlgorithm`. ``jaxfed run --plugin FILE_OR_MODULE``
imports a module that registers algorithms before the config is read.

An option may not shadow a run-level config key: the run layer lists its keys in ``RUN_KEYS``
when it is imported (``import jaxfed`` does), and ``register`` refuses a clash.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from jaxfed.contract import FederatedAlgorithm
from jaxfed.errors import ConfigError, clip, unknown_choice, where_raised
from jaxfed.options import Options, check_declarations, key_of

Builder = Callable[[Any, Any, Any], Any]  # (model, options, config) -> FederatedAlgorithm


class AlgorithmSpec(NamedTuple):
    name: str
    options: type[Options]
    build: Builder
    summary: str  # one line: what it is (the builder's or the options' docstring's first line)
    module: str = ""  # the module that registered it (research code's; "" for a built-in)
    file: str | None = None  # that module's file, where it has one


_REGISTRY: dict[str, AlgorithmSpec] = {}

# name -> the module (under jaxfed.algorithms) that registers it, in the order `jaxfed list` shows
BUILTINS = {
    "fedavg": "fedavg",
    "fedprox": "fedprox",
    "local": "local",
    "fedlora": "fedloru",
    "fedloru": "fedloru",
    "pfedloru": "fedloru",
    "mfedloru": "fedloru",
    "fedhm": "fedhm",
    "feddecomp": "feddecomp",
    "fedcspack": "fedcspack",
    "fedara": "fedara",
    "floral": "floral",
    "local_adaptor": "floral",
    "ensemble": "ensemble",
    # the papers' personalized-FL baselines
    "fedper": "partial",
    "fedrep": "partial",
    "fedbn": "partial",
    "ditto": "ditto",
    "moon": "regularized",
    "fedntd": "regularized",
    "fedspu": "fedspu",
    "fedrod": "fedrod",
    "fedproto": "fedproto",
    "ifca": "ifca",
    "fedala": "fedala",
    "fedbabu": "fedbabu",
    "pfedlora": "pfedlora",
    "fedamp": "fedamp",
    "fedcac": "fedcac",
    "pfedsd": "regularized",
    "fedas": "fedas",
    "pfedgate": "pfedgate",
    "fedtgp": "fedtgp",
    "fedkd": "fedkd",
    "lg_fedavg": "global_head",
    "fedgh": "global_head",
    "fml": "fml",
    "pfedafm": "pfedafm",
    "pfedes": "pfedes",
}

# What `jaxfed list` shows of each built-in: its group, then (name, one line: what it is, from which paper).
CATALOGUE: dict[str, list[tuple[str, str]]] = {
    "the five papers' methods": [
        ("fedara", "server SVD of the shared extractor per tier, class-anchor alignment (FedARA)"),
        ("fedcspack", "cosine-guided sparse parameter packs, cosine+KL weighted masked mean (FedCSPACK)"),
        ("floral", "a mixture of LoRA adaptors per layer, each client's own softmax router (FLoRAL)"),
        ("feddecomp", "shared full-rank + private low-rank parts, trained alternately (FedDecomp)"),
        ("fedloru", "low-rank client updates accumulated into the global model (FedLoRU)"),
    ],
    "their variants": [
        ("pfedloru", "FedLoRU with a private personal LoRA pair (the FedLoRU paper)"),
        ("mfedloru", "FedLoRU over client tiers of nested ranks (the FedLoRU paper)"),
        ("local_adaptor", "one private adaptor per client (FLoRAL's baseline)"),
        ("ensemble", "C full models mixed by a private router (FLoRAL's baseline)"),
    ],
    "baselines": [
        ("fedavg", "sample-weighted model averaging (McMahan et al. 2017)"),
        ("fedprox", "FedAvg plus a proximal term to the global model (Li et al. 2020)"),
        ("local", "each client trains alone, nothing is sent"),
        ("fedlora", "LoRA client updates of a frozen global model (the FedLoRU paper's baseline)"),
        ("fedhm", "server SVD factors per tier, reconstructed and averaged (Yao et al. 2021)"),
        ("fedper", "the head stays on the client, the base is averaged (Arivazhagan et al. 2019)"),
        ("fedrep", "private head trained first, then the shared body (Collins et al., ICML 2021)"),
        ("fedbn", "normalization layers stay on the client (Li et al., ICLR 2021)"),
        ("ditto", "FedAvg plus a personal model pulled toward it (Li et al., ICML 2021)"),
        ("moon", "FedAvg plus a model-contrastive loss (Li et al., CVPR 2021)"),
        ("fedntd", "FedAvg plus not-true distillation from the global model (Lee et al., NeurIPS 2022)"),
        ("fedspu", "each client trains and sends a random part of its neurons (Niu et al., AAAI 2025)"),
        ("fedrod", "a generic model (balanced softmax) plus a personal head (Chen & Chao, ICLR 2022)"),
        ("fedproto", "private models pulled toward shared class prototypes (Tan et al., AAAI 2022)"),
        ("ifca", "K cluster models, each client trains its best fit (Ghosh et al., NeurIPS 2020)"),
        ("fedbabu", "body trained under a fixed random head; fine-tuned to evaluate (Oh et al. 2022)"),
        ("fedala", "FedAvg from an adaptive local aggregation (Zhang et al., AAAI 2023)"),
        ("pfedlora", "a shared full-rank model plus personal LoRA modules (the FedLoRU paper's baseline)"),
        ("fedamp", "own models pulled toward attentive cloud models (Huang et al., AAAI 2021)"),
        ("fedcac", "critical parameters shared only among similar clients (Wu et al., ICCV 2023)"),
        ("pfedsd", "FedAvg plus self-distillation from the last local model (Jin et al., TPDS 2022)"),
        ("fedas", "global body aligned to local prototypes, Fisher-weighted (Yang et al., CVPR 2024)"),
        ("pfedgate", "a private gating layer scales/prunes the model's blocks (Chen et al., ICML 2023)"),
        ("fedtgp", "trainable global prototypes, adaptive-margin loss (Zhang et al., AAAI 2024)"),
        ("fedkd", "private mentors distil a shared mentee, sent SVD-compressed (Wu et al. 2022)"),
        ("lg_fedavg", "private extractors, the classifier head averaged (Liang et al. 2020)"),
        ("fedgh", "private extractors, a global head trained on their prototypes (Yi et al., MM 2023)"),
        ("fml", "a private model and a shared meme model learn from each other (Shen et al. 2020)"),
        ("pfedafm", "a shared small extractor's features mixed into private models (Yi et al. 2024)"),
        ("pfedes", "a shared small proxy extractor in front of private models (Yi et al. 2023)"),
    ],
}

RUN_KEYS: set[str] = set()  # the run layer's config keys (filled by jaxfed.runs.config)


def register(name: str, options: type[Options], build: Builder | None = None, *, replace: bool = False):
    """Register algorithm ``name`` with its ``options`` class and ``build`` function; usable as
    a decorator (``@register(name, Options)``). ``replace=True`` overrides an existing name.

    Users name each option by its key: the field's name without a trailing underscore, so an
    option named by a Python keyword is declared ``lambda_`` (``global_``, ``in_``, ...) and
    written ``--set lambda=0.5`` (:func:`jaxfed.options.key_of`). Refused (ValueError): two
    fields with one key (``mu`` and ``mu_``) and an option that shadows a run-level key."""
    caller = sys._getframe(1).f_globals.get("__name__", "")  # the module calling register: the plugin
    if build is None:

        def decorator(fn):
            _register(name, options, fn, replace, caller)
            return fn

        return decorator
    return _register(name, options, build, replace, caller)


def _register(name: str, options: type[Options], build: Builder, replace: bool, module_name: str) -> AlgorithmSpec:
    if not (isinstance(options, type) and issubclass(options, Options) and dataclasses.is_dataclass(options)):
        raise TypeError(f"register({name!r}): options must be a dataclass subclassing jaxfed.options.Options")
    if (name in _REGISTRY or name in BUILTINS) and not replace:
        raise ValueError(f"register: algorithm '{name}' exists already (pass replace=True to override it)")
    by_key: dict[str, list[str]] = {}
    for field in dataclasses.fields(options):
        by_key.setdefault(key_of(field.name), []).append(field.name)
    for key, fields in by_key.items():
        if len(fields) > 1 or not key:
            what = f"are all the key '{key}'" if len(fields) > 1 else "leaves no key (underscores only)"
            raise ValueError(f"register({name!r}): option field(s) {', '.join(fields)} {what}; rename")
    clash = sorted(set(by_key) & RUN_KEYS)
    if clash:
        raise ValueError(f"register({name!r}): option(s) {', '.join(clash)} shadow run-level config keys")
    check_declarations(options)
    file = getattr(sys.modules.get(module_name), "__file__", None)
    spec = _REGISTRY[name] = _spec(name, options, build)._replace(
        module=module_name, file=str(Path(file).resolve()) if file else None
    )
    return spec


def _spec(name: str, options: type[Options], build: Builder) -> AlgorithmSpec:
    doc = (build.__doc__ or options.__doc__ or "").strip().splitlines()
    return AlgorithmSpec(name, options, _checked(name, build), doc[0] if doc else "")


def _checked(name: str, build: Builder) -> Builder:
    """``build`` whose result is checked (a ConfigError naming the algorithm and the builder
    unless it is a :class:`~jaxfed.contract.FederatedAlgorithm`) and carries the options it was
    built with (its ``options`` field, where the builder left it None): what run directories
    record and a resume compares."""

    @functools.wraps(build)
    def built(model, options, config):
        algorithm = build(model, options, config)
        if not isinstance(algorithm, FederatedAlgorithm):
            kind = "None" if algorithm is None else f"a {type(algorithm).__name__}"
            raise ConfigError(
                f"algorithm '{name}': its builder {_where(build)} returned {kind}, not a "
                "jaxfed.algorithms.FederatedAlgorithm (return the record the builder makes)"
            )
        if algorithm.options is None:
            algorithm = algorithm._replace(options=options)
        return algorithm

    return built


def _where(function) -> str:
    """``build (path/to/plugin.py line 12)``: a function and where it is defined."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    place = f" ({code.co_filename} line {code.co_firstlineno})" if code is not None else ""
    return f"{getattr(function, '__qualname__', clip(repr(function)))}{place}"


def builtin(name: str, options: type[Options], build: Builder) -> None:
    """Register a built-in (from its module, on import) unless research code replaced it first."""
    if name not in _REGISTRY:
        _REGISTRY[name] = _spec(name, options, build)


def get(name: str) -> AlgorithmSpec:
    """The spec of ``name``; a one-line ConfigError listing the registered names otherwise."""
    if name not in _REGISTRY and name in BUILTINS:
        importlib.import_module(f"jaxfed.algorithms.{BUILTINS[name]}")
    if name not in _REGISTRY:
        hint = "an algorithm of your own needs its plugin: --plugin FILE_OR_MODULE (also on --resume; key plugins)"
        raise ConfigError(f"algorithm: {unknown_choice(name, names(), hint)}")
    return _REGISTRY[name]


def python_use(name: str) -> str | None:
    """How Python code builds built-in ``name`` (``from jaxfed.algorithms.partial import fedper;
    fedper(model, key=value, ...)``, its required arguments named), or None where research code
    registered the name."""
    module = f"jaxfed.algorithms.{BUILTINS[name]}" if name in BUILTINS else None
    if module is None or get(name).build.__module__ != module:
        return None
    parameters = inspect.signature(getattr(sys.modules[module], name)).parameters.values()
    required = [
        f"{p.name}=..." if p.kind == p.KEYWORD_ONLY else p.name
        for p in parameters
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    arguments = ", ".join([*required, "key=value", "..."])
    return f"from {module} import {name}; {name}({arguments})"


def names() -> list[str]:
    """Every algorithm's name: the built-ins, then those research code registered."""
    return [*BUILTINS, *(name for name in _REGISTRY if name not in BUILTINS)]


def options_with(key: str) -> list[str]:
    """The algorithms that have an option ``key`` (for error hints; loads every built-in)."""
    return [name for name in names() if get(name).options.field_for(key) is not None]


def registered_by(plugin: str) -> list[str]:
    """The algorithms a plugin registered (``--plugin``'s value: a ``.py`` file or a module name)."""
    if plugin.endswith(".py"):
        file = str(Path(plugin).resolve())
        return [spec.name for spec in _REGISTRY.values() if spec.file == file]
    return [spec.name for spec in _REGISTRY.values() if spec.module == plugin or spec.module.startswith(plugin + ".")]


def plugins_to_record(algorithm: str, plugins: tuple[str, ...]) -> tuple[str, ...]:
    """The plugins a run of ``algorithm`` records (``config.json``), so that ``--resume`` imports
    them again: ``plugins``, plus the module that called ``register`` for ``algorithm`` where
    research code imported it from Python (none of ``plugins`` registered it; not a script run as
    ``__main__``, which would run again): a package's module by its dotted name (importing its
    file alone would break its relative imports), a top-level module by its file."""
    spec = _REGISTRY.get(algorithm)
    if spec is None or not _imported_from_python(spec) or any(algorithm in registered_by(p) for p in plugins):
        return tuple(plugins)
    return (*plugins, spec.module if "." in spec.module else spec.file)


def _imported_from_python(spec: AlgorithmSpec) -> bool:
    """Whether research code registered ``spec`` from a module it imported, whose file is still
    there (not a ``--plugin`` file, not the script being run)."""
    plugin_file = spec.module.startswith("jaxfed_plugin_")
    return spec.file is not None and not plugin_file and spec.module != "__main__" and Path(spec.file).is_file()


def import_plugin(spec: str) -> None:
    """Import a module by dotted name (from ``sys.path`` or the working directory, as
    ``model=module:Class``), or a ``.py`` file by path, so its ``register`` calls run. A file
    whose algorithms are registered already (imported from Python under its module name) is not
    imported again. A plugin that cannot be imported (missing, a syntax error, an exception at
    import, a ``register`` call refused) is one ConfigError naming it, the line and the problem."""
    path = Path(spec)
    if spec.endswith(".py"):
        if not path.is_file():
            raise ConfigError(f"plugins: no file '{spec}' (a plugin that moved: pass --plugin with its new path)")
        if registered_by(spec):
            return
        module_name = f"jaxfed_plugin_{path.stem}"
        loaded = sys.modules.get(module_name)
        if loaded is not None:
            loaded_file = Path(getattr(loaded, "__file__", "") or "")
            # the same file again, or the file that moved here (its old path is gone): done already
            if loaded_file.resolve() == path.resolve() or not loaded_file.is_file():
                return
            # another file of the same name (a/plug.py, b/plug.py): a module of its own
            module_name = f"{module_name}_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]}"
            if module_name in sys.modules:
                return
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        before = set(_REGISTRY)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[module_name]
            for name in set(_REGISTRY) - before:  # a failed import registers nothing
                del _REGISTRY[name]
            raise ConfigError(f"plugins: importing {spec} failed: {where_raised(err, str(path))}") from None
        return
    from jaxfed.nn import user

    user.import_module(spec, "plugins")
