"""python -m orchestrator: the `specdec` command."""

import sys

from orchestrator.cli import main

sys.exit(main())
