"""The aggregation rules of ``netagg.p4``'s slot registers, in Python — shared by the software
target's pipeline model and the parameter server's fallback aggregator, so both follow the
switch exactly (the P4 program stays the reference; the PTF suite checks the model).

Per slot: an owner tag (``SlotOwner``) and the current round of each pool
(``RoundCheck``); per (slot, pool): the round's expected members (``MemberCheck``), the
bitmap of contributors (``BitmapCheck``), the missing-contribution count (``WorkerCount``),
the round's collective (``ExchangeCheck``) and flags (``RoundFlags``; they also say whether the round was
closed at a deadline, ``CloseCheck``), the exponent maximum
(``ExponentMax``) and the int32 sums (``ValueSum``): a slot here is a *cell* of ``wire.K`` values, and a
wide packet's slot is its first cell, its value chunk c summed in cell ``slot + c``. See
docs/protocol.md. ``SlotRegisters.aggregate`` is what ``NetaggIngress.apply`` does with a
packet from ``SlotOwner`` on: the registers' decision, the job counters to bump, the values
and exponent the packet leaves with, and where it goes (``Verdict``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from netagg import wire
from netagg.dataplane import DropReason, Level, ValueOp


class RoundState(IntEnum):
    """How a packet's round number compares with its (slot, pool)'s current round (ROUND_* in defines.p4)."""

    SAME = 0
    NEW = 1
    OLD = 2


@dataclass(slots=True)
class SlotDecision:
    """What the registers decided about one packet."""

    op: ValueOp  #: what ValueSum/ExponentMax do (NONE: nothing)
    round_state: RoundState  #: the packet's round vs the pool's current round
    first: bool  #: the round's first contribution
    fresh: bool  #: the sender's first packet of this round (else a retransmission)
    complete: bool  #: the round is complete (now, or already)
    late: bool  #: a new contribution to a round that had already completed
    members_mismatch: bool = False  #: the packet's members differ from the round's (dropped, nothing changed)
    #: A new contribution naming another collective than the round's (not added; the round goes OUT_OF_STEP).
    exchange_mismatch: bool = False
    #: The round had been closed at a deadline (``CloseCheck``): no register changed; the packet is answered from
    #: storage (``late``: its sender is not in the sum).
    closed: bool = False
    #: This packet's close request closed the round (it was incomplete): its result goes to the group.
    closes: bool = False

    @property
    def delivers(self) -> bool:
        """A result leaves: to the group (completing contribution) or to the sender (resend)."""
        return self.complete and not self.late


_OLD = SlotDecision(ValueOp.NONE, RoundState.OLD, False, False, False, False)
_MISMATCH = SlotDecision(ValueOp.NONE, RoundState.SAME, False, False, False, False, members_mismatch=True)


class Delivery(IntEnum):
    """Where a packet goes once the registers have seen it (``ResultDelivery``, or ``mark_to_drop``)."""

    NONE = 0  #: absorbed into the slot, a duplicate or refused: nothing leaves
    GROUP = 1  #: the round's completing contribution: the result to the job's multicast group
    SENDER = 2  #: a retransmission after completion: the stored result, back to its sender only
    UP = 3  #: a tree: the completed partial (or its resend) to the parent switch (``UpDelivery``)


@dataclass(slots=True)
class Verdict:
    """What ``NetaggIngress.apply`` does with a packet that reached the slot registers."""

    drop: DropReason  #: NONE, or why the packet is refused (counted as a drop and a job reject)
    counts: tuple[str, ...]  #: the per-job counters to bump, by ``dataplane.JOB_COUNTERS``' short names
    delivery: Delivery
    exponent: int  #: the exponent the packet leaves with
    values: np.ndarray  #: the values the packet leaves with (the stored sums, or its own if untouched)
    resend: bool = False  #: a retransmission's answer (an UP packet then carries FLAG_RETRANSMIT)
    #: The round's register bits: its ``wire.STORED_FLAGS`` the packet leaves with in place of its own, and
    #: ``wire.ROUND_CE`` (some contribution arrived CE-marked: the packet leaves with ECN CE).
    round_flags: int = 0
    #: A new contribution of another collective: counted as an EXCHANGE_MISMATCH drop and a job reject (not a
    #: contribution), though it counts towards completion and may leave as the (OUT_OF_STEP) result.
    exchange_mismatch: bool = False
    #: The ``members`` field the packet leaves with: None keeps its own; a closed round's result carries the
    #: bitmap of the contributions in its sum.
    members: int | None = None
    #: A new contribution to a round closed without it: not added, answered from storage; counted as a
    #: LATE_FOR_CLOSED_ROUND drop (not a job reject).
    late_for_close: bool = False


_CONTRIBUTION = ("contributions",)
_COMPLETION = ("contributions", "results")
_RETRANSMIT_RESULT = ("retransmit_results",)
_DUPLICATE = ("duplicates",)
_RESULT = ("results",)


class SlotRegisters:
    """Registers of ``num_slots`` cells, each with ``wire.NUM_POOLS`` pools (a wide slot takes several)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.owner = [0] * num_slots
        self.rounds = [[0] * num_slots for _ in range(wire.NUM_POOLS)]
        self.members = [0] * (num_slots * wire.NUM_POOLS)
        #: ``ExchangeCheck`` and ``RoundFlags``: each round's collective and its flags (docs/protocol.md).
        self.exchanges = [0] * (num_slots * wire.NUM_POOLS)
        self.flags = [0] * (num_slots * wire.NUM_POOLS)
        self.bitmaps = [0] * (num_slots * wire.NUM_POOLS)
        self.counts = [0] * (num_slots * wire.NUM_POOLS)
        self.exponents = [0] * (num_slots * wire.NUM_POOLS)
        #: ``LevelState``: where each (slot, pool)'s round stands in a tree of switches (``dataplane.Level``).
        self.levels = [0] * (num_slots * wire.NUM_POOLS)
        self.values = np.zeros((num_slots * wire.NUM_POOLS, wire.K), np.int32)

    def reset(self) -> None:
        """Power-on state."""
        self.__init__(self.num_slots)

    def snapshot(self) -> dict[str, np.ndarray]:
        """Every register as an array (for comparing engines; see softswitch.fastpath.FastRegisters)."""
        return {"owner": np.array(self.owner, np.int64), "rounds": np.array(self.rounds, np.int64),
                "members": np.array(self.members, np.int64),
                "exchanges": np.array(self.exchanges, np.int64), "flags": np.array(self.flags, np.int64),
                "bitmaps": np.array(self.bitmaps, np.int64), "counts": np.array(self.counts, np.int64),
                "exponents": np.array(self.exponents, np.int64), "levels": np.array(self.levels, np.int64),
                "values": self.values.copy()}

    @staticmethod
    def pool_index(slot: int, pool: int) -> int:
        return slot * wire.NUM_POOLS + pool

    def round_check(self, slot: int, pool: int, round_: int, stale: bool) -> RoundState:
        """RoundCheck: SAME, NEW (ahead, serial arithmetic mod 2**16) or OLD.

        A slot taken over (``stale``: another job's, or a restarted switch's zeroed owner tag)
        starts a NEW round in this pool and marks the other pool *two* rounds behind the packet:
        the round just before this one (``round_ - 1``, the other pool's) is then still ahead of
        it and starts afresh — a worker that lost that round's result can finish it with the
        others' copies of it — and no packet a host sends carries ``round_ - 2`` in the other
        pool (whole-job rounds alternate pools with the round number), so none can be SAME with
        what the other pool's registers hold from before (docs/protocol.md).
        """
        if stale:
            self.rounds[pool][slot] = round_
            self.rounds[1 - pool][slot] = (round_ - 2) & 0xFFFF
            return RoundState.NEW
        ahead = (round_ - self.rounds[pool][slot]) & 0xFFFF
        if ahead == 0:
            return RoundState.SAME
        if ahead < 0x8000:
            self.rounds[pool][slot] = round_
            return RoundState.NEW
        return RoundState.OLD

    def decide(self, slot: int, pool: int, round_: int, worker_mask: int, num_workers: int,
               generation: int, members: int = 0, exchange: int = 0, close: bool = False) -> SlotDecision:
        """SlotOwner, RoundCheck, MemberCheck, BitmapCheck and WorkerCount for one packet, and the value op.

        ``members`` (the packet's field) is 0 for a round of every worker (``num_workers``
        contributions complete it); otherwise the round's expected contributors, fixed by its
        first packet (a packet with other members is refused and changes nothing), and their
        number completes it. The caller has checked that the sender is one of them
        (``WorkerLookup``). ``exchange``: the packet's collective; a new round stores it, and a new
        contribution of the same round with another one is not added (``exchange_mismatch``; op NONE, or
        READ when it completes the round) but counts towards completion. ``close``: the packet asks to close the
        round (``wire.FLAG_CLOSE``): if the round is still incomplete after the packet, it completes now with the
        contributions it has (``closes``). A packet for a round that was closed (``closed``) changes nothing.
        """
        stale = self.owner[slot] != generation
        if stale:
            self.owner[slot] = generation
        state = self.round_check(slot, pool, round_, stale)
        if state == RoundState.OLD:
            return _OLD
        index = slot * wire.NUM_POOLS + pool
        if state == RoundState.NEW:
            self.members[index] = members
        elif self.members[index] != members:
            return _MISMATCH
        if state == RoundState.NEW:
            self.exchanges[index] = exchange
            mismatch = False
        else:
            mismatch = self.exchanges[index] != exchange
            if self.flags[index] & wire.FLAG_CLOSE:  # CloseCheck: closed at a deadline; answered from storage
                fresh = (self.bitmaps[index] & worker_mask) == 0
                return SlotDecision(ValueOp.READ, state, False, fresh, True, fresh, closed=True,
                                    exchange_mismatch=mismatch and fresh)
        before = 0 if state == RoundState.NEW else self.bitmaps[index]
        self.bitmaps[index] = before | worker_mask
        first = state == RoundState.NEW
        fresh = (before & worker_mask) == 0
        count = self.counts[index]
        late = False
        if fresh:
            if first:
                expected = members.bit_count() if members else num_workers
                count = self.counts[index] = (expected - 1) & 0xFF
            elif count == 0:
                late = True
            else:
                count = self.counts[index] = count - 1
        complete = count == 0 and not late
        closes = close and not complete and not late
        if closes:  # the close request completes the round with what it has
            self.counts[index] = 0
            complete = True
        mismatch = mismatch and fresh and not late
        if mismatch:
            op = ValueOp.READ if complete else ValueOp.NONE
        elif fresh and not late:
            op = ValueOp.WRITE if first else ValueOp.MERGE
        elif not fresh and complete:
            op = ValueOp.READ
        else:
            op = ValueOp.NONE
        return SlotDecision(op, state, first, fresh, complete, late, exchange_mismatch=mismatch, closes=closes)

    def aggregate(self, slot: int, pool: int, round_: int, worker_mask: int, num_workers: int, generation: int,
                  members: int, exponent: int, values: np.ndarray, has_up: bool = False, flags: int = 0,
                  exchange: int = 0, ce: bool = False) -> Verdict:
        """One packet from ``SlotOwner`` to the delivery decision (``NetaggIngress.apply``).

        ``decide``, then ``LevelState`` and the counting (a new contribution; the completing one is a
        result too, unless it goes up; a retransmission after completion is answered, from the stored
        result or, while the parent's result is outstanding, by the partial sent up again; anything
        else is a duplicate), then ``ExponentMax`` and ``ValueSum`` when the decision's op says so.
        ``has_up``: the job has an up link on this switch (``up_links``, docs/hierarchy.md). ``flags`` and
        ``exchange``: the packet's; ``RoundFlags`` keeps the OR of the round's ``wire.ROUND_FLAGS``, and with
        ``ce`` (the packet arrived with ECN CE) ``wire.ROUND_CE``.
        """
        close = bool(flags & wire.FLAG_CLOSE)
        if close and has_up:  # deadline rounds are one switch's: refused before any register changes
            return Verdict(DropReason.CLOSE_REFUSED, (), Delivery.NONE, exponent, values)
        decision = self.decide(slot, pool, round_, worker_mask, num_workers, generation, members, exchange, close)
        if decision.members_mismatch:
            return Verdict(DropReason.MEMBERS_MISMATCH, (), Delivery.NONE, exponent, values)
        if decision.round_state == RoundState.OLD:
            return Verdict(DropReason.NONE, _DUPLICATE, Delivery.NONE, exponent, values)
        index = self.pool_index(slot, pool)
        if decision.closed:  # the stored result of a round closed at a deadline, to the sender alone
            # A late contribution of another collective learns that too (the register keeps the round's flags).
            answer_flags = self.flags[index] | (wire.FLAG_OUT_OF_STEP if decision.exchange_mismatch else 0)
            return Verdict(DropReason.NONE, _RETRANSMIT_RESULT, Delivery.SENDER, self.exponent(index, ValueOp.READ, 0),
                           self.sums(index, ValueOp.READ, values), resend=True, round_flags=answer_flags,
                           members=self.bitmaps[index], late_for_close=decision.late)
        level = self.level_state(index, decision.first, has_up and decision.complete and not decision.late)
        op = decision.op
        delivery = Delivery.NONE
        if decision.fresh and not decision.late:
            counts = _COMPLETION if decision.complete and not has_up else _CONTRIBUTION
            if decision.exchange_mismatch:
                counts = _RESULT if decision.complete and not has_up else ()
            if decision.complete:
                delivery = Delivery.UP if has_up else Delivery.GROUP
        elif op == ValueOp.READ:
            counts = _RETRANSMIT_RESULT
            delivery = Delivery.UP if has_up and level != Level.FINAL else Delivery.SENDER
        else:
            counts = _DUPLICATE
        round_flags = self.round_flags(index, op, flags, decision.exchange_mismatch, ce)
        members_out = None
        if decision.closes:
            # A resend's close request is a result, not a retransmission's answer.
            counts = _COMPLETION if decision.fresh and not decision.exchange_mismatch else _RESULT
            delivery = Delivery.GROUP
            if op == ValueOp.NONE:
                op = ValueOp.READ
            self.flags[index] |= wire.FLAG_CLOSE
            round_flags = self.flags[index]
            members_out = self.bitmaps[index]
        if op != ValueOp.NONE:
            exponent = self.exponent(index, op, exponent)
            values = self.sums(index, op, values)
        return Verdict(DropReason.NONE, counts, delivery, exponent, values,
                       resend=op == ValueOp.READ and not decision.exchange_mismatch and not decision.closes,
                       round_flags=round_flags, exchange_mismatch=decision.exchange_mismatch, members=members_out)

    def accept_down(self, slot: int, pool: int, round_: int, generation: int, exponent: int,
                    values: np.ndarray, flags: int = 0, ce: bool = False) -> Verdict:
        """A parent's result for this switch's (slot, pool) (``down_links`` matched; docs/hierarchy.md).

        Nothing is taken over or started: a slot of another generation, or a round other than the
        pool's current one, makes it a duplicate (``SlotOwner`` and ``RoundCheck`` only read). For the
        current round while the partial is up, the result replaces the partial (exponent and sums
        written), the round becomes FINAL and the result goes to the local group; otherwise (not sent
        up yet, already final) it is a duplicate and changes nothing.
        """
        if flags & wire.FLAG_CLOSE:  # a closed round's bitmap names the parent's ranks, not this segment's
            return Verdict(DropReason.CLOSE_REFUSED, (), Delivery.NONE, exponent, values)
        if self.owner[slot] != generation or self.rounds[pool][slot] != round_ & 0xFFFF:
            return Verdict(DropReason.NONE, _DUPLICATE, Delivery.NONE, exponent, values)
        index = self.pool_index(slot, pool)
        if self.levels[index] != Level.UP:
            return Verdict(DropReason.NONE, _DUPLICATE, Delivery.NONE, exponent, values)
        self.levels[index] = Level.FINAL
        round_flags = self.round_flags(index, ValueOp.WRITE, flags, False, ce)
        exponent = self.exponent(index, ValueOp.WRITE, exponent)
        values = self.sums(index, ValueOp.WRITE, values)
        return Verdict(DropReason.NONE, _RESULT, Delivery.GROUP, exponent, values, round_flags=round_flags)

    def level_state(self, index: int, first: bool, goes_up: bool) -> Level:
        """LevelState for a contribution: a new round opens; a round completing (or complete) on a switch
        with an up link is UP unless its result is already FINAL. Returns the level the packet found."""
        level = Level.OPEN if first else Level(self.levels[index])
        self.levels[index] = Level.UP if goes_up and level != Level.FINAL else level
        return level

    def round_flags(self, index: int, op: ValueOp, flags: int, mismatch: bool, ce: bool = False) -> int:
        """RoundFlags: write / OR the packet's round flags, or OUT_OF_STEP for a contribution of another
        collective (its own flags are not taken), and ``wire.ROUND_CE`` when it arrived CE-marked (any packet
        that changes the register: a congestion mark is never lost); returns the round's register bits, which
        the packet leaves with."""
        mark = wire.ROUND_CE if ce else 0
        if mismatch:
            self.flags[index] |= wire.FLAG_OUT_OF_STEP | mark
        elif op == ValueOp.WRITE:
            self.flags[index] = (flags & wire.ROUND_FLAGS) | mark
        elif op == ValueOp.MERGE:
            self.flags[index] |= (flags & wire.ROUND_FLAGS) | mark
        return self.flags[index]

    def exponent(self, index: int, op: ValueOp, exponent: int) -> int:
        """ExponentMax: write / signed max / read; returns what the packet leaves with."""
        if op == ValueOp.WRITE or (op == ValueOp.MERGE and exponent > self.exponents[index]):
            self.exponents[index] = exponent
        return self.exponents[index]

    def sums(self, index: int, op: ValueOp, values: np.ndarray) -> np.ndarray:
        """ValueSum: overwrite, add modulo 2**32, or read; returns a copy of the stored sums.

        ``values`` holds ``wire.K`` values per cell: chunk c lives at pool index ``index + NUM_POOLS * c``
        (cell ``slot + c``, same pool)."""
        cells = values.size // wire.K
        rows = self.values[index:index + wire.NUM_POOLS * cells:wire.NUM_POOLS]
        if rows.shape[0] != cells:
            raise IndexError(f"a {values.size}-value packet at pool index {index} runs past the registers")
        if op == ValueOp.WRITE:
            rows[:] = values.reshape(cells, wire.K)
        elif op == ValueOp.MERGE:
            np.add(rows, values.reshape(cells, wire.K), out=rows)  # int32 arrays wrap modulo 2**32, as bit<32> does
        return rows.reshape(-1).copy()
