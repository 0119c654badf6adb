"""The command line: ``jaxfed run``, ``sweep``, ``report``, ``plot``, ``list``, ``bench``.

The top layer: it parses arguments into a validated :class:`jaxfed.Config` and hands it to the
run layer (:mod:`jaxfed.runs`). ``commands`` holds the commands, ``report`` judges papers'
claims over seeds, ``bench`` measures throughput.
"""

from jaxfed.cli.commands import add_config_arguments, config_from_args, main

__all__ = ["add_config_arguments", "config_from_args", "main"]
