"""Local ports for tests, demos and benchmarks, from a window outside the kernel's ephemeral range.

Why not "bind port 0, read the number, close": port 0 draws from the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the same range every
``connect()`` and every other ``bind(port 0)`` draws from. Once the probe socket is closed, any
socket of any process may be given that number before the caller binds it, and a caller that
binds UDP and TCP on one number (the PS) loses whenever some TCP connection's local port
happens to be it. A port outside that range is never handed out by the kernel on its own: only
a socket that names it explicitly can take it.

The window: :data:`PREFERRED_WINDOW`, 20000-28799. It lies above 10000 (clear of the
privileged ports and of the low ports services commonly claim) and below Linux's default
ephemeral low end 32768 (macOS and the BSDs start theirs at 49152), and stops short of
28800-29999, where the project's fixed ports live (netagg's UDP port 28900, the PS ports
29000-29002 of ``configs/`` and the tests, gloo's 29500, the example's 29600). When the
machine's ephemeral range overlaps that window, the largest stretch of 10000-65535 outside the
ephemeral range (and outside 28800-29999) is used instead; when the file cannot be read,
Linux's default range is assumed.

Where the code that binds is the test's own, binding port 0 and keeping the socket is better
still; this module is for ports that must be named before anything binds them (configs,
command lines of child processes, a controller's job table).
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Sequence

EPHEMERAL_RANGE_PATH = "/proc/sys/net/ipv4/ip_local_port_range"
#: Linux's default ``ip_local_port_range``, assumed where the file is absent or unreadable.
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
#: ``[start, stop)``: the ports handed out when the ephemeral range leaves them alone.
PREFERRED_WINDOW = (20000, 28800)
#: Nothing below this is handed out.
FLOOR = 10000
#: ``[start, stop)``: the project's fixed ports (28900, 29000-29002, 29500, 29600): never handed out.
FIXED_PORTS = (28800, 30000)
#: A fallback window smaller than this is refused (RuntimeError) rather than used.
MIN_WINDOW = 256

_KINDS = {
    "udp": (socket.SOCK_DGRAM,),
    "tcp": (socket.SOCK_STREAM,),
    "both": (socket.SOCK_DGRAM, socket.SOCK_STREAM),
}


def ephemeral_range(path: str = EPHEMERAL_RANGE_PATH) -> tuple[int, int]:
    """The kernel's ephemeral ports ``(low, high)``, both included (Linux's default if ``path`` is unreadable)."""
    try:
        with open(path) as f:
            low, high = (int(field) for field in f.read().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return (low, high) if 0 < low <= high <= 65535 else DEFAULT_EPHEMERAL_RANGE


def port_window(ephemeral: tuple[int, int] | None = None) -> range:
    """The ports :func:`free_ports` draws from, given the ephemeral range (see the module docstring)."""
    low, high = ephemeral or ephemeral_range()
    start, stop = PREFERRED_WINDOW
    if stop <= low or start > high:
        return range(start, stop)
    pieces = []
    for a, b in ((FLOOR, low), (high + 1, 65536)):  # outside the ephemeral range...
        for c, d in ((a, min(b, FIXED_PORTS[0])), (max(a, FIXED_PORTS[1]), b)):  # ...and the fixed ports
            if d > c:
                pieces.append(range(c, d))
    best = max(pieces, key=len, default=range(0))
    if len(best) < MIN_WINDOW:
        raise RuntimeError(f"no room for test ports: the ephemeral range {low}-{high} leaves fewer than "
                           f"{MIN_WINDOW} ports of {FLOOR}-65535 outside it")
    return best


def _pid_offset(size: int) -> int:
    """Where a process starts in a window of ``size``: spread by the pid (consecutive pids land far apart)."""
    return (os.getpid() * 2654435761 & 0xFFFFFFFF) % size


class PortAllocator:
    """Hands out ports of ``ports`` (a window) once each, from ``offset`` on, skipping busy ones; thread-safe."""

    def __init__(self, ports: Sequence[int], offset: int = 0) -> None:
        if not ports:
            raise ValueError("an empty port window")
        self.ports = ports
        self.cursor = offset % len(ports)
        self.given: set[int] = set()
        self.lock = threading.Lock()

    def take(self, count: int, kind: str = "udp", host: str = "127.0.0.1") -> list[int]:
        """``count`` distinct ports never handed out before, each free for ``kind`` on ``host`` when checked."""
        if kind not in _KINDS:
            raise ValueError(f"kind: {kind!r}; expected one of {', '.join(_KINDS)}")
        if count < 0:
            raise ValueError(f"count: {count} < 0")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        taken: list[int] = []
        with self.lock:
            for _ in range(len(self.ports)):
                if len(taken) == count:
                    break
                port = self.ports[self.cursor]
                self.cursor = (self.cursor + 1) % len(self.ports)
                if port not in self.given and _is_free(family, host, port, _KINDS[kind]):
                    self.given.add(port)
                    taken.append(port)
            if len(taken) < count:
                self.given.difference_update(taken)  # not handed out after all
                raise RuntimeError(
                    f"only {len(taken)} of {count} {kind} ports free on {host} in {self.ports[0]}-{self.ports[-1]} "
                    f"({len(self.given)} already handed out by this process)")
        return taken


def _is_free(family: int, host: str, port: int, sock_types: Sequence[int]) -> bool:
    """Whether ``host:port`` can be bound now for every type of ``sock_types`` (SO_REUSEADDR off)."""
    for sock_type in sock_types:
        with socket.socket(family, sock_type) as probe:
            try:
                probe.bind((host, port))  # SO_REUSEADDR left off: TIME_WAIT and listeners count as busy
            except OSError as err:
                if err.errno in (errno.EADDRINUSE, errno.EACCES):
                    return False
                raise  # e.g. EADDRNOTAVAIL: host is not an address of this machine
    return True


_default: PortAllocator | None = None
_default_lock = threading.Lock()


def _allocator() -> PortAllocator:
    global _default
    with _default_lock:
        if _default is None:
            window = port_window()
            _default = PortAllocator(window, _pid_offset(len(window)))
        return _default


def _after_fork_in_child() -> None:
    """A forked child keeps the parent's handed-out set (those ports are the parent's) but starts elsewhere."""
    global _default_lock
    _default_lock = threading.Lock()
    if _default is not None:
        _default.lock = threading.Lock()
        _default.cursor = _pid_offset(len(_default.ports))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def free_ports(count: int, kind: str = "udp", host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports on ``host`` for a caller that binds them (or hands them to a child process).

    ``kind``: "udp" or "tcp" checks that protocol; "both" checks UDP and TCP, for a caller that binds
    both on one number (the PS: UDP for packets, TCP for its control protocol).

    Guaranteed:

    * every port lies in :func:`port_window`, outside the kernel's ephemeral range as read at this
      process's first call, so the kernel never gives it to a socket that did not ask for it by number
      (a ``bind`` to port 0, a ``connect``'s local port);
    * no port is handed out twice by this process (threads included; a forked child keeps the parent's
      handed-out set and moves its cursor);
    * each port could be bound on ``host`` for the ``kind``'s protocols without SO_REUSEADDR at the
      moment it was checked (nothing bound or listening on it, no TIME_WAIT connection).

    Not guaranteed: that it is still free when the caller binds it. Another process can name the same
    number first: another test process (each starts at a pid-derived offset in the window, so this is
    rare, not impossible) or a service with a fixed port in the window. A protocol ``kind`` does not
    name is not checked. RuntimeError when the window has no ``count`` ports left.
    """
    return _allocator().take(count, kind, host)
