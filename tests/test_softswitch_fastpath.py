"""Differential test: the compiled engine (softswitch/fastpath) against the readable model (softswitch/pipeline).

Both get the same tables (the same P4Runtime updates) and the same frames; the fast engine takes
them in batches of random sizes. Emitted frames (in order, with their ports), every counter and
every register must be identical, over random and adversarial sequences: loss, duplicates,
reordering across rounds and slot reuse, malformed frames, spoofed sources, two tenants (one of them
with wide packets), packets of the other width, and a job re-created on freed cells.
"""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest
from p4.v1 import p4runtime_pb2 as p4rt

from netagg import dataplane as dp
from netagg import wire
from netagg.controller.p4rt_entities import EntityBuilder, multicast_group_entity
from netagg.p4info import P4InfoIndex
from netagg.softswitch.fastpath import COUNTERS, unavailable
from netagg.softswitch.forwarding_state import ForwardingState
from netagg.softswitch.pipeline import NetaggPipeline

if unavailable():
    pytest.skip(f"compiled engine unavailable: {unavailable()}", allow_module_level=True)

from netagg.softswitch import io_kernels
from netagg.softswitch.fastpath import FastPipeline

AGGREGATOR = "10.0.0.254"
PS = ("10.0.7.7", 7, 29000)
SWITCH_MAC = bytes.fromhex("0200000000fe")


def _ip(text: str) -> int:
    return int.from_bytes(socket.inet_aton(text), "big")


