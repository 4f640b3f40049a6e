"""The aggregation rules of ``netagg.p4``'s slot registers, in Python — shared by the software
target's pipeline model and the parameter server's fallback aggregator, so both follow the
switch exactly (the P4 program stays the reference; the PTF suite checks the model).

Per slot: an owner tag (``SlotOwner``) and one bitmap per pool (``BitmapCheck``); per
(slot, pool): the missing-contribution count (``WorkerCount``), the exponent maximum
(``ExponentMax``) and the K int32 sums (``ValueSum``). See docs/protocol.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from netagg import wire
from netagg.dataplane import ValueOp


@dataclass(slots=True)
class SlotDecision:
    """What the registers decided about one packet."""

    op: ValueOp  #: what ValueSum/ExponentMax do (NONE: nothing)
    first: bool  #: the round's first contribution
    fresh: bool  #: the sender's first packet of this round (else a retransmission)
    complete: bool  #: the round is complete (now, or already)
    late: bool  #: a new contribution to a round that had already completed

    @property
    def delivers(self) -> bool:
        """A result leaves: to the group (completing contribution) or to the sender (resend)."""
        return self.complete and not self.late


class SlotRegisters:
    """Registers of ``num_slots`` slots, each with ``wire.NUM_POOLS`` pools."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.owner = [0] * num_slots
        self.bitmaps = [[0] * num_slots for _ in range(wire.NUM_POOLS)]
        self.counts = [0] * (num_slots * wire.NUM_POOLS)
        self.exponents = [0] * (num_slots * wire.NUM_POOLS)
        self.values = np.zeros((num_slots * wire.NUM_POOLS, wire.K), np.int32)

    def reset(self) -> None:
        """Power-on state."""
        self.__init__(self.num_slots)

    @staticmethod
    def pool_index(slot: int, pool: int) -> int:
        return slot * wire.NUM_POOLS + pool

    def decide(self, slot: int, pool: int, worker_mask: int, num_workers: int, generation: int) -> SlotDecision:
        """SlotOwner, BitmapCheck and WorkerCount for one packet, and the resulting value op."""
        stale = self.owner[slot] != generation
        if stale:
            self.owner[slot] = generation
        mine = 0 if stale else self.bitmaps[pool][slot]
        other = 0 if stale else self.bitmaps[1 - pool][slot]
        self.bitmaps[pool][slot] = mine | worker_mask
        self.bitmaps[1 - pool][slot] = other & ~worker_mask & 0xFFFFFFFF
        first = mine == 0
        fresh = (mine & worker_mask) == 0
        index = slot * wire.NUM_POOLS + pool
        count = self.counts[index]
        late = False
        if fresh:
            if first:
                count = self.counts[index] = (num_workers - 1) & 0xFF
            elif count == 0:
                late = True
            else:
                count = self.counts[index] = count - 1
        complete = count == 0 and not late
        if fresh and not late:
            op = ValueOp.WRITE if first else ValueOp.MERGE
        elif not fresh and complete:
            op = ValueOp.READ
        else:
            op = ValueOp.NONE
        return SlotDecision(op, first, fresh, complete, late)

    def exponent(self, index: int, op: ValueOp, exponent: int) -> int:
        """ExponentMax: write / signed max / read; returns what the packet leaves with."""
        if op == ValueOp.WRITE or (op == ValueOp.MERGE and exponent > self.exponents[index]):
            self.exponents[index] = exponent
        return self.exponents[index]

    def sums(self, index: int, op: ValueOp, values: np.ndarray) -> np.ndarray:
        """ValueSum: overwrite, add modulo 2**32, or read; returns a copy of the stored sums."""
        row = self.values[index]
        if op == ValueOp.WRITE:
            row[:] = values
        elif op == ValueOp.MERGE:
            np.add(row, values, out=row)  # int32 arrays wrap modulo 2**32, as bit<32> does
        return row.copy()
