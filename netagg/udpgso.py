"""UDP segmentation offload in batches: many datagrams per send (``UDP_SEGMENT``) and per receive (``UDP_GRO``).

:mod:`netagg.mmsg` moves a batch of datagrams with one system call, but the kernel still
walks its socket and IP layers once per datagram. With UDP GSO one ``sendmsg`` hands the
kernel a run of equal-size segments (the last may be shorter) that crosses loopback and
veth as one packet and is cut into datagrams only where it must be; with ``UDP_GRO`` on the
receiving socket such a packet is read as one buffer plus a control message naming the
segment size. On the machines netagg runs on this is ~30x the datagrams per second of
``sendmmsg``/``recvmmsg`` (``make bench-switch`` prints both ceilings).

* :class:`GsoBatch` sends runs of segments: header ``h`` points at ``iovlen`` consecutive
  iovecs (one per segment) and, when it holds more than one, at a ``UDP_SEGMENT`` control
  message with the segment size. Callers (numpy here, compiled code in the software switch)
  fill the headers; :meth:`GsoBatch.send` makes one ``sendmmsg`` for all of them. When the
  kernel refuses a segmented send (no checksum offload on the route, an old kernel), the
  batch logs why once, falls back to one datagram per message for the rest of its life,
  and resends what was refused.
* :class:`GroBatch` receives: ``recvmmsg`` of up to a few coalesced buffers, each split by its
  ``UDP_GRO`` size into rows of :attr:`GroBatch.buf` (with the same ``buf``/``lengths``/``names``
  and ``recv`` as :class:`~netagg.mmsg.MsgBatch`, so a caller takes either).

The receiver of a segmented send without ``UDP_GRO`` gets ordinary datagrams, so both ends
choose independently. :func:`gso_unavailable` says, once per process, whether segmented
sends work here: it sends equal-size segments over loopback and compares what arrives
(Linux 7.0 to 7.1.4 corrupted such sends; a known regression fixed upstream).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import platform
import socket

import numpy as np

from netagg import mmsg, wire

try:  # compiled per-batch loops when numba is installed (extra "fast"); same effects, faster
    from netagg import udpgso_kernels as _kernels
except ImportError:
    _kernels = None

log = logging.getLogger(__name__)

SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
SOL_IP = 0
IP_TOS = 1
IP_RECVTOS = 13
#: Segments in one send: the kernel's UDP_MAX_SEGMENTS (64; newer kernels allow 128).
MAX_SEGMENTS = 64
#: Bytes of all segments of one send: a UDP datagram's payload limit, less some slack.
MAX_SEND_BYTES = 65000
#: ``struct cmsghdr`` (len, level, type) + a u16 segment size, padded: CMSG_SPACE(2).
CONTROL_BYTES = 24
_CMSG_LEN_U16 = 18
#: Receive control buffer per message (room for the UDP_GRO cmsg and anything else).
RX_CONTROL_BYTES = 64
#: A coalesced receive buffer: the largest GRO packet.
GRO_BUFFER_BYTES = 65536
#: Errors that mean "this socket or route cannot segment": fall back to one datagram per message.
_REFUSED = (errno.EIO, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOPROTOOPT, errno.EMSGSIZE)
_sendmmsg = mmsg._sendmmsg if mmsg.AVAILABLE else None


def enable_gro(sock: socket.socket) -> bool:
    """Ask for coalesced receives on ``sock``; False where the kernel does not offer ``UDP_GRO``."""
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
    except OSError:
        return False
    return True


def enable_ecn(sock: socket.socket, tos: int = wire.ECN_ECT0) -> bool:
    """Send with ECN bits ``tos`` (ECT(0): a queue on the way may mark CE instead of dropping) and receive each
    datagram's TOS (``IP_RECVTOS``: :class:`GroBatch` counts CE-marked datagrams); False where refused."""
    try:
        sock.setsockopt(SOL_IP, IP_TOS, tos)
        sock.setsockopt(SOL_IP, IP_RECVTOS, 1)
    except OSError:
        return False
    return True


