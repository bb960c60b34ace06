"""The protocol layer imports without torch or Triton, so that the orchestrator and the client
(CPU-only front doors) stay light. A fresh interpreter refuses to import either and must still
import every module below."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Add a module here once it must load without torch (the orchestrator, the client, ...).
TORCH_FREE_MODULES = (
    "specdec.errors",
    "specdec.limits",
    "specdec.sampling_params",
    "specdec.pb",
    "specdec.serving.messages",
    "specdec.serving.verdicts",
    "specdec.serving.proposers",
    "specdec.serving.ngram",
    "specdec.client",
    "orchestrator",
    "orchestrator.cli.main",
    "orchestrator.server",
    "orchestrator.core.pair",
    "orchestrator.core.records",
    "orchestrator.core.detokenizer",
    "orchestrator.core.metrics",
    "orchestrator.core.scheduler",
    "orchestrator.launch.placement",
    "orchestrator.cli.generate",
)
FORBIDDEN = ("torch", "triton")

_PROBE = textwrap.dedent(
    """
    import importlib, sys

    FORBIDDEN = {forbidden!r}

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in FORBIDDEN:
                raise ImportError(f"{{name}} is refused: this module must load without it")
            return None

    sys.meta_path.insert(0, Refuse())
    for name in {modules!r}:
        module = importlib.import_module(name)
        if name == "specdec.pb":  # its members load lazily: touch them
            for member in module.__all__:
                getattr(module, member)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
    assert not loaded, loaded
    """
)


def _probe(modules: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    code = _PROBE.format(forbidden=FORBIDDEN, modules=modules)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_protocol_modules_import_without_torch() -> None:
    result = _probe(TORCH_FREE_MODULES)
    assert result.returncode == 0, result.stderr


def test_the_probe_catches_a_module_that_needs_torch() -> None:
    result = _probe(("specdec.rng",))
    assert result.returncode != 0
    assert "torch is refused" in result.stderr
