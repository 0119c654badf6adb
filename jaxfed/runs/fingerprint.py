"""What a simulation is, for its run directory: the fingerprint a resume compares, and the
description ``config.json`` records.

A run's checkpoints must be continued by the simulation that wrote them: another learning rate,
seed, participation or partition would go on computing another run from a state that is not its
own. :func:`fingerprint` is what decides a round's numbers, as JSON: the algorithm and its options
(where the record carries them: :attr:`~jaxfed.contract.FederatedAlgorithm.options`), the model's
name, the client count, the participation (clients per round over clients), the clients held out
of training (new clients), the sampling, the
evaluation settings, the matmul precision, the seed (the root key), and the data: a cheap digest of
the examples and one of the per-client index tables (the partition), each over the arrays'
dtypes, shapes and contents, summed on the device. Each checkpoint's record holds it;
:func:`check_same_simulation` refuses, in one line naming the differences, a resume by a
simulation whose fingerprint differs. A record without one (a run directory from before
fingerprints, or a sweep member written before members recorded one) is not compared.

The fingerprint also holds a digest of each file of user code the simulation runs (a model file, a
plugin: :func:`code_files`). A resume whose file changed since is warned, not refused: an edit
that changes the numbers (a layer's activation) cannot be told from one that does not (a
comment, a print), and refusing would strand a run over the second.

:func:`describe` is the fingerprint without the digests, with the data's sizes instead: what
:func:`~jaxfed.runs.driver.run_simulation` writes to ``config.json`` (under the keys a
:class:`~jaxfed.Config` uses, so plot labels, ``jaxfed report`` and :func:`jaxfed.load_runs`
read it as they read a ``jaxfed run`` directory).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sysconfig
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.errors import ConfigError
from jaxfed.nn import user
from jaxfed.options import Options

EXAMPLES = ("x_train", "y_train", "x_test", "y_test")
PARTITION = ("train_idx", "train_count", "test_idx", "test_count")
_MIX = np.uint32(0x9E3779B1)  # the golden-ratio multiplier: position weights of the second sum


def model_name(model) -> str:
    """A model's name (:class:`jaxfed.nn.Model`'s, else its type's)."""
    return getattr(model, "name", type(model).__name__)


def seed_of(root) -> int | list[int]:
    """The seed of a root key made by ``jax.random.key(seed)`` (threefry: two 32-bit words), else
    the key's words."""
    words = [int(w) for w in np.asarray(jax.random.key_data(root)).reshape(-1)]
    return (words[0] << 32) | words[1] if len(words) == 2 else words


def options_dict(options) -> dict | None:
    """An algorithm's options as JSON (None when the record does not carry them)."""
    if isinstance(options, Options):
        return options.to_dict()
    return dict(options) if isinstance(options, Mapping) else None


def simulation_keys(sim) -> dict:
    """What a simulation runs, as :class:`~jaxfed.Config` keys (``options``: None when unknown)."""
    held_out = [] if sim.new_clients is None else [int(i) for i in sim.new_clients]
    # the local updates that personalize each new client: every new_* metric (only with new clients)
    updates = {"new_client_updates": sim.evaluation.new_client_updates} if held_out else {}
    return {
        "algorithm": sim.algorithm.name,
        "options": options_dict(getattr(sim.algorithm, "options", None)),
        "model": model_name(sim.model),
        "num_clients": sim.num_clients,
        "participation": sim.num_sampled / sim.num_clients,
        "sampling": sim.sampling,
        "eval_clients": sim.eval_clients,
        "eval_batch_size": sim.evaluation.batch_size,
        "matmul_precision": sim.matmul_precision,
        "seed": seed_of(sim.root),
        "new_client_ids": held_out,
        **updates,
    }


def _installed_roots() -> tuple[Path, ...]:
    """jaxfed's own package and the interpreter's library directories (installed packages): code
    that changes with a version, not with a user's edit."""
    paths = sysconfig.get_paths()
    roots = [Path(__file__).resolve().parents[1]] + [Path(paths[k]).resolve() for k in ("stdlib", "purelib", "platlib")]
    return tuple(roots)


