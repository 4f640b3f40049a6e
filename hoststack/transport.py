"""The worker's UDP transport: a SwitchML-style self-clocked window over the job's slots.

(Over 500 lines on purpose: :class:`Transport` and :class:`Exchange` share the per-slot rows and obey the
rules written below, which take a fifth of the file; the batch steps live in ``transport_reference`` and
``transport_kernels``, the codec in ``quantization``.)

One :meth:`Transport.exchange` call aggregates a ``(blocks, k)`` float32 array (k: the job's width) with the
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
(RFC 6298 estimate from the result round trips, exponential backoff, never below
:data:`RTO_FLOOR`: a worker or switch process on a busy machine is descheduled for several
milliseconds at a time, and a timer shorter than that takes the pause for a loss and floods
the links with copies just when the process is back; results waiting in the socket are read
before any timer is taken as expired); a result is
accepted only if its (slot, pool, round, seq) equal what the slot has outstanding, so
neither a late copy nor a forged result naming another round or block can complete a
block (it is counted in ``stale_results``). No accepted
result for ``progress_timeout`` seconds raises :class:`TransportTimeout`. A timeout with no
result accepted since the exchange began or since the previous timeout is a *stall*: most
likely another worker has not reached this exchange yet, and the switch keeps this worker's
packets until it does. Then only the head-of-line packet is resent (enough to repair a total
loss) and the window stays: resending the whole window every timeout while a straggler
computes would flood the links just when it arrives.

Riding through a switch restart (docs/protocol.md, "A switch restart"): the transport keeps
each slot's *previous* packet (``_shadow``: the exact bytes sent in the slot before its current
one, across exchanges). A restarted switch has lost the result of a round that some workers
received and others did not; only the former can finish it again, by resending their copies
of it. So when a slot's packet is resent for the second time or more (:data:`SHADOW_RETRIES`),
its shadow goes too (``FLAG_RETRANSMIT``, otherwise the same bytes), and when a stalled timeout
resends the head packet for the fourth time or more (:data:`STALL_SWEEP_RETRIES`), every slot's
latest packet whose result this worker holds goes (the shadow of a slot with a packet
outstanding, else the slot's last packet): a worker that lost a result may be stuck on a slot
this worker has finished with (or does not use in this exchange), holding back blocks that this
worker waits for, and a stall resends only the head packet. On a healthy switch each such copy
finds its round complete and gets the stored result back (counted in ``stale_results``) or
finds it superseded (dropped): harmless. They are counted in ``shadow_resends`` (and
``packets_sent``), not in ``retransmissions``.

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

I/O is batched through the kernel (:mod:`~netagg.hoststack.transport_io`, the socket's own module).
Every group of packets sent at once (a window refill, the retransmissions due at one moment) is built
in the preallocated rows by one pass (``fill_packets``) and leaves with one ``sendmmsg`` whose messages
are UDP GSO sends of up to 64 equal-size segments each (:mod:`netagg.udpgso`; iovecs point at the
rows), so the kernel's socket and IP layers are crossed once per 64 packets. Results are read with
``recvmmsg`` on a ``UDP_GRO`` socket, a coalesced buffer split by its segment size into receive rows,
and checked and applied by one pass over the batch
(``accept_results``): compiled with numba (:mod:`~netagg.hoststack.transport_kernels`) or its
numpy reference (:mod:`~netagg.hoststack.transport_reference`), with the same effects; the values are
quantized by the codec's one quantizer (``codec_kernels.quantize_row``, or
``quantization.quantize_scaled`` in numpy). Where the kernel refuses segmentation or GRO
the same batches go one datagram per message (``sendmmsg``/``recvmmsg``, one log line says
why), and without those calls (``mmsg.AVAILABLE`` false) one ``send`` or ``recvfrom_into``
per packet. Losing one segmented send loses up to 64 consecutive packets at once (a burst);
their timers fire together and they are resent together, a single loss event for the window.
"""

from __future__ import annotations

import heapq
import logging
import math
import socket
import time
from dataclasses import dataclass

import numpy as np

from netagg import layout, wire
from netagg.hoststack import quantization as qz
from netagg.hoststack import transport_reference as reference
from netagg.hoststack.congestion import RTO_FLOOR, CongestionWindow, RtoEstimator
from netagg.hoststack.failover import FailoverClient
from netagg.hoststack.packets import (
    PROBE_SEQ_BIT,
    SEQ_MASK,
    packet_dtype,
    slot_count_of,
)
from netagg.hoststack.transport_io import SlotSocket
from netagg.jobconfig import WorkerConfig, resolve

log = logging.getLogger(__name__)

try:  # compiled batch kernels when numba is installed (extra "fast"); same effects, faster
    from netagg.hoststack import transport_kernels as kernels
except ImportError:
    kernels = None  # (tests set it to None to run the numpy reference)

#: Receive calls per wake-up before the ready slots are refilled ...
_RECV_CALLS = 2
#: ... but while a retransmission timer is due, up to this many: results that waited in the socket while this
#: worker was descheduled are read before their packets are taken for lost (no retransmission storm).
_RECV_CALLS_MAX = 64
#: Restart ride-through (module docstring): from this resend of a packet on, its slot's previous packet is
#: resent with it ...
SHADOW_RETRIES = 2
#: ... and from this resend of the head packet in a stall on (about 11 RTOs into the stall), every slot's latest
#: answered packet. Needed: with the head's shadow alone, 3 of 8 runs of tests/test_hoststack_switch_restart.py
#: deadlocked. Measured with 4 workers, 32 slots, 3 x 200k values through the software switch: 2 (the first
#: stalled resend after the head's shadow) added 27 % packets at 5 % loss, 3 added 8 %, 4 adds 2 % (0.1 % at
#: 1 % loss; 2 sweeps per worker per 0.3 s straggler), with the same recovery times after a restart.
STALL_SWEEP_RETRIES = 4