def _kernel_in_regression(release: str) -> bool:
    """Whether ``release`` (``uname -r``) is one of Linux 7.0 to 7.1.4 (equal-size GSO sends corrupted)."""
    try:
        parts = [int(p) for p in release.split("-")[0].split(".")[:3]]
    except ValueError:
        return False
    parts += [0] * (3 - len(parts))
    return (7, 0, 0) <= tuple(parts) <= (7, 1, 4)


@functools.cache
def gso_unavailable() -> str | None:
    """Why segmented sends cannot be used in this process, or None when they work.

    Sends three equal-size segments with ``UDP_SEGMENT`` over loopback and checks that three
    datagrams of exactly those bytes arrive (both with and without ``UDP_GRO`` at the receiver).
    ``NETAGG_UDP_GSO=0`` in the environment turns segmentation off.
    """
    if os.environ.get("NETAGG_UDP_GSO", "1") == "0":
        return "NETAGG_UDP_GSO=0 in the environment"
    if not mmsg.AVAILABLE:
        return "recvmmsg/sendmmsg are not available on this platform"
    release = platform.release()
    size, count = 276, 3
    payload = bytes(np.arange(size * count, dtype=np.uint32).astype(np.uint8) ^ 0x5A)
    for gro in (False, True):
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            rx.bind(("127.0.0.1", 0))
            rx.settimeout(1.0)
            if gro and not enable_gro(rx):
                continue
            try:
                tx.setsockopt(SOL_UDP, UDP_SEGMENT, size)
                tx.sendto(payload, rx.getsockname())
            except OSError as err:
                return f"the kernel refuses UDP_SEGMENT ({err})"
            got = b""
            try:
                while len(got) < len(payload):
                    data, ancillary, _, _ = rx.recvmsg(GRO_BUFFER_BYTES, 64)
                    segment = size
                    for level, kind, value in ancillary:
                        if level == SOL_UDP and kind == UDP_GRO:
                            segment = int.from_bytes(value[:4], "little")
                    if segment != size or len(data) % size:
                        return f"a segmented send arrived cut into {len(data)}-byte pieces of {segment}"
                    got += data
            except TimeoutError:
                return f"only {len(got)} of {len(payload)} bytes of a segmented send arrived"
            if got != payload:
                regression = " (Linux 7.0-7.1.4 corrupt equal-size GSO sends)" if _kernel_in_regression(
                    release) else ""
                return f"kernel {release} corrupted a segmented send{regression}"
        finally:
            tx.close()
            rx.close()
    return None


