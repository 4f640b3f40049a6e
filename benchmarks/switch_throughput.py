"""Aggregated packets per second of each switch target on one workload, measured in one run.

``make bench-switch`` (root): for each target (the software target, and BMv2 when
``simple_switch_grpc`` is installed) it builds 4 veth pairs in a private namespace,
starts the target on them, installs one 4-worker job over P4Runtime, and drives it
from the other ends with raw frames: rounds of (slots x workers) contributions,
waiting for every multicast result before the next round. It prints contributions
aggregated per second per target and their ratio. The software target's loopback UDP
mode (the embedded default) is measured too, with the same rounds over UDP sockets.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from netagg import dataplane as dp
from netagg import wire
from netagg.bmv2.netns import VethRig, can_create_namespaces, ns_exec
from netagg.bmv2.p4build import compile_program
from netagg.bmv2.targets import bmv2_missing, start_target
from netagg.controller.config import parse_config
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.controller.store import JobRecord, WorkerEndpoint
from netagg.controller.switch_programmer import SwitchProgrammer
from netagg.localports import free_ports

WORKERS = 4
SLOTS = 32
GRPC = "127.0.0.1:9559"
SWITCH_MAC = "02:00:00:00:00:fe"
AGGREGATOR_IP = "10.88.0.254"


def _worker_ip(rank: int) -> str:
    return f"10.88.0.{rank + 1}"


def _worker_mac(rank: int) -> str:
    return f"02:00:00:88:00:{rank + 1:02x}"


def _install_job(grpc_address: str, device_config: bytes, hosts: list[dict], workers: list[WorkerEndpoint],
                 aggregator_port: int, slots: int = SLOTS) -> tuple[P4RuntimeClient, int]:
    client = P4RuntimeClient(grpc_address, device_id=1, election_id=(0, 1))
    client.connect()
    client.set_pipeline(dp.P4INFO_PATH, device_config)
    config = parse_config({
        "switch": {"grpc_address": grpc_address, "aggregator": {"ip": AGGREGATOR_IP, "udp_port": aggregator_port}},
        "controller": {"database": "unused.db", "api_socket": "unused.sock", "admin_token": "unused-token"},
        "hosts": hosts,
    }, "<bench>")
    job = JobRecord(job_id=1, tenant="bench", name="bench", mode="allreduce", state="active", slot_base=0,
                    slot_count=slots, slots_wanted=slots, generation=1, workers=workers, ps=None,
                    lease_seconds=3600, lease_expires=time.time() + 3600, created=time.time())
    SwitchProgrammer(client, config).install_job(job)
    return client, job.job_id


def _frame(rank: int, slot: int, pool: int) -> bytes:
    """A worker's contribution as raw Ethernet/IPv4/UDP bytes."""
    payload = wire.pack(wire.Header(job_id=1, slot=slot, pool=pool, rank=rank, seq=slot),
                        np.full(wire.K, rank + 1, np.int32))
    udp_len = wire.UDP_HEADER_BYTES + len(payload)
    ip = bytearray(b"\x45\x00" + (20 + udp_len).to_bytes(2, "big") + b"\x00\x00\x00\x00\x40\x11\x00\x00"
                   + socket.inet_aton(_worker_ip(rank)) + socket.inet_aton(AGGREGATOR_IP))
    ip[10:12] = wire.ipv4_checksum(bytes(ip)).to_bytes(2, "big")
    udp = (40000 + rank).to_bytes(2, "big") + wire.NETAGG_UDP_PORT.to_bytes(2, "big") + udp_len.to_bytes(2, "big")
    eth = bytes.fromhex(SWITCH_MAC.replace(":", "")) + bytes.fromhex(_worker_mac(rank).replace(":", "")) + b"\x08\x00"
    return eth + bytes(ip) + udp + b"\x00\x00" + payload


def _drive_raw(interfaces: dict[int, str], rounds: int) -> dict:
    """Send rounds of contributions on the test ends; wait for all results of a round."""
    socks = {}
    for port, ifname in interfaces.items():
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        s.bind((ifname, 0))
        s.settimeout(2.0)
        socks[port] = s
    frames = {pool: [[_frame(r, slot, pool) for r in range(WORKERS)] for slot in range(SLOTS)] for pool in (0, 1)}
    sent = received = 0
    start = time.perf_counter()
    for round_ in range(rounds):
        for per_worker in frames[round_ % 2]:
            for rank, frame in enumerate(per_worker):
                socks[rank + 1].send(frame)
                sent += 1
        for rank in range(WORKERS):
            got = 0
            while got < SLOTS:
                _, address = socks[rank + 1].recvfrom(4096)
                if address[2] == 4:  # our own outgoing frame
                    continue
                got += 1
            received += got
    elapsed = time.perf_counter() - start
    return {"contributions": sent, "results": received, "seconds": elapsed}