class Twins:
    """A reference and a fast pipeline over two ForwardingStates that receive the same writes."""

    def __init__(self, shards: int = 1) -> None:
        index = P4InfoIndex.from_file(dp.P4INFO_PATH)
        self.ref_state, self.fast_state = ForwardingState(index), ForwardingState(index)
        self.ref = NetaggPipeline(self.ref_state, index.p4info)
        self.fast = FastPipeline(self.fast_state, index.p4info)
        #: The fast engine's shards (softswitch/shards.py): shared registers and tables, counters each.
        self.shards = [self.fast, *(self.fast.add_shard() for _ in range(shards - 1))]
        for state in (self.ref_state, self.fast_state):
            state.configured = True
        self.builder = EntityBuilder(index)

    def _apply(self, update: p4rt.Update) -> None:
        for state in (self.ref_state, self.fast_state):
            with state.lock:
                state.apply_update(update)

    def entry(self, kind: int, table: str, match: dict, action: str | None = None, params: dict | None = None) -> None:
        self._apply(p4rt.Update(type=kind, entity=p4rt.Entity(
            table_entry=self.builder.table_entry(table, match, action, params))))

    def group(self, kind: int, gid: int, replicas: list[tuple[int, int]]) -> None:
        self._apply(p4rt.Update(type=kind, entity=multicast_group_entity(gid, replicas)))

    def add_job(self, job: int, workers: list[tuple[int, str, int, int]], base: int, count: int, gen: int,
                ps_mode: bool = False, k: int = wire.K) -> None:
        """workers: (rank, ip, udp port, switch port); ``base``: the first cell; ``k``: the job's width."""
        ins = p4rt.Update.INSERT
        self.entry(ins, dp.TABLE_JOBS, {"job_id": job}, dp.ACTION_SET_JOB, {
            "num_workers": len(workers), "slot_base": base, "slot_count": count, "mgid": job, "generation": gen,
            "width": wire.width_code(k)})
        for rank, ip, udp, port in workers:
            self.entry(ins, dp.TABLE_WORKERS, {"job_id": job, "ipv4_src": _ip(ip), "udp_src": udp,
                                               "ingress_port": port}, dp.ACTION_SET_WORKER,
                       {"rank": rank, "worker_mask": 1 << rank})
        receivers = [(1, PS[0], PS[2], PS[1])] if ps_mode else [(r + 1, ip, udp, port) for r, ip, udp, port in workers]
        for rid, ip, udp, _ in receivers:
            self.entry(ins, dp.TABLE_REPLICAS, {"mgid": job, "rid": rid}, dp.ACTION_SET_DESTINATION,
                       {"dst_mac": 0x020000000100 + rid, "dst_addr": _ip(ip), "dst_port": udp})
        self.group(ins, job, [(port, rid) for rid, _, _, port in receivers])

    def remove_job(self, job: int, workers: list[tuple[int, str, int, int]], ps_mode: bool = False) -> None:
        dele = p4rt.Update.DELETE
        self.entry(dele, dp.TABLE_JOBS, {"job_id": job})
        for _, ip, udp, port in workers:
            self.entry(dele, dp.TABLE_WORKERS, {"job_id": job, "ipv4_src": _ip(ip), "udp_src": udp,
                                                "ingress_port": port})
        for rid in [1] if ps_mode else [r + 1 for r, *_ in workers]:
            self.entry(dele, dp.TABLE_REPLICAS, {"mgid": job, "rid": rid})
        self.group(dele, job, [])

    def run(self, frames: list[tuple[bytes, int]], rng: np.random.Generator) -> None:
        """Both engines, the same frames; the fast one in random batches. Asserts identical outputs.

        With shards, each batch is split by the shard that owns each frame's slot (as the kernel's steering
        does; frames of no slot go to a random shard) and each part runs on its shard's pipeline in order:
        outputs must then be identical per owner (shards interleave, slots never do)."""
        n = len(self.shards)
        with self.fast.lock:
            tables = self.fast.tables()
        owner_of = [_owner(frame, port, n, tables) for frame, port in frames]
        want: dict[int, list[tuple[int, bytes]]] = {}
        for (frame, port), owner in zip(frames, owner_of):
            want.setdefault(owner, []).extend(self.ref.process(frame, port))
        got: dict[int, list[tuple[int, bytes]]] = {}
        stride = max([len(f) for f, _ in frames] + [1])
        out_buf = np.zeros((128, stride), np.uint8)
        out_len = np.zeros(128, np.int64)
        out_port = np.zeros(128, np.int64)
        i = 0
        while i < len(frames):
            size = int(rng.integers(1, 65))
            for owner in sorted(set(owner_of[i:i + size]), key=lambda _: rng.random()):
                chunk = [f for f, o in zip(frames[i:i + size], owner_of[i:i + size]) if o == owner]
                pipeline = self.shards[owner if owner >= 0 else int(rng.integers(0, n))]
                in_buf = np.zeros((len(chunk), stride), np.uint8)
                for row, (frame, _) in enumerate(chunk):
                    in_buf[row, :len(frame)] = np.frombuffer(frame, np.uint8)
                in_len = np.array([len(f) for f, _ in chunk], np.int64)
                in_port = np.array([p for _, p in chunk], np.int64)
                start = 0
                while start < len(chunk):
                    start, emitted = pipeline.run(in_buf, in_len, in_port, len(chunk), out_buf, out_len, out_port,
                                                  start)
                    got.setdefault(owner, []).extend(
                        (int(out_port[k]), out_buf[k, :out_len[k]].tobytes()) for k in range(emitted))
            i += size
        assert {o: len(v) for o, v in got.items() if v} == {o: len(v) for o, v in want.items() if v}
        for owner, outputs in want.items():
            for k, (g, w) in enumerate(zip(got.get(owner, []), outputs)):
                assert g == w, f"output {k} of shard {owner}'s frames differs"
        self.assert_same_state()

    def assert_same_state(self) -> None:
        for name in COUNTERS:
            for ref_array, fast_array in zip(self.ref_state.counter_sums(name), self.fast_state.counter_sums(name)):
                np.testing.assert_array_equal(fast_array, ref_array, err_msg=name)
        ref, fast = self.ref.registers.snapshot(), self.fast.registers.snapshot()
        for name in ref:
            np.testing.assert_array_equal(fast[name], ref[name], err_msg=name)


def frame(src_ip: str, dst_ip: str, sport: int, dport: int, payload: bytes, *, src_mac: bytes = b"\x02" * 6,
          ttl: int = 64, flags_frag: int = 0x4000, ihl: int = 5, proto: int = 17, tos: int = 0) -> bytes:
    options = bytes(4 * (ihl - 5))
    udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload if proto == 17 else payload
    total = 4 * ihl + len(udp)
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, tos, total & 0xFFFF, 0x1234, flags_frag, ttl, proto, 0,
                               socket.inet_aton(src_ip), socket.inet_aton(dst_ip)))
    ip[10:12] = wire.ipv4_checksum(bytes(ip)).to_bytes(2, "big")
    return SWITCH_MAC + src_mac + b"\x08\x00" + bytes(ip) + options + udp


