"""The controller survives kill -9 and a switch that lost its state; reconcile works both ways."""

from __future__ import annotations

import random
import threading
from itertools import pairwise

import pytest

from netagg import dataplane as dp
from netagg import wire
from netagg.bmv2.targets import start_target
from netagg.controller.api import ApiClient, ApiError
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.controller.switch_programmer import ip_to_int

from conftest import ADMIN_TOKEN, TOKENS, config_for, free_udp_port, start_controller

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def switch_view(grpc_address: str) -> dict:
    """What the switch holds, read by a backup client."""
    with P4RuntimeClient(grpc_address, device_id=1, election_id=(0, 1), p4info_path=dp.P4INFO_PATH) as reader:
        reader.connect()
        return {
            "jobs": {e.match["job_id"]: e.params for e in reader.read_entries(dp.TABLE_JOBS)},
            "workers": {(e.match["job_id"], e.match["udp_src"]): e.params["rank"]
                        for e in reader.read_entries(dp.TABLE_WORKERS)},
            "replicas": {(e.match["mgid"], e.match["rid"]) for e in reader.read_entries(dp.TABLE_REPLICAS)},
            "groups": set(reader.read_multicast_groups()),
        }


def assert_switch_matches_database(grpc_address: str, jobs: list[dict]) -> None:
    view = switch_view(grpc_address)
    switch_jobs = [j for j in jobs if j["mode"] != "fallback"]
    assert set(view["jobs"]) == {j["job_id"] for j in switch_jobs}
    for job in switch_jobs:
        params = view["jobs"][job["job_id"]]
        assert (params["slot_base"], params["slot_count"], params["generation"], params["width"]) == (
            job["slot_base"], job["slot_count"], job["generation"], wire.width_code(job["width"]))
    assert view["workers"] == {(j["job_id"], w["udp_port"]): w["rank"] for j in switch_jobs for w in j["workers"]}
    assert view["groups"] == {j["job_id"] for j in switch_jobs}
    assert view["replicas"] == {(j["job_id"], w["rank"] + 1) for j in switch_jobs for w in j["workers"]}
    # No cell is in two jobs (a job holds slot_count slots of wire.cells_of(width) cells from slot_base).
    ranges = sorted((j["slot_base"], j["slot_base"] + j["slot_count"] * wire.cells_of(j["width"])) for j in switch_jobs)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(ranges))
    assert all(j["state"] == "active" for j in jobs)


def burst(client: ApiClient, stop: threading.Event, seed: int, hosts: tuple[str, ...] = ("local",),
          tolerated: tuple[str, ...] = ()) -> None:
    """Creates (1-4 workers on ``hosts``, narrow and wide) and deletes until stopped or the controller is killed
    under it; an API error other than ``tolerated`` ones fails the test."""
    rng = random.Random(seed)
    mine: list[int] = []
    while not stop.is_set():
        try:
            if mine and rng.random() < 0.4:
                client.call("delete", job_id=mine.pop(rng.randrange(len(mine))))
            else:
                workers = [f"{rng.choice(hosts)}:{free_udp_port()}" for _ in range(rng.randint(1, 4))]
                result = client.call("create", name="burst", workers=workers, slots=rng.randint(1, 8),
                                     width=rng.choice(sorted(wire.WIDTH_CODES)))
                mine.append(result["job"]["job_id"])
        except ApiError as err:
            if err.code == "unreachable":
                return  # the controller was killed under us
            if err.code not in tolerated:
                raise


def test_kill_minus_nine_during_burst_loses_nothing(tmp_path, any_switch):
    soft_switch = any_switch
    config = config_for(tmp_path, any_switch, capacity=1024)  # cells: a wide slot takes 4
    for round_ in range(3):
        ctl = start_controller(config, tmp_path / "controller.log")
        stop = threading.Event()
        clients = [ApiClient(ctl.socket, TOKENS[name]) for name in ("alice", "bob")]
        threads = [threading.Thread(target=burst, args=(c, stop, round_ * 10 + i)) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        threading.Event().wait(0.8 + 0.3 * round_)
        ctl.kill()  # SIGKILL: no clean-up of any kind
        stop.set()
        for t in threads:
            t.join(timeout=30)
    ctl = start_controller(config, tmp_path / "controller.log")
    try:
        jobs = ApiClient(ctl.socket, ADMIN_TOKEN).call("list")
        assert jobs, "the bursts should have left jobs behind"
        assert_switch_matches_database(soft_switch.grpc_address, jobs)
    finally:
        ctl.stop()


def test_restart_reinstalls_lost_switch_state_and_removes_strays(tmp_path, any_switch):
    soft_switch = any_switch
    config = config_for(tmp_path, any_switch)
    ctl = start_controller(config, tmp_path / "controller.log")
    alice = ApiClient(ctl.socket, TOKENS["alice"])
    kept = alice.call("create", name="kept", workers=[f"local:{free_udp_port()}", f"local:{free_udp_port()}"],
                      slots=8)["job"]
    ctl.stop()
    # Someone else writes a stray job and worker while the controller is down.
    with P4RuntimeClient(soft_switch.grpc_address, device_id=1, election_id=(0, 5),
                         p4info_path=dp.P4INFO_PATH) as intruder:
        intruder.connect()
        intruder.insert_entry(dp.TABLE_JOBS, {"job_id": 900}, dp.ACTION_SET_JOB, {
            "num_workers": 1, "slot_base": 0, "slot_count": 64, "mgid": 900, "generation": 77, "width": 0})
        intruder.insert_entry(dp.TABLE_WORKERS, {"job_id": 900, "ipv4_src": ip_to_int("127.0.0.1"),
                                                 "udp_src": 5555, "ingress_port": 1}, dp.ACTION_SET_WORKER,
                              {"rank": 0, "worker_mask": 1})
        intruder.set_multicast_group(900, [(1, 1)])
    ctl = start_controller(config, tmp_path / "controller.log")
    try:
        jobs = ApiClient(ctl.socket, ADMIN_TOKEN).call("list")
        assert [j["job_id"] for j in jobs] == [kept["job_id"]]
        assert_switch_matches_database(soft_switch.grpc_address, jobs)
    finally:
        ctl.stop()

    # The switch restarts empty (no pipeline, no entries); the controller restores everything.
    host, port = soft_switch.loopback_address
    soft_switch.stop()
    fresh = start_target(soft_switch.kind, {}, tmp_path / "switch2.log", grpc_address=soft_switch.grpc_address,
                         loopback=f"{host}:{port}" if soft_switch.kind == "soft" else None)
    try:
        ctl = start_controller(config, tmp_path / "controller.log")
        try:
            jobs = ApiClient(ctl.socket, ADMIN_TOKEN).call("list")
            assert_switch_matches_database(fresh.grpc_address, jobs)
            assert "pushed the pipeline" in (tmp_path / "controller.log").read_text()
        finally:
            ctl.stop()
    finally:
        fresh.stop()
