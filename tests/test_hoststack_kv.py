"""The PS-lite style API (push/pull/pushpull/wait/allreduce/init) on a fallback-mode job."""

from __future__ import annotations

import numpy as np
import pytest

from netagg.hoststack import blocks as blk
from netagg.hoststack.kv import KVWorker
from netagg.testing.hoststack import expected_allreduce, fallback_job, run_workers

N = 3


def grads(rank: int, step: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(100 * step + rank)
    return [rng.standard_normal((4, 50)).astype(np.float32),
            rng.standard_normal(3).astype(np.float16),
            blk.float32_to_bfloat16(rng.standard_normal(130).astype(np.float32)),
            rng.standard_normal(()).astype(np.float64)]


def expected(step: int = 0) -> list:
    per_rank = [grads(r, step) for r in range(N)]
    return [expected_allreduce([per_rank[r][i] for r in range(N)])[0] for i in range(len(per_rank[0]))]


def test_pushpull_returns_the_aggregate_of_every_key_in_its_dtype_and_shape():
    with fallback_job(N) as (_, configs):
        results = run_workers(configs, lambda w, rank: w.wait(w.pushpull([10, 11, 12, 13], grads(rank))))
    for values in results:
        for got, want in zip(values, expected(), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_push_then_pull_returns_the_last_aggregate_and_writes_out_arrays():
    def job(worker: KVWorker, rank: int):
        stamps = [worker.push([10, 11, 12, 13], grads(rank, step)) for step in range(3)]  # queued, in order
        assert [worker.wait(ts) for ts in reversed(stamps)] == [None, None, None]
        out = [np.empty((4, 50), np.float32), np.empty(3, np.float64)]
        ts = worker.pull([10, 11], out=out)
        assert worker.wait(ts) is not None
        return out, worker.wait(worker.pull(10))

    with fallback_job(N) as (_, configs):
        results = run_workers(configs, job)
    want = expected(step=2)
    # pull returns the stored float32 aggregate (float16 inputs are summed in float32, not rounded back).
    want_f16_key, _ = expected_allreduce([grads(r, 2)[1].astype(np.float32) for r in range(N)])
    for out, (single,) in results:
        np.testing.assert_array_equal(out[0], want[0])
        np.testing.assert_array_equal(out[1], want_f16_key.astype(np.float64))
        np.testing.assert_array_equal(single, want[0])


def test_allreduce_keeps_shape_and_dtype_including_scalars_and_empty_arrays():
    inputs = [np.full((2, 3), rank + 1, np.float16) for rank in range(N)]

    def job(worker: KVWorker, rank: int):
        return (worker.allreduce(inputs[rank]), worker.allreduce(np.float32(rank)),
                worker.allreduce(np.zeros((0, 4), np.float32)))

    with fallback_job(N) as (_, configs):
        results = run_workers(configs, job)
    for matrix, scalar, empty in results:
        assert matrix.dtype == np.float16 and matrix.shape == (2, 3)
        np.testing.assert_array_equal(matrix, 6)
        assert scalar.shape == () and scalar == 3
        assert empty.shape == (0, 4)


def test_errors_surface_at_the_call_or_at_wait():
    with fallback_job(1) as (_, configs), KVWorker(configs[0]) as worker:
        with pytest.raises(KeyError, match="never pushed"):
            worker.wait(worker.pull([99]))
        with pytest.raises(KeyError, match="unknown or already waited-for"):
            worker.wait(12345)
        with pytest.raises(TypeError, match="float32, float16"):
            worker.push(1, np.arange(3))
        with pytest.raises(ValueError, match="duplicate"):
            worker.push([1, 1], [np.ones(2, np.float32)] * 2)
        with pytest.raises(ValueError, match="output arrays"):
            worker.pull([1, 2], out=[np.empty(1, np.float32)])
        ts = worker.init([5], [np.arange(4, dtype=np.float32).reshape(2, 2)])
        worker.wait(ts)
        np.testing.assert_array_equal(worker.wait(worker.pull(5))[0], [[0, 1], [2, 3]])


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    inputs = [torch.full((3, 4), float(rank + 1)).to(torch.bfloat16) for rank in range(N)]
    with fallback_job(N) as (_, configs):
        results = run_workers(configs, lambda w, rank: (w.allreduce(inputs[rank]),
                                                         w.wait(w.pushpull(1, torch.ones(5) * rank))[0]))
    for summed, pushpulled in results:
        assert isinstance(summed, torch.Tensor) and summed.dtype == torch.bfloat16 and summed.shape == (3, 4)
        assert torch.equal(summed, torch.full((3, 4), 6.0).to(torch.bfloat16))
        assert torch.equal(pushpulled, torch.full((5,), 3.0))
