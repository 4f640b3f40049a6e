"""Steering datagrams to cores by their slot: one rule for the switch's shards and a host's threads.

A software switch with N pipeline shards (or a worker with T sender/receiver threads) opens
N sockets on one address and lets the kernel pick the socket of each arriving packet by a
classic BPF program that reads the netagg header (``docs/protocol.md``, "Steering"):

    shard = (job_id + (slot >> SEGMENT_BLOCK_SHIFT)) mod N

so every packet of one (job, block of 64 job-relative slots) reaches the same shard, and no
slot register is touched by two cores. On a UDP socket group the program is attached with
``SO_ATTACH_REUSEPORT_CBPF`` (it sees the UDP payload at offset 0); on raw ports with
``PACKET_FANOUT`` mode ``PACKET_FANOUT_CBPF`` (it sees the Ethernet frame). A segmented (GSO)
send is steered once, by its first datagram, which is why senders never put two blocks into
one segmented send (``wire.SEGMENT_BLOCK_SLOTS``). Packets the program cannot read (too short,
not IPv4/UDP) go to shard 0; the pipeline drops or forwards them as it would anyway.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import socket
import struct

from netagg import layout, wire

SO_ATTACH_REUSEPORT_CBPF = 51
SOL_PACKET = 263
PACKET_FANOUT = 18
PACKET_FANOUT_DATA = 22
PACKET_FANOUT_CBPF = 6
#: Linux 6.x: the fanout group's members do not see frames sent on the interface (as PACKET_IGNORE_OUTGOING).
PACKET_FANOUT_FLAG_IGNORE_OUTGOING = 0x4000
#: The first member's flag: the kernel picks a free group id.
PACKET_FANOUT_FLAG_UNIQUEID = 0x2000
#: Where job_id and slot sit in the netagg header (bytes from its start).
JOB_OFFSET = layout.JOB_AT
SLOT_OFFSET = layout.SLOT_AT
#: Most shards a group steers to (the BPF program computes any N; more than this is a configuration error).
MAX_SHARDS = 64

# Classic BPF opcodes (linux/filter.h) and the special offsets of its loads (as unsigned 32-bit k).
_LD_W_ABS, _LD_H_ABS, _LD_H_IND = 0x20, 0x28, 0x48
_ST, _LDX_MEM, _RET_A = 0x02, 0x61, 0x16
_ALU_RSH_K, _ALU_LSH_K, _ALU_AND_K, _ALU_ADD_X, _ALU_MOD_K = 0x74, 0x64, 0x54, 0x0C, 0x94
_SKF_AD_PROTOCOL = (-0x1000) & 0xFFFFFFFF  # SKF_AD_OFF + SKF_AD_PROTOCOL: the frame's EtherType
_SKF_NET_OFF = (-0x100000) & 0xFFFFFFFF
_MISC_TAX = 0x07
_JEQ_K, _JGE_K, _RET_K, _LD_B_ABS = 0x15, 0x35, 0x06, 0x30


def block_of(slot: int) -> int:
    """The slot's steering block (job-relative slots ``64b .. 64b+63``)."""
    return slot >> wire.SEGMENT_BLOCK_SHIFT


def shard_of(job_id: int, slot: int, shards: int) -> int:
    """The shard (or host thread) that owns ``slot`` of ``job_id`` among ``shards``."""
    return (job_id + block_of(slot)) % shards


def _check(shards: int) -> None:
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be 1..{MAX_SHARDS}, got {shards}")


def udp_program(shards: int) -> list[tuple[int, int, int, int]]:
    """The reuseport program: A = (job + (slot >> 6)) % shards, reading the UDP payload."""
    _check(shards)
    return [
        (_LD_H_ABS, 0, 0, JOB_OFFSET),
        (_MISC_TAX, 0, 0, 0),
        (_LD_H_ABS, 0, 0, SLOT_OFFSET),
        (_ALU_RSH_K, 0, 0, wire.SEGMENT_BLOCK_SHIFT),
        (_ALU_ADD_X, 0, 0, 0),
        (_ALU_MOD_K, 0, 0, shards),
        (_RET_A, 0, 0, 0),
    ]