class TransportError(RuntimeError):
    """The transport cannot continue (an earlier failure, or a protocol violation)."""


class TransportTimeout(TransportError, TimeoutError):
    """No result arrived for ``progress_timeout`` seconds (a peer or the aggregator is gone)."""


class OutOfStep(TransportError):
    """The job's ranks are not in the same collective: a round of this one met another collective's (or an
    aborting rank's) contribution (docs/protocol.md, "Collectives out of step"). No sum is returned, and the
    transport is failed: every rank of the job raises, and its workers must be started again."""


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
    #: Results that came back sooner after their packet's resend than the path's shortest round trip: the
    #: original made it, the timeout was spurious (hoststack/congestion.py) ...
    spurious_timeouts: int = 0
    #: ... and the window cuts such results undid.
    window_undos: int = 0
    #: Timeouts with no result since the previous one (a worker not there yet): only the head packet was resent.
    stalled_timeouts: int = 0
    #: Copies of packets whose result this worker already has (a slot's previous packet, see the module
    #: docstring), sent so that a worker that lost the result can finish the round on a restarted switch.
    shadow_resends: int = 0
    #: Failover (hoststack/failover.py): decisions applied (exchanges moved to the PS), returns to the switch,
    #: and exchanges this worker had finished and ran again at the PS.
    failovers: int = 0
    failover_returns: int = 0
    replayed_exchanges: int = 0


@dataclass(frozen=True)
class _Mark:
    """A transport's round state where an exchange began (restored to run it again at the PS)."""

    seq: int
    probe_seq: int
    rounds: np.ndarray
    next_pool: np.ndarray


class _FailedOver(Exception):
    """Raised out of an exchange by a failover decision: exchanges from ``start`` on run at the PS."""

    def __init__(self, start: int) -> None:
        super().__init__(start)
        self.start = start


@dataclass(frozen=True)
class SubsetRound:
    """A subset exchange as its members agreed on it beforehand (docs/protocol.md, "Subset rounds").

    ``members``: the ranks taking part (bit r = rank r); ``round_base``: every slot's round number
    before the exchange (its first packet in a slot carries ``round_base + 1``). Whoever schedules
    these exchanges gives each one a base past the previous one's last round
    (:func:`subset_round_uses`), so that the switch sees every exchange as new rounds. As in
    whole-job exchanges, a packet with round ``r`` goes in pool ``(r - 1) % 2`` (the first one in
    pool ``round_base % 2``): a slot's consecutive rounds never share a pool, even across
    exchanges, and a slot taken over never meets a packet whose round is SAME as the other
    pool's mark (docs/protocol.md, step 2).
    """

    members: int
    round_base: int


