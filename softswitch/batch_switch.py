"""The software target's fast packet loop: batches in (recvmmsg), compiled pipeline, batches out (sendmmsg).

Same job as :class:`~netagg.softswitch.switch.SoftSwitch` (which stays the loop of the
reference model and of fault injection), without per-packet Python: each wake-up reads up
to :data:`~netagg.mmsg.BATCH` frames from a port in one system call, runs them through
:class:`~netagg.softswitch.fastpath.FastPipeline` in one call, and sends what they emit
with one ``sendmmsg`` per egress port. Frames of a batch are processed in arrival order,
so the program's semantics (register order between packets of one slot) are unchanged.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
from collections.abc import Sequence

import numpy as np

from netagg import mmsg, wire
from netagg.softswitch import fastpath_kernels as kernels
from netagg.softswitch.fastpath import FastPipeline
from netagg.softswitch.ports import LoopbackUdpPort, Port, RawSocketPort
from netagg.softswitch.switch import PortStats

log = logging.getLogger(__name__)

#: Bytes per frame buffer: a 9000-byte jumbo frame plus the loopback port's synthesized headers.
STRIDE = 9216
#: Frame header the loopback port synthesizes in front of each datagram.
LOOPBACK_HEADROOM = wire.ETH_HEADER_BYTES + wire.IPV4_HEADER_BYTES + wire.UDP_HEADER_BYTES
#: Batches served from one port before the others get a turn.
BATCHES_PER_TURN = 8
#: Linux's PACKET_IGNORE_OUTGOING (4.20+): a raw socket does not see the frames it sent itself.
PACKET_IGNORE_OUTGOING = 23
SOL_PACKET = 263


def batch_unavailable(ports: Sequence[Port]) -> str | None:
    """Why these ports cannot be served in batches, or None."""
    for port in ports:
        if isinstance(port, RawSocketPort):
            try:
                port.sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
            except OSError as err:
                return f"raw port {port.ifname}: PACKET_IGNORE_OUTGOING not supported ({err})"
        elif not isinstance(port, LoopbackUdpPort):
            return f"port {port.number}: {type(port).__name__} has no batched receive"
    return None


class _PortIo:
    """One port's receive batch and its constant arrays."""

    def __init__(self, port: Port) -> None:
        self.port = port
        self.fd = port.fileno()
        self.loopback = isinstance(port, LoopbackUdpPort)
        self.rx = mmsg.MsgBatch(mmsg.BATCH, STRIDE, LOOPBACK_HEADROOM if self.loopback else 0)
        self.in_len = np.zeros(mmsg.BATCH, np.int64)
        self.in_port = np.full(mmsg.BATCH, port.number, np.int64)
        self.switch_ip = int.from_bytes(socket.inet_aton(port.address[0]), "big") if self.loopback else 0


class BatchSwitch:
    """Serves all ports from one thread, a batch at a time (interface of ``SoftSwitch``)."""

    #: No fault injection here (the target uses SoftSwitch's per-packet loop for that).
    rx_faults = None
    tx_faults = None

    def __init__(self, pipeline: FastPipeline, ports: Sequence[Port]) -> None:
        reason = batch_unavailable(ports)
        if reason:
            raise ValueError(reason)
        self.pipeline = pipeline
        self.ports = {port.number: port for port in ports}
        if len(self.ports) != len(ports):
            raise ValueError("two ports share a number")
        self.stats = PortStats()
        self._io = {port.fileno(): _PortIo(port) for port in ports}
        self._out = mmsg.MsgBatch(4 * mmsg.BATCH, STRIDE)
        self._out_len = np.zeros(self._out.capacity, np.int64)
        self._out_port = np.zeros(self._out.capacity, np.int64)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="softswitch-batch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for port in self.ports.values():
            port.close()

    def run(self) -> None:
        """Serve until stop()."""
        poller = select.poll()
        for fd in self._io:
            poller.register(fd, select.POLLIN)
        while not self._stop.is_set():
            for fd, _ in poller.poll(100):
                try:
                    self._serve(self._io[fd])
                except Exception:  # a bug must not stop the switch
                    log.exception("batch from port %d failed", self._io[fd].port.number)

    def _serve(self, io: _PortIo) -> None:
        rx = io.rx
        for _ in range(BATCHES_PER_TURN):
            count = rx.recv(io.fd)
            if count == 0:
                return
            self.stats.received += count
            if io.loopback:
                kernels.loopback_frames(rx.buf, rx.lengths, rx.names, count, LOOPBACK_HEADROOM, io.switch_ip,
                                        io.in_len)
            else:
                io.in_len[:count] = rx.lengths[:count]
            start = 0
            while start < count:
                start, emitted = self.pipeline.run(rx.buf, io.in_len, io.in_port, count, self._out.buf,
                                                   self._out_len, self._out_port, start)
                if emitted:
                    self._transmit(emitted)

    def _transmit(self, emitted: int) -> None:
        out, out_port = self._out, self._out_port
        first = out_port[0]
        numbers = [int(first)] if (out_port[:emitted] == first).all() else np.unique(out_port[:emitted]).tolist()
        for number in numbers:
            port = self.ports.get(number)
            if port is None:
                self.stats.unknown_port += int((out_port[:emitted] == number).sum())
                continue
            if isinstance(port, LoopbackUdpPort):
                prepared, bad = kernels.loopback_sends(out.buf, self._out_len, out_port, emitted, number,
                                                       out.row_addr, out.names, out.name_addr, out.tx_words,
                                                       out.tx_iov_words)
                port.undeliverable += bad
                self.stats.transmit_failed += bad
            else:
                prepared = kernels.raw_sends(self._out_len, out_port, emitted, number, out.row_addr, out.tx_words,
                                             out.tx_iov_words)
            sent, failed = out.send_prepared(port.fileno(), prepared)
            self.stats.transmitted += sent
            self.stats.transmit_failed += failed
            if isinstance(port, LoopbackUdpPort):
                port.undeliverable += failed


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel with the array types the loop uses, so the
    first packets do not wait for the compiler (about 15 s on a 2-core machine, once per install)."""
    rx = mmsg.MsgBatch(1, 128, LOOPBACK_HEADROOM)
    in_len = np.zeros(1, np.int64)
    kernels.loopback_frames(rx.buf, rx.lengths, rx.names, 0, LOOPBACK_HEADROOM, 0, in_len)
    out = mmsg.MsgBatch(1, 128)
    out_len, out_port = np.zeros(1, np.int64), np.zeros(1, np.int64)
    kernels.loopback_sends(out.buf, out_len, out_port, 0, 1, out.row_addr, out.names, out.name_addr, out.tx_words,
                           out.tx_iov_words)
    kernels.raw_sends(out_len, out_port, 0, 1, out.row_addr, out.tx_words, out.tx_iov_words)

