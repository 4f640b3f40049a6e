"""The worker's UDP transport: a SwitchML-style self-clocked window over the job's slots.

One :meth:`Transport.exchange` call aggregates a ``(blocks, K)`` float32 array with the
other workers of the job (who make the same calls in the same order) and returns the
int32 sums and the global exponent of every block; :mod:`~netagg.hoststack.quantization`
decodes them.

Per call, block ``b`` travels in slot ``b % S`` (``S`` = the job's slot count). A slot
holds at most one outstanding packet: the next packet of slot ``s`` leaves only when the
result of the previous one arrived, with the other pool. Each packet's ``exponent``
carries this worker's exponent of the block one window ahead (``b + S``), so the result
of block ``b`` tells every worker the global exponent of block ``b + S`` before it is
quantized. The first window's exponents come from one *probe* per slot: a packet of
zeros carrying the exponent of block ``s``, with bit 31 of ``seq`` set. Data blocks use
``seq = block counter mod 2**31`` (consecutive over the transport's life). Every new
packet of a slot (probe or data) carries the slot's next ``round`` number, so the switch
drops a delayed copy of an earlier round instead of starting a round with it.

Lost packets are retransmitted (same bytes, ``FLAG_RETRANSMIT``) after a per-slot timeout
(RFC 6298 estimate from the result round trips, exponential backoff); a result is
accepted only if its (slot, pool, round, seq) equal what the slot has outstanding, so
neither a late copy nor a forged result naming another round or block can complete a
block (it is counted in ``stale_results``). No accepted
result for ``progress_timeout`` seconds raises :class:`TransportTimeout`.

Congestion control (ATP-style AIMD, with retransmission timeouts as the loss signal):
at most ``window`` slots are outstanding, ``window`` <= S. It starts at S (the plain
SwitchML window), halves (at most once per smoothed round trip) when a timer fires,
and grows by one per window of accepted results back to S. A packet whose slot is
ready but does not fit waits; waiting packets leave lowest block first (a slot's probe
before any data block), the same order on every worker. A waiting packet below every
packet the worker has outstanding leaves even when the window is full: otherwise, after
a decrease, a worker could hold only blocks that another worker cannot send until it
gets the lower block this worker is holding back (a deadlock). With that rule the lowest
unfinished block is always sent by every worker.
"""

from __future__ import annotations

import heapq
import math
import select
import time
from dataclasses import dataclass, field

import numpy as np

from netagg import wire
from netagg.hoststack import quantization as qz
from netagg.hoststack.packets import (
    PACKET_DTYPE,
    PROBE_SEQ_BIT,
    SEQ_MASK,
    resolve,
    slot_count_of,
    udp_socket,
)
from netagg.jobconfig import WorkerConfig

K = wire.K
_NETAGG_BYTES = wire.NETAGG_BYTES
_HEADER_BYTES = wire.HEADER_BYTES
_PAYLOAD_BYTES = wire.PAYLOAD_BYTES
_unpack_header = wire.HEADER_STRUCT.unpack_from
#: Datagrams read per wake-up before the ready slots are refilled.
_DRAIN_BATCH = 128


class TransportError(RuntimeError):
    """The transport cannot continue (an earlier failure, or a protocol violation)."""


class TransportTimeout(TransportError, TimeoutError):
    """No result arrived for ``progress_timeout`` seconds (a peer or the aggregator is gone)."""


@dataclass
class TransportStats:
    """Counters over the transport's life."""

    exchanges: int = 0
    blocks: int = 0
    packets_sent: int = 0
    retransmissions: int = 0
    results_accepted: int = 0
    #: Results that did not match the slot's outstanding (pool, round, seq): duplicates, late copies, forgeries.
    stale_results: int = 0
    #: Datagrams of the wrong size or version, or not a result of this job.
    malformed: int = 0
    #: Datagrams from an address that is not the aggregator (or the PS).
    foreign: int = 0
    socket_errors: int = 0
    #: Times the congestion window was halved, and its smallest value so far.
    window_decreases: int = 0
    smallest_window: float = 0.0


