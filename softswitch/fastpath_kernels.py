"""The netagg program compiled with numba: one call runs a whole batch of frames through it.

Each function mirrors a control of ``p4src/v1model/netagg.p4`` line by line, exactly like the
readable model in :mod:`netagg.softswitch.pipeline` (the reference); packets of a batch are
processed one after the other, in arrival order, so register updates between packets that
hit the same slot happen in the same order as in the model and on BMv2.
``tests/test_softswitch_fastpath.py`` feeds both engines the same sequences and requires
identical frames, counters and registers.

Tables arrive as arrays compiled by :mod:`netagg.softswitch.fastpath` from the
``ForwardingState`` (open-addressing hash tables for exact keys, a prefix list for the
LPM table), counters are the state's own arrays, registers are this engine's arrays.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from netagg import wire
from netagg.dataplane import DropReason, ValueOp
from netagg.udpgso_kernels import gso_header

wire.check_compiled_layout(__name__, version=2, header_bytes=20, k=64)  # see check_compiled_layout

K = wire.K
NETAGG_PORT = wire.NETAGG_UDP_PORT
IPV4_TOTAL_LENGTH = wire.IPV4_TOTAL_LENGTH
UDP_LENGTH = wire.UDP_LENGTH
FRAME_BYTES = wire.FRAME_BYTES
FLAG_RESULT = wire.FLAG_RESULT
VERSION = wire.VERSION
DROP_PORT = 511
RESULT_TTL = 64
HASH_MULT = np.uint64(0x9E3779B97F4A7C15)

# Offsets in a frame (Ethernet / IPv4 without options / UDP / netagg).
IP, UDP, NA = 14, 34, 42
VALUES = NA + wire.HEADER_BYTES

# Counter indices in the ``counters`` tuple (see fastpath.COUNTERS).
C_DROPS, C_EGRESS_DROPS, C_CONTRIB, C_RESULTS, C_DUPS, C_RETX, C_REJECTS = 0, 1, 2, 3, 4, 5, 6

D_NONE = int(DropReason.NONE)
D_NOT_IPV4 = int(DropReason.NOT_IPV4)
D_NO_ROUTE = int(DropReason.NO_ROUTE)
D_TTL = int(DropReason.TTL_EXPIRED)
D_MALFORMED = int(DropReason.MALFORMED)
D_BAD_VERSION = int(DropReason.BAD_VERSION)
D_RESULT_FROM_HOST = int(DropReason.RESULT_FROM_HOST)
D_UNKNOWN_JOB = int(DropReason.UNKNOWN_JOB)
D_UNKNOWN_WORKER = int(DropReason.UNKNOWN_WORKER)
D_SLOT_RANGE = int(DropReason.SLOT_OUT_OF_RANGE)
D_BAD_POOL = int(DropReason.BAD_POOL)
D_RANK = int(DropReason.RANK_MISMATCH)
D_NO_REPLICA = int(DropReason.NO_REPLICA)
D_SPOOFED = int(DropReason.SPOOFED_SOURCE)
D_NOT_MEMBER = int(DropReason.NOT_A_MEMBER)
D_MEMBERS = int(DropReason.MEMBERS_MISMATCH)
OP_NONE, OP_WRITE, OP_MERGE, OP_READ = int(ValueOp.NONE), int(ValueOp.WRITE), int(ValueOp.MERGE), int(ValueOp.READ)
#: Actions of the sources table as compiled.
SRC_SWITCH_ONLY, SRC_BIND = 1, 2


@njit(cache=True, inline="always")
def _u16(b, i):
    return (np.int64(b[i]) << 8) | np.int64(b[i + 1])


@njit(cache=True, inline="always")
def _u32(b, i):
    return (np.int64(b[i]) << 24) | (np.int64(b[i + 1]) << 16) | (np.int64(b[i + 2]) << 8) | np.int64(b[i + 3])


@njit(cache=True, inline="always")
def _put16(b, i, v):
    b[i] = (v >> 8) & 0xFF
    b[i + 1] = v & 0xFF


@njit(cache=True, inline="always")
def _put32(b, i, v):
    b[i] = (v >> 24) & 0xFF
    b[i + 1] = (v >> 16) & 0xFF
    b[i + 2] = (v >> 8) & 0xFF
    b[i + 3] = v & 0xFF


@njit(cache=True, inline="always")
def _copy(dst, d0, src, s0, n):
    """``dst[d0:d0+n] = src[s0:s0+n]`` as a loop over views that start at 0: numba's slice assignment checks
    for overlap and copies through a temporary array (about 15x slower for a frame), and a loop indexing
    both arrays with offsets is not vectorized (8x slower)."""
    d = dst[d0:d0 + n]
    s = src[s0:s0 + n]
    for j in range(n):
        d[j] = s[j]


@njit(cache=True, inline="always")
def _bump(packets, byte_counts, index, nbytes):
    """Count one packet of ``nbytes`` at ``index`` of a counter's (packets, bytes) arrays.

    Callers pick the arrays out of the ``counters`` tuple with literal indices (2 * C_x, 2 * C_x + 1):
    a computed index into a tuple of arrays makes numba copy the whole tuple onto the stack at every
    use, which cost more than the rest of a dropped packet's path."""
    if 0 <= index < packets.shape[0]:
        packets[index] += 1
        byte_counts[index] += nbytes


