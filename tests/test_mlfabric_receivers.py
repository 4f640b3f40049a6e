"""Receivers of model versions that their link cannot take leave the distribution job's multicast group
(mlfabric/receivers.py): the policy, the controller's side (store, group, worker endpoint), and the whole path
through a real controller and software switch over P4Runtime."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from netagg.controller.admission import JobRequest
from netagg.controller.config import load_config
from netagg.controller.service import Caller, JobService
from netagg.controller.store import JobStore
from netagg.controller.switch_programmer import job_state
from netagg.controller.worker_api import REFUSAL, WorkerApi
from netagg.jobconfig import Endpoint, WorkerConfig
from netagg.mlfabric.receivers import ReceiverMembership, ReceiverPolicy
from netagg.psproto import PsClient, PsRefused

from conftest import FakeFabric, controller_config

ALICE, BOB = Caller("alice"), Caller("bob")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- the policy ------------------------------------------------------------------------
def test_a_receiver_leaves_after_two_short_versions_in_a_row_not_counting_the_first_it_saw() -> None:
    clock = Clock()
    policy = ReceiverPolicy(clock=clock)
    assert not policy.version_over(0.1)  # the first version may have begun before it listened
    assert not policy.version_over(0.2)
    assert not policy.version_over(0.9)  # a good one resets the count
    assert not policy.version_over(0.3)
    assert policy.version_over(0.3)
    assert not policy.receiving
    assert not policy.version_over(0.0)  # out: nothing more to decide
    assert not policy.join_due()
    clock.now += 4.0
    assert policy.join_due() and policy.receiving
    assert not policy.join_due()


def test_a_receiver_that_leaves_again_after_a_join_stays_out_longer_until_a_version_arrives_whole() -> None:
    clock = Clock()
    policy = ReceiverPolicy(clock=clock, rejoin=4.0, max_rejoin=16.0)

    def leave_after_join() -> float:
        """Joined: fail again, and the time out before the next join."""
        assert policy.receiving
        assert not policy.version_over(0.0)  # the first after a join is not counted
        assert not policy.version_over(0.1)
        assert policy.version_over(0.1)
        left = clock.now
        while not policy.join_due():
            clock.now += 0.5
        return clock.now - left

    policy.version_over(1.0)
    policy.version_over(0.1)
    assert policy.version_over(0.1)
    clock.now += 4.0
    assert policy.join_due()
    assert [leave_after_join() for _ in range(4)] == [8.0, 16.0, 16.0, 16.0]
    assert policy.version_over(0.0) is False  # joined: the first one skipped
    assert not policy.version_over(1.0)  # whole: back to the shortest time out
    assert not policy.version_over(0.1)
    assert policy.version_over(0.1)
    clock.now += 4.0
    assert policy.join_due()


def test_a_change_the_controller_did_not_take_is_undone_and_tried_again_later() -> None:
    clock = Clock()
    policy = ReceiverPolicy(clock=clock)
    for share in (1.0, 0.1, 0.1):
        policy.version_over(share)
    assert not policy.receiving
    policy.undo()  # the leave failed: the switch still copies to it
    assert policy.receiving
    assert not policy.version_over(0.1)
    assert policy.version_over(0.1)


# -- the controller ----------------------------------------------------------------------
def _service(tmp_path: Path, fabric: FakeFabric | None = None) -> JobService:
    path = tmp_path / "controller.yaml"
    if not path.exists():
        path = controller_config(tmp_path, "127.0.0.1:1", aggregator_port=28900, capacity=256, min_slots=4)
        data = yaml.safe_load(path.read_text())
        data["controller"]["worker_address"] = "127.0.0.1:0"
        path.write_text(yaml.safe_dump(data))
    config = load_config(path)
    service = JobService(config, JobStore(config.database), fabric or FakeFabric())  # type: ignore[arg-type]
    service.load()
    service.worker_endpoint = Endpoint("127.0.0.1", 1)
    return service


def _distributed(service: JobService, receivers: int = 3) -> tuple[int, int]:
    """Alice's async job with a PS and a distribution job; (job id, distribution job id)."""
    created = service.create_job(ALICE, JobRequest(
        name="m", workers=[f"local:{44100 + i}" for i in range(receivers)], slots=8, width=64, mode="ps", ps="ps0",
        update_mode="async", distribution=[f"local:{44200 + i}" for i in range(receivers)],
        distribution_ps=["local:44300"]))
    job = service.store.get(created["job"]["job_id"])
    assert job is not None and job.distribution is not None
    return job.job_id, job.distribution


