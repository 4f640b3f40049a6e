"""The software target's fast packet loop: batches in, compiled pipeline, batches out.

Same job as :class:`~netagg.softswitch.switch.SoftSwitch` (which stays the loop of the
reference model and of fault injection), without per-packet Python: each wake-up reads a
batch of frames from a port in one system call, runs them through
:class:`~netagg.softswitch.fastpath.FastPipeline` in one call, and sends what they emit
with one ``sendmmsg`` per egress port. Frames of a batch are processed in arrival order,
so the program's semantics (register order between packets of one slot) are unchanged.

The loopback port also batches inside the kernel (:mod:`netagg.udpgso`): it receives with
``UDP_GRO`` (a host's segmented send arrives as one buffer, split here into datagrams) and
sends each destination's results as segmented sends of up to 64 datagrams. Where the
kernel offers neither, it falls back to one datagram per message, saying so once.
"""

from __future__ import annotations

import logging
import select
import socket
from collections import Counter
from collections.abc import Sequence

import numpy as np

from netagg import mmsg, udpgso, wire
from netagg.softswitch import io_kernels as kernels
from netagg.softswitch import packet_ring, raw_segmentation
from netagg.softswitch.fastpath import FastPipeline
from netagg.softswitch.ports import LoopbackUdpPort, Port, RawSocketPort
from netagg.softswitch.switch import PortLoop

log = logging.getLogger(__name__)

#: Bytes per frame buffer: a 9000-byte jumbo frame plus the loopback port's synthesized headers.
STRIDE = 9216
#: Frame header the loopback port synthesizes in front of each datagram.
LOOPBACK_HEADROOM = wire.ETH_HEADER_BYTES + wire.IPV4_HEADER_BYTES + wire.UDP_HEADER_BYTES
#: Batches served from one port before the others get a turn.
BATCHES_PER_TURN = 8
#: Datagrams the loopback port takes per receive with UDP_GRO (a few coalesced buffers).
LOOPBACK_GRO_ROWS = 256
#: Row of a loopback datagram: a netagg frame is 322 bytes; a longer datagram is cut to the row (and so
#: still dropped as malformed, as the reference loop does with the whole datagram). Small rows stay in cache.
LOOPBACK_STRIDE = 2048
#: Linux's PACKET_IGNORE_OUTGOING (4.20+): a raw socket does not see the frames it sent itself.
PACKET_IGNORE_OUTGOING = 23
SOL_PACKET = 263


def enable_batching(ports: Sequence[Port]) -> str | None:
    """Prepare the ports for batched serving (raw sockets stop seeing the frames they send);
    returns why these ports cannot be served in batches, or None."""
    for port in ports:
        if isinstance(port, RawSocketPort):
            try:
                port.sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
            except OSError as err:
                return f"raw port {port.ifname}: PACKET_IGNORE_OUTGOING not supported ({err})"
        elif not isinstance(port, LoopbackUdpPort):
            return f"port {port.number}: {type(port).__name__} has no batched receive"
    return None


