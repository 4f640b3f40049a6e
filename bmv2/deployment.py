"""A complete netagg deployment on this machine: switch, controller, parameter server, workers.

Used by ``make demo`` and its integration test. Every process it starts is
stopped when the context exits — normally, on an exception, or on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import yaml

from netagg import dataplane as dp
from netagg.bmv2.targets import TargetProcess, start_target
from netagg.jobconfig import WorkerConfig
from netagg.localports import free_ports
from netagg.shutdown import sigterm_as_interrupt

TENANT_TOKEN = "demo-tenant-token"
ADMIN_TOKEN = "demo-admin-token"


class DeploymentError(RuntimeError):
    """A process of the deployment failed to start or to do its job."""


def json_result(process: subprocess.Popen, what: str, timeout: float) -> dict:
    """The last line ``process`` prints, parsed as JSON; DeploymentError (with its stderr) if it fails."""
    out, err = process.communicate(timeout=timeout)
    if process.returncode != 0 or not (out or "").strip():
        raise DeploymentError(f"{what} failed (exit {process.returncode}):\n{(err or '')[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


class Deployment:
    """Switch, controller and CLI; subclasses decide where the switch and the hosts live."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[subprocess.Popen] = []
        self.switch: TargetProcess | None = None
        self.config_path = workdir / "controller.yaml"
        #: ``controller.worker_address``: where the deployment's workers reach the controller to follow moves of
        #: their job's slots (None: the controller moves no jobs; its hosts cannot reach it).
        self.worker_address: str | None = None
        #: Parameter servers in the controller's configuration: ps0, ps1, ... on consecutive ports of the PS host.
        self.parameter_servers = 1
        #: Tenants besides ``demo`` (name -> token), for jobs of several tenants.
        self.tenants: dict[str, str] = {}
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", "NETAGG_CONFIG": str(self.config_path)}

    # -- lifecycle ---------------------------------------------------------
    def __enter__(self) -> Deployment:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._cleanup = ExitStack()
        self._cleanup.enter_context(sigterm_as_interrupt())
        self._cleanup.callback(self.stop)  # runs first: stop processes, then restore SIGTERM
        try:
            self._start()
        except BaseException:
            self._cleanup.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._cleanup.close()

    def _start(self) -> None:
        """Start the switch, write ``controller.yaml`` (see controller_config), start the controller."""
        raise NotImplementedError

    def controller_config(self, grpc_address: str, aggregator_ip: str, aggregator_port: int, hosts: list[dict],
                          ps_host: str, ps_port: int, capacity: int, bmv2_json: Path | None = None,
                          target_rtt_ms: float | None = None) -> dict:
        """The controller's configuration for one switch; ``hosts`` as its ``hosts:`` entries (with ``link_mbit``
        where the link's rate is known), ``target_rtt_ms`` its ``slots.target_rtt_ms`` (None: the default)."""
        switch = {"grpc_address": grpc_address, "p4info": str(dp.P4INFO_PATH),
                  "aggregator": {"ip": aggregator_ip, "udp_port": aggregator_port}}
        if bmv2_json is not None:
            switch["bmv2_json"] = str(bmv2_json)
        return {"switch": switch, **self._controller_common(ps_host, ps_port, capacity, target_rtt_ms),
                "hosts": hosts}

    def topology_controller_config(self, topology: Path, ps_host: str, ps_port: int, capacity: int,
                                   bmv2_json: Path | None = None) -> dict:
        """The controller's configuration for a tree of switches: the topology file names the switches and the
        hosts (docs/controller.md, "The daemon over a topology"); ``bmv2_json``: the program every BMv2 switch
        of the tree gets."""
        switch = {"p4info": str(dp.P4INFO_PATH), **({"bmv2_json": str(bmv2_json)} if bmv2_json else {})}
        return {"topology": str(topology), "switch": switch, **self._controller_common(ps_host, ps_port, capacity)}

    def _controller_common(self, ps_host: str, ps_port: int, capacity: int,
                           target_rtt_ms: float | None = None) -> dict:
        rtt = {} if target_rtt_ms is None else {"target_rtt_ms": target_rtt_ms}
        workers = {} if self.worker_address is None else {"worker_address": self.worker_address}
        return {
            "slots": {"capacity": capacity, "min_per_job": 4, **rtt},
            "controller": {"database": str(self.workdir / "controller.db"),
                           "api_socket": str(self.workdir / "controller.sock"), "admin_token": ADMIN_TOKEN,
                           **workers},
            "tenants": {"demo": {"token": TENANT_TOKEN}, **{n: {"token": t} for n, t in self.tenants.items()}},
            "parameter_servers": [{"name": f"ps{i}", "host": ps_host, "udp_port": ps_port + i}
                                  for i in range(self.parameter_servers)],
        }

    def start_controller(self, config: dict) -> None:
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        socket_path = Path(config["controller"]["api_socket"])
        controller = self.spawn("controller", [sys.executable, "-m", "netagg.controller.cli", "controller", "run"])
        deadline = time.monotonic() + 30
        while not socket_path.exists():
            if controller.poll() is not None or time.monotonic() > deadline:
                raise DeploymentError(f"the controller did not start:\n{self.log_tail('controller')}")
            time.sleep(0.05)

    @property
    def worker_hosts(self) -> list[str]:
        """Configured host names that run workers (rank order)."""
        raise NotImplementedError

    @property
    def ps_host(self) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        assert self.switch is not None
        return f"{self.switch.kind} target, P4Runtime on {self.switch.grpc_address}"

    def host_command(self, host: str, cmd: Sequence[str]) -> list[str]:
        """How to run ``cmd`` on ``host`` (a configured host name)."""
        return list(cmd)

    def worker_ports(self, hosts: Sequence[str], offset: int = 0) -> list[int]:
        """UDP ports for workers on ``hosts`` (``offset``: a second job on the same hosts uses other ports)."""
        return free_ports(len(hosts))

    def stop(self) -> None:
        """Stop every process (workers and PS first, then the controller, the switch last)."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        self.processes.clear()
        if self.switch is not None:
            self.switch.stop()
            self.switch = None

    # -- processes -----------------------------------------------------------
    def spawn(self, name: str, cmd: Sequence[str], stdout: int | None = None) -> subprocess.Popen:
        """Start a process logged to ``workdir/<name>.log`` (or piped, when ``stdout`` is PIPE)."""
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it until it exits
        process = subprocess.Popen(list(cmd), stdout=stdout if stdout is not None else log, stderr=log,
                                   env=self._env, cwd=dp.REPO_ROOT, text=stdout is not None)
        log.close()
        self.processes.append(process)
        return process

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def cli(self, *args: str, token: str = TENANT_TOKEN) -> str:
        """Run ``netagg ARGS`` as the operator would; returns stdout, raises on a non-zero exit."""
        result = subprocess.run([sys.executable, "-m", "netagg.controller.cli", "--token", token, *args],
                                capture_output=True, text=True, env=self._env, cwd=dp.REPO_ROOT, timeout=60)
        if result.returncode != 0:
            raise DeploymentError(f"netagg {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def create_job(self, hosts: Sequence[str], slots: int | None, mode: str = "allreduce", name: str = "demo",
                   port_offset: int = 0, options: Sequence[str] = (), ps: str | None = "ps0",
                   token: str = TENANT_TOKEN) -> dict:
        """``netagg job create`` for one worker per entry of ``hosts`` (configured host names), of ``slots`` slots
        (None: the controller chooses them from the hosts' links), with the PS ``ps`` (the deployment's; None:
        none) and ``options`` (more ``job create`` flags), as the tenant of ``token``; writes every rank's YAML.
        Jobs sharing hosts need different ``port_offset``s."""
        num_workers = len(hosts)
        ports = self.worker_ports(hosts, port_offset)
        args = ["--json", "job", "create", "--name", name, *(() if slots is None else ("--slots", str(slots))),
                "--mode", mode, *(("--ps", ps) if ps else ()),
                "--workers", ",".join(f"{h}:{p}" for h, p in zip(hosts, ports)), *options]
        created = json.loads(self.cli(*args, token=token))
        job_id = created["job"]["job_id"]
        created["config_paths"] = []
        for rank in range(num_workers):
            path = self.workdir / f"job{job_id}-rank{rank}.yaml"
            self.cli("job", "config", str(job_id), "--rank", str(rank), "-o", str(path), token=token)
            WorkerConfig.load(path)  # validates what the controller wrote
            created["config_paths"].append(path)
        return created

    def start_ps(self, config_path: Path, ps_host: str, handle: str = "sum", lr: float = 0.1,
                 name: str = "ps") -> subprocess.Popen:
        """The job's parameter server on ``ps_host``, on the endpoint in its config; waits until it is up (its log:
        ``name``.log)."""
        ps = self.spawn(name, self.host_command(ps_host, [
            sys.executable, "-m", "netagg.hoststack.server", "--config", str(config_path),
            "--handle", handle, "--lr", str(lr)]))
        deadline = time.monotonic() + 30
        while "netagg PS:" not in self.log_tail(name):
            if ps.poll() is not None or time.monotonic() > deadline:
                raise DeploymentError(f"the parameter server did not start:\n{self.log_tail(name)}")
            time.sleep(0.05)
        return ps


class LocalDeployment(Deployment):
    """The embedded default: software target in loopback UDP mode; every host is 127.0.0.1."""

    HOST = "local"

    def __init__(self, workdir: Path, capacity: int = 1024, max_workers: int = 32, switch: str = "soft") -> None:
        super().__init__(workdir)
        # Every process is on this host: the workers follow moves at any free port (kept across restarts).
        self.worker_address = "127.0.0.1:0"
        self.capacity = capacity
        self.max_workers = max_workers
        #: ``soft`` (the software target's default engine) or ``soft-ref`` (its reference model).
        self.switch_kind = switch

    @property
    def worker_hosts(self) -> list[str]:
        return [self.HOST] * self.max_workers

    @property
    def ps_host(self) -> str:
        return self.HOST

    def describe(self) -> str:
        return f"{super().describe()}, loopback UDP port {self.switch.loopback_address[1]}"

    def _start(self) -> None:
        udp_port, ps_port = free_ports(2, "both")  # the PS binds UDP and TCP on ps_port
        self.switch = start_target(self.switch_kind, {}, self.workdir / "softswitch.log",
                                   loopback=f"127.0.0.1:{udp_port}")
        hosts = [{"name": self.HOST, "ip": "127.0.0.1", "mac": "02:00:00:00:bb:01", "port": 1}]
        self.start_controller(self.controller_config(self.switch.grpc_address, "127.0.0.1", udp_port, hosts,
                                                     self.HOST, ps_port, self.capacity))
