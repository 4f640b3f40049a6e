"""Chain replication of the MLfabric PS: kill -9 of the primary mid-training loses no acknowledged update."""

from __future__ import annotations

import dataclasses
import re
import signal
import threading
import time

import numpy as np
import pytest

from benchmarks.mlfabric_worker import load_digits_fast, model_loss
from examples.mlp_digits import init_params
from netagg.localports import free_ports
from netagg.mlfabric import chainctl
from netagg.mlfabric.async_server import FabricServer
from netagg.mlfabric.protocol import Connection, Refused
from netagg.mlfabric.worker import FabricClient
from netagg.testing.mlfabric import collect, loopback_configs, start_ps, start_workers, stop, write_configs

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
            observer = FabricClient([configs[0].ps.as_tuple()], 1, 0, observer=True, secret=configs[0].secret)
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
        observer = FabricClient([survivor.as_tuple()], 1, 0, observer=True, secret=configs[0].secret)
        stats, model = observer.stats(log=True, model=True)
        observer.close()
    finally:
        for node in [primary, *nodes]:
            stop(node)
    assert model is not None
    return reports, stats, model, killed_at, lag_samples


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The unreplicated run the failover runs are compared with: (worker reports, PS stats, final model)."""
    reports, stats, model, _, _ = _train(tmp_path_factory.mktemp("plain") / "run", replicas=0, kill_at=None)
    assert all(r["errors"] == 0 for r in reports)
    assert stats["version"] > 0.8 * WORKERS * STEPS
    return reports, stats, model


def test_kill_minus_nine_of_the_primary_loses_no_acknowledged_update(tmp_path, plain_run):
    _, _, baseline_model = plain_run
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
    plain_accuracy, replicated_accuracy = _accuracy(baseline_model), _accuracy(model)
    assert plain_accuracy > 0.9
    assert abs(replicated_accuracy - plain_accuracy) <= ACCURACY_TOLERANCE, (plain_accuracy, replicated_accuracy)


def _poll(endpoint, secret: str, until, timeout: float = 30.0, what: str = "the PS") -> dict:
    """``stats`` of the node at ``endpoint`` (an observer: it never promotes) until ``until(stats)`` holds."""
    observer = FabricClient([endpoint.as_tuple()], 1, 0, observer=True, failover_timeout=5, secret=secret)
    deadline = time.monotonic() + timeout
    try:
        while True:
            stats, _ = observer.stats()
            if until(stats):
                return stats
            assert time.monotonic() < deadline, f"timed out waiting for {what}; last stats: {stats}"
            time.sleep(0.02)
    finally:
        observer.close()


@pytest.mark.slow
def test_a_node_joins_the_promoted_replica_catches_up_and_takes_over_after_a_second_kill(tmp_path, plain_run):
    _, _, baseline_model = plain_run
    configs = loopback_configs(WORKERS, update_mode="async", delay_bound=BOUND, replicas=1)
    paths = write_configs(configs, tmp_path)
    ps, replica_endpoint, secret = configs[0].ps, configs[0].replicas[0], configs[0].secret
    replica = start_ps(paths[0], tmp_path / "replica.log", replica=0)
    primary = start_ps(paths[0], tmp_path / "primary.log")
    joiner = None
    total = WORKERS * STEPS
    try:
        # A little compute time per step, so the training outlasts the two failovers and the join.
        workers = start_workers(paths, [["--steps", str(STEPS), "--compute-delay", "0.03"]] * WORKERS)
        first_kill = _poll(ps, secret, lambda st: st["version"] >= total // 5,
                           what="a fifth of the training")["version"]
        primary.send_signal(signal.SIGKILL)
        primary.wait(timeout=10)
        # The workers fail over: the replica is promoted and runs unreplicated ...
        promoted = _poll(replica_endpoint, secret, lambda st: st["role"] == "primary", what="the replica's promotion")
        assert "replication" not in promoted
        # ... until a fresh node on the dead primary's endpoint joins it as its successor and is brought up to date.
        joiner = start_ps(paths[0], tmp_path / "joiner.log", extra=["--join", f"{replica_endpoint.host}:"
                                                                               f"{replica_endpoint.port}"])
        joined = _poll(ps, secret, lambda st: st["caught_up"], what="the joiner's state transfer")
        assert joined["role"] == "replica" and joined["stats"]["snapshots_installed"] == 1
        lag_samples = []

        def replicated(st: dict) -> bool:
            rep = st["replication"]
            if rep["snapshots_sent"] == 1:  # the state transfer was acknowledged: now the joiner keeps up
                lag_samples.append((st["seq"], rep["acked_seq"], rep["lag"]))
            return rep["snapshots_sent"] == 1 and st["version"] >= first_kill + total // 5

        second_kill = _poll(replica_endpoint, secret, replicated, what="training replicated to the joiner")["version"]
        replica.send_signal(signal.SIGKILL)  # the promoted replica dies too: the joiner is all that is left
        replica.wait(timeout=10)
        reports = collect(workers, timeout=120)
        observer = FabricClient([ps.as_tuple()], 1, 0, observer=True, secret=secret)
        stats, model = observer.stats(log=True, model=True)
        observer.close()
    finally:
        for node in (primary, replica, joiner):
            if node is not None:
                stop(node)
    # Both kills happened mid-training; every worker failed over twice (wrapping around the endpoint list to the
    # joiner on the first one) and finished its steps without errors.
    assert first_kill < second_kill < total
    for report in reports:
        assert report["failovers"] >= 2 and report["errors"] == 0 and report["steps"] == STEPS
    assert stats["role"] == "primary" and stats["version"] > second_kill and stats["stats"]["snapshots_installed"] == 1
    # Every update a worker saw acknowledged — by the first primary, the promoted replica or the joiner — is in
    # the joiner's log (from the snapshot or the records after it), each exactly once.
    logged = [entry["update_id"] for entry in stats["log"]]
    acked = [update_id for report in reports for update_id in report["acked"]]
    assert set(acked) <= set(logged)
    assert len(logged) == len(set(logged)) == stats["version"] == stats["stats"]["applied"] < stats["log_size"]
    assert stats["max_delay"] <= BOUND and all(entry["delay"] <= BOUND for entry in stats["log"])
    # While the promoted replica forwarded to the joiner, the joiner lagged by at most max_lag = 1 record.
    assert lag_samples and all(seq - acked_seq <= 1 and lag <= 1 for seq, acked_seq, lag in lag_samples)
    plain_accuracy, accuracy = _accuracy(baseline_model), _accuracy(model)
    assert abs(accuracy - plain_accuracy) <= ACCURACY_TOLERANCE, (plain_accuracy, accuracy)


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
        conn = Connection(configs[0].replicas[0].as_tuple(), secret=configs[0].secret)
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
        client = FabricClient([configs[0].ps.as_tuple()], 1, 0, failover_timeout=1, secret=configs[0].secret)
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


def _wait_for(condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _same_state(a: FabricServer, b: FabricServer) -> None:
    """Bit-identical model, same version, sequence number, log and counters."""
    assert a.model is not None and b.model is not None and a.model.tobytes() == b.model.tobytes()
    assert (a.version, a.seq, a.halted) == (b.version, b.seq, b.halted)
    assert list(a.log) == list(b.log) and a.delay_histogram == b.delay_histogram and a.max_delay == b.max_delay
    assert a.stats.applied_by_rank == b.stats.applied_by_rank and a.stats.applied == b.stats.applied


def test_a_replica_that_restarts_empty_gets_a_state_transfer_and_a_retried_push_is_a_duplicate_there():
    primary, replica, configs = _chain(ack_timeout=5)
    fresh = None
    try:
        client = FabricClient.from_config(configs[0], failover_timeout=10)
        client.hello()
        client.init(np.linspace(0, 1, 5).astype(np.float32))
        rng = np.random.default_rng(0)
        grads = [rng.standard_normal(5).astype(np.float32) for _ in range(6)]
        for step in range(3):
            assert client.push(f"0:{step}", step, grads[step])["outcome"] == "applied"
        replica.stop()  # it crashes and comes back empty, on the same endpoint
        pushed: dict = {}
        pusher = threading.Thread(target=lambda: pushed.update(client.push("0:3", 3, grads[3])))
        pusher.start()  # applied at the primary; acknowledged only once the new replica has it
        _wait_for(lambda: primary.version == 4, what="the primary to apply 0:3")
        assert not pushed and primary.forwarder is not None and primary.forwarder.lag == 1
        fresh = FabricServer(configs[0], replica=0, gate_timeout=0, ack_timeout=5).start()
        pusher.join(10)
        assert pushed["outcome"] == "applied"
        # The snapshot (taken after record 5: init and four updates) is the primary's state, bit for bit.
        assert primary.forwarder.snapshots_sent == 1 and fresh.stats.snapshots_installed == 1
        _same_state(primary, fresh)
        assert [e.update_id for e in fresh.log] == [f"0:{s}" for s in range(4)] and fresh.seq == 5
        # Records after the snapshot follow, each applied once.
        assert client.push("0:4", 4, grads[4])["outcome"] == "applied"
        _same_state(primary, fresh)
        assert [e.update_id for e in fresh.log] == [f"0:{s}" for s in range(5)] and fresh.seq == 6
        # The primary dies; pushes the worker retries are recognised by the new replica, from the snapshot (0:3)
        # and from the records after it (0:4), and not applied again.
        primary.stop()
        for step in (3, 4):
            again = client.push(f"0:{step}", step, grads[step])
            assert again["outcome"] == "applied" and again["duplicate"]
        assert fresh.role == "primary" and fresh.version == 5 and fresh.stats.duplicates == 2
        assert client.push("0:5", 5, grads[5])["outcome"] == "applied"
        expected = np.linspace(0, 1, 5).astype(np.float32)
        for g in grads:
            expected = expected + (-np.float32(0.1) * g).astype(np.float32)
        assert fresh.model is not None and fresh.model.tobytes() == expected.tobytes()
        client.close()
    finally:
        for node in (primary, replica, fresh):
            if node is not None:
                node.stop()


def test_while_a_snapshot_is_in_flight_the_lag_stays_bounded_and_nothing_is_acknowledged_early():
    configs = loopback_configs(2, update_mode="async", delay_bound=5, replicas=1)
    # An unreplicated primary (a replica promoted after a failover, say) and a node that joins it.
    head = FabricServer(dataclasses.replace(configs[0], replicas=()), gate_timeout=0, ack_timeout=5,
                        chain_members=[configs[0].ps.as_tuple(), *(r.as_tuple() for r in configs[0].replicas)]).start()
    joiner = FabricServer(configs[0], replica=0, joining=True, gate_timeout=0, ack_timeout=5)
    install, gate = joiner._op_snapshot, threading.Event()
    joiner._op_snapshot = lambda frame: (gate.wait(10), install(frame))[1]  # the snapshot arrives late
    joiner.start()
    try:
        client = FabricClient([configs[0].ps.as_tuple()], 1, 0, failover_timeout=5, secret=configs[0].secret)
        client.hello()
        client.init(np.zeros(4, np.float32))
        g = np.ones(4, np.float32)
        assert client.push("0:0", 0, g)["outcome"] == "applied"
        # Before its state transfer the joiner refuses to take over: it has nothing.
        conn = Connection(configs[0].replicas[0].as_tuple(), secret=configs[0].secret)
        with pytest.raises(Refused, match="has not caught up"):
            conn.call({"op": "promote", "job_id": 1})
        assert joiner.join(configs[0].ps.as_tuple())["seq"] == 2
        _wait_for(lambda: joiner._upstream == 1, what="the head to connect")
        clients = [client, FabricClient([configs[0].ps.as_tuple()], 1, 1, failover_timeout=5,
                                         secret=configs[0].secret)]
        clients[1].hello()
        outcomes: dict = {}

        def push(rank: int) -> None:
            outcomes[rank] = clients[rank].push(f"{rank}:1", 1, g)

        pushers = [threading.Thread(target=push, args=(rank,)) for rank in (0, 1)]
        pushers[0].start()
        _wait_for(lambda: head.version == 2, what="the first push to be applied")
        pushers[1].start()
        time.sleep(0.5)
        # One record is queued behind the snapshot (max_lag 1); the second push waits before being applied,
        # and neither is acknowledged while the joiner lacks the state.
        assert head.forwarder is not None and head.forwarder.lag == 1 and head.version == 2 and not outcomes
        gate.set()
        for t in pushers:
            t.join(10)
        assert outcomes[0]["outcome"] == outcomes[1]["outcome"] == "applied"
        assert head.version == joiner.version == 3 and joiner.stats.snapshots_installed == 1
        _same_state(head, joiner)
        with pytest.raises(Refused, match="primary is still connected"):
            conn.call({"op": "promote", "job_id": 1})
        conn.close()
        for c in clients:
            c.close()
    finally:
        gate.set()
        head.stop()
        joiner.stop()


def test_a_join_is_refused_unless_the_target_is_a_caught_up_tail():
    configs = loopback_configs(1, update_mode="async", delay_bound=5, replicas=2)
    ps, first, second = configs[0].ps.as_tuple(), *(r.as_tuple() for r in configs[0].replicas)
    head = FabricServer(dataclasses.replace(configs[0], replicas=()), gate_timeout=0,
                        chain_members=[ps, first, second]).start()
    a = FabricServer(configs[0], replica=0, joining=True, gate_timeout=0).start()
    b = FabricServer(configs[0], replica=1, joining=True, gate_timeout=0).start()
    try:
        with pytest.raises(ValueError, match="a primary does not join"):
            head.join(first)
        conn = Connection(ps, secret=configs[0].secret)
        with pytest.raises(Refused, match="endpoint: expected"):
            conn.call({"op": "join", "job_id": 1, "endpoint": ["127.0.0.1", "x"]})
        with pytest.raises(Refused, match="this node's own endpoint"):
            conn.call({"op": "join", "job_id": 1, "endpoint": list(ps)})
        stranger = ["127.0.0.1", free_ports(1, "both")[0]]  # not in the job's config: never gets the model
        with pytest.raises(Refused, match="not an endpoint of this job's PS chain"):
            conn.call({"op": "join", "job_id": 1, "endpoint": stranger})
        assert head.forwarder is None
        conn.close()
        with pytest.raises(Refused, match="has not caught up with the chain itself"):
            b.join(first)  # a has not joined anything yet: it has no state to pass on
        # A broken state transfer is refused and changes nothing.
        upstream = Connection(second, secret=configs[0].secret)
        with pytest.raises(Refused, match="snapshot without chain_hello"):
            upstream.call({"op": "snapshot", "job_id": 1, "seq": 3, "version": 2, "model_bytes": 0}, b"{}")
        assert upstream.call({"op": "chain_hello", "job_id": 1, "head": 3})[0]["seq"] == 0
        for header, blob, reason in [
            ({"model_bytes": 8}, b"\0" * 4, "bad seq 3, version 2 or model size 8"),
            ({"model_bytes": 0}, b"not json", "JSONDecodeError"),
            ({"model_bytes": 0}, b'{"outcomes": {}}', "KeyError: 'log'"),
            ({"model_bytes": 4, "initialized": True}, np.array([np.inf], np.float32).tobytes() + b"{}",
             "the model must be non-empty and finite"),
        ]:
            with pytest.raises(Refused, match=re.escape(reason)):
                upstream.call({"op": "snapshot", "job_id": 1, "seq": 3, "version": 2, **header}, blob)
        upstream.close()
        assert b.seq == 0 and b.model is None and not b._caught_up and b.stats.snapshots_installed == 0
        assert a.join(ps) == {"ok": True, "role": "primary", "seq": 0, "rejoined": False}
        _wait_for(lambda: a._caught_up, what="a to catch up")
        with pytest.raises(Refused, match=r"not the tail of the chain \(it forwards to 127.0.0.1:\d+\); join the tail"):
            b.join(ps)
        assert a.join(ps)["rejoined"]  # the same successor again (say it restarted): its forwarder catches it up
        assert b.join(first)["rejoined"] is False  # the tail: ps -> a -> b
        client = FabricClient([ps], 1, 0, failover_timeout=5, secret=configs[0].secret)
        client.hello()
        client.init(np.ones(3, np.float32))
        assert client.push("0:0", 0, np.ones(3, np.float32))["outcome"] == "applied"
        _same_state(head, a)
        _same_state(head, b)
        client.close()
    finally:
        for node in (head, a, b):
            node.stop()


def test_a_node_restarted_in_its_old_role_sends_workers_on_to_the_promoted_replica():
    primary, replica, configs = _chain()
    stale = None
    try:
        client = FabricClient.from_config(configs[0], failover_timeout=10)
        client.hello()
        client.init(np.zeros(2, np.float32))
        assert client.push("0:0", 0, np.ones(2, np.float32))["outcome"] == "applied"
        primary.stop()
        assert client.push("0:1", 1, np.ones(2, np.float32))["outcome"] == "applied" and client.current == 1
        # The old primary comes back empty as a primary (not with --join): its successor is a primary now.
        stale = FabricServer(configs[0], gate_timeout=0).start()
        assert stale.forwarder is not None
        _wait_for(lambda: stale.forwarder.superseded, what="the stale primary to learn it was replaced")
        fresh = FabricClient.from_config(configs[1], failover_timeout=10)
        assert fresh.push("1:0", 2, np.ones(2, np.float32))["outcome"] == "applied"
        assert fresh.current == 1 and replica.version == 3 and stale.model is None
        client.close()
        fresh.close()
    finally:
        for node in (primary, replica, stale):
            if node is not None:
                node.stop()


def test_the_workers_fast_digits_loader_gives_the_examples_data():
    from examples.mlp_digits import load_digits_dataset

    fast, reference = load_digits_fast(3), load_digits_dataset(3)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        a, b = getattr(fast, name), getattr(reference, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name


def test_an_operator_unlinks_a_dead_replica_and_the_job_goes_on_then_a_fresh_node_rejoins(tmp_path, capsys):
    from netagg.mlfabric import chainctl

    configs = loopback_configs(2, update_mode="async", delay_bound=5, replicas=1)
    ps, replica_at = configs[0].ps.as_tuple(), configs[0].replicas[0].as_tuple()
    path = tmp_path / "rank0.yaml"
    configs[0].save(path)
    replica = FabricServer(configs[0], replica=0, gate_timeout=0, ack_timeout=1).start()
    primary = FabricServer(configs[0], gate_timeout=0, ack_timeout=1).start()
    rejoined = None
    try:
        client = FabricClient([ps], 1, 0, failover_timeout=5, secret=configs[0].secret)
        client.hello()
        client.init(np.zeros(4, np.float32))
        g = np.ones(4, np.float32)
        assert client.push("0:0", 0, g)["outcome"] == "applied"
        assert chainctl.main(["--config", str(path), "status"]) == 0
        assert "-> 127.0.0.1" in capsys.readouterr().out
        replica.stop()  # the replica dies: with a lag bound the job cannot go on ...
        with pytest.raises(Refused, match=r"not (applied|acknowledged|safe)"):
            client.push("0:1", 1, g)
        assert chainctl.main(["--config", str(path), "status"]) == 1  # ... and status shows why
        out = capsys.readouterr().out
        assert "unreachable" in out and "primary" in out
        # Refused: the wrong successor, and (no secret) a stranger.
        bad = dataclasses.replace(configs[0], secret="")
        with pytest.raises(Refused, match="successor is"):
            chainctl.unlink(configs[0], ps, ("127.0.0.1", 9))
        with pytest.raises(Refused, match="wrong or missing job secret"):
            chainctl.unlink(bad, ps, replica_at)
        assert primary.forwarder is not None
        # The operator drops the dead replica: pushes are applied again (the retried one once).
        assert chainctl.main(["--config", str(path), "unlink", "--node", f"{ps[0]}:{ps[1]}",
                              "--successor", f"{replica_at[0]}:{replica_at[1]}"]) == 0
        assert primary.forwarder is None and primary.stats.unlinks == 1
        retried = client.push("0:1", 1, g)
        assert retried["outcome"] == "applied"
        assert client.push("0:2", primary.version, g)["outcome"] == "applied"
        assert [e.update_id for e in primary.log].count("0:1") == 1
        # A fresh node on the replica's endpoint joins the primary (now the tail) and catches up.
        rejoined = FabricServer(configs[0], replica=0, joining=True, gate_timeout=0, ack_timeout=5).start()
        rejoined.join(ps)
        _wait_for(lambda: rejoined._caught_up and rejoined.seq == primary.seq, what="the new replica to catch up")
        assert client.push("0:3", primary.version, g)["outcome"] == "applied"
        _wait_for(lambda: rejoined.seq == primary.seq, what="replication to resume")
        _same_state(primary, rejoined)
        client.close()
    finally:
        for node in (rejoined, primary, replica):
            if node is not None:
                node.stop()


# -- a chain that keeps itself (peer_timeout): docs/mlfabric.md, "Replication (chain) and failover" --------------
PEER_TIMEOUT = 0.5


def _three(peer_timeout: float = PEER_TIMEOUT, **options) -> tuple[list[FabricServer], list]:
    """A 3-node chain in-process (primary, replica 0, replica 1), started tail first."""
    configs = loopback_configs(2, update_mode="async", delay_bound=5, replicas=2)
    nodes = [FabricServer(configs[0], replica=i, gate_timeout=0, peer_timeout=peer_timeout, **options)
             for i in (1, 0)]
    nodes.reverse()
    for node in nodes[::-1]:
        node.start()
    primary = FabricServer(configs[0], gate_timeout=0, peer_timeout=peer_timeout, **options).start()
    return [primary, *nodes], configs


def _client(configs, rank: int = 0) -> FabricClient:
    client = FabricClient.from_config(configs[rank], failover_timeout=10)
    client.hello()
    return client


def test_a_dead_tail_is_removed_after_the_peer_timeout_and_the_waiting_push_is_acknowledged():
    (primary, middle, tail), configs = _three(ack_timeout=10)
    try:
        client = _client(configs)
        client.init(np.zeros(3, np.float32))
        g = np.ones(3, np.float32)
        assert client.push("0:0", 0, g)["outcome"] == "applied"
        _same_state(primary, tail)
        tail.stop()  # as dead as a killed process to its predecessor: connections refused
        # The push waits (the middle cannot have it acknowledged) until the middle removes its dead successor,
        # then it is acknowledged by the shorter chain: no error, applied once.
        assert client.push("0:1", 1, g)["outcome"] == "applied"
        assert middle.stats.successors_lost == 1 and middle.stats.bypasses == 0 and middle.stats.unlinks == 0
        assert middle._live_forwarder() is None and primary.forwarder.successor == middle.address
        assert client.push("0:2", 2, g)["outcome"] == "applied"
        _same_state(primary, middle)
        state = chainctl.node_status(middle.address, configs[0])
        assert state["successor"] is None and state["successors_lost"] == 1
        client.close()
    finally:
        for node in (primary, middle, tail):
            node.stop()


def test_a_dead_middle_node_is_bypassed_to_its_successor_which_gets_only_what_it_lacks():
    (primary, middle, tail), configs = _three(ack_timeout=10)
    try:
        client = _client(configs)
        client.init(np.zeros(3, np.float32))
        g = np.ones(3, np.float32)
        for step in range(3):
            assert client.push(f"0:{step}", step, g)["outcome"] == "applied"
        assert primary.forwarder.next_successor == tail.address  # learnt from the middle's answers
        middle.stop()
        assert client.push("0:3", 3, g)["outcome"] == "applied"
        assert primary.stats.successors_lost == primary.stats.bypasses == 1
        assert primary.forwarder.successor == tail.address and not primary.forwarder.detached
        assert primary.forwarder.snapshots_sent == 0  # the tail had everything but the last record: resent
        assert client.push("0:4", 4, g)["outcome"] == "applied"
        _same_state(primary, tail)
        assert [e.update_id for e in tail.log] == [f"0:{s}" for s in range(5)]
        nodes = {tuple(n["endpoint"]): n for n in chainctl.chain_status(configs[0], timeout=1)}
        view = chainctl.live_chain(nodes)
        assert view.order == [primary.address, tail.address] and view.tail == tail.address
        client.close()
    finally:
        for node in (primary, middle, tail):
            node.stop()


def test_a_replica_is_not_promoted_while_a_primary_answers_and_of_two_candidates_only_one_is():
    (primary, middle, tail), configs = _three(peer_timeout=0)
    try:
        client = _client(configs)
        client.init(np.zeros(2, np.float32))
        assert client.push("0:0", 0, np.ones(2, np.float32))["outcome"] == "applied"
        # The middle drops the (live) tail: the tail, caught up, has no upstream now, yet a primary answers.
        chainctl.unlink(configs[0], middle.address, tail.address)
        _wait_for(lambda: tail._upstream == 0, what="the tail to lose its upstream")
        to_tail = Connection(tail.address, secret=configs[0].secret)
        with pytest.raises(Refused, match=r"not promoted: 127.0.0.1:\d+ is the primary"):
            to_tail.call({"op": "promote", "job_id": 1})
        assert tail.stats.promotions_refused == 1
        # The primary dies: the middle and the tail are both candidates, level (same record). Only the one
        # earlier in the configured chain takes over; the other refuses, whichever is asked first.
        primary.stop()
        _wait_for(lambda: middle._upstream == 0, what="the middle to lose its upstream")
        with pytest.raises(Refused, match=r"has no upstream either and is further along .* it takes over"):
            to_tail.call({"op": "promote", "job_id": 1})
        assert Connection(middle.address, secret=configs[0].secret).call(
            {"op": "promote", "job_id": 1})[0]["promoted"]
        with pytest.raises(Refused, match="is the primary"):
            to_tail.call({"op": "promote", "job_id": 1})
        to_tail.close()
        client.close()
    finally:
        for node in (primary, middle, tail):
            node.stop()


def test_chain_state_answers_while_an_apply_holds_the_lock_waiting_for_a_dead_successor():
    primary, replica, configs = _chain(ack_timeout=2, max_lag=1)
    try:
        client = FabricClient([configs[0].ps.as_tuple()], 1, 0, failover_timeout=10, secret=configs[0].secret)
        client.hello()
        client.init(np.zeros(2, np.float32))
        replica.stop()
        done: dict = {}
        pushers = [threading.Thread(target=lambda s=s: done.setdefault(s, _try_push(client, s))) for s in (0, 1)]
        pushers[0].start()  # applied, waits for an acknowledgement ...
        _wait_for(lambda: primary.version == 1, what="the first push to be applied")
        pushers[1].start()  # ... so this one waits for room, holding the apply lock
        _wait_for(lambda: _held(primary._cond), what="the apply lock to be held")
        state = chainctl.node_status(configs[0].ps.as_tuple(), configs[0], timeout=1)
        assert state["reachable"] and state["role"] == "primary" and state["lag"] == 1  # answered, not timed out
        assert _held(primary._cond)
        for t in pushers:
            t.join(10)
        client.close()
    finally:
        primary.stop()
        replica.stop()


def _held(cond: threading.Condition) -> bool:
    """Whether another thread holds ``cond``'s lock."""
    if cond.acquire(blocking=False):
        cond.release()
        return False
    return True