@njit(cache=True, inline="always")
def _slot_of(key, mask):
    return np.int64((np.uint64(key) * HASH_MULT) >> np.uint64(40)) & mask


@njit(cache=True, inline="always")
def _ipv4_checksum(b):
    """NetaggComputeChecksum: csum16 over the 20-byte header with the checksum field zero."""
    b[IP + 10] = 0
    b[IP + 11] = 0
    total = 0
    for i in range(IP, IP + 20, 2):
        total += (np.int64(b[i]) << 8) | np.int64(b[i + 1])
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    _put16(b, IP + 10, ~total & 0xFFFF)


@njit(cache=True, inline="always")
def _decide(regs_owner, regs_rounds, regs_members, regs_bitmaps, regs_counts, slot, pool, round_, worker_mask,
            num_workers, generation, members):
    """SlotOwner, RoundCheck, MemberCheck, BitmapCheck and WorkerCount (netagg.slots.SlotRegisters.decide).

    Returns (op, old, fresh, complete, late, members_mismatch)."""
    stale = regs_owner[slot] != generation
    if stale:
        regs_owner[slot] = generation
    if stale:
        regs_rounds[pool, slot] = round_
        regs_rounds[1 - pool, slot] = (round_ - 2) & 0xFFFF  # two behind (slots.py)
        new = True
    else:
        ahead = (round_ - np.int64(regs_rounds[pool, slot])) & 0xFFFF
        if ahead == 0:
            new = False
        elif ahead < 0x8000:
            regs_rounds[pool, slot] = round_
            new = True
        else:
            return OP_NONE, True, False, False, False, False
    index = slot * 2 + pool
    if new:
        regs_members[index] = members
    elif np.int64(regs_members[index]) != members:
        return OP_NONE, False, False, False, False, True
    before = np.int64(0) if new else np.int64(regs_bitmaps[index])
    regs_bitmaps[index] = before | worker_mask
    fresh = (before & worker_mask) == 0
    count = np.int64(regs_counts[index])
    late = False
    if fresh:
        if new:
            expected = num_workers
            if members != 0:
                expected = 0
                m = members
                while m:
                    expected += m & 1
                    m >>= 1
            count = (expected - 1) & 0xFF
            regs_counts[index] = count
        elif count == 0:
            late = True
        else:
            count = count - 1
            regs_counts[index] = count
    complete = count == 0 and not late
    if fresh and not late:
        op = OP_WRITE if new else OP_MERGE
    elif not fresh and complete:
        op = OP_READ
    else:
        op = OP_NONE
    return op, False, fresh, complete, late, False


@njit(cache=True, inline="always")
def _emit(work, length, port, out_buf, out_len, out_port, n):
    _copy(out_buf[n], 0, work, 0, length)
    out_len[n] = length
    out_port[n] = port
    return n + 1


