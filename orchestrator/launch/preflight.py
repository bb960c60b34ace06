"""What `specdec serve` checks before it starts Ray: the checkpoints' files, the flags that
depend on them, and the ports.

Each of these was found only inside a service, after Ray had started (20-28 s on a 2-core
machine) and with two Ray tracebacks, or was misreported: an empty directory read as "You need
to have sentencepiece or tiktoken installed". Here each is one sentence naming the flag and the
file, from reading a few small files; neither torch nor transformers is imported.
"""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.config import ServeConfig
from orchestrator.core.detokenizer import check_shared_tokenizer
from orchestrator.launch.ports import bind
from specdec.tensor_parallel import config_split_problem

# the files some tokenizer of transformers reads: a fast tokenizer's, SentencePiece's, BPE's,
# WordPiece's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
LAYOUT = "a checkpoint directory holds config.json, *.safetensors and its tokenizer files"


def _config_json(flag: str, path: Path) -> dict[str, object]:
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"{flag} {str(path)!r} has no config.json ({LAYOUT}).")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag}: {str(file)!r} cannot be read as JSON ({e}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"{flag}: {str(file)!r} must hold a JSON object.")
    return config


def check_checkpoint(
    flag: str, directory: str, max_seq_len: int | None, tensor_parallel: int = 1
) -> None:
    """ValueError unless `directory` (given as `flag`) has a config.json, weights in
    safetensors and a tokenizer, holds `max_seq_len` positions (None: the services take the
    checkpoint's own limit), and splits over `tensor_parallel` ranks."""
    path = Path(directory)
    config = _config_json(flag, path)
    problem = config_split_problem(config, tensor_parallel)
    if problem is not None:
        raise ValueError(
            f"--{flag.removeprefix('--')}-tensor-parallel {tensor_parallel}: {problem} "
            f"({str(path / 'config.json')!r})"
        )
    if not any(path.glob("*.safetensors")):
        raise ValueError(
            f"{flag} {str(path)!r} has no *.safetensors files: the weights are read from "
            f"safetensors only (convert .bin or .pt weights first)."
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{flag} {str(path)!r} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} "
            f"({LAYOUT})."
        )
    limit = config.get("max_position_embeddings")
    if max_seq_len is not None and isinstance(limit, int) and max_seq_len > limit:
        raise ValueError(
            f"--max-seq-len {max_seq_len} exceeds the {flag.removeprefix('--')}'s "
            f"max_position_embeddings {limit} ({str(path / 'config.json')!r}); pass at most "
            f"{limit}, or omit it to take the checkpoints' own limit."
        )


def check_ports(config: ServeConfig) -> None:
    """PortError naming the flag of a port that cannot be bound (held by another process, or
    given to two flags); port 0 always can. Each is bound and let go again: the server binds
    it moments later, and grpc core would log an error line of its own before ours."""
    given = [("--port", config.port), ("--http-port", config.http_port),
             ("--metrics-port", config.metrics_port)]  # fmt: skip
    ports = [(flag, port) for flag, port in given if port]  # None: off; 0: a free one
    for i, (flag, port) in enumerate(ports):
        for other, same in ports[:i]:
            if same == port:
                raise ValueError(f"{other} and {flag} are both {port}: give each its own port.")
    held = []
    try:
        for flag, port in ports:
            held.append(bind(config.host, port, flag))
    finally:
        for sock in held:
            sock.close()


def check_before_ray(config: ServeConfig) -> None:
    """Every check that needs no Ray; ValueError (PortError for a port) names what to fix."""
    services = config.services
    check_checkpoint(
        "--target", services.target, services.max_seq_len, services.target_tensor_parallel
    )
    if services.draft is not None:
        check_checkpoint("--draft", services.draft, services.max_seq_len)
        check_shared_tokenizer(services.target, services.draft)
    check_ports(config)