@dataclass
class RtoEstimator:
    """RFC 6298's retransmission timeout from round-trip samples, clamped to [minimum, maximum].

    A round completes only when the slowest worker's packet arrived, so one worker's loss
    inflates everyone's round trip; samples are therefore clipped to twice the smoothed RTT
    (a real increase still raises SRTT by up to 12.5 % per sample) so that RTTVAR does not
    explode under loss.
    """

    initial: float = 0.05
    minimum: float = 0.002
    maximum: float = 1.0
    granularity: float = 0.0005
    #: Doublings of one packet's timeout before it plateaus: a failed retransmission here mostly
    #: means another worker's packet was lost (the round was incomplete), not congestion ...
    max_backoff: int = 2
    #: ... for this many more retries; after them doubling resumes (a straggler or dead peer).
    plateau: int = 2
    srtt: float | None = None
    rttvar: float = 0.0
    rto: float = field(init=False)

    def __post_init__(self) -> None:
        self.rto = min(max(self.initial, self.minimum), self.maximum)

    def sample(self, rtt: float) -> None:
        """Feed one round trip of a packet that was not retransmitted (Karn)."""
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            rtt = min(rtt, 2 * self.srtt)
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.rto = min(max(self.srtt + max(self.granularity, 4 * self.rttvar), self.minimum), self.maximum)

    def backoff(self, retries: int) -> float:
        """Timeout after ``retries`` retransmissions of the same packet.

        ``rto * 2**e`` with e = 1, 2, .., max_backoff, then ``plateau`` times max_backoff,
        then increasing by one per retry again; at most ``maximum``.
        """
        doublings = max(min(retries, self.max_backoff), retries - self.plateau)
        return min(self.rto * (2 ** min(doublings, 40)), self.maximum)


class Transport:
    """A worker's UDP endpoint for one job (see the module docstring)."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        progress_timeout: float = 10.0,
        rto_initial: float = 0.05,
        rto_min: float = 0.002,
        rto_max: float = 1.0,
        max_backoff: int = 2,
        congestion_control: bool = True,
    ) -> None:
        self.config = config
        self.num_workers = config.num_workers
        self.slot_count = slot_count_of(config)
        self.progress_timeout = progress_timeout
        target = config.ps if config.mode == "fallback" else config.aggregator
        self.destination = resolve(target)
        sources = {self.destination}
        if config.mode == "ps" and config.ps is not None:
            sources.add(resolve(config.ps))  # the PS reflects the switch's results as our clock
        self.sources = frozenset(sources)
        self.sock = udp_socket(resolve(config.bind))
        self.address: tuple[str, int] = self.sock.getsockname()
        if len(self.sources) == 1:
            # One peer: a connected socket sends faster and the kernel drops strangers' datagrams.
            self.sock.connect(self.destination)
            self._send = self.sock.send
        else:
            destination = self.destination
            sendto = self.sock.sendto
            self._send = lambda data: sendto(data, destination)
        self._poller = select.poll()
        self._poller.register(self.sock.fileno(), select.POLLIN)
        self.rto = RtoEstimator(rto_initial, rto_min, rto_max, max_backoff=max_backoff)
        self.stats = TransportStats()
        #: Congestion window (packets outstanding), kept across exchanges; fixed at S without control.
        self.congestion_control = congestion_control
        self.window = float(self.slot_count)
        self.stats.smallest_window = self.window
        self._last_decrease = -math.inf
        # One preallocated packet per slot; row s is always slot s.
        self._packets = np.zeros(self.slot_count, PACKET_DTYPE)
        hdr = self._packets["hdr"]
        hdr["version"] = wire.VERSION
        hdr["job_id"] = config.job_id
        hdr["rank"] = config.rank
        hdr["slot"] = np.arange(self.slot_count)
        self._raw = self._packets.view(np.uint8).reshape(self.slot_count, _NETAGG_BYTES)
        self._rows = [memoryview(self._raw[s]) for s in range(self.slot_count)]
        self._next_pool = np.zeros(self.slot_count, np.uint8)
        # Per slot: the round number of its latest use (+1 per new packet, mod 2**16), which
        # lets the switch tell a delayed copy of an earlier round from a new one. Every worker
        # of the job uses each slot the same number of times, so their numbers agree.
        self._rounds = np.zeros(self.slot_count, np.uint16)
        self._flagged: set[int] = set()  # rows whose flags carry FLAG_RETRANSMIT
        self._seq = 0
        self._probe_seq = 0
        self._recv_buf = bytearray(2048)
        self._recv_view = memoryview(self._recv_buf)
        self._failed: str | None = None

    # -- public ------------------------------------------------------------
    def exchange(self, blocks: np.ndarray, exponents: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Aggregate ``blocks`` ((n, K) float32) with the job: returns (sums (n, K) '>i4', exponents int8).

        ``exponents`` are this worker's :func:`quantization.block_exponents` of ``blocks``
        (computed here when not given; NaN/Inf raise ValueError before anything is sent).
        """
        if self._failed is not None:
            raise TransportError(f"transport unusable after an earlier failure: {self._failed}")
        if exponents is None:
            exponents = qz.block_exponents(blocks)
        round_ = _Round(self, blocks, exponents)
        try:
            round_.run()
        except TransportTimeout as err:
            self._failed = str(err)
            raise
        except BaseException as err:
            self._failed = f"{type(err).__name__}: {err}"
            raise
        finally:
            self.stats.exchanges += 1
        return round_.sums, round_.global_exp

    @property
    def next_seq(self) -> int:
        """``seq`` of the next exchange's first data block."""
        return self._seq

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- used by _Round ------------------------------------------------------
    def _receive_into(self) -> tuple[int, tuple[str, int]] | None:
        """One datagram into the receive buffer; None when there is none."""
        try:
            return self.sock.recvfrom_into(self._recv_buf)
        except BlockingIOError:
            return None
        except OSError:  # e.g. ICMP port unreachable from an earlier send on loopback
            self.stats.socket_errors += 1
            return (-1, ("", 0))

    def _on_results(self, count: int) -> None:
        """Additive increase: one packet per window of accepted results, up to S."""
        if self.congestion_control and self.window < self.slot_count:
            self.window = min(self.window + count / self.window, float(self.slot_count))

    def _on_timeout(self, now: float) -> None:
        """Multiplicative decrease, at most once per smoothed round trip (one loss event)."""
        if not self.congestion_control:
            return
        srtt = self.rto.srtt if self.rto.srtt is not None else self.rto.rto
        if now - self._last_decrease < srtt:
            return
        self._last_decrease = now
        self.window = max(1.0, self.window / 2)
        self.stats.window_decreases += 1
        self.stats.smallest_window = min(self.stats.smallest_window, self.window)


