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
before any timer is taken as expired; a group of packets sent at once gets its timer later by the time the
group takes to leave the bottleneck at the rate the window holds, ``count x SRTT / window``, else a whole
window sent at once, as an exchange's first is, times out at its tail); a result is
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

import logging
import math
import socket
import time
from dataclasses import dataclass

import numpy as np

from netagg import wire
from netagg.hoststack import quantization as qz
from netagg.hoststack.congestion import RTO_FLOOR, CongestionWindow, RtoEstimator
from netagg.hoststack.exchange import (
    ClosedEarly,
    Exchange,
    OutOfStep,
    TransportError,
    TransportStats,
    TransportTimeout,
)
from netagg.hoststack.failover import FailoverClient
from netagg.hoststack.packets import (
    PROBE_SEQ_BIT,
    packet_dtype,
    slot_count_of,
)
from netagg.hoststack.slot_rows import RoundMark, SlotRows
from netagg.hoststack.transport_io import SlotSocket
from netagg.jobconfig import WorkerConfig, resolve

log = logging.getLogger(__name__)

#: What callers import from here (the exchange's errors and counters live in ``exchange.py``).
__all__ = ["RTO_FLOOR", "ClosedEarly", "Exchange", "OutOfStep", "RtoEstimator", "SubsetRound", "Transport",
           "TransportError", "TransportStats", "TransportTimeout", "subset_round_uses"]

