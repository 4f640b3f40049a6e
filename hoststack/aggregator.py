"""One job's aggregation in software, with exactly the switch's semantics.

The parameter server uses it in fallback mode: it receives the workers' contribution
packets instead of the switch and must answer exactly as the switch would (same int32
modular sums, same maximum exponent, same bitmap/pool rules, docs/protocol.md steps
1-5): a new contribution is added once per (slot, pool, rank); the one completing a round
becomes the result for every worker; a retransmission after completion is answered with
the stored result, to its sender only; a retransmission before completion and a late
copy of a completed round are dropped.

Workers are told apart by their source address. Unless a table is given, the first
address seen for a rank is pinned to it (the switch's ``workers`` table, learned).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from netagg import layout, wire
from netagg.dataplane import DropReason
from netagg.slots import Delivery, SlotRegisters

Address = tuple[str, int]
_unpack_header = wire.HEADER_STRUCT.unpack_from
#: One aggregator serves one job, so the slots' owner tag is constant.
_GENERATION = 1


class Outcome(NamedTuple):
    """A result to send: to every worker of the job (``to_group``) or back to the sender."""

    packet: bytes
    to_group: bool


@dataclass
class AggregatorStats:
    """The switch's per-job counters, plus drops by reason."""

    contributions: int = 0
    results: int = 0
    duplicates: int = 0
    retransmit_results: int = 0
    drops: Counter = field(default_factory=Counter)

    def count(self, name: str) -> None:
        """Bump the counter ``name`` (a short name of ``dataplane.JOB_COUNTERS``, as ``Verdict.counts`` gives)."""
        setattr(self, name, getattr(self, name) + 1)


class SoftAggregator:
    """Bitmaps, counts, exponent maxima and int32 sums of one job's slots and pools."""

    def __init__(
        self,
        job_id: int,
        num_workers: int,
        slot_count: int,
        *,
        result_flags: int = wire.FLAG_RESULT | wire.FLAG_PS_FORWARDED,
        workers: Mapping[Address, int] | None = None,
        width: int = wire.K,
    ) -> None:
        if not 1 <= num_workers <= wire.MAX_WORKERS or slot_count < 1:
            raise ValueError(f"bad job shape: {num_workers} workers, {slot_count} slots")
        #: The job's packet width, its code, and the cells of one slot (as on the switch: docs/protocol.md).
        self.width = width
        self.width_code = wire.width_code(width)
        self.cells = wire.cells_of(width)
        self.message_bytes = wire.netagg_bytes(width)
        self.job_id = job_id
        self.num_workers = num_workers
        self.slot_count = slot_count
        self.result_flags = result_flags
        self._learn = workers is None
        self.rank_of: dict[Address, int] = dict(workers or {})
        self.address_of: dict[int, Address] = {rank: addr for addr, rank in self.rank_of.items()}
        self.registers = SlotRegisters(slot_count * self.cells)
        self.stats = AggregatorStats()

    def register(self, rank: int, address: Address) -> None:
        """Admit ``rank`` from ``address`` (a HELLO with the job's secret); replaces the rank's old address.

        Called from the PS's TCP threads while its UDP thread reads the maps: they are replaced
        whole (copy, change, swap), never changed in place under a reader.
        """
        if not 0 <= rank < self.num_workers:
            raise ValueError(f"rank {rank} not in 0..{self.num_workers - 1}")
        holder = self.rank_of.get(address)
        if holder is not None and holder != rank:
            raise ValueError(f"{address[0]}:{address[1]} is already registered as rank {holder}")
        rank_of, address_of = dict(self.rank_of), dict(self.address_of)
        old = address_of.get(rank)
        if old is not None:
            rank_of.pop(old, None)
        rank_of[address] = rank
        address_of[rank] = address
        self.rank_of, self.address_of = rank_of, address_of

    def group(self) -> list[Address]:
        """Where a completed round's result goes: every known worker."""
        return list(self.address_of.values())

    def _drop(self, reason: DropReason) -> None:
        self.stats.drops[reason.name] += 1

    def handle(self, data: bytes | bytearray | memoryview, source: Address) -> Outcome | None:
        """Process one datagram from ``source``; the result to send, if any."""
        if len(data) < wire.HEADER_BYTES:
            return self._drop(DropReason.MALFORMED)
        version, flags, job, slot, pool, rank, exponent, width, round_, _, members, exchange = _unpack_header(data, 0)
        if version != wire.VERSION:
            return self._drop(DropReason.BAD_VERSION)
        if width not in wire.WIDTHS or len(data) != wire.netagg_bytes(wire.WIDTHS[width]):
            return self._drop(DropReason.MALFORMED)
        if flags & wire.FLAG_RESULT:
            return self._drop(DropReason.RESULT_FROM_HOST)
        if job != self.job_id:
            return self._drop(DropReason.UNKNOWN_JOB)
        known_rank = self.rank_of.get(source)
        if known_rank is None and (not self._learn or rank >= self.num_workers or rank in self.address_of):
            return self._drop(DropReason.UNKNOWN_WORKER)
        if width != self.width_code:
            return self._drop(DropReason.WRONG_WIDTH)
        if slot >= self.slot_count:
            return self._drop(DropReason.SLOT_OUT_OF_RANGE)
        if pool >= wire.NUM_POOLS:
            return self._drop(DropReason.BAD_POOL)
        if known_rank is None:
            self.rank_of[source] = known_rank = rank
            self.address_of[rank] = source
        elif rank != known_rank:
            return self._drop(DropReason.RANK_MISMATCH)
        if members and not members & (1 << rank):
            return self._drop(DropReason.NOT_A_MEMBER)
        return self._aggregate(data, slot, pool, round_, rank, exponent, members, flags, exchange)

    def _aggregate(self, data: bytes | bytearray | memoryview, slot: int, pool: int, round_: int, rank: int,
                   exponent: int, members: int, flags: int, exchange: int) -> Outcome | None:
        values = np.frombuffer(data, wire.WIRE_VALUE_DTYPE, self.width, wire.HEADER_BYTES)
        verdict = self.registers.aggregate(slot * self.cells, pool, round_, 1 << rank, self.num_workers, _GENERATION,
                                           members,
                                           exponent, values, flags=flags, exchange=exchange)
        if verdict.drop != DropReason.NONE:
            return self._drop(verdict.drop)
        if verdict.exchange_mismatch:
            self._drop(DropReason.EXCHANGE_MISMATCH)
        if verdict.late_for_close:
            self._drop(DropReason.LATE_FOR_CLOSED_ROUND)
        for name in verdict.counts:
            self.stats.count(name)
        if verdict.delivery == Delivery.NONE:
            return None
        packet = bytearray(data[:wire.HEADER_BYTES])
        packet[layout.FLAGS_AT] = (packet[layout.FLAGS_AT] & ~wire.STORED_FLAGS & 0xFF) \
            | (verdict.round_flags & wire.STORED_FLAGS) | self.result_flags
        if verdict.members is not None:  # a round closed at a deadline: who is in its sum
            packet[layout.MEMBERS_AT:layout.MEMBERS_AT + 4] = verdict.members.to_bytes(4, "big")
        packet[layout.EXPONENT_AT] = verdict.exponent & 0xFF
        packet += verdict.values.astype(wire.WIRE_VALUE_DTYPE).tobytes()
        return Outcome(bytes(packet), to_group=verdict.delivery == Delivery.GROUP)