@njit(cache=True, inline="always")
def _packet(frame, length, ingress, work, out_buf, out_len, out_port, n,
            job_valid, job_params, w_keys, w_vals, src_keys, src_vals, route_vm, route_out, rep_keys, rep_vals,
            grp_off, grp_items, counters, regs_owner, regs_rounds, regs_members, regs_bitmaps, regs_counts, regs_exps,
            regs_values):
    """One frame through NetaggIngress, the replication engine and NetaggEgress; returns the new output count."""
    _copy(work, 0, frame, 0, length)
    b = work
    # -- NetaggParser
    error = False
    ipv4 = udp = netagg = False
    if length < 14:
        error = True
    elif _u16(b, 12) == 0x0800:
        if length < 34:
            error = True
        else:
            ipv4 = True
            if (b[IP] & 0x0F) == 5 and b[IP + 9] == 17:
                if length < 42:
                    error = True
                else:
                    udp = True
                    if _u16(b, UDP + 2) == NETAGG_PORT:
                        if length < FRAME_BYTES:
                            error = True
                        else:
                            netagg = True
    # -- NetaggIngress
    drop = D_NONE
    if error:
        drop = D_MALFORMED
    elif not ipv4:
        drop = D_NOT_IPV4
    else:  # SourceGuard
        if udp and _u16(b, UDP) == NETAGG_PORT:
            drop = D_SPOOFED
        else:
            src = _u32(b, IP + 12)
            mask = src_keys.shape[0] - 1
            h = _slot_of(src, mask)
            while src_keys[h] != -1:
                if src_keys[h] == src:
                    if src_vals[h, 0] == SRC_SWITCH_ONLY or src_vals[h, 1] != ingress:
                        drop = D_SPOOFED
                    break
                h = (h + 1) & mask
    if drop != D_NONE:
        _bump(counters[0], counters[1], drop, length)
        return n
    if not netagg:  # Ipv4Forward
        if b[IP + 8] <= 1:
            _bump(counters[0], counters[1], D_TTL, length)
            return n
        dst = _u32(b, IP + 16)
        hit = -1
        for r in range(route_vm.shape[0]):
            if (dst & route_vm[r, 1]) == route_vm[r, 0]:
                hit = r
                break
        if hit < 0:
            _bump(counters[0], counters[1], D_NO_ROUTE, length)
            return n
        _copy(b, 6, frame, 0, 6)
        mac = route_out[hit, 1]
        for i in range(6):
            b[i] = (mac >> (8 * (5 - i))) & 0xFF
        if (b[IP] & 0x0F) == 5:
            b[IP + 8] -= 1
            _ipv4_checksum(b)
        port = route_out[hit, 0]
        if port == DROP_PORT:
            return n
        return _emit(work, length, port, out_buf, out_len, out_port, n)
    if b[NA] != VERSION:
        drop = D_BAD_VERSION
    elif _u16(b, IP + 2) != IPV4_TOTAL_LENGTH or _u16(b, UDP + 4) != UDP_LENGTH or (_u16(b, IP + 6) & 0x3FFF):
        drop = D_MALFORMED
    elif b[NA + 1] & FLAG_RESULT:
        drop = D_RESULT_FROM_HOST
    if drop != D_NONE:
        _bump(counters[0], counters[1], drop, length)
        return n
    # WorkerLookup
    job = _u16(b, NA + 2)
    slot_rel = _u16(b, NA + 4)
    pool = np.int64(b[NA + 6])
    rank = np.int64(b[NA + 7])
    src = _u32(b, IP + 12)
    sport = _u16(b, UDP)
    slot_index = np.int64(0)
    num_workers = generation = mgid = np.int64(0)
    worker_mask = np.int64(0)
    members = _u32(b, NA + 16)
    if not job_valid[job]:
        drop = D_UNKNOWN_JOB
    else:
        num_workers = job_params[job, 0]
        slot_base = job_params[job, 1]
        slot_count = job_params[job, 2]
        mgid = job_params[job, 3]
        generation = job_params[job, 4]
        key = (job << 48) | (sport << 32) | src
        mask = w_keys.shape[0] - 1
        h = _slot_of(key ^ (np.int64(ingress) << 20), mask)
        found = -1
        while w_keys[h, 1] != -1:
            if w_keys[h, 0] == key and w_keys[h, 1] == ingress:
                found = h
                break
            h = (h + 1) & mask
        if found < 0:
            drop = D_UNKNOWN_WORKER
        elif slot_rel >= slot_count:
            drop = D_SLOT_RANGE
        elif pool >= 2:
            drop = D_BAD_POOL
        elif rank != w_vals[found, 0]:
            drop = D_RANK
        elif members != 0 and (members & w_vals[found, 1]) == 0:
            drop = D_NOT_MEMBER
        else:
            worker_mask = w_vals[found, 1]
            slot_index = (slot_base + slot_rel) & 0xFFFFFFFF
    if drop != D_NONE:
        if drop != D_UNKNOWN_JOB:
            _bump(counters[12], counters[13], job, length)
        _bump(counters[0], counters[1], drop, length)
        return n
    if slot_index >= regs_owner.shape[0]:
        return n
    op, old, fresh, complete, late, mismatch = _decide(
        regs_owner, regs_rounds, regs_members, regs_bitmaps, regs_counts, slot_index, pool, _u16(b, NA + 10),
        worker_mask, num_workers, generation, members)
    if mismatch:
        _bump(counters[12], counters[13], job, length)
        _bump(counters[0], counters[1], D_MEMBERS, length)
        return n
    if old:
        _bump(counters[8], counters[9], job, length)
        return n
    to_group = False
    if fresh and not late:
        _bump(counters[4], counters[5], job, length)
        if complete:
            to_group = True
            _bump(counters[6], counters[7], job, length)
    elif op == OP_READ:
        _bump(counters[10], counters[11], job, length)
    else:
        _bump(counters[8], counters[9], job, length)
    index = slot_index * 2 + pool
    if op != OP_NONE:  # ExponentMax, ValueSum
        exponent = np.int8(b[NA + 8])
        if op == OP_WRITE or (op == OP_MERGE and exponent > regs_exps[index]):
            regs_exps[index] = exponent
        b[NA + 8] = np.uint8(regs_exps[index])
        row = regs_values[index]
        for i in range(K):
            o = VALUES + 4 * i
            if op == OP_WRITE:
                row[i] = np.int32(np.uint32(_u32(b, o)))
            elif op == OP_MERGE:
                row[i] = np.int32(np.uint32((np.int64(row[i]) + _u32(b, o)) & 0xFFFFFFFF))
            _put32(b, o, np.int64(np.uint32(row[i])))
    if not (complete and not late):
        return n
    # ResultDelivery
    _copy(b, 6, frame, 0, 6)
    _copy(b, IP + 12, frame, IP + 16, 4)
    _put16(b, UDP, NETAGG_PORT)
    b[IP + 8] = RESULT_TTL
    _put16(b, UDP + 6, 0)
    b[NA + 1] |= FLAG_RESULT
    if not to_group:
        _copy(b, 0, frame, 6, 6)
        _copy(b, IP + 16, frame, IP + 12, 4)
        _put16(b, UDP + 2, sport)
        _ipv4_checksum(b)
        if ingress == DROP_PORT:
            return n
        return _emit(work, length, ingress, out_buf, out_len, out_port, n)
    # Replication and ResultRewrite (per replica).
    if mgid >= grp_off.shape[0] - 1:
        return n
    for g in range(grp_off[mgid], grp_off[mgid + 1]):
        port, rid = grp_items[g, 0], grp_items[g, 1]
        key = (mgid << 16) | rid
        mask = rep_keys.shape[0] - 1
        h = _slot_of(key, mask)
        found = -1
        while rep_keys[h] != -1:
            if rep_keys[h] == key:
                found = h
                break
            h = (h + 1) & mask
        if found < 0:
            _bump(counters[2], counters[3], D_NO_REPLICA, 0)
            continue
        mac = rep_vals[found, 0]
        for i in range(6):
            b[i] = (mac >> (8 * (5 - i))) & 0xFF
        _put32(b, IP + 16, rep_vals[found, 1])
        _put16(b, UDP + 2, rep_vals[found, 2])
        _ipv4_checksum(b)
        n = _emit(work, length, port, out_buf, out_len, out_port, n)
    return n


