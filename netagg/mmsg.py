"""Batched datagram I/O: Linux ``recvmmsg``/``sendmmsg`` over preallocated numpy buffers.

One system call moves up to a whole batch of datagrams (UDP) or frames (AF_PACKET), and
one ctypes call (about a microsecond) makes it, so Python's cost per packet shrinks by the
batch size. :class:`MsgBatch` owns the packet buffer (``capacity`` rows of ``stride``
bytes), the ``mmsghdr``/``iovec`` arrays the kernel reads and writes, and one 32-byte
address slot per message (``sockaddr_in`` for UDP, ``sockaddr_ll`` for raw sockets).
Compiled code (the software switch's fast path) can fill lengths and addresses directly
in these arrays; :meth:`MsgBatch.recv` and :meth:`MsgBatch.send_prepared` make the calls.

Only Linux on 64-bit little-endian machines has this layout; :data:`AVAILABLE` says
whether it can be used here (callers fall back to one ``recvfrom``/``send`` per packet).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import sys

import numpy as np

#: ``struct iovec`` and ``struct mmsghdr`` (``struct msghdr`` + ``msg_len``) on x86-64/aarch64 Linux.
IOVEC_DTYPE = np.dtype([("base", "<u8"), ("len", "<u8")])
MMSGHDR_DTYPE = np.dtype({
    "names": ["name", "namelen", "iov", "iovlen", "control", "controllen", "flags", "msg_len"],
    "formats": ["<u8", "<u4", "<u8", "<u8", "<u8", "<u8", "<i4", "<u4"],
    "offsets": [0, 8, 16, 24, 32, 40, 48, 56],
    "itemsize": 64,
})
#: Bytes reserved per message for its address (a sockaddr_ll is 20, a sockaddr_in 16).
NAME_BYTES = 32
#: sockaddr_in fields inside a name slot: family (host order), port and address (network order).
SIN_FAMILY, SIN_PORT, SIN_ADDR = 0, 2, 4
#: sockaddr_ll's packet type byte (PACKET_OUTGOING = 4: a copy of a frame this host sent).
SLL_PKTTYPE = 10
MSG_DONTWAIT = 0x40
#: Default batch: as many datagrams as one wake-up usually finds, and what the probe uses.
BATCH = 64

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
AVAILABLE = bool(_libc is not None and hasattr(_libc, "recvmmsg") and hasattr(_libc, "sendmmsg")
                 and sys.byteorder == "little" and ctypes.sizeof(ctypes.c_void_p) == 8)
if AVAILABLE:
    _recvmmsg = _libc.recvmmsg
    _recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
    _recvmmsg.restype = ctypes.c_int
    _sendmmsg = _libc.sendmmsg
    _sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    _sendmmsg.restype = ctypes.c_int

_RETRY = (errno.EAGAIN, errno.EWOULDBLOCK)


class MsgBatch:
    """Buffers and message headers for up to ``capacity`` datagrams of up to ``stride`` bytes.

    Row ``i`` of :attr:`buf` is message ``i``'s data; :attr:`headroom` bytes at the start of
    each row are left free on receive (the switch writes a synthesized frame header there).
    Receiving and sending use separate header arrays, so the receive side is set up once.
    """

    def __init__(self, capacity: int = BATCH, stride: int = 2048, headroom: int = 0) -> None:
        if not AVAILABLE:
            raise OSError("recvmmsg/sendmmsg are not available on this platform")
        self.capacity, self.stride, self.headroom = capacity, stride, headroom
        self.buf = np.zeros((capacity, stride), np.uint8)
        self.names = np.zeros((capacity, NAME_BYTES), np.uint8)
        step = np.arange(capacity, dtype=np.uint64)
        #: Start address of each row and of each name slot (the arrays never move).
        self.row_addr = np.uint64(self.buf.ctypes.data) + step * np.uint64(stride)
        self.name_addr = np.uint64(self.names.ctypes.data) + step * np.uint64(NAME_BYTES)
        # Receive side: row i (after the headroom) and name slot i, fixed.
        self.rx_iov = np.zeros(capacity, IOVEC_DTYPE)
        self.rx_iov["base"] = self.row_addr + np.uint64(headroom)
        self.rx_iov["len"] = stride - headroom
        self.rx_hdrs = np.zeros(capacity, MMSGHDR_DTYPE)
        self.rx_hdrs["iov"] = np.uint64(self.rx_iov.ctypes.data) + step * np.uint64(IOVEC_DTYPE.itemsize)
        self.rx_hdrs["iovlen"] = 1
        self.rx_hdrs["name"] = self.name_addr
        self.rx_hdrs["namelen"] = NAME_BYTES
        self._rx_words = self.rx_hdrs.view("<u4").reshape(capacity, 16)  # [:, 2] namelen, [:, 14] msg_len
        #: Lengths of the messages of the last :meth:`recv` (excluding the headroom): a view.
        self.lengths = self._rx_words[:, 14]
        # Send side: filled per batch through tx_words / tx_iov_words (compiled code or numpy).
        self.tx_iov = np.zeros(capacity, IOVEC_DTYPE)
        self.tx_hdrs = np.zeros(capacity, MMSGHDR_DTYPE)
        self.tx_hdrs["iov"] = np.uint64(self.tx_iov.ctypes.data) + step * np.uint64(IOVEC_DTYPE.itemsize)
        self.tx_hdrs["iovlen"] = 1
        #: The send headers as 64-bit words: [:, 0] name address, [:, 1] namelen; tx_iov_words [:, 0/1] base/len.
        self.tx_words = self.tx_hdrs.view("<u8").reshape(capacity, 8)
        self.tx_iov_words = self.tx_iov.view("<u8").reshape(capacity, 2)
        self._rx_addr = self.rx_hdrs.ctypes.data
        self._tx_addr = self.tx_hdrs.ctypes.data

    # -- receive ---------------------------------------------------------------
    def recv(self, fd: int, first: int = 0, limit: int | None = None) -> int:
        """Read waiting datagrams without blocking into rows ``first``, ``first + 1``, ... (at most
        ``limit``, or up to the end); returns how many (0: none).

        Message ``i``'s data is ``buf[i, headroom:headroom + lengths[i]]`` and its sender is in
        ``names[i]``. Raises OSError on a real error; an ICMP error queued on the socket
        (ECONNREFUSED after a send to a closed port) is consumed and reported as 0 datagrams.
        """
        room = self.capacity - first
        if limit is not None:
            room = min(room, limit)
        if room <= 0:
            return 0
        count = recv_headers(fd, self._rx_addr + first * MMSGHDR_DTYPE.itemsize, room)
        if count:
            self._rx_words[first:first + count, 2] = NAME_BYTES  # the kernel shortened them to the real length
        return count

    # -- send ------------------------------------------------------------------
    def send_prepared(self, fd: int, count: int, first: int = 0) -> tuple[int, int]:
        """Send messages ``first .. first+count-1`` whose ``tx_iov`` and ``tx_hdrs`` name fields are filled.

        Returns (sent, failed): a message the kernel refuses (full socket buffer, an error on
        one destination) is skipped and counted; the protocol's retransmission recovers it.
        """
        return send_headers(fd, self._tx_addr + first * MMSGHDR_DTYPE.itemsize, count)


def recv_headers(fd: int, address: int, count: int) -> int:
    """``recvmmsg`` without blocking into the ``count`` prepared headers at ``address``; returns how many.

    Nothing waiting, an interrupted call and an ICMP error queued on the socket (ECONNREFUSED after a
    send to a closed port, consumed by the call) all read as 0; a real error raises OSError.
    """
    got = _recvmmsg(fd, address, count, MSG_DONTWAIT, None)
    if got >= 0:
        return got
    err = ctypes.get_errno()
    if err in _RETRY or err in (errno.ECONNREFUSED, errno.EINTR):
        return 0
    raise OSError(err, os.strerror(err))


def send_headers(fd: int, address: int, count: int) -> tuple[int, int]:
    """``sendmmsg`` of the ``count`` prepared headers at ``address``, to the end; returns (sent, failed).

    A message the kernel refuses (full socket buffer, an error on one destination) is skipped and
    counted, and the rest go on; EINTR is retried.
    """
    done_total = failed = 0
    while done_total < count:
        done = _sendmmsg(fd, address + done_total * MMSGHDR_DTYPE.itemsize, count - done_total, 0)
        if done > 0:
            done_total += done
        elif done < 0 and ctypes.get_errno() == errno.EINTR:
            continue
        else:
            done_total += 1
            failed += 1
    return count - failed, failed


def sockaddr_in(host: str, port: int) -> np.ndarray:
    """One sockaddr_in as 16 bytes (a destination for ``tx_words``' name pointers)."""
    out = np.zeros(16, np.uint8)
    out[0:2] = np.frombuffer(socket.AF_INET.to_bytes(2, sys.byteorder), np.uint8)
    out[2:4] = np.frombuffer(port.to_bytes(2, "big"), np.uint8)
    out[4:8] = np.frombuffer(socket.inet_aton(host), np.uint8)
    return out
