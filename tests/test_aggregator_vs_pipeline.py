"""Differential test: the PS's software aggregator (hoststack/aggregator) against the switch's readable model
(softswitch/pipeline), for one job.

Both get the same contributions (the aggregator the UDP payloads, the model whole frames from the workers'
ports) over random sequences: loss, duplicates, retransmissions before and after completion, delayed copies
of earlier rounds, reordering across rounds and slots, both pools, round numbers wrapping past 0xFFFF, subset
rounds (with outsiders and packets that disagree on the members), more senders than the job's worker count
(late contributions), packets of the other width and refused packets; for narrow and wide jobs. Every packet
must leave both with the same result datagrams to the same destinations; at the end the job's counters, the drops
by reason and the slot registers must agree.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
from p4.v1 import p4runtime_pb2 as p4rt

from netagg import dataplane as dp
from netagg import wire
from netagg.controller.p4rt_entities import EntityBuilder, multicast_group_entity
from netagg.dataplane import DropReason
from netagg.hoststack.aggregator import SoftAggregator
from netagg.p4info import P4InfoIndex
from netagg.softswitch.forwarding_state import ForwardingState
from netagg.softswitch.pipeline import NetaggPipeline, ParsedPacket, deparse

JOB = 5
#: SoftAggregator's slots carry a constant owner tag, 1: with the same generation the registers agree cell for cell.
GENERATION = 1
SLOT_BASE = 3
SLOT_COUNT = 3
AGGREGATOR = "10.0.0.254"
SWITCH_MAC = bytes.fromhex("0200000000fe")
#: A host that is no worker of the job (its port on the switch is 9).
STRANGER = ("10.0.9.9", 999)
_IPV4_DONT_FRAGMENT = 0x4000
#: Drops counted in the job's rejects too: those of WorkerLookup and the registers (not of the checks before).
_JOB_REJECTS = (DropReason.UNKNOWN_WORKER, DropReason.WRONG_WIDTH, DropReason.SLOT_OUT_OF_RANGE, DropReason.BAD_POOL,
                DropReason.RANK_MISMATCH, DropReason.NOT_A_MEMBER, DropReason.MEMBERS_MISMATCH,
                DropReason.EXCHANGE_MISMATCH)


def _address(rank: int) -> tuple[str, int]:
    return f"10.0.0.{rank + 1}", 40000 + rank


def _port(rank: int) -> int:
    return rank + 1


class Pair:
    """One job on the readable pipeline (its entries written over P4Runtime) and on a SoftAggregator."""

    def __init__(self, num_workers: int, ranks: list[int], k: int) -> None:
        index = P4InfoIndex.from_file(dp.P4INFO_PATH)
        self.state = ForwardingState(index)
        self.state.configured = True
        self.pipeline = NetaggPipeline(self.state, index.p4info)
        builder = EntityBuilder(index)
        entries = [builder.table_entry(dp.TABLE_JOBS, {"job_id": JOB}, dp.ACTION_SET_JOB, {
            "num_workers": num_workers, "slot_base": SLOT_BASE, "slot_count": SLOT_COUNT, "mgid": JOB,
            "generation": GENERATION, "width": wire.width_code(k)})]
        for rank in ranks:
            ip, udp = _address(rank)
            entries.append(builder.table_entry(dp.TABLE_WORKERS, {
                "job_id": JOB, "ipv4_src": _ip(ip), "udp_src": udp, "ingress_port": _port(rank)},
                dp.ACTION_SET_WORKER, {"rank": rank, "worker_mask": 1 << rank}))
            entries.append(builder.table_entry(dp.TABLE_REPLICAS, {"mgid": JOB, "rid": rank + 1},
                                               dp.ACTION_SET_DESTINATION,
                                               {"dst_mac": 0x020000000100 + rank, "dst_addr": _ip(ip),
                                                "dst_port": udp}))
        entities = [p4rt.Entity(table_entry=e) for e in entries]
        entities.append(multicast_group_entity(JOB, [(_port(rank), rank + 1) for rank in ranks]))
        with self.state.lock:
            for entity in entities:
                self.state.apply_update(p4rt.Update(type=p4rt.Update.INSERT, entity=entity))
        self.aggregator = SoftAggregator(JOB, num_workers, SLOT_COUNT, result_flags=wire.FLAG_RESULT,
                                         workers={_address(rank): rank for rank in ranks}, width=k)
        self.cells = wire.cells_of(k)
        self.ranks = ranks
        self.delivered = {"group": 0, "sender": 0}

    def feed(self, sender: int | None, header: wire.Header, values: np.ndarray) -> None:
        """One contribution from rank ``sender`` (None: the stranger) to both; asserts the same results leave."""
        ip, udp = STRANGER if sender is None else _address(sender)
        datagram = header.pack() + values.astype(wire.WIRE_VALUE_DTYPE).tobytes()  # its width may not be the values'
        udp_length = wire.UDP_HEADER_BYTES + len(datagram)
        frame = deparse(ParsedPacket(
            eth=[SWITCH_MAC, b"\x02" * 6, wire.ETHERTYPE_IPV4],
            ipv4=[0x45, 0, wire.IPV4_HEADER_BYTES + udp_length, 0, _IPV4_DONT_FRAGMENT, 64, wire.IPPROTO_UDP, 0,
                  socket.inet_aton(ip), socket.inet_aton(AGGREGATOR)],
            udp=[udp, wire.NETAGG_UDP_PORT, udp_length, 0], payload=datagram))
        switch = []
        for port, out in self.pipeline.process(frame, 9 if sender is None else _port(sender)):
            dest = (socket.inet_ntoa(out[30:34]), int.from_bytes(out[36:38], "big"))
            assert port == _port(self.ranks[[_address(r) for r in self.ranks].index(dest)])
            switch.append((dest, out[42:]))
        outcome = self.aggregator.handle(datagram, (ip, udp))
        soft = []
        if outcome is not None:
            self.delivered["group" if outcome.to_group else "sender"] += 1
            soft = [(dest, outcome.packet) for dest in (self.aggregator.group() if outcome.to_group else [(ip, udp)])]
        assert sorted(switch) == sorted(soft), f"different results for {header}"

    def assert_same_counters_and_registers(self) -> None:
        stats = self.aggregator.stats
        for name in ("contributions", "results", "duplicates", "retransmit_results"):
            assert self.state.counter_values(dp.JOB_COUNTERS[name], JOB)[0] == getattr(stats, name), name
        drops = self.state.counter_arrays(dp.COUNTER_DROP_REASONS)[0]
        assert {DropReason(i).name: int(n) for i, n in enumerate(drops) if n} == dict(stats.drops)
        rejects = sum(stats.drops[reason.name] for reason in _JOB_REJECTS)
        assert self.state.counter_values(dp.COUNTER_JOB_REJECTS, JOB)[0] == rejects
        switch, soft = self.pipeline.registers.snapshot(), self.aggregator.registers.snapshot()
        cells = SLOT_COUNT * self.cells
        slots = slice(SLOT_BASE, SLOT_BASE + cells)
        pools = slice(SLOT_BASE * wire.NUM_POOLS, (SLOT_BASE + cells) * wire.NUM_POOLS)
        np.testing.assert_array_equal(switch["owner"][slots], soft["owner"])
        np.testing.assert_array_equal(switch["rounds"][:, slots], soft["rounds"])
        for name in ("members", "exchanges", "flags", "bitmaps", "counts", "exponents", "values"):
            np.testing.assert_array_equal(switch[name][pools], soft[name], err_msg=name)


def _ip(text: str) -> int:
    return int.from_bytes(socket.inet_aton(text), "big")


Packet = tuple[int | None, wire.Header, np.ndarray]


def _refused(rng: np.random.Generator, ranks: list[int], k: int) -> Packet:
    """A packet one of the checks before the registers refuses (or the stranger's)."""
    rank = int(rng.choice(ranks))
    other = wire.K + wire.WIDE_K - k
    values = rng.integers(-2**31, 2**31, k).astype(np.int32)
    fields = dict(job_id=JOB, slot=0, pool=0, rank=rank, seq=0, round=1, width=wire.width_code(k))
    change = rng.choice([{"job_id": JOB + 1}, {"slot": SLOT_COUNT + int(rng.integers(5))}, {"pool": 2},
                         {"rank": (rank + 1) % 32}, {"flags": wire.FLAG_RESULT}, {"version": wire.VERSION + 1},
                         {"width": wire.width_code(other)}, {"width": wire.width_code(other)}, {"width": 7}])
    fields.update(change)
    if change.get("width") == wire.width_code(other) and rng.random() < 0.8:  # well formed, of the other width
        values = rng.integers(-2**31, 2**31, other).astype(np.int32)
    sender = None if rng.random() < 0.2 else rank
    return sender, wire.Header(**fields), values


def _round(rng: np.random.Generator, ranks: list[int], slot: int, round_: int, delayed: list[Packet],
           k: int) -> list[Packet]:
    """One round of one slot: every rank's contribution or a subset round's, with loss, duplicates,
    outsiders and disagreeing members; some copies are held back in ``delayed`` to arrive rounds later."""
    pool = round_ % 2
    members, senders = 0, ranks
    batch: list[Packet] = []
    if rng.random() < 0.3:  # a subset round
        senders = [r for r in ranks if rng.random() < 0.6] or ranks[-1:]
        members = wire.members_of(senders)
        for rank in ranks:
            values = rng.integers(-2**31, 2**31, k).astype(np.int32)
            if rank not in senders and rng.random() < 0.3:  # an outsider
                batch.append((rank, _header(k, JOB, slot, pool, rank, 7, round=round_, members=members), values))
            if rank in senders and rng.random() < 0.15:  # other members than the round's (or the whole job)
                other = members ^ (1 << int(rng.integers(len(ranks) + 1))) if rng.random() < 0.7 else 0
                batch.append((rank, _header(k, JOB, slot, pool, rank, 7, round=round_, members=other), values))
    for rank in senders:
        values = rng.integers(-2**31, 2**31, k).astype(np.int32)
        exponent = int(rng.integers(-128, 128))
        if members and rng.random() < 0.2:  # a PS in the group (MLfabric's ps_members): zeros, no magnitude
            values, exponent = np.zeros(k, np.int32), -128
        flags = int(rng.choice([0, 0, 0, 0, 0, 0, wire.FLAG_NAN, wire.FLAG_POS_INF, wire.FLAG_NEG_INF,
                                wire.FLAG_OUT_OF_STEP]))
        exchange = round_ // 2 if rng.random() > 0.1 else int(rng.integers(0, 2**32))  # sometimes out of step
        header = _header(k, JOB, slot, pool, rank, round_ * 100 + slot, exponent=exponent, flags=flags,
                             round=round_, members=members, exchange=exchange)
        if rng.random() > 0.1:  # 10 % lost
            batch.append((rank, header, values))
        if rng.random() < 0.2:  # duplicate
            batch.append((rank, header, values))
        if rng.random() < 0.15:  # a retransmission that arrives rounds later
            delayed.append((rank, _header(k, JOB, slot, pool, rank, header.seq, header.exponent,
                                              wire.FLAG_RETRANSMIT | flags, round=round_, members=members,
                                              exchange=exchange), values))
    rng.shuffle(batch)
    if batch and rng.random() < 0.3:  # a resend after completion (or before, if a packet was lost)
        rank, header, values = batch[0]
        batch.append((rank, _header(k, header.job_id, header.slot, header.pool, header.rank, header.seq,
                                        header.exponent, wire.FLAG_RETRANSMIT, round=header.round,
                                        members=header.members), values))
    return batch


def _header(k: int, *args, **fields) -> wire.Header:
    """A header of a packet of ``k`` values."""
    return wire.Header(*args, width=wire.width_code(k), **fields)


def _traffic(rng: np.random.Generator, ranks: list[int], n: int, k: int) -> list[Packet]:
    """Rounds of random slots, one to three at a time shuffled together (a slot's next round may overtake
    its last), refused packets, and delayed copies released at random; round numbers start just below the
    wrap."""
    rounds = {slot: 0xFFFF - int(rng.integers(0, 8)) for slot in range(SLOT_COUNT)}
    delayed: list[Packet] = []
    packets: list[Packet] = []
    while len(packets) < n:
        mixed: list[Packet] = []
        for _ in range(int(rng.integers(1, 4))):
            slot = int(rng.integers(SLOT_COUNT))
            rounds[slot] = (rounds[slot] + 1) & 0xFFFF
            mixed += _round(rng, ranks, slot, rounds[slot], delayed, k)
        if rng.random() < 0.5:
            rng.shuffle(mixed)
        packets += mixed
        while rng.random() < 0.25:
            packets.append(_refused(rng, ranks, k))
        while delayed and rng.random() < 0.3:
            packets.append(delayed.pop(int(rng.integers(len(delayed)))))
    assert all(r < 0x100 for r in rounds.values()), "the round numbers wrapped"
    return packets


@pytest.mark.parametrize(("num_workers", "ranks"), [(3, [0, 1, 2]), (4, [0, 1, 2, 3]), (2, [0, 1, 2])],
                         ids=["three-workers", "four-workers", "more-senders-than-workers"])
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("k", [wire.K, wire.WIDE_K], ids=["narrow", "wide"])
def test_the_software_aggregator_answers_counts_and_stores_exactly_as_the_pipeline(num_workers, ranks, seed, k):
    rng = np.random.default_rng(seed)
    pair = Pair(num_workers, ranks, k)
    for sender, header, values in _traffic(rng, ranks, 1500, k):
        pair.feed(sender, header, values)
    pair.assert_same_counters_and_registers()
    stats = pair.aggregator.stats
    assert stats.results > 100 and stats.retransmit_results > 10 and stats.duplicates > 10
    assert pair.delivered["group"] == stats.results and pair.delivered["sender"] == stats.retransmit_results
    for reason in _JOB_REJECTS:
        assert stats.drops[reason.name] > 0, reason
