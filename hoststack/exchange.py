"""One exchange of a transport: its state and its loop (release packets into the window, read and apply results,
resend on timeouts), over the transport's slot rows, socket and window (``transport.py``'s module docstring
describes the protocol). Also the transport's errors and counters."""

from __future__ import annotations

import heapq
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from netagg import wire
from netagg.hoststack import quantization as qz
from netagg.hoststack import transport_reference as reference
from netagg.hoststack.congestion import RtoEstimator
from netagg.hoststack.deadline_rounds import DeadlineRounds
from netagg.hoststack.packets import headers

if TYPE_CHECKING:
    from netagg.hoststack.transport import Transport

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


class ClosedEarly(OutOfStep):
    """A round of a collective that takes every rank's contribution was closed at a deadline by another rank
    (docs/protocol.md, "Closing a round at a deadline"): the partial sum is never returned; the transport fails."""


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
    #: Results of resent packets that another rank's contribution completed: the round waited for that rank (its
    #: packet late or lost), so the timeout said nothing of this worker's path (the window cut is undone) ...
    peer_timeouts: int = 0
    #: ... and the window cuts such results (and spurious ones) undid.
    window_undos: int = 0
    #: Deadline rounds: slots left because the others finished this worker's outstanding round and the next one
    #: without its result reaching it (the group's copy lost; see Exchange._give_up_superseded).
    superseded_slots: int = 0
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
    #: Moves (hoststack/moves.py): times the job's slots changed under this transport at an exchange boundary.
    moves: int = 0
    #: Congestion marks (docs/protocol.md, "Congestion marks"): datagrams received ECN CE-marked, and the window
    #: cuts they made (at most one per round trip).
    ecn_marked: int = 0
    ecn_cuts: int = 0


