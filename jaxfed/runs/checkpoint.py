"""Checkpoints with orbax-checkpoint.

- :func:`save_state` / :func:`load_state`: one :class:`SimState` (or any pytree of arrays) to
  and from a directory, for research code that drives the engine itself.
- :class:`RunCheckpoints`: the numbered checkpoints of a run directory (``DIR/checkpoints/<round>``),
  each holding the simulation state and a JSON record of the run so far (config, metrics rows,
  pending per-round metrics). Orbax writes each one into a temporary directory and renames it
  when complete, so a run killed mid-save leaves the previous checkpoints intact. Each record
  carries SHA-256 digests of the state's arrays and of the record itself, checked on restore:
  a checkpoint that fails to restore or to verify (truncated, corrupt, bit-flipped, edited) is
  skipped for the previous one with a one-line warning. Each record also carries the state's
  structure (:func:`state_signature`: its arrays' paths, dtypes and shapes), compared before the
  state is read: a checkpoint of another structure than the one asked for (another algorithm's or
  model's state) is not damaged but resumed by the wrong simulation, a one-line
  :class:`StateStructureError`, and nothing is skipped or moved. (Orbax's own metadata cannot
  tell the two apart: a truncated checkpoint's reads back as a part of its tree.)

Everything random in a run derives from the config's seed and the round counter held in the
state, so state + config are all a resume needs.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxfed.core.tree import leaves_by_path
from jaxfed.errors import ConfigError, first_line

STATE, RECORD = "state", "run"
INTEGRITY = "integrity"
STRUCTURE = "structure"  # the record's entry holding the state's signature
_WARNED: set[Path] = set()  # unreadable checkpoints already reported in this process


class CorruptCheckpointError(ValueError):
    """A checkpoint whose contents differ from the digests recorded when it was saved."""


class StateStructureError(ConfigError):
    """A readable checkpoint whose state has another structure than the one it is restored into
    (another algorithm's or model's): the wrong simulation resumes it; the checkpoint is fine."""


def state_signature(tree) -> dict[str, str]:
    """``{path: "dtype[shape]"}`` of a state's arrays (a PRNG key array as its key data, as it is
    saved; concrete arrays, numpy arrays or ``ShapeDtypeStruct`` leaves alike)."""

    def signature(leaf) -> str:
        shape, dtype = tuple(leaf.shape), leaf.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
            shape, dtype = data.shape, data.dtype
        return f"{np.dtype(dtype).name}[{','.join(map(str, shape))}]"

    return {name: signature(leaf) for name, leaf in leaves_by_path(tree).items()}


def signature_difference(saved: dict[str, str], expected: dict[str, str]) -> str | None:
    """How the saved state's :func:`state_signature` differs from the expected one (None: alike)."""
    other = [k for k in expected if k in saved and saved[k] != expected[k]]
    lacking = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    parts = [f"{k} is {saved[k]} there, {expected[k]} here" for k in other[:1]]
    if len(other) > 1:
        parts[0] += f" ({len(other) - 1} more arrays differ)"
    if lacking:
        parts.append(f"it lacks {_some(lacking)}")
    if extra:
        parts.append(f"it has {_some(extra)}, which this simulation's state lacks")
    return ", ".join(parts) or None


def check_structure(record: dict, like, where) -> None:
    """A :class:`StateStructureError` when the checkpoint ``where``, of ``record``, holds a state
    of another structure than ``like`` (a record from before structures were recorded: not checked)."""
    saved = record.get(STRUCTURE)
    difference = None if saved is None else signature_difference(saved, state_signature(like))
    if difference is not None:
        raise StateStructureError(
            f"resume: the checkpoint {where} holds a state of another structure: {difference}; "
            "resume with the simulation that wrote it"
        )


def _some(keys: list[str], most: int = 2) -> str:
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


