"""The worker <-> parameter server control protocol: request/response frames over TCP.

A frame is ``!II`` (JSON length, blob length), a UTF-8 JSON object, then the blob (raw
array bytes, described by the JSON). Every request gets exactly one response; a
response is ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``. The operations
are listed in docs/hoststack.md. Every socket operation has a timeout.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from collections import deque
from typing import Any, NoReturn

from netagg.jobsecret import with_secret

_FRAME = struct.Struct("!II")
MAX_JSON_BYTES = 1 << 24
MAX_BLOB_BYTES = 1 << 31


class PsError(RuntimeError):
    """The parameter server refused a request, or the connection to it broke or timed out."""


class ProtocolError(PsError):
    """A frame that does not follow the protocol."""


class ConnectionClosed(ConnectionError):
    """The peer closed the connection between frames."""


#: Bytes handed to the kernel per ``send`` (each one waits at most the socket's timeout for room).
_SEND_CHUNK = 1 << 20


def send_frame(sock: socket.socket, header: dict[str, Any], blob: bytes | bytearray | memoryview = b"") -> None:
    """Send one frame. The socket's timeout bounds each wait for room to send, not the whole frame: a large
    frame over a slow link takes as long as it takes while it moves, and fails once it stops moving for the
    timeout (as receiving does, one ``recv`` at a time)."""
    text = json.dumps(header, separators=(",", ":")).encode()
    view = memoryview(blob).cast("B")
    _send_all(sock, memoryview(_FRAME.pack(len(text), view.nbytes) + text))
    if view.nbytes:
        _send_all(sock, view)


def _send_all(sock: socket.socket, view: memoryview) -> None:
    """``sendall`` whose timeout applies to each ``send`` (Python's ``sendall`` applies it to the total)."""
    sent = 0
    while sent < view.nbytes:
        sent += sock.send(view[sent:sent + _SEND_CHUNK])


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed mid-frame") if got else ConnectionClosed("connection closed")
        got += n
    return buf


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytearray]:
    """Receive one frame; raises ProtocolError on oversize or non-JSON frames."""
    json_len, blob_len = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if json_len > MAX_JSON_BYTES or blob_len > MAX_BLOB_BYTES:
        raise ProtocolError(f"frame too large ({json_len} + {blob_len} bytes)")
    try:
        header = json.loads(_recv_exact(sock, json_len))
    except ValueError as err:
        raise ProtocolError(f"frame header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise ProtocolError("frame header is not a JSON object")
    return header, _recv_exact(sock, blob_len) if blob_len else bytearray()


class PsUnreachable(PsError):
    """The server could not be reached, broke the connection, sent garbage or did not answer in time."""


class PsRefused(PsError):
    """The server answered ``{"ok": false, ...}``; the message is its reason."""


class PsClient:
    """A client connection to a parameter server (or any server speaking these frames).

    One request at a time (a lock serializes threads). A connection that failed is
    closed: the caller reconnects, or fails over, by making a new client.
    """

    def __init__(self, address: tuple[str, int], timeout: float = 30.0, secret: str = "") -> None:
        self.address = address
        self.timeout = timeout
        #: The job's secret (netagg/jobsecret.py), added to every request; "" for none.
        self._secret = secret
        try:
            self.sock = socket.create_connection(address, timeout=timeout)
        except OSError as err:
            raise PsUnreachable(f"cannot connect to the parameter server at {address[0]}:{address[1]}: "
                                f"{err}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()
        self._pending: deque[dict[str, Any]] = deque()
        #: The thread whose begun requests hold the connection.
        self._owner = 0

    def request(self, header: dict[str, Any], blob: bytes | bytearray | memoryview = b"",
                timeout: float | None = None) -> tuple[dict[str, Any], bytearray]:
        """Send a request and return the successful response; raises PsUnreachable or PsRefused."""
        self.begin(header, blob, timeout)
        return self.finish()

    def begin(self, header: dict[str, Any], blob: bytes | bytearray | memoryview = b"",
              timeout: float | None = None) -> None:
        """Send a request whose response :meth:`finish` reads later (overlap work with the round trip).

        Several requests may be begun; ``finish`` reads their responses in the same order. The
        connection is held from the first ``begin`` to the last ``finish``: other threads' requests wait.
        """
        if not self._pending or self._owner != threading.get_ident():
            self._lock.acquire()
            self._owner = threading.get_ident()
        try:
            self._send(header, blob, timeout)
        except BaseException:
            self._drop_pending()
            raise
        self._pending.append(header)

    def finish(self) -> tuple[dict[str, Any], bytearray]:
        """The response of the oldest request :meth:`begin` sent; raises PsUnreachable or PsRefused."""
        if not self._pending:
            raise RuntimeError("finish() without begin()")
        try:
            result = self._receive(self._pending[0])
        except PsRefused:
            self._done_one()
            raise
        except BaseException:
            self._drop_pending()
            raise
        self._done_one()
        return result

    def abort(self) -> None:
        """Close the connection without reading the pending answers (e.g. a pull that now cannot complete)."""
        self.close()
        if self._pending:
            self._drop_pending()

    def _done_one(self) -> None:
        self._pending.popleft()
        if not self._pending:
            self._lock.release()

    def _drop_pending(self) -> None:
        """The connection broke or was closed: forget what was pending and release it (the caller holds it)."""
        self._pending.clear()
        self._lock.release()

    def _send(self, header: dict[str, Any], blob: bytes | bytearray | memoryview, timeout: float | None) -> None:
        self.sock.settimeout(self.timeout if timeout is None else timeout)
        try:
            send_frame(self.sock, with_secret(header, self._secret), blob)
        except OSError as err:
            self._broke(header, err)

    def _receive(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytearray]:
        try:
            response, data = recv_frame(self.sock)
        except (OSError, ProtocolError, ConnectionClosed) as err:
            self._broke(header, err)
        if not response.get("ok"):
            raise PsRefused(str(response.get("error", "no reason given")))
        return response, data

    def _broke(self, header: dict[str, Any], err: BaseException) -> NoReturn:
        self.close()
        what = "did not answer in time" if isinstance(err, TimeoutError) else f"broke: {err}"
        raise PsUnreachable(f"{self.address[0]}:{self.address[1]} {header.get('op')}: {what}") from None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