def contribution(job: int, rank: int, ip: str, udp: int, slot: int, pool: int, round_: int, seq: int,
                 values: np.ndarray, exponent: int = 0, flags: int = 0, members: int = 0, exchange: int = 0,
                 width: int | None = None, ecn: int = 0) -> bytes:
    """A contribution carrying ``values``; ``width``: the header's code (default: the one of ``len(values)``;
    another one makes a malformed packet); ``ecn``: its IPv4 ECN bits."""
    code = wire.WIDTH_CODES[values.size] if width is None else width
    header = wire.Header(job_id=job, slot=slot, pool=pool, rank=rank, seq=seq, exponent=exponent, flags=flags,
                         round=round_ & 0xFFFF, members=members, exchange=exchange, width=code)
    payload = header.pack() + values.astype(wire.WIRE_VALUE_DTYPE).tobytes()
    return frame(ip, AGGREGATOR, udp, wire.NETAGG_UDP_PORT, payload, tos=ecn)


def _ecn(*keys: int) -> int:
    """A packet's ECN bits, from its own fields (the traffic's random draws stay as they were): mostly ECT(0),
    as hosts send; now and then CE (a queue on the way marked it) or not ECN-capable."""
    return (wire.ECN_ECT0, wire.ECN_ECT0, wire.ECN_CE, wire.ECN_ECT0, wire.ECN_NOT_ECT)[sum(keys) * 7919 % 5]


def _mutate(data: bytes, rng: np.random.Generator) -> bytes:
    kind = rng.integers(4)
    if kind == 0:
        return data[:int(rng.integers(0, len(data)))]
    if kind == 1:
        return data + rng.bytes(int(rng.integers(1, 40)))
    if kind == 2:
        return rng.bytes(int(rng.integers(0, 400)))
    out = bytearray(data)
    for _ in range(int(rng.integers(1, 6))):
        out[int(rng.integers(0, len(out)))] = int(rng.integers(0, 256))
    return bytes(out)


def _setup(twins: Twins) -> None:
    ins = p4rt.Update.INSERT
    twins.entry(ins, dp.TABLE_SOURCES, {"ipv4_src": _ip(AGGREGATOR)}, dp.ACTION_SWITCH_ONLY, {})
    twins.entry(ins, dp.TABLE_SOURCES, {"ipv4_src": _ip(PS[0])}, dp.ACTION_BIND_TO_PORT, {"port": PS[1]})
    twins.entry(ins, dp.TABLE_ROUTES, {"ipv4_dst": (_ip("10.0.0.0"), 16)}, dp.ACTION_FORWARD,
                {"port": 6, "dst_mac": 0x020000000606})
    twins.entry(ins, dp.TABLE_ROUTES, {"ipv4_dst": (_ip("10.0.1.0"), 24)}, dp.ACTION_FORWARD,
                {"port": 5, "dst_mac": 0x020000000505})
    twins.entry(ins, dp.TABLE_ROUTES, {"ipv4_dst": (_ip("10.0.7.7"), 32)}, dp.ACTION_FORWARD,
                {"port": 511, "dst_mac": 0x020000000707})


TENANT_A = [(r, f"10.0.0.{r + 1}", 40000 + r, 1 + r) for r in range(3)]
TENANT_B = [(r, f"10.0.1.{r + 1}", 41000 + r, 4 + r) for r in range(2)]
TENANT_C = [(r, f"10.0.2.{r + 1}", 42000 + r, 9 + r) for r in range(2)]


def _round_flags(rng: np.random.Generator) -> int:
    """A contribution's round flags: mostly none, sometimes a non-finite block, rarely an abort."""
    draw = rng.random()
    if draw < 0.85:
        return 0
    if draw < 0.97:
        return int(rng.choice([wire.FLAG_NAN, wire.FLAG_POS_INF, wire.FLAG_NEG_INF]))
    return wire.FLAG_OUT_OF_STEP


def _exchange(rng: np.random.Generator, round_: int) -> int:
    """The collective a contribution names: its round's, or (sometimes) another (ranks out of step)."""
    return round_ // 3 if rng.random() > 0.08 else int(rng.integers(0, 2**32))


