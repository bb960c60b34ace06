#!/usr/bin/env bash
# The one test command: installs what is needed, then lint, type check and the tests.
# GPU tests (marker `gpu`) skip themselves without CUDA; run them on a GPU machine with
#   python -m pytest -m gpu
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check -e ".[dev]"
# tests/deploy/test_prometheus.py runs Debian's prometheus and promtool (npm packages the
# deploy tests need they install themselves, under ~/.cache/specdec/npm)
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
        >/dev/null
fi
ruff check .
ruff format --check .
mypy
python -m specdec.pb.generate --check
python -m pytest -q "$@"
