"""MLfabric's request/response framing: :mod:`netagg.psproto` frames over TCP, with timeouts.

A frame is ``!II`` (JSON length, blob length), a JSON object, then the blob (float32
values). :class:`Connection` is the client side: it tells a broken or silent peer
(:class:`Unreachable`, worth failing over) from a refusal (:class:`Refused`, the
peer answered ``{"ok": false, ...}``); it adds the job's shared secret
(:mod:`netagg.jobsecret`) to every request it sends, so no sender builds it into a
header itself. The server side is :mod:`netagg.framed_server`. The operations are listed
in docs/mlfabric.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from netagg.psproto import PsClient, PsError, PsRefused, PsUnreachable

__all__ = ["Connection", "FabricError", "Refused", "Unreachable", "from_blob", "to_blob"]

#: An MLfabric request failed (the host stack's client errors, under MLfabric's names).
FabricError = PsError
#: The peer could not be reached, broke the connection or did not answer in time: worth failing over.
Unreachable = PsUnreachable
#: The peer answered with ``ok: false``; the message is its reason.
Refused = PsRefused


def to_blob(values: np.ndarray) -> bytes:
    """float32 values as a frame blob."""
    return np.ascontiguousarray(values, np.float32).tobytes()


def from_blob(blob: bytes | bytearray, size: int | None = None) -> np.ndarray:
    """A frame blob as float32 values (a copy); ``size`` checks the count."""
    if len(blob) % 4:
        raise ValueError(f"blob of {len(blob)} bytes is not float32 values")
    values = np.frombuffer(bytes(blob), np.float32).copy()
    if size is not None and values.size != size:
        raise ValueError(f"expected {size} float32 values, got {values.size}")
    return values


class Connection(PsClient):
    """A client connection to one MLfabric endpoint (PS, replica or aggregator).

    Every request it sends carries ``secret``, the job's shared secret ("" = the job has none).
    """

    def __init__(self, address: tuple[str, int], timeout: float = 10.0, *, secret: str = "") -> None:
        super().__init__(address, timeout, secret=secret)  # PsClient adds it to every request

    def call(self, header: dict[str, Any], blob: bytes | bytearray | memoryview = b"",
             timeout: float | None = None) -> tuple[dict[str, Any], bytearray]:
        """Send one request, return the successful response; raises Unreachable or Refused."""
        return self.request(header, blob, timeout)