def _traffic(rng: np.random.Generator, jobs: dict[int, tuple[list, int]], n: int, hostile: float,
             rounds: dict[tuple[int, int], int] | None = None, widths: dict[int, int] | None = None) -> list:
    """Rounds of contributions per (job, slot), of every worker or of a subset (``members``), with loss,
    duplicates, resends of old rounds, reordering, outsiders and other members in a subset round, packets of
    the other width, plus hostile and malformed frames and plain IPv4 traffic. ``rounds``: each (job, slot)'s
    last round so far (updated); ``widths``: each job's values per packet (default ``wire.K``)."""
    rounds = {} if rounds is None else rounds
    widths = {} if widths is None else widths
    frames: list[tuple[bytes, int]] = []
    while len(frames) < n:
        if rng.random() < hostile:
            kind = rng.integers(8)
            job = int(rng.choice(list(jobs)))
            rank, ip, udp, port = jobs[job][0][int(rng.integers(len(jobs[job][0])))]
            values = rng.integers(-2**31, 2**31, widths.get(job, wire.K)).astype(np.int32)
            good = contribution(job, rank, ip, udp, 0, 0, 1, 0, values)
            if kind == 0:
                frames.append((_mutate(good, rng), port))
            elif kind == 1:  # from another port, from the aggregator address, from the netagg port
                frames.append((good, 8))
                frames.append((frame(AGGREGATOR, ip, wire.NETAGG_UDP_PORT, udp, good[42:]), 8))
                frames.append((frame("10.0.9.9", ip, wire.NETAGG_UDP_PORT, udp, good[42:]), 8))
            elif kind == 2:  # posing as the PS, from its port and from another
                frames.append((frame(PS[0], ip, PS[2], udp, good[42:]), int(rng.choice([PS[1], 8]))))
            elif kind == 3:  # wrong slot/pool/rank/version/flags/job
                h = dict(job=job, rank=rank, ip=ip, udp=udp, slot=0, pool=0, round_=1, seq=0, values=values)
                h.update(rng.choice([{"slot": 5000}, {"pool": 2}, {"rank": (rank + 1) % 32}, {"flags": 1},
                                     {"job": 999}]))
                frames.append((contribution(**h), port))
            elif kind == 4:  # plain traffic: routed, no route, TTL, options, not UDP
                frames.append((frame(ip, "10.0.1.7", 1000, 2000, rng.bytes(30)), port))
                frames.append((frame(ip, "192.168.0.1", 1000, 2000, b"x"), port))
                frames.append((frame(ip, "10.0.0.9", 1000, 2000, b"x", ttl=1), port))
                frames.append((frame(ip, "10.0.0.9", 1000, 2000, b"opts", ihl=6), port))
                frames.append((frame(ip, "10.0.7.7", 1000, 2000, b"to port 511", proto=6), port))
            elif kind == 5:  # fragment, wrong lengths, a width code that is not the values', an undefined one
                frames.append((frame(ip, AGGREGATOR, udp, wire.NETAGG_UDP_PORT, good[42:], flags_frag=0x2000), port))
                frames.append((good[:-4] + b"", port))
                h = dict(job=job, rank=rank, ip=ip, udp=udp, slot=0, pool=0, round_=1, seq=0, values=values)
                frames.append((contribution(**h, width=1 - wire.WIDTH_CODES[values.size]), port))
                frames.append((contribution(**h, width=int(rng.integers(2, 256))), port))
            elif kind == 6:  # not IPv4
                frames.append((SWITCH_MAC + b"\x02" * 6 + b"\x86\xdd" + rng.bytes(60), port))
            else:  # a copy of a much older round
                frames.append((contribution(job, rank, ip, udp, 0, 0, 0xFFF0, 0, values), port))
            continue
        job = int(rng.choice(list(jobs)))
        workers, slots = jobs[job]
        k = widths.get(job, wire.K)
        slot = int(rng.integers(slots))
        key = (job, slot)
        round_ = rounds.get(key, 0) + 1
        rounds[key] = round_
        pool = round_ % 2
        batch = []
        members, senders = 0, workers
        if rng.random() < 0.3:  # a subset round
            senders = [w for w in workers if rng.random() < 0.6] or workers[-1:]
            members = wire.members_of(w[0] for w in senders)
            for rank, ip, udp, port in workers:
                values = rng.integers(-2**20, 2**20, k).astype(np.int32)
                if (1 << rank) & ~members and rng.random() < 0.3:  # an outsider
                    batch.append((contribution(job, rank, ip, udp, slot, pool, round_, 7, values, 0, 0, members), port))
                if (1 << rank) & members and rng.random() < 0.1:  # other members than the round's
                    other = members ^ (1 << int(rng.integers(len(workers) + 1)))
                    batch.append((contribution(job, rank, ip, udp, slot, pool, round_, 7, values, 0, 0, other), port))
        for rank, ip, udp, port in senders:
            wrong_width = rng.random() < 0.02  # the other width, valid as such: not the job's
            values = rng.integers(-2**20, 2**20, wire.K + wire.WIDE_K - k if wrong_width else k).astype(np.int32)
            exponent = int(rng.integers(-128, 128))
            if members and rng.random() < 0.2:  # a PS in the group (MLfabric's ps_members): zeros, no magnitude
                values, exponent = np.zeros(k, np.int32), -128
            close = wire.FLAG_CLOSE if rng.random() < 0.06 else 0  # a member closes the round at a deadline
            pkt = (contribution(job, rank, ip, udp, slot, pool, round_, round_ * 100 + slot, values, exponent,
                                _round_flags(rng) | close, members, _exchange(rng, round_),
                                ecn=_ecn(slot, rank, round_)), port)
            if rng.random() > 0.1:  # 10 % lost
                batch.append(pkt)
            if rng.random() < 0.2:  # duplicate
                batch.append(pkt)
            if rng.random() < 0.1:  # resend of the previous round (round 0: the other pool just after a takeover)
                batch.append((contribution(job, rank, ip, udp, slot, 1 - pool, round_ - 1, 0, values), port))
        if rng.random() < 0.05 and batch:  # a member's resend closes the round (or meets it closed)
            close_frame = bytearray(batch[0][0])
            close_frame[42 + 1] |= wire.FLAG_CLOSE | wire.FLAG_RETRANSMIT
            batch.append((bytes(close_frame), batch[0][1]))
        rng.shuffle(batch)
        frames.extend(batch)
        if rng.random() < 0.3 and batch:  # a resend after completion
            frames.append(batch[0])
    return frames