def tree_digest(tree) -> str:
    """SHA-256 over every leaf's shape, dtype and bytes (PRNG keys by their key data)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:  # replicated over processes
            leaf = leaf.addressable_data(0)
        array = np.ascontiguousarray(jax.device_get(leaf))
        digest.update(f"{array.shape}{array.dtype.str}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def record_digest(record: dict) -> str:
    """SHA-256 of a record's JSON (keys sorted), its integrity entry left out."""
    body = {k: v for k, v in record.items() if k != INTEGRITY}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def sealed(record: dict, state) -> dict:
    """``record`` with the digests of ``state`` and of itself."""
    return {**record, INTEGRITY: {"state": tree_digest(state), "record": record_digest(record)}}


def verify_record(record: dict) -> dict:
    """``record`` if its digest matches. Records saved before digests pass unchecked; one that holds
    the state's structure (written since, always with digests) and no digests lost them."""
    integrity = record.get(INTEGRITY)
    if integrity is None and STRUCTURE in record:
        raise CorruptCheckpointError("its run record lost its digests (edited after it was saved)")
    if integrity is not None and integrity.get("record") != record_digest(record):
        raise CorruptCheckpointError("its run record differs from what was saved (digest mismatch)")
    return record


def verify_state(state, record: dict):
    integrity = record.get(INTEGRITY)
    if integrity is not None and integrity.get("state") != tree_digest(state):
        raise CorruptCheckpointError("its state differs from what was saved (digest mismatch)")
    return state


def abstract_like(tree):
    """Shapes, dtypes and shardings of ``tree`` (concrete arrays or ``ShapeDtypeStruct`` leaves);
    a host (numpy) array stays one, so that it is restored into host memory (host-held client
    states: ``client_state=host``)."""

    def leaf(x):
        if isinstance(x, (jax.ShapeDtypeStruct, np.ndarray)):
            return x
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(leaf, tree)


def save_state(path: str | Path, state, *, overwrite: bool = False) -> None:
    """Write ``state`` (a pytree of arrays) to the directory ``path`` (absolute or relative).

    Blocks until the write is complete. An existing ``path`` is an error unless ``overwrite``.
    """
    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state, force=overwrite)
        checkpointer.wait_until_finished()


def load_state(path: str | Path, like=None):
    """Read a state written by :func:`save_state`, a run checkpoint's (``RUN/checkpoints/N`` or
    its ``state``), or a run directory's newest checkpoint's (``RUN``).

    ``like`` (a state of the same structure, e.g. ``simulation.init()``, or its
    ``jax.eval_shape``) gives the structure, dtypes and device placement of the result; without
    it the result is nested dicts of arrays on this process's first device, however many devices
    the state was saved from.
    """
    path = state_path(Path(path).absolute())
    with ocp.StandardCheckpointer() as checkpointer, _without_missing_metadata_warning():
        target = abstract_like(like) if like is not None else _on_first_device(checkpointer.metadata(path))
        return checkpointer.restore(path, target)


def state_path(path: Path) -> Path:
    """The saved state ``path`` names: itself, a run checkpoint's ``state``, or a run directory's
    newest checkpoint's; a ConfigError naming what to pass where it holds none."""
    if (path / "checkpoints").is_dir():  # a run directory
        rounds = RunCheckpoints(path / "checkpoints").rounds()
        if not rounds:
            raise ConfigError(f"load_state: {path} holds no complete checkpoint")
        path = path / "checkpoints" / str(rounds[-1])
    if (path / STATE).is_dir():  # a run checkpoint
        path = path / STATE
    if not (path / "_METADATA").is_file() and not (path / "_CHECKPOINT_METADATA").is_file():
        raise ConfigError(
            f"load_state: {path} holds no saved state; pass what save_state wrote, a run directory (its newest "
            "checkpoint) or RUN/checkpoints/N"
        )
    return path


