"""Raw ports through packet rings (softswitch/packet_ring.py): frames over veth pairs into the rings and out
of them, and the software target aggregating with its raw ports on rings. Behaviour, never speed."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import numpy as np
import pytest

from netagg import dataplane as dp
from netagg.bmv2.netns import VethRig, can_create_namespaces, in_namespace, ns_exec
from netagg.bmv2.targets import start_target
from netagg.softswitch import packet_ring
from netagg.softswitch.batch_switch import enable_batching
from netagg.softswitch.ports import RawSocketPort

pytestmark = [pytest.mark.netns, pytest.mark.timeout(180)]

ETH_P_ALL = 0x0003
#: Ethernet header of the test frames (an unused EtherType: no stack on the veth answers them).
HEADER = bytes.fromhex("020000000001" "020000000002" "88b5")


@pytest.fixture(autouse=True)
def _need_namespaces() -> None:
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"packet rings on veth pairs: {why}")
    if (why := packet_ring.unavailable()) is not None:
        pytest.skip(f"packet rings: {why}")


def _frame(k: int, length: int) -> bytes:
    """Test frame ``k``: its number in the first bytes after the header, then a pattern of ``length``."""
    body = k.to_bytes(4, "big") + bytes((k * 7 + j) & 0xFF for j in range(length - len(HEADER) - 4))
    return HEADER + body


def _lengths(count: int) -> list[int]:
    """Frame lengths: small, netagg-sized, around a V2 slot's room (2 KiB less its header) and jumbo."""
    cycle = [60, 318, 1514, 1970, 1982, 1983, 2100, 97, 4000, 9014, 318, 318]
    return [cycle[k % len(cycle)] for k in range(count)]


class Rig:
    """Ports 1..n: ring-side sockets (the switch's ``s`` ends) and the test ends' sockets."""

    def __init__(self, rig: VethRig, ignore_outgoing: bool = True) -> None:
        with in_namespace(rig.namespace):
            self.ports = [RawSocketPort(n, ifname) for n, ifname in sorted(rig.switch_interfaces().items())]
            self.peers = []
            for _, ifname in sorted(rig.test_interfaces().items()):
                peer = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
                peer.bind((ifname, 0))
                peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
                peer.setblocking(False)
                self.peers.append(peer)
        if ignore_outgoing:
            assert enable_batching(self.ports) is None  # as the switch does: PACKET_IGNORE_OUTGOING

    def close(self) -> None:
        for sock in [*self.peers, *(port.sock for port in self.ports)]:
            sock.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    with VethRig(f"tr{os.getpid() % 100000}", 2) as veths:
        built = Rig(veths)
        yield built
        built.close()


def _drain(rings: packet_ring.PacketRings, want: int, timeout: float = 10.0) -> list[tuple[int, bytes]]:
    """(port, frame) of everything the rings hand on until ``want`` frames came (poll, as the switch does)."""
    poller = select.poll()
    for sock in rings.sockets:
        poller.register(sock.fileno(), select.POLLIN)
    got: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        poller.poll(20)
        n = rings.receive()
        got += [(int(rings.ports[i]), rings.buf[i, :rings.lengths[i]].tobytes()) for i in range(n)]
    return got


