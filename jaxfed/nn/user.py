"""A researcher's own Flax module named in a config: ``model=module:Class`` or ``model=path/to/file.py:Class``.

The spec names a ``flax.linen.Module`` subclass: in a module importable from ``sys.path`` or the
working directory (``mypkg.nets:Net``), or in a Python file (``nets/net.py:Net``; the file's own
directory is importable while it runs, so it may import its neighbours). The class is
constructed with ``num_classes=`` when it has that field, else with no arguments, and wrapped as
any module is (:class:`jaxfed.nn.Model`). A relative file is recorded by its absolute path
(:func:`recorded_spec`), so a run's ``config.json`` finds it again on ``--resume`` from anywhere.
Each mistake (a file or module not found, an import that raised, no such class, not a Flax
module, a constructor that fails) is one :class:`~jaxfed.errors.ConfigError` line naming the spec.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import flax.linen as nn

from jaxfed.errors import ConfigError, clip, first_line, where_raised

FORMS = "module:Class or path/to/file.py:Class"


def is_spec(name: str) -> bool:
    """Whether a ``model`` value names a user's module (``...:Class``) rather than a built-in."""
    return isinstance(name, str) and ":" in name


def split_spec(spec: str) -> tuple[str, str]:
    """``(module or file, class name)`` of a spec; a ConfigError when it has neither form."""
    target, _, class_name = spec.rpartition(":")
    if not target or not class_name.isidentifier():
        raise ConfigError(f"model: '{clip(spec)}' is not {FORMS}")
    if not target.endswith(".py") and not all(part.isidentifier() for part in target.split(".")):
        raise ConfigError(f"model: '{clip(target)}' is neither a .py file nor a module name; write {FORMS}")
    return target, class_name


def recorded_spec(spec: str) -> str:
    """The spec as a config records it: a relative (or ``~``) ``.py`` path made absolute against
    the working directory, so it names the same file from any directory; anything else as it is."""
    if not is_spec(spec):
        return spec
    target, _, class_name = spec.rpartition(":")
    if not target.endswith(".py"):
        return spec
    return f"{Path(target).expanduser().absolute()}:{class_name}"


def label(name: str) -> str:
    """A model's short name for plot labels: ``net.py:Net`` for a file (not its absolute path);
    a module's spec or a built-in's name as it is."""
    target, _, class_name = name.rpartition(":")
    return f"{Path(target).name}:{class_name}" if target.endswith(".py") else name


def load_class(spec: str) -> type[nn.Module]:
    """The ``flax.linen.Module`` subclass ``spec`` names (its module imported once per process)."""
    target, class_name = split_spec(spec)
    module = _import_file(target) if target.endswith(".py") else import_module(target, "model")
    where = f"{target}" if target.endswith(".py") else f"module '{target}'"
    if not hasattr(module, class_name):
        found = module_classes(module)
        close = difflib.get_close_matches(class_name, found, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        listed = f"; its flax Modules: {', '.join(found)}" if found else "; it defines no flax Module"
        raise ConfigError(f"model: {where} has no '{class_name}'{hint}{listed}")
    value = getattr(module, class_name)
    if not (isinstance(value, type) and issubclass(value, nn.Module)):
        kind = "a class" if isinstance(value, type) else f"a {type(value).__name__}"
        raise ConfigError(f"model: '{class_name}' in {where} is {kind}, not a flax.linen.Module subclass")
    return value


def construct(spec: str, num_classes: int) -> nn.Module:
    """An instance of the class ``spec`` names: ``Class(num_classes=num_classes)`` when the class
    has a ``num_classes`` field, else ``Class()``."""
    cls = load_class(spec)
    takes_classes = "num_classes" in {f.name for f in dataclasses.fields(cls)}
    arguments = {"num_classes": num_classes} if takes_classes else {}
    try:
        return cls(**arguments)
    except Exception as err:
        shown = f"num_classes={num_classes}" if takes_classes else ""
        raise ConfigError(f"model: {cls.__name__}({shown}) failed: {type(err).__name__}: {first_line(err)}") from None


def module_classes(module) -> list[str]:
    """The names of the Flax Module subclasses a module defines (not those it imports)."""
    return sorted(
        name
        for name, value in vars(module).items()
        if isinstance(value, type) and issubclass(value, nn.Module) and value.__module__ == module.__name__
    )


def _import_file(target: str):
    path = Path(target).expanduser().absolute()
    if not path.is_file():
        raise ConfigError(f"model: no file '{clip(target)}'")
    name = f"jaxfed_model_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclass fields resolve their module by name
    try:
        with _importable(path.parent):
            spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ConfigError(f"model: importing {target} failed: {where_raised(err, str(path))}") from None
    return module


def import_module(target: str, field: str):
    """The module named ``target`` (dotted), imported from ``sys.path`` or the working directory:
    the one rule for user code named by a module (``model=module:Class``, ``--plugin module``).
    Each failure is a ConfigError line starting with ``field``."""
    importlib.invalidate_caches()  # a module written since the last import is found
    try:
        with _importable(Path(os.getcwd())):
            return importlib.import_module(target)
    except ModuleNotFoundError as err:
        if err.name is not None and (target == err.name or target.startswith(err.name + ".")):
            raise ConfigError(
                f"{field}: no module '{target}' on sys.path or in the working directory ({os.getcwd()})"
            ) from None
        raise ConfigError(f"{field}: importing {target} failed: {where_raised(err)}") from None
    except Exception as err:
        raise ConfigError(f"{field}: importing {target} failed: {where_raised(err)}") from None


@contextlib.contextmanager
def _importable(directory: Path):
    """``directory`` on ``sys.path`` (last) while a user's module is imported."""
    entry = str(directory)
    added = entry not in sys.path
    if added:
        sys.path.append(entry)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)
