"""Aggregated contributions per second of each switch target, against the kernel's ceilings, in one run.

``make bench-switch`` (root): one 4-worker job with 32 slots, driven by the native
``netagg-drive`` (``benchmarks/native/limit_probe.c``): every worker keeps one contribution
per slot in flight and sends the slot's next one when its result comes back (SwitchML
rounds, retransmission after 20 ms). Targets: the software target in its loopback UDP mode
(the embedded default), and on 4 veth pairs in a private namespace with raw frames the
software target and BMv2 (when ``simple_switch_grpc`` is installed).

The same run measures the ceilings: the probe's round trips/s through a native reflector
with the same number of packets in flight, one datagram per message (UDP loopback for the
loopback figures, AF_PACKET on veth for the veth figures) and with UDP GSO/GRO (loopback,
and UDP across a veth pair between namespaces), and netagg-drive against a zero-cost
aggregator (the ``--netagg`` reflector), per datagram and with ``--gso``, to show the driver
is not the bottleneck. The software target's loopback port is driven both ways: per
datagram (what a host without GSO sends) and with GSO/GRO (what netagg's host stack sends).
Each row is a ratio to both ceilings of its own run and prints the driver's CPU share.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.limit_probe import (
    build_probe,
    drive_switch_raw,
    drive_switch_udp,
    netagg_reflector,
    raw_round_trips,
    udp_round_trips,
    veth_udp_round_trips,
)
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
from netagg.softswitch.shards import default_shards

WORKERS = 4
SLOTS = 32
#: Slots of the shard scan's job: 6 steering blocks, an even share for 1, 2, 3 and 6 shards.
SCAN_SLOTS = 6 * wire.SEGMENT_BLOCK_SLOTS
#: Contributions in flight in the workload; the probes run with the same window.
WINDOW = WORKERS * SLOTS
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


def measure_loopback(seconds: float, rounds: int | None, log_dir: Path, gso: bool = False, shards: int = 1,
                     slots: int = SLOTS) -> dict:
    """The embedded default: the software target process in loopback UDP mode, workers on UDP sockets
    (``gso``: the workers send with UDP_SEGMENT and receive with UDP_GRO, as the host stack does), the switch
    in ``shards`` pipeline shards."""
    ports = free_ports(WORKERS + 1)
    switch = start_target("soft", {}, log_dir / "bench-loopback.log", loopback=f"127.0.0.1:{ports[-1]}",
                          shards=shards)
    try:
        hosts = [{"name": "local", "ip": "127.0.0.1", "mac": "02:00:00:00:bb:01", "port": 1}]
        workers = [WorkerEndpoint(r, "local", "127.0.0.1", ports[r]) for r in range(WORKERS)]
        client, job_id = _install_job(switch.grpc_address, b"", hosts, workers, ports[-1], slots)
        try:
            return drive_switch_udp(("127.0.0.1", ports[-1]), ports[:WORKERS], job_id=job_id, slots=slots,
                                    seconds=seconds, rounds=rounds, gso=gso)
        finally:
            client.close()
    finally:
        switch.stop()


def measure_driver_ceiling(seconds: float, gso: bool = False) -> dict:
    """netagg-drive against the zero-cost aggregator: same workers, slots and per-contribution work."""
    with netagg_reflector(gro=gso) as address:
        return drive_switch_udp(address, free_ports(WORKERS), slots=SLOTS, seconds=seconds, gso=gso)


def inner(target: str, seconds: float, rounds: int | None, prefix: str, slots: int = SLOTS) -> None:
    """Runs inside the rig's namespace: program the switch, drive it, print JSON."""
    rig = VethRig(prefix, WORKERS)
    device_config = b""
    if target == "bmv2":
        device_config = (dp.BUILD_DIR / "bench" / "netagg.json").read_bytes()
    hosts = [{"name": f"w{r}", "ip": _worker_ip(r), "mac": _worker_mac(r), "port": r + 1} for r in range(WORKERS)]
    workers = [WorkerEndpoint(r, f"w{r}", _worker_ip(r), 40000 + r) for r in range(WORKERS)]
    client, job_id = _install_job(GRPC, device_config, hosts, workers, wire.NETAGG_UDP_PORT, slots)
    try:
        interfaces = rig.test_interfaces()
        result = drive_switch_raw([interfaces[r + 1] for r in range(WORKERS)], [_worker_ip(r) for r in range(WORKERS)],
                                  [_worker_mac(r) for r in range(WORKERS)], AGGREGATOR_IP, SWITCH_MAC,
                                  job_id=job_id, slots=slots, seconds=seconds, rounds=rounds, udp_src_base=40000)
    finally:
        client.close()
    print(json.dumps(result))