def _owner(frame: bytes, port: int, shards: int, tables) -> int:
    """The shard of the frame's slot (netagg.steering; a parent's result: its local job's), -1 for a frame of no
    slot; one owner without shards."""
    if shards == 1:
        return 0
    owners = np.zeros(1, np.int64)
    row = np.frombuffer(frame, np.uint8).reshape(1, -1) if frame else np.zeros((1, 1), np.uint8)
    io_kernels.frame_owners(row, np.array([len(frame)], np.int64), np.array([port], np.int64), 1, shards, 0,
                                  owners, tables.dn_keys, tables.dn_vals)
    return int(owners[0])


@pytest.mark.parametrize(("seed", "shards"), [(1, 1), (2, 1), (3, 1), (4, 1), (1, 3), (2, 2)])
def test_random_and_adversarial_sequences_give_identical_frames_counters_and_registers(seed, shards):
    rng = np.random.default_rng(seed)
    twins = Twins(shards)
    _setup(twins)
    twins.add_job(1, TENANT_A, base=0, count=4, gen=100)
    # Tenant B sends wide packets: 3 slots of 4 cells from cell 4.
    twins.add_job(2, TENANT_B, base=4, count=3, gen=101, ps_mode=seed % 2 == 0, k=wire.WIDE_K)
    jobs = {1: (TENANT_A, 4), 2: (TENANT_B, 3)}
    widths = {2: wire.WIDE_K}
    twins.run(_traffic(rng, jobs, 1500, hostile=0.15, widths=widths), rng)
    twins.assert_same_state()
    # Tenant B leaves mid-round; a new narrow job (new generation) gets cells of its wide slots, and a new wide
    # job the cells after them.
    twins.remove_job(2, TENANT_B, ps_mode=seed % 2 == 0)
    twins.run(_traffic(rng, {1: (TENANT_A, 4)}, 200, hostile=0.1), rng)
    twins.add_job(3, TENANT_B, base=4, count=6, gen=102)
    twins.add_job(4, TENANT_C, base=10, count=2, gen=103, k=wire.WIDE_K)
    widths = {4: wire.WIDE_K}
    twins.run(_traffic(rng, {1: (TENANT_A, 4), 3: (TENANT_B, 6), 4: (TENANT_C, 2)}, 1500, hostile=0.15,
                       widths=widths), rng)
    twins.assert_same_state()
    drops = twins.ref_state.counter_arrays(dp.COUNTER_DROP_REASONS)[0]
    assert drops[dp.DropReason.WRONG_WIDTH] > 0 and drops[dp.DropReason.MALFORMED] > 0
    assert twins.ref_state.counter_arrays(dp.COUNTER_JOB_RESULTS)[0][4] > 50  # the wide job really aggregates
    contributions = twins.ref_state.counter_total(dp.COUNTER_JOB_CONTRIBUTIONS)
    results = twins.ref_state.counter_total(dp.COUNTER_JOB_RESULTS)
    assert contributions > 500 and results > 100  # the sequences really aggregate
    drops = twins.ref_state.counter_arrays(dp.COUNTER_DROP_REASONS)[0]
    assert drops[dp.DropReason.NOT_A_MEMBER] > 0 and drops[dp.DropReason.MEMBERS_MISMATCH] > 0
    assert drops[dp.DropReason.LATE_FOR_CLOSED_ROUND] > 0  # rounds were closed early, and late members answered


