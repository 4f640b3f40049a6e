"""Libra sparse tables: frequency sampling, hot-set choice, the PS's table state and whole jobs through the switch."""

from __future__ import annotations

import numpy as np
import pytest

from netagg import wire
from netagg.hoststack.hotset import FrequencySampler, choose_hot_set, merge_reports
from netagg.hoststack.server import KVServer
from netagg.hoststack.sparse_store import StaleHotSet, TableSpec, TableState, pack_arrays
from netagg.jobconfig import Endpoint
from netagg.localports import free_ports
from netagg.psproto import PsClient, PsRefused
from netagg.testing.hoststack import expected_allreduce, run_workers

testing = pytest.importorskip("netagg.testing.softswitch")

N = 3
ROWS = 20_000
WIDTH = 8
SLOTS = 8  # capacity: 8 slots * 64 values / 8 = 64 hot rows per round of slot use


def zipf_keys(rank: int, iteration: int, shift: int = 0, lookups: int = 300) -> np.ndarray:
    """The sorted unique rows one worker touches: Zipf(1.2) ranks, rank r is row (r + shift) mod ROWS."""
    rng = np.random.default_rng(1000 * iteration + rank)
    return np.unique((rng.zipf(1.2, lookups) - 1 + shift) % ROWS)


def grad_rows(rank: int, iteration: int, count: int) -> np.ndarray:
    return np.random.default_rng(7 * iteration + rank + 99).standard_normal((count, WIDTH)).astype(np.float32)


# -- frequency sampling and the hot-set choice -------------------------------------------
def test_sampler_decays_counts_and_keeps_only_the_largest():
    sampler = FrequencySampler(decay=0.5, sample_rate=1.0, max_tracked=3)
    sampler.observe(np.array([1, 2, 3, 4]))
    sampler.observe(np.array([2, 3, 4]))
    sampler.observe(np.array([4]))
    keys, counts = sampler.report(10)
    # 1st: all four at 1, a tie: the smaller keys stay (4 is dropped). 2nd: 1 at 0.5, 2 and 3 at 1.5, 4 at 1:
    # 1 is dropped. 3rd: 2 and 3 decay to 0.75, 4 to 0.5 + 1. Reported as touches per iteration: * (1 - decay).
    np.testing.assert_array_equal(keys, [2, 3, 4])
    np.testing.assert_allclose(counts, [0.375, 0.375, 0.75])
    top_keys, _ = sampler.report(1)
    np.testing.assert_array_equal(top_keys, [4])


def test_sampler_estimates_frequencies_from_a_sample():
    sampler = FrequencySampler(decay=0.9, sample_rate=0.25, seed=3)
    for _ in range(200):
        sampler.observe(np.arange(100))  # every key touched every iteration
    _, counts = sampler.report(100)
    assert abs(counts.mean() - 1.0) < 0.1  # touched once per iteration, estimated from a quarter of the touches


def test_merge_adds_reports_and_choice_needs_a_gain():
    merged_keys, merged_counts = merge_reports([(np.array([1, 5, 9]), np.array([1.0, 2.0, 3.0], np.float32)),
                                                (np.array([5, 7]), np.array([4.0, 0.5], np.float32))])
    np.testing.assert_array_equal(merged_keys, [1, 5, 7, 9])
    np.testing.assert_allclose(merged_counts, [1.0, 6.0, 0.5, 3.0])
    chosen = choose_hot_set(merged_keys, merged_counts, 2, np.empty(0, np.int64), 0.05)
    np.testing.assert_array_equal(chosen, [5, 9])
    assert choose_hot_set(merged_keys, merged_counts, 2, chosen, 0.05) is None  # the same set: no new version
    # {5, 1} holds 7 of the 9 the best set holds: 9 > 1.05 * 7, a new version; with a 50 % gain asked, none
    np.testing.assert_array_equal(choose_hot_set(merged_keys, merged_counts, 2, np.array([1, 5]), 0.05), [5, 9])
    assert choose_hot_set(merged_keys, merged_counts, 2, np.array([1, 5]), 0.5) is None
    # rows touched by fewer than min_touches workers per iteration stay cold, however large the capacity
    np.testing.assert_array_equal(choose_hot_set(merged_keys, merged_counts, 4, np.empty(0, np.int64), 0.05, 2.0),
                                  [5, 9])
    assert choose_hot_set(merged_keys, merged_counts, 4, np.empty(0, np.int64), 0.05, 7.0) is None
    # ties go to the smaller key, so every run chooses the same set
    np.testing.assert_array_equal(choose_hot_set(np.array([3, 4, 8]), np.ones(3), 2, np.empty(0, np.int64), 0), [3, 4])