def _group(service: JobService, dist_id: int) -> list[int]:
    """The replication ids (rank + 1) of the distribution job's multicast group, as the controller writes it."""
    job = service.store.get(dist_id)
    assert job is not None
    return sorted(rid for _, rid in job_state(service.config, job).groups[dist_id])


def test_a_receiver_that_leaves_gets_no_copies_and_the_store_keeps_it_across_a_restart(tmp_path) -> None:
    fabric = FakeFabric()
    service = _service(tmp_path, fabric)
    job_id, dist_id = _distributed(service)
    assert _group(service, dist_id) == [1, 2, 3]
    assert service.set_receiving(dist_id, 1, False) == {"receiving": False, "left": [1], "applied": True}
    assert fabric.installed[dist_id].left_receivers == [1]  # what the switch was given
    assert service.set_receiving(dist_id, 2, False)["left"] == [1, 2]
    assert _group(service, dist_id) == [1]
    # The receivers' entries stay (a join only adds the copy back); the job's own group is untouched.
    job = service.store.get(dist_id)
    assert len([e for e in job_state(service.config, job).entries.values() if "rid" in dict(e.match)]) == 3
    assert len(job_state(service.config, service.store.get(job_id)).groups[job_id]) == 1  # the PS
    restarted = _service(tmp_path)
    assert _group(restarted, dist_id) == [1]
    assert restarted.set_receiving(dist_id, 1, True)["left"] == [2]
    assert restarted.set_receiving(dist_id, 1, True)["left"] == [2]  # joining twice is joining
    assert _group(restarted, dist_id) == [1, 2]
    for rank in range(3):  # every receiver out: a group of no copies (the versions go nowhere)
        restarted.set_receiving(dist_id, rank, False)
    assert _group(restarted, dist_id) == []


def test_only_a_distribution_jobs_receivers_leave_and_under_a_tree_nobody_does(tmp_path) -> None:
    service = _service(tmp_path)
    job_id, dist_id = _distributed(service)
    for bad_job, rank in ((job_id, 0), (dist_id, 3), (dist_id, -1), (999, 0)):  # 3: the PS, a sender
        with pytest.raises(ValueError):
            service.set_receiving(bad_job, rank, False)
    assert service.store.get(dist_id).left_receivers == []
    service.fabric.is_tree = True  # a tree of switches: the distribution's groups are the tree's
    with pytest.raises(ValueError, match="tree"):
        service.set_receiving(dist_id, 0, False)


def test_the_worker_endpoint_takes_a_leave_only_with_the_distribution_jobs_secret(tmp_path) -> None:
    service = _service(tmp_path)
    job_id, dist_id = _distributed(service)
    api = WorkerApi(service, Endpoint("127.0.0.1", 0)).start()
    service.worker_endpoint = Endpoint(*api.address)
    try:
        config = WorkerConfig.from_dict(yaml.safe_load(
            service.worker_config(ALICE, job_id, 1, distribution=True).to_yaml()))
        assert config.controller is not None and config.job_id == dist_id
        main = service.store.get(job_id)
        leave = {"op": "receive", "job_id": dist_id, "rank": 1, "receiving": False}
        for header, secret in ((leave, main.secret), (leave, ""), ({**leave, "job_id": 999}, config.secret)):
            client = PsClient(api.address, timeout=5, secret=secret)
            with pytest.raises(PsRefused, match=REFUSAL):
                client.request(header)
            client.close()
        assert service.store.get(dist_id).left_receivers == []
        membership = ReceiverMembership(config, ReceiverPolicy(rejoin=0.3))
        try:
            for share in (1.0, 0.2, 0.2):
                membership.version_over(share)
            deadline, seen_out = time.monotonic() + 5, False
            while membership.stats.joins == 0 and time.monotonic() < deadline:  # it leaves, then joins again
                if membership.stats.leaves and service.store.get(dist_id).left_receivers == [1]:
                    seen_out = True
                time.sleep(0.02)
            assert seen_out and membership.stats.leaves == 1 and membership.stats.joins == 1
            assert service.store.get(dist_id).left_receivers == []
            assert membership.stats.failed_requests == 0
        finally:
            membership.close()
        # A receiver that died out of the group and starts again joins it first.
        service.set_receiving(dist_id, 1, False)
        restarted = ReceiverMembership(config)
        try:
            deadline = time.monotonic() + 5
            while service.store.get(dist_id).left_receivers and time.monotonic() < deadline:
                time.sleep(0.02)
            assert service.store.get(dist_id).left_receivers == [] and restarted.receiving
        finally:
            restarted.close()
    finally:
        api.stop()