class BatchSwitch(PortLoop):
    """Serves all ports from one thread, a batch at a time (interface of ``SoftSwitch``).

    Raw ports share one receive batch: every port that is ready when the loop wakes up adds
    its waiting frames (at most :data:`~netagg.mmsg.BATCH` each), the pipeline runs once over
    all of them, and what they emit leaves with one ``sendmmsg`` per egress port. By default the
    raw ports are read from packet rings instead, all at once and in arrival order across ports
    (:mod:`~netagg.softswitch.packet_ring`; ``raw_io`` / ``$NETAGG_RAW_IO`` picks ring or mmsg). The loopback
    port (the embedded default, alone on its switch) has a batch of its own, whose headroom
    takes the frame headers synthesized in front of each datagram.
    """

    thread_name = "softswitch-batch"
    #: No fault injection here (the target uses SoftSwitch's per-packet loop for that).
    rx_faults = None
    tx_faults = None

    def __init__(self, pipeline: FastPipeline, ports: Sequence[Port], raw_io: str | None = None,
                 peers: Sequence[FastPipeline] = (), udp_segmentation: bool = False) -> None:
        """``udp_segmentation``: raw ports send each run of one UDP flow's frames as one segmentation-offload
        send (:mod:`~netagg.softswitch.raw_segmentation`); off where the kernel refuses it, saying why."""
        reason = enable_batching(ports)
        if reason:
            raise ValueError(reason)
        super().__init__(ports)
        self.pipeline = pipeline
        #: Every shard's pipeline, index = shard (``netagg.softswitch.shards``); empty for an unsharded switch.
        self.peers = list(peers)
        #: Frames that reached this shard for another shard's slots (a sender broke the steering rule).
        self.foreign_frames = 0
        #: Frames the kernel refused to send, by egress port number (a raw port's socket buffer full: its link
        #: is backed up). Counted in ``stats.transmit_failed`` too; per port for :meth:`port_losses`.
        self.transmit_failed_by_port: Counter[int] = Counter()  # keys set below: read from other threads
        self._raw = [port for port in ports if isinstance(port, RawSocketPort)]
        self.transmit_failed_by_port.update({port.number: 0 for port in self._raw})
        self._loopback = [port for port in ports if isinstance(port, LoopbackUdpPort)]
        raw_rows = mmsg.BATCH * max(1, min(len(self._raw), 4))
        self._raw_rx = mmsg.MsgBatch(raw_rows, STRIDE)
        self._raw_len = np.zeros(raw_rows, np.int64)
        self._raw_port = np.zeros(raw_rows, np.int64)
        # raw_io (else $NETAGG_RAW_IO): "ring" reads raw ports from packet rings (packet_ring), "mmsg" with recvmmsg.
        self._rings = packet_ring.open_rings(self._raw, raw_io, max(raw_rows, 256), STRIDE)
        self._loop_rx: dict[int, mmsg.MsgBatch | udpgso.GroBatch] = {}
        for port in self._loopback:
            if udpgso.enable_gro(port.sock):
                self._loop_rx[port.number] = udpgso.GroBatch(LOOPBACK_GRO_ROWS, LOOPBACK_STRIDE, LOOPBACK_HEADROOM)
            else:
                log.info("loopback port %d: no UDP_GRO here, one datagram per message", port.number)
                self._loop_rx[port.number] = mmsg.MsgBatch(mmsg.BATCH, LOOPBACK_STRIDE, LOOPBACK_HEADROOM)
        loop_rows = LOOPBACK_GRO_ROWS
        self._loop_len = np.zeros(loop_rows, np.int64)
        self._loop_port = {port.number: np.full(loop_rows, port.number, np.int64) for port in self._loopback}
        self._loop_ip = {port.number: int.from_bytes(socket.inet_aton(port.address[0]), "big")
                         for port in self._loopback}
        # Egress: raw ports by group (port_slot[number]), the loopback port sent to elsewhere (-2).
        self._port_slot = np.full(max(self.ports) + 1, -1, np.int64)
        for group, port in enumerate(self._raw):
            self._port_slot[port.number] = group
        for port in self._loopback:
            self._port_slot[port.number] = -2
        self._group_counts = np.zeros(max(1, len(self._raw)), np.int64)
        self._owners = np.zeros(max(raw_rows, LOOPBACK_GRO_ROWS, 256), np.int64)
        self._out = mmsg.MsgBatch(max(2 * raw_rows, 2 * LOOPBACK_GRO_ROWS) + 4 * mmsg.BATCH, STRIDE)
        self._out_len = np.zeros(self._out.capacity, np.int64)
        self._out_port = np.zeros(self._out.capacity, np.int64)
        self._order = np.zeros(self._out.capacity, np.int64)  # group_sends' scratch
        # Segmented sends of the loopback port's results (udpgso), with their sorting scratch.
        self._gso: udpgso.GsoBatch | None = None
        if self._loopback:
            self._gso = udpgso.GsoBatch(self._out.capacity)
            if self._gso.refused is not None:
                log.info("loopback port: results leave one datagram per message (%s)", self._gso.refused)
            self._gso_keys = np.zeros(self._out.capacity, np.int64)
            self._gso_order = np.zeros((self._out.capacity, 2), np.uint64)
            self._gso_steer = np.zeros(self._out.capacity, np.int64)
        # Segmentation-offload sends on raw ports: a send-only socket per port, in group order.
        self._segmented: raw_segmentation.SegmentedSends | None = None
        self._tx_socks: list[socket.socket] = []
        if udp_segmentation and self._raw:
            try:
                for port in self._raw:
                    self._tx_socks.append(raw_segmentation.open_tx_socket(port.ifname))
                self._segmented = raw_segmentation.SegmentedSends(self._out.capacity, len(self._raw))
            except OSError as err:
                log.warning("raw ports: no segmentation offload (%s); one frame per send", err)
                for sock in self._tx_socks:
                    sock.close()
                self._tx_socks = []

    def run(self) -> None:
        """Serve until stop()."""
        poller = select.poll()
        by_fd = {port.fileno(): port for port in self.ports.values()}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        gro = [(port, rx) for port in self._loopback if isinstance(rx := self._loop_rx[port.number], udpgso.GroBatch)]
        while not self._stop.is_set():
            # Datagrams of a coalesced buffer left over from the last turn do not wake poll: serve them now.
            left = [port for port, rx in gro if rx.pending]
            ready = [by_fd[fd] for fd, _ in poller.poll(0 if left else 100)]
            ready += [port for port in left if port not in ready]
            try:
                raw = [port for port in ready if isinstance(port, RawSocketPort)]
                if raw:
                    self._serve_raw(raw)
                for port in ready:
                    if isinstance(port, LoopbackUdpPort):
                        self._serve_loopback(port)
            except Exception:  # a bug must not stop the switch
                log.exception("a batch from ports %s failed", [port.number for port in ready])

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._rings is not None and not (self._thread is not None and self._thread.is_alive()):
            self._rings.close()  # unmapped before the ports' sockets close
        for sock in self._tx_socks:
            sock.close()
        super().stop()

    def _serve_raw(self, ports: list[RawSocketPort]) -> None:
        if self._rings is not None:  # every port's ring at once, whichever woke the loop
            for _ in range(BATCHES_PER_TURN):
                fill = self._rings.receive()
                if fill == 0:
                    return
                self.stats.received += fill
                self._process(self._rings.buf, self._rings.lengths, self._rings.ports, fill)
            return
        rx, in_len, in_port = self._raw_rx, self._raw_len, self._raw_port
        for _ in range(BATCHES_PER_TURN):
            fill = 0
            for port in ports:
                count = rx.recv(port.fileno(), fill, mmsg.BATCH)
                in_port[fill:fill + count] = port.number
                fill += count
            if fill == 0:
                return
            self.stats.received += fill
            in_len[:fill] = rx.lengths[:fill]
            self._process(rx.buf, in_len, in_port, fill)

    def _serve_loopback(self, port: LoopbackUdpPort) -> None:
        rx, in_len, in_port = self._loop_rx[port.number], self._loop_len, self._loop_port[port.number]
        for _ in range(BATCHES_PER_TURN):
            count = rx.recv(port.fileno())
            if count == 0:
                return
            self.stats.received += count
            kernels.loopback_frames(rx.buf, rx.lengths, rx.names, count, LOOPBACK_HEADROOM,
                                    self._loop_ip[port.number], in_len)
            self._process(rx.buf, in_len, in_port, count)

    def _process(self, buf: np.ndarray, in_len: np.ndarray, in_port: np.ndarray, count: int) -> None:
        peers = self.peers
        if len(peers) > 1:
            me = self.pipeline.shard
            if count > self._owners.shape[0]:  # the kernel does not check bounds
                self._owners = np.zeros(count, np.int64)
            with self.pipeline.lock:
                tables = self.pipeline.tables()
            foreign = kernels.frame_owners(buf, in_len, in_port, count, len(peers), me, self._owners,
                                           tables.dn_keys, tables.dn_vals)
            if foreign:
                self.foreign_frames += foreign
                self._process_mixed(buf, in_len, in_port, count, me)
                return
        self._run(self.pipeline.lock, buf, in_len, in_port, 0, count)

    def _run(self, lock, buf: np.ndarray, in_len: np.ndarray, in_port: np.ndarray, start: int, end: int) -> None:
        """Frames ``start..end-1`` through this shard's pipeline holding ``lock``, sending what they emit."""
        while start < end:
            with lock:
                start, emitted = self.pipeline.run_locked(buf, in_len, in_port, end, self._out.buf, self._out_len,
                                                          self._out_port, start)
            if emitted:
                self._transmit(emitted)

    def _process_mixed(self, buf: np.ndarray, in_len: np.ndarray, in_port: np.ndarray, count: int, me: int) -> None:
        """A batch with frames of other shards' slots (a segmented send that broke the steering rule, steered
        by its first datagram): runs of one owner in order, another shard's under its lock and this one's
        (taken in shard order, as the control plane does), so no register is ever written by two cores at once."""
        owners = [me if o < 0 else o for o in self._owners[:count].tolist()]
        i = 0
        while i < count:
            owner = owners[i]
            j = i + 1
            while j < count and owners[j] == owner:
                j += 1
            if owner == me:
                self._run(self.pipeline.lock, buf, in_len, in_port, i, j)
            else:
                self._run(_Both(self.pipeline.lock, self.peers[owner].lock, me < owner), buf, in_len, in_port, i, j)
            i = j

    def _transmit(self, emitted: int) -> None:
        out, out_len, out_port = self._out, self._out_len, self._out_port
        handled = 0
        gso = self._gso
        for port in self._loopback:
            if gso is not None and gso.segmenting:
                headers, segments, bad = kernels.loopback_gso_sends(
                    out.buf, out_len, out_port, emitted, port.number, out.row_addr, out.names, out.name_addr,
                    gso.hdr_words, gso.iov_words, gso.ctrl_size, gso.iov_addr, gso.ctrl_addr, udpgso.CONTROL_BYTES,
                    udpgso.MAX_SEGMENTS, udpgso.MAX_SEND_BYTES, self._gso_keys, self._gso_order, self._gso_steer)
                handled += segments + bad
                if headers or bad:
                    sent, failed = gso.send(port.fileno(), headers) if headers else (0, 0)
                    port.undeliverable += bad + failed
                    self.stats.transmitted += sent
                    self.stats.transmit_failed += bad + failed
                continue
            prepared, bad = kernels.loopback_sends(out.buf, out_len, out_port, emitted, port.number, out.row_addr,
                                                   out.names, out.name_addr, out.tx_words, out.tx_iov_words)
            handled += prepared + bad
            if prepared or bad:
                sent, failed = out.send_prepared(port.fileno(), prepared)
                port.undeliverable += bad + failed
                self.stats.transmitted += sent
                self.stats.transmit_failed += bad + failed
        if not self._raw:
            self.stats.unknown_port += emitted - handled
            return
        if self._rings is not None and self._rings.tx:
            sent, failed, unknown = self._rings.transmit(out.buf, out_len, out_port, emitted, self._port_slot)
            self.stats.transmitted += sent
            self.stats.transmit_failed += failed
            self.stats.unknown_port += unknown
            return
        if self._segmented is not None and self._segmented.refused is None:
            self._transmit_segmented(emitted)
            return
        counts = self._group_counts
        self.stats.unknown_port += kernels.group_sends(out_len, out_port, emitted, self._port_slot, out.row_addr,
                                                       out.tx_words, out.tx_iov_words, counts, self._order)
        self._send_by_group(counts, out.send_prepared, [port.fileno() for port in self._raw])

    def _send_by_group(self, counts: np.ndarray, send, fds: list[int]) -> None:
        """Group ``g``'s ``counts[g]`` consecutive prepared messages through ``send(fds[g], count, first)`` (a
        sendmmsg), counting what left and what the kernel refused, per port."""
        first = 0
        for group, count in enumerate(counts.tolist()):
            if count:
                sent, failed = send(fds[group], count, first)
                self.stats.transmitted += sent
                self.stats.transmit_failed += failed
                if failed:
                    self.transmit_failed_by_port[self._raw[group].number] += failed
                first += count

    def _transmit_segmented(self, emitted: int) -> None:
        """Raw ports' frames as runs of one flow per send (raw_segmentation), one sendmmsg per port."""
        out, seg = self._out, self._segmented
        _, unknown = seg.plan(out.buf, self._out_len, self._out_port, emitted, self._port_slot, out.row_addr)
        self.stats.unknown_port += unknown
        self._send_by_group(seg.group_counts, seg.send, [sock.fileno() for sock in self._tx_socks])

    def port_losses(self) -> dict[int, tuple[int, int]]:
        """Per raw port: (frames the kernel refused to send out of it, frames its receive ring had no room
        for) since the switch started. Another thread may call it (the ring counters are the kernel's)."""
        dropped = self._rings.kernel_drops_by_port() if self._rings is not None else {}
        failed = dict(self.transmit_failed_by_port)
        return {port.number: (failed.get(port.number, 0), dropped.get(port.number, 0)) for port in self._raw}