def frame_program(shards: int) -> list[tuple[int, int, int, int]]:
    """The fanout program: the same rule on a received frame (IPv4 with or without options, UDP to netagg's
    port); anything else to shard 0. Loads are relative to the network header (``SKF_NET_OFF``): a fanout
    program runs where the kernel has already moved past the Ethernet header."""
    _check(shards)
    net = _SKF_NET_OFF
    netagg = net + wire.UDP_HEADER_BYTES  # plus X = the IPv4 header's length
    return [
        (_LD_W_ABS, 0, 0, _SKF_AD_PROTOCOL),  # A = the frame's EtherType
        (_JEQ_K, 0, 16, wire.ETHERTYPE_IPV4),
        (_LD_B_ABS, 0, 0, net + 9),  # A = IP protocol
        (_JEQ_K, 0, 14, wire.IPPROTO_UDP),
        (_LD_B_ABS, 0, 0, net),
        (_ALU_AND_K, 0, 0, 0x0F),
        (_ALU_LSH_K, 0, 0, 2),
        (_MISC_TAX, 0, 0, 0),  # X = the IPv4 header's length
        (_LD_H_IND, 0, 0, net + 2),  # A = UDP destination port
        (_JEQ_K, 0, 8, wire.NETAGG_UDP_PORT),
        (_LD_H_IND, 0, 0, netagg + JOB_OFFSET),
        (_ST, 0, 0, 0),  # M[0] = job
        (_LD_H_IND, 0, 0, netagg + SLOT_OFFSET),
        (_ALU_RSH_K, 0, 0, wire.SEGMENT_BLOCK_SHIFT),
        (_LDX_MEM, 0, 0, 0),  # X = M[0]
        (_ALU_ADD_X, 0, 0, 0),
        (_ALU_MOD_K, 0, 0, shards),
        (_RET_A, 0, 0, 0),
        (_RET_K, 0, 0, 0),
    ]


def udp_range_program(bases: list[int]) -> list[tuple[int, int, int, int]]:
    """A reuseport program for one job's host threads: socket i takes the job-relative slots from
    ``bases[i]`` up to ``bases[i + 1]`` (``bases[0]`` is 0; each a multiple of 64, so a segmented send of
    the switch's results never spans two threads)."""
    _check(len(bases))
    if bases[0] != 0 or any(b % wire.SEGMENT_BLOCK_SLOTS for b in bases) \
            or any(b >= c for b, c in itertools.pairwise(bases)):
        raise ValueError(f"thread ranges must start at 0 and at growing multiples of 64, got {bases}")
    program = [(_LD_H_ABS, 0, 0, SLOT_OFFSET)]
    for index in range(len(bases) - 1, 0, -1):
        program += [(_JGE_K, 0, 1, bases[index]), (_RET_K, 0, 0, index)]
    return [*program, (_RET_K, 0, 0, 0)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _fprog(program: list[tuple[int, int, int, int]]) -> tuple[bytes, ctypes.Array]:
    """``struct sock_fprog`` bytes and the instruction array they point at (keep it alive over the call)."""
    code = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *insn) for insn in program))
    prog = _SockFprog(len(program), ctypes.addressof(code))
    return bytes(prog), code


def attach_reuseport(sock: socket.socket, program: list[tuple[int, int, int, int]]) -> None:
    """Steer the SO_REUSEPORT group ``sock`` belongs to by ``program``: its value picks the socket (in bind
    order; past the last one the kernel hashes)."""
    fprog, code = _fprog(program)
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)
    del code


def udp_group(host: str, port: int, shards: int, rcvbuf: int = 8 << 20, sndbuf: int = 8 << 20,
              program: list[tuple[int, int, int, int]] | None = None, reuse: bool = False) -> list[socket.socket]:
    """``shards`` UDP sockets bound to one address (port 0: a free one), steered by slot; index = shard
    (``program``: another steering program than :func:`udp_program`, e.g. :func:`udp_range_program`).

    With one shard this is a plain socket (no SO_REUSEPORT: no other socket can join it), unless ``reuse``
    (other processes join it later, and the caller attaches the program)."""
    _check(shards)
    socks: list[socket.socket] = []
    try:
        for _ in range(shards):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            if shards > 1 or reuse:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.setblocking(False)
        if shards > 1:
            attach_reuseport(socks[0], program if program is not None else udp_program(shards))
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def join_fanout(sock: socket.socket, group_id: int | None, shards: int) -> tuple[int, bool]:
    """Add the bound AF_PACKET ``sock`` to fanout group ``group_id`` (16 bits; None: a new group with an id
    the kernel picks) steered by slot; members get shards in join order. Returns the group's id and whether
    members stop seeing outgoing frames (the kernel's flag; else callers filter by ``sll_pkttype``)."""
    _check(shards)
    unique = PACKET_FANOUT_FLAG_UNIQUEID if group_id is None else 0
    ignore_outgoing = True
    try:
        sock.setsockopt(SOL_PACKET, PACKET_FANOUT,
                        (group_id or 0) | ((PACKET_FANOUT_CBPF | PACKET_FANOUT_FLAG_IGNORE_OUTGOING | unique) << 16))
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        ignore_outgoing = False
        sock.setsockopt(SOL_PACKET, PACKET_FANOUT, (group_id or 0) | ((PACKET_FANOUT_CBPF | unique) << 16))
    fprog, code = _fprog(frame_program(shards))
    sock.setsockopt(SOL_PACKET, PACKET_FANOUT_DATA, fprog)
    del code
    return sock.getsockopt(SOL_PACKET, PACKET_FANOUT) & 0xFFFF, ignore_outgoing
