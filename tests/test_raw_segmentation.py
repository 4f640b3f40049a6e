"""Segmentation-offload sends of raw ports (softswitch/raw_segmentation.py): which frames merge, what the merged
header says, and that a receiving host gets exactly the frames' datagrams, in order, whether the egress interface
cuts them (tx-udp-segmentation) or the kernel does, and whether the receiver coalesces (UDP_GRO) or not."""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import subprocess
from collections.abc import Iterator

import numpy as np
import pytest

from netagg import mmsg, wire
from netagg.bmv2.netns import can_create_namespaces, in_namespace, ns_exec
from netagg.softswitch import raw_segmentation as rs

SRC, DST = "10.79.0.1", "10.79.0.2"
DST_MAC = bytes.fromhex("020000000002")


def _checksum(data: bytes) -> int:
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def _frame(index: int, payload_bytes: int, job: int = 3, slot: int | None = None, dport: int = wire.NETAGG_UDP_PORT,
           dst: str = DST, options: bool = False, mac: bytes = DST_MAC, udp_checksum: int = 0) -> bytes:
    """An Ethernet/IPv4/UDP frame whose payload starts like a netagg header (job, slot) and carries ``index``."""
    slot = index if slot is None else slot
    payload = (struct.pack("!HHHH", 0x0300, job, slot, index) + bytes([index & 0xFF]) * (payload_bytes - 8))
    ihl = 6 if options else 5
    udp_len = 8 + payload_bytes
    ip = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, ihl * 4 + udp_len, index, 0x4000, 64, 17, 0,
                     socket.inet_aton(SRC), socket.inet_aton(dst)) + (b"\x01\x01\x01\x00" if options else b"")
    ip = ip[:10] + struct.pack("!H", ~_checksum(ip) & 0xFFFF) + ip[12:]
    udp = struct.pack("!HHHH", 4000, dport, udp_len, udp_checksum)
    return mac + bytes.fromhex("020000000001") + b"\x08\x00" + ip + udp + payload


class Emitted:
    """Frames as the switch's pipeline leaves them: rows of an output batch, their lengths and egress ports."""

    def __init__(self, frames: list[tuple[int, bytes]]) -> None:
        self.batch = mmsg.MsgBatch(max(8, len(frames)), 2048)
        self.lengths = np.zeros(self.batch.capacity, np.int64)
        self.ports = np.zeros(self.batch.capacity, np.int64)
        for i, (port, frame) in enumerate(frames):
            self.batch.buf[i, :len(frame)] = np.frombuffer(frame, np.uint8)
            self.lengths[i] = len(frame)
            self.ports[i] = port
        self.count = len(frames)

    def plan(self, sends: rs.SegmentedSends, port_slot: np.ndarray) -> tuple[int, int]:
        return sends.plan(self.batch.buf, self.lengths, self.ports, self.count, port_slot, self.batch.row_addr)

    def row(self, i: int) -> bytes:
        return self.batch.buf[i, :self.lengths[i]].tobytes()


