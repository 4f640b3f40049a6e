"""Raw ports through the kernel's packet rings (PACKET_MMAP) instead of ``recvmmsg``/``sendmmsg``.

(Over 500 lines: the ring layouts, their compiled readers and the measured alternatives kept selectable by
``NETAGG_RAW_IO`` belong together; a third of it is the description of the kernel's ring protocol.)

The batched loop (:mod:`netagg.softswitch.batch_switch`) reads its raw ports (AF_PACKET sockets
on veth interfaces, :class:`~netagg.softswitch.ports.RawSocketPort`) from receive rings that the
kernel writes frames into and user space reads without a system call. Every port's ring is mapped
into one reserved address range (``MAP_FIXED``), so one compiled call (:func:`ring_receive`) takes
the waiting frames of all ports: it copies each into a row of the switch's 2-D receive buffer (what
:meth:`FastPipeline.run` reads), with its length and ingress port, and gives the slot back to the
kernel. Frames leave the rings in the order the kernel received them, across ports too (each frame
carries its receive timestamp; the rings are merged by it), so the pipeline sees the arrival order
BMv2's single ingress queue would. Frames another sender put on the interface (``PACKET_OUTGOING``)
and frames cut short are skipped and counted; the pipeline runs every frame, one at a time.

Modes (``NETAGG_RAW_IO``, or ``BatchSwitch(raw_io=...)``; :func:`open_rings`):

* ``ring`` (the default): ``TPACKET_V2``, one 2 KiB slot per frame (2048 a port), handed over frame
  by frame, so poll wakes up as it does for ``recvmmsg``. A longer frame (jumbo MTU) still arrives
  whole: the kernel marks its slot ``TP_STATUS_COPY`` and queues the frame on the socket
  (``PACKET_COPY_THRESH``), where :meth:`PacketRings.receive` reads it in its turn.
* ``ring-v3`` (for measurements): ``TPACKET_V3``, frames packed into blocks sized for the MTU, a block
  handed over when full or after the retire timeout (:data:`RETIRE_MS`). Netagg's closed-loop rounds
  (a worker sends a slot's next contribution when its result is back) never fill a block, so every
  round waits for the timeout (about 120k contributions/s at most with 32 slots a worker); and a frame
  in one port's open block cannot be ordered before a later frame in another port's handed-over block,
  so arrival order across ports is lost (the PTF suite's ``SlotReuseAndRetransmit`` fails).
* ``mmsg``: recvmmsg/sendmmsg, as before; also what raw ports fall back to when the kernel refuses
  a ring (logged once, with why).

``+tx`` (``ring+tx``, ``ring-v3+tx``; for measurements) adds a transmit ring per port
(``PACKET_TX_RING``): :func:`ring_transmit` copies the emitted frames into their port's next free
slots, and one ``send(fd, "", MSG_DONTWAIT)`` per port hands them to the kernel.

Measured with ``make bench-switch``'s veth workload (4 workers x 32 slots, raw frames; 2 shared,
noisy cores; six interleaved runs): ``ring`` 261k-365k contributions/s against ``mmsg``'s 236k-308k
(1.0-1.36x in the same run, about 1.14x typical), and 1.34-1.74 us of switch CPU per frame in or out
against 1.57-2.07 us (0.71-0.99x); ``ring+tx`` 189k-251k at 1.72-2.15 us (sendmmsg is cheaper than
the transmit ring's kick here); ``ring-v3`` 103k-127k.

Only Linux on 64-bit little-endian machines (the header layouts below); everything is ctypes,
mmap and numpy, the per-frame work numba (the compiled pipeline's dependency).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import socket
import struct
import sys
import threading
from collections.abc import Sequence

import numpy as np
from numba import njit

log = logging.getLogger(__name__)

SOL_PACKET = 263
PACKET_RX_RING = 5
PACKET_STATISTICS = 6
PACKET_COPY_THRESH = 7
PACKET_VERSION = 10
PACKET_TX_RING = 13
PACKET_LOSS = 14
TPACKET_V2 = 1
TPACKET_V3 = 2
PACKET_OUTGOING = 4
TP_STATUS_USER = 1
TP_STATUS_COPY = 2
TP_STATUS_SEND_REQUEST = 1
TP_STATUS_WRONG_FORMAT = 4
SIOCGIFMTU = 0x8921
MSG_TRUNC = 0x20

#: Frame header sizes (TPACKET_ALIGN(sizeof(struct tpacket{2,3}_hdr))); the sockaddr_ll follows.
V2_HDR, V3_HDR = 32, 48
#: struct tpacket_block_desc (version, offset_to_priv, struct tpacket_hdr_v1).
BLOCK_DESC = 48
#: TPACKET_V2 receive slot: header, sockaddr_ll and a 1500-byte-MTU frame (longer ones take the copy path).
V2_SLOT = 2048
#: TPACKET_V2 receive slots per port (4 MiB: about as many netagg frames as the mmsg path's socket buffer).
V2_RX_SLOTS = 2048
#: TPACKET_V3 receive ring per port (blocks sized for the port's MTU, as V3 has no copy path).
V3_RX_BYTES = 2 << 20
#: Block retire timeout of TPACKET_V3 receive rings (ms; the kernel's minimum is 1).
RETIRE_MS = 1
#: Room before a frame in a slot or block: TPACKET_ALIGN(header + sockaddr_ll) and the MAC header's alignment.
SLOT_OVERHEAD = 128
#: Transmit slots per port.
TX_SLOTS = 512

# Columns of PacketRings.table (one row per port): the port's number, then per ring (receive at T_RX,
# transmit at T_TX): offset in the mapping, slots per block, block size, slot size, slots, next slot.
# A TPACKET_V3 receive ring's slots are its blocks. T_HEAD: where the port's next received frame's
# header is (V2: its slot; V3: inside the block being read, -1 when none is open); T_LEFT: frames
# left in that V3 block.
T_PORT, T_RX, T_TX = 0, 1, 7
BASE, PER_BLOCK, BLOCK, UNIT, COUNT, NEXT = range(6)
T_HEAD, T_LEFT = 13, 14
T_COLUMNS = 15

#: Raw port I/O modes (see the module's docs); "+tx" adds transmit rings.
MODES = ("ring", "ring-v3", "mmsg", "ring+tx", "ring-v3+tx")
#: What raw ports use unless told otherwise.
DEFAULT_MODE = "ring"

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
if _libc is not None:
    _mmap = _libc.mmap
    _mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    _mmap.restype = ctypes.c_void_p
    _munmap = _libc.munmap
    _munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
PROT_NONE = 0
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000


def unavailable() -> str | None:
    """Why packet rings cannot be used here at all, or None."""
    if _libc is None:
        return "not Linux"
    if sys.byteorder != "little" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return "packet ring layouts are only known for 64-bit little-endian Linux"
    return None


@njit(cache=True, inline="always")
def _host_u16(b, i):
    """A little-endian (host order) u16 of a kernel ring header; wire fields are big-endian (``fastpath_defs``)."""
    return np.int64(b[i]) | (np.int64(b[i + 1]) << 8)


@njit(cache=True, inline="always")
def _host_u32(b, i):
    return np.int64(b[i]) | (np.int64(b[i + 1]) << 8) | (np.int64(b[i + 2]) << 16) | (np.int64(b[i + 3]) << 24)


@njit(cache=True, inline="always")
def _host_put32(b, i, v):
    b[i] = v & 0xFF
    b[i + 1] = (v >> 8) & 0xFF
    b[i + 2] = (v >> 16) & 0xFF
    b[i + 3] = (v >> 24) & 0xFF


@njit(cache=True, inline="always")
def _set_status(b, i, v):
    """Write a 32-bit status word, the byte with the ownership bit last: the kernel must not see the
    slot change hands before the rest is written (x86 keeps stores in order; the ring is one array,
    so the compiler keeps them in program order)."""
    b[i + 3] = (v >> 24) & 0xFF
    b[i + 2] = (v >> 16) & 0xFF
    b[i + 1] = (v >> 8) & 0xFF
    b[i] = v & 0xFF


@njit(cache=True, inline="always")
def _copy_in(row, ring, src, length):
    """``row[:length] = ring[src:src + length]`` as a loop over a view, which LLVM vectorizes (~0.05 ns a
    byte). Indexing ``ring[src + j]`` costs ~0.9 ns a byte (numba's wraparound of a possibly negative
    index stops vectorization); a slice assignment copies through a temporary."""
    frame = ring[src:src + length]
    for j in range(length):
        row[j] = frame[j]


@njit(cache=True, inline="always")
def _copy_out(ring, dst, row, length):
    """``ring[dst:dst + length] = row[:length]``, as :func:`_copy_in`."""
    slot = ring[dst:dst + length]
    for j in range(length):
        slot[j] = row[j]


@njit(cache=True, inline="always")
def _slot(table, r, col, i):
    """Address of slot ``i`` of port ``r``'s ring at ``col`` (slots never cross a block; a block may end
    in unused bytes)."""
    per_block = table[r, col + PER_BLOCK]
    return table[r, col + BASE] + (i // per_block) * table[r, col + BLOCK] + (i % per_block) * table[r, col + UNIT]


@njit(cache=True, inline="always")
def _take(ring, pos, v3, rows, lengths, ports, fill, port, counts):
    """Copy the frame whose tpacket header is at ``pos`` into row ``fill`` (or count why not); new fill."""
    if v3:  # struct tpacket3_hdr
        snaplen, length = _host_u32(ring, pos + 12), _host_u32(ring, pos + 16)
        mac, sll = _host_u16(ring, pos + 24), pos + 48
    else:  # struct tpacket2_hdr
        length, snaplen = _host_u32(ring, pos + 4), _host_u32(ring, pos + 8)
        mac, sll = _host_u16(ring, pos + 12), pos + 32
    if ring[sll + 10] == PACKET_OUTGOING:  # sockaddr_ll.sll_pkttype: a frame this socket sent
        counts[0] += 1
        return fill
    if snaplen != length or length > rows.shape[1] or fill >= rows.shape[0]:
        counts[1] += 1  # cut short (the ring was full for its copy, or it is longer than a row): never half a frame
        return fill
    _copy_in(rows[fill], ring, pos + mac, length)
    lengths[fill] = length
    ports[fill] = port
    return fill + 1


@njit(cache=True, inline="always")
def _head(ring, table, r, v3):
    """Header address of port ``r``'s next received frame, or -1 (opens the next retired V3 block)."""
    if not v3:
        slot = table[r, T_HEAD]
        return slot if ring[slot] & TP_STATUS_USER else -1
    while table[r, T_LEFT] == 0:
        blk = _slot(table, r, T_RX, table[r, T_RX + NEXT])
        if (ring[blk + 8] & TP_STATUS_USER) == 0:  # block_status: still the kernel's
            return -1
        n = _host_u32(ring, blk + 12)
        if n == 0:  # nothing in it: straight back
            _release_block(ring, table, r)
            continue
        table[r, T_LEFT] = n
        table[r, T_HEAD] = blk + _host_u32(ring, blk + 16)
    return table[r, T_HEAD]