def _result_keys(rounds: np.ndarray, pools: np.ndarray, seqs: np.ndarray) -> list[int]:
    """What a slot's result must echo, as one int per packet: ``round << 33 | pool << 32 | seq``."""
    return ((rounds.astype(np.int64) << 33) | (pools.astype(np.int64) << 32) | seqs).tolist()


class _Round:
    """The state of one exchange: per-slot outstanding packet, timers, received sums."""

    def __init__(self, transport: Transport, blocks: np.ndarray, exponents: np.ndarray) -> None:
        if blocks.ndim != 2 or blocks.shape[1] != K or blocks.dtype != np.float32:
            raise TypeError(f"expected float32 blocks of shape (n, {K}), got {blocks.dtype} {blocks.shape}")
        self.t = transport
        self.blocks = blocks
        self.num_blocks = nb = blocks.shape[0]
        self.window = transport.slot_count
        self.used_slots = min(self.window, nb)
        self.local_exp = np.asarray(exponents, dtype=np.int8)
        if self.local_exp.shape != (nb,):
            raise ValueError(f"{self.local_exp.shape[0]} exponents for {nb} blocks")
        # The exponent each slot's next packet carries: block b's packet carries b + window's.
        self._ahead = np.full(nb + self.window, qz.EXP_NONE, np.int8)
        self._ahead[:nb] = self.local_exp
        self.global_exp = np.full(nb, qz.EXP_NONE, np.int8)
        self.sums = np.empty((nb, K), qz.WIRE_DTYPE)
        self._sums_view = memoryview(self.sums.view(np.uint8).reshape(-1))
        self.seq0 = transport._seq
        self.probe0 = transport._probe_seq
        # Per used slot: expected (round << 33 | pool << 32 | seq) of the outstanding packet, or -1.
        self.expect = [-1] * self.used_slots
        self.sent_at = [0.0] * self.used_slots
        self.retries: dict[int, int] = {}
        self.timers: list[tuple[float, int, list[int], list[int]]] = []
        self._timer_id = 0
        self.remaining = nb
        #: Ready packets that did not fit in the congestion window: (order key, slot); see _order_key.
        self.waiting: list[tuple[int, int]] = []
        #: Order key of each slot's outstanding packet.
        self.in_flight: dict[int, int] = {}

    # -- sending -------------------------------------------------------------
    def emit_probes(self, slots: list[int]) -> None:
        """First-window probes in ``slots`` (zeros, carrying the exponent of block ``slot``)."""
        t = self.t
        sl = np.array(slots, dtype=np.intp)
        packets = t._packets
        packets["values"][sl] = 0
        seqs = PROBE_SEQ_BIT | ((self.probe0 + sl) & SEQ_MASK)
        hdr = packets["hdr"]
        hdr["seq"][sl] = seqs
        hdr["exponent"][sl] = self._ahead[sl]
        self._send(slots, sl, seqs)

    def _order_key(self, slot: int, block: int) -> int:
        """The release order of a packet: its block, or for a probe (block -1) ``slot - window`` (below every block)."""
        return block if block >= 0 else slot - self.window

    def release(self, slots: list[int], blocks: list[int]) -> None:
        """Send ready packets (probes as block -1) that fit in the congestion window; queue the rest.

        Queued packets leave lowest block first (probes first), before newer ones.
        """
        t = self.t
        in_flight = self.in_flight
        room = max(1, int(t.window)) - len(in_flight)
        if not self.waiting and len(slots) <= room:
            go_slots, go_blocks = slots, blocks
            for slot, block in zip(slots, blocks, strict=True):
                in_flight[slot] = self._order_key(slot, block)
        else:
            waiting = self.waiting
            for slot, block in zip(slots, blocks, strict=True):
                heapq.heappush(waiting, (self._order_key(slot, block), slot))
            go_slots, go_blocks = [], []
            while waiting:
                if len(go_slots) >= room and (not in_flight or waiting[0][0] > min(in_flight.values())):
                    break  # window full, and the lowest waiting packet is not the head of the line
                key, slot = heapq.heappop(waiting)
                in_flight[slot] = key
                go_slots.append(slot)
                go_blocks.append(key if key >= 0 else -1)
        if not go_slots:
            return
        probes = [s for s, b in zip(go_slots, go_blocks, strict=True) if b < 0]
        if probes:
            self.emit_probes(probes)
            if len(probes) < len(go_slots):
                data = [(s, b) for s, b in zip(go_slots, go_blocks, strict=True) if b >= 0]
                self.emit([s for s, _ in data], [b for _, b in data])
        else:
            self.emit(go_slots, go_blocks)

    def emit(self, slots: list[int], blocks: list[int]) -> None:
        """Quantize data ``blocks`` (their global exponents are known) and send them in ``slots``."""
        t = self.t
        sl = np.array(slots, dtype=np.intp)
        bl = np.array(blocks, dtype=np.intp)
        g = self.global_exp[bl]
        if (g < self.local_exp[bl]).any():
            raise TransportError("aggregator returned an exponent below this worker's: protocol violation")
        packets = t._packets
        packets["values"][sl] = qz.quantize(self.blocks[bl], g, t.num_workers)
        seqs = (bl + self.seq0) & SEQ_MASK
        hdr = packets["hdr"]
        hdr["seq"][sl] = seqs
        hdr["exponent"][sl] = self._ahead[bl + self.window]
        self._send(slots, sl, seqs)

    def _send(self, slots: list[int], sl: np.ndarray, seqs: np.ndarray) -> None:
        """Set pool and flags of the filled packets, send them, expect their results, arm one timer."""
        t = self.t
        pools = t._next_pool[sl]
        hdr = t._packets["hdr"]
        hdr["pool"][sl] = pools
        rounds = t._rounds[sl] + np.uint16(1)
        t._rounds[sl] = rounds
        hdr["round"][sl] = rounds
        if t._flagged:  # clear FLAG_RETRANSMIT left by earlier retransmissions from these rows
            hdr["flags"][list(t._flagged)] = 0
            t._flagged.clear()
        keys = _result_keys(rounds, pools, seqs)
        now = time.monotonic()
        rows, expect, sent_at, send = t._rows, self.expect, self.sent_at, t._send
        errors = 0
        for slot, key in zip(slots, keys, strict=True):
            try:
                send(rows[slot])
            except OSError:  # full buffer or ICMP: the timer resends
                errors += 1
            expect[slot] = key
            sent_at[slot] = now
        t.stats.packets_sent += len(keys) - errors
        t.stats.socket_errors += errors
        self._arm(now + t.rto.rto, slots, keys)

    def _arm(self, deadline: float, slots: list[int], keys: list[int]) -> None:
        self._timer_id += 1
        heapq.heappush(self.timers, (deadline, self._timer_id, slots, keys))

    def _retransmit_due(self, now: float) -> None:
        t = self.t
        while self.timers and self.timers[0][0] <= now:
            _, _, slots, keys = heapq.heappop(self.timers)
            for slot, key in zip(slots, keys, strict=True):
                if self.expect[slot] != key:
                    continue  # answered meanwhile
                t._on_timeout(now)
                retries = self.retries.get(slot, 0) + 1
                self.retries[slot] = retries
                t._raw[slot, 1] |= wire.FLAG_RETRANSMIT
                t._flagged.add(slot)
                try:
                    t._send(t._rows[slot])
                    t.stats.packets_sent += 1
                except OSError:
                    t.stats.socket_errors += 1
                t.stats.retransmissions += 1
                self._arm(now + t.rto.backoff(retries), [slot], [key])

    # -- receiving -----------------------------------------------------------
    def run(self) -> None:
        t = self.t
        nb = self.num_blocks
        if nb == 0:
            return
        self.release(list(range(self.used_slots)), [-1] * self.used_slots)
        last_progress = time.monotonic()
        buf, view = t._recv_buf, t._recv_view
        sources, job_id, stats = t.sources, t.config.job_id, t.stats
        expect, window, used = self.expect, self.window, self.used_slots
        seq0, sums_view, global_exp = self.seq0, self._sums_view, self.global_exp
        next_pool = t._next_pool
        while self.remaining:
            now = time.monotonic()
            wake = last_progress + t.progress_timeout
            if self.timers:
                wake = min(wake, self.timers[0][0])
            if wake > now:
                t._poller.poll(math.ceil((wake - now) * 1000))
            ready_slots: list[int] = []
            ready_blocks: list[int] = []
            accepted = stats.results_accepted
            for _ in range(_DRAIN_BATCH):
                got = t._receive_into()
                if got is None:
                    break
                size, source = got
                if size < 0:
                    continue
                if source not in sources:
                    stats.foreign += 1
                    continue
                if size != _NETAGG_BYTES:
                    stats.malformed += 1
                    continue
                version, flags, job, slot, pool, _, exponent, _, round_, seq = _unpack_header(buf, 0)
                if version != wire.VERSION or not flags & wire.FLAG_RESULT or job != job_id:
                    stats.malformed += 1
                    continue
                if slot >= used or expect[slot] != (round_ << 33 | pool << 32 | seq):
                    stats.stale_results += 1
                    continue
                # Accept: the result of the slot's outstanding packet.
                expect[slot] = -1
                del self.in_flight[slot]
                next_pool[slot] ^= 1
                stats.results_accepted += 1
                if self.retries:
                    if self.retries.pop(slot, 0) == 0:
                        t.rto.sample(time.monotonic() - self.sent_at[slot])
                else:
                    t.rto.sample(time.monotonic() - self.sent_at[slot])
                if seq & PROBE_SEQ_BIT:
                    following = slot
                else:
                    block = (seq - seq0) & SEQ_MASK
                    start = block * _PAYLOAD_BYTES
                    sums_view[start:start + _PAYLOAD_BYTES] = view[_HEADER_BYTES:_NETAGG_BYTES]
                    self.remaining -= 1
                    following = block + window
                if following < nb:
                    global_exp[following] = exponent
                    ready_slots.append(slot)
                    ready_blocks.append(following)
            now = time.monotonic()
            if stats.results_accepted != accepted:
                last_progress = now
                t._on_results(stats.results_accepted - accepted)
            elif now - last_progress >= t.progress_timeout:
                self._timeout(now - last_progress)
            if ready_slots or self.waiting:
                self.release(ready_slots, ready_blocks)
            self._retransmit_due(now)
        t._seq = (seq0 + nb) & SEQ_MASK
        t._probe_seq = (self.probe0 + used) & SEQ_MASK
        stats.blocks += nb

    def _timeout(self, waited: float) -> None:
        waiting = [s for s in range(self.used_slots) if self.expect[s] != -1]
        raise TransportTimeout(
            f"job {self.t.config.job_id} rank {self.t.config.rank}: no result for {waited:.1f} s "
            f"({self.remaining} of {self.num_blocks} blocks outstanding in {len(waiting)} slot(s), "
            f"{self.t.stats.retransmissions} retransmissions so far); is every worker of the job "
            f"running and is {self.t.destination[0]}:{self.t.destination[1]} reachable?"
        )
