"""Model distribution through the switch: each version sent once, copied by the switch, repaired over TCP."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from itertools import pairwise

import numpy as np
import pytest

from netagg import wire
from netagg.mlfabric import distribution
from netagg.mlfabric.async_server import FabricServer
from netagg.mlfabric.distribution import DistributionLayout, ModelCache, ModelSender
from netagg.mlfabric.protocol import Refused
from netagg.mlfabric.training import WorkerReport, _delivered, _step, run_worker
from netagg.mlfabric.worker import FabricClient
from netagg.testing.mlfabric import loopback_configs

testing = pytest.importorskip("netagg.testing.softswitch")

pytestmark = pytest.mark.timeout(120)

SLOTS = 16
SIZE = 10_000  # 157 blocks


def test_rounds_grow_with_the_version_in_every_slot_and_seq_names_version_and_block():
    layout = DistributionLayout(SIZE, SLOTS)
    assert (layout.blocks, layout.uses) == (157, 10)
    slots = np.arange(layout.blocks) % SLOTS
    for version in (0, 1, 6553, 6554):  # 6554 * 10 wraps past 2**16
        now, later = layout.rounds(version), layout.rounds(version + 1)
        for slot in range(SLOTS):
            used = now[slots == slot]
            assert all(0 < (b - a) & 0xFFFF < 0x8000 for a, b in pairwise(used))  # each use is a new round
            assert 0 < (later[slots == slot][0] - used[-1]) & 0xFFFF < 0x8000  # and the next version's too
    seqs = layout.seqs(0x12345)
    assert seqs[0] == 0x23450000 and seqs[-1] == 0x23450000 + 156
    with pytest.raises(ValueError, match="blocks"):
        DistributionLayout(wire.K * 65537, SLOTS)


def _distribution_job(switch, receivers: int, senders: int = 1):
    """Receivers are ranks 0..n-1 of a job on the switch; the PS (chain) sends as its last rank(s), outside the
    group."""
    return switch.add_job(receivers + senders, slot_count=SLOTS, senders=senders)


@pytest.mark.parametrize("loss", [0.0, pytest.param(0.1, marks=pytest.mark.slow)])
def test_every_receiver_gets_the_newest_version_exactly_repairing_what_it_missed(loss):
    faults = {"drop": loss, "seed": 7} if loss else {}
    rng = np.random.default_rng(1)
    models = {v: rng.standard_normal(SIZE).astype(np.float32) for v in range(1, 5)}
    models[3][:5] = [np.nan, np.inf, -0.0, 1e-45, -3.4e38]  # bit patterns, not values, travel
    with testing.LoopbackSwitch(**faults) as switch:
        configs = _distribution_job(switch, 4)  # receivers 0..2 keep caches; 3 will try to forge a version
        sender = ModelSender(configs[4], rate=20e6)
        caches = [ModelCache(c, SIZE, batched=rank != 2) for rank, c in enumerate(configs[:3])]  # 2: one by one
        try:
            for version in (1, 2, 3):
                sender.publish(version, models[version])
                time.sleep(0.1)
            for cache in caches:
                got = cache.newest(2, wait=2.0, repair=sender.blocks)
                assert got is not None and got[0] == 3
                assert got[1].tobytes() == models[3].tobytes()
                assert cache.newest(3, wait=0.1, repair=sender.blocks) is None  # nothing newer yet
            # Another receiver sends "version 5" as a one-member round of its own: a receiver of the one-way
            # job may not send (UNKNOWN_WORKER), so nothing reaches the caches nor moves the slots' rounds.
            forged = ModelSender(configs[3], rate=20e6)
            forged.publish(5, np.zeros(SIZE, np.float32))
            time.sleep(0.3)
            forged.close()
            assert all(c.newest(3, wait=0.0) is None for c in caches)
            sender.publish(4, models[4])
            for cache in caches:
                got = cache.newest(3, wait=2.0, repair=sender.blocks)
                assert got is not None and got[1].tobytes() == models[4].tobytes()
            deadline = time.monotonic() + 10  # counted after the last packet and its pacing pause
            while sender.stats.versions_sent < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sender.stats.versions_sent == 4
            with pytest.raises(BlockingIOError):  # the PS sends only: no copy comes back to it
                sender.sock.recv(2048, socket.MSG_DONTWAIT)
            counters = switch.counters(configs[0].job_id)
            # One-member rounds: every packet that reached the switch completed its round at once.
            assert counters["results"] == counters["contributions"] > 0
            assert 0 < counters["rejects"] <= 157  # the forged version's packets
            if loss:
                assert sum(c.stats.versions_repaired for c in caches) > 0
                assert counters["contributions"] < 4 * 157
            else:
                assert counters["contributions"] == 4 * 157 and counters["rejects"] == 157
                assert all(c.stats.versions_repaired == 0 for c in caches)
        finally:
            for cache in caches:
                cache.close()
            sender.close()


def test_workers_start_their_steps_from_versions_the_switch_delivered():
    with testing.LoopbackSwitch() as switch:
        dist = _distribution_job(switch, 3)
        fabric = loopback_configs(3, update_mode="async", delay_bound=8)
        sender = ModelSender(dist[3], rate=20e6)
        server = FabricServer(fabric[0], lr=0.01, gate_timeout=0, distribution=sender).start()
        target = np.linspace(-1, 1, SIZE).astype(np.float32)
        reports: list = [None] * 3

        def grad_fn(params: np.ndarray, step: int):
            time.sleep(0.01)
            return float(np.sum((params - target) ** 2)), (params - target).astype(np.float32)

        def work(rank: int) -> None:
            client = FabricClient.from_config(fabric[rank])
            try:
                reports[rank] = run_worker(client, grad_fn, np.zeros(SIZE, np.float32), steps=30,
                                           distribution=dist[rank], local_wait=0.2)
            finally:
                client.close()

        try:
            threads = [threading.Thread(target=work, args=(r,)) for r in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            assert all(r is not None and r.errors == 0 for r in reports)
            assert sum(r.local_models for r in reports) > sum(r.pulls for r in reports)  # most steps: no pull
            assert all(r.pulls >= 1 for r in reports)  # the first step pulls
            assert server.stats.applied + server.stats.dropped == sum(r.pushed for r in reports) == 90
            assert server.max_delay is not None and server.max_delay <= 8
            assert sender.stats.versions_sent > 1
            # Every applied gradient was computed on a version the PS had: the log's versions are ones it held.
            assert all(0 <= e.version < e.seq + 1 for e in server.log)
        finally:
            server.stop()


class _HaltedScheduler:
    """A client whose scheduler drops the update and says the job is halted."""

    rank = 0

    def request(self, *args, **kwargs):
        return {"action": "drop", "reason": "predicted delay", "halted": True}


def test_a_worker_that_never_pulls_still_stops_when_the_job_halts():
    # Starting every step from delivered versions, a worker may never pull again: the scheduler's answer
    # (like a push's outcome) tells it the job is halted.
    report = WorkerReport(0)
    params = np.zeros(3, np.float32)
    assert not _step(_HaltedScheduler(), report, lambda p, s: (0.0, p), "mlfabric", None, 0.0, None, 0, 0, params)
    assert report.halted and report.scheduler_dropped == 1


def test_a_repair_request_is_checked_before_anything_is_copied():
    fabric = loopback_configs(1, update_mode="async", delay_bound=4)
    with testing.LoopbackSwitch() as switch:
        dist = _distribution_job(switch, 1)
        server = FabricServer(fabric[0], gate_timeout=0, distribution=ModelSender(dist[1], rate=20e6)).start()
        client = FabricClient.from_config(fabric[0])
        try:
            client.hello()
            client.init(np.zeros(SIZE, np.float32))
            assert client.model_blocks(99, [(0, 1)]) is None  # never sent: not found
            for ranges, message in (([[0, 1 << 17]], "more blocks"), ([[5, 5]], "ranges must be"),
                                    ([[0, 1]] * 70_000, "ranges must be"), (["x"], "ranges must be")):
                with pytest.raises(Refused, match=message):
                    client.call("model_blocks", {"version": 0, "ranges": ranges})
        finally:
            client.close()
            server.stop()


def test_after_a_failover_the_promoted_replica_sends_the_versions_as_itself():
    with testing.LoopbackSwitch() as switch:
        dist = _distribution_job(switch, 2, senders=2)  # ranks 2 and 3: the primary and its replica
        fabric = loopback_configs(2, update_mode="async", delay_bound=8, replicas=1)
        replica = FabricServer(fabric[0], replica=0, lr=0.5, gate_timeout=0,
                               distribution=ModelSender(dist[3], rate=20e6)).start()
        primary = FabricServer(fabric[0], lr=0.5, gate_timeout=0, distribution=ModelSender(dist[2], rate=20e6)).start()
        caches = [ModelCache(dist[r], SIZE) for r in range(2)]
        clients = [FabricClient.from_config(fabric[r], failover_timeout=20) for r in range(2)]
        try:
            clients[0].hello()
            clients[1].hello()
            clients[0].init(np.zeros(SIZE, np.float32))
            grad = np.linspace(-1, 1, SIZE).astype(np.float32)
            assert clients[0].push("0:0", 0, grad)["outcome"] == "applied"
            before = [c.newest(0, wait=5.0) for c in caches]
            assert all(b is not None and b[0] == 1 for b in before)  # version 1, from the primary
            primary.stop()
            # Rank 1's push fails over to the replica, which is promoted and sends version 2 as rank 3.
            # (The client may go round the endpoint list more than once while the replica makes sure no other
            # node is primary before it accepts the promotion: seen 3 failovers on a loaded machine.)
            assert clients[1].push("1:0", 1, grad)["outcome"] == "applied" and clients[1].failovers >= 1
            assert replica.role == "primary" and replica.version == 2
            for cache in caches:
                version, model = cache.newest(1, wait=5.0)
                assert version == 2 and np.array_equal(model.view(np.uint32), replica.model.view(np.uint32))
            # The sender counts a version after its last packet and pacing pause: the caches may be first.
            deadline = time.monotonic() + 10
            while replica.distribution.stats.versions_sent < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert replica.distribution.stats.versions_sent >= 1
            assert switch.counters(dist[0].job_id)["rejects"] == 0
        finally:
            for c in clients:
                c.close()
            for c in caches:
                c.close()
            primary.stop()
            replica.stop()


@contextlib.contextmanager
def _held_sender():
    """A sender and one receiver's cache on the switch; the sender holds its versions while the event is set (a
    switch group in flight)."""
    with testing.LoopbackSwitch() as switch:
        configs = _distribution_job(switch, 1)
        sender = ModelSender(configs[1], rate=50e6)
        cache = ModelCache(configs[0], SIZE)
        group = threading.Event()
        sender.hold = group.is_set
        try:
            yield sender, cache, group
        finally:
            cache.close()
            sender.close()


def test_a_version_waits_while_a_switch_group_is_in_flight_but_never_longer_than_the_hold_limit(monkeypatch):
    monkeypatch.setattr(distribution, "HOLD_LIMIT", 1.5)
    model = np.arange(SIZE, dtype=np.float32)
    with _held_sender() as (sender, cache, group):
        group.set()  # a group in flight: version 1 waits for it ...
        sender.publish(1, model)
        assert cache.newest(0, wait=0.3) is None
        group.clear()  # ... and leaves once it is over, well before the hold limit
        got = cache.newest(0, wait=3.0)
        assert got is not None and np.array_equal(got[1], model)
        assert 0.25 <= sender.stats.held_seconds < 1.4
        group.set()  # a group that does not end: version 2 waits the hold limit, then goes
        began = time.monotonic()
        sender.publish(2, model + 1)
        got = cache.newest(1, wait=6.0)
        assert got is not None and got[0] == 2 and np.array_equal(got[1], model + 1)
        assert 1.45 <= time.monotonic() - began < 5.0


def test_a_receiver_that_gets_versions_only_in_part_still_measures_the_rate_its_link_took_them_at():
    """Half of every packet lost: no version arrives whole, so no whole version's time gives the rate; the share
    that arrived, over the time it took, does (it is what the scheduler plans this worker's transfers with)."""
    with testing.LoopbackSwitch(drop=0.5, seed=3) as switch:
        configs = _distribution_job(switch, 1)
        rate = 1e6  # bytes/s: a version of 157 blocks takes about 40 ms
        sender = ModelSender(configs[1], rate=rate)
        cache = ModelCache(configs[0], SIZE)
        try:
            for version in (1, 2, 3):
                sender.publish(version, np.full(SIZE, version, np.float32))
                time.sleep(0.3)
            assert cache.stats.versions_complete == 0
            measured = cache.rate
            assert measured is not None and 0.1 * rate < measured < 2 * rate
        finally:
            cache.close()
            sender.close()


def test_a_version_every_receiver_holds_is_not_sent_nor_any_older_one():
    """The PS's ``supersede``: its receivers computed the version themselves (from their switch group's sum), so
    neither it nor an older one pending or not begun goes out; a newer one does."""
    model = np.arange(SIZE, dtype=np.float32)
    with _held_sender() as (sender, cache, group):
        group.set()  # version 1 waits for a switch group before its first packet, version 2 is pending
        sender.publish(1, model)
        time.sleep(0.1)
        sender.publish(2, model + 1)
        sender.supersede(3)  # every receiver holds version 3: 1's send is cut, 2 dropped, 3 never published
        group.clear()
        assert cache.newest(0, wait=0.5) is None
        sender.publish(4, model + 3)
        got = cache.newest(0, wait=3.0)
        assert got is not None and got[0] == 4 and np.array_equal(got[1], model + 3)
        blocks = DistributionLayout(SIZE, SLOTS).blocks
        assert (sender.stats.versions_sent, sender.stats.sends_cut, sender.stats.packets_sent) == (1, 1, blocks)
        assert sender.stats.versions_unneeded == 2  # 3, and 2 that was pending


class _Recorder:
    """A distribution sender that records what the PS hands it."""

    def __init__(self) -> None:
        self.published: list[int] = []
        self.superseded: list[int] = []

    def publish(self, version: int, model: np.ndarray, ready=None) -> None:
        self.published.append(version)

    def supersede(self, version: int) -> None:
        self.superseded.append(version)

    def close(self) -> None:
        pass


def test_a_version_is_sent_unless_every_worker_still_receiving_computes_it_from_its_switch_groups_sum():
    fabric = loopback_configs(3, update_mode="async", delay_bound=8, schedule="mlfabric")
    recorder = _Recorder()
    server = FabricServer(fabric[0], lr=1.0, gate_timeout=0, batch_window=0.01, distribution=recorder).start()
    clients = [FabricClient.from_config(c) for c in fabric]
    grad = np.ones(SIZE, np.float32)
    try:
        clients[0].init(np.zeros(SIZE, np.float32))
        # Ranks 0 and 1 got the sum of their group (holders) on top of version 0; rank 2 never said whether it
        # receives the versions, so it is taken to: the version goes out.
        first = server._push_async([("0:0", 0, 0), ("1:0", 1, 0)], grad, holders=frozenset({0, 1}))
        assert first["multicast"] and recorder.published == [2] and not recorder.superseded
        # Rank 2 left the distribution's group (it pulls): its own update's version is sent (0 and 1 lack it).
        assert clients[2].request("2:0", 2, grad.nbytes, 1.0, receiving=False)["action"] == "send"
        assert clients[2].push("2:0", 2, grad)["multicast"] and recorder.published == [2, 3]
        # Now every worker still receiving computes version 5 itself: it is not sent, and no older one either.
        second = server._push_async([("0:1", 0, 3), ("1:1", 1, 3)], grad, holders=frozenset({0, 1}))
        assert second["version"] == 5 and second["multicast"] is False
        assert recorder.published == [2, 3] and recorder.superseded == [5]
        # A group applied on top of only one member's version: the other needs the copy.
        third = server._push_async([("0:2", 0, 5), ("1:2", 1, 4)], grad, holders=frozenset({0, 1}))
        assert third["multicast"] and recorder.published == [2, 3, 7]
        # A duplicate of the group gets the stored outcome: still "not sent".
        assert server._push_async([("0:1", 0, 3), ("1:1", 1, 3)], grad, holders=frozenset({0, 1}))["multicast"] \
            is False
        # Rank 2 joins again: versions its group's members computed are sent for it.
        assert clients[2].request("2:1", 7, grad.nbytes, 1.0, receiving=True)["action"] == "send"
        clients[2].push("2:1", 7, grad)
        assert server._push_async([("0:3", 0, 8), ("1:3", 1, 8)], grad, holders=frozenset({0, 1}))["multicast"]
        assert recorder.published == [2, 3, 7, 8, 10]
        with pytest.raises(Refused, match="receiving"):
            clients[2].call("request", {"update_id": "2:2", "version": 10, "size": grad.nbytes, "norm": 1.0,
                                        "receiving": "yes"})
        assert (server.version, server.stats.applies) == (10, 6)  # the duplicate applied nothing
        np.testing.assert_array_equal(server.model, np.full(SIZE, -6, np.float32))
    finally:
        for c in clients:
            c.close()
        server.stop()


class _SilentCache:
    """A model cache that never gets a version: records how long each lookup was allowed to wait."""

    membership = None

    def __init__(self) -> None:
        self.waits: list[tuple[int, float]] = []

    def newest(self, after: int, wait: float = 0.0, repair=None):
        self.waits.append((after, wait))
        return None


def test_a_worker_told_its_version_is_not_sent_pulls_at_once_instead_of_waiting_for_it():
    cache, client = _SilentCache(), FabricClient.__new__(FabricClient)
    assert _delivered(client, cache, 5, 3, 6, 1.0, coming=False) is None
    assert cache.waits == [(5, 0.0)]  # only a version already here; no wait
    cache.waits.clear()
    assert _delivered(client, cache, 5, 3, 6, 1.0) is None
    assert cache.waits == [(5, 1.0), (3, 0.0)]  # waits for the version the PS sends
