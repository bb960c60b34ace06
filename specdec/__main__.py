"""python -m specdec: the `specdec` command (serve, generate, demo)."""

import sys

from orchestrator.cli.main import main

sys.exit(main())
