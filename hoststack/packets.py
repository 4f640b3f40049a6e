"""Numpy views of netagg packets and small helpers shared by the worker and the PS.

The record dtype below is *derived* from ``wire.HEADER_FIELDS`` (the one wire-format
definition), so a ``(n,)`` array of :data:`PACKET_DTYPE` is ``n`` packets exactly as
``wire.pack`` lays them out: headers can be filled for a whole batch with numpy and
each row sent as is.
"""

from __future__ import annotations

import socket

import numpy as np

from netagg import wire
from netagg.jobconfig import WorkerConfig

_DTYPE_CODES = {(8, False): ">u1", (8, True): ">i1", (16, False): ">u2", (32, False): ">u4"}
#: One netagg header as a numpy record (big-endian fields in wire order).
HEADER_DTYPE = np.dtype([(f.name, _DTYPE_CODES[(f.bits, f.signed)]) for f in wire.HEADER_FIELDS])


def packet_dtype(k: int) -> np.dtype:
    """One whole netagg message of width ``k``: header plus ``k`` big-endian int32 values."""
    wire.width_code(k)
    return np.dtype([("hdr", HEADER_DTYPE), ("values", wire.WIRE_VALUE_DTYPE, (k,))])


def headers(rows: np.ndarray) -> np.ndarray:
    """The netagg headers of received rows (``(n, >= HEADER_BYTES)`` uint8) as :data:`HEADER_DTYPE` records."""
    return np.ascontiguousarray(rows[:, :wire.HEADER_BYTES]).view(HEADER_DTYPE)[:, 0]


#: A narrow message (``wire.K`` values).
PACKET_DTYPE = packet_dtype(wire.K)
assert HEADER_DTYPE.itemsize == wire.HEADER_BYTES and PACKET_DTYPE.itemsize == wire.NETAGG_BYTES
assert packet_dtype(wire.WIDE_K).itemsize == wire.netagg_bytes(wire.WIDE_K)

#: A receive buffer row: every message of either width fits, a longer datagram is cut (and counted as malformed).
RECV_ROW_BYTES = 1152
assert wire.netagg_bytes(wire.WIDE_K) < RECV_ROW_BYTES

#: Slots used in fallback mode when the controller reserved none on the switch.
DEFAULT_FALLBACK_SLOTS = 64
#: Bit 31 of ``seq`` marks an exponent probe (zeros, first window); data blocks use bits 0..30.
PROBE_SEQ_BIT = 0x80000000
SEQ_MASK = 0x7FFFFFFF
#: Socket buffer sizes asked for (the kernel may cap them at net.core.*mem_max).
SOCKET_BUFFER_BYTES = 4 << 20


def slot_count_of(config: WorkerConfig) -> int:
    """The job's window: ``slot_count``, or :data:`DEFAULT_FALLBACK_SLOTS` in fallback mode without one."""
    if config.slot_count >= 1:
        return config.slot_count
    return DEFAULT_FALLBACK_SLOTS


def udp_socket(bind: tuple[str, int], bound: socket.socket | None = None) -> socket.socket:
    """A non-blocking UDP socket bound to ``bind`` with large buffers.

    ``bound``: a UDP socket the caller already bound (and kept, so no other socket could take its
    port meanwhile) to use instead; its port must be ``bind``'s (ValueError otherwise)."""
    sock = bound if bound is not None else socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        if bound is None:
            sock.bind(bind)
        elif bind[1] and sock.getsockname()[1] != bind[1]:
            raise ValueError(f"the socket given is bound to port {sock.getsockname()[1]}, the config says {bind[1]}")
        sock.setblocking(False)
    except (OSError, ValueError):
        sock.close()
        raise
    return sock