@njit(cache=True, inline="always")
def _release_block(ring, table, r):
    """Give port ``r``'s current V3 block (or V2 slot) back to the kernel and move to the next."""
    nxt = table[r, T_RX + NEXT]
    _set_status(ring, _slot(table, r, T_RX, nxt) + 8, 0)
    nxt = nxt + 1 if nxt + 1 < table[r, T_RX + COUNT] else 0
    table[r, T_RX + NEXT] = nxt


@njit(cache=True, inline="always")
def _advance(ring, table, r, v3):
    """Port ``r``'s frame at its head was taken: free its slot (V2) or step through the block (V3)."""
    if v3:
        table[r, T_LEFT] -= 1
        if table[r, T_LEFT] == 0:
            _release_block(ring, table, r)
        else:
            table[r, T_HEAD] += _host_u32(ring, table[r, T_HEAD])  # tp_next_offset
        return
    _set_status(ring, table[r, T_HEAD], 0)
    nxt = table[r, T_RX + NEXT] + 1
    nxt = nxt if nxt < table[r, T_RX + COUNT] else 0
    table[r, T_RX + NEXT] = nxt
    table[r, T_HEAD] = _slot(table, r, T_RX, nxt)


@njit(cache=True, nogil=True)
def ring_receive(ring, table, version, rows, lengths, ports, fill, counts, copy):
    """Frames waiting in the ports' receive rings into rows ``fill..`` of ``rows``, with their lengths
    and ingress ports, in the order the kernel received them across all ports (each frame's receive
    timestamp; the lower port row on a tie), as far as the rows go; returns the new fill.

    TPACKET_V2: at a ``TP_STATUS_COPY`` slot (the frame was longer than a slot and waits whole on the
    socket) it stops with ``copy[0]`` = that port's row of ``table``, for the caller to read the frame
    from the socket and call :func:`ring_release` (:meth:`PacketRings.receive`); else ``copy[0]`` is -1.
    ``counts``: [outgoing frames skipped, frames dropped because they were cut short]."""
    v3 = version == 3
    sec_at, nsec_at = (4, 8) if v3 else (16, 20)
    cap = rows.shape[0]
    copy[0] = -1
    n_rings = table.shape[0]
    while fill < cap:
        best = -1
        best_pos = 0
        best_ts = np.int64(0)
        for r in range(n_rings):
            pos = _head(ring, table, r, v3)
            if pos < 0:
                continue
            ts = _host_u32(ring, pos + sec_at) * 1_000_000_000 + _host_u32(ring, pos + nsec_at)
            if best < 0 or ts < best_ts:
                best, best_pos, best_ts = r, pos, ts
        if best < 0:
            break
        if not v3 and ring[best_pos] & TP_STATUS_COPY:
            copy[0] = best
            break
        fill = _take(ring, best_pos, v3, rows, lengths, ports, fill, table[best, T_PORT], counts)
        _advance(ring, table, best, v3)
    return fill