def measure_on_veth(target: str, seconds: float, rounds: int | None, log_dir: Path, shards: int | None = None,
                    slots: int = SLOTS) -> dict:
    prefix = f"nb{os.getpid() % 10000}"
    if target == "bmv2":
        compile_program(dp.BUILD_DIR / "bench")
    with VethRig(prefix, WORKERS) as rig:
        switch = start_target(target, rig.switch_interfaces(), log_dir / f"bench-{target}.log",
                              grpc_address=GRPC, namespace=rig.namespace, shards=shards if target == "soft" else None)
        try:
            cmd = ns_exec(rig.namespace, [sys.executable, "-m", "benchmarks.switch_throughput", "--inner", target,
                                          "--seconds", str(seconds), "--prefix", prefix, "--slots", str(slots)]
                          + (["--rounds", str(rounds)] if rounds else []))
            out = subprocess.run(cmd, cwd=dp.REPO_ROOT, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise RuntimeError(f"{target} run failed:\n{out.stderr[-3000:]}")
            return json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            switch.stop()


def _ratio(value: float, base: dict | str | None, key: str) -> str:
    return f"{value / base[key]:.3f}x" if isinstance(base, dict) and base.get(key) else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, help="instead of --seconds: uses of every slot per target")
    parser.add_argument("--inner", choices=("soft", "bmv2"), help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--slots", type=int, default=SLOTS, help=argparse.SUPPRESS)
    parser.add_argument("--shards", default=f"1,{max(2, default_shards())}",
                        help="the shard scan: software target shard counts, comma-separated (default 1 and what "
                             "the machine can spare, at least 2); 0 skips the scan")
    args = parser.parse_args(argv)
    if args.inner:
        inner(args.inner, args.seconds, args.rounds, args.prefix, args.slots)
        return 0
    shard_counts = [int(n) for n in args.shards.split(",") if int(n) > 0]
    build_probe()
    log_dir = dp.BUILD_DIR / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    length = f"{args.rounds} rounds per slot" if args.rounds else f"{args.seconds:g} s per measurement"
    print(f"workload: 1 job, {WORKERS} workers, {SLOTS} slots ({WINDOW} contributions in flight), {length}, "
          f"K={wire.K} values/packet ({wire.NETAGG_BYTES}-byte datagrams, {wire.FRAME_BYTES}-byte frames); "
          "driver: native netagg-drive")
    udp_probe = udp_round_trips(wire.NETAGG_BYTES, WINDOW, args.seconds)
    gso_probe = udp_round_trips(wire.NETAGG_BYTES, WINDOW, args.seconds, gso=True)
    raw_probe = raw_round_trips(wire.FRAME_BYTES, WINDOW, args.seconds)
    veth_probe = veth_udp_round_trips(wire.NETAGG_BYTES, WINDOW, args.seconds)
    veth_gso_probe = veth_udp_round_trips(wire.NETAGG_BYTES, WINDOW, args.seconds, gso=True)
    driver = measure_driver_ceiling(args.seconds)
    driver_gso = measure_driver_ceiling(args.seconds, gso=True)
    rows: dict[str, dict | str] = {
        "soft, loopback UDP": measure_loopback(args.seconds, args.rounds, log_dir),
        "soft, loopback UDP GSO": measure_loopback(args.seconds, args.rounds, log_dir, gso=True),
    }
    ok, why = can_create_namespaces()
    for target in ("soft", "bmv2"):
        name = f"{target}, veth raw frames"
        if not ok:
            rows[name] = f"skipped: {why}"
        elif target == "bmv2" and (reason := bmv2_missing()):
            rows[name] = f"skipped: {reason}"
        else:
            rows[name] = measure_on_veth(target, args.seconds, args.rounds, log_dir)

    def rate(result: dict | str) -> str:
        return result if isinstance(result, str) else f"{result['round_trips_per_s']:>10,.0f} datagrams/s"

    print(f"\nceilings, same run ({WINDOW} packets in flight, native client and reflector, one direction's rate):")
    print(f"  udp probe      (loopback, one datagram per message)   {rate(udp_probe)}")
    print(f"  udp-gso probe  (loopback, UDP_SEGMENT + UDP_GRO)      {rate(gso_probe)}")
    print(f"  veth probe     (UDP across veth, per datagram)        {rate(veth_probe)}")
    print(f"  veth-gso probe (UDP across veth, UDP_SEGMENT + GRO)   {rate(veth_gso_probe)}")
    print(f"  raw probe      (AF_PACKET reflector on veth)          {rate(raw_probe)}")
    for name, result, probe in (("", driver, udp_probe), (" --gso", driver_gso, gso_probe)):
        print(f"  netagg-drive{name} vs zero-cost aggregator{'' if name else '      '} "
              f"{result['contributions_per_s']:>10,.0f} contributions/s = "
              f"{_ratio(result['contributions_per_s'], probe, 'round_trips_per_s')} of its probe, "
              f"driver CPU {result['cpu_share']:.0%}")
    base = rows.get("soft, veth raw frames")
    print(f"\n{'target':<24} {'contributions/s':>16} {'vs per-datagram':>16} {'vs GSO probe':>13} "
          f"{'vs soft (veth)':>15} {'retransmissions':>16} {'driver CPU':>11}")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"{name:<24} {row}")
            continue
        value = row["contributions_per_s"]
        if "loopback" in name:
            per_datagram, gso = f"{_ratio(value, udp_probe, 'round_trips_per_s')} udp", \
                f"{_ratio(value, gso_probe, 'round_trips_per_s')}"
        else:
            per_datagram, gso = f"{_ratio(value, raw_probe, 'round_trips_per_s')} raw", \
                f"{_ratio(value, veth_gso_probe, 'round_trips_per_s')}"
        print(f"{name:<24} {value:>16,.0f} {per_datagram:>16} {gso:>13} "
              f"{_ratio(value, base, 'contributions_per_s'):>15} {row['retransmissions']:>16,} "
              f"{row['cpu_share']:>11.0%}")
    if shard_counts:
        _shard_scan(shard_counts, args.seconds, args.rounds, log_dir, gso_probe, ok)
    return 0


