"""``python -m engine`` runs the ``patch-engine`` command line."""

import sys

from engine.commands.cli import main

sys.exit(main())
