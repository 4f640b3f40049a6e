"""The UDP transport end to end against the fallback-mode PS on loopback (no switch needed)."""

from __future__ import annotations

import contextlib
import socket
import time

import numpy as np
import pytest

from netagg import layout, wire
from netagg.hoststack import quantization as qz
from netagg.hoststack.kv import KVWorker
from netagg.hoststack.transport import Exchange, RtoEstimator, Transport, TransportError, TransportTimeout
from netagg.jobconfig import Endpoint
from netagg.testing.hoststack import (
    LossyRelay,
    block_scaled_inputs,
    expected_allreduce,
    fallback_job,
    job_configs,
    run_workers,
    through_relay,
)


def make_inputs(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    """Per rank: normal values at a few very different scales, so blocks have different exponents."""
    return block_scaled_inputs(n, size, seed, decades=30)


def check(results: list[np.ndarray], inputs: list[np.ndarray]) -> None:
    """Every worker got the same bits, exactly the oracle's, within the bound of the float64 sum."""
    expected, bound = expected_allreduce(inputs)
    for result in results:
        assert result.dtype == inputs[0].dtype and result.shape == inputs[0].shape
        np.testing.assert_array_equal(result, expected)
    truth = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    error = np.abs(results[0].astype(np.float64) - truth)
    assert np.all(error <= bound + np.abs(truth) * 2.0**-23 + 2.0**-149)


@pytest.mark.parametrize(("n", "size"), [(2, 1), (2, 65), pytest.param(2, 750_000, marks=pytest.mark.slow),
                                          (4, 20_000), (8, 3_000)])
def test_allreduce_through_the_fallback_ps(n, size):
    inputs = make_inputs(n, size, seed=n * size)
    with fallback_job(n, slot_count=32) as (server, configs):
        results = run_workers(configs, lambda w, rank: w.allreduce(inputs[rank]))
        blocks = -(-size // wire.K)
        assert server.aggregator.stats.results == blocks + min(blocks, 32)  # data blocks + probes
    check(results, inputs)


def test_consecutive_calls_of_different_sizes_keep_pools_and_seqs_in_step():
    n = 3
    calls = [make_inputs(n, size, seed=size) for size in (100, 5_000, 64, 1, 2_000)]
    with fallback_job(n, slot_count=8) as (_server, configs):
        results = run_workers(configs, lambda w, rank: [w.allreduce(c[rank]) for c in calls])
    for i, inputs in enumerate(calls):
        check([results[rank][i] for rank in range(n)], inputs)


@pytest.mark.parametrize(("drop", "duplicate", "reorder"),
                         [(0.05, 0.05, 0.05), pytest.param(0.2, 0.1, 0.1, marks=pytest.mark.slow)])
def test_loss_duplication_and_reordering_give_bit_identical_results(drop, duplicate, reorder):
    n = 3
    inputs = make_inputs(n, 6_000, seed=7)
    with fallback_job(n, slot_count=16) as (server, configs), \
            LossyRelay(server.address, n, drop, duplicate, reorder, seed=11) as relay:
        results = run_workers(through_relay(configs, relay),
                              lambda w, rank: (w.allreduce(inputs[rank]), w.transport.stats),
                              rto_initial=0.01)
        assert relay.up.stats.dropped and relay.down.stats.dropped and relay.down.stats.duplicated
        assert relay.up.stats.reordered and relay.down.stats.reordered
        assert server.aggregator.stats.retransmit_results > 0  # lost results were answered again
    check([r for r, _ in results], inputs)
    stats = [s for _, s in results]
    assert sum(s.retransmissions for s in stats) > 0
    assert sum(s.stale_results for s in stats) > 0  # duplicated results were ignored
    assert sum(s.window_decreases for s in stats) > 0  # losses shrank the congestion windows (differently)


def test_congestion_marked_results_shrink_the_window_and_sums_stay_exact():
    """ECN (docs/protocol.md, "Congestion marks"): a fifth of the results reach the workers CE-marked, as from a
    queue that marks instead of dropping. Each worker counts them and cuts its window (DCTCP: at most once per
    round trip, never undone), not a timeout; the sums are exact. Without marks nothing is counted or cut."""
    n = 3
    inputs = make_inputs(n, 40_000, seed=5)
    for mark in (0.0, 0.2):
        with fallback_job(n, slot_count=32) as (server, configs), \
                LossyRelay(server.address, n, seed=3, mark=mark) as relay:
            results = run_workers(through_relay(configs, relay),
                                  lambda w, rank: (w.allreduce(inputs[rank]), w.transport.stats,
                                                   w.transport.io.ecn))
        check([r for r, _, _ in results], inputs)
        stats = [s for _, s, _ in results]
        if not all(ecn for _, _, ecn in results) or not results[0][1].packets_sent:
            pytest.skip("no IP_TOS / IP_RECVTOS here")
        if mark == 0.0:
            assert relay.marked == 0
            assert all(s.ecn_marked == 0 and s.ecn_cuts == 0 for s in stats)
            continue
        assert relay.marked > 0 and sum(s.ecn_marked for s in stats) == relay.marked
        for s in stats:
            assert s.ecn_marked > 0 and s.ecn_cuts > 0 and s.smallest_window < 32
            assert s.ecn_cuts > s.window_decreases  # the marks cut it, not timeouts (a busy host may add one)


def test_a_dead_worker_makes_the_others_time_out():
    n = 3
    inputs = make_inputs(n, 1_000)
    with fallback_job(n) as (_, configs), pytest.raises(TransportTimeout, match="no result for"):
        run_workers(configs[:2], lambda w, rank: w.allreduce(inputs[rank]), progress_timeout=0.5)


def test_after_a_timeout_the_transport_refuses_to_continue():
    with fallback_job(2) as (_, configs), Transport(configs[0], progress_timeout=0.3) as transport:
        blocks = np.ones((3, wire.K), np.float32)
        with pytest.raises(TransportTimeout):
            transport.exchange(blocks)  # rank 1 never comes
        with pytest.raises(TransportError, match="earlier failure"):
            transport.exchange(blocks)


def test_nan_and_inf_are_sent_and_come_back_as_nan_and_inf():
    with fallback_job(1) as (_, configs), KVWorker(configs[0]) as worker:
        bad = np.ones(100, np.float32)
        bad[42] = np.nan
        worker.push(3, bad)
        pulled = worker.wait(worker.pull(3))[0]
        assert np.isnan(pulled[:wire.K]).all() and (pulled[wire.K:] == 1).all()
        assert (worker.allreduce(np.array([np.inf], np.float32)) == np.inf).all()
        np.testing.assert_array_equal(worker.allreduce(np.ones(3, np.float32)), 1)


def test_strangers_datagrams_are_counted_and_ignored():
    # A ps-mode transport listens to two peers (switch and PS), so its socket is unconnected and
    # sees whatever arrives; here the "switch" is a 1-worker fallback PS.
    with fallback_job(1) as (server, _configs):
        ps_config = job_configs(1, "ps", Endpoint(*server.address), Endpoint("127.0.0.1", 9))[0]
        with Transport(ps_config) as transport, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
            for junk in (b"", b"x" * 10, b"\x01" * wire.NETAGG_BYTES):
                stranger.sendto(junk, transport.address)
            blocks = np.arange(2 * wire.K, dtype=np.float32).reshape(2, wire.K)
            sums, exponents, _ = transport.exchange(blocks)
            assert transport.stats.foreign == 3 and transport.stats.malformed == 0
            np.testing.assert_array_equal(qz.dequantize(sums, exponents, 1), blocks)


def test_the_ps_ignores_malformed_datagrams_and_garbage_connections():
    n = 2
    with fallback_job(n) as (server, configs):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
            good = wire.pack(wire.Header(job_id=1, slot=0, pool=0, rank=0, seq=0), np.zeros(wire.K, np.int32))
            for junk in (b"short", b"\x07" + good[1:], good[:1] + b"\x01" + good[2:], good[:2] + b"\x00\x63" +
                         good[4:]):
                stranger.sendto(junk, server.address)
        with socket.create_connection(server.address, timeout=5) as garbage:
            garbage.sendall(b"\xff" * 64)
            with contextlib.suppress(ConnectionResetError):  # RST: the PS closed with our bytes unread
                assert garbage.recv(1) == b""  # the PS hangs up on a frame it cannot parse
        inputs = make_inputs(n, 500)
        results = run_workers(configs, lambda w, rank: w.allreduce(inputs[rank]))
        check(results, inputs)
        assert server.aggregator.stats.drops == {"MALFORMED": 1, "BAD_VERSION": 1, "RESULT_FROM_HOST": 1,
                                                  "UNKNOWN_JOB": 1}
        assert server.stats.bad_requests == 1


def test_the_ps_refuses_requests_without_the_job_secret_and_changes_nothing():
    from netagg.jobsecret import new_secret
    from netagg.psproto import PsClient, PsRefused

    secret = new_secret()
    with fallback_job(2, secret=secret) as (server, configs):
        hello = {"op": "hello", "job_id": 1, "rank": 0, "host": "127.0.0.1", "port": 9}
        for given in ("", "wrong-" + secret):
            client = PsClient(server.address, timeout=5, secret=given)
            with pytest.raises(PsRefused, match="wrong or missing job secret") as refused:
                client.request(hello)
            assert secret not in str(refused.value)
            client.close()
        assert server.stats.bad_secret == 2 and server.workers == {}  # nobody registered
        right = PsClient(server.address, timeout=5, secret=secret)
        assert right.request(hello)[0]["ok"] and server.workers[0] == ("127.0.0.1", 9)
        right.close()
        # With a secret, UDP contributions are admitted only from registered addresses (like the
        # switch's worker table): a stranger claiming rank 1 is dropped, not learnt as rank 1.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
            packet = wire.pack(wire.Header(job_id=1, slot=0, pool=0, rank=1, seq=0, round=1),
                               np.full(wire.K, 7, np.int32))
            stranger.sendto(packet, server.address)
            deadline = time.monotonic() + 5
            while not server.aggregator.stats.drops.get("UNKNOWN_WORKER") and time.monotonic() < deadline:
                time.sleep(0.01)
        assert server.aggregator.stats.drops.get("UNKNOWN_WORKER") == 1 and 1 not in server.aggregator.address_of
        inputs = make_inputs(2, 300)  # the workers register themselves (HELLO with the secret) and aggregate
        check(run_workers(configs, lambda w, rank: w.allreduce(inputs[rank])), inputs)


def test_rto_estimator_follows_rfc6298_with_clipping_clamping_and_capped_backoff():
    rto = RtoEstimator(initial=0.05, minimum=0.002, maximum=1.0, max_backoff=2)
    assert rto.rto == 0.05
    rto.sample(0.010)
    assert rto.srtt == 0.010 and rto.rttvar == 0.005 and rto.rto == pytest.approx(0.030)
    rto.sample(10.0)  # clipped to 2 x SRTT: one slow round cannot blow the timeout up
    assert rto.srtt == pytest.approx(0.01125) and rto.rto < 0.05
    for _ in range(200):
        rto.sample(0.0001)
    assert rto.rto == 0.002  # clamped to the minimum
    # Doubling twice, a plateau of two retries, then doubling again (a straggler or dead peer).
    assert [rto.backoff(k) for k in range(8)] == [0.002, 0.004, 0.008, 0.008, 0.008, 0.016, 0.032, 0.064]
    for _ in range(100):
        rto.sample(30.0)  # a real, lasting increase is followed (by up to 12.5 % per sample)
    assert rto.rto == 1.0  # clamped to the maximum
    assert RtoEstimator(initial=0.1, max_backoff=30).backoff(5) == 1.0
    assert RtoEstimator(initial=0.1).backoff(100) == 1.0


@contextlib.contextmanager
def lone_transport(slots: int = 8, **options):
    """A transport whose aggregator is a bare UDP socket that the test reads."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sink:
        sink.bind(("127.0.0.1", 0))
        sink.settimeout(1.0)
        config = job_configs(2, "allreduce", Endpoint(*sink.getsockname()), None, slot_count=slots)[0]
        with Transport(config, **options) as transport:
            yield transport, sink


def test_congestion_window_halves_once_per_round_trip_and_grows_back_to_the_slots():
    with lone_transport(8) as (t, _):
        assert t.window == 8
        t.rto.sample(0.010)
        t.on_timeout(100.0)
        t.on_timeout(100.005)  # the same loss event (within one smoothed round trip)
        assert t.window == 4 and t.stats.window_decreases == 1
        for step in range(1, 6):
            t.on_timeout(100.0 + 0.011 * step)
        assert t.window == 1 and t.stats.smallest_window == 1  # never below one packet
        t.on_results(1)
        assert t.window == 2
        t.on_results(2)  # one packet more per window of results
        assert t.window == 3
        t.on_results(1000)
        assert t.window == 8  # never above the job's slots
    with lone_transport(8, congestion_control=False) as (t, _):
        t.on_timeout(100.0)
        assert t.window == 8 and t.stats.window_decreases == 0


def test_a_burst_s_timer_waits_for_the_burst_to_leave_the_bottleneck():
    def newest(r: Exchange) -> tuple:
        return max(r.timers, key=lambda timer: timer[1])  # (a heap: the last armed has the largest id)

    with lone_transport(64) as (t, _):
        blocks = np.ones((256, wire.K), np.float32)
        round_ = Exchange(t, blocks, qz.block_exponents(blocks))
        round_.global_exp[:] = round_.local_exp
        before = time.monotonic()
        round_.release([0], [-1])  # no round trip measured yet: the plain timeout
        assert newest(round_)[0] - before == pytest.approx(t.rto.rto, abs=0.002)
        for _ in range(20):
            t.rto.sample(0.004)
        t.window = 33.0  # slot 0's probe and 32 more
        before = time.monotonic()
        round_.release(list(range(1, 33)), [-1] * 32)  # at once: 32 x 4 ms / 33 on the bottleneck
        deadline, _, slots, _ = newest(round_)
        assert slots.shape[0] == 32
        assert deadline - before == pytest.approx(t.rto.rto + 32 * 0.004 / 33, abs=0.001)
        t.window = 64.0
        round_.release([33], [-1])  # one packet: no drain beyond its own
        assert newest(round_)[0] - time.monotonic() == pytest.approx(t.rto.rto, abs=0.002)


@pytest.mark.parametrize("completer", [0, 1])
def test_a_resent_packet_s_result_is_judged_by_the_rank_that_completed_its_round(completer):
    with lone_transport(8) as (t, sink):  # this transport is rank 0 of 2
        blocks = np.ones((16, wire.K), np.float32)
        round_ = Exchange(t, blocks, qz.block_exponents(blocks))
        round_.release(list(range(8)), [-1] * 8)
        t.rto.sample(0.004)
        t.on_timeout(time.monotonic())  # slot 3's timer fired: the window is cut and the packet resent
        assert t.window == 4
        round_.resent_at[3] = time.monotonic() - 0.010  # long enough ago: not an answer to the original
        result = bytearray(sink.recv(2048))
        while wire.HEADER_STRUCT.unpack_from(result, 0)[3] != 3:
            result = bytearray(sink.recv(2048))
        result[layout.FLAGS_AT] |= wire.FLAG_RESULT
        result[layout.RANK_AT] = completer
        other = bytearray(result)
        other[layout.ROUND_AT:layout.ROUND_AT + 2] = (0x7777).to_bytes(2, "big")  # another round's: not this one
        other[layout.RANK_AT] = 1 - completer
        buf = np.zeros((2, 2048), np.uint8)
        for row, data in enumerate((other, result)):
            buf[row, :len(data)] = np.frombuffer(bytes(data), np.uint8)
        round_._judge_resends(np.array([3, 4]), np.array([round_.resent_at[3], 0.0]), buf, 2)
        if completer == 1:  # the round waited for rank 1: this worker's path lost nothing
            assert t.stats.peer_timeouts == 1 and t.window == 8 and t.stats.window_undos == 1
        else:  # this worker's resend completed it: its packet was lost, the cut stands
            assert t.stats.peer_timeouts == 0 and t.window == 4 and t.stats.window_undos == 0


def test_a_full_window_holds_packets_back_lowest_block_first_but_never_the_head_of_the_line():
    with lone_transport(8) as (t, sink):
        blocks = np.ones((32, wire.K), np.float32)
        round_ = Exchange(t, blocks, qz.block_exponents(blocks))
        round_.global_exp[:] = round_.local_exp
        t.window = 2.0
        round_.release(list(range(8)), [-1] * 8)  # the first window's probes
        assert sorted(round_.in_flight) == [0, 1] and len(round_.waiting) == 6
        seqs = [wire.HEADER_STRUCT.unpack_from(sink.recv(2048), 0)[wire.FIELD_INDEX["seq"]] for _ in range(2)]
        assert all(seq & (1 << 31) for seq in seqs)  # probes
        # Slot 1's result: its next block (9) is ready but waits behind slot 2's probe (lower).
        del round_.in_flight[1]
        round_.release([1], [9])
        assert round_.in_flight == {0: -8, 2: -6} and (9, 1) in round_.waiting
        header = wire.HEADER_STRUCT.unpack_from(sink.recv(2048), 0)
        assert header[3] == 2 and header[wire.FIELD_INDEX["seq"]] & (1 << 31)  # slot 2's probe went out
        # After a decrease the window (1) is full of blocks above a newly ready, lower block:
        # the lower one is sent anyway (else every worker could wait for another), the next is not.
        round_.waiting.clear()
        round_.in_flight = {3: 11}
        t.window = 1.0
        round_.release([1], [9])
        assert round_.in_flight == {3: 11, 1: 9}
        seq = wire.HEADER_STRUCT.unpack_from(sink.recv(2048), 0)[wire.FIELD_INDEX["seq"]]
        assert seq == (round_.seq0 + 9) & 0x7FFFFFFF
        round_.release([2], [10])
        assert 2 not in round_.in_flight and round_.waiting == [(10, 2)]
