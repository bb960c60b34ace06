"""What a test does when this machine lacks something it needs (a program, root, files it
cannot download): one line naming what is missing and how to get it.

On a developer's machine that line is a skip, so `bash scripts/test.sh` passes on any fresh
clone. Where SPECDEC_REQUIRE_TOOLS=1 (CI's `.ci/run` sets it) it is a failure instead: CI has
every tool, so a skip there would hide a broken install step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import pytest

REQUIRE = "SPECDEC_REQUIRE_TOOLS"
NPM_HINT = "`sudo apt-get install npm` (scripts/test.sh installs it when run as root)"


def required() -> bool:
    return os.environ.get(REQUIRE, "") not in ("", "0")


def missing(what: str, how: str) -> NoReturn:
    """Skip (fail where every tool is required) saying `what` is missing and `how` to get it."""
    line = f"missing {what}: {how}"
    if required():
        pytest.fail(f"{line} ({REQUIRE}=1: nothing may skip for a missing tool)", pytrace=False)
    pytest.skip(line)


def program(name: str, how: str) -> str:
    """The path of the program `name` on PATH, or `missing`."""
    path = shutil.which(name)
    if path is None:
        missing(f"`{name}`", how)
    return path


@contextmanager
def npm_registry(what: str) -> Iterator[None]:
    """Around an `npm install` of `what`: its failure (no route to the npm registry, a proxy's
    certificate npm does not trust) is `missing`, with npm's last error line."""
    try:
        yield
    except subprocess.CalledProcessError as e:
        lines = [line for line in (e.stderr or "").splitlines() if line.strip()]
        why = lines[-2] if len(lines) > 1 else (lines[0] if lines else f"exit {e.returncode}")
        missing(
            what,
            f"`npm install` failed ({why}); it needs the npm registry (a proxy's CA: set "
            f"NODE_EXTRA_CA_CERTS)",
        )
