"""The transport's batched fast path: compiled kernels against their numpy references, and the
exchange with and without numba and recvmmsg/sendmmsg.

The differential tests feed both implementations identical state and identical batches
(random, and adversarial: duplicates of a result within a batch, wrong round/pool/seq, another
job or version, no RESULT flag, short and long datagrams, strangers, slots out of range) and
require identical results, counters, round trips and every array they write.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest

from netagg import layout, mmsg, wire
from netagg.hoststack import congestion, exchange
from netagg.hoststack import quantization as qz
from netagg.hoststack import transport as tr
from netagg.hoststack import transport_reference as reference
from netagg.hoststack.packets import PROBE_SEQ_BIT, SEQ_MASK, packet_dtype
from netagg.hoststack.transport import Transport, TransportTimeout
from netagg.jobconfig import Endpoint
from netagg.localports import free_ports
from netagg.testing.hoststack import (
    LossyRelay,
    expected_allreduce,
    fallback_job,
    job_configs,
    run_workers,
    through_relay,
)

kernels = exchange.kernels  # the compiled steps an exchange runs (None without numba)
needs_numba = pytest.mark.skipif(kernels is None, reason="numba is not installed")

JOB = 7
#: The exchange id of the scenarios' collective (results of another one, or OUT_OF_STEP, raise the alarm).
EXCHANGE = 0x1234ABCD
PEERS = [("10.0.0.1", 28900), ("10.0.0.2", 9000)]
STRANGERS = [("10.0.0.1", 28901), ("10.0.0.9", 28900), ("0.0.0.0", 0)]


def _source(host: str, port: int) -> int:
    return int.from_bytes(socket.inet_aton(host), "big") << 16 | port


class Scenario:
    """A round's receive state (slots with outstanding packets) and a batch of datagrams for it."""

    def __init__(self, rng: np.random.Generator, used: int = 16, num_blocks: int = 100, count: int = 64,
                 slot_base: int = 0, k: int = wire.K) -> None:
        self.used, self.num_blocks, self.window = used, num_blocks, used
        #: Whether the exchange accepts rounds closed at a deadline (else a CLOSE result raises alarm 2).
        self.closable = int(rng.random() < 0.5)
        #: The job's width, its packets' dtype and bytes.
        self.k, self.dtype, self.nbytes = k, packet_dtype(k), wire.netagg_bytes(k)
        #: The transport's first slot (a host thread's share of the job's slots, hoststack/threads.py).
        self.slot_base = slot_base
        self.seq0 = int(rng.integers(0, 2**31))
        self.expect = np.full(used, -1, np.int64)
        outstanding = rng.random(used) < 0.8
        self.rounds = rng.integers(0, 2**16, used)
        self.pools = rng.integers(0, 2, used)
        probe = rng.random(used) < 0.3
        blocks = np.arange(used) + used * rng.integers(0, max(1, num_blocks // used), used)
        blocks = np.where(blocks < num_blocks, blocks, np.arange(used))
        self.seqs = np.where(probe, PROBE_SEQ_BIT | ((np.arange(used) + 5) & SEQ_MASK), (blocks + self.seq0) & SEQ_MASK)
        keys = (self.rounds << 33) | (self.pools << 32) | self.seqs
        self.expect[outstanding] = keys[outstanding]
        self.retries = np.where(rng.random(used) < 0.3, rng.integers(1, 4, used), 0).astype(np.int32)
        self.sent_at = rng.random(used)
        self.next_pool = rng.integers(0, 2, used + 3).astype(np.uint8)
        self.sums = np.zeros((num_blocks, 4 * k), np.uint8)
        self.global_exp = np.full(num_blocks, qz.EXP_NONE, np.int8)
        self.allowed = np.array(sorted(_source(*p) for p in PEERS), np.int64)
        self.buf = rng.integers(0, 256, (mmsg.BATCH, 1152)).astype(np.uint8)  # garbage where nothing is written
        self.names = np.zeros((mmsg.BATCH, mmsg.NAME_BYTES), np.uint8)
        self.lengths = np.zeros(mmsg.BATCH, np.uint32)
        self.count = 0
        for _ in range(count):
            self._add(rng)

    def _datagram(self, rng: np.random.Generator, slot: int) -> np.ndarray:
        packet = np.zeros(1, self.dtype)
        hdr = packet["hdr"]
        hdr["version"], hdr["flags"], hdr["job_id"] = wire.VERSION, wire.FLAG_RESULT, JOB
        hdr["width"] = wire.width_code(self.k)
        hdr["slot"], hdr["pool"], hdr["round"] = slot + self.slot_base, self.pools[slot], self.rounds[slot]
        hdr["seq"], hdr["exponent"], hdr["rank"] = self.seqs[slot], rng.integers(-128, 128), rng.integers(0, 32)
        hdr["exchange"] = EXCHANGE
        packet["values"] = rng.integers(-2**31, 2**31, self.k)
        return packet.view(np.uint8)

    def _add(self, rng: np.random.Generator) -> None:
        slot = int(rng.integers(0, self.used))
        data = self._datagram(rng, slot)
        hdr = data.view(self.dtype)["hdr"]
        source = PEERS[int(rng.integers(0, len(PEERS)))]
        length = self.nbytes
        fault = rng.integers(0, 16)
        if fault == 0:
            source = STRANGERS[int(rng.integers(0, len(STRANGERS)))]
        elif fault == 1:
            other = wire.netagg_bytes(wire.K + wire.WIDE_K - self.k)  # a datagram of the other width
            length = int(rng.choice([0, 1, 15, 16, self.nbytes - 1, self.nbytes + 1, 512, other]))
        elif fault == 2:
            hdr["version"] = wire.VERSION + 1
        elif fault == 3:
            hdr["flags"] = wire.FLAG_RETRANSMIT
        elif fault == 4:
            hdr["job_id"] = JOB + 1
        elif fault == 5:
            hdr["round"] = (int(hdr["round"][0]) + 1) & 0xFFFF
        elif fault == 6:
            hdr["pool"] ^= 1
        elif fault == 7:
            hdr["seq"] = (int(hdr["seq"][0]) + self.window) & 0xFFFFFFFF
        elif fault == 8:
            hdr["slot"] = self.slot_base + self.used + int(rng.integers(0, 3))
        elif fault == 10 and self.slot_base:  # another thread's slot, below this one's
            hdr["slot"] = self.slot_base - 1 - int(rng.integers(0, min(3, self.slot_base)))
        elif fault == 11:  # a round out of step: the alarm, whatever the seq
            hdr["flags"] |= wire.FLAG_OUT_OF_STEP
            if rng.random() < 0.5:
                hdr["seq"] = int(rng.integers(0, 2**32))
        elif fault == 12:  # a result naming another collective
            hdr["exchange"] = EXCHANGE ^ int(rng.integers(1, 2**32))
        elif fault == 13:  # a block that met NaN or inf: accepted, its flags recorded
            hdr["flags"] |= int(rng.choice([wire.FLAG_NAN, wire.FLAG_POS_INF, wire.FLAG_NEG_INF,
                                            wire.FLAG_POS_INF | wire.FLAG_NEG_INF]))
        elif fault == 15:  # a later round of the slot (two or more ahead: the outstanding one is superseded)
            hdr["round"] = (int(hdr["round"][0]) + int(rng.integers(1, 6))) & 0xFFFF
            hdr["pool"] = int(hdr["pool"][0]) ^ int(rng.integers(0, 2))
        elif fault == 14:  # a round closed at a deadline: who is in its sum in members
            hdr["flags"] |= wire.FLAG_CLOSE
            hdr["members"] = int(rng.integers(1, 2**32))
        elif fault == 9 and self.count:  # a second copy of an earlier datagram of the batch
            i = int(rng.integers(0, self.count))
            self._put(self.buf[i, :self.nbytes].copy(), self.names[i].copy(), int(self.lengths[i]))
            return
        flags = int(hdr["flags"][0]) | int(rng.choice([0, wire.FLAG_PS_FORWARDED]))
        hdr["flags"] = flags
        name = np.zeros(mmsg.NAME_BYTES, np.uint8)
        name[:16] = mmsg.sockaddr_in(*source)
        self._put(data, name, length)

    def _put(self, data: np.ndarray, name: np.ndarray, length: int) -> None:
        if self.count == mmsg.BATCH:
            return
        self.buf[self.count, :data.size] = data
        self.names[self.count] = name
        self.lengths[self.count] = length
        self.count += 1

    def run(self, accept) -> tuple:
        state = [a.copy() for a in (self.expect, self.retries, self.sent_at, self.next_pool, self.sums,
                                    self.global_exp, np.zeros(self.num_blocks, np.uint8), np.zeros(3, np.int64),
                                    np.zeros(self.num_blocks, np.uint32))]
        expect, retries, sent_at, next_pool, sums, global_exp, result_flags, alarm, result_members = state
        acc_slots = np.full(mmsg.BATCH, -7, np.int64)
        following = np.full(mmsg.BATCH, -7, np.int64)
        rtts = np.full(mmsg.BATCH, -7.0)
        closed = np.full(mmsg.BATCH, 7, np.int64)
        superseded = np.zeros(self.used, np.uint8)
        out = accept(self.buf, self.lengths, self.names, self.count, self.allowed, JOB, self.slot_base, self.seq0,
                     self.window,
                     self.num_blocks, expect, retries, sent_at, next_pool, 2.5, sums, global_exp, EXCHANGE,
                     self.closable, result_flags, result_members, alarm, acc_slots, following, closed, superseded,
                     rtts)
        n_acc, n_rtt = out[0], out[1]
        state.append(closed[:n_acc])
        state.append(superseded)
        return tuple(int(v) for v in out), state, acc_slots[:n_acc], following[:n_acc], rtts[:n_rtt]


def _same(a: tuple, b: tuple) -> None:
    assert a[0] == b[0]
    for x, y in zip(a[1:], b[1:], strict=True):
        if isinstance(x, list):
            for u, v in zip(x, y, strict=True):
                np.testing.assert_array_equal(u, v)
        else:
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("k", [wire.K, wire.WIDE_K], ids=["narrow", "wide"])
def test_numpy_reference_applies_the_per_datagram_rules(k):
    for seed in range(50):
        s = Scenario(np.random.default_rng(seed), slot_base=64 * (seed % 3), k=k)
        s.closable = 0  # closed rounds (no round trip sample) are test_a_closed_round_is_accepted_only_...'s
        (n_acc, n_rtt, foreign, malformed, stale, done), state, acc, following, rtts = s.run(reference.accept_results)
        assert n_acc + foreign + malformed + stale == s.count
        assert len(set(acc.tolist())) == n_acc  # at most one result per slot and batch
        expect, retries, _, next_pool, _, _, _, alarm, _, _, _ = state
        assert (expect[acc] == -1).all() and (retries[acc] == 0).all()
        np.testing.assert_array_equal(next_pool[acc], s.next_pool[acc] ^ 1)
        assert n_rtt == int((s.retries[acc] == 0).sum())
        np.testing.assert_array_equal(rtts, 2.5 - s.sent_at[acc][s.retries[acc] == 0])
        probes = (s.seqs[acc] & PROBE_SEQ_BIT) != 0
        assert done == int((~probes).sum())
        np.testing.assert_array_equal(following[probes], acc[probes])
        if alarm[0]:  # an OUT_OF_STEP or foreign-collective result for an outstanding (round, pool)
            assert s.expect[alarm[2]] != -1


def test_results_out_of_step_raise_the_alarm_and_are_never_accepted():
    implementations = [reference.accept_results] + ([kernels.accept_results] if kernels else [])
    for case in ("flag", "exchange"):
        s = Scenario(np.random.default_rng(3), count=0)
        slot = int(np.flatnonzero(s.expect != -1)[0])
        data = s._datagram(np.random.default_rng(4), slot)
        hdr = data.view(s.dtype)["hdr"]
        if case == "flag":
            hdr["flags"] |= wire.FLAG_OUT_OF_STEP
            hdr["seq"] ^= 0x55  # the completing packet may be another rank's block: seq does not matter
        else:
            hdr["exchange"] = EXCHANGE + 1
        name = np.zeros(mmsg.NAME_BYTES, np.uint8)
        name[:16] = mmsg.sockaddr_in(*PEERS[0])
        s._put(data, name, s.nbytes)
        for accept in implementations:
            counts, state, acc, _, _ = s.run(accept)
            assert counts[0] == 0 and counts[4] == 1 and acc.size == 0
            assert state[0][slot] == s.expect[slot]  # still outstanding
            assert state[7].tolist() == [1, int(hdr["exchange"][0]), slot]


def test_a_closed_round_is_accepted_only_by_an_exchange_that_allows_it():
    implementations = [reference.accept_results] + ([kernels.accept_results] if kernels else [])
    for closable in (0, 1):
        s = Scenario(np.random.default_rng(5), count=0)
        s.closable = closable
        slot = int(np.flatnonzero((s.expect != -1) & ((s.seqs & PROBE_SEQ_BIT) == 0))[0])
        data = s._datagram(np.random.default_rng(6), slot)
        hdr = data.view(s.dtype)["hdr"]
        hdr["flags"] |= wire.FLAG_CLOSE
        hdr["members"] = 0b0011
        name = np.zeros(mmsg.NAME_BYTES, np.uint8)
        name[:16] = mmsg.sockaddr_in(*PEERS[0])
        s._put(data, name, s.nbytes)
        block = (int(s.seqs[slot]) - s.seq0) & SEQ_MASK
        for accept in implementations:
            counts, state, acc, _, _ = s.run(accept)
            if closable:
                assert counts[0] == 1 and acc.tolist() == [slot] and state[7][0] == 0
                assert state[6][block] & wire.FLAG_CLOSE and state[8][block] == 0b0011 and state[9].tolist() == [3]
                assert counts[1] == 0  # no round trip sample: its wait measured the deadline
            else:  # never used: the exchange raises ClosedEarly
                assert counts[0] == 0 and counts[4] == 1 and state[7].tolist() == [2, EXCHANGE, slot]
                assert state[0][slot] == s.expect[slot]


def test_a_result_two_rounds_past_the_outstanding_one_marks_the_slot_superseded_when_closable():
    implementations = [reference.accept_results] + ([kernels.accept_results] if kernels else [])
    for ahead, closable, marked in ((1, 1, 0), (2, 1, 1), (9, 1, 1), (2, 0, 0), (0x8001, 1, 0)):
        s = Scenario(np.random.default_rng(8), count=0)
        s.closable = closable
        slot = int(np.flatnonzero(s.expect != -1)[0])
        data = s._datagram(np.random.default_rng(9), slot)
        hdr = data.view(s.dtype)["hdr"]
        hdr["round"] = (int(hdr["round"][0]) + ahead) & 0xFFFF
        name = np.zeros(mmsg.NAME_BYTES, np.uint8)
        name[:16] = mmsg.sockaddr_in(*PEERS[0])
        s._put(data, name, s.nbytes)
        for accept in implementations:
            counts, state, _, _, _ = s.run(accept)
            assert counts[0] == 0 and counts[4] == 1  # stale either way: never used
            assert state[10][slot] == marked and state[10].sum() == marked, (ahead, closable)


def test_two_copies_of_a_result_in_one_batch_count_once_and_once_as_stale():
    s = Scenario(np.random.default_rng(1), count=0)
    slot = int(np.flatnonzero(s.expect != -1)[0])
    data = s._datagram(np.random.default_rng(2), slot)
    name = np.zeros(mmsg.NAME_BYTES, np.uint8)
    name[:16] = mmsg.sockaddr_in(*PEERS[0])
    for _ in range(2):
        s._put(data, name, s.nbytes)
    implementations = [reference.accept_results] + ([kernels.accept_results] if kernels else [])
    for accept in implementations:
        counts, _, acc, _, _ = s.run(accept)
        assert counts[0] == 1 and counts[2:5] == (0, 0, 1) and acc.tolist() == [slot]


@needs_numba
@pytest.mark.parametrize("seed", range(300))
def test_accept_kernel_matches_the_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    used = int(rng.choice([1, 2, 16, 64]))
    s = Scenario(rng, used=used, num_blocks=int(rng.integers(used, 4 * used + 2)), count=int(rng.integers(0, 80)),
                 slot_base=int(rng.choice([0, 0, 64, 192])), k=wire.WIDE_K if seed % 2 else wire.K)
    _same(s.run(reference.accept_results), s.run(kernels.accept_results))


def _fill_case(rng: np.random.Generator, slots: int = 32, num_blocks: int = 200, k: int = wire.K):
    scales = 10.0 ** rng.integers(-44, 37, (num_blocks, 1))  # extreme exponents need two scale factors
    blocks = (rng.standard_normal((num_blocks, k)) * scales).astype(np.float32)
    blocks[rng.integers(0, num_blocks)] = 0
    local = qz.block_exponents(blocks)
    global_exp = local.copy()
    raised = rng.random(num_blocks) < 0.3  # another worker's larger exponent
    global_exp[raised] = np.minimum(local[raised].astype(np.int16) + rng.integers(1, 5, int(raised.sum())), 127)
    ahead = np.concatenate([local, np.full(slots, qz.EXP_NONE, np.int8)])
    n = int(rng.integers(1, slots + 1))
    chosen = rng.permutation(slots)[:n].astype(np.int64)
    block_ids = np.where(rng.random(n) < 0.25, -1, chosen + slots * rng.integers(0, num_blocks // slots, n))
    raw = np.zeros((slots, wire.netagg_bytes(k)), np.uint8)
    raw[:, 0] = wire.VERSION
    raw[:, layout.WIDTH_AT] = wire.width_code(k)
    raw[:, 1] = rng.integers(0, 4, slots)  # FLAG_RETRANSMIT left over in some rows
    state = dict(raw=raw, next_pool=rng.integers(0, 2, slots).astype(np.uint8),
                 rounds=rng.integers(0, 2**16, slots).astype(np.uint16), expect=np.full(slots, -1, np.int64),
                 sent_at=np.zeros(slots))
    args = dict(slots=chosen, block_ids=block_ids.astype(np.int64), blocks=blocks, local_exp=local,
                global_exp=global_exp.astype(np.int8), ahead=ahead, seq0=int(rng.integers(0, 2**31)),
                probe0=int(rng.integers(0, 2**31)), window=slots)
    return args, state, int(rng.integers(1, 33))


def _fill(fill, args: dict, state: dict, workers: int) -> tuple:
    st = {k: v.copy() for k, v in state.items()}
    keys = np.full(args["slots"].shape[0], -7, np.int64)
    enc_a, enc_b = qz.factor_tables(workers)[:2]
    result = fill(args["slots"], args["block_ids"], args["blocks"], args["local_exp"], args["global_exp"],
                  args["ahead"], args["seq0"], args["probe0"], args["window"], enc_a, enc_b, st["raw"],
                  st["raw"].view(np.uint32), st["next_pool"], st["rounds"], st["expect"], st["sent_at"], 1.25, keys)
    return int(result), [st[k] for k in sorted(st)], keys


@pytest.mark.parametrize("k", [wire.K, wire.WIDE_K], ids=["narrow", "wide"])
def test_numpy_fill_builds_what_the_wire_format_says(k):
    args, state, workers = _fill_case(np.random.default_rng(3), k=k)
    result, (expect, next_pool, raw, rounds, sent_at), keys = _fill(reference.fill_packets, args, state, workers)
    assert result == 0
    for i, (slot, block) in enumerate(zip(args["slots"].tolist(), args["block_ids"].tolist(), strict=True)):
        header, values = wire.unpack(raw[slot].tobytes())
        assert header.flags == 0 and header.pool == next_pool[slot] and header.round == rounds[slot]
        assert header.round == (int(state["rounds"][slot]) + 1) & 0xFFFF
        if block < 0:
            assert header.seq == PROBE_SEQ_BIT | (args["probe0"] + slot) & SEQ_MASK and not values.any()
            assert header.exponent == args["ahead"][slot]
        else:
            assert header.seq == (args["seq0"] + block) & SEQ_MASK
            assert header.exponent == args["ahead"][block + args["window"]]
            want = qz.quantize(args["blocks"][block:block + 1], args["global_exp"][block:block + 1], workers)
            np.testing.assert_array_equal(values, want[0])
        assert keys[i] == expect[slot] == header.round << 33 | header.pool << 32 | header.seq
        assert sent_at[slot] == 1.25


@needs_numba
@pytest.mark.parametrize("seed", range(100))
def test_fill_kernel_matches_the_numpy_reference(seed):
    args, state, workers = _fill_case(np.random.default_rng(seed), k=wire.WIDE_K if seed % 2 else wire.K)
    _same(_fill(reference.fill_packets, args, state, workers), _fill(kernels.fill_packets, args, state, workers))


def test_a_global_exponent_below_the_local_one_writes_nothing():
    args, state, workers = _fill_case(np.random.default_rng(4))
    data = np.flatnonzero(args["block_ids"] >= 0)
    assert data.size
    args["global_exp"][args["block_ids"][data[-1]]] = args["local_exp"][args["block_ids"][data[-1]]] - 1
    implementations = [reference.fill_packets] + ([kernels.fill_packets] if kernels else [])
    for fill in implementations:
        result, arrays, _ = _fill(fill, args, state, workers)
        assert result == -1
        for before, after in zip([state[k] for k in sorted(state)], arrays, strict=True):
            np.testing.assert_array_equal(before, after)


@pytest.fixture(params=["compiled+mmsg", "numpy+mmsg", "compiled+per-packet", "numpy+per-packet"])
def path(request, monkeypatch):
    """Every combination of batch processor (numba or numpy) and socket calls (batched or one per packet)."""
    processor, io = request.param.split("+")
    if processor == "compiled" and kernels is None:
        pytest.skip("numba is not installed")
    if processor == "numpy":
        monkeypatch.setattr(exchange, "kernels", None)
        monkeypatch.setattr(congestion, "kernels", None)
    if io == "per-packet":
        monkeypatch.setattr(mmsg, "AVAILABLE", False)
    elif not mmsg.AVAILABLE:
        pytest.skip("recvmmsg/sendmmsg are not available here")
    return request.param


def test_every_path_gives_bit_identical_results_under_loss_duplication_and_reordering(path):
    n = 3
    rng = np.random.default_rng(5)
    inputs = [(rng.standard_normal(3_000) * 10.0 ** rng.integers(-20, 20)).astype(np.float32) for _ in range(n)]
    with fallback_job(n, slot_count=16) as (_server, configs), \
            LossyRelay(_server.address, n, 0.1, 0.05, 0.05, seed=3) as relay:
        results = run_workers(through_relay(configs, relay),
                              lambda w, rank: (w.transport.batched, w.allreduce(inputs[rank]), w.transport.stats),
                              rto_initial=0.01)
    expected, _ = expected_allreduce(inputs)
    for batched, result, _ in results:
        assert batched == path.endswith("mmsg")
        np.testing.assert_array_equal(result, expected)
    stats = [s for _, _, s in results]
    assert sum(s.retransmissions for s in stats) > 0 and sum(s.stale_results for s in stats) > 0
    for s in stats:
        assert s.results_accepted == -(-3_000 // wire.K) + 16 and s.foreign == s.malformed == 0


def test_every_path_counts_strangers_and_junk_on_an_unconnected_socket(path):
    with fallback_job(1) as (server, _configs):
        ps_config = job_configs(1, "ps", Endpoint(*server.address), Endpoint("127.0.0.1", 9))[0]
        with Transport(ps_config) as transport, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
            result = wire.pack(wire.Header(job_id=1, slot=0, pool=0, rank=0, seq=PROBE_SEQ_BIT, round=1,
                                           flags=wire.FLAG_RESULT), np.zeros(wire.K, np.int32))
            for junk in (b"", b"x" * 10, b"\x01" * wire.NETAGG_BYTES, result):
                stranger.sendto(junk, transport.address)
            blocks = np.arange(2 * wire.K, dtype=np.float32).reshape(2, wire.K)
            sums, exponents, _ = transport.exchange(blocks)
            assert transport.stats.foreign == 4 and transport.stats.malformed == 0
            np.testing.assert_array_equal(qz.dequantize(sums, exponents, 1), blocks)


def test_every_path_counts_socket_errors_when_nobody_listens(path):
    port = free_ports(1)[0]  # nobody listens; outside the ephemeral range, so no socket is given it meanwhile
    config = job_configs(1, "allreduce", Endpoint("127.0.0.1", port), None, slot_count=4)[0]
    with Transport(config, progress_timeout=0.3, rto_initial=0.01) as transport:
        with pytest.raises(TransportTimeout):
            transport.exchange(np.ones((8, wire.K), np.float32))
        assert transport.stats.socket_errors > 0  # ICMP port unreachable, on a send or a receive
        assert transport.stats.retransmissions > 0


def test_every_path_resends_a_slots_previous_or_last_answered_packet_byte_for_byte(path):
    """The shadow resends (restart ride-through): a slot's previous packet while one is outstanding, else its
    last one; FLAG_RETRANSMIT set, every other byte as first sent; the same with either fill and either I/O."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sink:
        sink.bind(("127.0.0.1", 0))
        sink.settimeout(2.0)
        config = job_configs(2, "allreduce", Endpoint(*sink.getsockname()), None, slot_count=4)[0]
        with Transport(config) as t:
            rng = np.random.default_rng(8)
            blocks = rng.standard_normal((12, wire.K)).astype(np.float32)
            r = tr.Exchange(t, blocks, qz.block_exponents(blocks))
            r.global_exp[:] = r.local_exp

            def received(count: int) -> dict[int, bytes]:
                out = {}
                for _ in range(count):
                    data = sink.recv(2048)
                    out[wire.unpack(data)[0].slot] = data
                return out

            def answered(slot: int) -> None:  # as accept_results does for a matching result
                r.expect[slot] = -1
                t.rows.next_pool[slot] ^= 1

            def flagged(data: bytes) -> bytes:
                return data[:1] + bytes([data[1] | wire.FLAG_RETRANSMIT]) + data[2:]

            r.release([0, 1, 2, 3], [-1] * 4)
            probes = received(4)
            r._resend_answered(np.arange(4))  # one packet per slot so far: nothing to resend
            for slot in (0, 1):
                answered(slot)
            r.emit([0, 1], [0, 1])
            data = received(2)
            np.testing.assert_array_equal(t.rows.shadow[:2],
                                          np.frombuffer(probes[0] + probes[1], np.uint8).reshape(2, -1))
            r._resend_answered(np.arange(4))  # slots 0 and 1: their probes; 2 and 3 have no previous packet
            assert received(2) == {0: flagged(probes[0]), 1: flagged(probes[1])}
            answered(0)  # slot 0's block 0 is answered: its last packet is what another worker may lack
            r._resend_answered(np.array([0, 1, 2], np.int64))
            assert received(2) == {0: flagged(data[0]), 1: flagged(probes[1])}
            assert t.stats.shadow_resends == 4 and t.stats.packets_sent == 6 + 4 and t.stats.retransmissions == 0
            sink.settimeout(0.2)
            with pytest.raises(TimeoutError):
                sink.recv(2048)
