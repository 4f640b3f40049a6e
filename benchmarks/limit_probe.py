"""The kernel socket path's ceilings, measured by a native probe, and a native netagg load generator.

``benchmarks/native/limit_probe.c`` is compiled on first use (``build/native/limit_probe``).
A user-space switch or host stack on the kernel's socket path cannot do better than a
native reflector that does nothing but echo: ``udp_round_trips`` measures that ceiling on
loopback UDP, ``veth_udp_round_trips`` with UDP sockets in two namespaces joined by a veth
pair, ``raw_round_trips`` on AF_PACKET sockets at the two ends of a veth pair.
``netagg-drive`` (``drive_switch_udp`` / ``drive_switch_raw``) drives a switch with
SwitchML-style rounds, so the Python load generator is not what a benchmark measures, and
``netagg_reflector`` is a zero-cost 1-worker aggregator (it echoes with the RESULT flag set).

The UDP ceilings come in two modes: per datagram (sendmmsg/recvmmsg, the default) and
``gso=True``: UDP GSO sends (``UDP_SEGMENT``, up to 64 equal-size datagrams a send) and UDP
GRO receives (``UDP_GRO``: one coalesced buffer, split by its segment size), the reflector
echoing each coalesced buffer with one GSO send (``netagg_reflector(gro=True)``,
``drive_switch_udp(..., gso=True)``). The clients check a sequence number and a hash of it in
every echoed payload, so a kernel that corrupts GSO sends shows as ``payload_errors``.

``python -m benchmarks.limit_probe`` prints every ceiling, per datagram and with GSO/GRO.
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
from netagg.bmv2.netns import SWITCH_MAC, Topology, VethRig, can_create_namespaces, ns_exec
from netagg.bmv2.netns import run as netns_run

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
def netagg_reflector(bind: tuple[str, int] = ("127.0.0.1", 0), gro: bool = False) -> Iterator[tuple[str, int]]:
    """A zero-cost 1-worker aggregator on UDP: every datagram goes back to its sender as a RESULT.

    ``gro``: receive with UDP_GRO and echo each coalesced buffer with one UDP_SEGMENT send.
    """
    args = ["udp-reflect", "--bind", f"{bind[0]}:{bind[1]}", "--netagg", *(["--gro"] if gro else [])]
    with reflector(args) as running:
        host, port = running.address.rsplit(":", 1)
        yield host, int(port)


def udp_client(target: str, size: int = wire.NETAGG_BYTES, window: int = 64, seconds: float = 2.0,
               gso: bool = False, namespace: str | None = None) -> dict:
    """``udp-client`` against ``target`` ("IP:PORT"): ``window`` datagrams of ``size`` bytes in flight."""
    args = ["udp-client", "--target", target, "--size", str(size), "--window", str(window),
            "--seconds", str(seconds), *(["--gso"] if gso else [])]
    return _run(args, namespace, timeout=seconds + 30)


def udp_round_trips(size: int = wire.NETAGG_BYTES, window: int = 64, seconds: float = 2.0,
                    gso: bool = False) -> dict:
    """Round trips/s of ``window`` datagrams of ``size`` bytes in flight through a loopback UDP reflector.

    ``gso``: the client sends with UDP_SEGMENT and receives with UDP_GRO, the reflector runs with --gro.
    """
    with reflector(["udp-reflect", "--bind", "127.0.0.1:0", *(["--gro"] if gso else [])]) as running:
        result = udp_client(running.address, size, window, seconds, gso)
    result["reflector"] = running.stats
    return result


def veth_udp_round_trips(size: int = wire.NETAGG_BYTES, window: int = 64, seconds: float = 2.0,
                         gso: bool = False) -> dict | str:
    """The same across a veth pair between two namespaces; "skipped: why" without namespaces.

    The reflector runs in the switch namespace of a one-host ``Topology`` (at its aggregator address),
    the client in the host's namespace. Per datagram the veth's offloads are off (as ``Topology`` sets
    them); ``gso`` turns tx/rx checksumming, TSO and GSO on at both ends, so the veth carries GSO packets
    unsegmented to the GRO reflector.
    """
    ok, why = can_create_namespaces()
    if not ok:
        return f"skipped: {why}"
    build_probe()
    with Topology(f"lv{os.getpid() % 100000}", 1, subnet=89) as topo:
        host, switch = topo.hosts[0], topo.switch_namespace
        netns_run(ns_exec(switch, ["ip", "link", "set", host.switch_ifname, "address", SWITCH_MAC]))
        netns_run(ns_exec(switch, ["ip", "addr", "add", f"{topo.aggregator_ip}/24", "dev", host.switch_ifname]))
        netns_run(ns_exec(switch, ["ip", "neigh", "replace", host.ip, "lladdr", host.mac, "dev", host.switch_ifname,
                                   "nud", "permanent"]))
        if gso and shutil.which("ethtool"):  # without ethtool the veth keeps its defaults: offloads on
            for namespace, ifname in ((switch, host.switch_ifname), (host.namespace, host.ifname)):
                netns_run(ns_exec(namespace, ["ethtool", "-K", ifname, "tx", "on", "rx", "on", "tso", "on",
                                              "gso", "on"]))
        bind = ["udp-reflect", "--bind", f"{topo.aggregator_ip}:0", *(["--gro"] if gso else [])]
        with reflector(bind, switch) as running:
            result = udp_client(running.address, size, window, seconds, gso, host.namespace)
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
                     seconds: float = 2.0, rounds: int | None = None, rto_ms: float = 20.0,
                     gso: bool = False) -> dict:
    """netagg-drive over loopback UDP: one worker per port in ``bind_ports`` (rank = index).

    ``gso``: each worker sends its queued contributions as UDP_SEGMENT sends (up to 64 a send) and
    receives results with UDP_GRO.
    """
    args = ["netagg-drive", "--udp", "--workers", str(len(bind_ports)), "--target", f"{target[0]}:{target[1]}",
            "--bind-ports", ",".join(map(str, bind_ports)), *_drive_limits(job_id, slots, seconds, rounds, rto_ms),
            *(["--gso"] if gso else [])]
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


def describe(result: dict | str, unit: str = "round trips") -> str:
    """One line for a probe result."""
    if isinstance(result, str):
        return result
    reflector_cpu = result["reflector"].get("cpu_seconds", 0.0) / max(result["reflector"].get("seconds", 1.0), 1e-9)
    client_cpu = result["cpu_seconds"] / result["seconds"]
    extra = ""
    if "payload_errors" in result:
        extra = (f", {result['payload_errors']} payload errors, {result['datagrams_per_send']:.1f} datagrams/send, "
                 f"{result['datagrams_per_receive']:.1f}/receive")
    return (f"{result['round_trips_per_s']:,.0f} {unit}/s (client CPU {client_cpu:.0%}, "
            f"reflector CPU {reflector_cpu:.0%}, {result['timeouts']} timeouts{extra})")


def ratio(gso: dict | str, per_datagram: dict | str) -> str:
    """GSO/GRO round trips/s over per-datagram ones, as "N.Nx per datagram" ("n/a" when either is missing)."""
    if isinstance(gso, str) or isinstance(per_datagram, str) or not per_datagram["round_trips_per_s"]:
        return "n/a"
    return f"{gso['round_trips_per_s'] / per_datagram['round_trips_per_s']:.1f}x per datagram"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement")
    parser.add_argument("--window", type=int, default=64, help="packets in flight")
    args = parser.parse_args(argv)
    build_probe()
    size, window, seconds = wire.NETAGG_BYTES, args.window, args.seconds
    for title, measure in ((f"UDP loopback, {size}-byte datagrams, window {window}", udp_round_trips),
                           (f"UDP across a veth pair between namespaces, {size}-byte datagrams, window {window}",
                            veth_udp_round_trips)):
        per_datagram = measure(size, window, seconds, gso=False)
        gso = measure(size, window, seconds, gso=True)
        print(f"{title}:")
        print(f"  per datagram (sendmmsg/recvmmsg): {describe(per_datagram, 'datagrams')}")
        print(f"  UDP_SEGMENT + UDP_GRO:            {describe(gso, 'datagrams')}; {ratio(gso, per_datagram)}")
    raw = raw_round_trips(wire.FRAME_BYTES, window, seconds)
    print(f"AF_PACKET on a veth pair, {wire.FRAME_BYTES}-byte frames, window {window} (per frame, no GSO mode): "
          f"{describe(raw, 'frames')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
