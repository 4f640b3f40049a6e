"""The MLfabric PS: bounded-delay async updates (real processes), sync rounds, aggregation, bad input."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from itertools import pairwise

import numpy as np
import pytest

from netagg.mlfabric.aggregation import AggregationService
from netagg.mlfabric.async_server import FabricServer, OutcomeWindow
from netagg.mlfabric.protocol import Connection, Refused
from netagg.mlfabric.training import WorkerReport, _send, run_worker
from netagg.mlfabric.worker import FabricClient, Unavailable
from netagg.testing.mlfabric import collect, loopback_configs, start_ps, start_workers, stop, write_configs

pytestmark = pytest.mark.timeout(120)

BOUND = 3


@pytest.mark.slow
def test_a_slow_workers_stale_updates_are_dropped_and_no_applied_update_exceeds_the_bound(tmp_path):
    configs = loopback_configs(4, update_mode="async", delay_bound=BOUND)
    paths = write_configs(configs, tmp_path)
    ps = start_ps(paths[0], tmp_path / "ps.log")
    try:
        # Ranks 0-2 take 50 ms a step; rank 3 takes 1.5 s more per step, so that even a busy machine runs
        # more than the bound's updates of the others meanwhile (at 0.5 s, one loaded run in several got none
        # of rank 3's updates dropped). The others' 50 ms keep them running past rank 3's first push: with
        # none, an idle machine ran all their 120 updates before rank 3's first pull, and none of its updates
        # was stale (one run in five).
        args = [["--steps", "40", "--compute-delay", "0.05"]] * 3 + [["--steps", "5", "--compute-delay", "1.5"]]
        reports = collect(start_workers(paths, args), timeout=100)
        observer = FabricClient.from_config(configs[0], observer=True)
        stats, _ = observer.stats(log=True)
        observer.close()
    finally:
        stop(ps)
    counters = stats["stats"]
    # The PS recorded the delay of every applied update: none above the bound.
    assert stats["max_delay"] <= BOUND
    assert all(0 <= entry["delay"] <= BOUND for entry in stats["log"])
    assert len(stats["log"]) == counters["applied"] == stats["version"]
    histogram = {int(d): n for d, n in stats["delay_histogram"].items()}
    assert max(histogram) == stats["max_delay"] and sum(histogram.values()) == counters["applied"]
    # The slow worker's updates were dropped (and counted for it) ...
    assert counters["dropped_by_rank"].get("3", 0) > 0
    assert reports[3]["dropped"] == counters["dropped_by_rank"]["3"]
    # ... while the fast ones mostly got through.
    assert sum(counters["applied_by_rank"].get(str(r), 0) for r in range(3)) > 60
    # Every push was either applied or dropped, and the workers agree with the PS.
    assert counters["applied"] + counters["dropped"] == counters["pushes"] == sum(r["pushed"] for r in reports)
    assert sorted(a for r in reports for a in r["acked"]) == sorted(e["update_id"] for e in stats["log"])
    for report in reports:
        assert report["errors"] == 0 and all(d <= BOUND for d in report["delays"])
    # Training went somewhere: the fast workers' last minibatch loss is well below the initial ~2.3.
    assert max(r["last_loss"] for r in reports[:3]) < 1.5
    # The job had a secret (every request carried it) and it is in no log line, report or stats answer.
    assert configs[0].secret and counters["bad_secret"] == 0
    assert configs[0].secret not in (tmp_path / "ps.log").read_text() + json.dumps(reports) + json.dumps(stats)


@pytest.mark.slow
def test_the_scheduled_job_grants_non_overlapping_slots_and_keeps_the_bound(tmp_path):
    configs = loopback_configs(4, update_mode="async", delay_bound=BOUND, schedule="mlfabric")
    paths = write_configs(configs, tmp_path)
    ps = start_ps(paths[0], tmp_path / "ps.log")
    try:
        args = [["--steps", "25"]] * 3 + [["--steps", "8", "--compute-delay", "0.2"]]
        reports = collect(start_workers(paths, args), timeout=100)
        observer = FabricClient.from_config(configs[0], observer=True)
        stats, _ = observer.stats()
        observer.close()
    finally:
        stop(ps)
    assert stats["max_delay"] <= BOUND
    scheduler = stats["scheduler"]
    slots = scheduler["ps_slots"]
    assert len(slots) == scheduler["sent"] + scheduler["groups"] > 0
    # Slots on the PS's link never overlap (batch after batch, each batch back to back).
    for (_, end), (start, _) in pairwise(slots):
        assert start >= end - 1e-9
    # Each request was sent, aggregated or dropped by the scheduler, and the workers saw the same.
    assert sum(r["scheduler_dropped"] for r in reports) == scheduler["dropped"]
    assert sum(r["aggregated"] for r in reports) == scheduler["aggregated"]
    assert sum(r["steps"] for r in reports) == scheduler["sent"] + scheduler["aggregated"] + scheduler["dropped"]
    assert all(r["errors"] == 0 for r in reports)


def _server(num_workers: int = 3, **options) -> tuple[FabricServer, list]:
    configs = loopback_configs(num_workers, **{k: options.pop(k) for k in list(options)
                                               if k in ("update_mode", "delay_bound", "schedule", "replicas")})
    return FabricServer(configs[0], **options).start(), configs


def test_async_updates_apply_sgd_exactly_drop_stale_ones_and_deduplicate():
    server, configs = _server(2, update_mode="async", delay_bound=1, lr=0.5, gate_timeout=0)
    try:
        a, b = (FabricClient.from_config(c) for c in configs)
        a.hello()
        assert a.init(np.ones(4, np.float32)) and not b.init(np.zeros(4, np.float32))
        version, model, _ = b.pull()
        assert version == 0 and np.array_equal(model, np.ones(4, np.float32))
        g = np.array([1, 2, 3, 4], np.float32)
        assert a.push("0:0", 0, g)["outcome"] == "applied"
        assert b.push("1:0", 0, g)["delays"] == [1]  # one update applied since b's pull: delay 1 <= 1
        dropped = a.push("0:1", 0, g)  # computed on version 0, the PS is at 2: delay 2 > 1
        assert dropped["outcome"] == "dropped" and "delay 2 > bound 1" in dropped["reason"]
        again = a.push("0:0", 0, g)  # a retried push is not applied twice
        assert again["outcome"] == "applied" and again["duplicate"]
        version, model, _ = a.pull()
        assert version == 2
        np.testing.assert_array_equal(model, np.ones(4, np.float32) - 0.5 * g - 0.5 * g)
        assert server.stats.dropped_by_rank[0] == 1 and server.stats.duplicates == 1
        assert [(e.update_id, e.delay) for e in server.log] == [("0:0", 0), ("1:0", 1)]
        # An aggregate of two gradients counts two versions and is applied (or dropped) as a whole.
        agg = a.push("agg1", 2, 2 * g, parts=[["0:2", 0, 2], ["1:1", 1, 1]])
        assert agg["outcome"] == "applied" and agg["delays"] == [0, 1] and a.pull()[0] == 4
        assert server.stats.aggregated_applies == 1
        stale = a.push("agg2", 2, g, parts=[["0:3", 0, 4], ["1:2", 1, 2]])
        assert stale["outcome"] == "dropped" and server.stats.dropped == 3
        a.close()
        b.close()
    finally:
        server.stop()


def test_memory_stays_bounded_an_old_id_is_refused_and_a_recent_one_is_still_a_duplicate():
    server, configs = _server(2, update_mode="async", delay_bound=100, lr=1.0, gate_timeout=0, outcome_window=4,
                              log_size=8)
    try:
        a, b = (FabricClient.from_config(c) for c in configs)
        a.hello()
        a.init(np.zeros(3, np.float32))
        g = np.ones(3, np.float32)
        for step in range(20):  # 5 times the outcome window, 2.5 times the log
            assert a.push(f"0:{step}", a.pull()[0], g)["outcome"] == "applied"
        assert b.push("1:0", 0, g)["delays"] == [20]
        stats, _ = a.stats(log=True)
        # The log is a ring of the last 8 and rank 0 keeps 4 outcomes; the counters still count everything.
        assert [e["update_id"] for e in stats["log"]] == [f"0:{s}" for s in range(13, 20)] + ["1:0"]
        assert stats["logged"] == stats["log_size"] == 8 and len(server.log) == 8
        assert stats["outcomes_kept"] == 4 + 1 and sorted(server._outcomes.get(0, s) is not None
                                                          for s in range(20)) == [False] * 16 + [True] * 4
        assert stats["stats"]["applied"] == stats["version"] == 21
        assert stats["stats"]["applied_by_rank"] == {"0": 20, "1": 1}
        assert stats["delay_histogram"] == {"0": 20, "20": 1} and stats["max_delay"] == 20
        # A step older than the window is refused (it cannot be told from a new one), not applied again.
        with pytest.raises(Refused, match=r"\['0:3'\] are older than the last 4 steps"):
            a.push("0:3", 3, g)
        assert server.version == 21 and server.stats.expired_ids == 1
        # A recent step is still answered with its first outcome.
        again = a.push("0:17", 17, g)
        assert again["outcome"] == "applied" and again["duplicate"] and again["version"] == 18
        # A step inside the window that was never pushed is new; the window follows the newest step.
        assert a.push("0:25", 21, g)["outcome"] == "applied"
        assert a.push("0:23", 22, g)["outcome"] == "applied"
        with pytest.raises(Refused, match="older than the last 4 steps"):
            a.push("0:21", 23, g)
        # Kept: 0:23 and 0:25 (steps 22 and 24 were never pushed), and 1:0.
        assert server.version == 23 and len(server.log) == 8 and len(server._outcomes) == 2 + 1
        np.testing.assert_array_equal(server.model, np.full(3, -23.0, np.float32))
        # The window survives a state transfer, into a node that keeps fewer steps: the newest ones.
        smaller = OutcomeWindow.from_json(1, json.loads(json.dumps(server._outcomes.to_json())))
        assert smaller.get(0, 25) == server._outcomes.get(0, 25) and smaller.get(0, 23) is None
        assert smaller.expired(0, 24) and not smaller.expired(0, 26) and smaller.get(1, 0) is not None
        a.close()
        b.close()
    finally:
        server.stop()


def test_sync_rounds_apply_the_mean_once_every_worker_pushed():
    server, configs = _server(3, update_mode="sync", lr=0.3)
    try:
        clients = [FabricClient.from_config(c) for c in configs]
        for c in clients:
            c.hello()
        clients[0].init(np.zeros(5, np.float32))
        grads = [np.full(5, r + 1.0, np.float32) for r in range(3)]
        outcomes = [None] * 3

        def push(rank: int) -> None:
            outcomes[rank] = clients[rank].push(f"{rank}:0", 0, grads[rank])

        threads = [threading.Thread(target=push, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert all(o["outcome"] == "applied" and o["version"] == 3 for o in outcomes)
        assert server.stats.applies == 1 and server.version == 3
        _, model, _ = clients[1].pull()
        np.testing.assert_allclose(model, np.full(5, -0.3 * 2.0, np.float32), rtol=1e-6)
        # A push for a round that is over is dropped, not mixed into the next one.
        late = clients[2].push("2:1", 0, grads[2])
        assert late["outcome"] == "dropped" and "round 0 is over" in late["reason"]
        for c in clients:
            c.close()
    finally:
        server.stop()


def test_updates_queued_behind_the_link_are_aggregated_at_an_idle_worker():
    # 4 workers: 0-2 ask to send at once; 3 is idle and aggregates. Measured bandwidths: 100 kB/s for
    # the senders, 400 kB/s for worker 3, so a 10 kB update takes 0.1 s (0.025 s from worker 3).
    server, configs = _server(4, update_mode="async", delay_bound=10, schedule="mlfabric", lr=1.0,
                              batch_window=1.0, gate_timeout=0)
    assert server.grants is not None
    size = 2500
    initial = np.zeros(size, np.float32)
    grads = [np.full(size, 10.0 ** r, np.float32) for r in range(3)]
    try:
        with AggregationService(lambda: FabricClient.from_config(configs[3]), 1, ("127.0.0.1", 0),
                                secret=configs[3].secret) as agg:
            idle = FabricClient.from_config(configs[3], agg=agg.address)
            idle.hello()
            idle.init(initial)
            for rank in range(3):
                server.grants.observe(rank, 100_000, 1.0)
            server.grants.observe(3, 400_000, 1.0)
            clients = [FabricClient.from_config(c) for c in configs[:3]]
            reports = [WorkerReport(rank) for rank in range(3)]
            outcomes = [None] * 3

            def send(rank: int) -> None:
                clients[rank].hello()
                version = clients[rank].pull()[0]
                outcomes[rank] = _send(clients[rank], reports[rank], "mlfabric", f"{rank}:0", version, grads[rank])

            threads = [threading.Thread(target=send, args=(r,)) for r in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            scheduler = server.grants.stats
            assert scheduler.batches == 1 and scheduler.groups == 1
            assert scheduler.sent == 1 and scheduler.aggregated == 2
            # Equal transfer times, so the largest norm (rank 2) goes first, direct; the two queued behind it
            # are summed at worker 3, which is faster to the PS than sending them one by one.
            assert all(o is not None and o["outcome"] == "applied" for o in outcomes)
            assert server.version == 3 and server.stats.applies == 2 and server.stats.aggregated_applies == 1
            assert [r.aggregated for r in reports] == [1, 1, 0]
            assert agg.stats.groups == 1 and agg.stats.members == 2 and agg.stats.partial_groups == 0
            np.testing.assert_allclose(server.model, -(grads[0] + grads[1] + grads[2]), rtol=1e-6)
            seqs = {e.update_id: e.seq for e in server.log}
            aggregated = [f"{r}:0" for r in range(3) if reports[r].aggregated]
            assert seqs[aggregated[0]] == seqs[aggregated[1]]
            for c in [*clients, idle]:
                c.close()
    finally:
        server.stop()


def test_bad_input_gets_a_clear_error_or_a_counted_drop_and_the_ps_keeps_serving():
    server, configs = _server(2, update_mode="async", delay_bound=2, frame_timeout=0.5, gate_timeout=0)
    address = configs[0].ps.as_tuple()
    try:
        conn = Connection(address, timeout=5, secret=configs[0].secret)

        def refused(header: dict, blob: bytes = b"") -> str:
            with pytest.raises(Refused) as info:
                conn.call(header, blob)
            return str(info.value)

        assert "unknown worker: rank 7" in refused({"op": "hello", "job_id": 1, "rank": 7})
        assert "unknown worker: rank 'x'" in refused({"op": "pull", "job_id": 1, "rank": "x"})
        assert "this PS serves job 1" in refused({"op": "hello", "job_id": 2, "rank": 0})
        assert "unknown op 'frobnicate'" in refused({"op": "frobnicate", "job_id": 1, "rank": 0})
        assert "before the model was initialized" in refused(
            {"op": "push", "job_id": 1, "rank": 0, "update_id": "0:0", "version": 0}, b"\0" * 16)
        conn.call({"op": "init", "job_id": 1, "rank": 0}, np.zeros(4, np.float32).tobytes())
        assert "expected 4 float32 values, got 3" in refused(
            {"op": "push", "job_id": 1, "rank": 0, "update_id": "0:0", "version": 0}, b"\0" * 12)
        assert "NaN or Inf" in refused({"op": "push", "job_id": 1, "rank": 0, "update_id": "0:0", "version": 0},
                                       np.array([0, np.nan, 0, 0], np.float32).tobytes())
        assert "version 9 is not one this PS had" in refused(
            {"op": "push", "job_id": 1, "rank": 0, "update_id": "0:0", "version": 9}, b"\0" * 16)
        assert "update id 'u': expected '0:<step>'" in refused(
            {"op": "push", "job_id": 1, "rank": 0, "update_id": "u", "version": 0}, b"\0" * 16)
        assert "update id '1:0': expected '0:<step>'" in refused(
            {"op": "push", "job_id": 1, "rank": 0, "update_id": "1:0", "version": 0}, b"\0" * 16)
        assert "unknown worker: rank 5 in parts" in refused(
            {"op": "push", "job_id": 1, "rank": 0, "update_id": "0:0", "version": 0, "parts": [["5:0", 5, 0]]},
            b"\0" * 16)
        assert "push without asking" in refused({"op": "request", "job_id": 1, "rank": 0, "update_id": "0:0",
                                                 "version": 0, "size": 16})
        assert "replicate without chain_hello" in refused({"op": "replicate", "job_id": 1, "seq": 1})
        assert server.stats.unknown_workers == 3 and server.stats.bad_requests >= 12
        # Garbage that is not a frame: that connection is closed and counted, nobody else is affected.
        with socket.create_connection(address, timeout=5) as raw:
            raw.sendall(struct.pack("!II", 5, 0) + b"{nope")
            assert raw.recv(100) == b""
        # A frame cut off mid-way: the PS gives up on it after its frame timeout.
        with socket.create_connection(address, timeout=5) as raw:
            raw.sendall(struct.pack("!II", 1000, 0) + b'{"op":')
            assert raw.recv(100) == b""
        deadline = time.monotonic() + 5
        while server.stats.malformed_frames < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stats.malformed_frames == 2
        response, data = conn.call({"op": "pull", "job_id": 1, "rank": 1})
        assert response["version"] == 0 and len(data) == 16
        conn.close()
        # A client of a dead PS gets a clear error in bounded time.
        dead = FabricClient([("127.0.0.1", 9)], 1, 0, timeout=1, failover_timeout=0.5)
        with pytest.raises(Unavailable, match="no primary"):
            dead.pull()
    finally:
        server.stop()


def test_a_fault_inside_a_handler_is_answered_and_the_connection_keeps_serving():
    # A server's own fault must not look like a broken connection: clients fail over from those, retrying
    # into the same fault. It is answered as an internal error, told to on_error, and the next request works.
    from netagg.framed_server import FramedServer, listen

    errors: list[str] = []

    def handle(frame):
        if frame.header.get("op") == "boom":
            raise RuntimeError("a bug")
        return {"ok": True, "echo": frame.header.get("n")}, b""

    server = FramedServer(listen(("127.0.0.1", 0)), lambda: (handle, None), name="test",
                          on_error=errors.append).start()
    conn = Connection(server.address, timeout=5)
    try:
        with pytest.raises(Refused, match="internal error: RuntimeError: a bug"):
            conn.call({"op": "boom"})
        assert conn.call({"op": "echo", "n": 7})[0]["echo"] == 7  # the same connection, still served
        assert errors == ["internal error: RuntimeError: a bug"]
    finally:
        conn.close()
        server.stop()


class _StallingRelay:
    """A TCP relay to ``target`` whose first connection goes silent (forwards nothing, either way) once
    ``stall_after`` bytes went up: a connection whose network stalled mid-push. Later connections relay."""

    def __init__(self, target: tuple[str, int], stall_after: int) -> None:
        self.target = target
        self.stall_after = stall_after
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.connections = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            upstream = socket.create_connection(self.target)
            self._sockets += [conn, upstream]
            self.connections += 1
            limit = self.stall_after if self.connections == 1 else None
            for src, dst, cap in ((conn, upstream, limit), (upstream, conn, None)):
                thread = threading.Thread(target=self._pump, args=(src, dst, cap), daemon=True)
                thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket, cap: int | None) -> None:
        moved = 0
        src.settimeout(0.2)
        while not self._stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            if cap is not None:
                data = data[:max(0, cap - moved)]
                if not data:  # stalled: swallow the rest, as a dead path would
                    continue
            moved += len(data)
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        for sock in self._sockets:
            sock.close()


def test_a_push_whose_connection_stalls_past_the_failover_timeout_is_sent_again_and_applied_once():
    """What `make soak-mlfabric` found: a push's one attempt outlasted the failover timeout (its connection
    stalled mid-frame), and the client gave up without sending it again."""
    server, configs = _server(1, update_mode="async", delay_bound=4, lr=1.0, gate_timeout=0, frame_timeout=1.0)
    relay = _StallingRelay(server.address, stall_after=100_000)
    try:
        setup = FabricClient.from_config(configs[0])
        setup.hello()
        setup.init(np.zeros(200_000, np.float32))
        setup.close()
        client = FabricClient([relay.address], configs[0].job_id, 0, secret=configs[0].secret, timeout=1.0,
                              failover_timeout=0.5)
        update = np.ones(200_000, np.float32)  # 800 kB: the first connection stalls after 100 kB of it
        outcome = client.push("0:0", 0, update, timeout=1.5)
        assert outcome["outcome"] == "applied" and not outcome.get("duplicate")
        assert relay.connections == 2 and "did not answer in time" in client.last_failure
        assert server.version == 1 and server.stats.applied == 1
        assert server.stats.malformed_frames == 1  # the cut frame: counted, not applied
        client.close()
    finally:
        relay.close()
        server.stop()


def test_a_worker_sends_the_initial_model_only_while_the_ps_has_none():
    server, configs = _server(2, update_mode="async", gate_timeout=0)
    try:
        sent = []

        class Counting(FabricClient):
            def init(self, model):
                sent.append(self.rank)
                return super().init(model)

        initial = np.arange(8, dtype=np.float32)

        def start(rank: int, **options) -> None:
            client = Counting.from_config(configs[rank])
            report = run_worker(client, lambda params, step: (0.0, np.zeros_like(params)), initial + rank, steps=0,
                                **options)
            client.close()
            assert not report.errors

        # Rank 1 starts first: it waits for rank 0's model instead of sending its own.
        late = threading.Thread(target=start, args=(1,))
        late.start()
        time.sleep(0.5)
        start(0)
        late.join(10)
        start(1)  # and a rank that starts after the model was set does not send one either
        assert sent == [0]
        assert np.array_equal(server.model, initial)
    finally:
        server.stop()


def test_without_rank_0_another_rank_initialises_the_model_after_its_wait():
    server, configs = _server(2, update_mode="async", gate_timeout=0)
    try:
        initial = np.arange(8, dtype=np.float32)
        client = FabricClient.from_config(configs[1])
        began = time.monotonic()
        report = run_worker(client, lambda params, step: (0.0, np.zeros_like(params)), initial, steps=0,
                            init_wait=0.5)
        client.close()
        assert not report.errors and time.monotonic() - began >= 0.5
        assert np.array_equal(server.model, initial)
    finally:
        server.stop()


def test_a_grant_wait_is_split_into_the_ps_hold_and_the_wire():
    # The PS says how long it held a request (``held``); the worker counts the rest of its wait as the wire's.
    server, configs = _server(2, update_mode="async", delay_bound=10, schedule="mlfabric", batch_window=0.3,
                              gate_timeout=0)
    try:
        client, other = FabricClient.from_config(configs[0]), FabricClient.from_config(configs[1])
        client.hello()
        other.hello()
        client.init(np.zeros(16, np.float32))
        asked = time.monotonic()
        decision = client.request("0:0", 0, 64, 1.0)
        waited = time.monotonic() - asked
        # Rank 1 never asks, so the batch waited out its window at the PS before the grant left.
        assert 0.25 <= decision["held"] <= waited
        client.close()
        other.close()
    finally:
        server.stop()

    class Held:
        def request(self, *args, **kwargs):
            time.sleep(0.3)
            return {"action": "drop", "reason": "test", "held": 0.25, "version": 0}

    report = WorkerReport(0)
    assert _send(Held(), report, "mlfabric", "0:0", 0, np.zeros(4, np.float32)) is None
    assert report.phase_seconds["grant"] >= 0.3
    assert 0.04 <= report.grant_wire_seconds <= report.phase_seconds["grant"] - 0.25 + 1e-9


def test_a_scheduler_drop_tells_the_worker_the_version_to_start_from():
    # A worker that takes its models from the switch starts its next step from the newest version it knows of: a
    # drop for the delay bound says the PS's version, or the worker starts again from the same old one.
    server, configs = _server(2, update_mode="async", delay_bound=1, schedule="mlfabric", batch_window=0.05,
                              gate_timeout=0)
    try:
        client, other = FabricClient.from_config(configs[0]), FabricClient.from_config(configs[1])
        client.hello()
        client.init(np.zeros(16, np.float32))
        g = np.ones(16, np.float32)
        for step in range(3):
            assert other.push(f"1:{step}", step, g)["outcome"] == "applied"
        decision = client.request("0:0", 0, 64, 1.0)
        assert decision["action"] == "drop" and "bound 1" in decision["reason"]
        assert decision["version"] == server.version == 3
        client.close()
        other.close()
    finally:
        server.stop()


def test_a_sync_ps_refuses_a_rest_push_and_its_round_is_untouched():
    # Only an async PS's switch groups leave rests; a short "rest" blob in a sync round would be summed with whole
    # gradients. It is refused before the round sees it.
    server, configs = _server(2, update_mode="sync", lr=1.0, gate_timeout=0)
    try:
        client = FabricClient.from_config(configs[0])
        client.hello()
        client.init(np.zeros(16, np.float32))
        with pytest.raises(Refused, match="rest"):
            client.push("0:0", 0, np.ones(4, np.float32), rest=True)
        client.close()
        assert server.version == 0 and server.stats.applied == 0 and not server._round
    finally:
        server.stop()


def test_a_worker_that_pulls_its_models_tells_the_scheduler_the_rate_of_its_pulls():
    """Without versions through the switch a worker's only measure of its path is its pulls: its requests carry
    their rate (bytes/s), so a batch does not wait for a slow one as if it were as fast as the others."""
    size = 250_000  # 1 MB of float32

    class Slow:
        rank, failovers = 0, 0

        def __init__(self):
            self.rates: list = []

        def hello(self):
            return {"initialized": True}

        def pull(self):
            time.sleep(0.2)  # 1 MB in 0.2 s: 5 MB/s at most
            return 0, np.zeros(size, np.float32), False

        def request(self, update_id, version, nbytes, norm, rate=None, receiving=None):
            assert receiving is None  # no distribution: nothing to say about it
            self.rates.append(rate)
            return {"action": "drop", "reason": "test", "version": 0}

    client = Slow()
    report = run_worker(client, lambda params, step: (0.0, np.ones_like(params)), np.zeros(size, np.float32),
                        steps=3, schedule="mlfabric")
    assert report.pulls == 3 and len(client.rates) == 3
    # Not the first pull's: every worker pulls the first model at once, and that says nothing of its own link.
    assert client.rates[0] is None
    assert all(r is not None and 0 < r <= 5e6 for r in client.rates[1:])  # at most 1 MB in 0.2 s; slower loaded