class _Both:
    """Two shard locks held together, taken in shard order (``first_is_mine``: this shard's comes first)."""

    def __init__(self, mine, theirs, first_is_mine: bool) -> None:
        self._order = (mine, theirs) if first_is_mine else (theirs, mine)

    def __enter__(self) -> None:
        self._order[0].acquire()
        self._order[1].acquire()

    def __exit__(self, *exc: object) -> None:
        self._order[1].release()
        self._order[0].release()


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel with the array types the loop uses, so the
    first packets do not wait for the compiler (about 15 s on a 2-core machine, once per install).

    The batches have the loop's shapes: numba specializes on memory layout, and a 1-row batch's
    strided ``lengths`` view would count as contiguous and compile a version the loop never uses.
    """
    rx = mmsg.MsgBatch(mmsg.BATCH, 128, LOOPBACK_HEADROOM)
    in_len = np.zeros(mmsg.BATCH, np.int64)
    kernels.loopback_frames(rx.buf, rx.lengths, rx.names, 0, LOOPBACK_HEADROOM, 0, in_len)
    out = mmsg.MsgBatch(mmsg.BATCH, 128)
    out_len, out_port = np.zeros(mmsg.BATCH, np.int64), np.zeros(mmsg.BATCH, np.int64)
    kernels.loopback_sends(out.buf, out_len, out_port, 0, 1, out.row_addr, out.names, out.name_addr, out.tx_words,
                           out.tx_iov_words)
    kernels.group_sends(out_len, out_port, 0, np.full(2, -1, np.int64), out.row_addr, out.tx_words,
                        out.tx_iov_words, np.zeros(1, np.int64), np.zeros(mmsg.BATCH, np.int64))
    gso = udpgso.GsoBatch(mmsg.BATCH)
    kernels.loopback_gso_sends(out.buf, out_len, out_port, 0, 1, out.row_addr, out.names, out.name_addr,
                               gso.hdr_words, gso.iov_words, gso.ctrl_size, gso.iov_addr, gso.ctrl_addr,
                               udpgso.CONTROL_BYTES, udpgso.MAX_SEGMENTS, udpgso.MAX_SEND_BYTES,
                               np.zeros(mmsg.BATCH, np.int64), np.zeros((mmsg.BATCH, 2), np.uint64),
                               np.zeros(mmsg.BATCH, np.int64))
    kernels.frame_owners(rx.buf, in_len, in_len.copy(), 0, 2, 0, np.zeros(mmsg.BATCH, np.int64),
                         np.full((16, 2), -1, np.int64), np.zeros(16, np.int64))
    seg = raw_segmentation.SegmentedSends(out.capacity, 1)
    seg.plan(out.buf, out_len, out_port, 0, np.full(2, -1, np.int64), out.row_addr)
    udpgso.warm_up()
    packet_ring.warm_up()
    gro = udpgso.GroBatch(4, 128, LOOPBACK_HEADROOM)  # its lengths are contiguous, unlike MsgBatch's view
    kernels.loopback_frames(gro.buf, gro.lengths, gro.names, 0, LOOPBACK_HEADROOM, 0, np.zeros(4, np.int64))