def _after_restart(rng: np.random.Generator, jobs: dict[int, tuple[list, int]],
                   rounds: dict[tuple[int, int], int]) -> list:
    """What workers send to a restarted switch (registers zero, same tables): per (job, slot), some workers
    ("leaders") have the last round's result and send the next round, the others lost it and resend the last
    round; the leaders also resend their copies of the last round (shadow packets), in any order, with
    duplicates; then the laggards send the next round too. Rounds advance by one."""
    frames: list[tuple[bytes, int]] = []
    for (job, slot), last in sorted(rounds.items()):
        workers = jobs[job][0]
        leaders = [w for w in workers if rng.random() < 0.6] or workers[:1]
        laggards = [w for w in workers if w not in leaders]
        batch = []
        for rank, ip, udp, port in workers:
            values = rng.integers(-2**20, 2**20, wire.K).astype(np.int32)
            flags = wire.FLAG_RETRANSMIT
            resend = contribution(job, rank, ip, udp, slot, last % 2, last, 0, values, 0, flags)
            batch += [(resend, port)] * int(rng.integers(1, 3))
        for rank, ip, udp, port in leaders:
            values = rng.integers(-2**20, 2**20, wire.K).astype(np.int32)
            batch.append((contribution(job, rank, ip, udp, slot, (last + 1) % 2, last + 1, 1, values), port))
        rng.shuffle(batch)
        frames += batch
        for rank, ip, udp, port in laggards:
            values = rng.integers(-2**20, 2**20, wire.K).astype(np.int32)
            frames.append((contribution(job, rank, ip, udp, slot, (last + 1) % 2, last + 1, 1, values), port))
        rounds[(job, slot)] = last + 1
    return frames


@pytest.mark.parametrize("seed", [5, 6])
def test_a_register_reset_mid_job_and_the_ride_through_give_identical_frames_counters_and_registers(seed):
    """A switch restart: every register back to zero under the same tables (the controller re-pushed the same
    generation), then what workers send to ride through it (the stale-slot path marks the other pool two rounds
    behind, so a round one behind the first packet still starts afresh and completes)."""
    rng = np.random.default_rng(seed)
    twins = Twins()
    _setup(twins)
    twins.add_job(1, TENANT_A, base=0, count=4, gen=100)
    twins.add_job(2, TENANT_B, base=4, count=3, gen=101)
    jobs = {1: (TENANT_A, 4), 2: (TENANT_B, 3)}
    rounds: dict[tuple[int, int], int] = {}
    twins.run(_traffic(rng, jobs, 600, hostile=0.05, rounds=rounds), rng)
    for engine in (twins.ref, twins.fast):
        engine.reset_registers()
    before = twins.ref_state.counter_total(dp.COUNTER_JOB_RESULTS)
    twins.run(_after_restart(rng, jobs, rounds), rng)
    # Every (job, slot) completed two rounds: the one the laggards lost and the next.
    assert twins.ref_state.counter_total(dp.COUNTER_JOB_RESULTS) - before == 2 * len(rounds)
    twins.run(_traffic(rng, jobs, 600, hostile=0.05, rounds=rounds), rng)
    twins.assert_same_state()


def test_a_group_larger_than_the_output_batch_is_refused_not_truncated():
    twins = Twins()
    workers = [(r, f"10.0.0.{r + 1}", 40000 + r, 1 + r % 8) for r in range(32)]
    twins.add_job(1, workers, base=0, count=2, gen=7)
    out = np.zeros((16, 400), np.uint8)
    with pytest.raises(ValueError, match="cannot hold a group of 32"):
        twins.fast.run(out, np.zeros(16, np.int64), np.zeros(16, np.int64), 1, out, np.zeros(16, np.int64),
                       np.zeros(16, np.int64))


def test_single_frame_interface_matches_the_model():
    rng = np.random.default_rng(9)
    twins = Twins()
    _setup(twins)
    twins.add_job(1, TENANT_A, base=0, count=4, gen=100)
    for frame_, port in _traffic(rng, {1: (TENANT_A, 4)}, 400, hostile=0.2):
        assert twins.fast.process(frame_, port) == twins.ref.process(frame_, port)
    twins.assert_same_state()


