"""The controller daemon over a tree of switches (``topology:``, docs/hierarchy.md): three software targets,
each its own process with its own P4Runtime session, driven by one `netagg controller run`.

What is checked on the switches themselves (read back over P4Runtime): a job over two racks is on every
switch of its tree with the entries ``topology.tree_state`` gives, a job inside one rack on its leaf alone;
a job whose tree has a switch that is away is refused and leaves nothing anywhere, while jobs elsewhere go
on; a restarted leaf gets its share back; a delete takes the job off everywhere; the segments survive a
controller restart; a job of more than 32 workers is admitted over the tree.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_controller_recovery import burst
from test_controller_switch_restart import cli, kill9, switch_state, wait_for

from netagg import dataplane as dp
from netagg import wire
from netagg.bmv2.targets import TargetProcess, start_target
from netagg.controller.api import ApiClient
from netagg.controller.cli import EXIT_CODES
from netagg.controller.config import load_config, parse_config
from netagg.controller.topology import (
    Allocation,
    TreeWorker,
    dump_topology,
    fabric_state,
    parse_topology,
    plan_tree,
    tree_state,
)
from netagg.jobconfig import ConfigError, WorkerConfig
from netagg.localports import free_ports

from conftest import ADMIN_TOKEN, TWO_RACKS, ControllerProcess, free_udp_port, start_controller

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SWITCHES = ("root", "rack0", "rack1")
TOPOLOGY = TWO_RACKS


@pytest.fixture
def targets(tmp_path: Path) -> Iterator[dict[str, TargetProcess]]:
    """The three switches: software targets on Unix sockets (no ports: the control plane is what is tested)."""
    started: dict[str, TargetProcess] = {}
    try:
        for name in SWITCHES:
            started[name] = start_target("soft", {}, tmp_path / f"{name}.log",
                                         grpc_address=f"unix:{tmp_path / name}.sock",
                                         loopback=f"127.0.0.1:{free_udp_port()}")
        yield started
    finally:
        for target in started.values():
            target.stop()


def tree_config(tmp_path: Path, targets: dict[str, TargetProcess], capacity: int = 64,
                metrics_port: int | None = None) -> Path:
    topology = parse_topology(TOPOLOGY, "<test>")
    topo_path = tmp_path / "topology.yaml"
    topo_path.write_text(yaml.safe_dump(dump_topology(topology, {n: t.grpc_address for n, t in targets.items()})))
    config = {
        "topology": str(topo_path),
        "switch": {"election_id": 10, "p4info": str(dp.P4INFO_PATH)},
        "slots": {"capacity": capacity, "min_per_job": 4},
        "jobs": {"lease_seconds": 3600},
        "controller": {"database": str(tmp_path / "ctl.db"), "api_socket": str(tmp_path / "ctl.sock"),
                       "admin_token": ADMIN_TOKEN,
                       **({"metrics_address": f"127.0.0.1:{metrics_port}"} if metrics_port else {})},
        "tenants": {"alice": {"token": "alice-test-token"}},
        "parameter_servers": [{"name": "ps0", "host": "r0h1", "udp_port": 29001}],
    }
    path = tmp_path / "controller.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def create(capsys, ctl: ControllerProcess, workers: list[str], *extra: str, slots: int = 8) -> tuple[int, dict, str]:
    """A job create; narrow unless ``extra`` names a width (the slot counts below are narrow slots: cells)."""
    width = () if "--width" in extra else ("--width", "64")
    code, out, err = cli(capsys, ctl, "--json", "job", "create", "--slots", str(slots), "--workers",
                         ",".join(workers), *width, *extra)
    return code, (json.loads(out) if code == 0 else {}), err


def expected_on(targets: dict[str, TargetProcess], jobs: list[dict]) -> dict[str, dict]:
    """What each switch must hold for ``jobs`` (their views), from the topology module directly."""
    topology = parse_topology(TOPOLOGY, "<test>")
    states = fabric_state(topology)
    for job in [j for j in jobs if j["segments"]]:  # not the fallback jobs: on no switch
        workers = [TreeWorker(w["rank"], w["host"], w["udp_port"]) for w in job["workers"]]
        allocations = {s: Allocation(job["job_id"], base, count, job["generation"], job["width"])
                       for s, (base, count) in job["segments"].items()}
        for switch, share in tree_state(topology, plan_tree(topology, workers), allocations, workers).items():
            states[switch].entries.update(share.entries)
            states[switch].groups.update(share.groups)
    return {name: {"entries": sorted((e.table, e.match, e.action, e.params) for e in states[name].entries.values()),
                   "groups": {gid: sorted(r) for gid, r in states[name].groups.items()}} for name in targets}


def held(targets: dict[str, TargetProcess]) -> dict[str, dict | None]:
    return {name: switch_state(t.grpc_address) for name, t in targets.items()}


def test_a_job_over_two_racks_is_on_every_switch_of_its_tree_and_a_rack_job_on_its_leaf(capsys, tmp_path, targets):
    ctl = start_controller(tree_config(tmp_path, targets), tmp_path / "controller.log")
    try:
        wait_for(lambda: all(held(targets).values()), "the controller to push the pipeline to every switch")
        code, made, err = create(capsys, ctl, ["r0h0:41000", "r1h0:41001", "r0h1:41002"])
        assert code == 0, err
        tree_job = made["job"]
        assert set(tree_job["segments"]) == {"root", "rack0", "rack1"}
        assert {c for _, c in tree_job["segments"].values()} == {8} and made["admission"] == "full"
        code, made, err = create(capsys, ctl, ["r1h0:41010", "r1h1:41011"], slots=60)
        assert code == 0, err
        rack_job = made["job"]
        assert list(rack_job["segments"]) == ["rack1"] and rack_job["slot_count"] == 56  # 64 - the tree job's 8
        assert made["admission"] == "partial"
        assert held(targets) == expected_on(targets, [tree_job, rack_job])

        # Each worker's config: its leaf's segment, its rank there, the whole job's size and its rank in it.
        code, out, err = cli(capsys, ctl, "job", "config", str(tree_job["job_id"]), "--rank", "2")
        assert code == 0, err
        config = WorkerConfig.from_dict(yaml.safe_load(out))
        assert (config.job_id, config.rank, config.num_workers, config.job_workers, config.job_rank) == \
            (tree_job["job_id"], 1, 2, 3, 2)
        assert (config.aggregator.host, config.aggregator.port) == ("10.61.0.254", wire.NETAGG_UDP_PORT)
        assert config.slot_count == 8 and config.failover_after == 0

        code, out, err = cli(capsys, ctl, "--json", "job", "show", str(tree_job["job_id"]))
        assert code == 0, err
        shown = json.loads(out)
        assert set(shown["switch_counters"]) == set(SWITCHES) and shown["counters"]["contributions"] == 0
        code, out, err = cli(capsys, ctl, "job", "show", str(tree_job["job_id"]))
        assert code == 0, err
        assert "switches " in out and "rack1 " in out and "on root: contributions=0" in out, out

        # The rack job takes more slots on rack1 than the others have left: a second tree job gets what all
        # three switches have, here rack1's last 0 -> none, so it falls back to its PS.
        code, made, err = create(capsys, ctl, ["r0h0:41020", "r1h1:41021"], "--ps", "ps0")
        assert code == 0, err
        assert made["admission"] == "fallback" and made["job"]["segments"] == {}

        # A controller restart: the jobs, their segments, and the switches unchanged.
        before = held(targets)
        ctl.stop()
        ctl = start_controller(ctl.config, tmp_path / "controller.log")
        code, out, err = cli(capsys, ctl, "--json", "job", "list", token=ADMIN_TOKEN)
        assert code == 0, err
        assert [j["segments"] for j in json.loads(out)][:2] == [tree_job["segments"], rack_job["segments"]]
        assert wait_for(lambda: held(targets) == before, "the switches to stay as they were")

        # A delete takes the tree job off every switch of its tree; its slots are free on each.
        code, _, err = cli(capsys, ctl, "job", "delete", str(tree_job["job_id"]))
        assert code == 0, err
        assert held(targets) == expected_on(targets, [rack_job])
        code, made, err = create(capsys, ctl, ["r0h0:41030", "r1h0:41031"], slots=8)
        assert code == 0 and made["admission"] == "full", err
    finally:
        ctl.stop()


def test_a_wide_job_has_its_width_on_every_switch_of_its_tree_and_counts_cells_on_each(capsys, tmp_path, targets):
    ctl = start_controller(tree_config(tmp_path, targets), tmp_path / "controller.log")  # 64 cells a switch
    try:
        wait_for(lambda: all(held(targets).values()), "the controller to push the pipeline to every switch")
        code, made, err = create(capsys, ctl, ["r0h0:41000", "r1h0:41001"], "--width", "256", slots=8)
        assert code == 0, err
        wide = made["job"]
        assert (made["admission"], wide["width"], wide["cells"]) == ("full", 256, 32)
        assert wide["segments"] == {"root": [0, 8], "rack0": [0, 8], "rack1": [0, 8]}  # first cell, slots
        # rack1 has 32 cells left: a rack job of 12 wide slots (48 cells) gets 8, a narrow one the rest.
        code, made, err = create(capsys, ctl, ["r1h0:41010", "r1h1:41011"], "--width", "256", slots=12)
        assert code == 0, err
        rack = made["job"]
        assert (made["admission"], rack["segments"], rack["cells"]) == ("partial", {"rack1": [32, 8]}, 32)
        code, made, err = create(capsys, ctl, ["r0h0:41020", "r1h1:41021"], "--width", "256", slots=1)
        assert code == EXIT_CODES["capacity_exhausted"] and "of width 256" in err, err
        on_switches = held(targets)
        assert on_switches == expected_on(targets, [wide, rack])
        for name in SWITCHES:  # set_job: the width code at every level
            jobs = [e for e in on_switches[name]["entries"] if e[0] == dp.TABLE_JOBS]
            assert jobs and all(dict(e[3])["width"] == wire.width_code(256) for e in jobs), (name, jobs)
        code, out, err = cli(capsys, ctl, "job", "config", str(wide["job_id"]), "--rank", "1")
        assert code == 0, err
        config = WorkerConfig.from_dict(yaml.safe_load(out))
        assert (config.width, config.slot_count, config.aggregator.host) == (256, 8, "10.62.0.254")
        code, out, err = cli(capsys, ctl, "job", "show", str(wide["job_id"]))
        assert code == 0 and "width 256" in out and "rack1 0..31" in out, out
    finally:
        ctl.stop()


def samples(port: int) -> list[tuple[str, dict, float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as response:
        text = response.read().decode()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def test_a_switch_away_refuses_only_the_jobs_of_its_trees_and_gets_its_share_back(capsys, tmp_path, targets):
    port = free_ports(1, kind="tcp")[0]
    ctl = start_controller(tree_config(tmp_path, targets, metrics_port=port), tmp_path / "controller.log")
    try:
        wait_for(lambda: all(held(targets).values()), "the controller to push the pipeline to every switch")
        code, made, err = create(capsys, ctl, ["r0h0:41000", "r1h0:41001"])
        assert code == 0, err
        first = made["job"]
        kill9(targets["rack1"])
        wait_for(lambda: "rack1" in (ctl.log.read_text()) and "lost" in ctl.log.read_text(), "the loss noticed")
        before = held({n: targets[n] for n in ("root", "rack0")})
        code, _, err = create(capsys, ctl, ["r0h1:41010", "r1h1:41011"])
        assert code == EXIT_CODES["switch_unavailable"], err
        assert "rack1" in err and "retry" in err and "Traceback" not in err
        assert held({n: targets[n] for n in ("root", "rack0")}) == before  # nothing left anywhere
        up = {labels["grpc_address"]: value for name, labels, value in samples(port) if name == "netagg_switch_up"}
        assert up == {t.grpc_address: float(n != "rack1") for n, t in targets.items()}
        in_use = {labels["switch"]: value for name, labels, value in samples(port) if name == "netagg_slots_in_use"}
        assert in_use == {"root": 8.0, "rack0": 8.0, "rack1": 8.0}
        # A job inside rack0 does not need rack1.
        code, made, err = create(capsys, ctl, ["r0h1:41020", "r0h0:41021"])
        assert code == 0, err
        local = made["job"]
        # rack1 comes back bare (a reboot): the controller puts the pipeline and the first job's share back.
        Path(targets["rack1"].grpc_address[len("unix:"):]).unlink(missing_ok=True)
        targets["rack1"] = start_target("soft", {}, tmp_path / "rack1.log", grpc_address=targets["rack1"].grpc_address,
                                        loopback=f"127.0.0.1:{free_udp_port()}")
        expected = expected_on(targets, [first, local])
        assert wait_for(lambda: held(targets) == expected, "rack1 re-installed")
        code, made, err = create(capsys, ctl, ["r0h1:41030", "r1h1:41031"])
        assert code == 0, err
        contributions = {labels["switch"] for name, labels, _ in samples(port)
                         if name == "netagg_job_contributions_total" and labels["job_id"] == str(first["job_id"])}
        assert contributions == {"root", "rack0", "rack1"}
    finally:
        ctl.stop()


def test_a_job_of_more_than_32_workers_over_two_racks(capsys, tmp_path, targets):
    ctl = start_controller(tree_config(tmp_path, targets), tmp_path / "controller.log")
    try:
        wait_for(lambda: all(held(targets).values()), "the controller to push the pipeline to every switch")
        workers = [f"r{r}h{h}:{42000 + 100 * (2 * r + h) + i}" for r in range(2) for h in range(2) for i in range(12)]
        code, made, err = create(capsys, ctl, workers)
        assert code == 0, err
        job = made["job"]
        assert len(job["workers"]) == 48 and set(job["segments"]) == {"root", "rack0", "rack1"}
        assert held(targets) == expected_on(targets, [job])
        code, out, err = cli(capsys, ctl, "job", "config", str(job["job_id"]), "--rank", "47")
        assert code == 0, err
        config = WorkerConfig.from_dict(yaml.safe_load(out))
        assert (config.num_workers, config.rank, config.job_workers, config.job_rank) == (24, 23, 48, 47)
        # One leaf cannot take more than 32 members: a clear refusal.
        code, _, err = create(capsys, ctl, [f"r0h{i % 2}:{43000 + i}" for i in range(33)])
        assert code == EXIT_CODES["invalid_argument"] and "add a level to the tree" in err, err
        # What the tree does not run yet: said, not half done.
        code, _, err = create(capsys, ctl, ["r0h0:44000", "r1h0:44001"], "--mode", "ps", "--ps", "ps0")
        assert code == EXIT_CODES["invalid_argument"] and "--mode ps" in err and "tree" in err, err
    finally:
        ctl.stop()


def test_a_topology_config_is_checked(tmp_path):
    shipped = load_config(dp.REPO_ROOT / "configs" / "controller-tree.yaml")
    assert shipped.topology is not None and shipped.parameter_servers["ps0"].host in shipped.topology.hosts
    topo_path = tmp_path / "topology.yaml"
    topo_path.write_text(yaml.safe_dump(TOPOLOGY))
    base = {"topology": str(topo_path), "switch": {"p4info": str(dp.P4INFO_PATH)},
            "controller": {"database": "x.db", "api_socket": "x.sock", "admin_token": ADMIN_TOKEN}}
    config = parse_config(base, "<test>")
    assert config.topology is not None and set(config.hosts) == {"r0h0", "r0h1", "r1h0", "r1h1"}
    assert config.grpc_address == "unix:/unused/root" and config.aggregator_ip == "10.60.0.254"  # the root's
    for extra, key in (({"switch": {**base["switch"], "grpc_address": "1.2.3.4:9559"}}, "switch.grpc_address"),
                       ({"hosts": [{"name": "a", "ip": "1.2.3.4", "mac": "02:00:00:00:00:01", "port": 1}]}, "hosts"),
                       ({"topology": str(tmp_path / "missing.yaml")}, "topology")):
        with pytest.raises(ConfigError, match=key):
            parse_config({**base, **extra}, "<test>")
    broken = dict(TOPOLOGY, switches={**TOPOLOGY["switches"], "rack1": {**TOPOLOGY["switches"]["rack1"],
                                                                          "parent": {"switch": "nowhere",
                                                                                     "up_port": 1, "port": 3}}})
    topo_path.write_text(yaml.safe_dump(broken))
    with pytest.raises(ConfigError, match=r"topology.*nowhere"):
        parse_config(base, "<test>")


def test_kill_9_of_the_controller_among_tree_creates_leaves_every_switch_as_its_database_says(tmp_path, targets):
    config = tree_config(tmp_path, targets, capacity=1024)  # cells: the bursts' wide jobs take 4 a slot
    for round_ in range(3):
        ctl = start_controller(config, tmp_path / "controller.log")
        wait_for(lambda: all(held(targets).values()), "every switch in sync")
        stop = threading.Event()
        hosts = tuple(h["name"] for h in TOPOLOGY["hosts"])
        thread = threading.Thread(target=burst, args=(ApiClient(ctl.socket, "alice-test-token"), stop, round_, hosts,
                                                      ("capacity_exhausted",)))
        thread.start()
        threading.Event().wait(0.8 + 0.4 * round_)
        ctl.kill()  # SIGKILL: no clean-up of any kind
        stop.set()
        thread.join(timeout=30)
    ctl = start_controller(config, tmp_path / "controller.log")
    try:
        jobs = ApiClient(ctl.socket, ADMIN_TOKEN).call("list")
        assert jobs, "the bursts should have left jobs behind"
        assert any(len(j["segments"]) == 3 for j in jobs) and any(len(j["segments"]) == 1 for j in jobs)
        expected = expected_on(targets, jobs)
        assert wait_for(lambda: held(targets) == expected, "every switch as the database says")
        assert all(j["state"] == "active" for j in ApiClient(ctl.socket, ADMIN_TOKEN).call("list"))
        for switch in SWITCHES:  # no cell of a switch is in two jobs (a segment: first cell, slots of the width)
            ranges = sorted((b, b + c * wire.cells_of(j["width"])) for j in jobs
                            for s, (b, c) in j["segments"].items() if s == switch)
            assert all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(ranges)), (switch, ranges)
    finally:
        ctl.stop()


def test_a_topology_edited_under_a_job_stops_the_daemon_naming_the_job(capsys, tmp_path, targets):
    config = tree_config(tmp_path, targets)
    ctl = start_controller(config, tmp_path / "controller.log")
    try:
        code, made, err = create(capsys, ctl, ["r0h0:41000", "r1h0:41001"])
        assert code == 0, err
    finally:
        ctl.stop()
    topology = tmp_path / "topology.yaml"
    data = yaml.safe_load(topology.read_text())
    for host in data["hosts"]:  # r1h0 moves to rack0: the job's tree would be rack0 alone
        if host["name"] == "r1h0":
            host.update(switch="rack0", port=3)
    topology.write_text(yaml.safe_dump(data))
    with pytest.raises(RuntimeError, match=rf"job {made['job']['job_id']}'s switches .* topology changed"):
        start_controller(config, tmp_path / "controller.log")
