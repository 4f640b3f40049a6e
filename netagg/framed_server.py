"""The request servers' one TCP server: :mod:`netagg.psproto` frames, one answer per request.

Used by the parameter server (hoststack/server.py), the MLfabric PS chain (mlfabric/async_server.py)
and the aggregation service (mlfabric/aggregation.py). :class:`FramedServer` accepts connections and
serves each in its own thread, one handler call per frame:

* a handler's ``KeyError``/``TypeError``/``ValueError`` is a bad request: answered
  ``{"ok": false, "error": ...}`` (``on_error`` is told);
* any other exception is a fault of the server: logged with its traceback and answered
  ``{"ok": false, "error": "internal error: ..."}`` (``on_error`` is told too). Either way the
  connection is kept: a broken connection is what clients fail over from, retrying into the same fault;
* a frame that is not one (garbage, oversize, cut off, slower than ``frame_timeout``) closes its
  connection (``on_malformed`` is told); the server keeps serving everyone else.

:func:`dispatch` is the handler side: the job-id check, the job-secret check
(:func:`netagg.jobsecret.require`), then the handler of the request's op.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from netagg import jobsecret
from netagg.psproto import ConnectionClosed, ProtocolError, recv_frame, send_frame

_log = logging.getLogger(__name__)

__all__ = ["Frame", "FramedServer", "Handler", "Reply", "Session", "dispatch", "listen", "serve"]

_POLL_SECONDS = 0.1
#: The exceptions that make a request a bad one (the client's fault), not the server's.
BAD_REQUEST = (KeyError, TypeError, ValueError)


@dataclass
class Frame:
    """One received request: its JSON header, blob, and when its first and last bytes arrived."""

    header: dict[str, Any]
    blob: bytearray
    first_byte: float
    last_byte: float


#: An answer: the response header and its blob.
Reply = tuple[dict[str, Any], bytes | bytearray]
#: Answers one request (raising for a refusal, see the module docstring).
Handler = Callable[[Frame], Reply]
#: One connection's handler and what runs when it closes (None: nothing).
Session = tuple[Handler, Callable[[], None] | None]


def dispatch(frame: Frame, handlers: Mapping[str, Handler], *, job_id: int, secret: str,
             on_bad_secret: Callable[[], None], server: str = "this server",
             unknown: str = "unknown op {op!r}") -> Reply:
    """Run the handler of the request's op once its job id and the job's secret were checked.

    ValueError (a bad request) for another job's request (``server`` names this one in the reason),
    a wrong or missing secret (``on_bad_secret`` is called first) or an op not in ``handlers``
    (the reason: ``unknown`` formatted with ``op``).
    """
    header = frame.header
    if header.get("job_id") != job_id:
        raise ValueError(f"request for job {header.get('job_id')!r}; {server} serves job {job_id}")
    jobsecret.require(secret, header, on_bad_secret)
    op = header.get("op")
    handler = handlers.get(op) if isinstance(op, str) else None
    if handler is None:
        raise ValueError(unknown.format(op=op))
    return handler(frame)


def _answer(handle: Handler, frame: Frame, on_error: Callable[[str], None] | None) -> Reply:
    """``handle(frame)``, or the error answer for what it raised (see the module docstring)."""
    try:
        return handle(frame)
    except BAD_REQUEST as err:
        message = f"{type(err).__name__}: {err}"
    except Exception as err:  # a fault of the server's own: answered and logged, the connection kept
        _log.exception("request %r failed", frame.header.get("op"))
        message = f"internal error: {type(err).__name__}: {err}"
    if on_error is not None:
        on_error(message)
    return {"ok": False, "error": message}, b""


def serve(conn: socket.socket, handle: Handler, stop: threading.Event, *, frame_timeout: float = 30.0,
          on_malformed: Callable[[str], None] | None = None, on_error: Callable[[str], None] | None = None,
          on_close: Callable[[], None] | None = None) -> None:
    """Serve one connection until the peer closes it, a frame is malformed or ``stop`` is set.

    ``on_close`` runs when the connection ends, however it ends.
    """
    try:
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
                response, data = _answer(handle, Frame(header, blob, first, time.monotonic()), on_error)
                try:
                    send_frame(conn, response, data)
                except OSError:
                    return
    finally:
        if on_close is not None:
            on_close()


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


class FramedServer:
    """Accepts connections on ``sock`` (listening, with a short timeout: :func:`listen`) until stopped.

    ``session()`` is called per connection and returns its ``(handler, on_close)``; each connection
    is served by :func:`serve` in its own thread, with ``frame_timeout``, ``on_malformed`` and
    ``on_error``. ``stop`` (default: the server's own event) stops accepting and serving.
    """

    def __init__(self, sock: socket.socket, session: Callable[[], Session], *, name: str,
                 stop: threading.Event | None = None, frame_timeout: float = 30.0,
                 on_malformed: Callable[[str], None] | None = None,
                 on_error: Callable[[str], None] | None = None, per_source: int | None = None,
                 on_refused: Callable[[str], None] | None = None) -> None:
        """``per_source``: the most connections one source address may hold at once; a connection beyond it is
        closed at once (``on_refused`` is told), so one host cannot take every thread of a server shared by
        tenants. None: no limit."""
        self.sock = sock
        self.address: tuple[str, int] = sock.getsockname()
        self.name = name
        self._session = session
        self._stop = stop if stop is not None else threading.Event()
        self._serve_options: dict[str, Any] = {"frame_timeout": frame_timeout, "on_malformed": on_malformed,
                                               "on_error": on_error}
        self._thread: threading.Thread | None = None
        self._per_source = per_source
        self._on_refused = on_refused
        self._open: dict[str, int] = {}
        self._open_lock = threading.Lock()

    def start(self) -> FramedServer:
        self._thread = threading.Thread(target=self._accept_loop, name=f"{self.name}-accept", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting and serving (connections end within a poll interval) and close the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sock.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except (TimeoutError, BlockingIOError):
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(_POLL_SECONDS)
                continue
            source = peer[0] if isinstance(peer, tuple) else str(peer)
            if not self._admit(source):
                conn.close()
                if self._on_refused is not None:
                    self._on_refused(f"{source}: more than {self._per_source} connections")
                continue
            handle, on_close = self._session()
            threading.Thread(target=serve, args=(conn, handle, self._stop),
                             kwargs={**self._serve_options, "on_close": self._closer(source, on_close)},
                             name=self.name, daemon=True).start()

    def _admit(self, source: str) -> bool:
        with self._open_lock:
            if self._per_source is not None and self._open.get(source, 0) >= self._per_source:
                return False
            self._open[source] = self._open.get(source, 0) + 1
            return True

    def _closer(self, source: str, on_close: Callable[[], None] | None) -> Callable[[], None]:
        def closed() -> None:
            with self._open_lock:
                self._open[source] -= 1
                if not self._open[source]:
                    del self._open[source]
            if on_close is not None:
                on_close()
        return closed