def measure_loopback(rounds: int, log_dir: Path) -> dict:
    """The embedded default: the software target process in loopback UDP mode, workers on UDP sockets."""
    ports = free_ports(WORKERS + 1)
    switch = start_target("soft", {}, log_dir / "bench-loopback.log", loopback=f"127.0.0.1:{ports[-1]}")
    try:
        hosts = [{"name": "local", "ip": "127.0.0.1", "mac": "02:00:00:00:bb:01", "port": 1}]
        workers = [WorkerEndpoint(r, "local", "127.0.0.1", ports[r]) for r in range(WORKERS)]
        client, job_id = _install_job(switch.grpc_address, b"", hosts, workers, ports[-1])
        try:
            return _drive_udp(job_id, ports[:WORKERS], ("127.0.0.1", ports[-1]), rounds)
        finally:
            client.close()
    finally:
        switch.stop()


def _drive_udp(job_id: int, bind_ports: list[int], target: tuple[str, int], rounds: int) -> dict:
    socks = []
    for port in bind_ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", port))
        s.settimeout(2.0)
        socks.append(s)
    payloads = {pool: [[wire.pack(wire.Header(job_id=job_id, slot=slot, pool=pool, rank=rank, seq=slot),
                                  np.full(wire.K, rank + 1, np.int32)) for rank in range(len(socks))]
                       for slot in range(SLOTS)]
                for pool in (0, 1)}
    sent = received = 0
    start = time.perf_counter()
    for round_ in range(rounds):
        for per_worker in payloads[round_ % 2]:
            for s, payload in zip(socks, per_worker):
                s.sendto(payload, target)
                sent += 1
        for s in socks:
            for _ in range(SLOTS):
                s.recv(4096)
                received += 1
    elapsed = time.perf_counter() - start
    return {"contributions": sent, "results": received, "seconds": elapsed}


def inner(target: str, rounds: int, prefix: str) -> None:
    """Runs inside the rig's namespace: program the switch, drive it, print JSON."""
    rig = VethRig(prefix, WORKERS)
    device_config = b""
    if target == "bmv2":
        device_config = (dp.BUILD_DIR / "bench" / "netagg.json").read_bytes()
    hosts = [{"name": f"w{r}", "ip": _worker_ip(r), "mac": _worker_mac(r), "port": r + 1} for r in range(WORKERS)]
    workers = [WorkerEndpoint(r, f"w{r}", _worker_ip(r), 40000 + r) for r in range(WORKERS)]
    client, _ = _install_job(GRPC, device_config, hosts, workers, wire.NETAGG_UDP_PORT)
    try:
        result = _drive_raw(rig.test_interfaces(), rounds)
    finally:
        client.close()
    print(json.dumps(result))


def measure_on_veth(target: str, rounds: int, log_dir: Path) -> dict:
    prefix = f"nb{os.getpid() % 10000}"
    if target == "bmv2":
        compile_program(dp.BUILD_DIR / "bench")
    with VethRig(prefix, WORKERS) as rig:
        switch = start_target(target, rig.switch_interfaces(), log_dir / f"bench-{target}.log",
                              grpc_address=GRPC, namespace=rig.namespace)
        try:
            cmd = ns_exec(rig.namespace, [sys.executable, "-m", "benchmarks.switch_throughput", "--inner", target,
                                          "--rounds", str(rounds), "--prefix", prefix])
            out = subprocess.run(cmd, cwd=dp.REPO_ROOT, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise RuntimeError(f"{target} run failed:\n{out.stderr[-3000:]}")
            return json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            switch.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60, help="rounds of slots x workers contributions")
    parser.add_argument("--inner", choices=("soft", "bmv2"), help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:
        inner(args.inner, args.rounds, args.prefix)
        return 0
    log_dir = dp.BUILD_DIR / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict | str] = {}
    print(f"workload: 1 job, {WORKERS} workers, {SLOTS} slots, {args.rounds} rounds, "
          f"K={wire.K} values/packet ({wire.FRAME_BYTES}-byte frames)")
    rows["soft, loopback UDP"] = measure_loopback(args.rounds, log_dir)
    ok, why = can_create_namespaces()
    for target in ("soft", "bmv2"):
        name = f"{target}, veth raw frames"
        if not ok:
            rows[name] = f"skipped: {why}"
        elif target == "bmv2" and (reason := bmv2_missing()):
            rows[name] = f"skipped: {reason}"
        else:
            rows[name] = measure_on_veth(target, args.rounds, log_dir)
    base = rows.get("soft, veth raw frames")
    print(f"{'target':<24} {'contributions/s':>16} {'results/s':>10} {'vs soft (veth)':>15}")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"{name:<24} {row}")
            continue
        rate = row["contributions"] / row["seconds"]
        ratio = rate / (base["contributions"] / base["seconds"]) if isinstance(base, dict) else float("nan")
        print(f"{name:<24} {rate:>16,.0f} {row['results'] / row['seconds']:>10,.0f} {ratio:>14.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
