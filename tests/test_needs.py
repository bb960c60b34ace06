"""tests/needs.py: a missing tool skips with its line, and fails where every tool is required."""

import subprocess

import pytest

from tests import needs


def test_a_missing_program_skips_saying_what_and_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(needs.REQUIRE, raising=False)
    with pytest.raises(pytest.skip.Exception, match="missing `no-such-tool-x`: get it so"):
        needs.program("no-such-tool-x", "get it so")


def test_where_every_tool_is_required_a_missing_one_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(needs.REQUIRE, "1")
    with pytest.raises(pytest.fail.Exception, match=r"missing `no-such-tool-x`.*nothing may skip"):
        needs.program("no-such-tool-x", "get it so")


def test_a_present_program_is_found() -> None:
    assert needs.program("sh", "").endswith("/sh")


def test_a_failed_npm_install_skips_with_npms_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(needs.REQUIRE, raising=False)
    stderr = "npm error code SELF_SIGNED_CERT_IN_CHAIN\nnpm error request failed\nnpm error log\n"
    skips = pytest.raises(pytest.skip.Exception, match=r"missing pkg: .*npm error request failed")
    with skips, needs.npm_registry("pkg"):
        raise subprocess.CalledProcessError(1, ["npm"], "", stderr)