@njit(cache=True, nogil=True)
def ring_release(ring, table, r):
    """Give port ``r``'s current TPACKET_V2 receive slot back to the kernel and move on (after a
    copy-path read)."""
    _advance(ring, table, r, False)


@njit(cache=True, nogil=True)
def ring_transmit(ring, table, version, out_buf, out_len, out_port, count, port_slot, queued):
    """Copy the emitted frames into their port's transmit ring (``port_slot[port]``: row of ``table``,
    -2 for a port sent to elsewhere, -1 none), in order; ``queued[row]``: frames queued per port.
    Returns (frames to no port, frames that found their port's next slot busy or did not fit)."""
    queued[:] = 0
    unknown = 0
    failed = 0
    hdr = V3_HDR if version == 3 else V2_HDR
    len_at = 16 if version == 3 else 4
    status_at = 20 if version == 3 else 0
    for i in range(count):
        p = out_port[i]
        g = port_slot[p] if 0 <= p < port_slot.shape[0] else -1
        if g < 0:
            if g == -1:
                unknown += 1
            continue
        nxt = table[g, T_TX + NEXT]
        slot = _slot(table, g, T_TX, nxt)
        status = _host_u32(ring, slot + status_at)
        length = out_len[i]
        if (status != 0 and status != TP_STATUS_WRONG_FORMAT) or length > table[g, T_TX + UNIT] - hdr:
            failed += 1  # the kernel still sends from this slot (or the frame cannot fit one)
            continue
        _copy_out(ring, slot + hdr, out_buf[i], length)
        _host_put32(ring, slot + len_at, length)
        _set_status(ring, slot + status_at, TP_STATUS_SEND_REQUEST)
        table[g, T_TX + NEXT] = nxt + 1 if nxt + 1 < table[g, T_TX + COUNT] else 0
        queued[g] += 1
    return unknown, failed


