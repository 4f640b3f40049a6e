"""Chain replication of the MLfabric PS: kill -9 of the primary mid-training loses no acknowledged update."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from benchmarks.mlfabric_worker import load_digits_fast, model_loss
from examples.mlp_digits import init_params
from netagg.mlfabric.async_server import FabricServer
from netagg.mlfabric.protocol import Connection, Refused
from netagg.mlfabric.testing import collect, loopback_configs, start_ps, start_workers, stop, write_configs
from netagg.mlfabric.worker import FabricClient

pytestmark = pytest.mark.timeout(150)

WORKERS, STEPS, BOUND = 3, 100, 8
#: The replicated run (with a failover) must reach the unreplicated run's test accuracy within this.
ACCURACY_TOLERANCE = 0.04


def _accuracy(model: np.ndarray) -> float:
    return model_loss(model, load_digits_fast(0), init_params(0))[1]


def _train(tmp_path, replicas: int, kill_at: int | None):
    tmp_path.mkdir()
    configs = loopback_configs(WORKERS, update_mode="async", delay_bound=BOUND, replicas=replicas)
    paths = write_configs(configs, tmp_path)
    nodes = [start_ps(paths[0], tmp_path / f"replica{i}.log", replica=i) for i in range(replicas)]
    primary = start_ps(paths[0], tmp_path / "primary.log")
    lag_samples = []
    try:
        workers = start_workers(paths, [["--steps", str(STEPS)]] * WORKERS)
        killed_at = None
        if kill_at is not None:
            observer = FabricClient([configs[0].ps.as_tuple()], 1, 0, observer=True)
            while killed_at is None:
                stats, _ = observer.stats()
                lag_samples.append((stats["seq"], stats["replication"]["acked_seq"], stats["replication"]["lag"]))
                if stats["version"] >= kill_at:
                    primary.send_signal(signal.SIGKILL)  # a real crash: no goodbye to anyone
                    primary.wait(timeout=10)
                    killed_at = stats["version"]
                time.sleep(0.02)
            observer.close()
        reports = collect(workers, timeout=120)
        survivor = configs[0].replicas[-1] if kill_at is not None else configs[0].ps
        observer = FabricClient([survivor.as_tuple()], 1, 0, observer=True)
        stats, model = observer.stats(log=True, model=True)
        observer.close()
    finally:
        for node in [primary, *nodes]:
            stop(node)
    assert model is not None
    return reports, stats, model, killed_at, lag_samples


def test_kill_minus_nine_of_the_primary_loses_no_acknowledged_update(tmp_path):
    baseline_reports, baseline, baseline_model, _, _ = _train(tmp_path / "plain", replicas=0, kill_at=None)
    reports, stats, model, killed_at, lag_samples = _train(tmp_path / "replicated", replicas=1,
                                                           kill_at=WORKERS * STEPS // 5)
    # Killed a fifth into the training (no worker can have finished yet); every worker failed over to the
    # replica and finished its steps without errors.
    assert killed_at is not None and 0 < killed_at < WORKERS * STEPS
    assert stats["role"] == "primary" and stats["version"] > killed_at
    for report in reports:
        assert report["failovers"] >= 1 and report["errors"] == 0 and report["steps"] == STEPS
    # No acknowledged update is lost: the replica's log has every update a worker saw acknowledged ...
    logged = [entry["update_id"] for entry in stats["log"]]
    acked = [update_id for report in reports for update_id in report["acked"]]
    assert set(acked) <= set(logged)
    # ... each applied once (a push retried after the failover is recognised, not applied twice).
    assert len(logged) == len(set(logged)) == stats["version"]
    assert all(entry["delay"] <= BOUND for entry in stats["log"])
    # While the primary lived, the replica acknowledged all but at most max_lag = 1 of its records.
    assert lag_samples and all(seq - acked_seq <= 1 and lag <= 1 for seq, acked_seq, lag in lag_samples)
    # Training continued to the same accuracy as the unreplicated run, within the stated tolerance.
    assert all(r["errors"] == 0 for r in baseline_reports)
    plain_accuracy, replicated_accuracy = _accuracy(baseline_model), _accuracy(model)
    assert plain_accuracy > 0.9
    assert abs(replicated_accuracy - plain_accuracy) <= ACCURACY_TOLERANCE, (plain_accuracy, replicated_accuracy)
    assert baseline["version"] > 0.8 * WORKERS * STEPS


def _chain(**options) -> tuple[FabricServer, FabricServer, list]:
    configs = loopback_configs(2, update_mode="async", delay_bound=5, replicas=1)
    replica = FabricServer(configs[0], replica=0, gate_timeout=0, **options).start()
    primary = FabricServer(configs[0], gate_timeout=0, **options).start()
    return primary, replica, configs


def test_the_replica_mirrors_the_primary_and_a_retried_push_is_applied_once_after_failover():
    primary, replica, configs = _chain()
    try:
        client = FabricClient.from_config(configs[0], failover_timeout=10)
        client.hello()
        client.init(np.arange(6, dtype=np.float32))
        g = np.linspace(-1, 1, 6).astype(np.float32)
        assert client.push("0:0", 0, g)["outcome"] == "applied"
        assert client.push("0:1", 1, g)["outcome"] == "applied"
        # Acknowledged means applied at the replica too: bit-identical model, same log.
        assert np.array_equal(replica.model, primary.model) and replica.version == primary.version == 2
        assert [e.update_id for e in replica.log] == ["0:0", "0:1"]
        # Before the primary is gone the replica serves no worker and refuses to take over.
        conn = Connection(configs[0].replicas[0].as_tuple())
        with pytest.raises(Refused, match="replica, not the primary"):
            conn.call({"op": "pull", "job_id": 1, "rank": 0})
        with pytest.raises(Refused, match="primary is still connected"):
            conn.call({"op": "promote", "job_id": 1})
        primary.stop()  # its connections close, as after a crash
        # The worker never got the answer to "0:1" (say) and pushes it again: applied once, not twice.
        again = client.push("0:1", 1, g)
        assert again["outcome"] == "applied" and again["duplicate"] and client.current == 1
        assert client.push("0:2", 2, g)["outcome"] == "applied"
        assert replica.role == "primary" and replica.version == 3
        np.testing.assert_allclose(replica.model, np.arange(6, dtype=np.float32) - 0.3 * g, rtol=1e-6)
        conn.close()
        client.close()
    finally:
        primary.stop()
        replica.stop()


def test_a_dead_replica_bounds_the_lag_and_no_push_is_acknowledged_unsafely():
    primary, replica, configs = _chain(ack_timeout=0.5, max_lag=1)
    try:
        client = FabricClient([configs[0].ps.as_tuple()], 1, 0, failover_timeout=1)
        client.hello()
        client.init(np.zeros(3, np.float32))
        assert client.push("0:0", 0, np.ones(3, np.float32))["outcome"] == "applied"
        replica.stop()
        # Applied at the primary, but the replica cannot confirm it: not acknowledged.
        with pytest.raises(Refused, match="not acknowledged by the replica"):
            client.push("0:1", 1, np.ones(3, np.float32))
        # One record behind is the bound: the next update is refused before it is applied.
        with pytest.raises(Refused, match=r"not applied: replica .* 1 records behind"):
            client.push("0:2", 2, np.ones(3, np.float32))
        assert primary.version == 2 and primary.forwarder is not None and primary.forwarder.lag == 1
        assert primary.stats.replication_stalls == 2
        client.close()
    finally:
        primary.stop()
        replica.stop()


def test_the_workers_fast_digits_loader_gives_the_examples_data():
    from examples.mlp_digits import load_digits_dataset

    fast, reference = load_digits_fast(3), load_digits_dataset(3)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        a, b = getattr(fast, name), getattr(reference, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
