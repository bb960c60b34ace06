"""Binding the orchestrator's ports, and a refusal that names the port and its flag when one
cannot be bound (most often: another server holds it)."""

from __future__ import annotations

import errno
import socket


class PortError(ValueError):
    """A port of `specdec serve` could not be bound."""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_error(host: str, port: int, flag: str, error: OSError | None) -> PortError:
    """The refusal for `host:port`, given as `flag`; `error` the bind's (None: unknown)."""
    if error is not None and error.errno == errno.EADDRINUSE:
        reason = "the port is in use by another process (another specdec serve?)"
    elif error is not None:
        reason = error.strerror or str(error)
    else:
        reason = "it could not be bound"
    return PortError(
        f"Cannot listen on {host}:{port} ({flag} {port}): {reason}. Stop what uses it, or pass "
        f"another port to {flag} (0 picks a free one)."
    )


def probe(host: str, port: int, flag: str) -> PortError:
    """Why a server could not bind `host:port` (a plain bind shows the OS's reason)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as e:
            return port_error(host, port, flag, e)
    return port_error(host, port, flag, None)


def bind(host: str, port: int, flag: str) -> socket.socket:
    """A listening TCP socket on `host:port` (0: a free port); PortError names `flag`."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    # SO_REUSEADDR lets a restarted server bind past TIME_WAIT; on Linux it never shares a
    # port another socket listens on (SO_REUSEPORT would, and is not set)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise port_error(host, port, flag, e) from None
    return sock