def _shard_scan(counts: list[int], seconds: float, rounds: int | None, log_dir: Path, gso_probe: dict | str,
                namespaces: bool) -> None:
    """The software target with 1..N pipeline shards on a workload whose slots span SCAN_SLOTS // 64 steering
    blocks (so every shard has slots), loopback with GSO and veth raw frames: contributions/s against 1 shard
    and against linear scaling."""
    cpus = len(os.sched_getaffinity(0))
    print(f"\nshard scan: 1 job, {WORKERS} workers, {SCAN_SLOTS} slots ({SCAN_SLOTS // wire.SEGMENT_BLOCK_SLOTS} "
          f"steering blocks), {cpus} CPUs here, the driver on the same machine")
    print(f"{'target':<30} {'shards':>6} {'contributions/s':>16} {'vs 1 shard':>11} {'vs linear':>10} "
          f"{'vs GSO probe':>13} {'driver CPU':>11}")
    for name, measure in (
            ("soft, loopback UDP GSO", lambda n: measure_loopback(seconds, rounds, log_dir, gso=True, shards=n,
                                                                  slots=SCAN_SLOTS)),
            ("soft, veth raw frames", lambda n: measure_on_veth("soft", seconds, rounds, log_dir, shards=n,
                                                                slots=SCAN_SLOTS) if namespaces else None)):
        one = None
        for n in counts:
            row = measure(n)
            if row is None:
                print(f"{name:<30} skipped: no namespaces")
                break
            value = row["contributions_per_s"]
            one = one or (value if n == 1 else None)
            vs_one = f"{value / one:.2f}x" if one else "-"
            vs_linear = f"{value / (one * n):.2f}" if one else "-"
            print(f"{name:<30} {n:>6} {value:>16,.0f} {vs_one:>11} {vs_linear:>10} "
                  f"{_ratio(value, gso_probe, 'round_trips_per_s'):>13} {row['cpu_share']:>11.0%}")


if __name__ == "__main__":
    sys.exit(main())
