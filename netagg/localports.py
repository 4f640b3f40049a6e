"""Free local ports for tests, demos and benchmarks."""

from __future__ import annotations

import socket


def free_ports(count: int, kind: str = "udp", host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ``kind`` ("udp" or "tcp") ports on ``host`` that were free a moment ago.

    The sockets are closed before returning, so another process could take a port in
    between: callers bind them promptly (the usual race of this idiom).
    """
    sock_type = {"udp": socket.SOCK_DGRAM, "tcp": socket.SOCK_STREAM}[kind]
    socks = [socket.socket(socket.AF_INET, sock_type) for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
