"""Start a switch target — BMv2 ``simple_switch_grpc`` or the software target — as a process.

Both are started the same way (ports as ``number@interface``, a P4Runtime
address, no pipeline: the controller or the test pushes it), so the caller has
one code path for both.
"""

from __future__ import annotations

import functools
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from netagg.bmv2.netns import ns_exec
from netagg.faults import Faults
from netagg.localports import free_ports

#: soft: the software target with its default engine (the compiled fast path where it can run);
#: soft-ref: the software target on its readable reference model; soft-sharded: its fast path in
#: SHARDED_SHARDS pipeline shards (several cores); bmv2: simple_switch_grpc.
TARGETS = ("soft", "soft-ref", "soft-sharded", "bmv2")
SOFT_TARGETS = ("soft", "soft-ref", "soft-sharded")
#: Shards of the soft-sharded target: more than this machine's cores is fine (it tests the steering).
SHARDED_SHARDS = 3


class TargetError(RuntimeError):
    """A target could not be started or did not come up."""


def bmv2_missing() -> str | None:
    """Why the BMv2 target cannot run here, or None when p4c and BMv2 are on PATH."""
    missing = [tool for tool in ("simple_switch_grpc", "p4c-bm2-ss") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not on PATH (install p4lang's p4c and behavioral-model packages)"
    return None


@dataclass
class TargetProcess:
    """A running switch and how to reach it."""

    kind: str
    grpc_address: str
    process: subprocess.Popen
    log_path: Path
    loopback_address: tuple[str, int] | None = None
    extra: dict = field(default_factory=dict)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@functools.cache
def _bmv2_has_thrift() -> bool:
    result = subprocess.run(["simple_switch_grpc", "--help"], capture_output=True, text=True, timeout=30)
    return "--thrift-port" in result.stdout + result.stderr


def target_command(kind: str, interfaces: Mapping[int, str], grpc_address: str, device_id: int = 1,
                   loopback: str | None = None, faults: Faults | None = None,
                   shards: int | None = None, udp_segmentation: bool = False) -> list[str]:
    """The command line that starts ``kind`` on ``interfaces`` ({port: ifname}); ``shards``: the software
    target's pipeline shards (None: its default, or SHARDED_SHARDS for soft-sharded); ``udp_segmentation``:
    the software target's raw ports send runs of one UDP flow as segmentation-offload sends (BMv2: ignored)."""
    if kind == "bmv2":
        if loopback or (faults and faults.args()):
            raise TargetError("BMv2 has no loopback UDP mode or fault injection; use the software target")
        cmd = ["simple_switch_grpc", "--device-id", str(device_id), "--no-p4", "--log-level", "warn"]
        if _bmv2_has_thrift():
            # BMv2 built with thrift opens a runtime port (9090 by default) on every address;
            # a free one keeps two switches (or anything else on 9090) from colliding.
            cmd += ["--thrift-port", str(free_ports(1, "tcp")[0])]
        for number, ifname in sorted(interfaces.items()):
            cmd += ["-i", f"{number}@{ifname}"]
        return [*cmd, "--", "--grpc-server-addr", grpc_address]
    if kind in SOFT_TARGETS:
        cmd = [sys.executable, "-m", "netagg.softswitch", "--grpc-addr", grpc_address, "--device-id", str(device_id)]
        if kind == "soft-ref":
            cmd += ["--engine", "reference"]
        elif kind == "soft-sharded":
            cmd += ["--engine", "fast", "--shards", str(shards or SHARDED_SHARDS)]
        if shards is not None and kind != "soft-sharded":
            cmd += ["--shards", str(shards)]
        for number, ifname in sorted(interfaces.items()):
            cmd += ["-i", f"{number}@{ifname}"]
        if loopback:
            cmd += ["--loopback", loopback]
        if udp_segmentation:
            cmd.append("--udp-segmentation")
        return cmd + (faults.args() if faults else [])
    raise TargetError(f"unknown target {kind!r}; choose one of {', '.join(TARGETS)}")


def start_target(kind: str, interfaces: Mapping[int, str], log_path: Path, grpc_address: str | None = None,
                 namespace: str | None = None, device_id: int = 1, loopback: str | None = None,
                 faults: Faults | None = None, ready_timeout: float = 20.0,
                 shards: int | None = None, udp_segmentation: bool = False) -> TargetProcess:
    """Start the target (inside ``namespace`` if given) and wait until P4Runtime answers."""
    if kind == "bmv2" and (reason := bmv2_missing()):
        raise TargetError(reason)
    grpc_address = grpc_address or f"127.0.0.1:{free_ports(1, 'tcp')[0]}"
    cmd = ns_exec(namespace, target_command(kind, interfaces, grpc_address, device_id, loopback, faults, shards,
                                            udp_segmentation))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    target = TargetProcess(kind, grpc_address, process, log_path)
    if loopback:
        host, port = loopback.rsplit(":", 1)
        target.loopback_address = (host, int(port))
    try:
        wait_for_p4runtime(target, namespace, ready_timeout)
    except BaseException:
        target.stop()
        raise
    return target


def wait_for_p4runtime(target: TargetProcess, namespace: str | None, timeout: float) -> None:
    """Poll the gRPC port until it accepts connections (inside the namespace if any)."""
    if target.grpc_address.startswith("unix:"):
        _wait_for_unix_socket(target, target.grpc_address[len("unix:"):], timeout)
        return
    host, port = target.grpc_address.rsplit(":", 1)
    probe = [sys.executable, "-c",
             f"import socket; socket.create_connection(({host!r}, {int(port)}), timeout=0.5).close()"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if target.process.poll() is not None:
            raise TargetError(f"{target.kind} target exited with {target.process.returncode}:\n{target.log_tail()}")
        if namespace is None:
            try:
                socket.create_connection((host, int(port)), timeout=0.5).close()
                return
            except OSError:
                pass
        elif subprocess.run(ns_exec(namespace, probe), capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    raise TargetError(f"{target.kind} target did not open P4Runtime on {target.grpc_address} "
                      f"within {timeout:.0f} s:\n{target.log_tail()}")


def _wait_for_unix_socket(target: TargetProcess, path: str, timeout: float) -> None:
    """A unix-socket P4Runtime address is reachable from every network namespace."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if target.process.poll() is not None:
            raise TargetError(f"{target.kind} target exited with {target.process.returncode}:\n{target.log_tail()}")
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(0.5)
                s.connect(path)
            return
        except OSError:
            time.sleep(0.1)
    raise TargetError(f"{target.kind} target did not open P4Runtime on unix:{path} within {timeout:.0f} s:\n"
                      f"{target.log_tail()}")