#: A whole-job exchange with a deadline gives up this many seconds after its deadline.
DEADLINE_GIVE_UP = 5.0


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

    Deadline rounds (docs/protocol.md, "Closing a round at a deadline"): with ``partial`` every member accepts
    rounds closed before all members contributed (:attr:`Transport.last_members` then says, per block, who is in
    the sum); a member with ``close_after`` closes its rounds still outstanding that many seconds after its
    exchange began (implies ``partial``); one with ``give_up_after`` stops that many seconds after it began
    (``TransportTimeout``): a member that late was closed out of rounds the others have moved past. Without
    ``partial`` or ``close_after``, a closed round fails the exchange (``ClosedEarly``).
    """

    members: int
    round_base: int
    partial: bool = False
    close_after: float | None = None
    give_up_after: float | None = None


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
        self.netagg_bytes = wire.netagg_bytes(self.k)
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
        #: The last whole-job exchange, for a failover that restarts there: blocks, exponents, flags, id, mark, and
        #: whether it was a deadline exchange (its sums may hold closed rounds, which the PS cannot reproduce).
        self._prev: tuple[np.ndarray, np.ndarray, np.ndarray | None, int, RoundMark, bool] | None = None
        self.rto = RtoEstimator(rto_initial, rto_min, rto_max, max_backoff=max_backoff)
        self.stats = TransportStats()
        #: Congestion window (packets outstanding), kept across exchanges; fixed at S without control.
        self.congestion_control = congestion_control
        self.cwnd = CongestionWindow(self.slot_count, congestion_control)
        self.stats.smallest_window = self.cwnd.value
        #: One preallocated packet per slot (row s is slot ``slot_base + s``), the copies kept for recovery and the
        #: round state (slot_rows.py): what the exchanges fill, send and advance.
        self.rows = SlotRows(self.k, config.job_id, config.rank, self.slot_base, self.slot_count)
        #: Deadline rounds of a subset exchange (SubsetRound): (closed rounds accepted, close after, give up after).
        self._deadline: tuple[bool, float, float] = (False, math.inf, math.inf)
        #: Results of deadline rounds ahead of this worker, kept for the exchange that gets there
        #: (Exchange._stash_ahead): (used slot, the key its result echoes) -> (bytes, sender name, length).
        self.stash: dict[tuple[int, int], tuple[bytes, bytes, int]] = {}
        #: Per used slot, the furthest round a kept result showed, and whether it left this worker out of the round
        #: before it (Exchange._stash_ahead): what an expectation set later is checked against (_gone_by_kept).
        self.kept_ahead: dict[int, tuple[int, bool]] = {}
        #: The last exchange's ``members`` field per block (a round closed at a deadline: who is in its sum; see
        #: ``result_flags & wire.FLAG_CLOSE``), and how many close requests this worker sent in it.
        self.last_members = np.zeros(0, np.uint32)
        self.last_closes = 0
        self.encode = qz.factor_tables(config.total_workers)[:2]  # the whole job's (a tree: more than its leaf's)
        #: The socket and its batched I/O (transport_io.py), sending the rows above.
        self.io = SlotSocket(resolve(config.bind), self.rows.raw, self.rows.resend, self.slot_base, self.stats, sock,
                             connect)
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
                 tag: int = 0, deadline: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
        ``deadline`` (seconds; every rank gives the same): deadline rounds (docs/protocol.md, "Closing a round at a
        deadline"): this worker closes its rounds still open that long after it began; per block,
        ``result_flags & FLAG_CLOSE`` and :attr:`last_members` say who is in the sum (members 0: this worker
        could not learn the block's sum). It gives up ``deadline`` + 5 s after it began.
        """
        if self._subset_rounds:
            raise TransportError("this transport runs subset rounds: its round numbers no longer agree with the "
                                 "job's other workers for a whole-job exchange")
        if deadline is None:
            return self._exchange(blocks, exponents, flags, tag, None)
        if not deadline > 0:
            raise ValueError(f"deadline {deadline}: must be > 0 seconds")
        self._deadline = (True, deadline, deadline + DEADLINE_GIVE_UP)
        try:
            return self._exchange(blocks, exponents, flags, tag, None)
        finally:
            self._deadline = (False, math.inf, math.inf)

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
        # Round r in pool (r - 1) % 2 (SubsetRound). The members are written into each row as it is filled
        # (Exchange._launch), so that every row keeps the bytes it was sent with (a shadow copy must be the same).
        self.rows.start_subset(subset.round_base, members)
        self._deadline = (subset.partial or subset.close_after is not None,
                          math.inf if subset.close_after is None else subset.close_after,
                          math.inf if subset.give_up_after is None else subset.give_up_after)
        try:
            return self._exchange(blocks, exponents, flags, members, subset.round_base)
        finally:
            self.rows.members = 0
            self._deadline = (False, math.inf, math.inf)

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
        hdr["pool"], hdr["rank"], hdr["exponent"] = self.rows.next_pool[0], self.config.rank, qz.EXP_NONE
        hdr["round"] = (int(self.rows.rounds[0]) + 1) & 0xFFFF
        hdr["seq"] = PROBE_SEQ_BIT | self.rows.probe_seq
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
            mark = self.rows.mark()
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
            self._prev = (blocks, exponents, flags, ident, mark, self._deadline[0])
        return sums, global_exp, result_flags

    def _run(self, blocks: np.ndarray, exponents: np.ndarray, flags: np.ndarray | None, ident: int,
             mark: RoundMark) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Run one exchange; after a failover decision, again at the PS from where the decision says."""
        closable, close_after, give_up_after = self._deadline
        while True:
            began = time.monotonic()
            exchange = Exchange(self, blocks, exponents, flags, ident, closable=closable, close_at=began + close_after,
                                give_up_at=began + give_up_after)
            failover_from = self._run_exchange(exchange)
            if failover_from is None:
                self.last_members = exchange.result_members
                self.last_closes = exchange.closes_sent
                return exchange.sums, exchange.global_exp, exchange.result_flags
            # The job's workers decided to fail over: exchanges from ``failover_from`` on run at the PS.
            self._to_ps()
            if closable:
                # Some of this deadline exchange's rounds may have closed on the switch without a rank, and another
                # rank may have returned those sums: run again at the PS, the rounds would close anew, with other
                # members. No rank returns a sum of something else: the job fails, loudly, everywhere.
                reason = (f"job {self.config.job_id} rank {self.config.rank}: the switch went away during deadline "
                          f"exchange {self._index}; its rounds cannot be closed again alike at the PS: restart the "
                          "job (admitted at its PS, its deadline rounds close there)")
                self.abort(reason)
                raise TransportError(reason)
            if failover_from == self._index - 1 and self._prev is not None:
                # Another worker had not finished the previous exchange: send it again (same sums).
                prev_blocks, prev_exponents, prev_flags, prev_ident, prev_mark, prev_deadline = self._prev
                if prev_deadline:
                    # This worker returned the switch's sums of a deadline exchange, perhaps of rounds closed
                    # without a rank; sent again at the PS its values would make other sums for the rank that had
                    # not finished. No rank returns a sum of something else: the job fails, loudly, everywhere.
                    reason = (f"job {self.config.job_id} rank {self.config.rank}: the switch went away while another "
                              f"rank was still in deadline exchange {failover_from}, whose sums this worker took from "
                              "the switch (perhaps of rounds closed without a rank); the PS cannot sum them again "
                              "alike: restart the job")
                    self.abort(reason)
                    raise TransportError(reason)
                self.rows.restore(prev_mark)
                self._run_exchange(Exchange(self, prev_blocks, prev_exponents, prev_flags, prev_ident))
                self.stats.replayed_exchanges += 1
            elif failover_from != self._index:
                raise TransportError(f"failover decision starts at exchange {failover_from}; this worker is at "
                                     f"{self._index}: the job's workers do not run the same exchanges")
            self.rows.restore(mark)

    def _run_exchange(self, exchange: Exchange) -> int | None:
        """Run ``exchange``: None when it has every sum, else the exchange a failover decision starts from."""
        failover_from = exchange.run()
        if failover_from is None and self._on_ps:  # a slot's rounds per exchange: subset_round_uses, wherever run
            self._rounds_away += subset_round_uses(exchange.num_blocks, self.slot_count)
        return failover_from

    @property
    def exchange_index(self) -> int:
        """Whole-job exchanges so far: the next one's index (the same on every worker of the job)."""
        return self._index

    def resize(self, config: WorkerConfig) -> None:
        """Take the job's slots after a move (``config``: its new ``slot_count`` and ``generation``), between two
        exchanges at which every worker of the job switches (hoststack/moves.py). The switch holds the new range
        under a fresh generation, so every slot starts afresh there: so do the rows here."""
        if self._failed is not None:
            raise TransportError(f"transport unusable after an earlier failure: {self._failed}")
        if self.slot_base != 0 or self._subset_rounds or self._on_ps:
            raise TransportError("a move needs the job's whole slot range on the switch (not a thread's share, subset "
                                 "rounds or the PS)")
        if (config.job_id, config.rank, config.num_workers, config.width) != \
                (self.config.job_id, self.config.rank, self.num_workers, self.k):
            raise ValueError("a move changes the job's slots and generation only")
        seq, probe_seq = self.rows.seq, self.rows.probe_seq
        self.config = config
        self.slot_count = slot_count_of(config)
        self.rows = SlotRows(self.k, config.job_id, config.rank, 0, self.slot_count)
        self.rows.seq, self.rows.probe_seq = seq, probe_seq
        self.io.set_rows(self.rows.raw, self.rows.resend)
        self.cwnd.resize(self.slot_count)
        self.stash.clear()
        self.kept_ahead.clear()
        self._prev = None  # a failover never restarts an exchange from before a move (every worker finished it)
        self.stats.moves += 1
        log.info("job %d rank %d: from exchange %d on, %d slots (generation %d)", config.job_id, config.rank,
                 self._index, self.slot_count, config.generation)

    def failover_armed(self) -> bool:
        """Whether a stalled exchange votes for the PS (a whole-job exchange on the switch, with a PS)."""
        return self.failover is not None and not self._on_ps and not self._subset_rounds

    def vote(self) -> int | None:
        """A stalled exchange votes at the PS: the exchange the job's failover starts from once every worker voted
        (the stalled one or the one before it), or None (no decision: keep waiting for the switch)."""
        assert self.failover is not None
        return self.failover.vote(self._index, self.address)

    def _to_ps(self) -> None:
        assert self._ps_address is not None
        self._rounds_away = 0  # the switch saw (at most) every round sent so far
        self._on_ps = True
        self._set_destination(self._ps_address)
        self.rows.forget_shadows()  # no shadow resends of packets sent to the switch
        self.stats.failovers += 1
        log.warning("job %d rank %d: switch %s:%d away; exchanges from %d run at the PS %s:%d",
                    self.config.job_id, self.config.rank, *self._switch_address, self._index, *self._ps_address)

    def _back_to_switch(self) -> None:
        self._on_ps = False
        self._set_destination(self._switch_address)
        self.rows.forget_shadows()
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
        return self.rows.seq

    def close(self) -> None:
        self.io.close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- used by Exchange (one exchange's state and loop; it fills and sends ``rows`` through ``io``) --
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

    def on_marks(self, received: int, marked: int, now: float) -> None:
        """``marked`` of the ``received`` datagrams came ECN CE-marked: the window's DCTCP response."""
        self.stats.ecn_marked += marked
        if self.cwnd.on_marks(received, marked, now, self.rto.srtt if self.rto.srtt is not None else self.rto.rto):
            self.stats.ecn_cuts = self.cwnd.stats.ecn_cuts
            self.stats.smallest_window = self.cwnd.stats.smallest

    def on_timeout(self, now: float) -> None:
        """Multiplicative decrease, at most once per smoothed round trip (one loss event)."""
        if self.cwnd.on_timeout(now, self.rto.srtt if self.rto.srtt is not None else self.rto.rto):
            self.stats.window_decreases = self.cwnd.stats.decreases
            self.stats.smallest_window = self.cwnd.stats.smallest

    def on_resends_answered(self, spurious: int, peer: int, confirmed: int) -> None:
        """Results for resent packets: ``spurious`` answered their originals, ``peer`` were completed by another
        rank's contribution (the round waited for that rank, not for this worker's packet): both undo the cut their
        timeouts made, unless another was a loss; ``confirmed`` answered the resends (the cut stands)."""
        self.stats.spurious_timeouts += spurious
        self.stats.peer_timeouts += peer
        if confirmed:
            self.cwnd.on_loss_confirmed()
        elif (spurious or peer) and self.cwnd.on_spurious():
            self.stats.window_undos = self.cwnd.stats.undone