# A tree of switches (docs/hierarchy.md): job 1's segment here is a leaf, its parent behind port 8.
PARENT_IP, UP_PORT, PARENT_JOB = "10.0.8.254", 8, 55


def _add_tree_links(twins: Twins, kind: int = p4rt.Update.INSERT) -> None:
    twins.entry(kind, dp.TABLE_UP_LINKS, {"job_id": 1}, *(() if kind == p4rt.Update.DELETE else (
        dp.ACTION_SET_UP_LINK, {"port": UP_PORT, "parent_job": PARENT_JOB, "parent_rank": 3,
                                "parent_mac": 0x02000000080E, "parent_addr": _ip(PARENT_IP)})))
    twins.entry(kind, dp.TABLE_DOWN_LINKS, {"ingress_port": UP_PORT, "ipv4_src": _ip(PARENT_IP),
                                            "job_id": PARENT_JOB},
                *(() if kind == p4rt.Update.DELETE else (dp.ACTION_SET_DOWN_LINK, {"job": 1})))


def _down(slot: int, pool: int, round_: int, values: np.ndarray, exponent: int = 0, src: str = PARENT_IP,
          job: int = PARENT_JOB, sport: int = wire.NETAGG_UDP_PORT, close: int = 0, ecn: int = 0) -> bytes:
    header = wire.Header(job_id=job, slot=slot, pool=pool, rank=0, seq=round_, exponent=exponent,
                         flags=wire.FLAG_RESULT | (round_ * 8 & wire.ROUND_FLAGS) | close, round=round_ & 0xFFFF)
    return frame(src, AGGREGATOR, sport, wire.NETAGG_TREE_UDP_PORT, wire.pack(header, values), tos=ecn)


def _tree_traffic(rng: np.random.Generator, slots: int, n: int, rounds: dict[int, int]) -> list:
    """Rounds of the leaf job 1 with loss, duplicates and resends (which go up again while the round is up,
    or are answered from the final result), interleaved with the parent's results: on time, early (before
    the round went up), late (another round), twice, lost; and forgeries of them from a worker's port, from
    another address, for another parent job, from another source port, and cut short."""
    frames: list[tuple[bytes, int]] = []
    while len(frames) < n:
        slot = int(rng.integers(slots))
        round_ = rounds.get(slot, 0) + 1
        rounds[slot] = round_
        pool = round_ % 2
        batch = []
        for rank, ip, udp, port in TENANT_A:
            values = rng.integers(-2**20, 2**20, wire.K).astype(np.int32)
            close = wire.FLAG_CLOSE if rng.random() < 0.03 else 0  # refused on a switch with an up link
            pkt = (contribution(1, rank, ip, udp, slot, pool, round_, round_, values, int(rng.integers(-20, 20)),
                                _round_flags(rng) | close, 0, _exchange(rng, round_),
                                ecn=_ecn(slot, rank, round_)), port)
            if rng.random() > 0.1:
                batch.append(pkt)
            if rng.random() < 0.3:  # a resend, perhaps after completion: up again, or the final result
                batch.append((contribution(1, rank, ip, udp, slot, pool, round_, round_, values, 0,
                                           wire.FLAG_RETRANSMIT), port))
        total = rng.integers(-2**30, 2**30, wire.K).astype(np.int32)
        for _ in range(int(rng.choice([0, 1, 1, 1, 2]))):  # the parent's result: lost, once or twice
            batch.append((_down(slot, pool, round_, total, int(rng.integers(-30, 30)), ecn=_ecn(slot, round_, 1)),
                          UP_PORT))
        if rng.random() < 0.2:  # a late one, for the round before
            batch.append((_down(slot, 1 - pool, round_ - 1, total), UP_PORT))
        if rng.random() < 0.3:  # forgeries
            forged = [(_down(slot, pool, round_, total), TENANT_A[0][3]),
                      (_down(slot, pool, round_, total, src="10.0.8.7"), UP_PORT),
                      (_down(slot, pool, round_, total, job=PARENT_JOB + 1), UP_PORT),
                      (_down(slot, pool, round_, total, src=TENANT_A[1][1], sport=5555), TENANT_A[1][3]),
                      (_down(slot, pool, round_, total)[:-8], UP_PORT),
                      (_down(slot, pool, round_, total, close=wire.FLAG_CLOSE), UP_PORT),
                      (_down(slots + 3, pool, round_, total), UP_PORT)]
            batch.append(forged[int(rng.integers(len(forged)))])
        rng.shuffle(batch)
        frames.extend(batch)
        if rng.random() < 0.3:  # resends after everything else of the round
            rank, ip, udp, port = TENANT_A[int(rng.integers(len(TENANT_A)))]
            frames.append((contribution(1, rank, ip, udp, slot, pool, round_, round_,
                                        np.zeros(wire.K, np.int32), 0, wire.FLAG_RETRANSMIT), port))
    return frames


