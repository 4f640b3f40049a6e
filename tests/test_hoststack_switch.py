"""The host stack through the software switch (allreduce and ps modes), with seeded faults."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from netagg import wire
from netagg.hoststack.server import SGD, KVServer
from netagg.hoststack.transport import SubsetRound, TransportError, subset_round_uses
from netagg.jobconfig import Endpoint
from netagg.localports import free_ports
from netagg.testing.hoststack import block_scaled_inputs, expected_allreduce, run_workers

testing = pytest.importorskip("netagg.testing.softswitch")

N = 4
SIZE = 6_000
SLOTS = 16


def make_inputs(n: int = N, size: int = SIZE, seed: int = 3) -> list[np.ndarray]:
    return block_scaled_inputs(n, size, seed, decades=20)


@pytest.mark.parametrize("loss", [0.0, 0.01, 0.05, pytest.param(0.2, marks=pytest.mark.slow)])
def test_allreduce_is_bit_identical_under_loss_duplication_and_reordering(loss):
    inputs = make_inputs()
    expected, _ = expected_allreduce(inputs)
    faults = {"drop": loss, "duplicate": loss / 2, "reorder": loss / 2, "seed": 5} if loss else {}
    with testing.LoopbackSwitch(**faults) as switch:
        configs = switch.add_job(N, slot_count=SLOTS)
        results = run_workers(configs, lambda w, rank: w.allreduce(inputs[rank]), rto_initial=0.01)
        counters = switch.counters(configs[0].job_id)
        fault_stats = switch.fault_stats
    for result in results:
        np.testing.assert_array_equal(result, expected)
    blocks = -(-SIZE // wire.K)
    assert counters["results"] == blocks + SLOTS  # each round completed exactly once (probes included)
    if loss:
        assert fault_stats["dropped"] and fault_stats["duplicated"] and fault_stats["reordered"]
        assert counters["retransmit_results"] > 0


@pytest.mark.slow
def test_allreduce_is_bit_identical_when_whole_gso_sends_are_lost():
    """A lost UDP GSO packet loses up to 64 consecutive datagrams at once: every block still arrives exactly once."""
    inputs = make_inputs(size=40_000)
    expected, _ = expected_allreduce(inputs)
    slots = 64
    with testing.LoopbackSwitch(burst=0.004, burst_length=64, seed=11) as switch:
        configs = switch.add_job(N, slot_count=slots)
        results = run_workers(configs, lambda w, rank: [w.allreduce(inputs[rank]) for _ in range(2)],
                              rto_initial=0.01)
        counters = switch.counters(configs[0].job_id)
        fault_stats = switch.fault_stats
    for per_worker in results:
        for result in per_worker:
            np.testing.assert_array_equal(result, expected)
    blocks = -(-inputs[0].size // wire.K)
    assert counters["results"] == 2 * (blocks + slots)  # every round completed exactly once (probes included)
    # Bursts took many consecutive packets each (a burst ends early when packets stop arriving back to back).
    assert fault_stats["bursts"] >= 2 and fault_stats["dropped"] >= 4 * fault_stats["bursts"]
    assert counters["retransmit_results"] > 0


@pytest.mark.parametrize("loss", [0.0, pytest.param(0.2, marks=pytest.mark.slow)])
def test_ps_mode_sum_store_gets_every_block_even_when_the_switch_to_ps_copy_is_lost(loss):
    inputs = make_inputs(size=4_000)
    second = [x * 2 for x in make_inputs(size=70, seed=9)]
    expected, _ = expected_allreduce(inputs)
    expected_second, _ = expected_allreduce(second)
    faults = {"drop": loss, "duplicate": loss / 2, "reorder": loss / 2, "seed": 8} if loss else {}
    with testing.LoopbackSwitch(**faults) as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = switch.add_job(N, slot_count=SLOTS, mode="ps", ps=ps)
        with KVServer(configs[0]) as server:
            def job(worker, rank):
                worker.wait(worker.push([1, 2], [inputs[rank], second[rank]]))
                return worker.wait(worker.pull([1, 2])), worker.wait(worker.pushpull(2, second[rank]))

            results = run_workers(configs, job, rto_initial=0.01)
            assert server.applied_rounds == 2
            if loss:
                assert server.stats.repaired_blocks > 0
    for (pulled, pushpulled) in results:
        np.testing.assert_array_equal(pulled[0], expected)
        np.testing.assert_array_equal(pulled[1], expected_second)
        np.testing.assert_array_equal(pushpulled[0], expected_second)


def test_ps_mode_sgd_handle_updates_the_weights():
    lr = 0.5
    weights = np.linspace(-1, 1, 100).astype(np.float32)
    grads = make_inputs(size=100, seed=4)
    aggregate, _ = expected_allreduce(grads)
    with testing.LoopbackSwitch() as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = switch.add_job(N, slot_count=SLOTS, mode="ps", ps=ps)
        with KVServer(configs[0], SGD(lr)):
            def job(worker, rank):
                if rank == 0:
                    worker.wait(worker.init(7, weights))
                for _ in range(2):
                    updated = worker.wait(worker.pushpull(7, grads[rank]))[0]
                return updated

            results = run_workers(configs, job)
    want = weights.copy()
    for _ in range(2):
        want -= np.float32(lr / N) * aggregate
    for updated in results:
        np.testing.assert_array_equal(updated, want)


def test_two_tenant_jobs_running_at_once_under_loss_each_get_exactly_their_own_sums():
    import threading

    shapes = {"a": (4, 6_000, 11), "b": (3, 2_500, 12)}  # workers, values, seed
    inputs = {name: make_inputs(n, size, seed) for name, (n, size, seed) in shapes.items()}
    results: dict[str, list] = {}
    errors: list[BaseException] = []
    with testing.LoopbackSwitch(drop=0.05, duplicate=0.02, reorder=0.02, seed=21) as switch:
        configs = {name: switch.add_job(n, slot_count=SLOTS) for name, (n, _, _) in shapes.items()}

        def tenant(name: str) -> None:
            try:
                results[name] = run_workers(configs[name], lambda w, rank: [w.allreduce(inputs[name][rank])
                                                                           for _ in range(2)], rto_initial=0.01)
            except BaseException as err:  # reported below, in the test's thread
                errors.append(err)

        threads = [threading.Thread(target=tenant, args=(name,)) for name in shapes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        counters = {name: switch.counters(cfg[0].job_id) for name, cfg in configs.items()}
    for name, (_, size, _) in shapes.items():
        expected, _ = expected_allreduce(inputs[name])
        for per_rank in results[name]:
            for result in per_rank:
                np.testing.assert_array_equal(result, expected)
        # Each job's rounds completed exactly once, counted for that job alone.
        assert counters[name]["results"] == 2 * (-(-size // wire.K) + SLOTS)


def test_forged_results_injected_during_an_allreduce_under_loss_leave_the_sums_exact():
    """Forgeries that slipped past the switch (sent from the aggregator's own address and port) name the
    right job, slot, pool and block id of every outstanding packet, but not its round: none completes a block."""
    import threading

    from netagg.hoststack.packets import PACKET_DTYPE

    inputs = make_inputs(n=3, size=6_000, seed=13)
    expected, _ = expected_allreduce(inputs)
    blocks = -(-6_000 // wire.K)
    with testing.LoopbackSwitch(drop=0.05, duplicate=0.02, reorder=0.02, seed=17) as switch:
        configs = switch.add_job(3, slot_count=SLOTS)
        # Every block id of the call in its slot, both pools, rounds the job never reaches, values 12345.
        forged = np.zeros(2 * blocks, PACKET_DTYPE)
        hdr = forged["hdr"]
        hdr["version"], hdr["flags"], hdr["job_id"] = wire.VERSION, wire.FLAG_RESULT, configs[0].job_id
        ids = np.arange(2 * blocks) // 2
        hdr["seq"], hdr["slot"], hdr["pool"] = ids, ids % SLOTS, np.arange(2 * blocks) % 2
        hdr["round"] = 40_000 + ids // SLOTS
        forged["values"] = 12345
        datagrams = [bytes(row) for row in forged.view(np.uint8).reshape(len(forged), -1)]
        sock = switch.target.loopback.sock  # the aggregator's address and port, as a spoofer would forge them
        done = threading.Event()
        sent = [0]

        def forger() -> None:
            while not done.is_set():
                for config in configs:
                    for datagram in datagrams:
                        with contextlib.suppress(OSError):
                            sock.sendto(datagram, (config.bind.host, config.bind.port))
                            sent[0] += 1
                time.sleep(0.001)

        thread = threading.Thread(target=forger, daemon=True)
        thread.start()
        try:
            results = run_workers(configs, lambda w, rank: (w.allreduce(inputs[rank]), w.transport.stats),
                                  rto_initial=0.01)
        finally:
            done.set()
            thread.join(5)
    assert sent[0] > 0
    for result, _ in results:
        np.testing.assert_array_equal(result, expected)
    assert all(stats.stale_results > 0 for _, stats in results)  # forgeries counted as they were dropped


@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_workers_waiting_for_a_straggler_resend_only_their_head_packet(loss):
    """While one worker is late, the others' timeouts see no result: they resend one packet, not the window."""
    inputs = make_inputs(n=3, size=SLOTS * wire.K * 4)
    expected, _ = expected_allreduce(inputs)
    faults = {"drop": loss, "seed": 21} if loss else {}
    with testing.LoopbackSwitch(**faults) as switch:
        configs = switch.add_job(3, slot_count=SLOTS)

        def job(worker, rank):
            if rank == 2:
                time.sleep(0.4)  # about 100 timeouts of the others' 2 ms minimum (backoff stretches them)
            result = worker.allreduce(inputs[rank])
            return result, worker.transport.stats

        results = run_workers(configs, job, rto_initial=0.002, rto_min=0.002)
    for result, _ in results:
        np.testing.assert_array_equal(result, expected)
    for _, stats in results[:2]:
        assert stats.stalled_timeouts >= 3
        # Resending the window at each of those timeouts would be >= 3 * SLOTS packets.
        assert stats.retransmissions < SLOTS + stats.stalled_timeouts, stats
        if not loss:
            # Waiting is not congestion: the ~100 stalled timeouts did not shrink the window (halving at each,
            # at most once per round trip, would take it to 1). One ordinary timeout after the straggler
            # arrived may still halve it once on a busy machine.
            assert stats.smallest_window >= SLOTS / 2, stats


@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_subset_rounds_sum_their_members_only_exactly_once_under_loss(loss):
    inputs = make_inputs(size=3_000)
    faults = {"drop": loss, "duplicate": loss / 2, "reorder": loss / 2, "seed": 11} if loss else {}
    exchanges = [wire.members_of([0, 2, 3]), wire.members_of([1, 2]), wire.members_of([3]),
                 wire.members_of(range(N))]
    blocks = -(-3_000 // wire.K)
    with testing.LoopbackSwitch(**faults) as switch:
        configs = switch.add_job(N, slot_count=SLOTS)
        barrier = threading.Barrier(N)

        def job(worker, rank):
            out, base = [], 0
            for members in exchanges:  # as a scheduler hands them out: one at a time, bases past the last round
                barrier.wait(60)
                if members >> rank & 1:
                    out.append(worker.allreduce_subset(inputs[rank] * (base + 1), SubsetRound(members, base)))
                base += subset_round_uses(blocks, SLOTS)
            with pytest.raises(TransportError, match="subset rounds"):
                worker.allreduce(inputs[rank])
            return out

        results = run_workers(configs, job, rto_initial=0.01)
        counters = switch.counters(configs[0].job_id)
    base = 0
    taken = [0] * N
    for members in exchanges:
        ranks = [r for r in range(N) if members >> r & 1]
        # Quantized with the job's N (as the transport does): the sum of the members' inputs alone.
        absent = [np.zeros_like(inputs[0])] * (N - len(ranks))
        expected, _ = expected_allreduce([inputs[r] * (base + 1) for r in ranks] + absent)
        for r in ranks:
            np.testing.assert_array_equal(results[r][taken[r]], expected)
            taken[r] += 1
        base += subset_round_uses(blocks, SLOTS)
    assert counters["results"] == len(exchanges) * (blocks + SLOTS)  # every round completed exactly once
    assert counters["rejects"] == 0