def _definitions(obj):
    """The functions and classes ``obj`` is made of: itself (unwrapped from ``jax.jit`` and other
    wrappers), a ``functools.partial``'s function, each field of a record (``Aggregation``), a
    callable instance's class."""
    if isinstance(obj, functools.partial):
        yield from _definitions(obj.func)
    elif isinstance(obj, tuple):
        for item in obj:
            yield from _definitions(item)
    elif callable(obj):
        obj = inspect.unwrap(obj)
        yield obj if inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isclass(obj) else type(obj)


def code_files(sim) -> dict[str, str]:
    """``{file path: 12 hex digits of its sha256}`` of each file of user code ``sim`` runs: the
    files, outside jaxfed and the installed packages, that define its model's Module class (and
    its ``tier_models``') and its algorithm's functions (a ``model=path.py:Class`` file, a
    ``--plugin``; not the modules those import), as they are on disk now. Empty for a built-in
    algorithm on a built-in model."""
    module = getattr(sim.model, "module", sim.model)
    tier_models = getattr(getattr(sim.algorithm, "options", None), "tier_models", ())
    tier_classes = [user.load_class(spec) for spec in tier_models if user.is_spec(spec)]
    roots, files = _installed_roots(), {}
    for definition in [type(module), *tier_classes, *_definitions(tuple(sim.algorithm))]:
        try:
            source = inspect.getsourcefile(definition)
        except TypeError:  # a builtin: no file of its own
            continue
        if source is None or not Path(source).is_file():
            continue
        path = Path(source).resolve()
        if not any(path.is_relative_to(root) for root in roots):
            files[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return files


def changed_code(saved: dict, current: dict) -> list[str]:
    """The files of user code both fingerprints record whose digests differ (:func:`code_files`)."""
    old, new = saved.get("code") or {}, current.get("code") or {}
    return sorted(path for path in old.keys() & new.keys() if old[path] != new[path])


def warn_changed_code(saved: dict | None, current: dict, where, log) -> None:
    """A warning through ``log`` naming each file of user code that changed since the checkpoint
    ``saved`` (its fingerprint; None: nothing to compare) was written in ``where``."""
    edited = changed_code(saved or {}, current)
    if edited:
        log(
            f"warning: {', '.join(edited)} changed since {where} was written; resuming with the code as it is now "
            "(the rounds before ran the code as it was)"
        )


def fingerprint(sim, data=None) -> dict:
    """:func:`simulation_keys` plus the digests of ``data`` (default: the simulation's): what a
    checkpoint's record holds and a resume compares (a sweep's member: its template on the
    member's data, with the member's own seed and options, :meth:`jaxfed.runs.sweep.Sweep.fingerprints`)."""
    data = sim.data if data is None else data
    examples = [getattr(data, name) for name in EXAMPLES]
    return {
        **simulation_keys(sim),
        "examples": f"{len(data.x_train)} train + {len(data.x_test)} test #{digest(examples)}",
        "partition": f"#{digest([getattr(data, name) for name in PARTITION])}",
        "code": code_files(sim),
    }


def describe(sim) -> dict:
    """:func:`simulation_keys` (``options`` where known), the dataset's name (where the data has
    one) and the data's sizes: ``config.json`` of a simulation built in research code."""
    described = {key: value for key, value in simulation_keys(sim).items() if value is not None}
    data = sim.data
    if data.name:
        described["dataset"] = data.name
    described["data"] = {
        "train_examples": len(data.x_train),
        "test_examples": len(data.x_test),
        "input_shape": list(data.x_train.shape[1:]),
        "num_classes": data.num_classes,
    }
    return described


def digest(arrays) -> str:
    """12 hex digits over ``arrays``' dtypes, shapes and contents: two position-weighted sums of
    each array's 32-bit words, computed on the device where the arrays are (exact integer sums, so
    the same whatever the arrays' sharding), hashed with the shapes."""
    sums = [_word_sums(a) for a in arrays]
    sums = np.stack([np.asarray(s.addressable_data(0) if hasattr(s, "addressable_data") else s) for s in sums])
    shapes = " ".join(f"{a.dtype}{tuple(a.shape)}" for a in arrays)
    return hashlib.sha256(shapes.encode() + sums.tobytes()).hexdigest()[:12]


@jax.jit
def _word_sums(array):
    return _sums(_words(array))


def _words(x):
    """``x`` as a flat array of uint32 words (1- and 2-byte values widened, 8-byte ones split)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)


def _sums(words):
    position = jax.lax.iota(jnp.uint32, words.size)
    return jnp.stack(
        [jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * (position * _MIX + np.uint32(1)), dtype=jnp.uint32)]
    )


def option_defaults(options) -> dict | None:
    """The defaults of ``options``' class, as :meth:`~jaxfed.options.Options.to_dict` writes
    them (:meth:`~jaxfed.options.Options.defaults_dict`; None for options that are not an
    :class:`~jaxfed.options.Options`)."""
    return options.defaults_dict() if isinstance(options, Options) else None


def differences(saved: dict, current: dict, defaults: dict | None = None) -> list[str]:
    """``"key (old -> new)"`` for each key of both fingerprints whose value differs, then each
    option that differs (options are compared when both are known and the algorithm is the same).
    An option of ``current`` that ``saved`` does not record, one the algorithm gained since, is
    taken at its default in ``defaults`` (the current options' class's, :func:`option_defaults`):
    an option is added with a default that computes what the algorithm computed without it, so a
    run recorded before it resumes, and one resumed with another value is refused."""
    changed = [
        f"{key} ({saved[key]!r} -> {current[key]!r})"
        for key in saved
        if key not in ("options", "code") and key in current and saved[key] != current[key]
    ]
    old, new = saved.get("options"), current.get("options")
    if saved.get("algorithm") == current.get("algorithm") and old is not None and new is not None:
        added = {key: defaults[key] for key in new.keys() - old.keys() if key in (defaults or {})}
        old = {**added, **old}
        changed += [
            f"{key} ({old.get(key)!r} -> {new.get(key)!r})" for key in {**old, **new} if old.get(key) != new.get(key)
        ]
    return changed


def check_same_simulation(
    saved: dict | None,
    current: dict,
    where,
    log=None,
    field: str = "resume",
    defaults: dict | None = None,
    code_warning: bool = True,
) -> None:
    """A one-line ConfigError naming what differs when the fingerprint ``saved`` (a checkpoint's
    record, of the run in ``where``) is not ``current``'s (``defaults``: of the options an older
    record lacks, :func:`differences`). ``saved`` None (a record from before fingerprints): not
    compared, a warning through ``log`` (where given); options known on one side only or on
    neither: not compared, a warning too; a file of user code changed since (:func:`changed_code`): a warning
    (``code_warning=False``: the caller warns once for many checkpoints, :func:`warn_changed_code`)."""
    if saved is None:
        if log is not None:
            log(
                f"warning: {where} records no simulation fingerprint (written before jaxfed recorded one); "
                "resuming without checking that this simulation is the one that wrote it"
            )
        return
    changed = differences(saved, current, defaults)
    if changed:
        raise ConfigError(
            f"{field}: the simulation differs from the one that wrote {where} in {', '.join(changed)}; resume "
            "with the simulation that wrote it (only the loop settings may change), or run into another directory"
        )
    known = [side.get("options") is not None for side in (saved, current)]
    if log is not None and known[0] != known[1]:
        log(
            f"warning: the algorithm's options are known for {'the checkpoint' if known[0] else 'this simulation'} "
            "only (its record carries none), so they are not compared"
        )
    if log is not None and not any(known):
        log(
            "warning: the algorithm records no options (its FederatedAlgorithm was built with options=None), so "
            "they are not compared with the checkpoint's; pass options=... to FederatedAlgorithm"
        )
    if log is not None and code_warning:
        warn_changed_code(saved, current, where, log)