@njit(cache=True)
def run_batch(in_buf, in_len, in_port, count, work, out_buf, out_len, out_port, max_out,
              job_valid, job_params, w_keys, w_vals, src_keys, src_vals, route_vm, route_out, rep_keys, rep_vals,
              grp_off, grp_items, counters, regs_owner, regs_rounds, regs_members, regs_bitmaps, regs_counts, regs_exps,
              regs_values):
    """Frames ``0..count-1`` in order; returns (frames consumed, frames emitted).

    Stops early when the next frame could overflow ``out_buf`` (``max_out``: the most
    frames one input can emit); the caller sends what was emitted and calls again."""
    n = 0
    cap = out_buf.shape[0]
    for i in range(count):
        if n + max_out > cap:
            return i, n
        n = _packet(in_buf[i], in_len[i], in_port[i], work, out_buf, out_len, out_port, n,
                    job_valid, job_params, w_keys, w_vals, src_keys, src_vals, route_vm, route_out, rep_keys,
                    rep_vals, grp_off, grp_items, counters, regs_owner, regs_rounds, regs_members, regs_bitmaps,
                    regs_counts, regs_exps, regs_values)
    return count, n


@njit(cache=True)
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


@njit(cache=True)
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


@njit(cache=True)
def group_sends(out_len, out_port, count, port_slot, row_addr, tx_words, tx_iov_words, group_counts):
    """Fill sendmmsg headers for the emitted frames grouped by egress port (a counting sort).

    ``port_slot[port]`` is the group of a raw port, -2 for a port sent to elsewhere (the loopback
    port), or -1 (no such port: the frame is left out and counted). Afterwards group ``g``'s
    messages are ``group_counts[g]`` consecutive headers, groups in order. Returns the frames
    to no port."""
    groups = group_counts.shape[0]
    group_counts[:] = 0
    unknown = 0
    for i in range(count):
        port = out_port[i]
        g = port_slot[port] if 0 <= port < port_slot.shape[0] else -1
        if g == -1:
            unknown += 1
        elif g >= 0:
            group_counts[g] += 1
    start = np.zeros(groups, np.int64)
    total = 0
    for g in range(groups):
        start[g] = total
        total += group_counts[g]
    for i in range(count):
        port = out_port[i]
        g = port_slot[port] if 0 <= port < port_slot.shape[0] else -1
        if g < 0:
            continue
        m = start[g]
        start[g] += 1
        tx_words[m, 0] = 0
        tx_words[m, 1] = 0
        tx_iov_words[m, 0] = row_addr[i]
        tx_iov_words[m, 1] = out_len[i]
    return unknown


@njit(cache=True)
def loopback_gso_sends(out_buf, out_len, out_port, count, port_number, row_addr, names, name_addr, hdr_words,
                       iov_words, ctrl_size, iov_addr, ctrl_addr, ctrl_bytes, max_segments, max_bytes, keys, order):
    """:func:`loopback_sends` for segmented sends (``netagg.udpgso.GsoBatch``): the emitted frames to
    ``port_number`` grouped by destination (IPv4 address and UDP port; each destination's frames in
    the order they were emitted), and each destination's run cut into headers of up to
    ``max_segments`` payloads of one length (``max_bytes`` in all). Header ``h`` sends to
    ``names[h]``; iovec ``j`` is a payload. Returns (headers, segments, undeliverable)."""
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
        seg = order[j, 1]
        start = j
        total = np.uint64(0)
        while (j < m and keys[perm[j]] == key and order[j, 1] == seg and j - start < max_segments
               and total + seg <= max_bytes):
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
