"""`specdec serve`'s parent process: the exit code it gives for the orchestrator's."""

import signal

import pytest

from orchestrator.launch.supervisor import stop_code


@pytest.mark.parametrize(
    ("code", "stopping", "expected"),
    [
        (0, True, 0),
        (1, True, 1),
        (2, False, 2),
        (-signal.SIGABRT, False, 128 + signal.SIGABRT),  # an abort nobody asked for: a crash
        (-signal.SIGKILL, True, 128 + signal.SIGKILL),  # killed: not an abort Ray makes
        (-signal.SIGSEGV, True, 128 + signal.SIGSEGV),
    ],
)
def test_exit_codes_are_the_orchestrator_s(code: int, stopping: bool, expected: int) -> None:
    assert stop_code(code, stopping) == expected


def test_an_abort_during_a_forwarded_stop_is_exit_1_with_the_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ray's core worker aborts when the raylet and GCS were stopped under it (a SIGTERM to
    every process of a systemd unit): that stop is what the user asked for."""
    assert stop_code(-signal.SIGABRT, True) == 1
    err = capsys.readouterr().err
    assert "aborted during the stop" in err and "raylet" in err and "Exit code 1" in err


def test_the_orchestrator_runs_with_ray_s_auto_init_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray call made after the cluster was stopped from outside must fail, not start a new
    local cluster (which Ray's core worker then aborted); the user's own setting wins."""
    from orchestrator.launch.supervisor import child_env

    monkeypatch.delenv("RAY_ENABLE_AUTO_CONNECT", raising=False)
    assert child_env("INFO")["RAY_ENABLE_AUTO_CONNECT"] == "0"
    monkeypatch.setenv("RAY_ENABLE_AUTO_CONNECT", "1")
    assert child_env("INFO")["RAY_ENABLE_AUTO_CONNECT"] == "1"