# -- the whole path: a real controller and software switch -------------------------------------
@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    from netagg.bmv2.deployment import LocalDeployment

    with LocalDeployment(tmp_path_factory.mktemp("receivers"), capacity=256) as local:
        yield local


def test_the_switch_stops_copying_versions_to_a_receiver_that_left_and_copies_them_again_once_it_joins(
        deployment) -> None:
    from netagg.mlfabric.distribution import ModelCache, ModelSender

    hosts = [deployment.HOST] * 2
    receivers = deployment.worker_ports(hosts)
    sender_port = deployment.worker_ports([deployment.HOST])[0]
    created = deployment.create_job(hosts, 8, mode="ps", name="receivers", options=[
        "--sync", "async", "--distribution", ",".join(f"{deployment.HOST}:{p}" for p in receivers),
        "--distribution-ps", f"{deployment.HOST}:{sender_port}"])
    job_id = created["job"]["job_id"]
    paths = []
    for which in (["--rank", "0"], ["--rank", "1"], ["--ps-node", "0"]):
        path = deployment.workdir / f"receivers-dist{'-'.join(which)}.yaml"
        deployment.cli("job", "config", str(job_id), "--distribution", *which, "-o", str(path))
        paths.append(path)
    configs = [WorkerConfig.load(p) for p in paths]
    assert configs[0].controller is not None
    size = 3000
    sender = ModelSender(configs[2], rate=50e6)
    # Receiver 1 decides by a policy that leaves at once (no real slow link here); it joins again after 1 s.
    membership = ReceiverMembership(configs[1], ReceiverPolicy(leave_below=1.01, strikes=1, rejoin=1.0))
    caches = [ModelCache(configs[0], size), ModelCache(configs[1], size, membership=membership)]
    models = {v: np.full(size, v, np.float32) for v in range(1, 8)}
    try:
        def send(version: int) -> None:
            sender.publish(version, models[version])
            deadline = time.monotonic() + 5
            while caches[0].newest(version - 1) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            got = caches[0].newest(version - 1)
            assert got is not None and got[0] == version and np.array_equal(got[1], models[version])

        for version in (1, 2, 3):  # 1 is not scored (the first seen), 2 is scored when 3 begins: it leaves
            send(version)
        deadline = time.monotonic() + 5
        while membership.stats.leaves == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert membership.stats.leaves == 1
        shown = json.loads(deployment.cli("--json", "job", "show", str(configs[0].job_id)))
        assert shown["left_receivers"] == [1]  # what an operator sees
        packets = caches[1].stats.packets
        send(4)  # the switch copies it to receiver 0 only
        time.sleep(0.2)
        assert caches[1].stats.packets == packets
        assert caches[1].newest(3) is None
        deadline = time.monotonic() + 5
        while membership.stats.joins == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert membership.stats.joins == 1 and membership.receiving
        send(5)
        deadline = time.monotonic() + 5
        while (got := caches[1].newest(4)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got is not None and got[0] == 5 and np.array_equal(got[1], models[5])
    finally:
        for cache in caches:
            cache.close()
        membership.close()
        sender.close()
        deployment.cli("job", "delete", str(job_id))