def _try_push(client: FabricClient, step: int):
    try:
        return client.push(f"0:{step}", step, np.ones(2, np.float32))
    except Refused as err:
        return str(err)


def test_a_replica_left_out_of_the_chain_rejoins_the_tail_by_itself():
    configs = loopback_configs(2, update_mode="async", delay_bound=5, replicas=1)
    replica = FabricServer(configs[0], replica=0, gate_timeout=0, peer_timeout=PEER_TIMEOUT).start()
    primary = FabricServer(configs[0], gate_timeout=0, peer_timeout=PEER_TIMEOUT).start()
    try:
        client = _client(configs)
        client.init(np.zeros(2, np.float32))
        g = np.ones(2, np.float32)
        assert client.push("0:0", 0, g)["outcome"] == "applied"
        # A second upstream is refused: one predecessor per node.
        other = Connection(replica.address, secret=configs[0].secret)
        with pytest.raises(Refused, match="another upstream node forwards to this node"):
            other.call({"op": "chain_hello", "job_id": 1, "head": 0})
        other.close()
        # The primary drops its (live) successor, which goes on training alone; the replica, without upstream
        # for the peer timeout and not in the primary's chain, joins it as its tail and is brought up to date.
        chainctl.unlink(configs[0], primary.address, replica.address)
        for step in (1, 2):
            assert client.push(f"0:{step}", step, g)["outcome"] == "applied"
        _wait_for(lambda: replica.stats.rejoins == 1 and replica._caught_up and replica.seq == primary.seq,
                  what="the replica to rejoin and catch up")
        assert primary._live_forwarder() is not None and primary.forwarder.successor == replica.address
        assert client.push("0:3", 3, g)["outcome"] == "applied"
        _same_state(primary, replica)
        client.close()
    finally:
        primary.stop()
        replica.stop()
