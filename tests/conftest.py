"""Shared fixtures: a software target process in loopback mode and a controller process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from netagg import dataplane as dp
from netagg.bmv2.p4build import compile_program
from netagg.bmv2.targets import TargetProcess, bmv2_missing, start_target
from netagg.controller.fabric import ONE_SWITCH, SwitchSession
from netagg.controller.store import JobRecord
from netagg.localports import free_ports

ADMIN_TOKEN = "admin-test-token"
#: A root and two racks of two hosts each, as a topology file gives it (no switch behind the addresses).
TWO_RACKS = {
    "switches": {
        "root": {"grpc_address": "unix:/unused/root", "aggregator": {"ip": "10.60.0.254", "mac": "02:00:00:60:00:fe"}},
        "rack0": {"grpc_address": "unix:/unused/rack0", "aggregator": {"ip": "10.61.0.254", "mac": "02:00:00:61:00:fe"},
                  "parent": {"switch": "root", "up_port": 32, "port": 1}},
        "rack1": {"grpc_address": "unix:/unused/rack1", "aggregator": {"ip": "10.62.0.254", "mac": "02:00:00:62:00:fe"},
                  "parent": {"switch": "root", "up_port": 32, "port": 2}},
    },
    "hosts": [{"name": f"r{r}h{h}", "switch": f"rack{r}", "port": 1 + h, "ip": f"10.6{1 + r}.0.{1 + h}",
               "mac": f"02:00:00:6{1 + r}:00:{1 + h:02x}"} for r in range(2) for h in range(2)],
}


def old_database(path: Path, missing: str) -> None:
    """A controller database from before the ``jobs`` column ``missing`` existed, holding one job (id 4, alice's,
    8 slots from 16, generation 3)."""
    import sqlite3

    from netagg.controller import store

    conn = sqlite3.connect(str(path))
    conn.executescript(store.SCHEMA)
    for name, declaration in store.MIGRATIONS:
        if name != missing:
            conn.execute(f"ALTER TABLE jobs ADD COLUMN {name} {declaration}")
    conn.execute(
        "INSERT INTO jobs (job_id, tenant, name, mode, state, slot_base, slot_count, slots_wanted, generation,"
        " workers, ps, lease_seconds, lease_expires, created) VALUES"
        " (4, 'alice', 'old', 'allreduce', 'active', 16, 8, 8, 3, ?, NULL, 60, 1e12, 1)",
        ('[{"rank": 0, "host": "local", "ip": "127.0.0.1", "udp_port": 5000}]',))
    conn.commit()
    conn.close()
TOKENS = {"alice": "alice-test-token", "bob": "bob-test-token"}


def free_udp_port() -> int:
    """A port for a job endpoint: free for UDP and TCP (a PS node on it listens on TCP too)."""
    return free_ports(1, "both")[0]


@pytest.fixture(scope="session")
def bmv2_json(tmp_path_factory) -> Path:
    """The program compiled for BMv2 (skips, saying why, without p4c and BMv2)."""
    reason = bmv2_missing()
    if reason:
        pytest.skip(f"BMv2 target: {reason}")
    json_path, _ = compile_program(tmp_path_factory.mktemp("p4c"))
    return json_path


@pytest.fixture
def soft_switch(tmp_path: Path) -> Iterator[TargetProcess]:
    """The software target as a process: P4Runtime on a free port, loopback UDP port."""
    target = start_target("soft", {}, tmp_path / "softswitch.log", loopback=f"127.0.0.1:{free_udp_port()}")
    yield target
    target.stop()


@pytest.fixture(params=["soft", pytest.param("bmv2", marks=pytest.mark.bmv2)])
def any_switch(request, tmp_path: Path) -> Iterator[TargetProcess]:
    """Each target in turn, for control-plane tests: the software target, then BMv2 (no ports)."""
    if request.param == "soft":
        yield request.getfixturevalue("soft_switch")
        return
    json_path = request.getfixturevalue("bmv2_json")
    target = start_target("bmv2", {}, tmp_path / "bmv2.log")
    target.extra["bmv2_json"] = json_path
    target.loopback_address = ("127.0.0.1", 28900)  # unused: BMv2 has no loopback port
    yield target
    target.stop()


def controller_config(tmp_path: Path, grpc_address: str, aggregator_port: int, capacity: int = 64,
                      min_slots: int = 4, lease: float = 3600, bmv2_json: Path | None = None) -> Path:
    config = {
        "switch": {"grpc_address": grpc_address, "device_id": 1, "election_id": 10,
                   "p4info": str(dp.P4INFO_PATH),
                   **({"bmv2_json": str(bmv2_json)} if bmv2_json else {}),
                   "aggregator": {"ip": "127.0.0.1", "mac": "02:00:00:00:aa:01", "udp_port": aggregator_port}},
        "slots": {"capacity": capacity, "min_per_job": min_slots},
        "jobs": {"lease_seconds": lease},
        "controller": {"database": str(tmp_path / "ctl.db"), "api_socket": str(tmp_path / "ctl.sock"),
                       "admin_token": ADMIN_TOKEN},
        "tenants": {name: {"token": token} for name, token in TOKENS.items()},
        "hosts": [{"name": "local", "ip": "127.0.0.1", "mac": "02:00:00:00:bb:01", "port": 1}],
        "parameter_servers": [{"name": "ps0", "host": "local", "udp_port": 29001}],
    }
    path = tmp_path / "controller.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class ControllerProcess:
    """A `netagg controller run` process."""

    config: Path
    socket: Path
    process: subprocess.Popen
    log: Path

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_controller(config: Path, log: Path, timeout: float = 20.0) -> ControllerProcess:
    socket_path = Path(yaml.safe_load(config.read_text())["controller"]["api_socket"])
    if socket_path.exists():
        socket_path.unlink()
    with open(log, "ab") as out:
        process = subprocess.Popen([sys.executable, "-m", "netagg.controller.cli", "--config", str(config),
                                    "controller", "run"], stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    controller = ControllerProcess(config, socket_path, process, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"controller exited {process.returncode}:\n{log.read_text()[-3000:]}")
        if socket_path.exists():
            return controller
        time.sleep(0.05)
    controller.kill()
    raise RuntimeError(f"controller did not come up:\n{log.read_text()[-3000:]}")


def config_for(tmp_path: Path, switch: TargetProcess, **kwargs) -> Path:
    """A controller configuration for ``switch`` (either target)."""
    return controller_config(tmp_path, switch.grpc_address, switch.loopback_address[1],
                             bmv2_json=switch.extra.get("bmv2_json"), **kwargs)


@pytest.fixture
def controller(tmp_path: Path, any_switch: TargetProcess) -> Iterator[ControllerProcess]:
    """A controller process on each target in turn."""
    ctl = start_controller(config_for(tmp_path, any_switch), tmp_path / "controller.log")
    yield ctl
    ctl.stop()


@pytest.fixture
def soft_controller(tmp_path: Path, soft_switch: TargetProcess) -> Iterator[ControllerProcess]:
    """A controller on the software target (tests that send traffic over loopback UDP)."""
    ctl = start_controller(config_for(tmp_path, soft_switch), tmp_path / "controller.log")
    yield ctl
    ctl.stop()


class _Client:
    index = None


class FakeFabric:
    """A stand-in for the controller's switches in the job service's tests: switches that are always there
    (one, or a tree's), recording the jobs installed and counting nothing."""

    def __init__(self, names: tuple[str, ...] = (ONE_SWITCH,), tree: bool = False) -> None:
        self.is_tree = tree
        self.sessions = {n: SwitchSession(n, "fake", 1, _Client(), unavailable_since=None) for n in names}
        self.installed: dict[int, JobRecord] = {}

    def switches_of(self, job: JobRecord) -> list[str]:
        if not job.uses_switch:
            return []
        return list(job.segments) if self.is_tree else [ONE_SWITCH]

    def install(self, job: JobRecord, others: list[JobRecord]) -> None:
        self.installed[job.job_id] = job

    def remove(self, job: JobRecord, others: list[JobRecord]) -> None:
        self.installed.pop(job.job_id, None)

    def read_counters(self, switch: str, job_id: int) -> dict[str, int]:
        return dict.fromkeys(dp.JOB_COUNTERS, 0)
