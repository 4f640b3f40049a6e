"""The software target's I/O kernels around the compiled program: loopback datagrams as frames and results as
datagrams (plain and segmented sends), raw ports' frames grouped by egress port, and which shard owns a frame's
slot (:mod:`~netagg.softswitch.batch_switch`, :mod:`~netagg.softswitch.shards`)."""

from __future__ import annotations

import numpy as np
from numba import njit

from netagg import layout, wire
from netagg.softswitch.fastpath_controls import down_link
from netagg.softswitch.fastpath_defs import (
    BLOCK_SHIFT,
    FLAG_RESULT,
    FLAGS,
    FRAME_BYTES,
    IP,
    NETAGG_PORT,
    TREE_PORT,
    UDP,
    _copy,
    _ipv4_checksum,
    _put16,
    _put32,
    _u16,
    _u32,
)
from netagg.udpgso_kernels import gso_header

wire.check_compiled_layout(__name__, "v4 K=64 widths=64,256 version:8,flags:8,job_id:16,slot:16,pool:8,rank:8,"
                                     "exponent:8s,width:8,round:16,seq:32,members:32,exchange:32")

@njit(cache=True, nogil=True)
def loopback_frames(buf, lengths, names, count, headroom, switch_ip, out_len):
    """The Ethernet/IPv4/UDP header a host's kernel would have put before each received datagram
    (``ports.LoopbackUdpPort._frame_for``), written into each row's headroom."""
    for i in range(count):
        b = buf[i]
        data = np.int64(lengths[i])
        udp_len = 8 + data
        for j in range(12):  # switch MAC 02:00:00:00:aa:01, host MAC 02:00:00:00:bb:01
            b[j] = 0
        b[0] = b[6] = 0x02
        b[4], b[5] = 0xAA, 0x01
        b[10], b[11] = 0xBB, 0x01
        _put16(b, 12, 0x0800)
        b[IP] = 0x45
        b[IP + 1] = 0
        _put16(b, IP + 2, 20 + udp_len)
        _put16(b, IP + 4, 0)
        _put16(b, IP + 6, 0x4000)
        b[IP + 8] = 64
        b[IP + 9] = 17
        _copy(b, IP + 12, names[i], 4, 4)
        _put32(b, IP + 16, switch_ip)
        _ipv4_checksum(b)
        _copy(b, UDP, names[i], 2, 2)
        _put16(b, UDP + 2, NETAGG_PORT)
        _put16(b, UDP + 4, udp_len)
        _put16(b, UDP + 6, 0)
        out_len[i] = headroom + data
    return headroom


@njit(cache=True, inline="always")
def _udp_payload(b, length):
    """Where an emitted IPv4/UDP frame's UDP payload starts, or -1 if it is not one (undeliverable on loopback)."""
    if length < 42 or _u16(b, 12) != 0x0800 or b[IP + 9] != 17:
        return -1
    udp = 14 + (b[IP] & 0x0F) * 4
    if udp + 8 > length:
        return -1
    return udp + 8


@njit(cache=True, nogil=True)
def loopback_sends(out_buf, out_len, out_port, count, port_number, row_addr, names, name_addr, tx_words,
                   tx_iov_words):
    """Fill sendmmsg headers for the emitted frames to ``port_number``: each frame's UDP payload to its
    IPv4 destination and UDP port (``ports.LoopbackUdpPort.transmit``). Returns (prepared, undeliverable)."""
    m = 0
    bad = 0
    for i in range(count):
        if out_port[i] != port_number:
            continue
        b = out_buf[i]
        length = out_len[i]
        payload = _udp_payload(b, length)
        if payload < 0:
            bad += 1
            continue
        udp = payload - 8
        nm = names[m]
        nm[0] = 2  # AF_INET, little-endian
        nm[1] = 0
        _copy(nm, 2, b, udp + 2, 2)
        _copy(nm, 4, b, IP + 16, 4)
        tx_words[m, 0] = name_addr[m]
        tx_words[m, 1] = 16
        tx_iov_words[m, 0] = row_addr[i] + np.uint64(udp + 8)
        tx_iov_words[m, 1] = length - udp - 8
        m += 1
    return m, bad


@njit(cache=True, nogil=True)
def order_by_group(out_port, count, port_slot, group_frames, order):
    """The emitted frames by egress group, a counting sort that keeps each group's frames in emission order.

    ``port_slot[port]`` is the group of a raw port, -2 for a port sent to elsewhere (the loopback
    port), or -1 (no such port: the frame is left out and counted). Afterwards ``group_frames[g]`` is
    group ``g``'s frame count and ``order`` holds the frames' indices group after group. Returns the
    frames to no port."""
    groups = group_frames.shape[0]
    group_frames[:] = 0
    unknown = 0
    for i in range(count):
        port = out_port[i]
        g = port_slot[port] if 0 <= port < port_slot.shape[0] else -1
        if g == -1:
            unknown += 1
        elif g >= 0:
            group_frames[g] += 1
    start = np.zeros(groups, np.int64)
    total = 0
    for g in range(groups):
        start[g] = total
        total += group_frames[g]
    for i in range(count):
        port = out_port[i]
        g = port_slot[port] if 0 <= port < port_slot.shape[0] else -1
        if g >= 0:
            order[start[g]] = i
            start[g] += 1
    return unknown