@contextlib.contextmanager
def _without_missing_metadata_warning():
    """A run checkpoint's state (``checkpoints/<round>/state``) keeps its step metadata one level
    up, so orbax logs "Metadata file does not exist" for a state that reads perfectly well."""

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Metadata file does not exist")

    logger = logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _on_first_device(metadata):
    """The saved arrays' shapes and dtypes, placed on this process's first device."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    tree = getattr(metadata, "item_metadata", metadata)
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)


class RunCheckpoints:
    """The checkpoints of one run directory, newest ``keep`` kept.

    ``save(round, state, record)`` writes asynchronously (training goes on while it writes);
    ``wait()`` blocks until every save is complete.
    """

    def __init__(self, directory: str | Path, keep: int = 3):
        self.directory = Path(directory).absolute()
        self._begun: set[int] = set()  # rounds this object saved
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=False),
            item_names=(STATE, RECORD),
        )

    def rounds(self) -> list[int]:
        """Rounds with a complete checkpoint, oldest first."""
        if not self.directory.exists():
            return []
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, round_: int, state, record: dict) -> None:
        """Save round ``round_`` (asynchronously); a round already saved is kept as it is: a run
        resumed from it that stops again on the same round (a non-finite update) re-saves the
        same state. Host (numpy) arrays are copied before it returns (orbax's ``NumpyHandler``):
        the run loop writes donated host-held client states in place right after."""
        if round_ in self._begun or (self.directory / str(round_)).is_dir():  # begun: it may still be writing
            return
        self._begun.add(round_)
        self.directory.mkdir(parents=True, exist_ok=True)
        # A copy: the write runs in the background while the caller goes on updating its record.
        record = sealed({**json.loads(json.dumps(record)), STRUCTURE: state_signature(state)}, state)
        args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), RECORD: ocp.args.JsonSave(record)})
        self._manager.save(round_, args=args, force=True)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def read_record(self, round_: int) -> dict:
        """The run record of checkpoint ``round_``, verified against its digest."""
        return self._record(round_)

    def _record(self, round_: int) -> dict:
        args = ocp.args.Composite(**{RECORD: ocp.args.JsonRestore()})
        return verify_record(self._manager.restore(round_, args=args)[RECORD])

    def restore(self, round_: int, like) -> tuple[Any, dict]:
        """``(state, record)`` of checkpoint ``round_``, restored into ``like``'s structure and
        placement, both verified against their digests. The record is read first: a state of
        another structure than ``like``'s (its record says) is a :class:`StateStructureError`."""
        record = self._record(round_)
        check_structure(record, like, self.directory / str(round_))
        args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract_like(like))})
        return verify_state(self._manager.restore(round_, args=args)[STATE], record), record

    def newest(self, load: Callable[[int], Any], warn: Callable[[str], None] | None = None, at_most=None):
        """``(round, load(round))`` for the newest checkpoint (of a round ``<= at_most``, where
        given) that ``load`` reads without error, warning about each newer one skipped; ``None``
        if there is none."""
        warn = warn or (lambda message: warnings.warn(message, stacklevel=2))
        for round_ in reversed([r for r in self.rounds() if at_most is None or r <= at_most]):
            try:
                with _quiet_abandoned_reads():
                    return round_, load(round_)
            except StateStructureError:  # a good checkpoint, of another simulation: no older one is its
                raise
            except Exception as err:  # a truncated or corrupt checkpoint: any reader error
                where = self.directory / str(round_)
                if where not in _WARNED:  # one line per checkpoint, however often it is read
                    _WARNED.add(where)
                    warn(f"checkpoint {where} is unreadable ({first_line(err)}); using an older one")
        return None

    def set_aside(self, round_: int) -> Path:
        """Rename checkpoint ``round_`` to ``<round>.unreadable`` (kept for inspection, out of the way)."""
        target = self.directory / f"{round_}.unreadable"
        suffix = 1
        while target.exists():
            target, suffix = self.directory / f"{round_}.unreadable{suffix}", suffix + 1
        (self.directory / str(round_)).rename(target)
        self._manager.reload()
        return target

    def close(self) -> None:
        self._manager.close()


@contextlib.contextmanager
def _quiet_abandoned_reads():
    """A failed orbax restore abandons its other reads: their coroutines would each print an
    "Exception ignored" traceback when collected. Collect them here, silently, after a failure only
    (a full collection costs 0.1-0.2 s: on every read it was a large part of a resume's time)."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        yield
    except BaseException:
        gc.collect()
        raise
    finally:
        sys.unraisablehook = hook
