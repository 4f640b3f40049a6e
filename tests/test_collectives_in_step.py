"""Never a silent wrong sum (docs/protocol.md, "Round flags"): NaN and inf reach every rank as IEEE sums make
them, and ranks out of step raise ``OutOfStep`` on every rank instead of summing two different calls — through
the software switch and through the PS's aggregator (fallback mode), from ``KVWorker.allreduce``."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from netagg import dataplane as dp
from netagg import wire
from netagg.dataplane import DropReason
from netagg.hoststack import KVWorker
from netagg.hoststack.transport import OutOfStep, TransportError
from netagg.jobconfig import WorkerConfig
from netagg.testing.hoststack import expected_allreduce, fallback_job
from netagg.testing.softswitch import LoopbackSwitch

PROGRESS_TIMEOUT = 4.0


@contextlib.contextmanager
def _job(target: str, n: int) -> Iterator[list[WorkerConfig]]:
    if target == "switch":
        with LoopbackSwitch() as switch:
            yield switch.add_job(n, 16)
    else:
        with fallback_job(n, slot_count=16) as (_, configs):
            yield configs


def _each_rank(configs: list[WorkerConfig], fn: Callable[[KVWorker, int], Any]) -> list[tuple[Any, BaseException]]:
    """``fn(worker, rank)`` in a thread per rank: (result, error) per rank, and how long each took."""
    outcomes: list[Any] = [None] * len(configs)

    def run(rank: int) -> None:
        started = time.monotonic()
        try:
            with KVWorker(configs[rank], progress_timeout=PROGRESS_TIMEOUT) as worker:
                outcomes[rank] = (fn(worker, rank), None, time.monotonic() - started)
        except BaseException as err:  # each rank's outcome is the test's subject
            outcomes[rank] = (None, err, time.monotonic() - started)

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(len(configs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    return outcomes


def _inputs(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("target", ["switch", "ps"])
def test_the_issue_scenario_nan_reaches_every_rank_and_the_next_sum_is_exact(target):
    """One rank's gradient holds a NaN at element 5; then an ordinary allreduce of the same size."""
    n, size = 3, 1_000
    first, second = _inputs(n, size, 1), _inputs(n, size, 2)
    first[0][5] = np.nan
    with _job(target, n) as configs:
        outcomes = _each_rank(configs, lambda w, rank: (w.allreduce(first[rank]), w.allreduce(second[rank])))
    expected_second, bound = expected_allreduce(second)
    for result, error, _ in outcomes:
        assert error is None
        got_first, got_second = result
        assert np.isnan(got_first[5])
        assert np.isnan(got_first[:wire.K]).all()  # the block of element 5, as docs/protocol.md says
        exact_first, _ = expected_allreduce([x.copy() for x in first])
        np.testing.assert_array_equal(got_first[wire.K:], exact_first[wire.K:])  # the other blocks exact
        assert np.isfinite(got_first[wire.K:]).all()
        np.testing.assert_array_equal(got_second, expected_second)
        assert (np.abs(got_second - sum(x.astype(np.float64) for x in second)) <= bound + 1e-6).all()


@pytest.mark.parametrize(("values", "want"), [
    ((np.inf, 1.0, 2.0), np.inf),
    ((-np.inf, 1.0, -np.inf), -np.inf),
    ((np.inf, -np.inf, 0.0), np.nan),
    ((np.inf, np.nan, 0.0), np.nan),
])
def test_infinities_sum_as_ieee_per_block(values, want):
    n, size = 3, 3 * wire.K
    inputs = _inputs(n, size, 3)
    for rank, value in enumerate(values):
        inputs[rank][wire.K + 7] = value  # in block 1 only
    with _job("switch", n) as configs:
        outcomes = _each_rank(configs, lambda w, rank: w.allreduce(inputs[rank]))
    for result, error, _ in outcomes:
        assert error is None
        block = result[wire.K:2 * wire.K]
        if np.isnan(want):
            assert np.isnan(block).all()
        else:
            assert (block == want).all()
        assert np.isfinite(result[:wire.K]).all() and np.isfinite(result[2 * wire.K:]).all()


