"""The controller's two errors: a refused request (``ServiceError``) and a failed P4Runtime call (``P4RuntimeError``).

Both carry a code (the CLI's exit status, the gRPC code name) and a message whose ``str()`` is one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from google.rpc import code_pb2, status_pb2
from p4.v1 import p4runtime_pb2 as p4rt

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


class ServiceError(Exception):
    """A request the service refuses; ``code`` picks the CLI's exit status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class UpdateError:
    """Why one update of a Write failed."""

    index: int
    code: str
    message: str


class P4RuntimeError(Exception):
    """A failed P4Runtime operation: the gRPC code name, a message, and per-update Write errors."""

    def __init__(self, code: str, message: str, errors: Sequence[UpdateError] = ()) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.errors = tuple(errors)

    def __str__(self) -> str:
        text = f"{self.code}: {self.message}"
        if self.errors:
            text += ": " + "; ".join(f"update #{e.index}: {e.code}: {e.message}" for e in self.errors)
        return " ".join(text.split())

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError, what: str) -> P4RuntimeError:
        """Wrap a gRPC error of the operation ``what``, decoding Write's per-update errors."""
        code = err.code() if hasattr(err, "code") else None
        name = code.name if code is not None else "UNKNOWN"
        total, errors = _update_errors(err)
        if errors:  # the server's own message (empty from PI) would repeat them
            return cls(name, f"{what}: {len(errors)} of {total} update(s) failed", errors)
        details = (err.details() if hasattr(err, "details") else None) or str(err)
        return cls(name, f"{what}: {details}")


def _update_errors(err: grpc.RpcError) -> tuple[int, list[UpdateError]]:
    """(number of updates, the failed ones) from the google.rpc.Status in the trailing metadata.

    That is how PI/BMv2 report a Write's failures: one p4.v1.Error per update, OK or not.
    """
    metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in metadata or ():
        if key != _STATUS_DETAILS_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        errors = []
        for i, packed in enumerate(status.details):
            error = p4rt.Error()
            if packed.Unpack(error) and error.canonical_code != code_pb2.OK:
                errors.append(UpdateError(i, code_pb2.Code.Name(error.canonical_code), error.message))
        return len(status.details), errors
    return 0, []


def client_error(message: str) -> P4RuntimeError:
    """A request the client refuses before sending it (a bad name or value): INVALID_ARGUMENT."""
    return P4RuntimeError("INVALID_ARGUMENT", f"(client) {message}")
