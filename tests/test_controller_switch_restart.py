"""The switch restarts (kill -9, then again on the same P4Runtime and UDP addresses) under a running
controller, or together with it: the controller notices, reconnects and puts every job back.

Every wait polls a condition with a deadline; the recovery times are printed (run with ``-s``) and
recorded in docs/operations.md ("The switch restarts").
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from netagg import dataplane as dp
from netagg.bmv2.targets import TargetProcess, start_target
from netagg.controller.cli import EXIT_CODES, main
from netagg.controller.config import parse_config
from netagg.controller.p4runtime_client import P4RuntimeClient, P4RuntimeError
from netagg.controller.switch_programmer import MANAGED_TABLES
from netagg.hoststack.kv import KVWorker
from netagg.jobconfig import ConfigError, WorkerConfig
from netagg.localports import free_ports
from netagg.softswitch.p4runtime_server import serve
from netagg.softswitch.target import SoftwareTarget
from netagg.testing.hoststack import expected_allreduce

from conftest import ADMIN_TOKEN, TOKENS, ControllerProcess, controller_config, free_udp_port, start_controller

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

#: Bound of every wait for the controller or the switch (generous: 2 shared cores).
DEADLINE = 60.0
T = TypeVar("T")


# --------------------------------------------------------------------------- helpers


def wait_for(condition: Callable[[], T], what: str, timeout: float = DEADLINE) -> T:
    """Poll ``condition`` until it returns something true; that value (AssertionError after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def start_switch(tmp_path: Path, name: str, grpc_address: str | None = None,
                 udp_port: int | None = None) -> TargetProcess:
    """The software target in loopback mode (on these addresses, or free ones)."""
    return start_target("soft", {}, tmp_path / f"{name}.log", grpc_address=grpc_address,
                        loopback=f"127.0.0.1:{udp_port or free_udp_port()}")


def restart_switch(tmp_path: Path, old: TargetProcess, name: str) -> TargetProcess:
    assert old.loopback_address is not None
    return start_switch(tmp_path, name, old.grpc_address, old.loopback_address[1])


def kill9(switch: TargetProcess) -> None:
    switch.process.kill()
    switch.process.wait(timeout=10)


def config_with_metrics(tmp_path: Path, switch: TargetProcess | tuple[str, int]) -> tuple[Path, int]:
    """A controller configuration for ``switch`` (or its P4Runtime address and loopback UDP port) with the
    metrics endpoint on a free TCP port."""
    if isinstance(switch, TargetProcess):
        assert switch.loopback_address is not None
        switch = (switch.grpc_address, switch.loopback_address[1])
    path = controller_config(tmp_path, *switch)
    port = free_ports(1, kind="tcp")[0]
    data = yaml.safe_load(path.read_text())
    data["controller"]["metrics_address"] = f"127.0.0.1:{port}"
    path.write_text(yaml.safe_dump(data))
    return path, port


def scrape(port: int) -> dict[str, float]:
    """The controller's unlabelled-or-single-label samples by name (the switch series have one label)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as response:
        text = response.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("netagg_switch_") and not s.name.startswith("netagg_switch_drops")}


def switch_state(grpc_address: str) -> dict | None:
    """Every entry of the controller's tables and every multicast group, read over P4Runtime by a backup
    client; None when the switch cannot be read (down, or no pipeline)."""
    try:
        with P4RuntimeClient(grpc_address, device_id=1, election_id=(0, 1), p4info_path=dp.P4INFO_PATH,
                             timeout=5) as reader:
            entries = sorted((e.table, tuple(sorted(e.match.items())), e.action, tuple(sorted(e.params.items())))
                             for table in MANAGED_TABLES for e in reader.read_entries(table))
            groups = {gid: sorted(replicas) for gid, replicas in reader.read_multicast_groups().items()}
            return {"entries": entries, "groups": groups}
    except P4RuntimeError:
        return None


def cli(capsys, controller: ControllerProcess, *args: str, token: str = TOKENS["alice"]) -> tuple[int, str, str]:
    code = main(["--config", str(controller.config), "--token", token, *args])
    out, err = capsys.readouterr()
    return code, out, err


def create_job(capsys, controller: ControllerProcess, workers: int, *extra: str, slots: int = 8) -> dict:
    """A job create; narrow unless ``extra`` names a width (several 8-slot jobs fit the 64 cells then)."""
    width = () if "--width" in extra else ("--width", "64")
    code, out, err = cli(capsys, controller, "--json", "job", "create", "--slots", str(slots), "--workers",
                         ",".join(f"local:{p}" for p in free_ports(workers)), *width, *extra)
    assert code == 0, err
    return json.loads(out)["job"]


def jobs_of(capsys, controller: ControllerProcess) -> list[dict]:
    code, out, err = cli(capsys, controller, "--json", "job", "list", token=ADMIN_TOKEN)
    assert code == 0, err
    return json.loads(out)


def assert_refused_while_away(capsys, controller: ControllerProcess) -> None:
    """A job create while the switch is away: a clear error (exit 6), and no job left behind."""
    before = jobs_of(capsys, controller)
    code, _, err = cli(capsys, controller, "job", "create", "--slots", "4", "--workers", f"local:{free_udp_port()}")
    assert code == EXIT_CODES["switch_unavailable"], err
    assert "switch" in err and "unavailable" in err and "retry" in err and "Traceback" not in err
    assert jobs_of(capsys, controller) == before


def report(capsys, text: str) -> None:
    """Print a measured figure (shown with ``-s``; past capsys, which captures the CLI's output)."""
    with capsys.disabled():
        print(f"\n{text}")


def log_lines(controller: ControllerProcess, text: str) -> list[str]:
    return [line for line in controller.log.read_text().splitlines() if text in line]


def logged_at(line: str) -> float:
    """The Unix time of a controller log line (its asctime, millisecond resolution)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


# --------------------------------------------------------------------------- tests


def test_switch_restart_is_noticed_and_every_job_put_back(capsys, tmp_path):
    switches = [start_switch(tmp_path, "switch1")]
    config, metrics_port = config_with_metrics(tmp_path, switches[0])
    ctl = start_controller(config, tmp_path / "controller.log")
    try:
        address = switches[0].grpc_address
        allreduce = create_job(capsys, ctl, 2)
        ps_job = create_job(capsys, ctl, 3, "--mode", "ps", "--ps", "ps0")
        before = wait_for(lambda: switch_state(address), "the switch's tables")
        assert set(before["groups"]) == {allreduce["job_id"], ps_job["job_id"]}
        samples = scrape(metrics_port)
        assert samples["netagg_switch_up"] == 1 and samples["netagg_switch_restarts_total"] == 0

        killed = time.monotonic()
        kill9(switches[0])
        wait_for(lambda: scrape(metrics_port)["netagg_switch_up"] == 0, "the controller to report the switch down")
        noticed = time.monotonic()
        assert_refused_while_away(capsys, ctl)
        code, _, err = cli(capsys, ctl, "job", "delete", str(allreduce["job_id"]))
        assert code == EXIT_CODES["switch_unavailable"] and "unavailable" in err

        switches.append(restart_switch(tmp_path, switches[0], "switch2"))
        ready, ready_at = time.monotonic(), time.time()
        wait_for(lambda: switch_state(address) == before, "the restarted switch's tables and groups")
        restored = time.monotonic()
        samples = wait_for(lambda: (s := scrape(metrics_port))["netagg_switch_up"] == 1 and s,
                           "netagg_switch_up 1 again")
        assert samples["netagg_switch_restarts_total"] == 1
        assert samples["netagg_switch_reconnects_total"] == 1
        assert samples["netagg_switch_unavailable_seconds_total"] > 0
        assert len(log_lines(ctl, "WARNING switch")) == 1 and log_lines(ctl, "WARNING switch")[0].count(" lost: ") == 1
        back = log_lines(ctl, "back after")
        assert len(back) == 1 and "restarted" in back[0] and "pushed the pipeline" in back[0]
        report(capsys, f"[switch restart] kill -9 -> controller noticed {noticed - killed:.2f} s; restarted switch "
                       f"accepting P4Runtime -> controller in sync (its log) {logged_at(back[0]) - ready_at:.2f} s, "
                       f"-> tables and groups read back {restored - ready:.2f} s; "
                       f"controller log: {back[0].split(' INFO ')[-1]}")

        # Business as usual: a new job, and a delete, go through.
        third = create_job(capsys, ctl, 2)
        assert cli(capsys, ctl, "job", "delete", str(allreduce["job_id"]))[0] == 0
        state = switch_state(address)
        assert state is not None and set(state["groups"]) == {ps_job["job_id"], third["job_id"]}
        code, out, err = cli(capsys, ctl, "--json", "job", "show", str(ps_job["job_id"]))
        assert code == 0, err
        assert all(v >= 0 for v in json.loads(out)["counters"].values())  # baselines re-read after the restart
        assert ctl.process.poll() is None
    finally:
        ctl.stop()
        for switch in switches:
            switch.stop()


@pytest.mark.parametrize("first", ["controller", "switch"])
def test_controller_and_switch_killed_together(capsys, tmp_path, first):
    switches = [start_switch(tmp_path, "switch1")]
    config, metrics_port = config_with_metrics(tmp_path, switches[0])
    ctl = start_controller(config, tmp_path / "controller.log")
    controllers = [ctl]
    try:
        address = switches[0].grpc_address
        jobs = [create_job(capsys, ctl, 2), create_job(capsys, ctl, 3), create_job(capsys, ctl, 1, slots=5)]
        listed = jobs_of(capsys, ctl)
        before = wait_for(lambda: switch_state(address), "the switch's tables")
        assert set(before["groups"]) == {j["job_id"] for j in jobs}

        killed = time.monotonic()
        ctl.kill()
        kill9(switches[0])
        if first == "controller":  # the controller starts without its switch: it waits, serving the API
            ctl = start_controller(config, tmp_path / "controller.log")
            controllers.append(ctl)
            assert log_lines(ctl, "unavailable at start")
            assert jobs_of(capsys, ctl) == listed
            assert scrape(metrics_port)["netagg_switch_up"] == 0
            assert_refused_while_away(capsys, ctl)
            switches.append(restart_switch(tmp_path, switches[0], "switch2"))
        else:
            switches.append(restart_switch(tmp_path, switches[0], "switch2"))
            ctl = start_controller(config, tmp_path / "controller.log")
            controllers.append(ctl)
        ready = time.monotonic()
        wait_for(lambda: switch_state(address) == before, "the switch's tables and groups back")
        restored = time.monotonic()
        report(capsys, f"[controller and switch killed, {first} restarted first] both killed -> tables back "
              f"{restored - killed:.2f} s; the second of them ready -> tables back {restored - ready:.2f} s")
        wait_for(lambda: scrape(metrics_port)["netagg_switch_up"] == 1, "netagg_switch_up 1")
        if first == "controller":
            reached = log_lines(ctl, "reached after")
            assert len(reached) == 1 and "pushed the pipeline" in reached[0]

        # Jobs, leases and slots as before; a new job gets slots no other job holds.
        assert jobs_of(capsys, ctl) == listed
        added = create_job(capsys, ctl, 2)
        ranges = sorted((j["slot_base"], j["slot_base"] + j["cells"]) for j in [*listed, added])
        assert all(end <= start for (_, end), (start, _) in pairwise(ranges))
        state = switch_state(address)
        assert state is not None and set(state["groups"]) == {*before["groups"], added["job_id"]}
    finally:
        for one in controllers:
            one.stop()
        for switch in switches:
            switch.stop()


def test_workers_allreduce_through_a_restarted_switch(capsys, tmp_path):
    """Two workers mid-training: one allreduce before the kill, one started while the switch is away (it
    completes once the controller has put the job back), one more after; every sum exact."""
    switches = [start_switch(tmp_path, "switch1")]
    config, metrics_port = config_with_metrics(tmp_path, switches[0])
    ctl = start_controller(config, tmp_path / "controller.log")
    try:
        job = create_job(capsys, ctl, 2, "--width", "256")  # wide packets through the restart
        configs = []
        for rank in range(2):
            code, out, err = cli(capsys, ctl, "job", "config", str(job["job_id"]), "--rank", str(rank))
            assert code == 0, err
            configs.append(WorkerConfig.from_dict(yaml.safe_load(out)))
        rng = np.random.default_rng(7)
        rounds = [[rng.standard_normal(5000).astype(np.float32) for _ in range(2)] for _ in range(3)]
        results: list[list[np.ndarray]] = [[], []]
        finished: list[list[float]] = [[], []]
        stats: list[object] = [None, None]
        errors: list[BaseException] = []
        first_done = threading.Barrier(3, timeout=DEADLINE)
        switch_killed = threading.Event()

        def work(rank: int) -> None:
            try:
                # The progress timeout outlasts the outage: the worker retransmits until the switch is back.
                with KVWorker(configs[rank], progress_timeout=DEADLINE) as worker:
                    results[rank].append(worker.allreduce(rounds[0][rank]))
                    first_done.wait()
                    switch_killed.wait(DEADLINE)
                    for inputs in rounds[1:]:
                        results[rank].append(worker.allreduce(inputs[rank]))
                        finished[rank].append(time.monotonic())
                    stats[rank] = worker.transport.stats
            except BaseException as err:
                errors.append(err)
                first_done.abort()

        threads = [threading.Thread(target=work, args=(rank,), daemon=True) for rank in range(2)]
        for thread in threads:
            thread.start()
        first_done.wait()
        before = switch_state(switches[0].grpc_address)
        killed = time.monotonic()
        kill9(switches[0])
        wait_for(lambda: scrape(metrics_port)["netagg_switch_up"] == 0, "the controller to report the switch down")
        switch_killed.set()  # the workers start the second allreduce into a dead switch
        switches.append(restart_switch(tmp_path, switches[0], "switch2"))
        ready = time.monotonic()
        wait_for(lambda: switch_state(switches[0].grpc_address) == before, "the job back on the switch")
        restored = time.monotonic()
        for thread in threads:
            thread.join(DEADLINE * 2)
            assert not thread.is_alive(), "a worker is still running"
        done = time.monotonic()
        assert not errors, errors
        for index, inputs in enumerate(rounds):
            expected, _ = expected_allreduce(inputs, configs[0].width)
            for rank in range(2):
                np.testing.assert_array_equal(results[rank][index], expected)
        report(capsys, f"[workers through a restart] kill -> switch ready {ready - killed:.2f} s -> job back "
                       f"{restored - ready:.2f} s -> the allreduce started during the outage done "
                       f"{max(f[0] for f in finished) - restored:.2f} s later; the next one took "
                       f"{max(f[1] for f in finished) - max(f[0] for f in finished):.2f} s; all done "
                       f"{done - killed:.2f} s after the kill; retransmissions per worker "
                       f"{[getattr(one, 'retransmissions', None) for one in stats]}")
        assert scrape(metrics_port)["netagg_switch_restarts_total"] == 1
    finally:
        ctl.stop()
        for switch in switches:
            switch.stop()


def test_pipeline_replaced_under_a_live_session_is_noticed_by_the_poll(capsys, tmp_path):
    """No disconnect at all: another client pushes the same program with another cookie (which wipes the
    tables); the controller's periodic cookie read notices and re-installs everything."""
    switches = [start_switch(tmp_path, "switch1")]
    config, metrics_port = config_with_metrics(tmp_path, switches[0])
    ctl = start_controller(config, tmp_path / "controller.log")
    try:
        address = switches[0].grpc_address
        job = create_job(capsys, ctl, 2)
        before = wait_for(lambda: switch_state(address), "the switch's tables")
        with P4RuntimeClient(address, device_id=1, election_id=(0, 20), p4info_path=dp.P4INFO_PATH) as intruder:
            intruder.set_pipeline(dp.P4INFO_PATH, b"", cookie=0x1234)
            assert intruder.get_pipeline_cookie() == 0x1234
            # (Its tables are empty now; not asserted: the controller's poll may already be re-installing them.)
        wait_for(lambda: switch_state(address) == before, "the job back on the switch")
        samples = wait_for(lambda: (s := scrape(metrics_port))["netagg_switch_up"] == 1 and s, "netagg_switch_up 1")
        assert samples["netagg_switch_restarts_total"] == 1
        assert log_lines(ctl, "cookie is 0x1234")
        # The controller kept that pipeline (the same program) and now watches for its cookie.
        with P4RuntimeClient(address, device_id=1, election_id=(0, 1)) as reader:
            assert reader.get_pipeline_cookie() == 0x1234
        assert cli(capsys, ctl, "job", "show", str(job["job_id"]))[0] == 0
    finally:
        ctl.stop()
        for switch in switches:
            switch.stop()


def test_p4runtime_server_back_with_its_state_gets_a_cheap_reconcile(capsys, tmp_path):
    """The switch's P4Runtime server goes away and comes back on the same address with its pipeline and
    tables (the data path never stopped): a reconnect, not a restart; the reconcile changes nothing."""
    grpc_port, udp_port = free_ports(1, kind="tcp")[0], free_udp_port()
    target = SoftwareTarget(f"127.0.0.1:{grpc_port}", loopback=("127.0.0.1", udp_port), engine="reference").start()
    address = target.grpc_address
    config, metrics_port = config_with_metrics(tmp_path, (address, udp_port))
    ctl = start_controller(config, tmp_path / "controller.log")
    try:
        create_job(capsys, ctl, 2)
        before = wait_for(lambda: switch_state(address), "the switch's tables")
        assert target.server is not None
        target.server.server.stop(grace=None).wait(10)
        wait_for(lambda: scrape(metrics_port)["netagg_switch_up"] == 0, "the controller to report the switch down")
        target.server = serve(target.device, address, device_id=1)
        samples = wait_for(lambda: (s := scrape(metrics_port))["netagg_switch_up"] == 1 and s, "netagg_switch_up 1")
        assert (samples["netagg_switch_restarts_total"], samples["netagg_switch_reconnects_total"]) == (0, 1)
        back = log_lines(ctl, "back after")
        assert len(back) == 1 and "kept its state" in back[0] and "kept the pipeline" in back[0]
        assert "inserted 0, modified 0, deleted 0 entries, set 0 and deleted 0 groups" in back[0]
        assert switch_state(address) == before
    finally:
        ctl.stop()
        target.stop()


def test_startup_wait_bounds_the_wait_for_an_absent_switch(capsys, tmp_path):
    path = controller_config(tmp_path, f"127.0.0.1:{free_ports(1, kind='tcp')[0]}", free_udp_port())
    data = yaml.safe_load(path.read_text())
    data["switch"]["startup_wait_seconds"] = 1.5
    path.write_text(yaml.safe_dump(data))
    code = main(["--config", str(path), "controller", "run"])
    err = capsys.readouterr().err
    assert code == EXIT_CODES["switch_error"], err
    assert "was not reached within 1.5 s (switch.startup_wait_seconds)" in err and "Traceback" not in err
    data["switch"]["startup_wait_seconds"] = -1
    with pytest.raises(ConfigError, match="startup_wait_seconds: must be >= 0"):
        parse_config(data, "c.yaml")
