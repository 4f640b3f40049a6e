"""The namespace topology: hosts behind a switch on veth links, real kernel UDP through either target."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from netagg import wire
from netagg.bmv2.netns import Topology, can_create_namespaces, list_namespaces, ns_exec
from netagg.bmv2.targets import bmv2_missing, start_target
from netagg.controller.config import parse_config
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.controller.store import JobRecord, WorkerEndpoint
from netagg.controller.switch_programmer import SwitchProgrammer

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

RECEIVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", 9000)); s.settimeout(10)
    data, addr = s.recvfrom(2048)
    print(data.decode(), addr[0])
""")

WORKER = textwrap.dedent("""
    import socket, sys
    import numpy as np
    from netagg import wire
    rank, job, agg = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", 41000 + rank)); s.settimeout(10)
    for attempt in range(50):
        s.sendto(wire.pack(wire.Header(job_id=job, slot=0, pool=0, rank=rank, seq=3),
                           np.full(wire.K, rank + 1, np.int32)), (agg, wire.NETAGG_UDP_PORT))
        try:
            header, values = wire.unpack(s.recv(4096))
            break
        except TimeoutError:
            continue
    print(header.flags, int(values[0]), int(values[-1]))
""")


def _skip_unless(target: str) -> None:
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"namespace topology: {why}")
    if target == "bmv2" and (reason := bmv2_missing()):
        pytest.skip(f"BMv2 target: {reason}")


@pytest.mark.parametrize("target", ["soft", pytest.param("bmv2", marks=pytest.mark.bmv2)])
def test_hosts_talk_and_aggregate_through_the_switch(target, tmp_path, request):
    _skip_unless(target)
    device_config = request.getfixturevalue("bmv2_json").read_bytes() if target == "bmv2" else b""
    prefix = f"tt{os.getpid() % 10000}"
    with Topology(prefix, num_hosts=3, mtu=1500) as topo:
        # A unix-socket P4Runtime address reaches into the switch's namespace.
        switch = start_target(target, topo.switch_interfaces(), tmp_path / "switch.log",
                              grpc_address=f"unix:{tmp_path}/p4runtime.sock", namespace=topo.switch_namespace)
        try:
            _program(switch.grpc_address, topo, device_config)
            # Plain IPv4 forwarding between two hosts, through the kernel stacks.
            receiver = subprocess.Popen(ns_exec(topo.hosts[1].namespace, [sys.executable, "-c", RECEIVER]),
                                        stdout=subprocess.PIPE, text=True)
            sender = textwrap.dedent(f"""
                import socket, time
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                for _ in range(20):
                    s.sendto(b"hello-through-the-switch", ("{topo.hosts[1].ip}", 9000)); time.sleep(0.1)
            """)
            subprocess.run(ns_exec(topo.hosts[0].namespace, [sys.executable, "-c", sender]), timeout=30, check=True)
            out, _ = receiver.communicate(timeout=15)
            assert out.split() == ["hello-through-the-switch", topo.hosts[0].ip]
            # In-network aggregation between hosts 0 and 2 (job 1 installed above).
            workers = [subprocess.Popen(ns_exec(topo.hosts[r].namespace, [
                sys.executable, "-c", WORKER, str(rank), "1", topo.aggregator_ip]), stdout=subprocess.PIPE, text=True)
                for rank, r in enumerate((0, 2))]
            results = [w.communicate(timeout=30)[0].split() for w in workers]
            assert results == [[str(wire.FLAG_RESULT), "3", "3"]] * 2
        finally:
            switch.stop()
    assert not [ns for ns in list_namespaces() if ns.startswith(prefix)]


def _program(grpc_address: str, topo: Topology, device_config: bytes) -> None:
    """Routes for every host plus one 2-worker job (hosts 0 and 2), as the controller computes them."""
    hosts = [{"name": h.name, "ip": h.ip, "mac": h.mac, "port": h.switch_port} for h in topo.hosts]
    config = parse_config({
        "switch": {"grpc_address": grpc_address, "aggregator": {"ip": topo.aggregator_ip}},
        "controller": {"database": "x.db", "api_socket": "x.sock", "admin_token": "unused-token"},
        "hosts": hosts}, "<test>")
    job = JobRecord(job_id=1, tenant="t", name="t", mode="allreduce", state="active", slot_base=0, slot_count=4,
                    slots_wanted=4, generation=1, ps=None, lease_seconds=60, lease_expires=0, created=0,
                    workers=[WorkerEndpoint(rank, topo.hosts[h].name, topo.hosts[h].ip, 41000 + rank)
                             for rank, h in enumerate((0, 2))])
    with P4RuntimeClient(grpc_address, device_id=1, election_id=(0, 1)) as client:
        client.connect()
        client.set_pipeline(config.p4info, device_config)
        SwitchProgrammer(client, config).reconcile([job])
        assert len(client.read_entries("NetaggIngress.ipv4_forward.routes")) == 3