class GsoBatch:
    """Message headers for segmented sends of up to ``capacity`` segments (see the module docstring).

    A caller writes segment ``j``'s address and length into ``iov_words[j]``, and per header
    ``h`` its name pointer/length (``hdr_words[h, 0/1]``), its first iovec's address
    (``iov_addr + 16 * first``) and count (``hdr_words[h, 2/3]``), the control pointer and
    length (``hdr_words[h, 4/5]``: ``ctrl_addr + CONTROL_BYTES * h`` and :data:`CONTROL_BYTES`,
    or 0 and 0 for a single segment) and the segment size (``ctrl_size[h]``); or calls
    :meth:`plan_uniform`. Control messages' level, type and length are set once here.
    """

    def __init__(self, capacity: int) -> None:
        if not mmsg.AVAILABLE:
            raise OSError("recvmmsg/sendmmsg are not available on this platform")
        self.capacity = capacity
        self.iov = np.zeros(capacity, mmsg.IOVEC_DTYPE)
        self.hdrs = np.zeros(capacity, mmsg.MMSGHDR_DTYPE)
        self.ctrl = np.zeros((capacity, CONTROL_BYTES), np.uint8)
        words = self.ctrl.view("<u8")
        words[:, 0] = _CMSG_LEN_U16
        words[:, 1] = SOL_UDP | (UDP_SEGMENT << 32)
        #: Segment size of each header's control message (u16 at byte 16).
        self.ctrl_size = self.ctrl.view("<u2")[:, 8]
        self.iov_words = self.iov.view("<u8").reshape(capacity, 2)
        self.hdr_words = self.hdrs.view("<u8").reshape(capacity, 8)
        self.iov_addr = np.uint64(self.iov.ctypes.data)
        self.ctrl_addr = np.uint64(self.ctrl.ctypes.data)
        self._hdr_addr = self.hdrs.ctypes.data
        #: None while segmented sends are used; else why not (logged once).
        self.refused: str | None = gso_unavailable()
        # Fallback: one header per segment, pointing at the same iovecs.
        self._plain = np.zeros(capacity, mmsg.MMSGHDR_DTYPE)
        self._plain_words = self._plain.view("<u8").reshape(capacity, 8)
        self._plain_words[:, 2] = self.iov_addr + np.arange(capacity, dtype=np.uint64) * np.uint64(16)
        self._plain_words[:, 3] = 1
        self._plain_addr = self._plain.ctypes.data
        self._plan = _kernels.plan_uniform if _kernels is not None else _plan_uniform_reference
        self._no_keys = np.zeros(capacity, np.int64)

    @property
    def segmenting(self) -> bool:
        """Whether sends are segmented (False after a refusal, or where :func:`gso_unavailable` said so)."""
        return self.refused is None

    def plan_uniform(self, addresses: np.ndarray, length: int, name_addr: int = 0, name_len: int = 0,
                     max_segments: int = MAX_SEGMENTS, keys: np.ndarray | None = None) -> int:
        """Headers for ``addresses`` (uint64, each ``length`` bytes) to one destination, in order:
        runs of up to ``max_segments`` (and :data:`MAX_SEND_BYTES`) whose ``keys`` (int64, one per
        address; e.g. each datagram's steering block, ``wire.SEGMENT_BLOCK_SLOTS``) are equal;
        returns the header count."""
        per = max(1, min(max_segments, MAX_SEND_BYTES // max(length, 1))) if self.refused is None and length else 1
        if keys is None:
            keys = self._no_keys[:addresses.shape[0]]
        return self._plan(addresses, length, per, name_addr, name_len, self.iov_words, self.hdr_words,
                          self.ctrl_size, self.iov_addr, self.ctrl_addr, CONTROL_BYTES, keys)

    def send(self, fd: int, headers: int) -> tuple[int, int]:
        """Send headers ``0 .. headers-1``; returns (segments sent, segments failed).

        A header the kernel refuses for a transient reason (full socket buffer, an ICMP error)
        is skipped and its segments counted as failed (the protocol's retransmission recovers
        them). A refusal of segmentation itself switches this batch to one datagram per
        message, with one log line, and the refused and remaining headers go that way.
        """
        sent = failed = 0
        h = 0
        hw = self.hdr_words
        while h < headers:
            done = _sendmmsg(fd, self._hdr_addr + h * 64, headers - h, 0)
            if done > 0:
                sent += int(hw[h:h + done, 3].sum())
                h += done
                continue
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in _REFUSED and hw[h, 5] and self.refused is None:
                self.refused = f"the kernel refused a segmented send ({os.strerror(err)})"
                log.warning("UDP GSO off for this socket, one datagram per message from now on: %s", self.refused)
            if self.refused is not None and hw[h, 5]:
                s, f = self._send_plain(fd, h, headers)
                return sent + s, failed + f
            failed += int(hw[h, 3])
            h += 1
        return sent, failed

    def _send_plain(self, fd: int, first_header: int, headers: int) -> tuple[int, int]:
        """Send the segments of headers ``first_header ..`` one datagram each (same names, same iovecs)."""
        hw = self.hdr_words
        first = int((int(hw[first_header, 2]) - int(self.iov_addr)) // 16)
        counts = hw[first_header:headers, 3].astype(np.int64)
        total = int(counts.sum())
        pw = self._plain_words
        pw[first:first + total, 0] = np.repeat(hw[first_header:headers, 0], counts)
        pw[first:first + total, 1] = np.repeat(hw[first_header:headers, 1], counts)
        return mmsg.send_headers(fd, self._plain_addr + first * mmsg.MMSGHDR_DTYPE.itemsize, total)


class GroBatch:
    """Coalesced receives split into rows: :attr:`buf` row ``i`` (after ``headroom``) holds datagram ``i``.

    Interface of :class:`~netagg.mmsg.MsgBatch` for receiving: ``recv(fd, first, limit)``
    fills rows ``first ..`` and returns how many; ``lengths[i]`` is datagram ``i``'s size and
    ``names[i]`` its sender. As with ``recvmmsg``, a datagram longer than a row is cut to the
    row and its length is the row's (so rows are never read past their end, and a size check
    still rejects it when the row is longer than any valid datagram). Segments of a coalesced buffer that do not
    fit in the rows asked for stay pending and come first on the next call, so no datagram is
    lost to a small batch.
    """

    def __init__(self, capacity: int, stride: int, headroom: int = 0, messages: int = mmsg.BATCH) -> None:
        if not mmsg.AVAILABLE:
            raise OSError("recvmmsg/sendmmsg are not available on this platform")
        self.capacity, self.stride, self.headroom, self.messages = capacity, stride, headroom, messages
        self.buf = np.zeros((capacity, stride), np.uint8)
        self.names = np.zeros((capacity, mmsg.NAME_BYTES), np.uint8)
        self.lengths = np.zeros(capacity, np.uint32)
        self._big = np.zeros((messages, GRO_BUFFER_BYTES), np.uint8)
        self._rx_names = np.zeros((messages, mmsg.NAME_BYTES), np.uint8)
        self._ctrl = np.zeros((messages, RX_CONTROL_BYTES), np.uint8)
        step = np.arange(messages, dtype=np.uint64)
        self._iov = np.zeros(messages, mmsg.IOVEC_DTYPE)
        self._iov["base"] = np.uint64(self._big.ctypes.data) + step * np.uint64(GRO_BUFFER_BYTES)
        self._iov["len"] = GRO_BUFFER_BYTES
        self._hdrs = np.zeros(messages, mmsg.MMSGHDR_DTYPE)
        self._hdrs["iov"] = np.uint64(self._iov.ctypes.data) + step * np.uint64(mmsg.IOVEC_DTYPE.itemsize)
        self._hdrs["iovlen"] = 1
        self._hdrs["name"] = np.uint64(self._rx_names.ctypes.data) + step * np.uint64(mmsg.NAME_BYTES)
        self._hdrs["control"] = np.uint64(self._ctrl.ctypes.data) + step * np.uint64(RX_CONTROL_BYTES)
        self._words32 = self._hdrs.view("<u4").reshape(messages, 16)  # [:, 2] namelen, [:, 10] controllen, [:, 14] len
        self._hdr_addr = self._hdrs.ctypes.data
        # The last recvmmsg's messages (count, segment sizes) and how far they are split: state = (message, offset).
        self._count = 0
        self._sizes = np.zeros(messages, np.int64)
        self._tos = np.full(messages, -1, np.int64)
        self._state = np.zeros(2, np.int64)
        self._split = _kernels.split if _kernels is not None else _split_reference
        self._segment_sizes = _kernels.segment_sizes if _kernels is not None else _segment_sizes_reference
        #: Datagrams and receive calls so far (datagrams per call = how well coalescing works).
        self.datagrams = 0
        self.calls = 0
        #: Datagrams received ECN CE-marked so far (counted when their message arrives; needs ``enable_ecn``).
        self.ce_datagrams = 0

    @property
    def pending(self) -> bool:
        """Whether datagrams of the last receive are still to be handed out (the socket may not wake a poll)."""
        return bool(self._state[0] < self._count)

    def recv(self, fd: int, first: int = 0, limit: int | None = None) -> int:
        """Fill rows ``first ..`` (at most ``limit``) with waiting datagrams, without blocking; returns how many.

        Raises OSError on a real error; an ICMP error queued on the socket is consumed and
        reported as 0 datagrams (as :meth:`MsgBatch.recv <netagg.mmsg.MsgBatch.recv>`).
        """
        room = self.capacity - first
        if limit is not None:
            room = min(room, limit)
        if room <= 0:
            return 0
        if self._state[0] < self._count:  # segments left over from the last call come first
            filled = self._split(self._big, self._words32, self._sizes, self._rx_names, self._count, self._state,
                                 self.buf, self.lengths, self.names, first, room, self.headroom)
            self.datagrams += filled
            return filled
        words = self._words32
        words[:, 2] = mmsg.NAME_BYTES
        words[:, 10] = RX_CONTROL_BYTES
        try:
            count = mmsg.recv_headers(fd, self._hdr_addr, self.messages)
        except OSError:
            self._count = 0
            raise
        if count == 0:
            self._count = 0
            return 0
        self.calls += 1
        self._count = count
        self._state[:] = 0
        self.ce_datagrams += int(self._segment_sizes(self._ctrl, words, count, self._sizes, self._tos))
        filled = self._split(self._big, words, self._sizes, self._rx_names, count, self._state, self.buf,
                             self.lengths, self.names, first, room, self.headroom)
        self.datagrams += filled
        return filled


def _plan_uniform_reference(addresses: np.ndarray, length: int, per: int, name_addr: int, name_len: int,
                            iov_words: np.ndarray, hdr_words: np.ndarray, ctrl_size: np.ndarray, iov_addr: np.uint64,
                            ctrl_addr: np.uint64, ctrl_bytes: int, keys: np.ndarray) -> int:
    """Segment ``j`` of ``addresses`` gets iovec ``j`` (``length`` bytes); runs of up to ``per`` consecutive
    segments with equal ``keys`` get one header each (its name, first iovec, count, and a UDP_SEGMENT control
    message when it holds more than one); returns the header count. ``udpgso_kernels.plan_uniform`` is the
    compiled twin."""
    n = addresses.shape[0]
    if n == 0:
        return 0
    iov_words[:n, 0] = addresses
    iov_words[:n, 1] = length
    # A run starts at 0, where the key changes, and every ``per`` segments within an equal-key stretch.
    change = np.flatnonzero(np.diff(keys[:n]) != 0) + 1
    starts: list[int] = []
    for lo, hi in zip([0, *change.tolist()], [*change.tolist(), n], strict=True):
        starts.extend(range(lo, hi, per))
    first = np.array(starts, dtype=np.uint64)
    headers = first.shape[0]
    ends = np.append(first[1:], np.uint64(n))
    hdr_words[:headers, 0] = name_addr
    hdr_words[:headers, 1] = name_len
    hdr_words[:headers, 2] = iov_addr + first * np.uint64(16)
    sizes = ends - first
    hdr_words[:headers, 3] = sizes
    multi = sizes > 1
    hdr_words[:headers, 4] = np.where(multi, ctrl_addr + np.arange(headers, dtype=np.uint64) * np.uint64(ctrl_bytes),
                                      np.uint64(0))
    hdr_words[:headers, 5] = np.where(multi, np.uint64(ctrl_bytes), np.uint64(0))
    ctrl_size[:headers] = length
    return headers


def _segment_sizes_reference(ctrl: np.ndarray, words32: np.ndarray, count: int, sizes: np.ndarray,
                             tos: np.ndarray) -> int:
    """``sizes[m]``: message ``m``'s UDP_GRO segment size from its control messages (``ctrl[m]``, the kernel's
    ``msg_controllen`` in ``words32[m, 10]``), or its whole length ``words32[m, 14]`` (at least 1) without one;
    ``tos[m]``: its IPv4 TOS byte (``IP_RECVTOS``), or -1 without one. Returns the datagrams of the messages
    that arrived ECN CE-marked (a coalesced message is one flow's datagrams under one IPv4 header: all marked
    alike)."""
    marked = 0
    for m in range(count):
        length = int(words32[m, 14])
        used = min(int(words32[m, 10]), ctrl.shape[1])  # never read past the buffer, whatever it says
        size = max(length, 1)
        tos[m] = -1
        offset = 0
        while offset + 16 <= used:
            cmsg_len = int(ctrl[m, offset:offset + 8].view("<u8")[0])
            level, kind = ctrl[m, offset + 8:offset + 16].view("<i4").tolist()
            if level == SOL_UDP and kind == UDP_GRO and 20 <= cmsg_len <= used - offset:
                value = int(ctrl[m, offset + 16:offset + 20].view("<i4")[0])
                if value > 0:
                    size = value
            elif level == SOL_IP and kind == IP_TOS and 17 <= cmsg_len <= used - offset:
                tos[m] = int(ctrl[m, offset + 16])
            if cmsg_len < 16 or cmsg_len > used - offset:
                break
            offset += (cmsg_len + 7) & ~7
        sizes[m] = size
        if tos[m] >= 0 and (tos[m] & wire.ECN_MASK) == wire.ECN_CE:
            marked += max(1, -(-length // size))
    return marked


def _split_reference(big: np.ndarray, words32: np.ndarray, sizes: np.ndarray, rx_names: np.ndarray, count: int,
                     state: np.ndarray, buf: np.ndarray, lengths: np.ndarray, names: np.ndarray, first: int,
                     room: int, headroom: int) -> int:
    """Cut messages ``state[0] ..`` (from byte ``state[1]`` of the first) of ``big`` into segments of ``sizes[m]``
    bytes (the last of a message may be shorter) and copy them into rows ``first ..`` of ``buf`` after
    ``headroom`` (at most ``room``; a segment longer than a row is cut to it, as is its length), each with
    its message's sender; an empty message is one empty row. Advances ``state``; returns rows filled.
    ``udpgso_kernels.split`` is the compiled twin."""
    row, end_row, width = first, first + room, buf.shape[1] - headroom
    m, offset = int(state[0]), int(state[1])
    while m < count and row < end_row:
        end = int(words32[m, 14])
        if end == 0:
            lengths[row] = 0
            names[row] = rx_names[m]
            row, m, offset = row + 1, m + 1, 0
            continue
        size = int(sizes[m])
        n = min(-(-(end - offset) // size), end_row - row)
        full = min(n, (end - offset) // size)  # whole segments among them
        if full:
            copy = min(size, width)
            src = big[m, offset:offset + full * size].reshape(full, size)
            buf[row:row + full, headroom:headroom + copy] = src[:, :copy]
            lengths[row:row + full] = copy
        if n > full:  # the shorter last segment
            tail = end - offset - full * size
            copy = min(tail, width)
            buf[row + full, headroom:headroom + copy] = big[m, offset + full * size:offset + full * size + copy]
            lengths[row + full] = copy
        names[row:row + n] = rx_names[m]
        row += n
        offset += n * size
        if offset >= end:
            m, offset = m + 1, 0
    state[0], state[1] = m, offset
    return row - first


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels with the types the batches use."""
    if _kernels is None or not mmsg.AVAILABLE:
        return
    gso = GsoBatch(4)
    gso.plan_uniform(np.zeros(0, np.uint64), 1)
    gro = GroBatch(4, 64)
    gro._segment_sizes(gro._ctrl, gro._words32, 0, gro._sizes, gro._tos)
    gro._split(gro._big, gro._words32, gro._sizes, gro._rx_names, 0, gro._state, gro.buf, gro.lengths, gro.names,
               0, 0, 0)
