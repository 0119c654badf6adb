"""``python -m jaxfed.cli``: the ``jaxfed`` command."""

from jaxfed.cli.commands import entry

entry()
