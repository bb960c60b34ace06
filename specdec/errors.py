"""Typed errors shared by the services; the servers map each to one gRPC status code."""


class SpecdecError(Exception):
    """Base class of errors that carry a gRPC status name (see `grpc_code`)."""

    grpc_code = "INTERNAL"


class InvalidInputError(SpecdecError, ValueError):
    """Input from outside (a request, a config, a checkpoint) is invalid."""

    grpc_code = "INVALID_ARGUMENT"


class CacheFullError(SpecdecError):
    """The KV cache has no room for the request; nothing was evicted."""

    grpc_code = "RESOURCE_EXHAUSTED"


class UnknownRequestError(SpecdecError, KeyError):
    """A request id the service does not hold."""

    grpc_code = "NOT_FOUND"


class CheckpointError(SpecdecError, ValueError):
    """A model directory that is missing, corrupt, unsupported or too large for the device."""

    grpc_code = "FAILED_PRECONDITION"


class UnavailableError(SpecdecError):
    """The server cannot take the call now (stopping, or a part did not answer); retry."""

    grpc_code = "UNAVAILABLE"


class UnauthenticatedError(SpecdecError):
    """A call without the server's API key, or with another one."""

    grpc_code = "UNAUTHENTICATED"
