"""``python -m jaxfed.cli``: the ``jaxfed`` command."""

import sys

from jaxfed.cli.commands import main

sys.exit(main())