@pytest.mark.parametrize(("seed", "shards"), [(5, 1), (6, 1), (7, 3)])
def test_tree_paths_give_identical_frames_counters_and_registers(seed, shards):
    """The up and down paths (tree_links.p4) on both engines: a leaf job beside a flat one, links removed
    and installed again mid-way (a round then completes to the group, and a result from above is a host's)."""
    rng = np.random.default_rng(seed)
    twins = Twins(shards)
    _setup(twins)
    twins.add_job(1, TENANT_A, base=0, count=4, gen=100)
    twins.add_job(2, TENANT_B, base=4, count=3, gen=101)
    _add_tree_links(twins)
    rounds: dict[int, int] = {}
    tree, flat = _tree_traffic(rng, 4, 900, rounds), _traffic(rng, {2: (TENANT_B, 3)}, 400, hostile=0.1)
    picks = rng.permutation([0] * len(tree) + [1] * len(flat))  # the two jobs interleaved, each in its order
    sources = [iter(tree), iter(flat)]
    twins.run([next(sources[pick]) for pick in picks], rng)
    ups = twins.ref_state.counter_total(dp.COUNTER_JOB_CONTRIBUTIONS)
    _add_tree_links(twins, p4rt.Update.DELETE)
    twins.run(_tree_traffic(rng, 4, 200, rounds), rng)
    _add_tree_links(twins)
    twins.run(_tree_traffic(rng, 4, 600, rounds), rng)
    twins.assert_same_state()
    levels = twins.ref.registers.snapshot()["levels"]
    assert ups > 300 and {1, 2} <= set(levels.tolist())  # rounds went up, and results came down
    assert twins.ref_state.counter_arrays(dp.COUNTER_DROP_REASONS)[0][dp.DropReason.CLOSE_REFUSED] > 0


@pytest.mark.parametrize("engine", ["ref", "fast"])
def test_a_congestion_mark_on_any_contribution_reaches_every_result_of_the_round(engine):
    """ECN (docs/protocol.md, "Congestion marks"): a round one of whose contributions arrived CE-marked sends its
    result CE-marked to every member, even when the completing packet was not marked, and a resend's answer from
    storage keeps the mark; the next round of the slot starts unmarked. The IPv4 checksum stays valid."""
    twins = Twins()
    _setup(twins)
    twins.add_job(1, TENANT_A, base=0, count=4, gen=100)
    pipeline = twins.ref if engine == "ref" else twins.fast
    values = np.arange(wire.K, dtype=np.int32)

    def send(rank: int, round_: int, ecn: int, flags: int = 0) -> list[tuple[int, bytes]]:
        _, ip, udp, port = TENANT_A[rank]
        return pipeline.process(contribution(1, rank, ip, udp, 0, round_ % 2, round_, round_, values, 0, flags,
                                             ecn=ecn), port)

    def ecn_of(frames: list[tuple[int, bytes]]) -> set[int]:
        for _, data in frames:
            assert wire.ipv4_checksum(data[14:34]) == 0  # a valid header sums to zero
        return {data[15] & wire.ECN_MASK for _, data in frames}

    assert send(0, 1, wire.ECN_CE) == [] and send(1, 1, wire.ECN_ECT0) == []
    results = send(2, 1, wire.ECN_ECT0)
    assert len(results) == 3 and ecn_of(results) == {wire.ECN_CE}
    assert ecn_of(send(1, 1, wire.ECN_ECT0, wire.FLAG_RETRANSMIT)) == {wire.ECN_CE}  # answered from storage
    assert all(data[42 + 1] & wire.ROUND_CE == wire.FLAG_RESULT for _, data in results)  # never a header flag
    for rank in range(2):
        send(rank, 2, wire.ECN_ECT0)
    assert ecn_of(send(2, 2, wire.ECN_ECT0)) == {wire.ECN_ECT0}
    for rank in range(2):
        send(rank, 3, wire.ECN_NOT_ECT)
    assert ecn_of(send(2, 3, wire.ECN_CE)) == {wire.ECN_CE}  # the completing packet's own mark
