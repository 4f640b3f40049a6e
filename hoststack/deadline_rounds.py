"""Deadline rounds in an exchange (docs/protocol.md, "Closing a round at a deadline"): closing the rounds still open
past the deadline, keeping the results of rounds ahead of this worker, listening to the slots a closed round left
this worker out of, and leaving a slot whose round is gone. A part of :class:`~netagg.hoststack.exchange.Exchange`
(its base class), on the exchange's per-slot state; the loop in ``exchange.py`` calls these only when the exchange
is ``closable``.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import numpy as np

from netagg import wire
from netagg.hoststack import quantization as qz
from netagg.hoststack.packets import PROBE_SEQ_BIT, SEQ_MASK, headers

if TYPE_CHECKING:
    from netagg.hoststack.slot_rows import SlotRows
    from netagg.hoststack.transport import Transport

#: Past a deadline (``close_at``), a packet is closed once it has been out this many of the path's shortest round
#: trips (at least CLOSE_GRACE_FLOOR seconds, at most the RTO): members that are there send each round within about
#: a round trip of each other; the RTO of a worker that waited for members (MLfabric's PS) is the members' lateness.
CLOSE_GRACE_RTTS = 3
CLOSE_GRACE_FLOOR = 0.005
#: A slot this worker listens to (DeadlineRounds._listen) whose next result has not come this many RTOs (at least
#: LISTEN_FLOOR seconds) after the previous one: its copy was lost (a non-member of the round cannot ask the switch
#: for it again), and the slot is left. The same bound ends a wait in a job that closes rounds and has gone silent
#: towards this worker (DeadlineRounds._silent_due).
LISTEN_RTOS = 8
LISTEN_FLOOR = 1.0
#: Results of rounds ahead of this worker kept for when it gets there (DeadlineRounds._stash_ahead).
STASH_ROWS = 8192


class DeadlineRounds:
    """The deadline-round steps of an exchange (see the module docstring). :class:`Exchange` holds the state named
    below and applies kept results through its ``_apply_batch``."""

    transport: Transport
    rows: SlotRows
    num_blocks: int
    window: int
    seq0: int
    ident: int
    expect: np.ndarray
    sent_at: np.ndarray
    in_flight: dict[int, int]
    changed: set[int]
    closed_key: np.ndarray
    slot_members: np.ndarray
    superseded: np.ndarray
    listening: np.ndarray
    result_flags: np.ndarray
    result_members: np.ndarray
    sums: np.ndarray
    sums_flat: np.ndarray
    global_exp: np.ndarray
    remaining: int
    close_at: float
    closes_sent: int
    closed_seen: bool
    _outputs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    _stash_buf: np.ndarray
    _stash_names: np.ndarray
    _stash_lengths: np.ndarray

    def _close_due(self, now: float) -> float:
        """Past ``close_at``: send a close request (the slot's packet again, ``FLAG_CLOSE`` set: the switch completes
        the round with the contributions it has) for each outstanding packet out for at least the grace
        (``CLOSE_GRACE_RTTS``), once per packet. Returns when the next one falls due."""
        t = self.transport
        grace = t.rto.rto
        if math.isfinite(t.rto.min_rtt):
            grace = min(grace, max(CLOSE_GRACE_FLOOR, CLOSE_GRACE_RTTS * t.rto.min_rtt))
        outstanding = (self.expect != -1) & ~self.listening
        pending = outstanding & (self.closed_key != self.expect)
        if not pending.any():
            return math.inf
        due_at = np.maximum(self.sent_at + grace, self.close_at)
        due = pending & (due_at <= now)
        if due.any():
            slots = np.flatnonzero(due).astype(np.int64)
            self.closed_key[slots] = self.expect[slots]
            self.rows.set_flags(slots, wire.FLAG_CLOSE)
            errors = t.io.transmit(slots)
            t.stats.packets_sent += slots.shape[0] - errors
            t.stats.socket_errors += errors
            self.closes_sent += slots.shape[0] - errors
            pending &= ~due
        return float(due_at[pending].min()) if pending.any() else math.inf

    def _stash_ahead(self, buf: np.ndarray, lengths: np.ndarray, names: np.ndarray, count: int) -> None:
        """Keep the results of this job's rounds ahead of this worker in their slots (a deadline closed them, and the
        others went on: they may be this exchange's later rounds or a later exchange's), for when it gets there
        (``_replay_stash``). At most ``STASH_ROWS``; the oldest go first."""
        t = self.transport
        payload = self.sums_flat.shape[1]
        hdr = headers(buf[:count])
        slot = hdr["slot"].astype(np.int64) - t.slot_base
        inside = (slot >= 0) & (slot < t.slot_count)
        ahead = np.zeros(count, np.int64)
        ahead[inside] = (hdr["round"][inside].astype(np.int64) - self.rows.rounds[slot[inside]].astype(np.int64)) \
            & 0xFFFF
        keep = np.flatnonzero(inside & (ahead >= 1) & (ahead < 0x8000)
                              & (lengths[:count] == wire.HEADER_BYTES + payload) & (hdr["version"] == wire.VERSION)
                              & ((hdr["flags"] & wire.FLAG_RESULT) != 0) & (hdr["job_id"] == t.config.job_id))
        if not keep.shape[0]:
            return
        # A result that leaves this worker out — closed without it, or a subset round of this exchange that does not
        # name it — says the others went on without it from the round before (see _gone_by_kept).
        members = hdr["members"][keep].astype(np.int64)
        without = ((members >> t.config.rank) & 1) == 0
        left_out = without & (((hdr["flags"][keep] & wire.FLAG_CLOSE) != 0)
                              | ((members != 0) & (hdr["exchange"][keep].astype(np.int64) == self.ident)))
        kept = t.kept_ahead
        for used_slot, rnd, out in zip(slot[keep].tolist(), hdr["round"][keep].tolist(), left_out.tolist(),
                                       strict=True):
            known = kept.get(used_slot)
            step = (rnd - known[0]) & 0xFFFF if known is not None else 1
            if step == 0:
                kept[used_slot] = (rnd, known[1] or out)
            elif step < 0x8000:
                kept[used_slot] = (rnd, out)
        waiting = np.unique(slot[keep])
        waiting = waiting[self.expect[waiting] != -1]
        self.superseded[waiting[self._gone_by_kept(waiting)]] = 1
        keys = (hdr["round"][keep].astype(np.int64) << 33) | (hdr["pool"][keep].astype(np.int64) << 32) \
            | hdr["seq"][keep].astype(np.int64)
        for row, used_slot, key in zip(keep.tolist(), slot[keep].tolist(), keys.tolist(), strict=True):
            t.stash[(used_slot, key)] = (buf[row, :lengths[row]].tobytes(), names[row].tobytes(), int(lengths[row]))
        while len(t.stash) > STASH_ROWS:
            del t.stash[next(iter(t.stash))]

    def _gone_by_kept(self, slots: np.ndarray) -> np.ndarray:
        """Per slot of ``slots`` (each expecting a result): whether a result kept for it (``kept_ahead``) shows its
        expected round gone. A result two or more rounds ahead took that round's pool (the switch holds it no more:
        resends would find nothing). One the very next round, closed without this worker or a subset round of this
        exchange without it, means the others went on without it: its round was closed without it too, and the
        group's copy was lost; a slot it only listens to expects such results, so this one rule does not apply there.
        An expectation whose round got there (or past) forgets what was kept for its slot."""
        kept = self.transport.kept_ahead
        out = np.zeros(slots.shape[0], bool)
        for i, slot in enumerate(slots.tolist()):
            known = kept.get(slot)
            if known is None:
                continue
            step = (known[0] - (int(self.expect[slot]) >> 33)) & 0xFFFF
            if step == 0 or step >= 0x8000:
                del kept[slot]
            else:
                out[i] = step >= 2 or (known[1] and not self.listening[slot])
        return out

    def _replay_stash(self) -> tuple[int, list[int], list[int]]:
        """Apply the kept results (``_stash_ahead``) that the slots whose expectation changed now expect; leave those
        whose expected round the kept results show gone (``_gone_by_kept``)."""
        t = self.transport
        capacity = self._outputs[0].shape[0]
        rows = []
        missed = []
        for slot in list(self.changed):
            self.changed.discard(slot)
            if self.expect[slot] == -1:
                continue
            if (found := t.stash.pop((slot, int(self.expect[slot])), None)) is not None:
                rows.append(found)
                if len(rows) == capacity:
                    break
            else:
                missed.append(slot)
        if missed and t.kept_ahead:
            slots = np.array(missed, np.int64)
            gone = slots[self._gone_by_kept(slots)]
            if gone.shape[0]:
                self.superseded[gone] = 1
                self._give_up_superseded()
        if not rows:
            return 0, [], []
        buf, names, lengths = self._stash_buf, self._stash_names, self._stash_lengths
        for i, (data, name, length) in enumerate(rows):
            buf[i, :length] = np.frombuffer(data, np.uint8)
            names[i, :len(name)] = np.frombuffer(name, np.uint8)
            lengths[i] = length
        return self._apply_batch(buf, lengths, names, len(rows))

    def _after_closed(self, slots: np.ndarray, closed: np.ndarray, my_mask: int) -> None:
        """Accepted results of rounds closed at a deadline (``closed``: their members, -1: not closed). A slot whose
        round closed with this worker in it goes on as a subset round of those members: the ones that were not there
        have left the slot (below), so its next rounds complete without them and without another close. A slot whose
        round closed without this worker: its exponent for the slot's next block was not in the round's maximum, so
        it cannot quantize that block for the round; it sends nothing more in the slot and listens to its results
        (:meth:`_listen`)."""
        was_closed = closed >= 0
        self.closed_seen = self.closed_seen or bool(was_closed.any())
        missed = was_closed & ((closed & my_mask) == 0)
        stay = was_closed & ~missed
        self.slot_members[slots[stay]] = closed[stay]
        if missed.any():
            self.listening[slots[missed]] = True

    def _listen(self, slots: np.ndarray, blocks: np.ndarray) -> None:
        """Slots this worker left (``_after_closed``) still get their rounds' results: every member of the job is in
        its multicast group. Expect the result of each slot's next round (block ``blocks``) without sending:
        the others' sum, which holds nothing of this worker's (its members say so). Retries 1: no round-trip
        sample. A lost copy is noticed when a later round's result arrives (``_give_up_superseded``)."""
        keep = blocks < self.num_blocks
        slots, blocks = slots[keep], blocks[keep]
        if not slots.shape[0]:
            return
        rows = self.rows
        rounds = (rows.rounds[slots].astype(np.int64) + 1) & 0xFFFF
        rows.rounds[slots] = rounds
        seqs = (blocks + self.seq0) & SEQ_MASK
        self.expect[slots] = (rounds << 33) | (rows.next_pool[slots].astype(np.int64) << 32) | seqs
        self.sent_at[slots] = time.monotonic()
        self.retries[slots] = 1
        self.changed.update(slots.tolist())

    def _listen_due(self, now: float) -> float:
        """Leave the listened slots whose next result is overdue (``LISTEN_RTOS``); returns when the next one is."""
        waiting = self.listening & (self.expect != -1)
        if not waiting.any():
            return math.inf
        due_at = self.sent_at + self._overdue_after()
        overdue = waiting & (due_at <= now)
        if overdue.any():
            self.superseded[overdue] = 1
            self._give_up_superseded()
            waiting &= ~overdue
        return float(due_at[waiting].min()) if waiting.any() else math.inf

    def _overdue_after(self) -> float:
        """How long a result may be late before it counts as lost for good: a listened slot's next one
        (``_listen_due``), or any one while a job that closes rounds is silent towards this worker (``_silent_due``)."""
        return max(LISTEN_FLOOR, LISTEN_RTOS * self.transport.rto.rto)

    def _silent_due(self, now: float, last_progress: float) -> None:
        """Leave the slots still waiting once no result has come for ``_overdue_after`` while a member closes this
        exchange's rounds (``closed_seen``): a closer ends every open round within a round trip or two of its
        deadline, so a round still open to this worker that long is one the others finished, and the one after it,
        while every copy of their results to it was lost (the switch drops a packet of a round it no longer holds,
        unanswered). Such a slot's blocks have no sum here (members 0), as when a later round's result shows the round
        gone (``_give_up_superseded``); the caller learns it from ``members`` (a deadline allreduce fails loudly,
        MLfabric's PS, whose results name every part, asks the member to push). Not with the switch failover armed:
        a silent switch is its case."""
        if now - last_progress < self._overdue_after():
            return
        waiting = self.expect != -1
        if waiting.any():
            self.superseded[waiting] = 1
            self._give_up_superseded()

    def _leave(self, first_blocks: np.ndarray) -> None:
        """No sum here for each slot's blocks from ``first_blocks`` on (a window apart): flags ``FLAG_CLOSE``,
        members 0, sums 0."""
        nb, window = self.num_blocks, self.window
        for first in first_blocks.tolist():
            if first < nb:
                skipped = np.arange(first, nb, window)
                self.result_flags[skipped] = wire.FLAG_CLOSE
                self.result_members[skipped] = 0
                self.sums[skipped] = 0
                self.global_exp[skipped] = qz.EXP_NONE
                self.remaining -= skipped.shape[0]

    def _give_up_superseded(self) -> None:
        """Slots whose outstanding round the others finished, and the one after it, without this worker's result
        reaching it (a deadline closed the rounds; the group's copy was lost and the switch holds the slot's later
        rounds now): whether this worker is in that round's sum cannot be known here. The slot is left: its blocks
        from the outstanding one on have no sum here (flags ``FLAG_CLOSE``, members 0; see _after_closed)."""
        slots = np.flatnonzero(self.superseded).astype(np.int64)
        self.superseded[slots] = 0
        slots = slots[self.expect[slots] != -1]
        if slots.shape[0] and self.transport.stash:  # the expected result may be among the kept ones: not gone
            kept = self.transport.stash
            found = np.array([(s, int(self.expect[s])) in kept for s in slots.tolist()], bool)
            if found.any():
                self.changed.update(slots[found].tolist())
                slots = slots[~found]
        if not slots.shape[0]:
            return
        seqs = self.expect[slots] & 0xFFFFFFFF
        probe = (seqs & PROBE_SEQ_BIT) != 0
        first = np.where(probe, slots, (seqs - self.seq0) & SEQ_MASK)
        self.expect[slots] = -1
        self.listening[slots] = False
        for slot in slots.tolist():
            self.in_flight.pop(slot, None)
        self._leave(first)
        self.transport.stats.superseded_slots += slots.shape[0]
