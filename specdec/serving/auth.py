"""The client API's key: `authorization: Bearer KEY` metadata on every call (an HTTP API takes
the same header), compared in constant time; UNAUTHENTICATED without it or with another key.
The standard health service stays open, so that load balancers and Kubernetes probes need no
key (Prometheus' /metrics is plain HTTP and is not behind it either).

`authorized` is the one check: `ApiKeyInterceptor` applies it to gRPC calls, and the HTTP API
(`orchestrator.web.api`, all routes but /health) to its Authorization header.
"""

from __future__ import annotations

import hmac
import string
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

API_KEY_ENV = "SPECDEC_API_KEY"
HEADER = "authorization"
SCHEME = "Bearer "
MIN_KEY_CHARS, MAX_KEY_CHARS = 16, 4096
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
_KEY_CHARS = frozenset(string.ascii_letters + string.digits + string.punctuation)
UNAUTHENTICATED_MESSAGE = (
    "This server needs an API key: send the metadata (or HTTP header) 'authorization: Bearer "
    "KEY' (specdec generate --api-key, Client(api_key=...), or SPECDEC_API_KEY)."
)


def check_api_key(key: str, source: str = "api_key") -> str:
    """The key, or a ValueError naming `source` for one that cannot travel as gRPC metadata
    or is too short to be a secret."""
    if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS or not set(key) <= _KEY_CHARS:
        raise ValueError(
            f"{source} must be {MIN_KEY_CHARS} to {MAX_KEY_CHARS} printable ASCII characters "
            f"without spaces, got {len(key)} characters"
            f"{'' if set(key) <= _KEY_CHARS else ' including others'}."
        )
    return key


def read_api_key_file(path: Path) -> str:
    """The key in `path` (surrounding whitespace, a final newline, dropped)."""
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {str(path)!r} cannot be read: {e}.") from None
    return check_api_key(key, f"the key in --api-key-file {str(path)!r}")


def authorized(authorization: str | None, api_key: str) -> bool:
    """Whether an Authorization header (or metadata) value carries `api_key`, in constant time
    for any value of the same length."""
    if authorization is None or not authorization.startswith(SCHEME):
        return False
    offered = authorization[len(SCHEME) :].strip().encode("utf-8", "replace")
    return hmac.compare_digest(offered, api_key.encode())


def metadata_value(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for name, value in metadata or ():
        if name == HEADER:
            return value if isinstance(value, str) else None
    return None


def _refuse(_request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuses every call but the health service's without the key (UNAUTHENTICATED)."""

    def __init__(self, api_key: str, open_prefixes: Sequence[str] = OPEN_PREFIXES) -> None:
        self._key = check_api_key(api_key)
        self._open = tuple(open_prefixes)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler: Any = continuation(details)
        if handler is None or details.method.startswith(self._open):
            return handler  # type: ignore[no-any-return]
        if authorized(metadata_value(details.invocation_metadata), self._key):
            return handler  # type: ignore[no-any-return]
        kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        kind = next(k for k in kinds if getattr(handler, k) is not None)
        return handler._replace(**{kind: _refuse})  # type: ignore[no-any-return]