# -- the PS's state of one table ------------------------------------------------------------
def _state(placement: str = "libra", capacity: int = 2, report_every: int = 1) -> TableState:
    return TableState(TableSpec(0, 100, 2, placement, capacity, report_every, 0.0), num_workers=2)


def _rows(*values: float) -> np.ndarray:
    return np.array([[v, -v] for v in values], np.float32)


def test_state_sums_pushed_rows_and_answers_pulls():
    state = _state("ps", capacity=0)
    state.push(0, 0, 0, np.array([1, 5]), _rows(1.0, 2.0))
    with pytest.raises(ValueError, match="not complete"):
        state.pull(0, None, timeout=0.01)
    state.push(1, 0, 0, np.array([5, 7]), _rows(10.0, 20.0))
    keys, rows = state.pull(0, None, timeout=1)
    np.testing.assert_array_equal(keys, [1, 5, 7])
    np.testing.assert_array_equal(rows, _rows(1.0, 12.0, 20.0))
    _, asked = state.pull(0, np.array([0, 7]), timeout=1)
    np.testing.assert_array_equal(asked, _rows(0.0, 20.0))
    assert state.hot_set.version == 0  # placement ps never has a hot set


def test_state_refuses_stale_versions_hot_rows_and_pushes_out_of_order():
    state = _state()
    report = (np.array([3, 4]), np.array([5.0, 5.0], np.float32))
    state.push(0, 0, 0, np.array([3]), _rows(1.0), report)
    with pytest.raises(ValueError, match="pushed iteration 1, expected 0"):
        state.push(1, 1, 0, np.array([3]), _rows(1.0))
    with pytest.raises(ValueError, match="before iteration 0 completed"):
        state.push(0, 1, 0, np.array([3]), _rows(1.0))
    state.push(1, 0, 0, np.array([4]), _rows(1.0), report)
    hot = state.sync(1, timeout=1)
    assert (hot.version, hot.effective, hot.keys.tolist()) == (1, 1, [3, 4])
    with pytest.raises(StaleHotSet, match="stale hot set: rank 0 pushed iteration 1 with hot-set version 0"):
        state.push(0, 1, 0, np.array([9]), _rows(1.0))
    with pytest.raises(ValueError, match=r"hot row\(s\) \[4\]"):
        state.push(0, 1, 1, np.array([4, 9]), _rows(1.0, 2.0))
    with pytest.raises(ValueError, match="sorted and unique"):
        state.push(0, 1, 1, np.array([9, 8]), _rows(1.0, 2.0))
    with pytest.raises(ValueError, match=r"in 0\.\.99"):
        state.push(0, 1, 1, np.array([100]), _rows(1.0))
    assert state.stats.refused == 4  # the malformed push is refused before it reaches the state
    state.push(0, 1, 1, np.array([9]), _rows(1.0))  # still accepted after the refusals
    assert state.hot_set_at(0).version == 0 and state.hot_set_at(1).version == 1


# -- whole jobs through the software switch -------------------------------------------------
def _exact(iteration: int, shift: int = 0) -> dict[int, np.ndarray]:
    total: dict[int, np.ndarray] = {}
    for rank in range(N):
        keys = zipf_keys(rank, iteration, shift)
        for key, row in zip(keys.tolist(), grad_rows(rank, iteration, keys.size), strict=True):
            total[key] = total[key] + row if key in total else row.copy()  # float32, rank order like the PS
    return total


def _run_job(placement: str, iterations: int, loss: float = 0.0, shift_at: int | None = None, **table_options):
    faults = {"drop": loss, "duplicate": loss / 2, "reorder": loss / 2, "seed": 11} if loss else {}
    with testing.LoopbackSwitch(**faults) as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = switch.add_job(N, slot_count=SLOTS, ps=ps)
        with KVServer(configs[0]) as server:
            def job(worker, rank):
                table = worker.sparse_table(0, ROWS, WIDTH, placement=placement, **table_options)
                pulled, hot_sets = [], []
                for it in range(iterations):
                    shift = 5_000 if shift_at is not None and it >= shift_at else 0
                    keys = zipf_keys(rank, it, shift)
                    hot_sets.append(table.hot)
                    pulled.append(worker.wait(table.pushpull(keys, grad_rows(rank, it, keys.size))))
                return pulled, hot_sets, table.stats
            results = run_workers(configs, job, rto_initial=0.01)
            state = server.tables.get(0)
        assert not loss or switch.fault_stats["dropped"] > 0
        return results, state.stats if state else None


