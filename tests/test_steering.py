"""Steering by slot (netagg/steering.py): the kernel's BPF programs pick the rule's socket, on UDP
reuseport groups and on raw fanout groups, and segmented sends follow the rule."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time

import numpy as np
import pytest

from netagg import steering, udpgso, wire
from netagg.bmv2.netns import VethRig, can_create_namespaces, in_namespace

ETH_P_ALL = 0x0003
CASES = [(job, slot) for job in (1, 2, 7, 65535) for slot in (0, 1, 63, 64, 65, 130, 200, 1000, 65535)]


def _header(job: int, slot: int, flags: int = 0) -> bytes:
    return wire.HEADER_STRUCT.pack(wire.VERSION, flags, job, slot, 0, 0, 0, 0, 0, 0, 0, 0)


def _which(socks: list[socket.socket], timeout: float = 2.0) -> list[int]:
    """Indexes of the sockets that received something (each drained)."""
    select.select(socks, [], [], timeout)
    time.sleep(0.01)
    got = []
    for i, sock in enumerate(socks):
        while select.select([sock], [], [], 0)[0]:
            sock.recv(65536)
            if i not in got:
                got.append(i)
    return got


def test_shard_of_is_job_plus_block_modulo_shards():
    assert steering.shard_of(1, 0, 4) == 1
    assert steering.shard_of(1, 63, 4) == 1
    assert steering.shard_of(1, 64, 4) == 2
    assert steering.shard_of(3, 64 * 5 + 7, 4) == 0
    with pytest.raises(ValueError):
        steering.udp_program(0)
    with pytest.raises(ValueError):
        steering.frame_program(steering.MAX_SHARDS + 1)


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
def test_reuseport_group_delivers_each_datagram_to_its_slots_shard(shards):
    socks = steering.udp_group("127.0.0.1", 0, shards)
    port = socks[0].getsockname()[1]
    assert all(s.getsockname()[1] == port for s in socks)
    with contextlib.ExitStack() as stack, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        for sock in socks:
            stack.callback(sock.close)
        for job, slot in CASES:
            tx.sendto(_header(job, slot) + bytes(wire.PAYLOAD_BYTES), ("127.0.0.1", port))
            assert _which(socks) == [steering.shard_of(job, slot, shards)], (job, slot)
        tx.sendto(b"x", ("127.0.0.1", port))  # too short to read: shard 0
        assert _which(socks) == [0]


def test_a_group_of_one_is_a_plain_socket_no_one_else_can_join():
    (sock,) = steering.udp_group("127.0.0.1", 0, 1)
    with sock, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with pytest.raises(OSError):
            other.bind(sock.getsockname())


@pytest.mark.skipif(udpgso.gso_unavailable() is not None, reason=f"no UDP GSO here: {udpgso.gso_unavailable()}")
def test_a_segmented_send_is_steered_whole_by_its_first_datagram_so_plans_cut_at_blocks():
    """Why the rule exists: the kernel steers a GSO send once. A plan keyed by block sends each block's
    datagrams to its own shard."""
    shards = 2
    socks = steering.udp_group("127.0.0.1", 0, shards)
    port = socks[0].getsockname()[1]
    job, slots = 1, np.arange(32, 160)  # blocks 0, 1, 2: shards 1, 0, 1
    rows = np.zeros((slots.shape[0], wire.NETAGG_BYTES), np.uint8)
    for i, slot in enumerate(slots.tolist()):
        rows[i, :wire.HEADER_BYTES] = np.frombuffer(_header(job, slot), np.uint8)
    addresses = np.uint64(rows.ctypes.data) + np.arange(rows.shape[0], dtype=np.uint64) * np.uint64(rows.shape[1])
    gso = udpgso.GsoBatch(256)
    with contextlib.ExitStack() as stack, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        for sock in socks:
            stack.callback(sock.close)
        tx.connect(("127.0.0.1", port))
        # Unkeyed: one send of 64 starting in block 0 carries block 1's datagrams to block 0's shard.
        headers = gso.plan_uniform(addresses, wire.NETAGG_BYTES)
        assert gso.send(tx.fileno(), headers)[0] == slots.shape[0]
        misplaced = _misplaced(socks, job)
        assert misplaced == [s for s in range(64, 96)] + [s for s in range(128, 160)]
        # Keyed by block: every datagram reaches its slot's shard.
        headers = gso.plan_uniform(addresses, wire.NETAGG_BYTES, keys=slots >> wire.SEGMENT_BLOCK_SHIFT)
        assert headers == 3
        assert gso.send(tx.fileno(), headers)[0] == slots.shape[0]
        assert _misplaced(socks, job) == []


def _misplaced(socks: list[socket.socket], job: int) -> list[int]:
    """Slots of the datagrams that reached another socket than their slot's shard (all 128 must arrive)."""
    time.sleep(0.05)
    misplaced, seen = [], 0
    for i, sock in enumerate(socks):
        while select.select([sock], [], [], 0)[0]:
            slot = wire.HEADER_STRUCT.unpack_from(sock.recv(65536))[wire.FIELD_INDEX["slot"]]
            seen += 1
            if steering.shard_of(job, slot, len(socks)) != i:
                misplaced.append(slot)
    assert seen == 128
    return sorted(misplaced)


def _frame(job: int, slot: int, ihl: int = 5, dport: int = wire.NETAGG_UDP_PORT) -> bytes:
    eth = bytes.fromhex("020000000002" "020000000001") + wire.ETHERTYPE_IPV4.to_bytes(2, "big")
    payload = _header(job, slot) + bytes(wire.PAYLOAD_BYTES)
    udp = (40000).to_bytes(2, "big") + dport.to_bytes(2, "big") + (8 + len(payload)).to_bytes(2, "big") + bytes(2)
    ip = bytes([0x40 | ihl, 0]) + (4 * ihl + len(udp) + len(payload)).to_bytes(2, "big") + bytes(4) \
        + bytes([64, wire.IPPROTO_UDP]) + bytes(2) + bytes([10, 0, 0, 1, 10, 0, 0, 2]) + bytes(4 * (ihl - 5))
    return eth + ip + udp + payload


@pytest.mark.netns
def test_fanout_group_delivers_each_frame_to_its_slots_shard_and_hides_outgoing_frames():
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"fanout on a veth pair: {why}")
    shards = 3
    with VethRig(f"st{os.getpid() % 100000}", 1) as rig, in_namespace(rig.namespace):
        (switch_if,) = rig.switch_interfaces().values()
        (test_if,) = rig.test_interfaces().values()
        members = []
        group = None
        for _ in range(shards):
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            sock.bind((switch_if, 0))
            group, hides_outgoing = steering.join_fanout(sock, group, shards)
            members.append(sock)
        peer = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        peer.bind((test_if, 0))
        try:
            _which(members, 0.2)  # whatever the stack sent when the link came up
            for job, slot in CASES:
                peer.send(_frame(job, slot))
                assert _which(members) == [steering.shard_of(job, slot, shards)], (job, slot)
            peer.send(_frame(2, 64, ihl=6))  # IPv4 options: the program reads the header's length
            assert _which(members) == [steering.shard_of(2, 64, shards)]
            peer.send(_frame(2, 64, dport=53))  # not netagg: shard 0
            assert _which(members) == [0]
            peer.send(bytes(12) + b"\x08\x06" + bytes(46))  # ARP: shard 0
            assert _which(members) == [0]
            if hides_outgoing:
                members[1].send(_frame(1, 0))
                assert _which(members, 0.3) == []
                assert _which([peer]) == [0]
        finally:
            for sock in [*members, peer]:
                sock.close()
