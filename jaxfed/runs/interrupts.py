"""Ctrl-C that is never lost. Python's own SIGINT handler raises KeyboardInterrupt wherever the
main thread is; when that is a callback whose exceptions Python ignores (JAX's garbage-collection
callback: ``Exception ignored in: <function _xla_gc_callback ...>``), the interrupt is dropped and
the run went on to its end. The ``jaxfed`` command installs :func:`install`'s handler, which
raises the same KeyboardInterrupt and remembers it; the run loop calls :func:`check` before each
compiled call, so a dropped interrupt stops the run there. Python code calling the library keeps
Python's handler (nothing here is installed on import)."""

from __future__ import annotations

import signal
import threading

_received = threading.Event()


def install() -> None:
    """Make SIGINT raise KeyboardInterrupt, as Python's handler does, and remember it."""

    def handler(signum, frame):
        _received.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def received() -> bool:
    """Whether SIGINT came under :func:`install`'s handler."""
    return _received.is_set()


def check() -> None:
    """Raise KeyboardInterrupt if SIGINT came under :func:`install`'s handler (dropped or not)."""
    if received():
        raise KeyboardInterrupt


def clear() -> None:
    """Forget a SIGINT received (tests)."""
    _received.clear()
