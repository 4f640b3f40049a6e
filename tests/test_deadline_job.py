"""A job that opts in to deadline allreduces (``--deadline-ms``, ``WorkerConfig.deadline_ms``): the setting is
checked, stored and written into every worker's config, and the DDP hook sums each gradient bucket as a deadline
allreduce of its own (a late rank's values join the same bucket's next sum, never another bucket's)."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time

import numpy as np
import pytest
import yaml

from netagg import wire
from netagg.hoststack.envconfig import config_from_env
from netagg.jobconfig import ConfigError, Endpoint, WorkerConfig
from netagg.testing.hoststack import run_workers

testing = pytest.importorskip("netagg.testing.softswitch")

BASE = dict(job_id=1, rank=0, num_workers=2, slot_count=16, mode="allreduce", aggregator=Endpoint("127.0.0.1", 1),
            bind=Endpoint("127.0.0.1", 2))


def test_deadline_ms_is_a_checked_job_setting():
    config = WorkerConfig(**BASE, deadline_ms=50)
    assert config.deadline_ms == 50
    assert WorkerConfig.from_dict(yaml.safe_load(config.to_yaml())).deadline_ms == 50
    assert WorkerConfig(**BASE).deadline_ms == 0  # exact unless the job opted in
    for bad in (-1, 60_001, True, "50", float("nan")):
        with pytest.raises(ConfigError, match="deadline_ms"):
            WorkerConfig(**BASE, deadline_ms=bad)
    ps = Endpoint("127.0.0.1", 3)
    for other in ({"threads": 2}, {"senders": 1}, {"mode": "ps", "ps": ps}, {"job_workers": 4, "job_rank": 0},
                  {"mode": "fallback", "ps": ps, "aggregator": ps}):  # fallback without the job's secret
        with pytest.raises(ConfigError, match="deadline_ms"):
            WorkerConfig(**{**BASE, **other}, deadline_ms=50)
    at_ps = WorkerConfig(**{**BASE, "mode": "fallback", "ps": ps, "aggregator": ps}, secret="s" * 32, deadline_ms=50)
    assert at_ps.deadline_ms == 50
    env = {"NETAGG_JOB_ID": "1", "DMLC_NUM_WORKER": "2", "NETAGG_RANK": "0", "NETAGG_SLOTS": "16",
           "NETAGG_AGGREGATOR": "127.0.0.1:28900", "NETAGG_BIND": "127.0.0.1:40000"}
    assert config_from_env(env).deadline_ms == 0
    assert config_from_env({**env, "NETAGG_DEADLINE_MS": "20"}).deadline_ms == 20
    for bad in ("soon", "-5"):
        with pytest.raises(ConfigError, match="NETAGG_DEADLINE_MS"):
            config_from_env({**env, "NETAGG_DEADLINE_MS": bad})


def test_the_controller_stores_the_deadline_writes_it_into_every_config_and_refuses_what_cannot_close(
        capsys, soft_controller):
    from netagg.controller.cli import EXIT_CODES, main

    from conftest import TOKENS, free_udp_port

    def cli(*args: str) -> tuple[int, str, str]:
        code = main(["--config", str(soft_controller.config), "--json", "--token", TOKENS["alice"], *args])
        out, err = capsys.readouterr()
        return code, out, err

    workers = ",".join(f"local:{free_udp_port()}" for _ in range(2))
    code, out, err = cli("job", "create", "--workers", workers, "--slots", "8", "--deadline-ms", "40")
    assert code == 0, err
    job = json.loads(out)["job"]
    assert job["deadline_ms"] == 40
    for rank in (0, 1):
        code, out, err = cli("job", "config", str(job["job_id"]), "--rank", str(rank))
        assert code == 0, err
        assert WorkerConfig.from_dict(yaml.safe_load(out)).deadline_ms == 40
    code = main(["--config", str(soft_controller.config), "--token", TOKENS["alice"], "job", "show",
                 str(job["job_id"])])
    assert code == 0 and "deadline allreduce: rounds close 40 ms" in capsys.readouterr().out
    # Stored with the job (a restarted controller writes the same configs).
    database = yaml.safe_load(soft_controller.config.read_text())["controller"]["database"]
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT deadline_ms FROM jobs WHERE job_id = ?", (job["job_id"],)).fetchone()[0] == 40
    # A job at its PS (fallback) closes its rounds there: its configs carry the deadline and the job's secret.
    code, out, err = cli("job", "create", "--workers", f"local:{free_udp_port()},local:{free_udp_port()}",
                         "--mode", "fallback", "--ps", "ps0", "--deadline-ms", "30")
    assert code == 0, err
    at_ps = json.loads(out)["job"]
    code, out, err = cli("job", "config", str(at_ps["job_id"]), "--rank", "1")
    assert code == 0, err
    config = WorkerConfig.from_dict(yaml.safe_load(out))
    assert (config.mode, config.deadline_ms) == ("fallback", 30) and config.secret
    bad = ((["--deadline-ms", "-1"], "deadline_ms: expected milliseconds"),
           (["--deadline-ms", "10", "--threads", "2"], "--deadline-ms needs a plain allreduce job"),
           (["--deadline-ms", "10", "--mode", "ps", "--ps", "ps0"], "--deadline-ms needs a plain allreduce job"))
    for args, message in bad:
        code, _, err = cli("job", "create", "--workers", f"local:{free_udp_port()}", "--slots", "8", *args)
        assert code == EXIT_CODES["invalid_argument"], err
        assert message in err, err


def test_an_old_database_without_the_column_opens_with_exact_jobs(tmp_path):
    from netagg.controller.store import JobStore

    from conftest import old_database

    old_database(tmp_path / "ctl.db", "deadline_ms")
    store = JobStore(tmp_path / "ctl.db")
    assert store.get(4).deadline_ms == 0
    store.close()


def test_a_deadline_needs_a_positive_number_of_seconds():
    with testing.LoopbackSwitch() as switch:
        configs = switch.add_job(1, slot_count=8)

        def job(worker, rank):
            assert worker.job_deadline is None  # the job did not opt in
            for bad in (0.0, -0.1, float("nan")):
                with pytest.raises(ValueError, match="deadline"):
                    worker.allreduce(np.ones(10, np.float32), deadline=bad)
            return worker.allreduce(np.ones(10, np.float32))

        out = run_workers(configs, job)
    np.testing.assert_array_equal(out[0], np.ones(10, np.float32))


class _Bucket:
    """What the DDP hook reads of a ``dist.GradBucket``: its flat gradient buffer and its index."""

    def __init__(self, buffer, index: int) -> None:
        self._buffer, self._index = buffer, index

    def buffer(self):
        return self._buffer

    def index(self) -> int:
        return self._index


def test_the_ddp_hook_sums_each_bucket_as_a_deadline_allreduce_of_its_own():
    """Two buckets of the same size, three ranks, the job's deadline 100 ms: rank 2 reaches step 0's buckets 0.5 s
    late. Ranks 0 and 1 do not wait for it; every rank averages the same sums; rank 2's values of each bucket join
    that bucket's sum at step 1 (not the other bucket's, which has the same shape)."""
    torch = pytest.importorskip("torch", reason="torch is optional: pip install torch==2.13.0")
    from netagg.hoststack.ddp_hook import NetaggHookState, netagg_allreduce_hook

    n, size = 3, 2_000
    rng = np.random.default_rng(5)
    grads = {(step, bucket, rank): rng.normal(0, 1, size).astype(np.float32)
             for step in range(2) for bucket in range(2) for rank in range(n)}
    with testing.LoopbackSwitch() as switch:
        configs = [dataclasses.replace(c, deadline_ms=100.0) for c in switch.add_job(n, slot_count=16)]
        between = threading.Barrier(n)

        def job(worker, rank):
            assert worker.job_deadline == pytest.approx(0.1)
            state = NetaggHookState(worker)
            out, took = {}, []
            for step in range(2):
                if rank == 2 and step == 0:
                    time.sleep(0.5)
                began = time.monotonic()
                for bucket in range(2):
                    future = netagg_allreduce_hook(state, _Bucket(torch.from_numpy(grads[step, bucket, rank]), bucket))
                    out[step, bucket] = future.value().numpy().copy()
                took.append(time.monotonic() - began)
                between.wait(30)
            return out, took, worker.deadline_carry

        results = run_workers(configs, job, rto_initial=0.01)
    blocks = -(-size // wire.K)
    assert results[2][2] == 2 * blocks and results[0][2] == results[1][2] == 0  # rank 2's step 0 carried, whole
    assert results[0][1][0] < 0.45 and results[1][1][0] < 0.45  # step 0 did not wait for rank 2
    for bucket in range(2):
        for step in range(2):
            for rank in (1, 2):
                np.testing.assert_array_equal(results[rank][0][step, bucket], results[0][0][step, bucket])
        np.testing.assert_allclose(results[0][0][0, bucket] * n, grads[0, bucket, 0] + grads[0, bucket, 1], atol=1e-4)
        # Step 1: every rank's step-1 values and rank 2's step-0 values of this very bucket.
        expected = sum(grads[1, bucket, r] for r in range(n)) + grads[0, bucket, 2]
        np.testing.assert_allclose(results[0][0][1, bucket] * n, expected, atol=1e-4)


def test_a_deadline_allreduce_through_a_ps_without_the_jobs_secret_is_refused_at_once():
    """Fallback mode without the job's secret: the PS learns a rank's address only from its contributions, so a
    rank late from the start would never get the closed rounds' results; a call with a deadline raises before
    sending anything, and the same call without one sums exactly."""
    from netagg.testing.hoststack import fallback_job

    with fallback_job(2, slot_count=16) as (_, configs):
        def job(worker, rank):
            with pytest.raises(ValueError, match="needs the job's secret"):
                worker.allreduce(np.ones(300, np.float32), deadline=0.1)
            return worker.allreduce(np.full(300, rank + 1, np.float32))

        out = run_workers(configs, job)
    for total in out:
        np.testing.assert_array_equal(total, np.full(300, 3, np.float32))


@pytest.mark.parametrize("late", [0.5, 1.5])
def test_a_deadline_allreduce_at_the_ps_closes_without_a_late_rank_and_it_learns_the_sums(late):
    """A job at its PS (fallback mode, with the job's secret: every rank registered its address at start). Rank 2
    calls ``late`` seconds after the others' deadline passed: the others return at their deadline without it,
    every rank returns the same sums, each block exactly the sum of the ranks its result names (past the deadline
    a round does not wait for ranks 0 and 1 either), none with rank 2's values, and every rank carries the blocks
    it is not in to its next deadline call; the next exact call sums everyone's values."""
    from netagg.testing.hoststack import fallback_job

    n, size, deadline = 3, 20_000, 1.0
    rng = np.random.default_rng(4)
    first = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    second = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    with fallback_job(n, slot_count=16, secret="s3cret-" * 5) as (_, configs):
        def job(worker, rank):
            if rank == 2:
                time.sleep(deadline + late)
            began = time.monotonic()
            one = worker.allreduce(first[rank], deadline=deadline)
            took = time.monotonic() - began
            carry, members = worker.deadline_carry, worker.transport.last_members.copy()
            two = worker.allreduce(second[rank])  # exact: no deadline
            return one, took, carry, two, members

        out = run_workers(configs, job, timeout=60)
    ones = [o[0] for o in out]
    for one in ones[1:]:
        np.testing.assert_array_equal(one, ones[0])  # one sum, whoever learned it how
    members = out[0][4]
    for o in out[1:]:
        np.testing.assert_array_equal(o[4], members)
    blocks = -(-size // wire.K)
    assert members.shape == (blocks,) and not (members & 0b100).any() and (members != 0).all()
    padded = np.zeros((n, blocks * wire.K))
    padded[:, :size] = first
    inside = (members[None, :] >> np.arange(n)[:, None]) & 1  # rank x block
    expected = (padded.reshape(n, blocks, wire.K) * inside[:, :, None]).sum(axis=0).reshape(-1)[:size]
    np.testing.assert_allclose(ones[0], expected, rtol=1e-3, atol=1e-3)
    assert out[0][1] < deadline + 2.0 and out[1][1] < deadline + 2.0  # nobody waited for rank 2
    for rank in range(n):  # what a rank is not in joins its next deadline call
        assert out[rank][2] == int((inside[rank] == 0).sum())
    assert out[2][2] == blocks
    exact = sum(s.astype(np.float64) for s in second)
    for o in out:
        np.testing.assert_allclose(o[3], exact, rtol=1e-3, atol=1e-3)