CONGESTION_PROBE = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    s.connect_ex((sys.argv[1], 9))  # the congestion control is chosen at connect, before the SYN leaves
    print(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode())
""")


def test_the_hosts_tcp_congestion_control_is_the_topologys_not_the_machines():
    """The emulated hosts run the congestion control the cluster names (configs/cluster.yaml), whatever the
    machine's default is, and a change applies to the connections opened after it (the soak's A/B)."""
    _skip_unless("soft")
    prefix = f"tc{os.getpid() % 10000}"

    def probe(topo: Topology) -> str:
        out = subprocess.run(ns_exec(topo.hosts[0].namespace, [sys.executable, "-c", CONGESTION_PROBE,
                                                                topo.hosts[1].ip]),
                             capture_output=True, text=True, timeout=30, check=True)
        return out.stdout.strip()

    with Topology(prefix, num_hosts=2, tcp_congestion="cubic") as topo:
        assert probe(topo) == "cubic"
        topo.set_tcp_congestion("reno")
        assert probe(topo) == "reno"


def test_an_unknown_congestion_control_is_a_clear_error():
    _skip_unless("soft")
    from netagg.bmv2.netns import NetnsError

    with pytest.raises(NetnsError, match="not available"), \
            Topology(f"tu{os.getpid() % 10000}", num_hosts=1, tcp_congestion="no-such-cc"):
        pass
    assert not [ns for ns in list_namespaces() if ns.startswith(f"tu{os.getpid() % 10000}-")]


BULK_SENDER = textwrap.dedent("""
    import socket, sys, time
    end = time.time() + float(sys.argv[2])
    while time.time() < end:
        try:
            s = socket.create_connection((sys.argv[1], 5001), timeout=2)
            s.settimeout(1)
            while time.time() < end:
                try:
                    s.send(bytes(1 << 16))
                except TimeoutError:
                    pass
        except OSError:
            time.sleep(0.1)
""")
BULK_SINK = textwrap.dedent("""
    import socket
    server = socket.create_server(("0.0.0.0", 5001))
    while True:
        conn, _ = server.accept()
        while conn.recv(1 << 20):
            pass
""")


def test_a_link_slowed_down_under_load_keeps_moving():
    """A rate change of a shaped link (the dynamic cluster's) never strands the queue. TCP hands the qdisc
    segments of up to 64 kB (software GSO runs after it, whatever the device's offloads); a token bucket
    shallower than the queue's head packet could never send it, and the host went silent until its rate
    rose again (the soak's 'cannot connect to the parameter server' failures, docs/mlfabric.md)."""
    _skip_unless("soft")
    from netagg.bmv2.netns import LinkShape, shape_link

    prefix = f"ts{os.getpid() % 10000}"
    with Topology(prefix, num_hosts=2) as topo:
        a, b = topo.hosts
        # No switch here: join the two hosts' switch-side ends with a bridge in the switch namespace.
        sw = topo.switch_namespace
        subprocess.run(ns_exec(sw, ["ip", "link", "add", "br0", "type", "bridge"]), check=True)
        for host in topo.hosts:
            subprocess.run(ns_exec(sw, ["ip", "link", "set", host.switch_ifname, "master", "br0"]), check=True)
        subprocess.run(ns_exec(sw, ["ip", "link", "set", "br0", "up"]), check=True)
        for host in topo.hosts:  # the static entries point at the switch's MAC: learn the real ones
            other = b if host is a else a
            subprocess.run(ns_exec(host.namespace, ["ip", "neigh", "replace", other.ip, "lladdr", other.mac,
                                                    "dev", host.ifname]), check=True)
        sink = subprocess.Popen(ns_exec(b.namespace, [sys.executable, "-c", BULK_SINK]))
        sender = subprocess.Popen(ns_exec(a.namespace, [sys.executable, "-c", BULK_SENDER, b.ip, "40"]))
        rx = f"/sys/class/net/{b.ifname}/statistics/rx_packets"

        def received() -> int:
            return int(subprocess.run(ns_exec(b.namespace, ["cat", rx]), capture_output=True, text=True).stdout)

        try:
            for _ in range(3):
                shape_link(a.namespace, a.ifname, LinkShape(40.0, 0.0, 1000), topo.mtu)
                time.sleep(1.5)  # a full queue of large segments
                shape_link(a.namespace, a.ifname, LinkShape(2.5, 0.0, 1000), topo.mtu)
                last, since = received(), time.monotonic()
                stalled = 0.0
                end = time.monotonic() + 5
                while time.monotonic() < end:
                    time.sleep(0.1)
                    now = received()
                    if now != last:
                        last, since = now, time.monotonic()
                    stalled = max(stalled, time.monotonic() - since)
                queue = subprocess.run(ns_exec(a.namespace, ["tc", "-s", "qdisc", "show", "dev", a.ifname]),
                                       capture_output=True, text=True).stdout
                assert stalled < 2.0, f"the link sent nothing for {stalled:.1f} s after slowing down: {queue}"
        finally:
            sender.kill()
            sink.kill()
