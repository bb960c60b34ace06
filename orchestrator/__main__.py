"""python -m orchestrator: the `specdec` command."""

import sys

from orchestrator.cli.main import main

sys.exit(main())