def _check_iteration(results, iteration: int, shift: int = 0) -> None:
    """Every worker got the same rows: every touched row once, cold rows exact, hot rows as the switch sums them."""
    keys, rows = results[0][0][iteration]
    for other in results[1:]:
        np.testing.assert_array_equal(other[0][iteration][0], keys)
        np.testing.assert_array_equal(other[0][iteration][1], rows)
    hot = results[0][1][iteration].keys
    hot_keys = set(hot.tolist())
    exact = _exact(iteration, shift)
    assert set(exact) <= set(keys.tolist())
    assert np.all(np.diff(keys) > 0)
    got = dict(zip(keys.tolist(), rows, strict=True))
    for key in set(keys.tolist()) - set(exact):
        assert key in hot_keys and not got[key].any()  # untouched hot rows are zeros
    cold = [k for k in exact if k not in hot_keys]
    for key in cold:
        np.testing.assert_array_equal(got[key], exact[key])
    if hot.size:  # the hot rows: what the switch's quantized sum of the dense blocks gives, bit for bit
        dense = []
        for rank in range(N):
            mine = np.zeros((hot.size, WIDTH), np.float32)
            touched = zipf_keys(rank, iteration, shift)
            inside = np.isin(touched, hot)
            mine[np.searchsorted(hot, touched[inside])] = grad_rows(rank, iteration, touched.size)[inside]
            dense.append(mine.reshape(-1))
        want, _ = expected_allreduce(dense)
        np.testing.assert_array_equal(np.array([got[k] for k in hot.tolist()]).reshape(-1), want)


@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_libra_job_sums_every_row_once_across_hot_set_changes(loss):
    iterations = 16
    results, stats = _run_job("libra", iterations, loss, report_every=2, min_gain=0.0)
    versions = [h.version for h in results[0][1]]
    assert versions[0] == 0 and versions[-1] >= 3, versions  # the hot set changed several times mid-run
    for rank_result in results[1:]:
        assert [h.version for h in rank_result[1]] == versions  # same version, same iteration, on every worker
    for iteration in range(iterations):
        _check_iteration(results, iteration)
    hot_rows, cold_rows = results[0][2]["hot_rows"], results[0][2]["cold_rows"]
    assert hot_rows > 0 and cold_rows > 0
    assert stats.refused == 0 and stats.iterations == iterations


@pytest.mark.parametrize("placement", ["ps", "switch"])
def test_all_ps_and_dense_switch_placements_give_the_same_sums(placement):
    results, stats = _run_job(placement, 3)
    for iteration in range(3):
        _check_iteration(results, iteration)
    hot_rows, cold_rows = results[0][2]["hot_rows"], results[0][2]["cold_rows"]
    if placement == "ps":
        assert hot_rows == 0 and cold_rows > 0 and stats.iterations == 3
    else:
        assert cold_rows == 0 and stats is None  # no PS involved


def test_hot_set_follows_a_drifting_distribution():
    """Shift the Zipf ranking mid-training: the hot set's coverage collapses, then recovers."""
    iterations, shift_at = 40, 20
    results, _ = _run_job("libra", iterations, shift_at=shift_at, report_every=2, min_gain=0.05,
                              decay=0.7, sample_rate=0.5)

    def coverage(iteration: int) -> float:
        hot = results[0][1][iteration].keys
        keys = zipf_keys(0, iteration, 5_000 if iteration >= shift_at else 0, lookups=300)
        return float(np.isin(keys, hot).mean())

    before = np.mean([coverage(i) for i in range(shift_at - 6, shift_at)])
    at_shift = coverage(shift_at)
    after = np.mean([coverage(i) for i in range(iterations - 6, iterations)])
    assert before > 0.15 and after > 0.15, (before, after)  # 64 hot rows of a 20,000-row table
    assert at_shift < 0.5 * before, (at_shift, before)
    assert results[0][1][-1].version > results[0][1][shift_at].version
    for iteration in (shift_at - 1, shift_at, iterations - 1):
        _check_iteration(results, iteration, 5_000 if iteration >= shift_at else 0)


