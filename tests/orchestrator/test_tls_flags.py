"""`specdec serve` refuses bad TLS and API-key flags at start-up, with one line on stderr
naming the flag.

Apart from test_tls.py on purpose: that module's serve stack keeps a Ray cluster up, whose
log monitor forwards the actors' output to this process's stderr at any moment, and these
tests read stderr whole. Here no cluster runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.cli.main import main
from tests.certs import issue, load

SERVICE_NAME = "specdec-services"


def test_bad_tls_flags_fail_at_start_up(
    checkpoints: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cryptography import x509

    ca_cert, ca_key = issue(tmp_path, "ca", [])
    cert, key = issue(tmp_path, "service", [x509.DNSName(SERVICE_NAME)], load((ca_cert, ca_key)))
    ca_path = str(ca_cert)
    target, _ = checkpoints
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    cases = {
        "--tls-cert and --tls-key go together": ["--tls-cert", str(cert)],
        "--service-tls-cert and --service-tls-key go together": ["--service-tls-key", str(key)],
        "--tls-key '/nonexistent/tls.key' cannot be read: No such file": [
            "--tls-cert", str(cert), "--tls-key", "/nonexistent/tls.key"],
        "--service-tls-cert .* is not a PEM file": [
            "--service-tls-cert", str(not_pem), "--service-tls-key", str(key),
            "--service-tls-root-cert", ca_path],
        "--service-tls-cert needs --service-tls-root-cert": [
            "--service-tls-cert", str(cert), "--service-tls-key", str(key)],
        "--service-tls-root-cert needs --service-tls-cert": ["--service-tls-root-cert", ca_path],
        "--service-tls-server-name must be .* given with --service-tls-root-cert": [
            "--service-tls-server-name", SERVICE_NAME],
        "--service-tls-root-cert and --service-tls-client-cert/--service-tls-client-key go "
        "together": ["--service-tls-cert", str(cert), "--service-tls-key", str(key),
                     "--service-tls-root-cert", ca_path],
        "--tls-client-ca needs --tls-cert and --tls-key": ["--tls-client-ca", ca_path],
        "--tls-client-ca .* is not a PEM file": [
            "--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(not_pem)],
        "--api-key must be 16 to 4096 printable ASCII": ["--api-key", "short"],
        "--api-key-file '/nonexistent/key' cannot be read": [
            "--api-key-file", "/nonexistent/key"],
        "--api-key and --api-key-file are alternatives": [
            "--api-key", "k3y-0123456789-abcdef", "--api-key-file", str(cert)],
    }  # fmt: skip
    for message, flags in cases.items():
        assert main(["serve", "--target", str(target), "--metrics-port", "-1", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("specdec serve: ") and re.search(message, err), (message, err)
