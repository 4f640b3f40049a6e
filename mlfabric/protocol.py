"""MLfabric's request/response framing: :mod:`netagg.hoststack.psproto` frames over TCP, with timeouts.

A frame is ``!II`` (JSON length, blob length), a JSON object, then the blob (float32
values). :class:`Connection` is the client side: it tells a broken or silent peer
(:class:`Unreachable`, worth failing over) from a refusal (:class:`Refused`, the
peer answered ``{"ok": false, ...}``); it adds the job's shared secret
(:mod:`netagg.jobsecret`) to every request it sends, so no sender builds it into a
header itself. :func:`serve` is the server side of one connection: one handler call per
frame, a clear error response for bad requests, and the connection dropped (counted) on
a malformed frame. The servers check the secret with :func:`netagg.jobsecret.require`. The
operations are listed in docs/mlfabric.md.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from netagg.hoststack.psproto import (
    ConnectionClosed,
    ProtocolError,
    PsClient,
    PsError,
    PsRefused,
    PsUnreachable,
    recv_frame,
    send_frame,
)

_log = logging.getLogger(__name__)

__all__ = ["Connection", "FabricError", "Frame", "Refused", "Unreachable", "accept_loop",
           "from_blob", "listen", "serve", "to_blob"]

_POLL_SECONDS = 0.1
#: The reason a request without the job's secret gets (it never repeats what the request carried).


#: An MLfabric request failed (the host stack's client errors, under MLfabric's names).
FabricError = PsError
#: The peer could not be reached, broke the connection or did not answer in time: worth failing over.
Unreachable = PsUnreachable
#: The peer answered with ``ok: false``; the message is its reason.
Refused = PsRefused


@dataclass
class Frame:
    """One received request: its JSON header, blob, and when its first and last bytes arrived."""

    header: dict[str, Any]
    blob: bytearray
    first_byte: float
    last_byte: float


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


Handler = Callable[[Frame], tuple[dict[str, Any], bytes | bytearray]]


def serve(conn: socket.socket, handle: Handler, stop: threading.Event, *, frame_timeout: float = 30.0,
          on_malformed: Callable[[str], None] | None = None, on_error: Callable[[str], None] | None = None,
          on_close: Callable[[], None] | None = None) -> None:
    """Serve one connection until the peer closes it or ``stop`` is set.

    ``handle`` returns ``(response, blob)``; a ``ValueError``/``KeyError``/``TypeError`` it
    raises becomes ``{"ok": false, "error": ...}`` (``on_error`` is told); any other exception
    too, as an ``internal error`` logged with its traceback (a fault of the server must not
    look like a broken connection, which clients fail over from). A frame that is
    not one (garbage, oversize, cut off, slower than ``frame_timeout``) closes the
    connection (``on_malformed`` is told); the server keeps serving everyone else.
    ``on_close`` runs when the connection ends, however it ends.
    """
    try:
        _serve(conn, handle, stop, frame_timeout, on_malformed, on_error)
    finally:
        if on_close is not None:
            on_close()


def _serve(conn: socket.socket, handle: Handler, stop: threading.Event, frame_timeout: float,
           on_malformed: Callable[[str], None] | None, on_error: Callable[[str], None] | None) -> None:
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while not stop.is_set():
            try:
                readable, _, _ = select.select([conn], [], [], _POLL_SECONDS)
            except (OSError, ValueError):
                return
            if not readable:
                continue
            first = time.monotonic()
            conn.settimeout(frame_timeout)
            try:
                header, blob = recv_frame(conn)
            except ConnectionClosed:
                return
            except (ProtocolError, OSError) as err:
                if on_malformed is not None:
                    on_malformed(f"{type(err).__name__}: {err}")
                return
            if stop.is_set():  # stopped meanwhile: a stopped server answers nothing
                return
            frame = Frame(header, blob, first, time.monotonic())
            try:
                response, data = handle(frame)
            except (KeyError, TypeError, ValueError) as err:
                message = f"{type(err).__name__}: {err}"
                if on_error is not None:
                    on_error(message)
                response, data = {"ok": False, "error": message}, b""
            except Exception as err:  # a fault of the server's own: answered and logged, the connection kept
                _log.exception("request %r failed", header.get("op"))
                message = f"internal error: {type(err).__name__}: {err}"
                if on_error is not None:
                    on_error(message)
                response, data = {"ok": False, "error": message}, b""
            try:
                send_frame(conn, response, data)
            except OSError:
                return


def listen(address: tuple[str, int]) -> socket.socket:
    """A listening TCP socket with a short accept timeout (so accept loops can stop)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(64)
        sock.settimeout(_POLL_SECONDS)
    except OSError:
        sock.close()
        raise
    return sock


def accept_loop(sock: socket.socket, session: Callable[[], tuple[Handler, Callable[[], None] | None]],
                stop: threading.Event, name: str, **serve_options: Any) -> None:
    """Accept connections until ``stop``; each is served by :func:`serve` in its own thread.

    ``session()`` is called per connection and returns its ``(handler, on_close)``.
    """
    while not stop.is_set():
        try:
            conn, _ = sock.accept()
        except (TimeoutError, BlockingIOError):
            continue
        except OSError:
            if stop.is_set():
                return
            time.sleep(_POLL_SECONDS)
            continue
        handle, on_close = session()
        threading.Thread(target=serve, args=(conn, handle, stop), kwargs={**serve_options, "on_close": on_close},
                         name=name, daemon=True).start()
