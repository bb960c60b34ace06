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
