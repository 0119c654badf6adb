"""Exceptions users see: the CLI prints each as a single line, never a traceback."""

from __future__ import annotations

import difflib
import traceback
from pathlib import Path
from typing import Any

IMAGE_CHANNELS = (1, 3, 4)  # grey, RGB, RGBA


def unknown_choice(value, allowed, hint: str = "") -> str:
    """What a value outside a list of names is told, after its field's name: ``unknown 'fedavgg'
    (did you mean 'fedavg'?); allowed: fedavg, fedprox, ...``, with ``hint`` (where the value may
    come from besides) before the list."""
    names = [str(a) for a in allowed]
    close = difflib.get_close_matches(str(value), names, n=1)
    guess = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown '{clip(str(value))}'{guess}{'; ' + hint if hint else ''}; allowed: {', '.join(names)}"


def channels_first(example_shape: tuple) -> bool:
    """Whether one example of this shape looks like an image with its channels first, (C, H, W):
    models and loaders take images channels last. Said in both the data's and the model's errors."""
    return len(example_shape) == 3 and example_shape[0] in IMAGE_CHANNELS and example_shape[2] not in IMAGE_CHANNELS


class ConfigError(ValueError):
    """A user-facing mistake (bad config value, missing dataset, ...): the message is one line.
    The CLI exits with code 2."""


class NonFiniteUpdateError(RuntimeError):
    """A client returned NaN or inf under ``nonfinite=error``.

    ``round`` is the failing round (1-based), ``client_ids`` the clients whose update was not
    finite, ``state`` the last good :class:`~jaxfed.simulation.SimState` (``round - 1`` rounds
    done) and ``metrics`` the per-round metrics of the good rounds of the failing call.
    """

    def __init__(self, round: int, client_ids: list[int], state: Any = None, metrics: Any = None):
        self.round, self.client_ids, self.state, self.metrics = round, client_ids, state, metrics
        shown = ", ".join(map(str, client_ids[:20])) + (", ..." if len(client_ids) > 20 else "")
        super().__init__(f"round {round}: non-finite update (NaN or inf) from client(s) {shown}")


class StorageFullError(RuntimeError):
    """The run directory's disk filled up (or hit its quota) while a checkpoint or the metrics
    were written; the newest complete checkpoint is intact. The CLI exits with code 1."""


class DeviceMemoryError(RuntimeError):
    """A round or an evaluation ran out of device memory (XLA's RESOURCE_EXHAUSTED "Out of
    memory"); the newest complete checkpoint is intact. The CLI exits with code 1."""


STORAGE_FULL_ERRNOS = (28, 122)  # ENOSPC, EDQUOT


def _chain(err: BaseException | None):
    """``err`` and what it wraps (its causes and contexts)."""
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def is_device_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` (or what it wraps) is XLA running out of device memory, not a full disk."""
    return any("RESOURCE_EXHAUSTED" in str(e) and "out of memory" in str(e).lower() for e in _chain(err))


def is_storage_full(err: BaseException) -> bool:
    """Whether ``err`` (or what it wraps) is a full disk: an OSError with ENOSPC / EDQUOT, or
    TensorStore's RESOURCE_EXHAUSTED as orbax re-raises it (XLA's out of device memory is not)."""
    if is_device_out_of_memory(err):
        return False
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in STORAGE_FULL_ERRNOS:
            return True
        if "RESOURCE_EXHAUSTED" in str(e) or "No space left on device" in str(e):
            return True
    return False


def first_line(err: BaseException, limit: int = 200) -> str:
    """An error's first line (its type's name when it has no message), cut at ``limit``
    characters and before TensorStore's spec dump: the reason shown in a one-line message."""
    text = str(err).strip()
    if not text:
        return type(err).__name__
    return text.splitlines()[0].split(" See full TensorStore details")[0][:limit]


def clip(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was: a user's value echoed in a
    one-line error (a 200 KB value must not make a 200 KB line)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def where_raised(err: BaseException, file: str | None = None) -> str:
    """``ErrorType: message (FILE line N)`` of an exception raised by a user's code being imported
    (a plugin, a model): the line is the last one in ``file`` where given (else the last frame)."""
    if isinstance(err, SyntaxError):
        return f"SyntaxError: {err.msg} ({err.filename} line {err.lineno})"
    frames = traceback.extract_tb(err.__traceback__)
    own = [f for f in frames if file is not None and Path(f.filename) == Path(file)] or frames
    place = f" ({own[-1].filename} line {own[-1].lineno})" if own else ""
    return f"{type(err).__name__}: {first_line(err)}{place}"