def _assert_out_of_step_everywhere(outcomes: list, ranks: list[int]) -> None:
    for rank in ranks:
        result, error, took = outcomes[rank]
        assert result is None, f"rank {rank} returned a sum"
        assert isinstance(error, OutOfStep), f"rank {rank}: {error!r}"
        assert "out of step" in str(error)
        assert took < PROGRESS_TIMEOUT, f"rank {rank} raised only after {took:.1f} s"


@pytest.mark.parametrize("target", ["switch", "ps"])
def test_a_rank_calling_with_another_size_makes_every_rank_raise(target):
    n = 3
    inputs = _inputs(n, 2_000, 4)
    with _job(target, n) as configs:
        outcomes = _each_rank(configs, lambda w, rank: w.allreduce(inputs[rank][:1_000 if rank == 1 else 2_000]))
    _assert_out_of_step_everywhere(outcomes, [0, 1, 2])


@pytest.mark.parametrize("target", ["switch", "ps"])
def test_a_rank_that_skips_a_call_makes_every_rank_raise_and_nothing_is_mixed(target):
    """Rank 2 skips the first call (1,000 values) and makes the second (3,000 values) as its first."""
    n = 3
    small, large = _inputs(n, 1_000, 5), _inputs(n, 3_000, 6)

    def calls(worker: KVWorker, rank: int) -> Any:
        if rank != 2:
            worker.allreduce(small[rank])
        return worker.allreduce(large[rank])

    with _job(target, n) as configs:
        outcomes = _each_rank(configs, calls)
    _assert_out_of_step_everywhere(outcomes, [0, 1, 2])


@pytest.mark.parametrize("target", ["switch", "ps"])
def test_a_rank_whose_call_raises_before_sending_fails_the_job_everywhere(target):
    """Rank 0's input is refused (not a number); the others' same call raises, and so does every later call
    (the job is failed, never mixed with rank 0's next call of the same size)."""
    n = 3
    inputs = _inputs(n, 1_000, 7)

    def calls(worker: KVWorker, rank: int) -> Any:
        if rank == 0:
            with pytest.raises((TypeError, ValueError)):
                worker.allreduce(np.array(["not", "a", "gradient"], dtype=object))
            with pytest.raises(TransportError, match="aborted"):
                worker.allreduce(inputs[0])
            raise OutOfStep("rank 0 stopped as documented")  # its own error was checked above
        try:
            return worker.allreduce(inputs[rank])
        finally:
            with pytest.raises(TransportError, match="earlier failure"):
                worker.allreduce(inputs[rank])

    with _job(target, n) as configs:
        outcomes = _each_rank(configs, calls)
    _assert_out_of_step_everywhere(outcomes, [1, 2])


def test_the_switch_counts_the_refused_contributions_per_job():
    n = 2
    inputs = _inputs(n, 500, 8)
    with LoopbackSwitch() as switch:
        configs = switch.add_job(n, 16)
        outcomes = _each_rank(configs, lambda w, rank: w.allreduce(inputs[rank][:250 * (rank + 1)]))
        counters = switch.counters(configs[0].job_id)
        client = switch.programmer.client
        mismatches = client.read_counter(dp.COUNTER_DROP_REASONS, DropReason.EXCHANGE_MISMATCH)[0]
    _assert_out_of_step_everywhere(outcomes, [0, 1])
    assert counters["rejects"] >= 1 and mismatches == counters["rejects"]


def test_exponents_without_flags_are_not_taken_for_finite_blocks():
    """A caller that passes exponents but no flags still gets NaN back, never a garbage sum of a quantized NaN."""
    from netagg.hoststack import quantization as qz
    from netagg.hoststack.transport import Transport

    blocks = np.ones((2, wire.K), np.float32)
    blocks[1, 3] = np.nan
    with fallback_job(1) as (_, configs), Transport(configs[0]) as transport:
        sums, exponents, flags = transport.exchange(blocks, qz.block_exponents(blocks))
    out = qz.dequantize(sums, exponents, 1, flags=flags)
    assert (out[0] == 1).all() and np.isnan(out[1]).all()
