#!/usr/bin/env bash
# The one test command: installs what is needed, then lint, type check and the tests.
# GPU tests (marker `gpu`) skip themselves without CUDA; run them on a GPU machine with
#   python -m pytest -m gpu
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check -e ".[dev]"
ruff check .
ruff format --check .
mypy
python -m specdec.pb.generate --check
python -m pytest -q "$@"
