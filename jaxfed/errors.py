"""Exceptions users see: the CLI prints each as a single line, never a traceback."""

from __future__ import annotations

from typing import Any


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
