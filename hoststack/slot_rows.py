"""A transport's slot rows: one preallocated packet per slot, the copies kept for recovery, and the round state
every worker of the job keeps in step (``transport.py``'s module docstring gives the rules).

The one owner of these arrays: :class:`~netagg.hoststack.transport.Transport` creates them, an
:class:`~netagg.hoststack.exchange.Exchange` fills and sends rows through the methods here (and hands the arrays
to the batch kernels), and a failover marks and restores the round state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from netagg import layout, wire
from netagg.hoststack.packets import SEQ_MASK, packet_dtype


@dataclass(frozen=True)
class RoundMark:
    """The round state where an exchange began (restored to run it again at the PS)."""

    seq: int
    probe_seq: int
    rounds: np.ndarray
    next_pool: np.ndarray


class SlotRows:
    """Row ``s`` is slot ``slot_base + s``: its latest packet (``raw``, as sent), the packet before it (``shadow``),
    how many packets it carried (``uses``), its round number and next pool; plus the block counters ``seq`` and
    ``probe_seq`` and the ``members`` a subset exchange writes into each row it fills."""

    def __init__(self, k: int, job_id: int, rank: int, slot_base: int, slot_count: int) -> None:
        self.slot_count = slot_count
        self.packets = np.zeros(slot_count, packet_dtype(k))
        hdr = self.packets["hdr"]
        hdr["version"] = wire.VERSION
        hdr["width"] = wire.width_code(k)
        hdr["job_id"] = job_id
        hdr["rank"] = rank
        hdr["slot"] = slot_base + np.arange(slot_count)
        nbytes = wire.netagg_bytes(k)
        self.raw = self.packets.view(np.uint8).reshape(slot_count, nbytes)
        self.words = self.raw.view(np.uint32)
        #: Per slot: the exact bytes of the packet sent in it before the current one, kept across exchanges, and
        #: how many packets the slot has carried (a shadow exists from 2 on).
        self.shadow = np.zeros((slot_count, nbytes), np.uint8)
        self.uses = np.zeros(slot_count, np.int64)
        #: What recovery copies are assembled in and sent from (:meth:`answered_copies`).
        self.resend = np.zeros((slot_count, nbytes), np.uint8)
        self.next_pool = np.zeros(slot_count, np.uint8)
        #: Per slot: the round number of its latest use (+1 per new packet, mod 2**16), which lets the switch tell a
        #: delayed copy of an earlier round from a new one. Every worker of the job uses each slot the same number of
        #: times, so their numbers agree.
        self.rounds = np.zeros(slot_count, np.uint16)
        self.seq = 0
        self.probe_seq = 0
        #: The members a subset exchange writes into each row it fills (0: the whole job).
        self.members = 0

    # -- round state ---------------------------------------------------------------------------------------------
    def mark(self) -> RoundMark:
        return RoundMark(self.seq, self.probe_seq, self.rounds.copy(), self.next_pool.copy())

    def restore(self, mark: RoundMark) -> None:
        self.seq, self.probe_seq = mark.seq, mark.probe_seq
        self.rounds[:] = mark.rounds
        self.next_pool[:] = mark.next_pool

    def start_subset(self, round_base: int, members: int) -> None:
        """A subset exchange's rounds: every slot's round number is ``round_base`` (its first packet carries one
        more, in pool ``round_base % 2``); block ids start over (rounds are unique per exchange)."""
        self.rounds[:] = round_base & 0xFFFF
        self.next_pool[:] = round_base & 1
        self.seq = self.probe_seq = 0
        self.members = members

    def advance(self, blocks: int, probes: int) -> None:
        """An exchange of ``blocks`` data blocks and ``probes`` probes ended: the next one's first ids."""
        self.seq = (self.seq + blocks) & SEQ_MASK
        self.probe_seq = (self.probe_seq + probes) & SEQ_MASK

    def forget_shadows(self) -> None:
        """The packets sent so far went to another aggregator: none is resent as a shadow."""
        self.uses[:] = 0

    # -- rows ----------------------------------------------------------------------------------------------------
    def prepare(self, slots: np.ndarray, members: np.ndarray, ident: int) -> None:
        """Before ``slots`` are filled with new packets: each row's packet becomes the slot's shadow, and the row
        gets the exchange's id and its slot's ``members`` (always written: a row may still hold an earlier subset
        round's)."""
        self.shadow[slots] = self.raw[slots]
        self.uses[slots] += 1
        hdr = self.packets["hdr"]
        hdr["members"][slots] = members
        hdr["exchange"][slots] = ident

    def set_flags(self, slots: np.ndarray, flags: int) -> None:
        """Set ``flags`` in the rows of ``slots`` (cleared when a row is next filled)."""
        self.raw[slots, layout.FLAGS_AT] |= flags

    def set_block_flags(self, slots: np.ndarray, flags: np.ndarray) -> None:
        """The rows' flags byte (a block's non-finite flags; the fill wrote 0)."""
        self.packets["hdr"]["flags"][slots] = flags

    def answered_copies(self, slots: np.ndarray, outstanding: np.ndarray) -> np.ndarray:
        """Copy, per slot of ``slots``, its latest packet whose result this worker has into ``resend`` (the shadow
        where the slot has a packet outstanding, else the row itself), ``FLAG_RETRANSMIT`` set; slots without such
        a packet are skipped. Returns the slots copied, in the order of the rows ``resend[:n]``."""
        keep = self.uses[slots] >= np.where(outstanding, 2, 1)
        if not keep.all():
            slots, outstanding = slots[keep], outstanding[keep]
        n = slots.shape[0]
        if n:
            rows = self.resend[:n]
            rows[:] = np.where(outstanding[:, None], self.shadow[slots], self.raw[slots])
            rows[:, layout.FLAGS_AT] |= wire.FLAG_RETRANSMIT
        return slots