class Exchange(DeadlineRounds):
    """One exchange (one :meth:`Transport.exchange` call): per-slot outstanding packet, timers, received sums. The
    deadline rounds' steps (closing, keeping results ahead, listening, leaving a slot) are in ``deadline_rounds.py``."""

    def __init__(self, transport: Transport, blocks: np.ndarray, exponents: np.ndarray,
                 flags: np.ndarray | None = None, ident: int = 0, *, closable: bool = False,
                 close_at: float = math.inf, give_up_at: float = math.inf) -> None:
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
        #: Deadline rounds (docs/protocol.md, "Closing a round at a deadline"). ``closable``: results of rounds closed
        #: early are accepted (else they fail the exchange: no rank uses a partial sum it did not ask for); per block,
        #: the result's ``members`` (for a closed one: who is in its sum). ``close_at``: from then on (monotonic),
        #: this worker closes its outstanding rounds, each once it has been out its grace (``_close_due``).
        self.closable = closable or close_at < math.inf
        self.result_members = np.zeros(nb, np.uint32)
        self.close_at = close_at
        #: A member that cannot finish by then stops (``TransportTimeout``): its rounds were closed without it.
        self.give_up_at = give_up_at
        self.closes_sent = 0
        #: A result of a closed round arrived: some member closes this exchange's rounds (see _silent_due).
        self.closed_seen = False
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
        self.rows = rows = transport.rows
        self.seq0 = rows.seq
        self.probe0 = rows.probe_seq
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
        #: Per used slot: the expected key its close request was sent for (-1: none).
        self.closed_key = np.full(used, -1, np.int64)
        #: Per used slot: the ``members`` its packets carry (the exchange's; after a round closed at a deadline,
        #: that round's: see _after_closed).
        self.slot_members = np.full(used, rows.members, np.int64)
        #: Per used slot: a result two or more rounds past its outstanding packet arrived (``accept_results``).
        self.superseded = np.zeros(used, np.uint8)
        #: Per used slot: this worker left it (a round closed without it) and only receives its results (_listen).
        self.listening = np.zeros(used, bool)
        #: Slots that expect a new result since the kept ones were last looked up (_replay_stash).
        self.changed: set[int] = set()
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
        slot_rows = r.rows
        r.fill(none, none, r.blocks, r.local_exp, r.global_exp, r.ahead, 0, 0, r.window, *t.encode, slot_rows.raw,
               slot_rows.words, slot_rows.next_pool, slot_rows.rounds, r.expect, r.sent_at, 0.0, none.copy())
        rows = t.io.rx_capacity
        none_rows = np.zeros(rows, np.int64)
        io = t.io
        r.accept(io.rx_buf, io.rx_lengths, io.rx_names, 0, io.allowed, t.config.job_id, t.slot_base, 0, r.window, 0,
                 r.expect, r.retries, r.sent_at, slot_rows.next_pool, 0.0, r.sums_flat, r.global_exp, 0, 0,
                 r.result_flags, r.result_members, r.alarm, none_rows, none_rows.copy(), none_rows.copy(), r.superseded,
                 np.zeros(rows))
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
        rows = self.rows
        # Each row still holds the slot's latest packet, as it was sent (FLAG_RETRANSMIT aside): it becomes
        # the slot's shadow (the same for both fill implementations: the copy is made here, before either).
        rows.prepare(slots, self.slot_members[slots], self.ident)
        if self.fill(slots, block_ids, self.blocks, self.local_exp, self.global_exp, self.ahead, self.seq0,
                      self.probe0, self.window, enc_a, enc_b, rows.raw, rows.words, rows.next_pool, rows.rounds,
                      self.expect, self.sent_at, now, keys) < 0:
            raise TransportError("aggregator returned an exponent below this worker's: protocol violation")
        if self.block_flags is not None:  # fill wrote flags 0: a block's non-finite flags go with it
            rows.set_block_flags(slots, np.where(block_ids >= 0, self.block_flags[np.maximum(block_ids, 0)], 0))
        errors = t.io.transmit(slots)
        t.stats.packets_sent += slots.shape[0] - errors
        t.stats.socket_errors += errors
        self._arm(now + t.rto.rto + self._drain_time(slots.shape[0]), slots, keys)
        if self.closable:
            self.changed.update(slots.tolist())

    def _drain_time(self, count: int) -> float:
        """How long a burst of ``count`` packets takes to leave the path's bottleneck at the rate the window holds
        (``count x srtt / window``): its last packet's round trip is that much longer than the estimate's, so its
        timer waits that much more (a window refilled at once, such as an exchange's first, times out spuriously
        otherwise)."""
        t = self.transport
        if t.rto.srtt is None or count <= 1:
            return 0.0
        return count * t.rto.srtt / max(1.0, t.window)

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
        self.rows.set_flags(slots, wire.FLAG_RETRANSMIT)
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
        outstanding = np.zeros(slots.shape[0], bool)
        inside = slots < self.used_slots
        outstanding[inside] = self.expect[slots[inside]] != -1
        slots = self.rows.answered_copies(slots, outstanding)
        n = slots.shape[0]
        if not n:
            return
        errors = t.io.transmit(np.arange(n, dtype=np.int64), resend_buffer=True, blocks=t.io.blocks_of(slots))
        t.stats.packets_sent += n - errors
        t.stats.socket_errors += errors
        t.stats.shadow_resends += n - errors

    # -- receiving -----------------------------------------------------------
    def run(self) -> int | None:
        """Send the blocks and gather their sums: None once every block has its sum (in ``sums``, ``global_exp``,
        ``result_flags``). A failover decision ends it early (a stalled exchange votes for the PS: ``transport.py``'s
        ``_run``): returns the exchange the job's failover starts from, and this exchange is abandoned."""
        t = self.transport
        nb = self.num_blocks
        if nb == 0:
            return None
        self.release(list(range(self.used_slots)), [-1] * self.used_slots)
        last_progress = time.monotonic()
        stats = t.stats
        io = t.io
        buf, names, lengths = io.rx_buf, io.rx_names, io.rx_lengths
        closable = self.closable
        close_next = self.close_at
        rows = io.rx_capacity
        self._outputs = (np.empty(rows, np.int64), np.empty(rows, np.int64), np.zeros(rows, np.int64),
                         np.empty(rows))
        if closable:  # where kept results are applied from (_replay_stash)
            self._stash_buf = np.zeros((rows, buf.shape[1]), np.uint8)
            self._stash_names, self._stash_lengths = np.zeros_like(names[:rows]), np.zeros(rows, lengths.dtype)
        failover = t.failover if t.failover_armed() else None
        vote_at = last_progress + failover.after if failover is not None else math.inf
        while self.remaining:
            now = time.monotonic()
            wake = min(last_progress + t.progress_timeout, vote_at, self.give_up_at)
            if self.timers:
                wake = min(wake, self.timers[0][0])
            wake = min(wake, close_next)
            if self.closed_seen and failover is None:
                wake = min(wake, last_progress + self._overdue_after())
            if closable and self.changed and (t.stash or t.kept_ahead):  # kept results to look up: do not sleep
                wake = now
            if wake > now and not io.rx_pending():
                io.poller.poll(math.ceil((wake - now) * 1000))
            ready_slots: list[int] = []
            ready_blocks: list[int] = []
            accepted = 0
            calls = 0
            received, marked = io.datagrams_received, io.ce_received
            if closable and self.changed and (t.stash or t.kept_ahead):  # results it now expects may be kept
                n_acc_total, got_slots, got_blocks = self._replay_stash()
                accepted += n_acc_total
                ready_slots += got_slots
                ready_blocks += got_blocks
            while calls < _RECV_CALLS_MAX:
                calls += 1
                count = io.receive()
                if count <= 0:
                    if count < 0:
                        continue  # a socket error (counted): read on
                    break
                n_acc_total, got_slots, got_blocks = self._apply_batch(buf, lengths, names, count)
                accepted += n_acc_total
                ready_slots += got_slots
                ready_blocks += got_blocks
                if calls >= _RECV_CALLS and not (self.timers and self.timers[0][0] <= time.monotonic()):
                    break  # refill the ready slots first; the rest is read on the next turn
            now = time.monotonic()
            if io.ce_received != marked:
                t.on_marks(io.datagrams_received - received, io.ce_received - marked, now)
            if accepted:
                stats.results_accepted += accepted
                last_progress = now
                if self.stall_open:
                    self._restart_timers(now)
                t.on_results(accepted)
                if failover is not None:
                    vote_at = now + failover.after
            elif now >= vote_at:
                failover_from = t.vote()  # the switch may be away: a decision once every worker voted for the PS
                if failover_from is not None:
                    return failover_from  # this exchange is abandoned here: the transport runs it at the PS
                vote_at = time.monotonic() + failover.after  # no decision: ride on, vote again later
                if time.monotonic() - last_progress >= t.progress_timeout:
                    self._timeout(time.monotonic() - last_progress)
            elif now - last_progress >= t.progress_timeout:
                self._timeout(now - last_progress)
            if now >= self.give_up_at and self.remaining:
                self._timeout(now - last_progress, deadline=True)
            if ready_slots or self.waiting:
                self.release(ready_slots, ready_blocks)
            if now >= self.close_at:
                close_next = self._close_due(time.monotonic())
            if self.listening.any():
                close_next = min(close_next, self._listen_due(time.monotonic()))
            if self.closed_seen and failover is None and self.remaining:
                self._silent_due(time.monotonic(), last_progress)
            self._retransmit_due(now)
        self.rows.advance(nb, self.used_slots)
        stats.blocks += nb
        return None

    def _apply_batch(self, buf: np.ndarray, lengths: np.ndarray, names: np.ndarray, count: int
                     ) -> tuple[int, list[int], list[int]]:
        """Apply ``count`` received datagrams (``accept_results`` and what follows from each accepted result);
        returns (results accepted, slots ready to send, their blocks). With ``closable``, results of rounds ahead
        of this worker are kept (``_stash_ahead``) and a slot whose round is gone is left (``_give_up_superseded``)."""
        t = self.transport
        stats, nb = t.stats, self.num_blocks
        expect, retries, sent_at, next_pool = self.expect, self.retries, self.sent_at, self.rows.next_pool
        sums, global_exp, result_flags, result_members = self.sums_flat, self.global_exp, self.result_flags, \
            self.result_members
        closable, superseded, alarm = int(self.closable), self.superseded, self.alarm
        acc_slots, following, acc_closed, rtts = self._outputs
        accepted = 0
        ready_slots: list[int] = []
        ready_blocks: list[int] = []
        # A slot this worker listens to may find its next results further on in the same batch: the batch
        # is applied again while listening slots learn what to expect next (the rows taken before are stale
        # then, and counted once).
        first_pass, again = True, True
        while again:
            again = False
            if closable:
                superseded[:] = 0  # judged against the keys of the last pass only (see below)
            now = time.monotonic()
            n_acc, n_rtt, foreign, malformed, stale, done = self.accept(
                buf, lengths, names, count, t.io.allowed, t.config.job_id, t.slot_base, self.seq0, self.window, nb,
                expect, retries, sent_at, next_pool, now, sums, global_exp, self.ident, closable,
                result_flags, result_members, alarm, acc_slots, following, acc_closed, superseded, rtts)
            if not first_pass:
                stats.stale_results -= n_acc
            elif foreign or malformed or stale:
                stats.foreign += foreign
                stats.malformed += malformed
                stats.stale_results += stale
                if alarm[0]:
                    self._out_of_step()
            first_pass = False
            if not n_acc:
                break
            accepted += n_acc
            self.remaining -= done
            resent = self.resent_at[acc_slots[:n_acc]]
            if resent.any():
                self._judge_resends(acc_slots[:n_acc], resent, buf, count)
            in_flight = self.in_flight
            for slot in acc_slots[:n_acc].tolist():
                in_flight.pop(slot, None)  # (a slot this worker listens to has nothing in flight)
            if n_rtt:
                t.rto.sample_all(rtts[:n_rtt])
            nxt = following[:n_acc]
            ready = nxt < nb
            if closable and (acc_closed[:n_acc] >= 0).any():
                self._after_closed(acc_slots[:n_acc], acc_closed[:n_acc], 1 << t.config.rank)
            if closable and self.listening.any():
                heard = self.listening[acc_slots[:n_acc]]
                if heard.any():
                    self._listen(acc_slots[:n_acc][heard], nxt[heard])
                    ready &= ~heard
                    again = True
            ready_slots += acc_slots[:n_acc][ready].tolist()
            ready_blocks += nxt[ready].tolist()
        if closable:
            self._stash_ahead(buf, lengths, names, count)
        if closable and superseded.any():  # a later round's result, and none left for the expected one
            self._give_up_superseded()
        return accepted, ready_slots, ready_blocks

    def _judge_resends(self, slots: np.ndarray, resent: np.ndarray, buf: np.ndarray, count: int) -> None:
        """Accepted results (in ``buf[:count]``) of ``slots`` whose packets were resent at ``resent`` (0: not resent):
        those back sooner than the path's shortest round trip answer the originals (the timeout was spurious: the
        originals' round trips are samples); of the others, those another rank's contribution completed were
        waiting for that rank (its packet was late or lost, not this worker's: ``_completed_by``); the rest answer
        this worker's resends, so its packet or result was lost (hoststack/congestion.py)."""
        t = self.transport
        now = time.monotonic()
        was = resent > 0
        slots = slots[was]
        self.resent_at[slots] = 0.0
        spurious = t.rto.spurious(now - resent[was])
        n = int(spurious.sum())
        if n:
            t.rto.sample_all(now - self.sent_at[slots[spurious]])
        completer = self._completed_by(slots[~spurious], buf, count)
        peer = int(((completer >= 0) & (completer != t.config.rank)).sum())
        t.on_resends_answered(n, peer, slots.shape[0] - n - peer)

    def _completed_by(self, slots: np.ndarray, buf: np.ndarray, count: int) -> np.ndarray:
        """Per slot of ``slots``: the rank whose contribution completed the round of its result in ``buf[:count]``
        (a result carries the completing packet's rank: docs/protocol.md, step 4), or -1 where that cannot be told:
        no such result in the batch, or a tree (a parent's result carries a switch's rank at the parent)."""
        out = np.full(slots.shape[0], -1, np.int64)
        t = self.transport
        if not slots.shape[0] or t.config.total_workers != t.config.num_workers:
            return out
        hdr = headers(buf[:count])
        result = (hdr["flags"] & wire.FLAG_RESULT) != 0
        row_slot = hdr["slot"].astype(np.int64) - t.slot_base
        for i, slot in enumerate(slots.tolist()):
            rows = np.flatnonzero(result & (row_slot == slot) & (hdr["round"] == self.rows.rounds[slot]))
            if rows.shape[0]:
                out[i] = int(hdr["rank"][rows[0]])
        return out

    def _out_of_step(self) -> None:
        t = self.transport
        if self.alarm[0] == 2:
            raise ClosedEarly(
                f"job {t.config.job_id} rank {t.config.rank}: collective #{t._index} ({self.num_blocks} blocks, id "
                f"{self.ident:#010x}): slot {int(self.alarm[2]) + t.slot_base}'s round was closed at a deadline by "
                "another rank, but this collective sums every rank's contribution; no partial sum is returned, and "
                "this worker is unusable: restart the job's workers (and give every rank the same deadline setting)")
        met = int(self.alarm[1])
        other = "another rank's abort, or a contribution of another collective" if met == self.ident \
            else f"collective id {met:#010x}"
        raise OutOfStep(
            f"job {t.config.job_id} rank {t.config.rank}: the job's ranks are out of step in collective "
            f"#{t._index} ({self.num_blocks} blocks, id {self.ident:#010x}): slot {int(self.alarm[2]) + t.slot_base}'s "
            f"round met {other} (a rank skipped or failed a call, or called with another size); no sum is "
            "returned, and this worker is unusable: restart the job's workers")

    def _timeout(self, waited: float, deadline: bool = False) -> None:
        waiting = int((self.expect != -1).sum())
        if deadline:
            raise TransportTimeout(
                f"job {self.transport.config.job_id} rank {self.transport.config.rank}: the exchange's deadline "
                f"passed with {self.remaining} of {self.num_blocks} blocks outstanding: its rounds were closed "
                "without this worker (it sends its update another way)")
        raise TransportTimeout(
            f"job {self.transport.config.job_id} rank {self.transport.config.rank}: no result for {waited:.1f} s "
            f"({self.remaining} of {self.num_blocks} blocks outstanding in {waiting} slot(s), "
            f"{self.transport.stats.retransmissions} retransmissions so far); is every worker of the job "
            f"running and is {self.transport.destination[0]}:{self.transport.destination[1]} reachable?"
        )