def test_a_worker_on_an_old_hot_set_is_refused_not_mis_summed():
    with testing.LoopbackSwitch() as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = switch.add_job(N, slot_count=SLOTS, ps=ps)
        with KVServer(configs[0]) as server:
            def job(worker, rank):
                table = worker.sparse_table(0, ROWS, WIDTH, report_every=1, min_gain=0.0)
                keys = zipf_keys(rank, 0)
                worker.wait(table.pushpull(keys, grad_rows(rank, 0, keys.size)))
                assert table.hot.version == 1
                if rank == 0:  # pretend this worker missed the switch-over
                    table.hot = results_old_hot
                    with pytest.raises(PsRefused, match="stale hot set"):
                        worker.wait(table.pushpull(keys, grad_rows(rank, 1, keys.size)))
                return table.hot.version

            from netagg.hoststack.hotset import HotSet
            results_old_hot = HotSet.empty()
            assert run_workers(configs, job, rto_initial=0.01) == [0, 1, 1]
            assert server.tables[0].stats.refused == 1


def test_a_worker_that_skips_pulls_syncs_the_hot_set_before_pushing():
    with testing.LoopbackSwitch() as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = switch.add_job(N, slot_count=SLOTS, ps=ps)
        with KVServer(configs[0]):
            def job(worker, rank):
                table = worker.sparse_table(0, ROWS, WIDTH, report_every=1, min_gain=0.0)
                for it in range(4):
                    keys = zipf_keys(rank, it)
                    worker.wait(table.push(keys, grad_rows(rank, it, keys.size)))
                return table.stats["syncs"], table.hot.version, worker.wait(table.pull())

            results = run_workers(configs, job, rto_initial=0.01)
    assert all(syncs == 3 and version >= 2 for syncs, version, _ in results)
    np.testing.assert_array_equal(results[1][2][1], results[0][2][1])


def test_bad_sparse_requests_get_errors_and_the_ps_keeps_serving():
    with testing.LoopbackSwitch() as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = switch.add_job(2, slot_count=SLOTS, ps=ps)
        with KVServer(configs[0]) as server:
            client = PsClient(server.address, timeout=5)
            base = {"job_id": configs[0].job_id, "table": 3}
            spec = {**base, "op": "sparse_open", "num_rows": 10, "width": 2, "placement": "ps", "capacity": 0,
                    "report_every": 1, "min_gain": 0.0}
            with pytest.raises(PsRefused, match="was not opened"):
                client.request({**base, "op": "sparse_pull", "iteration": 0, "count": -1, "version": 0})
            client.request(spec)
            with pytest.raises(PsRefused, match="is open as"):
                client.request({**spec, "width": 3})
            with pytest.raises(PsRefused, match="placement"):
                client.request({**spec, "table": 4, "placement": "dense"})
            push = {**base, "op": "sparse_push", "rank": 0, "iteration": 0, "version": 0, "count": 2}
            with pytest.raises(PsRefused, match="does not hold"):
                client.request(push, pack_arrays(np.array([1, 2], "<i8")))  # rows missing
            with pytest.raises(PsRefused, match="NaN"):
                client.request(push, pack_arrays(np.array([1, 2], "<i8"), np.full((2, 2), np.nan, "<f4")))
            with pytest.raises(PsRefused, match="rank 5"):
                client.request({**push, "rank": 5}, pack_arrays(np.array([1, 2], "<i8"), np.ones((2, 2), "<f4")))
            with pytest.raises(PsRefused, match="not complete"):
                client.request({**base, "op": "sparse_pull", "iteration": 0, "count": -1, "version": 0,
                                "timeout": 0.05})
            with pytest.raises(PsRefused, match="frequency report of 5000 keys"):
                client.request({**push, "report_count": 5000}, b"")
            with pytest.raises(PsRefused, match="KeyError"):
                client.request({**base, "op": "sparse_push"})
            client.request(push, pack_arrays(np.array([1, 2], "<i8"), np.ones((2, 2), "<f4")))
            client.close()
            assert server.stats.bad_requests >= 8