def _mtu(sock: socket.socket, ifname: str) -> int:
    request = struct.pack("16si20x", ifname.encode()[:15], 0)
    return struct.unpack_from("16si", fcntl.ioctl(sock.fileno(), SIOCGIFMTU, request))[1]


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _pow2_pages(size: int) -> int:
    block = mmap.PAGESIZE
    while block < size:
        block *= 2
    return block


class PacketRings:
    """Receive (and optionally transmit) rings on a set of raw sockets, mapped side by side.

    ``sockets[i]`` serves switch port ``numbers[i]`` on interface ``ifnames[i]``. :meth:`receive`
    fills :attr:`buf` / :attr:`lengths` / :attr:`ports` with the waiting frames of all ports;
    :meth:`transmit` (``tx=True``) queues emitted frames and kicks the kernel. :meth:`close` unmaps
    the rings (before the sockets close). Raises OSError when the kernel refuses a ring, leaving the
    sockets as they were (ringless), so the caller can go on with recvmmsg.
    """

    def __init__(self, sockets: Sequence[socket.socket], numbers: Sequence[int], ifnames: Sequence[str],
                 version: int = 2, tx: bool = False, rows: int = 256, stride: int = 9216) -> None:
        if (why := unavailable()) is not None:
            raise OSError(errno.ENOTSUP, why)
        if version not in (2, 3):
            raise ValueError(f"TPACKET_V{version}: expected 2 or 3")
        self.version, self.tx = version, tx
        self.sockets = list(sockets)
        self.table = np.zeros((len(self.sockets), T_COLUMNS), np.int64)
        self._total = 0
        self._addr = 0
        self.ring = np.zeros(0, np.uint8)
        page = mmap.PAGESIZE
        # Per socket: [(option, request, (block size, blocks, slot size, slots per block))]
        requests: list[list[tuple[int, bytes, tuple[int, int, int, int]]]] = []
        for i, (sock, number) in enumerate(zip(self.sockets, numbers)):
            self.table[i, T_PORT] = number
            if version == 3:  # V3 cannot hand on a frame longer than a block: size blocks for the MTU
                block = _pow2_pages(_mtu(sock, ifnames[i]) + 18 + SLOT_OVERHEAD + BLOCK_DESC)
                blocks = max(8, V3_RX_BYTES // block)
                rx = (block, blocks, block, 1)
                req = struct.pack("7I", block, blocks, block, blocks, RETIRE_MS, 0, 0)
            else:
                block = 16 * page
                per_block = block // V2_SLOT
                blocks = -(-V2_RX_SLOTS // per_block)
                rx = (block, blocks, V2_SLOT, per_block)
                req = struct.pack("4I", block, blocks, V2_SLOT, blocks * per_block)
            mine = [(PACKET_RX_RING, req, rx)]
            if tx:
                t_slot = _round_up(SLOT_OVERHEAD + stride, 16)
                t_block = _pow2_pages(max(16 * page, t_slot))
                per_block = t_block // t_slot
                blocks = -(-TX_SLOTS // per_block)
                t_req = (struct.pack("7I", t_block, blocks, t_slot, blocks * per_block, 0, 0, 0) if version == 3
                         else struct.pack("4I", t_block, blocks, t_slot, blocks * per_block))
                mine.append((PACKET_TX_RING, t_req, (t_block, blocks, t_slot, per_block)))
            requests.append(mine)
            self._total += sum(layout[0] * layout[1] for _, _, layout in mine)
        addr = _mmap(None, self._total, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"reserving {self._total} bytes for packet rings: {os.strerror(err)}")
        self._addr = addr
        try:
            offset = 0
            for i, (sock, mine) in enumerate(zip(self.sockets, requests)):
                sock.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V3 if version == 3 else TPACKET_V2)
                if version == 2:  # a frame longer than a slot waits whole on the socket (TP_STATUS_COPY)
                    sock.setsockopt(SOL_PACKET, PACKET_COPY_THRESH, 1)
                if tx:
                    sock.setsockopt(SOL_PACKET, PACKET_LOSS, 1)  # a refused frame is skipped, not retried forever
                size = 0
                for option, req, (block, blocks, unit, per_block) in mine:
                    sock.setsockopt(SOL_PACKET, option, req)
                    col = T_RX if option == PACKET_RX_RING else T_TX
                    count = blocks if version == 3 and option == PACKET_RX_RING else blocks * per_block
                    self.table[i, col:col + 5] = (offset + size, per_block, block, unit, count)
                    size += block * blocks
                self.table[i, T_HEAD] = -1 if version == 3 else self.table[i, T_RX + BASE]
                where = _mmap(addr + offset, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED,
                              sock.fileno(), 0)
                if where != addr + offset:
                    err = ctypes.get_errno()
                    raise OSError(err, f"mapping the packet ring of {ifnames[i]}: {os.strerror(err)}")
                offset += size
        except BaseException:
            self.close()
            for sock in self.sockets:  # back to ringless sockets (recvmmsg reads nothing while a ring is set)
                for option in (PACKET_RX_RING, PACKET_TX_RING):
                    with contextlib.suppress(OSError):
                        sock.setsockopt(SOL_PACKET, option, bytes(28 if version == 3 else 16))
                with contextlib.suppress(OSError):
                    sock.setsockopt(SOL_PACKET, PACKET_COPY_THRESH, 0)
            raise
        for sock in self.sockets:  # frames queued before the ring existed would be taken for copy-path frames
            with contextlib.suppress(OSError):
                while sock.recv(1, socket.MSG_DONTWAIT):
                    pass
        self.ring = np.ctypeslib.as_array(ctypes.cast(addr, ctypes.POINTER(ctypes.c_uint8)), shape=(self._total,))
        self.buf = np.zeros((rows, stride), np.uint8)
        self.lengths = np.zeros(rows, np.int64)
        self.ports = np.zeros(rows, np.int64)
        #: [outgoing frames skipped, frames dropped because they were cut short]
        self.counts = np.zeros(2, np.int64)
        self._copy = np.full(1, -1, np.int64)
        self._queued = np.zeros(len(self.sockets), np.int64)
        self._drops: dict[int, int] = {}
        self._drops_lock = threading.Lock()
        block, blocks, unit, per_block = requests[0][0][2]
        self.layout = (f"TPACKET_V{version} receive ring, {blocks * per_block} x {unit // 1024} KiB "
                       f"{'blocks' if version == 3 else 'slots'} per port"
                       + (f", transmit ring {TX_SLOTS} slots per port" if tx else ""))

    def receive(self) -> int:
        """The frames waiting in the rings of all ports, into rows ``0..n-1`` of :attr:`buf` in the order
        the kernel received them (across ports too); returns n."""
        fill = ring_receive(self.ring, self.table, self.version, self.buf, self.lengths, self.ports, 0, self.counts,
                            self._copy)
        while self._copy[0] >= 0:  # a frame longer than a slot: read it whole from the socket, in its turn
            r = int(self._copy[0])
            try:
                length, address = self.sockets[r].recvfrom_into(self.buf[fill], 0, MSG_TRUNC | socket.MSG_DONTWAIT)
            except OSError:
                length, address = -1, None  # not queued after all (cannot happen while the slot says so)
            ring_release(self.ring, self.table, r)
            if address is not None and address[2] == PACKET_OUTGOING:
                self.counts[0] += 1
            elif 0 <= length <= self.buf.shape[1]:
                self.lengths[fill], self.ports[fill] = length, self.table[r, T_PORT]
                fill += 1
            else:
                self.counts[1] += 1
            fill = ring_receive(self.ring, self.table, self.version, self.buf, self.lengths, self.ports, fill,
                                self.counts, self._copy)
        return fill

    def transmit(self, out_buf: np.ndarray, out_len: np.ndarray, out_port: np.ndarray, count: int,
                 port_slot: np.ndarray) -> tuple[int, int, int]:
        """Queue the emitted frames on their ports' transmit rings and kick each port that got some.

        ``port_slot[port]`` is the index of the port's socket, -2 for a port served elsewhere, -1 for
        no port. Returns (sent, failed, to no port)."""
        unknown, failed = ring_transmit(self.ring, self.table, self.version, out_buf, out_len, out_port, count,
                                        port_slot, self._queued)
        sent = 0
        for i, n in enumerate(self._queued.tolist()):
            if n:
                try:
                    self.sockets[i].send(b"", socket.MSG_DONTWAIT)
                    sent += n
                except OSError:
                    failed += n
        return sent, failed, unknown

    def kernel_drops(self) -> int:
        """Frames the kernel dropped because a ring was full (PACKET_STATISTICS), since the rings opened."""
        return sum(self.kernel_drops_by_port().values())

    def kernel_drops_by_port(self) -> dict[int, int]:
        """Frames the kernel dropped because a port's ring was full, by port number, since the rings opened
        (reading PACKET_STATISTICS resets the kernel's count: the totals are kept here). Thread-safe."""
        with self._drops_lock:
            for r, sock in enumerate(self.sockets):
                number = int(self.table[r, T_PORT])
                drops = struct.unpack("II", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))[1]
                self._drops[number] = self._drops.get(number, 0) + drops
            return dict(self._drops)

    def close(self) -> None:
        """Unmap every ring (before the sockets close: the kernel keeps a mapped ring's pages)."""
        if self._addr:
            self.ring = np.zeros(0, np.uint8)
            _munmap(self._addr, self._total)
            self._addr = 0


def raw_io_mode(requested: str | None = None) -> str:
    """The raw port I/O asked for: ``requested``, else ``$NETAGG_RAW_IO``, else :data:`DEFAULT_MODE`."""
    mode = (requested or os.environ.get("NETAGG_RAW_IO") or DEFAULT_MODE).strip().lower()
    if mode not in MODES:
        raise ValueError(f"raw port I/O {mode!r}: expected one of {', '.join(MODES)}")
    return mode


def open_rings(ports: Sequence, mode: str | None = None, rows: int = 256, stride: int = 9216) -> PacketRings | None:
    """Packet rings for raw ports (``RawSocketPort``s) in the I/O mode asked for (:func:`raw_io_mode`),
    or None for recvmmsg/sendmmsg: asked for, or the kernel refused a ring (logged once, with why)."""
    mode = raw_io_mode(mode)
    if mode == "mmsg" or not ports:
        return None
    kind, _, extra = mode.partition("+")
    try:
        rings = PacketRings([port.sock for port in ports], [port.number for port in ports],
                            [port.ifname for port in ports], version=3 if kind == "ring-v3" else 2,
                            tx=extra == "tx", rows=rows, stride=stride)
    except OSError as err:
        log.warning("raw ports: no packet ring (%s); using recvmmsg/sendmmsg", err)
        return None
    log.info("raw ports %s: %s", [port.number for port in ports], rings.layout)
    return rings


def warm_up() -> None:
    """Compile (or load from numba's cache) the ring kernels with the loop's array types."""
    ring = np.zeros(4096, np.uint8)
    table = np.zeros((1, T_COLUMNS), np.int64)
    for col in (T_RX, T_TX):
        table[0, col + PER_BLOCK] = table[0, col + COUNT] = 1
        table[0, col + BLOCK] = table[0, col + UNIT] = 4096
    rows = np.zeros((2, 64), np.uint8)
    lengths, ports, counts = np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros(2, np.int64)
    for version in (2, 3):
        table[0, T_HEAD] = 0 if version == 2 else -1
        ring_receive(ring, table, version, rows, lengths, ports, 0, counts, np.zeros(1, np.int64))
        ring_transmit(ring, table, version, rows, lengths, ports, 0, np.full(2, -1, np.int64), np.zeros(1, np.int64))
    ring_release(ring, table, 0)