def _messages(sends: rs.SegmentedSends, emitted: Emitted, count: int) -> list[list[int]]:
    """Per message, the rows its frame iovecs point into (the first frame's row, then the merged ones')."""
    stride, base = emitted.batch.stride, int(emitted.batch.row_addr[0])
    out = []
    for h in range(count):
        first = (int(sends.hdr_words[h, 2]) - int(sends.iov_addr)) // 16
        iovs = sends.iov_words[first + 1:first + int(sends.hdr_words[h, 3])]
        out.append([(int(addr) - base) // stride for addr, _ in iovs])
    return out


def test_runs_of_one_flow_merge_per_port_in_order_and_everything_else_leaves_alone() -> None:
    frames = [
        (1, _frame(0, 1048)), (2, _frame(1, 1048)), (1, _frame(2, 1048)), (1, _frame(3, 1048)),  # port 1: 0, 2, 3
        (1, _frame(4, 500)),                                   # another length: a run of its own
        (1, _frame(5, 1048)), (1, _frame(6, 1048, job=4)),     # another job: another steering block
        (1, _frame(7, 1048, slot=wire.SEGMENT_BLOCK_SLOTS)),   # same job, the next steering block
        (1, _frame(8, 1048, options=True)),                    # IPv4 options: never merged
        (1, _frame(9, 1048, dst="10.79.0.3")),                 # another destination
        (1, _frame(12, 1048, slot=12, udp_checksum=0x1234)),   # a UDP checksum (a forwarded frame): alone
        (1, _frame(13, 1048, slot=13, udp_checksum=0x1234)),
        (7, _frame(10, 1048)),                                 # a port the switch does not have
        (2, _frame(11, 1048)),
    ]
    emitted = Emitted(frames)
    before = [emitted.row(i) for i in range(emitted.count)]
    sends = rs.SegmentedSends(64, 2)
    port_slot = np.array([-1, 0, 1], np.int64)
    messages, unknown = emitted.plan(sends, port_slot)
    assert unknown == 1
    assert sends.group_counts.tolist() == [9, 1]
    assert _messages(sends, emitted, messages) == [[0, 2, 3], [4], [5], [6], [7], [8], [9], [10], [11], [1, 13]]
    # A merged run's first frame announces the run: lengths, a valid IPv4 checksum, the pseudo-header sum.
    for head, size, segment in ((0, 3, 1048), (1, 2, 1048)):
        row = emitted.row(head)
        assert struct.unpack("!H", row[16:18])[0] == 20 + 8 + size * segment
        assert struct.unpack("!H", row[38:40])[0] == 8 + size * segment
        assert _checksum(row[14:34]) == 0xFFFF
        pseudo = _checksum(row[26:34] + struct.pack("!HH", 17, 8 + size * segment))
        assert struct.unpack("!H", row[40:42])[0] == pseudo
        assert row[42:] == before[head][42:]
    vnet = {h: sends.vnet[h, :rs.VNET_BYTES].tobytes() for h in range(messages)}
    assert vnet[0] == struct.pack("<BBHHHH", rs.VIRTIO_NET_HDR_F_NEEDS_CSUM, rs.VIRTIO_NET_HDR_GSO_UDP_L4, 42, 1048,
                                  34, 6)
    for h, rows in enumerate(_messages(sends, emitted, messages)):
        if len(rows) == 1:  # alone: an empty virtio-net header and the frame exactly as emitted
            assert vnet[h] == bytes(rs.VNET_BYTES)
            assert emitted.row(rows[0]) == before[rows[0]]


def test_a_run_stops_at_the_segment_limits() -> None:
    emitted = Emitted([(1, _frame(i, 1048, slot=0)) for i in range(70)])
    sends = rs.SegmentedSends(128, 1)
    messages, _ = emitted.plan(sends, np.array([-1, 0], np.int64))
    sizes = [len(rows) for rows in _messages(sends, emitted, messages)]
    per = min(rs.MAX_SEGMENTS, rs.MAX_SEND_BYTES // 1048)
    assert sizes == [per, 70 - per]


@pytest.fixture
def link() -> Iterator[tuple[str, str]]:
    """Namespaces ``a`` (the switch's side) and ``b`` (a host at DST) joined by a veth pair, offloads off as the
    emulated cluster has them; yields their names."""
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"segmentation sends over a veth pair: {why}")
    tag = f"rs{os.getpid() % 100000}"
    a, b = f"{tag}-a", f"{tag}-b"
    run = lambda cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
    for ns in (a, b):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        run(["ip", "netns", "add", ns])
    try:
        run(["ip", "link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y"])
        run(["ip", "link", "set", f"{tag}x", "netns", a])
        run(["ip", "link", "set", f"{tag}y", "netns", b])
        for ns, ifname in ((a, f"{tag}x"), (b, f"{tag}y")):
            subprocess.run(ns_exec(ns, ["ethtool", "-K", ifname, "tx", "off", "rx", "off", "tso", "off", "gso",
                                        "off"]), capture_output=True)
            run(ns_exec(ns, ["ip", "link", "set", ifname, "up"]))
        run(ns_exec(b, ["ip", "addr", "add", f"{DST}/24", "dev", f"{tag}y"]))
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.netns
@pytest.mark.parametrize("device_segments", [True, False], ids=["device-cuts", "kernel-cuts"])
@pytest.mark.parametrize("gro", [True, False], ids=["gro", "no-gro"])
def test_the_host_receives_exactly_the_frames_datagrams_in_order(link: tuple[str, str], device_segments: bool,
                                                                 gro: bool) -> None:
    a, b = link
    ifname = f"{a.split('-')[0]}x"
    if device_segments:
        subprocess.run(ns_exec(a, ["ethtool", "-K", ifname, "tx", "on", "gso", "on", "tx-udp-segmentation", "on"]),
                       check=True, capture_output=True)
    mac = subprocess.run(ns_exec(b, ["cat", f"/sys/class/net/{a.split('-')[0]}y/address"]), check=True,
                         capture_output=True, text=True).stdout.strip()
    with in_namespace(b):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rx.bind((DST, wire.NETAGG_UDP_PORT))
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        rx.settimeout(2.0)
        if gro:
            rx.setsockopt(17, 104, 1)  # UDP_GRO
    with in_namespace(a):
        tx = rs.open_tx_socket(ifname)
    try:
        sizes = [1048] * 40 + [100] + [1048] * 90 + [324] * 5
        frames = [_frame(i, n, slot=i % 8, mac=bytes.fromhex(mac.replace(":", ""))) for i, n in enumerate(sizes)]
        emitted = Emitted([(1, f) for f in frames])
        sends = rs.SegmentedSends(256, 1)
        messages, _ = emitted.plan(sends, np.array([-1, 0], np.int64))
        assert messages < len(frames) // 10
        assert sends.send(tx.fileno(), messages) == (len(frames), 0)
        got: list[bytes] = []
        while len(got) < len(frames):
            data, ancillary, _, _ = rx.recvmsg(1 << 16, 64)
            segment = next((int.from_bytes(d[:2], "little") for level, kind, d in ancillary if kind == 104), 0)
            got += [data[k:k + segment] for k in range(0, len(data), segment)] if segment else [data]
        assert got == [f[42:] for f in frames]
    finally:
        rx.close()
        tx.close()


@pytest.mark.netns
def test_a_kernel_that_refuses_merged_sends_gets_the_frames_one_by_one(link: tuple[str, str], monkeypatch) -> None:
    """Where the kernel refuses a merged send as such (EINVAL: no UDP segmentation for packet sockets), the
    frames of that send still leave, one by one, with the first frame's header as a lone datagram's, and the
    batch says so (``refused``: the switch then stops merging)."""
    a, b = link
    ifname = f"{a.split('-')[0]}x"
    mac = subprocess.run(ns_exec(b, ["cat", f"/sys/class/net/{a.split('-')[0]}y/address"]), check=True,
                         capture_output=True, text=True).stdout.strip()
    real = mmsg._sendmmsg

    def refuse_merged(fd, address, count, flags):
        header = np.frombuffer(ctypes.string_at(address, mmsg.MMSGHDR_DTYPE.itemsize), "<u8")
        if header[3] > 2:  # iovecs: the virtio-net header and more than one frame
            ctypes.set_errno(errno.EINVAL)
            return -1
        return real(fd, address, 1, flags)

    monkeypatch.setattr(mmsg, "_sendmmsg", refuse_merged)
    with in_namespace(b):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rx.bind((DST, wire.NETAGG_UDP_PORT))
        rx.settimeout(2.0)
    with in_namespace(a):
        tx = rs.open_tx_socket(ifname)
    try:
        frames = [_frame(i, 1048, slot=i % 8, mac=bytes.fromhex(mac.replace(":", ""))) for i in range(12)]
        emitted = Emitted([(1, f) for f in frames])
        sends = rs.SegmentedSends(64, 1)
        messages, _ = emitted.plan(sends, np.array([-1, 0], np.int64))
        assert messages == 1
        assert sends.send(tx.fileno(), messages) == (len(frames), 0)
        assert sends.refused is not None and "refused" in sends.refused
        got = [rx.recv(1 << 16) for _ in frames]
        assert got == [f[42:] for f in frames]
    finally:
        rx.close()
        tx.close()