def subset_round_uses(num_blocks: int, slot_count: int) -> int:
    """The most round numbers an exchange of ``num_blocks`` blocks uses in one slot (its probe included)."""
    if num_blocks <= 0:
        return 0
    return -(-num_blocks // min(slot_count, num_blocks)) + 1


class Transport:
    """A worker's UDP endpoint for one job (see the module docstring)."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        progress_timeout: float = 10.0,
        rto_initial: float = 0.05,
        rto_min: float = RTO_FLOOR,
        rto_max: float = 1.0,
        max_backoff: int = 2,
        congestion_control: bool = True,
        sock: socket.socket | None = None,
        failover: FailoverClient | None = None,
        slot_range: tuple[int, int] | None = None,
        connect: bool = True,
    ) -> None:
        """``sock``: a UDP socket already bound to ``config.bind``'s port, to use instead of binding one
        (a caller that held the port since it reported it, so nothing else could take it). ``failover``:
        move the job's exchanges to its PS when the switch stays away (module docstring). ``slot_range``:
        (first slot, count), this transport's share of the job's slots (one of a worker's threads,
        :mod:`~netagg.hoststack.threads`; default: all of them). ``connect``: connect the socket to its one
        peer (a socket of a steered group must not be: the kernel steers only unconnected ones)."""
        self.config = config
        self.num_workers = config.num_workers
        #: Values per packet (the job's width) and the bytes of one message.
        self.k = config.width
        self.netagg_bytes = nbytes = wire.netagg_bytes(self.k)
        #: The job-relative slot of row 0 and the rows (slots) of this transport.
        self.slot_base, self.slot_count = slot_range if slot_range is not None else (0, slot_count_of(config))
        if self.slot_count < 1 or self.slot_base < 0 or self.slot_base + self.slot_count > 0x10000:
            raise ValueError(f"slot range {slot_range} is not within the 16-bit slot field")
        self.progress_timeout = progress_timeout
        target = config.ps if config.mode == "fallback" else config.aggregator
        # Failover to the PS (hoststack/failover.py): where the job's exchanges go while the switch is away.
        self.failover = failover
        self._switch_address = resolve(target)
        self._ps_address = resolve(config.ps) if failover is not None and config.ps is not None else None
        if failover is not None and self._ps_address is None:
            raise ValueError("failover needs the job's PS endpoint (config.ps)")
        #: ps mode: the PS reflects the switch's results as our clock, so both may send us results (whichever
        #: of the two the packets go to); other modes hear from where they send only.
        self._also_from = frozenset({resolve(config.ps), self._switch_address}) \
            if config.mode == "ps" and config.ps is not None else frozenset()
        self._on_ps = False
        #: Whole-job exchanges so far (the same count on every worker: the failover votes' index) ...
        self._index = 0
        #: ... and the last one's inputs, flags, collective id and the state it began from (run again at the PS
        #: after a failover).
        self._prev: tuple[np.ndarray, np.ndarray, np.ndarray | None, int, _Mark] | None = None
        self.rto = RtoEstimator(rto_initial, rto_min, rto_max, max_backoff=max_backoff)
        self.stats = TransportStats()
        #: Congestion window (packets outstanding), kept across exchanges; fixed at S without control.
        self.congestion_control = congestion_control
        self.cwnd = CongestionWindow(self.slot_count, congestion_control)
        self.stats.smallest_window = self.cwnd.value
        # One preallocated packet per slot; row s is always slot s.
        self.packets = np.zeros(self.slot_count, packet_dtype(self.k))
        hdr = self.packets["hdr"]
        hdr["version"] = wire.VERSION
        hdr["width"] = wire.width_code(self.k)
        hdr["job_id"] = config.job_id
        hdr["rank"] = config.rank
        hdr["slot"] = self.slot_base + np.arange(self.slot_count)
        self.raw = self.packets.view(np.uint8).reshape(self.slot_count, nbytes)
        self.words = self.raw.view(np.uint32)
        # Per slot: the exact bytes of the packet sent in it before the current one (row s of ``_raw``), kept
        # across exchanges, and how many packets the slot has carried (a shadow exists from 2 on).
        self.shadow = np.zeros((self.slot_count, nbytes), np.uint8)
        self.uses = np.zeros(self.slot_count, np.int64)
        # What the recovery resends are copied into and sent from (module docstring).
        self.resend = np.zeros((self.slot_count, nbytes), np.uint8)
        #: The members a subset exchange writes into each row it fills (0: the whole job).
        self.members = 0
        self.next_pool = np.zeros(self.slot_count, np.uint8)
        # Per slot: the round number of its latest use (+1 per new packet, mod 2**16), which
        # lets the switch tell a delayed copy of an earlier round from a new one. Every worker
        # of the job uses each slot the same number of times, so their numbers agree.
        self.rounds = np.zeros(self.slot_count, np.uint16)
        self.seq = 0
        self.probe_seq = 0
        self.encode = qz.factor_tables(config.total_workers)[:2]  # the whole job's (a tree: more than its leaf's)
        #: The socket and its batched I/O (transport_io.py), sending the rows above.
        self.io = SlotSocket(resolve(config.bind), self.raw, self.resend, self.slot_base, self.stats, sock, connect)
        self.address = self.io.address
        self._set_destination(self._switch_address)
        #: On the PS: the most rounds a slot has run there since the switch last saw the job (``failover_route``).
        self._rounds_away = 0
        self._failed: str | None = None
        #: Set by the first subset exchange: slots' round numbers then follow the subsets' bases, no longer
        #: the job-wide count every worker keeps, so whole-job exchanges are refused from then on.
        self._subset_rounds = False
        Exchange.warm_up(self)

    def _set_destination(self, destination: tuple[str, int]) -> None:
        """Send to ``destination`` (the switch, or the PS after a failover) and accept results from it."""
        self.io.set_destination(destination, self._also_from)

    # -- public ------------------------------------------------------------
    def exchange(self, blocks: np.ndarray, exponents: np.ndarray | None = None, *, flags: np.ndarray | None = None,
                 tag: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Aggregate ``blocks`` ((n, k) float32, k = ``self.k``) with the job: returns (sums (n, k) '>i4',
        exponents int8, round flags uint8), per block; :func:`quantization.dequantize` with ``flags=`` decodes them.

        ``exponents`` and ``flags`` are this worker's :func:`quantization.inspect` of ``blocks`` (computed here
        when either is not given: exponents alone do not say whether the blocks are finite). Blocks holding NaN
        or inf are sent as the protocol says (their flags set, those values 0): the result's flags tell which
        blocks are NaN or inf on every rank.
        ``tag``: names the collective beside its order and size (``wire.exchange_id``). Raises
        :class:`OutOfStep` when the job's ranks are in different collectives, :class:`TransportTimeout`
        when no result comes; either fails the transport for good.
        With failover, ``blocks`` is kept until the next exchange (another worker may need it sent
        again at the PS): do not change it before then.
        """
        if self._subset_rounds:
            raise TransportError("this transport runs subset rounds: its round numbers no longer agree with the "
                                 "job's other workers for a whole-job exchange")
        return self._exchange(blocks, exponents, flags, tag, None)

    def exchange_subset(self, blocks: np.ndarray, subset: SubsetRound, exponents: np.ndarray | None = None, *,
                        flags: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`exchange` with ``subset.members`` only: a subset round in every slot it uses.

        Every member calls it with the same blocks shape and ``subset``; the sums are theirs.
        """
        members = subset.members
        if not members >> self.config.rank & 1:
            raise ValueError(f"rank {self.config.rank} is not one of the members {members:#x}")
        if members >> self.num_workers:
            raise ValueError(f"members {members:#x} name ranks the job's {self.num_workers} workers do not have")
        uses = subset_round_uses(blocks.shape[0] if blocks.ndim == 2 else 0, self.slot_count)
        if uses >= 0x8000:
            raise ValueError(f"{blocks.shape[0]} blocks use {uses} rounds per slot: more than the switch tells apart")
        self._subset_rounds = True
        self.rounds[:] = subset.round_base & 0xFFFF
        self.next_pool[:] = subset.round_base & 1  # round r in pool (r - 1) % 2 (SubsetRound)
        self.seq = self.probe_seq = 0  # rounds are unique per exchange, so block ids may start over
        # Written into each row as it is filled (Exchange._launch), so that every row keeps the bytes it was sent
        # with (a shadow copy of it must be the same packet).
        self.members = members
        try:
            return self._exchange(blocks, exponents, flags, members, subset.round_base)
        finally:
            self.members = 0

    def abort(self, reason: str) -> None:
        """This worker cannot take part in its next collective (its input was refused before anything was sent):
        fail the transport and send an abort contribution into slot 0's next round, where every collective
        starts, so that the job's other ranks raise :class:`OutOfStep` instead of waiting (docs/protocol.md,
        "Collectives out of step"). Later calls raise at once."""
        if self._failed is not None:
            return
        self._failed = f"aborted: {reason}"
        if self._subset_rounds or self.slot_base != 0:
            return  # a subset's rounds are the scheduler's; another share's slot 0 is share 0's to abort
        packet = np.zeros(1, packet_dtype(self.k))
        hdr = packet["hdr"]
        hdr["width"] = wire.width_code(self.k)
        hdr["version"], hdr["flags"], hdr["job_id"], hdr["slot"] = wire.VERSION, wire.FLAG_OUT_OF_STEP, \
            self.config.job_id, 0
        hdr["pool"], hdr["rank"], hdr["exponent"] = self.next_pool[0], self.config.rank, qz.EXP_NONE
        hdr["round"] = (int(self.rounds[0]) + 1) & 0xFFFF
        hdr["seq"] = PROBE_SEQ_BIT | self.probe_seq
        hdr["exchange"] = wire.exchange_id(self._index, 0xFFFFFFFF)
        data = packet.tobytes()
        for _ in range(3):
            try:
                self.io.send(data)
            except OSError:
                self.stats.socket_errors += 1
        log.error("job %d rank %d: aborted collective %d (%s); the job's other ranks will raise OutOfStep",
                  self.config.job_id, self.config.rank, self._index, reason)

    def _exchange(self, blocks: np.ndarray, exponents: np.ndarray | None, flags: np.ndarray | None, tag: int,
                  round_base: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._failed is not None:
            raise TransportError(f"transport unusable after an earlier failure: {self._failed}")
        whole_job = round_base is None
        sent = self.stats.packets_sent
        try:
            exponents, flags = qz.inspected(blocks, exponents, flags)
            nb = blocks.shape[0] if blocks.ndim == 2 else 0
            ident = wire.exchange_id(self._index if whole_job else round_base, nb, tag)
            if whole_job and self._on_ps:
                assert self.failover is not None
                if not self.failover.on_ps(self._index, self._rounds_away):
                    self._back_to_switch()
            mark = self._mark()
            sums, global_exp, result_flags = self._run(blocks, exponents, flags, ident, mark)
        except TransportTimeout as err:
            self._failed = str(err)
            raise
        except BaseException as err:
            if self.stats.packets_sent == sent and not isinstance(err, TransportError):
                self.abort(f"{type(err).__name__}: {err}")  # refused before sending: tell the others
            self._failed = f"{type(err).__name__}: {err}"
            raise
        finally:
            self.stats.exchanges += 1
            if whole_job:
                self._index += 1  # a failed call counts too: the others' next collective must not match this one
        if whole_job and self.failover is not None:  # kept (not copied) for a failover that restarts here
            self._prev = (blocks, exponents, flags, ident, mark)
        return sums, global_exp, result_flags

    def _run(self, blocks: np.ndarray, exponents: np.ndarray, flags: np.ndarray | None, ident: int,
             mark: _Mark) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Run one exchange; after a failover decision, again at the PS from where the decision says."""
        while True:
            exchange = Exchange(self, blocks, exponents, flags, ident)
            try:
                self._run_exchange(exchange)
                return exchange.sums, exchange.global_exp, exchange.result_flags
            except _FailedOver as decision:
                self._to_ps()
                if decision.start == self._index - 1 and self._prev is not None:
                    # Another worker had not finished the previous exchange: send it again (same sums).
                    prev_blocks, prev_exponents, prev_flags, prev_ident, prev_mark = self._prev
                    self._restore(prev_mark)
                    self._run_exchange(Exchange(self, prev_blocks, prev_exponents, prev_flags, prev_ident))
                    self.stats.replayed_exchanges += 1
                elif decision.start != self._index:
                    raise TransportError(f"failover decision starts at exchange {decision.start}; this worker is at "
                                         f"{self._index}: the job's workers do not run the same exchanges") from None
                self._restore(mark)

    def _run_exchange(self, exchange: Exchange) -> None:
        exchange.run()
        if self._on_ps:  # a slot's rounds per exchange: exactly subset_round_uses, wherever they ran
            self._rounds_away += subset_round_uses(exchange.num_blocks, self.slot_count)

    def _mark(self) -> _Mark:
        return _Mark(self.seq, self.probe_seq, self.rounds.copy(), self.next_pool.copy())

    def _restore(self, mark: _Mark) -> None:
        self.seq, self.probe_seq = mark.seq, mark.probe_seq
        self.rounds[:] = mark.rounds
        self.next_pool[:] = mark.next_pool

    def failover_armed(self) -> bool:
        """Whether a stalled exchange votes for the PS (a whole-job exchange on the switch, with a PS)."""
        return self.failover is not None and not self._on_ps and not self._subset_rounds

    def vote(self) -> None:
        """A stalled exchange votes at the PS; raises _FailedOver with the decision, or returns (no decision:
        keep waiting for the switch)."""
        assert self.failover is not None
        start = self.failover.vote(self._index, self.address)
        if start is not None:
            raise _FailedOver(start)

    def _to_ps(self) -> None:
        assert self._ps_address is not None
        self._rounds_away = 0  # the switch saw (at most) every round sent so far
        self._on_ps = True
        self._set_destination(self._ps_address)
        self.uses[:] = 0  # no shadow resends of packets sent to the switch
        self.stats.failovers += 1
        log.warning("job %d rank %d: switch %s:%d away; exchanges from %d run at the PS %s:%d",
                    self.config.job_id, self.config.rank, *self._switch_address, self._index, *self._ps_address)

    def _back_to_switch(self) -> None:
        self._on_ps = False
        self._set_destination(self._switch_address)
        self.uses[:] = 0
        self.stats.failover_returns += 1
        log.info("job %d rank %d: exchanges from %d go to the switch %s:%d again", self.config.job_id,
                 self.config.rank, self._index, *self._switch_address)

    @property
    def batched(self) -> bool:
        """Whether packets cross the kernel in batches (sendmmsg/recvmmsg) rather than one call each."""
        return self.io.batched

    @property
    def gso_refused(self) -> str | None:
        """Why sends go one datagram per message instead of UDP GSO (None: GSO is in use)."""
        return self.io.gso_refused

    @property
    def gro(self) -> bool:
        """Whether results are received as UDP GRO coalesced buffers."""
        return self.io.gro

    @property
    def sock(self) -> socket.socket:
        return self.io.sock

    @property
    def destination(self) -> tuple[str, int]:
        """Where the exchanges go: the switch, or the PS after a failover."""
        return self.io.destination

    @property
    def on_ps(self) -> bool:
        """Whether the job's exchanges run at the PS (a failover) rather than at the switch."""
        return self._on_ps

    @property
    def next_seq(self) -> int:
        """``seq`` of the next exchange's first data block."""
        return self.seq

    def close(self) -> None:
        self.io.close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- used by Exchange (one exchange's state and loop; it also reads and writes the per-slot rows and round
    # state above: ``packets``/``raw``/``words``, ``shadow``/``uses``/``resend``, ``rounds``/``next_pool``/
    # ``seq``/``probe_seq``, ``members``; its I/O goes through ``io``) --
    @property
    def window(self) -> float:
        """Packets this transport keeps outstanding at most (``cwnd``; its slots without congestion control)."""
        return self.cwnd.value

    @window.setter
    def window(self, value: float) -> None:
        self.cwnd.value = float(value)

    def on_results(self, count: int) -> None:
        """Additive increase: one packet per window of accepted results, up to S."""
        self.cwnd.on_results(count)

    def on_timeout(self, now: float) -> None:
        """Multiplicative decrease, at most once per smoothed round trip (one loss event)."""
        if self.cwnd.on_timeout(now, self.rto.srtt if self.rto.srtt is not None else self.rto.rto):
            self.stats.window_decreases = self.cwnd.stats.decreases
            self.stats.smallest_window = self.cwnd.stats.smallest

    def on_resends_answered(self, spurious: int, confirmed: int) -> None:
        """Results for resent packets: ``spurious`` answered their originals (undo the cut their timeouts made,
        unless another was a loss), ``confirmed`` may have answered the resends (the cut stands)."""
        self.stats.spurious_timeouts += spurious
        if confirmed:
            self.cwnd.on_loss_confirmed()
        elif spurious and self.cwnd.on_spurious():
            self.stats.window_undos = self.cwnd.stats.undone


class Exchange:
    """One exchange (one :meth:`Transport.exchange` call): per-slot outstanding packet, timers, received sums."""

    def __init__(self, transport: Transport, blocks: np.ndarray, exponents: np.ndarray,
                 flags: np.ndarray | None = None, ident: int = 0) -> None:
        k = transport.k
        if blocks.ndim != 2 or blocks.shape[1] != k or blocks.dtype != np.float32:
            raise TypeError(f"expected float32 blocks of shape (n, {k}) (the job's width), got {blocks.dtype} "
                            f"{blocks.shape}")
        self.transport = transport
        self.num_blocks = nb = blocks.shape[0]
        if flags is not None and flags.shape != (nb,):
            raise ValueError(f"{flags.shape[0]} flags for {nb} blocks")
        #: Non-finite flags of each block (None: all finite); such blocks go with those values 0.
        self.block_flags = flags.astype(np.uint8) & wire.NONFINITE_FLAGS if flags is not None and flags.any() else None
        self.blocks = np.ascontiguousarray(qz.finite_blocks(blocks, self.block_flags))
        #: The collective's id (``wire.exchange_id``), in every packet; the round flags of each result block; and
        #: what ``accept_results`` reports of a result out of step: [seen, its exchange id, its slot].
        self.ident = ident
        self.result_flags = np.zeros(nb, np.uint8)
        self.alarm = np.zeros(3, np.int64)
        self.window = transport.slot_count
        self.used_slots = used = min(self.window, nb)
        self.local_exp = np.asarray(exponents, dtype=np.int8)
        if self.local_exp.shape != (nb,):
            raise ValueError(f"{self.local_exp.shape[0]} exponents for {nb} blocks")
        # The exponent each slot's next packet carries: block b's packet carries b + window's.
        self.ahead = np.full(nb + self.window, qz.EXP_NONE, np.int8)
        self.ahead[:nb] = self.local_exp
        self.global_exp = np.full(nb, qz.EXP_NONE, np.int8)
        self.sums = np.empty((nb, k), qz.WIRE_DTYPE)
        #: The sums as one row of bytes per block (what ``accept_results`` copies payloads into).
        self.sums_flat = self.sums.view(np.uint8).reshape(nb, 4 * k)
        self.seq0 = transport.seq
        self.probe0 = transport.probe_seq
        # Per used slot: expected (round << 33 | pool << 32 | seq) of the outstanding packet or -1,
        # when it was sent, and how often it was resent (Karn: no round trip sample then).
        self.expect = np.full(used, -1, np.int64)
        self.sent_at = np.zeros(used)
        self.retries = np.zeros(used, np.int32)
        #: When each slot's outstanding packet was last resent (0: not resent): tells a spurious timeout.
        self.resent_at = np.zeros(used)
        #: Retransmission timers: (deadline, id, slots, their expected keys when armed).
        self.timers: list[tuple[float, int, np.ndarray, np.ndarray]] = []
        self._timer_id = 0
        #: results_accepted at the start and at the last timeout: no change since means stalled (see below).
        self.accepted_mark = transport.stats.results_accepted
        #: A stalled timeout happened and no result has been accepted since (see _restart_timers).
        self.stall_open = False
        self.remaining = nb
        #: Ready packets that did not fit in the congestion window: (order key, slot); see _order_key.
        self.waiting: list[tuple[int, int]] = []
        #: Order key of each slot's outstanding packet.
        self.in_flight: dict[int, int] = {}
        #: The batch steps: compiled (transport_kernels) or their numpy reference (transport_reference).
        steps = kernels if kernels is not None else reference
        self.fill, self.accept = steps.fill_packets, steps.accept_results

    @classmethod
    def warm_up(cls, t: Transport) -> None:
        """Compile the batch kernels for ``t``'s argument types (or load them from numba's cache) now, with
        empty batches, rather than inside the first exchange's progress timeout."""
        if kernels is None:
            return
        r = cls(t, np.zeros((0, t.k), np.float32), np.zeros(0, np.int8))
        none = np.zeros(0, np.int64)
        r.fill(none, none, r.blocks, r.local_exp, r.global_exp, r.ahead, 0, 0, r.window, *t.encode, t.raw, t.words,
               t.next_pool, t.rounds, r.expect, r.sent_at, 0.0, none.copy())
        rows = t.io.rx_capacity
        outputs = np.zeros(rows, np.int64), np.zeros(rows, np.int64), np.zeros(rows)
        io = t.io
        r.accept(io.rx_buf, io.rx_lengths, io.rx_names, 0, io.allowed, t.config.job_id, t.slot_base, 0, r.window, 0,
                 r.expect, r.retries, r.sent_at, t.next_pool, 0.0, r.sums_flat, r.global_exp, 0, r.result_flags,
                 r.alarm, *outputs)
        RtoEstimator().sample_all(np.full(1, 0.001))  # one sample: an empty batch returns before the kernel

    # -- sending -------------------------------------------------------------
    def emit_probes(self, slots: list[int]) -> None:
        """First-window probes in ``slots`` (zeros, carrying the exponent of block ``slot``)."""
        self._launch(np.array(slots, np.int64), np.full(len(slots), -1, np.int64))

    def emit(self, slots: list[int], blocks: list[int]) -> None:
        """Quantize data ``blocks`` (their global exponents are known) and send them in ``slots``."""
        self._launch(np.array(slots, np.int64), np.array(blocks, np.int64))

    def _order_key(self, slot: int, block: int) -> int:
        """The release order of a packet: its block, or for a probe (block -1) ``slot - window`` (below every block)."""
        return block if block >= 0 else slot - self.window

    def release(self, slots: list[int], blocks: list[int]) -> None:
        """Send ready packets (probes as block -1) that fit in the congestion window; queue the rest.

        Queued packets leave lowest block first (probes first), before newer ones.
        """
        t = self.transport
        in_flight = self.in_flight
        room = max(1, int(t.window)) - len(in_flight)
        if not self.waiting and len(slots) <= room:
            go_slots, go_blocks = slots, blocks
            if blocks and min(blocks) >= 0:
                in_flight.update(zip(slots, blocks))  # data blocks: the key is the block
            else:
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
        if go_slots:
            # In release order: probes (lowest keys) before data blocks.
            self._launch(np.array(go_slots, np.int64), np.array(go_blocks, np.int64))

    def _launch(self, slots: np.ndarray, block_ids: np.ndarray) -> None:
        """Build the packets (``fill_packets``), send them in one batch, arm one timer."""
        t = self.transport
        keys = np.empty(slots.shape[0], np.int64)
        now = time.monotonic()
        enc_a, enc_b = t.encode
        # Each row still holds the slot's latest packet, as it was sent (FLAG_RETRANSMIT aside): it becomes
        # the slot's shadow (the same for both fill implementations: the copy is made here, before either).
        t.shadow[slots] = t.raw[slots]
        t.uses[slots] += 1
        hdr = t.packets["hdr"]
        if t.members:
            hdr["members"][slots] = t.members
        hdr["exchange"][slots] = self.ident
        if self.fill(slots, block_ids, self.blocks, self.local_exp, self.global_exp, self.ahead, self.seq0,
                      self.probe0, self.window, enc_a, enc_b, t.raw, t.words, t.next_pool, t.rounds,
                      self.expect, self.sent_at, now, keys) < 0:
            raise TransportError("aggregator returned an exponent below this worker's: protocol violation")
        if self.block_flags is not None:  # fill wrote flags 0: a block's non-finite flags go with it
            hdr["flags"][slots] = np.where(block_ids >= 0, self.block_flags[np.maximum(block_ids, 0)], 0)
        errors = t.io.transmit(slots)
        t.stats.packets_sent += slots.shape[0] - errors
        t.stats.socket_errors += errors
        self._arm(now + t.rto.rto, slots, keys)

    def _arm(self, deadline: float, slots: np.ndarray, keys: np.ndarray) -> None:
        self._timer_id += 1
        heapq.heappush(self.timers, (deadline, self._timer_id, slots, keys))

    def _retransmit_due(self, now: float) -> None:
        """Resend every packet whose timer expired unanswered, all in one batch; each gets its backoff timer."""
        t, expect, timers = self.transport, self.expect, self.timers
        due: list[np.ndarray] = []
        due_keys: list[np.ndarray] = []
        while timers and timers[0][0] <= now:
            _, _, slots, keys = heapq.heappop(timers)
            unanswered = expect[slots] == keys
            if unanswered.any():
                due.append(slots[unanswered])
                due_keys.append(keys[unanswered])
        if not due:
            return
        slots = np.concatenate(due) if len(due) > 1 else due[0]
        keys = np.concatenate(due_keys) if len(due_keys) > 1 else due_keys[0]
        retries = self.retries
        stalled = t.stats.results_accepted == self.accepted_mark
        self.accepted_mark = t.stats.results_accepted
        if stalled:
            # No result since the exchange began or since the last timeout: most likely another worker has not
            # reached this exchange yet (the switch holds our packets meanwhile). Resend only the head-of-line
            # packet, which also repairs a total loss, and keep the window: no congestion was seen. (From the
            # head's STALL_SWEEP_RETRIES-th resend on, every slot's latest answered packet goes too: see the end.)
            head_slot = min(self.in_flight, key=self.in_flight.__getitem__)
            is_head = slots == head_slot
            rest = ~is_head
            if rest.any():  # one timer for the others, not backed off further: they were not sent
                self._arm(now + t.rto.backoff(max(1, int(retries[slots[rest]].min()))), slots[rest], keys[rest])
            t.stats.stalled_timeouts += 1
            self.stall_open = True
            slots, keys = slots[is_head], keys[is_head]
            if not slots.shape[0]:
                return
        by_retries: dict[int, list[int]] = {}
        for i, slot in enumerate(slots.tolist()):
            if not stalled:
                t.on_timeout(now)
            count = int(retries[slot]) + 1
            retries[slot] = count
            by_retries.setdefault(count, []).append(i)
        t.raw[slots, layout.FLAGS_AT] |= wire.FLAG_RETRANSMIT  # cleared when the row is next filled
        errors = t.io.transmit(slots)
        self.resent_at[slots] = now
        t.stats.packets_sent += slots.shape[0] - errors
        t.stats.socket_errors += errors
        t.stats.retransmissions += slots.shape[0]
        for count, members in by_retries.items():
            self._arm(now + t.rto.backoff(count), slots[members], keys[members])
        # A restarted switch may have lost a result that other workers hold and another does not (module
        # docstring): from a packet's second resend on, its slot's previous packet goes too; in a stall, where
        # the stuck worker may be waiting on any slot, every slot's latest packet whose result this worker has.
        if stalled:
            if retries[slots[0]] >= STALL_SWEEP_RETRIES:
                self._resend_answered(np.arange(t.slot_count, dtype=np.int64))
        else:
            again = slots[retries[slots] >= SHADOW_RETRIES]
            if again.shape[0]:
                self._resend_answered(np.unique(again))  # a slot once, even if two of its timers were due

    def _restart_timers(self, now: float) -> None:
        """The first result after a stall: every outstanding packet's timer starts again from now (RFC 6298's
        restart on new acknowledgements). The switch held them while the straggler was away; timers that ran
        through the stall would fire while its results come in and resend (and halve the window for) the lot."""
        self.stall_open = False
        slots = np.fromiter(self.in_flight, np.int64, len(self.in_flight))
        self.timers.clear()
        if slots.shape[0]:
            self._arm(now + self.transport.rto.rto, slots, self.expect[slots].copy())

    def _resend_answered(self, slots: np.ndarray) -> None:
        """Resend, per slot of ``slots``, its latest packet whose result this worker already has: the shadow
        (previous packet) of a slot with a packet outstanding, else the slot's row (its last packet);
        ``FLAG_RETRANSMIT`` set, the same bytes otherwise. Slots without such a packet are skipped."""
        t = self.transport
        uses = t.uses[slots]
        outstanding = np.zeros(slots.shape[0], bool)
        inside = slots < self.used_slots
        outstanding[inside] = self.expect[slots[inside]] != -1
        keep = uses >= np.where(outstanding, 2, 1)
        if not keep.all():
            slots, outstanding = slots[keep], outstanding[keep]
        n = slots.shape[0]
        if not n:
            return
        rows = t.resend[:n]
        rows[:] = np.where(outstanding[:, None], t.shadow[slots], t.raw[slots])
        rows[:, layout.FLAGS_AT] |= wire.FLAG_RETRANSMIT
        errors = t.io.transmit(np.arange(n, dtype=np.int64), resend_buffer=True, blocks=t.io.blocks_of(slots))
        t.stats.packets_sent += n - errors
        t.stats.socket_errors += errors
        t.stats.shadow_resends += n - errors

    # -- receiving -----------------------------------------------------------
    def run(self) -> None:
        t = self.transport
        nb = self.num_blocks
        if nb == 0:
            return
        self.release(list(range(self.used_slots)), [-1] * self.used_slots)
        last_progress = time.monotonic()
        stats, accept, job_id, slot_base = t.stats, self.accept, t.config.job_id, t.slot_base
        io = t.io
        buf, names, lengths, allowed = io.rx_buf, io.rx_names, io.rx_lengths, io.allowed
        expect, retries, sent_at, next_pool = self.expect, self.retries, self.sent_at, t.next_pool
        window, seq0, sums, global_exp = self.window, self.seq0, self.sums_flat, self.global_exp
        ident, result_flags, alarm = self.ident, self.result_flags, self.alarm
        rows = io.rx_capacity
        acc_slots = np.empty(rows, np.int64)
        following = np.empty(rows, np.int64)
        rtts = np.empty(rows)
        failover = t.failover if t.failover_armed() else None
        vote_at = last_progress + failover.after if failover is not None else math.inf
        while self.remaining:
            now = time.monotonic()
            wake = min(last_progress + t.progress_timeout, vote_at)
            if self.timers:
                wake = min(wake, self.timers[0][0])
            if wake > now and not io.rx_pending():
                io.poller.poll(math.ceil((wake - now) * 1000))
            ready_slots: list[int] = []
            ready_blocks: list[int] = []
            accepted = 0
            calls = 0
            while calls < _RECV_CALLS_MAX:
                calls += 1
                count = io.receive()
                if count <= 0:
                    if count < 0:
                        continue  # a socket error (counted): read on
                    break
                n_acc, n_rtt, foreign, malformed, stale, done = accept(
                    buf, lengths, names, count, allowed, job_id, slot_base, seq0, window, nb, expect, retries, sent_at,
                    next_pool, time.monotonic(), sums, global_exp, ident, result_flags, alarm, acc_slots, following,
                    rtts)
                if foreign or malformed or stale:
                    stats.foreign += foreign
                    stats.malformed += malformed
                    stats.stale_results += stale
                    if alarm[0]:
                        self._out_of_step()
                if n_acc:
                    accepted += n_acc
                    self.remaining -= done
                    resent = self.resent_at[acc_slots[:n_acc]]
                    if resent.any():
                        self._judge_resends(acc_slots[:n_acc], resent)
                    in_flight = self.in_flight
                    for slot in acc_slots[:n_acc].tolist():
                        del in_flight[slot]
                    if n_rtt:
                        t.rto.sample_all(rtts[:n_rtt])
                    nxt = following[:n_acc]
                    ready = nxt < nb
                    ready_slots += acc_slots[:n_acc][ready].tolist()
                    ready_blocks += nxt[ready].tolist()
                if calls >= _RECV_CALLS and not (self.timers and self.timers[0][0] <= time.monotonic()):
                    break  # refill the ready slots first; the rest is read on the next turn
            now = time.monotonic()
            if accepted:
                stats.results_accepted += accepted
                last_progress = now
                if self.stall_open:
                    self._restart_timers(now)
                t.on_results(accepted)
                if failover is not None:
                    vote_at = now + failover.after
            elif now >= vote_at:
                t.vote()  # the switch may be away: raises _FailedOver once every worker voted
                vote_at = time.monotonic() + failover.after  # no decision: ride on, vote again later
                if time.monotonic() - last_progress >= t.progress_timeout:
                    self._timeout(time.monotonic() - last_progress)
            elif now - last_progress >= t.progress_timeout:
                self._timeout(now - last_progress)
            if ready_slots or self.waiting:
                self.release(ready_slots, ready_blocks)
            self._retransmit_due(now)
        t.seq = (seq0 + nb) & SEQ_MASK
        t.probe_seq = (self.probe0 + self.used_slots) & SEQ_MASK
        stats.blocks += nb

    def _judge_resends(self, slots: np.ndarray, resent: np.ndarray) -> None:
        """Accepted results of ``slots`` whose packets were resent at ``resent`` (0: not resent): those back sooner
        than the path's shortest round trip answer the originals (the timeout was spurious: the originals' round
        trips are samples); the others may answer the resends (hoststack/congestion.py)."""
        t = self.transport
        now = time.monotonic()
        was = resent > 0
        slots = slots[was]
        self.resent_at[slots] = 0.0
        spurious = t.rto.spurious(now - resent[was])
        n = int(spurious.sum())
        if n:
            t.rto.sample_all(now - self.sent_at[slots[spurious]])
        t.on_resends_answered(n, slots.shape[0] - n)

    def _out_of_step(self) -> None:
        t = self.transport
        met = int(self.alarm[1])
        other = "another rank's abort, or a contribution of another collective" if met == self.ident \
            else f"collective id {met:#010x}"
        raise OutOfStep(
            f"job {t.config.job_id} rank {t.config.rank}: the job's ranks are out of step in collective "
            f"#{t._index} ({self.num_blocks} blocks, id {self.ident:#010x}): slot {int(self.alarm[2]) + t.slot_base}'s "
            f"round met {other} (a rank skipped or failed a call, or called with another size); no sum is "
            "returned, and this worker is unusable: restart the job's workers")

    def _timeout(self, waited: float) -> None:
        waiting = int((self.expect != -1).sum())
        raise TransportTimeout(
            f"job {self.transport.config.job_id} rank {self.transport.config.rank}: no result for {waited:.1f} s "
            f"({self.remaining} of {self.num_blocks} blocks outstanding in {waiting} slot(s), "
            f"{self.transport.stats.retransmissions} retransmissions so far); is every worker of the job "
            f"running and is {self.transport.destination[0]}:{self.transport.destination[1]} reachable?"
        )
