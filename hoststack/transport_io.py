"""The transport's socket: its UDP endpoint and the batched I/O that moves rows of packets through the kernel.

A :class:`SlotSocket` sends rows of a packet array (the transport's one packet per slot, or its resend
buffer) with one ``sendmmsg`` of UDP GSO sends per batch (:mod:`netagg.udpgso`: up to 64 equal-size
segments each, never two steering blocks in one), and receives results into rows: ``recvmmsg`` on a
``UDP_GRO`` socket, coalesced buffers split by their segment size. Where the kernel refuses segmentation or
GRO the same batches go one datagram per message (one log line says why), and without those calls
(``mmsg.AVAILABLE`` false) one ``send`` or ``recvfrom_into`` per packet. It knows nothing of slots' meaning,
rounds or timers (``transport.py``); it counts its socket errors for the caller.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import select
import socket
from typing import TYPE_CHECKING

import numpy as np

from netagg import mmsg, udpgso, wire
from netagg.hoststack.packets import RECV_ROW_BYTES, udp_socket

if TYPE_CHECKING:
    from netagg.hoststack.transport import TransportStats

log = logging.getLogger(__name__)

#: Datagrams read per receive without GRO (one recvmmsg).
RECV_BATCH = mmsg.BATCH
#: Receive rows per call with GRO (a few coalesced buffers of up to 64 segments each).
RECV_ROWS = 256
#: Receive buffer row: longer datagrams are cut to this (and so still counted as malformed).
RECV_STRIDE = RECV_ROW_BYTES


class SlotSocket:
    """A worker's UDP socket for one job's packets (see the module docstring).

    ``packets`` and ``resend`` are the caller's row arrays (one row per slot); ``transmit`` sends rows of
    either; ``slot_base`` is row 0's job-relative slot; socket errors are counted in ``stats.socket_errors``.
    ``sock``: a UDP socket already bound to ``bind``'s port, to use instead of binding one. ``connect``:
    connect to the one peer when there is one (a socket of a steered group must not be).
    """

    def __init__(self, bind: tuple[str, int], packets: np.ndarray, resend: np.ndarray, slot_base: int,
                 stats: TransportStats, sock: socket.socket | None = None, connect: bool = True) -> None:
        self.sock = udp_socket(bind, sock)
        self.address: tuple[str, int] = self.sock.getsockname()
        self._fd = self.sock.fileno()
        self._connect = connect
        self.slot_base = slot_base
        #: Where socket errors are counted (``socket_errors``: full buffers, ICMP errors from earlier sends).
        self._stats = stats
        self.poller = select.poll()
        self.poller.register(self._fd, select.POLLIN)
        self.batched = mmsg.AVAILABLE
        #: Packets leave ECT(0) and results' ECN marks are counted (``ce_received``; with GRO receives only).
        self.ecn = udpgso.enable_ecn(self.sock)
        self._tx: udpgso.GsoBatch | None = None
        #: Rows one :meth:`receive` fills at most.
        self.rx_capacity = RECV_BATCH
        if self.batched:
            if udpgso.enable_gro(self.sock):
                self._rx: mmsg.MsgBatch | udpgso.GroBatch = udpgso.GroBatch(RECV_ROWS, RECV_STRIDE)
                self.rx_capacity = RECV_ROWS
            else:
                self._rx = mmsg.MsgBatch(RECV_BATCH, RECV_STRIDE)
            self.rx_buf, self.rx_names, self.rx_lengths = self._rx.buf, self._rx.names, self._rx.lengths
        else:
            self.rx_buf = np.zeros((RECV_BATCH, RECV_STRIDE), np.uint8)
            self.rx_names = np.zeros((RECV_BATCH, mmsg.NAME_BYTES), np.uint8)
            self.rx_lengths = np.zeros(RECV_BATCH, np.uint32)
            self._rx_rows = [memoryview(row) for row in self.rx_buf]
            self._rx_name_view = memoryview(self.rx_names.reshape(-1))
        self.destination: tuple[str, int] = ("", 0)
        self.sources: frozenset[tuple[str, int]] = frozenset()
        self.allowed = np.zeros(0, np.int64)
        self.set_rows(packets, resend)

    def set_rows(self, packets: np.ndarray, resend: np.ndarray) -> None:
        """Send from ``packets`` and ``resend`` (a transport's slot rows; again when a move resized them)."""
        self.row_bytes = packets.shape[1]
        self.rows = [memoryview(row) for row in packets]
        self.resend_rows = [memoryview(row) for row in resend]
        if self.batched:
            refused_before = self._tx.refused if self._tx is not None else None
            self._tx = udpgso.GsoBatch(packets.shape[0])
            if self._tx.refused is not None and self._tx.refused != refused_before:
                log.info("transport %s: one datagram per message (%s)", self.address, self._tx.refused)
            step = np.arange(packets.shape[0], dtype=np.uint64) * np.uint64(self.row_bytes)
            self._row_addr = np.uint64(packets.ctypes.data) + step
            self._resend_addr = np.uint64(resend.ctypes.data) + step

    def set_destination(self, destination: tuple[str, int], also_from: frozenset[tuple[str, int]] = frozenset(),
                        ) -> None:
        """Send to ``destination`` and accept results from it (and from ``also_from``)."""
        self.destination = destination
        self.sources = frozenset({destination} | also_from)
        if len(self.sources) == 1 and self._connect:
            # One peer: a connected socket sends faster and the kernel drops strangers' datagrams.
            self.sock.connect(destination)
            self._send = self.sock.send
        else:
            sendto = self.sock.sendto
            self._send = lambda data: sendto(data, destination)
        if self.batched:
            self._dest_name = mmsg.sockaddr_in(*destination)  # kept alive: the headers point at it
            self._tx_name = (0, 0) if len(self.sources) == 1 and self._connect \
                else (self._dest_name.ctypes.data, self._dest_name.size)
        else:
            # What recvmmsg would write for a peer (sockaddr_in up to the address); others get zeros.
            self._source_names = {source: bytes(mmsg.sockaddr_in(*source)[:8]) for source in self.sources}
        #: The peers as the batch processors compare them: IPv4 << 16 | port.
        self.allowed = np.array([int.from_bytes(socket.inet_aton(host), "big") << 16 | port
                                 for host, port in sorted(self.sources)], np.int64)

    @property
    def gso_refused(self) -> str | None:
        """Why sends go one datagram per message instead of UDP GSO (None: GSO is in use)."""
        if self._tx is None:
            return "no sendmmsg/recvmmsg on this platform"
        return self._tx.refused

    @property
    def ce_received(self) -> int:
        """Datagrams received ECN CE-marked so far (0 without GRO receives: the marks are not read there)."""
        return self._rx.ce_datagrams if self.gro else 0

    @property
    def datagrams_received(self) -> int:
        """Datagrams received so far through coalesced receives (what ``ce_received`` is a share of)."""
        return self._rx.datagrams if self.gro else 0

    @property
    def gro(self) -> bool:
        """Whether results are received as UDP GRO coalesced buffers."""
        return self.batched and isinstance(self._rx, udpgso.GroBatch)

    def blocks_of(self, slots: np.ndarray) -> np.ndarray:
        """The steering blocks of rows ``slots`` (job-relative slot >> 6)."""
        return (slots + self.slot_base) >> wire.SEGMENT_BLOCK_SHIFT

    def transmit(self, slots: np.ndarray, resend_buffer: bool = False, blocks: np.ndarray | None = None) -> int:
        """Send the rows of ``slots`` as they are (one sendmmsg per batch); returns how many failed.

        ``resend_buffer``: rows of the resend buffer (``slots`` are then row numbers there, and ``blocks``
        their slots' steering blocks) instead of the packets. A segmented send never spans two steering blocks
        (``wire.SEGMENT_BLOCK_SLOTS``: receivers with several cores steer it by its first datagram)."""
        tx = self._tx
        if tx is None:
            errors, rows, send = 0, self.resend_rows if resend_buffer else self.rows, self._send
            for slot in slots.tolist():
                try:
                    send(rows[slot])
                except OSError:  # full buffer or ICMP: the timer resends
                    errors += 1
            return errors
        errors = 0
        addresses = self._resend_addr if resend_buffer else self._row_addr
        if blocks is None:
            blocks = self.blocks_of(slots)
        for first in range(0, slots.shape[0], tx.capacity):
            chunk = slots[first:first + tx.capacity]
            headers = tx.plan_uniform(addresses[chunk], self.row_bytes, *self._tx_name,
                                      keys=blocks[first:first + tx.capacity])
            errors += tx.send(self._fd, headers)[1]
        return errors

    def send(self, data: bytes) -> None:
        """One datagram to the destination, outside the batches (OSError if the kernel refuses it)."""
        self._send(data)

    def rx_pending(self) -> bool:
        """Whether datagrams of a coalesced receive wait in the batch (poll would not report them)."""
        return isinstance(self._rx, udpgso.GroBatch) and self._rx.pending if self.batched else False

    def receive(self) -> int:
        """Read up to :attr:`rx_capacity` waiting datagrams into the receive rows; returns how many, or -1
        after a socket error (counted; e.g. ICMP port unreachable from an earlier send on loopback)."""
        if self.batched:
            try:
                count = self._rx.recv(self._fd)
            except OSError:
                self._stats.socket_errors += 1
                return -1
            if count == 0 and ctypes.get_errno() == errno.ECONNREFUSED:  # MsgBatch.recv reports it as 0
                self._stats.socket_errors += 1
                return -1
            return count
        count, rows, names, lengths = 0, self._rx_rows, self._rx_name_view, self.rx_lengths
        known, unknown, recv = self._source_names, bytes(8), self.sock.recvfrom_into
        for _ in range(RECV_BATCH):
            try:
                size, source = recv(rows[count])
            except BlockingIOError:
                break
            except OSError:
                self._stats.socket_errors += 1
                continue
            lengths[count] = size
            names[count * mmsg.NAME_BYTES:count * mmsg.NAME_BYTES + 8] = known.get(source, unknown)
            count += 1
        return count

    def close(self) -> None:
        self.sock.close()
