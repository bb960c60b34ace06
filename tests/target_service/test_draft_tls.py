"""A target started on its own (`python -m target_service --draft-address ...`) checks its draft
over TLS when given the draft's CA: the same trust the hub's draft link uses."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from draft_service.server import start as start_draft
from specdec.serving.server import ServerConfig
from target_service.__main__ import build_parser, target_config
from target_service.config import TargetConfig
from target_service.server import start as start_target
from tests.certs import issue, load
from tests.draft_service.models import model_draft, runner_config

NAME = "specdec-draft"  # the only name in the draft's certificate


def test_the_start_up_check_of_the_draft_uses_tls(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    from cryptography import x509

    target_dir, draft_dir = checkpoints
    ca = issue(tmp_path, "ca", [])
    cert, key = issue(tmp_path, "draft", [x509.DNSName(NAME)], load(ca))
    draft = replace(model_draft(draft_dir), server=ServerConfig(tls_cert=cert, tls_key=key))
    d_srv, _ = start_draft(draft)
    base = TargetConfig(
        runner_config(target_dir), draft_address=f"127.0.0.1:{d_srv.port}", draft_wait_s=3.0
    )
    try:
        with pytest.raises(grpc.FutureTimeoutError):  # plaintext never reaches a TLS server
            start_target(base)
        trusted = replace(base, draft_tls_root_cert=ca[0], draft_tls_server_name=NAME)
        t_srv, _ = start_target(trusted)
        t_srv.stop(0)
    finally:
        d_srv.stop(0)


def test_the_flags_reach_the_config(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("unused")
    args = build_parser().parse_args(
        ["--model", str(tmp_path), "--draft-address", "draft:1", "--draft-tls-root-cert", str(ca),
         "--draft-tls-server-name", NAME, "--max-seq-len", "64"]
    )  # fmt: skip
    config = target_config(args)
    assert config.draft_tls_root_cert == ca and config.draft_tls_server_name == NAME
