"""How large a message each port takes, derived from what the services hold, so that no single
request can make a server parse (and hold) more than a well-formed one ever needs.

The client port: a prompt is at most max_seq_len tokens, and no tokenizer the project serves
spells one token with more than MAX_CHARS_PER_TOKEN characters (BPE merges of whitespace runs
in code vocabularies reach a few dozen), each at most 4 bytes of UTF-8. So a text prompt longer
than max_seq_len × MAX_CHARS_PER_TOKEN characters is refused before it is tokenised, and a
GenerateRequest larger than max_seq_len × MAX_CHARS_PER_TOKEN × 4 bytes plus REQUEST_SLACK_BYTES
(stop strings, ids, sampling fields) is refused by gRPC before Python sees it.
(`specdec serve --max-request-bytes` overrides the latter.)

The services' ports: the largest message is either a block of dense q (every request, k
positions, float32 over the vocabulary) or a control that re-admits every request with its
tokens (varints of at most 5 bytes each); MESSAGE_SLACK_BYTES covers the rest. Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.limits import INT32_MAX

MAX_CHARS_PER_TOKEN = 32
UTF8_MAX_BYTES = 4
REQUEST_SLACK_BYTES = 64 * 1024
MESSAGE_SLACK_BYTES = 1 << 20
VARINT_MAX_BYTES = 5
DEFAULT_SEQ_LEN_CAP = 8192  # the services' cap on a checkpoint's own limit (specdec.serving.cli)
# a port's largest message may be set to [MIN_MESSAGE_BYTES, MAX_MESSAGE_BYTES]: gRPC's limits
# are int32 (`specdec serve --max-request-bytes`, a service's --max-message-bytes)
MIN_MESSAGE_BYTES, MAX_MESSAGE_BYTES = 1024, INT32_MAX


def max_prompt_chars(max_seq_len: int) -> int:
    """The longest text prompt that is tokenised at all."""
    return max_seq_len * MAX_CHARS_PER_TOKEN


def request_bytes(max_seq_len: int) -> int:
    """The client port's largest request: a text prompt of max_prompt_chars in UTF-8, plus the
    other fields."""
    return max_prompt_chars(max_seq_len) * UTF8_MAX_BYTES + REQUEST_SLACK_BYTES


def service_message_bytes(
    max_requests: int, max_num_draft_tokens: int, vocab_size: int, max_seq_len: int
) -> int:
    """A draft or target service's largest message (see the module docstring)."""
    dense_q = max_requests * max_num_draft_tokens * (vocab_size * 4 + 16)
    readmit = max_requests * (max_seq_len * VARINT_MAX_BYTES + 256)
    return max(dense_q, readmit) + MESSAGE_SLACK_BYTES


def _config(model_dir: str | Path) -> dict[str, object]:
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def checkpoint_vocab_size(model_dir: str | Path) -> int:
    """The embedding's rows from config.json (0 if it says none: the loader reports why)."""
    value = _config(model_dir).get("vocab_size")
    return value if isinstance(value, int) and value > 0 else 0


def served_seq_len(model_dir: str | Path, max_seq_len: int | None) -> int:
    """The max_seq_len the services will hold: the configured one, else the checkpoint's own
    limit capped at DEFAULT_SEQ_LEN_CAP (as the services' mains do)."""
    if max_seq_len is not None:
        return max_seq_len
    limit = _config(model_dir).get("max_position_embeddings")
    if not isinstance(limit, int) or limit < 1:
        return DEFAULT_SEQ_LEN_CAP
    return min(limit, DEFAULT_SEQ_LEN_CAP)