@contextlib.contextmanager
def _one_cpu() -> Iterator[None]:
    """This thread on one CPU: frames it sends pass one CPU's backlog, so the kernel receives them in the
    order they were sent, across ports too."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)


@pytest.mark.parametrize("version", [2, 3])
def test_frames_arrive_in_order_byte_exact(rig: Rig, version: int) -> None:
    rings = packet_ring.PacketRings([p.sock for p in rig.ports], [p.number for p in rig.ports],
                                    [p.ifname for p in rig.ports], version=version)
    try:
        # Far more frames than one V3 block (16 KiB on the rig's 9000-byte MTU) or one burst of V2 slots,
        # in bursts alternating between the ports, read while they keep coming; V2's longer frames take
        # the copy path. V2 (the default) hands them on in the order the kernel received them, across
        # ports. V3 (kept for measurements) keeps each port's order only: a frame in one port's open block
        # cannot be ordered before a later one in another port's retired block (packet_ring's docstring),
        # which a loaded machine's late block retirement shows.
        lengths = _lengths(1200)
        sent: list[tuple[int, bytes]] = []
        got: list[tuple[int, bytes]] = []
        with _one_cpu():
            for start in range(0, len(lengths), 300):
                for k in range(start, start + 300):
                    port = 1 + (k // 3) % 2
                    frame = _frame(k, lengths[k])
                    rig.peers[port - 1].send(frame)
                    sent.append((port, frame))
                got += _drain(rings, 100, timeout=0.5)
        got += _drain(rings, len(sent) - len(got))
        assert len(got) == len(sent), (len(got), len(sent), rings.counts, rings.kernel_drops())
        for port in (1, 2):
            mine = [frame for p, frame in sent if p == port]
            theirs = [frame for p, frame in got if p == port]
            assert [len(f) for f in theirs] == [len(f) for f in mine]
            assert theirs == mine, f"port {port}: frames differ or out of order"
        if version == 2:
            assert [p for p, _ in got] == [p for p, _ in sent], "not in arrival order across ports"
        assert rings.counts.tolist() == [0, 0]
        assert rings.kernel_drops() == 0
        assert _drain(rings, 1, timeout=0.05) == []
    finally:
        rings.close()


def test_frames_a_full_ring_had_no_room_for_are_counted_for_their_port(rig: Rig) -> None:
    rings = packet_ring.PacketRings([p.sock for p in rig.ports], [p.number for p in rig.ports],
                                    [p.ifname for p in rig.ports], version=2)
    try:
        slots = packet_ring.V2_RX_SLOTS
        with _one_cpu():
            for k in range(slots + 500):  # nobody reads port 2's ring meanwhile: the last ones find it full
                rig.peers[1].send(_frame(k, 318))
            rig.peers[0].send(_frame(0, 318))
        time.sleep(0.2)
        drops = rings.kernel_drops_by_port()
        assert drops[1] == 0 and drops[2] >= 500 - 50, drops  # (a few may still sit in the backlog)
        assert rings.kernel_drops_by_port() == drops  # totals: reading does not lose what was read before
        got = _drain(rings, slots + 1, timeout=2.0)
        assert sum(1 for port, _ in got if port == 2) + drops[2] == slots + 500
    finally:
        rings.close()


def test_the_switch_logs_each_ports_losses_since_its_last_report(caplog: pytest.LogCaptureFixture) -> None:
    from netagg.softswitch.cli import _report_losses

    with caplog.at_level(logging.WARNING):
        first = _report_losses({1: (0, 0), 2: (5, 1)}, {})
        assert first == {1: (0, 0), 2: (5, 1)}
        assert "port 2: 5 not sent, 1 not received (total 5, 1)" in caplog.text and "port 1" not in caplog.text
        caplog.clear()
        _report_losses({1: (0, 0), 2: (5, 1)}, first)  # nothing new: nothing logged
        assert caplog.text == ""
        _report_losses({1: (3, 0), 2: (5, 1)}, first)
        assert "port 1: 3 not sent, 0 not received (total 3, 0)" in caplog.text and "port 2" not in caplog.text


def test_a_block_that_does_not_fill_is_handed_over_after_its_timeout(rig: Rig) -> None:
    rings = packet_ring.PacketRings([rig.ports[0].sock], [1], [rig.ports[0].ifname], version=3)
    try:
        rig.peers[0].send(_frame(1, 318))
        assert _drain(rings, 1, timeout=5.0) == [(1, _frame(1, 318))]
    finally:
        rings.close()


@pytest.mark.parametrize("version", [2, 3])
def test_frames_the_port_sent_itself_are_skipped(version: int) -> None:
    with VethRig(f"to{os.getpid() % 100000}", 1) as veths:
        test_rig = Rig(veths, ignore_outgoing=False)  # as on a kernel without PACKET_IGNORE_OUTGOING
        port = test_rig.ports[0]
        rings = packet_ring.PacketRings([port.sock], [1], [port.ifname], version=version)
        with in_namespace(veths.namespace):
            other = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        other.bind((port.ifname, 0))
        try:
            other.send(_frame(5, 100))  # another sender on the port's interface: the ring sees PACKET_OUTGOING
            test_rig.peers[0].send(_frame(6, 200))
            deadline = time.monotonic() + 5
            got: list[tuple[int, bytes]] = []
            while (len(got) < 1 or rings.counts[0] < 1) and time.monotonic() < deadline:
                got += _drain(rings, 1, timeout=0.05)
            assert got == [(1, _frame(6, 200))]
            assert rings.counts.tolist() == [1, 0]
        finally:
            rings.close()
            other.close()
            test_rig.close()


@pytest.mark.parametrize("version", [2, 3])
def test_transmit_ring_sends_frames_in_order_byte_exact(rig: Rig, version: int) -> None:
    rings = packet_ring.PacketRings([p.sock for p in rig.ports], [p.number for p in rig.ports],
                                    [p.ifname for p in rig.ports], version=version, tx=True)
    try:
        lengths = _lengths(200)
        out = np.zeros((len(lengths), 9216), np.uint8)
        out_len = np.array(lengths, np.int64)
        out_port = np.array([1 + k % 2 if k % 17 else 9 for k in range(len(lengths))], np.int64)  # 9: no port
        for k, length in enumerate(lengths):
            out[k, :length] = np.frombuffer(_frame(k, length), np.uint8)
        port_slot = np.full(10, -1, np.int64)
        port_slot[1], port_slot[2] = 0, 1
        sent, failed, unknown = rings.transmit(out, out_len, out_port, len(lengths), port_slot)
        assert (sent, failed, unknown) == (len(lengths) - unknown, 0, (out_port == 9).sum())
        for peer_index, port in enumerate((1, 2)):
            want = [_frame(k, lengths[k]) for k in range(len(lengths)) if out_port[k] == port]
            got: list[bytes] = []
            deadline = time.monotonic() + 5
            while len(got) < len(want) and time.monotonic() < deadline:
                try:
                    got.append(rig.peers[peer_index].recv(65535))
                except BlockingIOError:
                    time.sleep(0.01)
            assert got == want
    finally:
        rings.close()


@pytest.mark.parametrize("mode", ["ring", "ring-v3+tx"])
def test_a_refused_ring_falls_back_to_mmsg_and_says_why(rig: Rig, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    class Refusing:  # a port whose socket is not a packet socket: the kernel refuses it a ring
        number, ifname = 9, rig.ports[0].ifname
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    try:
        with caplog.at_level(logging.WARNING, logger=packet_ring.__name__):
            assert packet_ring.open_rings([rig.ports[0], Refusing], mode) is None  # port 1 got its ring first
        assert "no packet ring" in caplog.text and "recvmmsg" in caplog.text
        rig.peers[0].send(_frame(1, 318))  # port 1's socket is ringless again: recv reads the frame
        poller = select.poll()
        poller.register(rig.ports[0].fileno(), select.POLLIN)
        assert poller.poll(5000)
        assert rig.ports[0].receive() == [_frame(1, 318)]
    finally:
        Refusing.sock.close()


def test_raw_io_modes() -> None:
    assert packet_ring.open_rings([], "ring") is None
    assert packet_ring.raw_io_mode("MMSG") == "mmsg"
    with pytest.raises(ValueError, match="raw port I/O"):
        packet_ring.raw_io_mode("rings")


DRIVE = textwrap.dedent("""
    import json, select, socket, struct, sys, time
    import numpy as np
    from benchmarks import switch_throughput as st
    from netagg import wire
    from netagg.bmv2.netns import VethRig
    from netagg.controller.store import WorkerEndpoint

    prefix, slots, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    W = st.WORKERS
    hosts = [{"name": f"w{r}", "ip": st._worker_ip(r), "mac": st._worker_mac(r), "port": r + 1} for r in range(W)]
    workers = [WorkerEndpoint(r, f"w{r}", st._worker_ip(r), 40000 + r) for r in range(W)]
    client, job = st._install_job(st.GRPC, b"", hosts, workers, wire.NETAGG_UDP_PORT, slots=slots)
    mac = lambda text: bytes.fromhex(text.replace(":", ""))

    def frame(rank, slot, rnd):
        values = (np.arange(wire.K, dtype=np.int64) * (rank + 1) + slot * 1000 + rnd * 7 - 50).astype(np.int32)
        payload = wire.pack(wire.Header(job_id=job, slot=slot, pool=(rnd - 1) & 1, rank=rank, seq=rnd * 1000 + slot,
                                        round=rnd), values)
        udp = struct.pack("!HHHH", 40000 + rank, wire.NETAGG_UDP_PORT, 8 + len(payload), 0)
        ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + len(payload), 0, 0x4000, 64, 17, 0,
                                   socket.inet_aton(st._worker_ip(rank)), socket.inet_aton(st.AGGREGATOR_IP)))
        ip[10:12] = wire.ipv4_checksum(bytes(ip)).to_bytes(2, "big")
        return mac(st.SWITCH_MAC) + mac(st._worker_mac(rank)) + b"\\x08\\x00" + bytes(ip) + udp + payload

    socks = []
    for r, ifname in sorted(VethRig(prefix, W).test_interfaces().items()):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
        s.bind((ifname, 0)); s.setblocking(False); s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        socks.append(s)
    poller = select.poll()
    for s in socks:
        poller.register(s.fileno(), select.POLLIN)
    bad, resent = [], 0
    for rnd in range(1, rounds + 1):
        want = {(r, slot) for r in range(W) for slot in range(slots)}
        expect = {slot: sum((np.arange(wire.K, dtype=np.int64) * (r + 1) + slot * 1000 + rnd * 7 - 50)
                            for r in range(W)) for slot in range(slots)}
        for slot in range(slots):
            for r in range(W):
                socks[r].send(frame(r, slot, rnd))
        last = time.monotonic(); tries = 0
        while want and tries < 5:
            if time.monotonic() - last > 1.0:  # a lost frame: resend this round's contributions still waiting
                tries += 1; last = time.monotonic()
                for slot in {slot for _, slot in want}:
                    for r in range(W):
                        socks[r].send(frame(r, slot, rnd)); resent += 1
            poller.poll(50)
            for r, s in enumerate(socks):
                while True:
                    try:
                        data, address = s.recvfrom(65535)
                    except BlockingIOError:
                        break
                    if address[2] == 4 or len(data) < 42 or struct.unpack_from("!H", data, 36)[0] != 40000 + r:
                        continue  # this worker's own sends, or not a result for it
                    header, values = wire.unpack(data[42:])
                    if header.round != rnd or (r, header.slot) not in want:
                        continue  # a duplicate result after a resend
                    if not header.is_result or not np.array_equal(values, expect[header.slot]):
                        bad.append([r, header.slot, rnd, header.flags])
                    want.discard((r, header.slot))
        if want:
            bad.append(["missing", rnd, sorted(want)[:8]])
            break
    client.close()
    print(json.dumps({"bad": bad[:20], "resent": resent}))
""")


@pytest.mark.parametrize("mode", ["ring", "ring-v3", "ring+tx"])
def test_switch_aggregates_with_ring_ports(mode: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import switch_throughput as st

    monkeypatch.setenv("NETAGG_RAW_IO", mode)
    prefix = f"ta{os.getpid() % 10000}"
    with VethRig(prefix, st.WORKERS) as veths:
        log = tmp_path / "switch.log"
        switch = start_target("soft", veths.switch_interfaces(), log, grpc_address=st.GRPC, namespace=veths.namespace)
        try:
            out = subprocess.run(ns_exec(veths.namespace, [sys.executable, "-c", DRIVE, prefix, "32", "12"]),
                                 cwd=dp.REPO_ROOT, capture_output=True, text=True, timeout=120)
        finally:
            switch.stop()
        text = log.read_text()
        assert out.returncode == 0, out.stderr[-4000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["bad"] == [], result
        version = "V3" if mode.startswith("ring-v3") else "V2"
        assert f"TPACKET_{version} receive ring" in text, text[-3000:]
        assert ("transmit ring" in text) == mode.endswith("+tx"), text[-3000:]
        assert "no packet ring" not in text and "Traceback" not in text, text[-3000:]
