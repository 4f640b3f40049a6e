"""The kernel socket path's ceilings, measured by a native probe, and a native netagg load generator.

``benchmarks/native/limit_probe.c`` is compiled on first use (``build/native/limit_probe``).
A user-space switch or host stack on the kernel's socket path cannot do better than a
native reflector that does nothing but echo: ``udp_round_trips`` measures that ceiling on
loopback UDP, ``raw_round_trips`` on AF_PACKET sockets at the two ends of a veth pair.
``netagg-drive`` (``drive_switch_udp`` / ``drive_switch_raw``) drives a switch with
SwitchML-style rounds, so the Python load generator is not what a benchmark measures, and
``netagg_reflector`` is a zero-cost 1-worker aggregator (it echoes with the RESULT flag set).

``python -m benchmarks.limit_probe`` prints both ceilings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from netagg import dataplane as dp
from netagg import wire
from netagg.bmv2.netns import VethRig, can_create_namespaces, ns_exec

SOURCE = Path(__file__).resolve().parent / "native" / "limit_probe.c"
BINARY = dp.BUILD_DIR / "native" / "limit_probe"


class ProbeUnavailable(RuntimeError):
    """No C compiler to build the probe with."""


def find_compiler() -> str | None:
    """``$CC``, else the first of cc, gcc, clang on PATH."""
    if os.environ.get("CC"):
        return os.environ["CC"]
    return next((path for name in ("cc", "gcc", "clang") if (path := shutil.which(name))), None)


def build_probe() -> Path:
    """Compile the probe unless the binary is newer than its source; returns the binary's path."""
    if BINARY.exists() and BINARY.stat().st_mtime >= SOURCE.stat().st_mtime:
        return BINARY
    cc = find_compiler()
    if cc is None:
        raise ProbeUnavailable("no C compiler (cc) found: install gcc (make setup does, as root)")
    BINARY.parent.mkdir(parents=True, exist_ok=True)
    tmp = BINARY.with_name(f".{BINARY.name}.{os.getpid()}")
    out = subprocess.run([cc, "-O2", "-std=c11", "-Wall", "-o", str(tmp), str(SOURCE)],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{cc} failed on {SOURCE}:\n{out.stderr[-3000:]}")
    os.replace(tmp, BINARY)  # atomic: concurrent builds never see half a binary
    return BINARY


def _run(args: Sequence[str], namespace: str | None = None, timeout: float = 60.0) -> dict:
    """Run one probe command (inside ``namespace`` if given) and return its JSON result."""
    cmd = ns_exec(namespace, [str(build_probe()), *args])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@dataclass
class Reflector:
    """A running reflector: where it listens; its counts once it has stopped."""

    address: str
    stats: dict = field(default_factory=dict)


@contextlib.contextmanager
def reflector(args: Sequence[str], namespace: str | None = None) -> Iterator[Reflector]:
    """Run ``udp-reflect``/``raw-reflect`` with ``args`` until the block ends (then SIGTERM)."""
    cmd = ns_exec(namespace, [str(build_probe()), *args])
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        line = process.stderr.readline()  # "listening ADDRESS" once bound, or an error and exit
        if not line.startswith("listening "):
            process.wait(timeout=5)
            raise RuntimeError(f"{' '.join(cmd)}: {line}{process.stderr.read()[-2000:]}")
        running = Reflector(line.split(None, 1)[1].strip())
        yield running
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            stdout, _ = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, _ = process.communicate()
    lines = stdout.strip().splitlines()
    running.stats.update(json.loads(lines[-1]) if lines else {})


@contextlib.contextmanager
def netagg_reflector(bind: tuple[str, int] = ("127.0.0.1", 0)) -> Iterator[tuple[str, int]]:
    """A zero-cost 1-worker aggregator on UDP: every datagram goes back to its sender as a RESULT."""
    with reflector(["udp-reflect", "--bind", f"{bind[0]}:{bind[1]}", "--netagg"]) as running:
        host, port = running.address.rsplit(":", 1)
        yield host, int(port)


def udp_round_trips(size: int = wire.NETAGG_BYTES, window: int = 64, seconds: float = 2.0) -> dict:
    """Round trips/s of ``window`` datagrams of ``size`` bytes in flight through a loopback UDP reflector."""
    with reflector(["udp-reflect", "--bind", "127.0.0.1:0"]) as running:
        result = _run(["udp-client", "--target", running.address, "--size", str(size), "--window", str(window),
                       "--seconds", str(seconds)], timeout=seconds + 30)
    result["reflector"] = running.stats
    return result


def raw_round_trips(size: int = wire.FRAME_BYTES, window: int = 64, seconds: float = 2.0) -> dict | str:
    """The same with raw frames on a veth pair in a private namespace; "skipped: why" without namespaces."""
    ok, why = can_create_namespaces()
    if not ok:
        return f"skipped: {why}"
    build_probe()
    with VethRig(f"lp{os.getpid() % 100000}", 1) as rig:
        switch_end, test_end = rig.switch_interfaces()[1], rig.test_interfaces()[1]
        with reflector(["raw-reflect", "--ifname", switch_end], rig.namespace) as running:
            result = _run(["raw-client", "--ifname", test_end, "--size", str(size), "--window", str(window),
                           "--seconds", str(seconds)], rig.namespace, timeout=seconds + 30)
    result["reflector"] = running.stats
    return result


def _drive_limits(job_id: int, slots: int, seconds: float, rounds: int | None, rto_ms: float) -> list[str]:
    args = ["--job", str(job_id), "--slots", str(slots), "--rto-ms", str(rto_ms)]
    return args + (["--rounds", str(rounds)] if rounds else ["--seconds", str(seconds)])


def _timeout(seconds: float, rounds: int | None) -> float:
    return 330.0 if rounds else seconds + 60


def drive_switch_udp(target: tuple[str, int], bind_ports: Sequence[int], *, job_id: int = 1, slots: int = 32,
                     seconds: float = 2.0, rounds: int | None = None, rto_ms: float = 20.0) -> dict:
    """netagg-drive over loopback UDP: one worker per port in ``bind_ports`` (rank = index)."""
    args = ["netagg-drive", "--udp", "--workers", str(len(bind_ports)), "--target", f"{target[0]}:{target[1]}",
            "--bind-ports", ",".join(map(str, bind_ports)), *_drive_limits(job_id, slots, seconds, rounds, rto_ms)]
    return _run(args, timeout=_timeout(seconds, rounds))


def drive_switch_raw(ifnames: Sequence[str], src_ips: Sequence[str], src_macs: Sequence[str], dst_ip: str,
                     dst_mac: str, *, job_id: int = 1, slots: int = 32, seconds: float = 2.0,
                     rounds: int | None = None, rto_ms: float = 20.0, udp_src_base: int = 40000,
                     namespace: str | None = None) -> dict:
    """netagg-drive with raw frames: worker i sends on ``ifnames[i]`` from ``src_ips[i]``/``src_macs[i]``."""
    args = ["netagg-drive", "--raw", "--workers", str(len(ifnames)), "--ifnames", ",".join(ifnames),
            "--src-ips", ",".join(src_ips), "--src-macs", ",".join(src_macs), "--dst-ip", dst_ip,
            "--dst-mac", dst_mac, "--udp-src-base", str(udp_src_base),
            *_drive_limits(job_id, slots, seconds, rounds, rto_ms)]
    return _run(args, namespace, timeout=_timeout(seconds, rounds))


def describe(result: dict | str) -> str:
    """One line for a probe result."""
    if isinstance(result, str):
        return result
    reflector_cpu = result["reflector"].get("cpu_seconds", 0.0) / max(result["reflector"].get("seconds", 1.0), 1e-9)
    client_cpu = result["cpu_seconds"] / result["seconds"]
    return (f"{result['round_trips_per_s']:,.0f} round trips/s (client CPU {client_cpu:.0%}, "
            f"reflector CPU {reflector_cpu:.0%}, {result['timeouts']} timeouts)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement")
    parser.add_argument("--window", type=int, default=64, help="packets in flight")
    args = parser.parse_args(argv)
    build_probe()
    print(f"UDP loopback, {wire.NETAGG_BYTES}-byte datagrams, window {args.window}: "
          f"{describe(udp_round_trips(wire.NETAGG_BYTES, args.window, args.seconds))}")
    print(f"AF_PACKET on a veth pair, {wire.FRAME_BYTES}-byte frames, window {args.window}: "
          f"{describe(raw_round_trips(wire.FRAME_BYTES, args.window, args.seconds))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