def test_capacity_is_the_slot_budget():
    with testing.LoopbackSwitch() as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = switch.add_job(1, slot_count=SLOTS, ps=ps)
        with KVServer(configs[0]):
            def job(worker, rank):
                return [worker.sparse_table(i, ROWS, WIDTH, hot_rounds=rounds).spec.capacity
                        for i, rounds in enumerate((1, 4))]
            assert run_workers(configs, job)[0] == [SLOTS * wire.K // WIDTH, 4 * SLOTS * wire.K // WIDTH]


@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_sgd_weights_lose_no_update_when_rows_move_in_and_out_of_the_hot_set(loss):
    """PS-held weights for cold rows, replicas for hot rows: after many switch-overs every row has every step."""
    iterations, lr, scale = 14, 0.5, 0.1
    faults = {"drop": loss, "duplicate": loss / 2, "reorder": loss / 2, "seed": 4} if loss else {}
    every_key = np.unique(np.concatenate([zipf_keys(r, it) for r in range(N) for it in range(iterations)]))
    with testing.LoopbackSwitch(**faults) as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = switch.add_job(N, slot_count=SLOTS, ps=ps)
        with KVServer(configs[0]) as server:
            def job(worker, rank):
                table = worker.sparse_table(0, ROWS, WIDTH, update="sgd", lr=lr, init_scale=scale, seed=5,
                                            report_every=2, min_gain=0.0)
                versions = []
                for it in range(iterations):
                    keys = zipf_keys(rank, it)
                    versions.append(table.hot.version)
                    worker.wait(table.push(keys, grad_rows(rank, it, keys.size)))
                    worker.wait(table.pull(zipf_keys(rank, it + 1)))  # the next batch's rows, like training
                return versions, worker.wait(table.pull(every_key)), table.stats
            results = run_workers(configs, job, rto_initial=0.01)
            assert server.tables[0].stats.refused == 0
    versions = results[0][0]
    assert len(set(versions)) >= 4, versions  # rows moved in and out of the hot set several times
    from netagg.hoststack.sparse_store import initial_rows
    want = initial_rows(every_key, WIDTH, scale, 5).astype(np.float64)
    for it in range(iterations):
        for key, row in _exact(it).items():
            want[np.searchsorted(every_key, key)] -= lr / N * row.astype(np.float64)
    for _, final, stats in results:
        np.testing.assert_array_equal(final, results[0][1])  # replicas and the PS agree on every worker
        assert stats["hot_rows"] > 0 and stats["cold_rows"] > 0
    np.testing.assert_allclose(results[0][1], want, rtol=0, atol=1e-5)


def test_the_switch_exchange_detects_workers_on_different_hot_sets():
    """The version block: equal versions pass, a one-version difference makes every worker discard the sums."""
    from netagg.hoststack.hotset import HotSet
    from netagg.hoststack.sparse import HotSetMismatch

    keys = np.arange(0, 200, 2)
    with testing.LoopbackSwitch() as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = switch.add_job(N, slot_count=SLOTS, ps=ps)
        with KVServer(configs[0]):
            def job(worker, rank):
                table = worker.sparse_table(0, ROWS, WIDTH)
                dense = np.full(keys.size * WIDTH, rank + 1.0, np.float32)
                outcomes = []
                for versions in ((7, 7, 7), (4102, 6, 6), (5, 5, 6)):  # 4102 = 6 mod 4096: the tag wraps
                    table.hot = HotSet(versions[rank], 0, keys)
                    try:
                        outcomes.append(float(worker.call(table._exchange, dense, 0)[0]))
                    except HotSetMismatch as err:
                        outcomes.append(str(err))
                return outcomes
            results = run_workers(configs, job, rto_initial=0.01)
    for rank, (same, wrapped, mixed) in enumerate(results):
        assert same == wrapped == 6.0  # 1 + 2 + 3
        assert "different hot sets" in mixed and f"version {(5, 5, 6)[rank]}" in mixed


def test_a_key_space_of_a_hundred_million_rows_costs_only_the_touched_rows():
    rows, iterations, lr = 10**8, 4, 0.5
    rng = np.random.default_rng(8)
    touched = [[np.unique(rng.integers(0, rows, 200)) for _ in range(2)] for _ in range(iterations)]
    grads = [[np.full((k.size, 4), 1.0 + r, np.float32) for r, k in enumerate(step)] for step in touched]
    every = np.unique(np.concatenate([k for step in touched for k in step]))
    with testing.LoopbackSwitch() as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = switch.add_job(2, slot_count=SLOTS, ps=ps)
        with KVServer(configs[0]) as server:
            def job(worker, rank):
                table = worker.sparse_table(0, rows, 4, update="sgd", lr=lr, init_scale=0.1, seed=2, report_every=1,
                                            min_touches=0.0)
                for it in range(iterations):
                    worker.wait(table.push(touched[it][rank], grads[it][rank]))
                return worker.wait(table.pull(every))
            results = run_workers(configs, job, rto_initial=0.01)
            assert len(server.tables[0].weights) <= every.size  # only touched rows are stored
    from netagg.hoststack.sparse_store import initial_rows
    want = initial_rows(every, 4, 0.1, 2).astype(np.float64)
    for it in range(iterations):
        for rank in range(2):
            want[np.searchsorted(every, touched[it][rank])] -= lr / 2 * grads[it][rank]
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_allclose(results[0], want, rtol=0, atol=1e-5)
