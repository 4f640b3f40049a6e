"""Wide packets (256 values, docs/protocol.md "Wide packets") end to end: the host stack through the software
switch, beside a narrow tenant, through the PS in fallback and ps modes, and over several threads per worker."""

from __future__ import annotations

import numpy as np
import pytest

from netagg import wire
from netagg.hoststack.server import KVServer
from netagg.jobconfig import Endpoint
from netagg.localports import free_ports
from netagg.testing.hoststack import block_scaled_inputs, expected_allreduce, fallback_job, run_workers

testing = pytest.importorskip("netagg.testing.softswitch")

N = 3
SIZE = 20_000
SLOTS = 8
WIDE = wire.WIDE_K


def _inputs(seed: int, n: int = N, size: int = SIZE) -> list[np.ndarray]:
    return block_scaled_inputs(n, size, seed, decades=20)


@pytest.mark.parametrize("loss", [0.0, 0.1])
def test_a_wide_job_sums_bit_identically_to_the_wide_reference_under_loss(loss):
    inputs = _inputs(1)
    expected, _ = expected_allreduce(inputs, k=WIDE)
    faults = {"drop": loss, "duplicate": loss / 2, "reorder": loss / 2, "seed": 9} if loss else {}
    with testing.LoopbackSwitch(**faults) as switch:
        configs = switch.add_job(N, slot_count=SLOTS, width=WIDE)
        results = run_workers(configs, lambda w, rank: [w.allreduce(inputs[rank]) for _ in range(2)],
                              rto_initial=0.01)
        counters = switch.counters(configs[0].job_id)
    for per_worker in results:
        for result in per_worker:
            np.testing.assert_array_equal(result, expected)
    blocks = -(-SIZE // WIDE)
    assert counters["results"] == 2 * (blocks + SLOTS)  # a quarter of a narrow job's rounds, each exactly once
    assert counters["contributions"] == N * counters["results"]
    if loss:
        assert counters["retransmit_results"] > 0


def test_a_wide_and_a_narrow_tenant_side_by_side_each_get_exactly_their_own_sums():
    wide_in, narrow_in = _inputs(2), _inputs(3, n=2)
    with testing.LoopbackSwitch(drop=0.05, duplicate=0.02, reorder=0.02, seed=4) as switch:
        narrow = switch.add_job(2, slot_count=SLOTS)
        wide = switch.add_job(N, slot_count=SLOTS, width=WIDE)  # its cells follow the narrow job's
        configs = narrow + wide
        inputs = narrow_in + wide_in
        results = run_workers(configs, lambda w, i: w.allreduce(inputs[i]), rto_initial=0.01)
    for result in results[:2]:
        np.testing.assert_array_equal(result, expected_allreduce(narrow_in)[0])
    for result in results[2:]:
        np.testing.assert_array_equal(result, expected_allreduce(wide_in, k=WIDE)[0])


def test_the_ps_in_fallback_mode_aggregates_a_wide_job_exactly():
    inputs = _inputs(5)
    with fallback_job(N, slot_count=SLOTS, width=WIDE) as (server, configs):
        results = run_workers(configs, lambda w, rank: w.allreduce(inputs[rank]), rto_initial=0.01)
        drops = dict(server.aggregator.stats.drops)
    for result in results:
        np.testing.assert_array_equal(result, expected_allreduce(inputs, k=WIDE)[0])
    assert not drops


def test_ps_mode_with_wide_packets_stores_every_block_even_when_the_switch_to_ps_copy_is_lost():
    inputs = _inputs(6)
    with testing.LoopbackSwitch(drop=0.1, seed=12) as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = switch.add_job(N, slot_count=SLOTS, mode="ps", ps=ps, width=WIDE)
        with KVServer(configs[0]) as server:
            def job(worker, rank):
                worker.wait(worker.push([3], [inputs[rank]]))
                return worker.wait(worker.pull([3]))[0]

            results = run_workers(configs, job, rto_initial=0.01)
            assert server.applied_rounds == 1 and server.stats.repaired_blocks > 0
    expected = expected_allreduce(inputs, k=WIDE)[0]
    for result in results:
        np.testing.assert_array_equal(result, expected)


def test_a_worker_over_two_threads_sends_wide_packets_in_each():
    inputs = _inputs(7, size=40_000)
    with testing.LoopbackSwitch() as switch:
        configs = [c.__class__(**{**vars(c), "threads": 2}) for c in switch.add_job(2, slot_count=128, width=WIDE)]
        results = run_workers(configs, lambda w, rank: w.allreduce(inputs[rank]), rto_initial=0.01)
    for result in results:
        np.testing.assert_array_equal(result, expected_allreduce(inputs[:2], k=WIDE)[0])