@njit(cache=True, nogil=True)
def group_sends(out_len, out_port, count, port_slot, row_addr, tx_words, tx_iov_words, group_counts, order):
    """Fill sendmmsg headers for the emitted frames grouped by egress port (:func:`order_by_group`):
    group ``g``'s messages are ``group_counts[g]`` consecutive headers, groups in order; ``order`` is
    scratch. Returns the frames to no port."""
    unknown = order_by_group(out_port, count, port_slot, group_counts, order)
    for m in range(group_counts.sum()):
        i = order[m]
        tx_words[m, 0] = 0
        tx_words[m, 1] = 0
        tx_iov_words[m, 0] = row_addr[i]
        tx_iov_words[m, 1] = out_len[i]
    return unknown


@njit(cache=True, nogil=True)
def loopback_gso_sends(out_buf, out_len, out_port, count, port_number, row_addr, names, name_addr, hdr_words,
                       iov_words, ctrl_size, iov_addr, ctrl_addr, ctrl_bytes, max_segments, max_bytes, keys, order,
                       steer):
    """:func:`loopback_sends` for segmented sends (``netagg.udpgso.GsoBatch``): the emitted frames to
    ``port_number`` grouped by destination (IPv4 address and UDP port; each destination's frames in
    the order they were emitted), and each destination's run cut into headers of up to
    ``max_segments`` payloads of one length (``max_bytes`` in all) and of one steering block (job and
    ``slot >> wire.SEGMENT_BLOCK_SHIFT``: a host with several receive threads steers a segmented send by its
    first datagram). Header ``h`` sends to ``names[h]``; iovec ``j`` is a payload; ``keys``, ``order`` and
    ``steer`` are scratch. Returns (headers, segments, undeliverable)."""
    m = 0
    bad = 0
    for i in range(count):
        if out_port[i] != port_number:
            continue
        b = out_buf[i]
        length = out_len[i]
        payload = _udp_payload(b, length)
        if payload < 0:
            bad += 1
            continue
        udp = payload - 8
        keys[m] = (np.int64(_u32(b, IP + 16)) << np.int64(16)) | np.int64(_u16(b, udp + 2))
        if payload + layout.SLOT_AT + 2 <= length:  # job_id and slot of a netagg header
            steer[m] = (np.int64(_u16(b, payload + layout.JOB_AT)) << np.int64(32)) \
                | np.int64(_u16(b, payload + layout.SLOT_AT) >> BLOCK_SHIFT)
        else:
            steer[m] = -1
        iov_words[m, 0] = row_addr[i] + np.uint64(udp + 8)
        iov_words[m, 1] = length - udp - 8
        m += 1
    if m == 0:
        return 0, 0, bad
    perm = np.argsort(keys[:m], kind="mergesort")  # stable: a destination's frames keep their order
    # iovecs in destination order (through order[] as scratch, then copied back).
    for j in range(m):
        order[j, 0] = iov_words[perm[j], 0]
        order[j, 1] = iov_words[perm[j], 1]
    headers = 0
    j = 0
    while j < m:
        key = keys[perm[j]]
        block = steer[perm[j]]
        seg = order[j, 1]
        start = j
        total = np.uint64(0)
        while (j < m and keys[perm[j]] == key and order[j, 1] == seg and j - start < max_segments
               and total + seg <= max_bytes and steer[perm[j]] == block):
            iov_words[j, 0] = order[j, 0]
            iov_words[j, 1] = order[j, 1]
            total += seg
            j += 1
        size = j - start
        nm = names[headers]
        nm[0] = 2  # AF_INET, little-endian
        nm[1] = 0
        nm[2] = (key >> 8) & 0xFF
        nm[3] = key & 0xFF
        nm[4] = (key >> 40) & 0xFF
        nm[5] = (key >> 32) & 0xFF
        nm[6] = (key >> 24) & 0xFF
        nm[7] = (key >> 16) & 0xFF
        gso_header(hdr_words, headers, name_addr[headers], 16, iov_addr, start, size, ctrl_addr, ctrl_bytes,
                   ctrl_size, seg)
        headers += 1
    return headers, m, bad


@njit(cache=True, nogil=True)
def frame_owners(buf, lengths, ports, count, shards, me, owners, dn_keys, dn_vals):
    """The shard that owns each frame's slot (``netagg.steering.shard_of``: job and slot of a netagg
    frame), or -1 for a frame of no slot (not IPv4/UDP to netagg's port, too short): any shard may run
    it. A parent's result coming down (``down_links``) is owned by the shard of the local job's slot,
    which the steering (by the parent's job id) cannot know. Writes ``owners[0..count-1]``; returns how
    many frames belong to a shard other than ``me``."""
    foreign = 0
    for i in range(count):
        b = buf[i]
        length = lengths[i]
        owners[i] = -1
        if length < IP + 20 or _u16(b, 12) != 0x0800 or b[IP + 9] != 17:
            continue
        udp = IP + (b[IP] & 0x0F) * 4
        dport = _u16(b, udp + 2)
        if udp + 14 > length or (dport != NETAGG_PORT and dport != TREE_PORT):
            continue
        job = np.int64(_u16(b, udp + 8 + layout.JOB_AT))
        if udp == UDP and length >= FRAME_BYTES and b[FLAGS] & FLAG_RESULT:
            down, local = down_link(b, ports[i], dn_keys, dn_vals)
            if down:
                job = local
        slot = np.int64(_u16(b, udp + 8 + layout.SLOT_AT))
        owner = (job + (slot >> BLOCK_SHIFT)) % shards
        owners[i] = owner
        if owner != me:
            foreign += 1
    return foreign
