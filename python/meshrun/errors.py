"""Exceptions: every coordinator error surfaces as one of these, with the coordinator's message.

The classes also derive from the built-in exception a Python user expects for the gRPC status
(INVALID_ARGUMENT -> ValueError, NOT_FOUND -> KeyError, UNAVAILABLE -> ConnectionError, ...), so
`except ValueError` works as it would around jax.jit.
"""
import grpc


class MeshrunError(Exception):
    """Base class. `code` is the gRPC status code (grpc.StatusCode) or None."""

    code = None

    def __str__(self):  # KeyError would print the repr of its message
        return str(self.args[0]) if self.args else ""


class InvalidArgumentError(MeshrunError, ValueError):
    """A bad shape, dtype, sharding or program (INVALID_ARGUMENT, OUT_OF_RANGE)."""


class UnsupportedPrimitiveError(InvalidArgumentError):
    """A jaxpr primitive meshrun cannot convert; the message names it and the user's file:line."""


class NotFoundError(MeshrunError, KeyError):
    """An array, input or checkpoint that does not exist (NOT_FOUND)."""


class AlreadyExistsError(MeshrunError, FileExistsError):
    """ALREADY_EXISTS."""


class ClusterConnectionError(MeshrunError, ConnectionError):
    """The cluster cannot be reached (UNAVAILABLE), or did not answer in time."""


class DeadlineExceededError(MeshrunError, TimeoutError):
    """A call or a collective ran past its deadline (DEADLINE_EXCEEDED); names the rank."""


class PermissionDeniedError(MeshrunError, PermissionError):
    """UNAUTHENTICATED or PERMISSION_DENIED: missing or wrong credentials, a path outside a root."""


class ResourceExhaustedError(MeshrunError, MemoryError):
    """A request past a worker's memory budget (RESOURCE_EXHAUSTED)."""


class FailedPreconditionError(MeshrunError, RuntimeError):
    """FAILED_PRECONDITION, ABORTED: the cluster is not in a state to run the call."""


class InternalError(MeshrunError, RuntimeError):
    """Any other status."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.UNAVAILABLE: ClusterConnectionError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDeniedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.ABORTED: FailedPreconditionError,
}


def from_rpc_error(err: grpc.RpcError, what: str) -> MeshrunError:
    """The exception for a failed RPC `what` (e.g. "Jit"), carrying the coordinator's message."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, InternalError)
    exc = cls(f"{what}: {details}" if details else f"{what}: {code}")
    exc.code = code
    return exc
