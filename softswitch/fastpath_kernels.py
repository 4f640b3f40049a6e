"""The netagg program compiled with numba: one call runs a whole batch of frames through it.

(Over 500 lines: the program's kernels and the loopback send/receive kernels after them share the byte helpers.)

One function per control of ``p4src/v1model`` (named after its instance in ``netagg.p4``:
``netagg_parser``, ``source_guard``, ``ipv4_forward``, ``worker_lookup``, ``slot_owner``,
``round_check``, ``member_check``, ``bitmap_check``, ``worker_count``, ``exponent_max``,
``value_sum``, ``result_delivery``, ``down_link``, ``level_state``, ``up_delivery``, ``netagg_ingress``,
``result_rewrite``, ``netagg_egress``,
``netagg_compute_checksum``), each inlined (``inline="always"``) into ``run_batch``, which runs
every frame through them in the V1Switch's order, exactly like the readable model in
:mod:`netagg.softswitch.pipeline` (the reference). Packets of a batch are
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

from netagg import dataplane as dp
from netagg import layout, wire
from netagg.dataplane import DropReason, Level, ValueOp
from netagg.slots import RoundState
from netagg.udpgso_kernels import gso_header

wire.check_compiled_layout(__name__, "v3 K=64 widths=64,256 version:8,flags:8,job_id:16,slot:16,pool:8,rank:8,"
                                     "exponent:8s,width:8,round:16,seq:32,members:32,exchange:32")

K = wire.K
WIDE = wire.WIDTH_CODES[wire.WIDE_K]
WIDE_CELLS = wire.cells_of(wire.WIDE_K)
NETAGG_PORT = wire.NETAGG_UDP_PORT
TREE_PORT = wire.NETAGG_TREE_UDP_PORT
IPV4_TOTAL_LENGTH = wire.IPV4_TOTAL_LENGTH
UDP_LENGTH = wire.UDP_LENGTH
FRAME_BYTES = wire.FRAME_BYTES
WIDE_IPV4_TOTAL_LENGTH = wire.ipv4_total_length(wire.WIDE_K)
WIDE_UDP_LENGTH = wire.udp_length(wire.WIDE_K)
WIDE_FRAME_BYTES = wire.frame_bytes(wire.WIDE_K)
FLAG_RESULT = wire.FLAG_RESULT
FLAG_OUT_OF_STEP = wire.FLAG_OUT_OF_STEP
ROUND_FLAGS = wire.ROUND_FLAGS
NOT_ROUND_FLAGS = 0xFF & ~wire.ROUND_FLAGS
VERSION = wire.VERSION
DROP_PORT = dp.DROP_PORT
POOLS = wire.NUM_POOLS
RESULT_TTL = 64
HASH_MULT = np.uint64(0x9E3779B97F4A7C15)

# Offsets in a frame (Ethernet / IPv4 without options / UDP / netagg), and of the netagg header's fields in it
# (netagg.layout, from wire.HEADER_FIELDS).
IP, UDP, NA = 14, 34, 42
NA_VERSION, FLAGS, JOB, SLOT, POOL, RANK = (NA + layout.VERSION_AT, NA + layout.FLAGS_AT, NA + layout.JOB_AT,
                                            NA + layout.SLOT_AT, NA + layout.POOL_AT, NA + layout.RANK_AT)
EXPONENT, WIDTH, ROUND, SEQ, MEMBERS, EXCHANGE = (NA + layout.EXPONENT_AT, NA + layout.WIDTH_AT,
                                                  NA + layout.ROUND_AT, NA + layout.SEQ_AT, NA + layout.MEMBERS_AT,
                                                  NA + layout.EXCHANGE_AT)
VALUES = NA + layout.VALUES_AT

# Counter indices in the ``counters`` tuple (see fastpath.COUNTERS).
C_DROPS, C_EGRESS_DROPS, C_CONTRIB, C_RESULTS, C_DUPS, C_RETX, C_REJECTS = 0, 1, 2, 3, 4, 5, 6
# ... and of each counter's (packets, bytes) arrays in the flat ``counters`` tuple. Module-level ints are constants
# to numba, so ``counters[P_REJECTS]`` is a static index (see _bump).
P_DROPS, B_DROPS = 2 * C_DROPS, 2 * C_DROPS + 1
P_EGRESS_DROPS, B_EGRESS_DROPS = 2 * C_EGRESS_DROPS, 2 * C_EGRESS_DROPS + 1
P_CONTRIB, B_CONTRIB = 2 * C_CONTRIB, 2 * C_CONTRIB + 1
P_RESULTS, B_RESULTS = 2 * C_RESULTS, 2 * C_RESULTS + 1
P_DUPS, B_DUPS = 2 * C_DUPS, 2 * C_DUPS + 1
P_RETX, B_RETX = 2 * C_RETX, 2 * C_RETX + 1
P_REJECTS, B_REJECTS = 2 * C_REJECTS, 2 * C_REJECTS + 1

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
D_EXCHANGE = int(DropReason.EXCHANGE_MISMATCH)
D_WRONG_WIDTH = int(DropReason.WRONG_WIDTH)
LEVEL_OPEN, LEVEL_UP, LEVEL_FINAL = int(Level.OPEN), int(Level.UP), int(Level.FINAL)
FLAG_RETRANSMIT = wire.FLAG_RETRANSMIT
OP_NONE, OP_WRITE, OP_MERGE, OP_READ = int(ValueOp.NONE), int(ValueOp.WRITE), int(ValueOp.MERGE), int(ValueOp.READ)
ROUND_SAME, ROUND_NEW, ROUND_OLD = int(RoundState.SAME), int(RoundState.NEW), int(RoundState.OLD)
#: Actions of the sources table as compiled.
SRC_SWITCH_ONLY, SRC_BIND = 1, 2
BLOCK_SHIFT = wire.SEGMENT_BLOCK_SHIFT


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

    Callers pick the arrays out of the ``counters`` tuple with constant indices (P_x, B_x = 2 * C_x, 2 * C_x + 1):
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
def _emit(work, length, port, out_buf, out_len, out_port, n):
    _copy(out_buf[n], 0, work, 0, length)
    out_len[n] = length
    out_port[n] = port
    return n + 1


# --------------------------------------------------------------------------- the controls, in the program's order
#
# One function per control of p4src/v1model (named after its instance in netagg.p4), each inlined
# into ``run_batch``. ``b`` is the packet being processed (a copy of ``frame``, the packet as received).


@njit(cache=True, inline="always")
def netagg_parser(b, length):
    """NetaggParser: ethernet -> ipv4 (ihl 5, UDP) -> udp -> netagg + values (+ values1..3 when wide).

    Returns (parser error, ipv4 valid, udp valid, netagg valid)."""
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
                    dport = _u16(b, UDP + 2)
                    if dport in (NETAGG_PORT, TREE_PORT):
                        if length < FRAME_BYTES or (b[WIDTH] == WIDE and length < WIDE_FRAME_BYTES):
                            error = True
                        else:
                            netagg = True
    return error, ipv4, udp, netagg


@njit(cache=True, inline="always")
def source_guard(b, udp, ingress, src_keys, src_vals):
    """SourceGuard: no host sends from the netagg port, the aggregator address or another host's address.

    Returns the drop reason (D_NONE: passed)."""
    if udp and _u16(b, UDP) == NETAGG_PORT:
        return D_SPOOFED
    src = _u32(b, IP + 12)
    mask = src_keys.shape[0] - 1
    h = _slot_of(src, mask)
    while src_keys[h] != -1:
        if src_keys[h] == src:
            if src_vals[h, 0] == SRC_SWITCH_ONLY or src_vals[h, 1] != ingress:
                return D_SPOOFED
            return D_NONE
        h = (h + 1) & mask
    return D_NONE


@njit(cache=True, inline="always")
def ipv4_forward(b, frame, route_vm, route_out):
    """Ipv4Forward: LPM on the destination (routes longest prefix first), TTL decrement without options.

    Returns (drop reason, egress_spec)."""
    if b[IP + 8] <= 1:
        return D_TTL, np.int64(0)
    dst = _u32(b, IP + 16)
    for r in range(route_vm.shape[0]):
        if (dst & route_vm[r, 1]) == route_vm[r, 0]:  # forward(port, dst_mac)
            _copy(b, 6, frame, 0, 6)
            mac = route_out[r, 1]
            for i in range(6):
                b[i] = (mac >> (8 * (5 - i))) & 0xFF
            if (b[IP] & 0x0F) == 5:
                b[IP + 8] -= 1
            return D_NONE, route_out[r, 0]
    return D_NO_ROUTE, np.int64(0)


@njit(cache=True, inline="always")
def worker_lookup(b, ingress, job_valid, job_params, w_keys, w_vals, down):
    """WorkerLookup: jobs, workers (keyed by the ingress port too), then the slot/pool/rank/member checks.
    ``down``: a parent's result (tree_links.p4), which has no sender to look up or check.

    Returns (drop reason, num_workers, slot_index, mgid, generation, worker_mask); slot_index is the slot's
    first cell (``slot_base + slot << 2 * width``)."""
    zero = np.int64(0)
    job = _u16(b, JOB)
    if not job_valid[job]:
        return D_UNKNOWN_JOB, zero, zero, zero, zero, zero
    num_workers = job_params[job, 0]
    slot_base = job_params[job, 1]
    slot_count = job_params[job, 2]
    mgid = job_params[job, 3]
    generation = job_params[job, 4]
    width = job_params[job, 5]
    found = -1
    if not down:
        key = (job << 48) | (_u16(b, UDP) << 32) | _u32(b, IP + 12)
        mask = w_keys.shape[0] - 1
        h = _slot_of(key ^ (np.int64(ingress) << 20), mask)
        while w_keys[h, 1] != -1:
            if w_keys[h, 0] == key and w_keys[h, 1] == ingress:
                found = h
                break
            h = (h + 1) & mask
    slot_rel = _u16(b, SLOT)
    members = _u32(b, MEMBERS)
    drop = D_NONE
    if not down and found < 0:
        drop = D_UNKNOWN_WORKER
    elif np.int64(b[WIDTH]) != width:
        drop = D_WRONG_WIDTH
    elif slot_rel >= slot_count:
        drop = D_SLOT_RANGE
    elif b[POOL] >= 2:
        drop = D_BAD_POOL
    elif not down and np.int64(b[RANK]) != w_vals[found, 0]:
        drop = D_RANK
    elif not down and members != 0 and (members & w_vals[found, 1]) == 0:
        drop = D_NOT_MEMBER
    if drop != D_NONE:
        return drop, zero, zero, zero, zero, zero
    mask_bit = zero if down else w_vals[found, 1]
    return D_NONE, num_workers, (slot_base + (slot_rel << (2 * width))) & 0xFFFFFFFF, mgid, generation, mask_bit


@njit(cache=True, inline="always")
def slot_owner(regs_owner, slot, generation):
    """SlotOwner: does the slot belong to another job (or to none since a restart)? It becomes this job's.

    Returns stale."""
    stale = regs_owner[slot] != generation
    if stale:
        regs_owner[slot] = generation
    return stale


@njit(cache=True, inline="always")
def round_check(regs_rounds, slot, pool, round_, stale):
    """RoundCheck: ROUND_SAME, ROUND_NEW (ahead, mod 2**16) or ROUND_OLD; a stale slot starts a new round
    and marks the other pool two rounds behind (netagg.slots.SlotRegisters.round_check)."""
    if stale:
        regs_rounds[pool, slot] = round_
        regs_rounds[1 - pool, slot] = (round_ - 2) & 0xFFFF
        return ROUND_NEW
    ahead = (round_ - np.int64(regs_rounds[pool, slot])) & 0xFFFF
    if ahead == 0:
        return ROUND_SAME
    if ahead < 0x8000:
        regs_rounds[pool, slot] = round_
        return ROUND_NEW
    return ROUND_OLD


@njit(cache=True, inline="always")
def member_check(regs_members, index, round_state, members):
    """MemberCheck: a new round takes the packet's members; the same round must carry them.

    Returns the drop reason (D_NONE: passed)."""
    if round_state == ROUND_NEW:
        regs_members[index] = members
    elif np.int64(regs_members[index]) != members:
        return D_MEMBERS
    return D_NONE


@njit(cache=True, inline="always")
def exchange_check(regs_exchanges, index, round_state, exchange):
    """ExchangeCheck: a new round takes the packet's collective; returns whether the packet names another."""
    if round_state == ROUND_NEW:
        regs_exchanges[index] = exchange
        return False
    return np.int64(regs_exchanges[index]) != exchange


@njit(cache=True, inline="always")
def round_flags(b, regs_flags, index, op, mismatch):
    """RoundFlags: write / OR the packet's round flags (a contribution of another collective: OUT_OF_STEP
    instead); the packet leaves with the round's flags in place of its own."""
    if mismatch:
        regs_flags[index] |= FLAG_OUT_OF_STEP
    elif op == OP_WRITE:
        regs_flags[index] = b[FLAGS] & ROUND_FLAGS
    elif op == OP_MERGE:
        regs_flags[index] |= b[FLAGS] & ROUND_FLAGS
    b[FLAGS] = (b[FLAGS] & NOT_ROUND_FLAGS) | regs_flags[index]


@njit(cache=True, inline="always")
def bitmap_check(regs_bitmaps, index, round_state, worker_mask):
    """BitmapCheck: add the sender's bit. Returns (first: the round's first packet, fresh: the sender's first)."""
    first = round_state == ROUND_NEW
    before = np.int64(0) if first else np.int64(regs_bitmaps[index])
    regs_bitmaps[index] = before | worker_mask
    return first, (before & worker_mask) == 0


@njit(cache=True, inline="always")
def worker_count(regs_counts, index, first, fresh, members, num_workers):
    """WorkerCount: contributions the round still misses. Returns (complete, late)."""
    count = np.int64(regs_counts[index])
    late = False
    if fresh:
        if first:
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
    return count == 0 and not late, late


@njit(cache=True, inline="always")
def exponent_max(b, regs_exps, index, op):
    """ExponentMax: write / signed max / read; the packet leaves with the stored maximum."""
    exponent = np.int8(b[EXPONENT])
    if op == OP_WRITE or (op == OP_MERGE and exponent > regs_exps[index]):
        regs_exps[index] = exponent
    b[EXPONENT] = np.uint8(regs_exps[index])


@njit(cache=True, inline="always")
def _cells(b):
    """Cells of the packet's slot (its width passed WorkerLookup, so it is the job's)."""
    return WIDE_CELLS if b[WIDTH] == WIDE else 1


@njit(cache=True, inline="always")
def value_sum(b, regs_values, index, op):
    """ValueSum: overwrite, add modulo 2**32, or read; the packet leaves with the stored sums. A wide packet's
    chunk c is cell ``slot + c``'s row, pool index ``index + POOLS * c``."""
    for c in range(_cells(b)):
        row = regs_values[index + POOLS * c]
        for i in range(K):
            o = VALUES + 4 * (c * K + i)
            if op == OP_WRITE:
                row[i] = np.int32(np.uint32(_u32(b, o)))
            elif op == OP_MERGE:
                row[i] = np.int32(np.uint32((np.int64(row[i]) + _u32(b, o)) & 0xFFFFFFFF))
            _put32(b, o, np.int64(np.uint32(row[i])))


@njit(cache=True, inline="always")
def result_delivery(b, frame, ingress, to_group):
    """ResultDelivery: a RESULT from the aggregator address, to the group or back to the sender.

    Returns egress_spec (the ingress port for the sender; unused for the group)."""
    _copy(b, 6, frame, 0, 6)
    _copy(b, IP + 12, frame, IP + 16, 4)
    _put16(b, UDP, NETAGG_PORT)
    b[IP + 8] = RESULT_TTL
    _put16(b, UDP + 6, 0)
    b[FLAGS] |= FLAG_RESULT
    if to_group:
        return np.int64(0)
    _copy(b, 0, frame, 6, 6)
    _copy(b, IP + 16, frame, IP + 12, 4)
    _copy(b, UDP + 2, frame, UDP, 2)
    return np.int64(ingress)


@njit(cache=True, inline="always")
def _down_key(ingress, src, job):
    return (np.int64(job) << 48) | (np.int64(ingress) << 32) | np.int64(src)


@njit(cache=True, inline="always")
def down_link(b, ingress, dn_keys, dn_vals):
    """DownLink: the local job a parent's result (a RESULT from the parent's address on the up port) is for.

    Returns (down, local job)."""
    key = _down_key(ingress, _u32(b, IP + 12), _u16(b, JOB))
    mask = dn_keys.shape[0] - 1
    h = _slot_of(key, mask)
    while dn_keys[h, 1] != -1:
        if dn_keys[h, 0] == key and dn_keys[h, 1] == ingress:
            return True, dn_vals[h]
        h = (h + 1) & mask
    return False, np.int64(0)


@njit(cache=True, inline="always")
def level_state(regs_levels, index, first, goes_up):
    """LevelState for a contribution: a new round opens; completing on a switch with an up link makes it UP
    unless already FINAL. Returns the level the packet found (netagg.slots.SlotRegisters.level_state)."""
    level = LEVEL_OPEN if first else np.int64(regs_levels[index])
    if goes_up and level != LEVEL_FINAL:
        regs_levels[index] = LEVEL_UP
    else:
        regs_levels[index] = level
    return level


@njit(cache=True, inline="always")
def up_delivery(b, frame, up, fresh):
    """UpDelivery: the partial as a contribution to the parent (``up``: port, parent job, rank there, parent
    MAC and address), from the tree port. Returns egress_spec (the up port)."""
    _copy(b, 6, frame, 0, 6)
    mac = up[3]
    for i in range(6):
        b[i] = (mac >> (8 * (5 - i))) & 0xFF
    _copy(b, IP + 12, frame, IP + 16, 4)
    _put32(b, IP + 16, up[4])
    b[IP + 8] = RESULT_TTL
    _put16(b, UDP, TREE_PORT)
    _put16(b, UDP + 2, NETAGG_PORT)
    _put16(b, UDP + 6, 0)
    _put16(b, JOB, up[1])
    b[RANK] = up[2] & 0xFF
    _put32(b, MEMBERS, 0)
    b[FLAGS] = (0 if fresh else FLAG_RETRANSMIT) | (b[FLAGS] & ROUND_FLAGS)  # RoundFlags set them
    return up[0]


@njit(cache=True, inline="always")
def _down(b, frame, length, ingress, job_valid, job_params, w_keys, w_vals, counters, regs):
    """NetaggIngress.apply for a parent's result (its job id already the local job's): WorkerLookup without a
    sender, SlotOwner and RoundCheck reading only, LevelState; stored and sent to the group while the round is
    UP, else a duplicate.

    Returns (egress_spec, to_group, mgid)."""
    regs_owner, regs_rounds, regs_exps, regs_values, regs_levels = regs[0], regs[1], regs[5], regs[6], regs[7]
    regs_flags = regs[9]
    job = _u16(b, JOB)
    drop, _, slot_index, mgid, generation, _ = worker_lookup(b, ingress, job_valid, job_params, w_keys, w_vals, True)
    if drop != D_NONE:
        if drop != D_UNKNOWN_JOB:
            _bump(counters[P_REJECTS], counters[B_REJECTS], job, length)
        _bump(counters[P_DROPS], counters[B_DROPS], drop, length)
        return DROP_PORT, False, mgid
    if slot_index + _cells(b) > regs_owner.shape[0]:  # the controller never installs such a range
        return DROP_PORT, False, mgid
    pool = np.int64(b[POOL])
    index = slot_index * POOLS + pool
    if (np.int64(regs_owner[slot_index]) != generation
            or np.int64(regs_rounds[pool, slot_index]) != _u16(b, ROUND)
            or regs_levels[index] != LEVEL_UP):
        _bump(counters[P_DUPS], counters[B_DUPS], job, length)
        return DROP_PORT, False, mgid
    regs_levels[index] = LEVEL_FINAL
    _bump(counters[P_RESULTS], counters[B_RESULTS], job, length)
    round_flags(b, regs_flags, index, OP_WRITE, False)
    exponent_max(b, regs_exps, index, OP_WRITE)
    value_sum(b, regs_values, index, OP_WRITE)
    return result_delivery(b, frame, ingress, True), True, mgid


@njit(cache=True, inline="always")
def _aggregate(b, frame, length, ingress, job_valid, job_params, w_keys, w_vals, up_valid, up_params, counters,
               regs):
    """NetaggIngress.apply for a contribution: WorkerLookup, the slot registers, LevelState, the job counters,
    then ResultDelivery or (a job with an up link) UpDelivery.

    Returns (egress_spec, to_group, mgid); egress_spec DROP_PORT: dropped (mark_to_drop)."""
    regs_owner, regs_rounds, regs_members, regs_bitmaps, regs_counts, regs_exps, regs_values, regs_levels = regs[:8]
    regs_exchanges, regs_flags = regs[8], regs[9]
    job = _u16(b, JOB)
    drop, num_workers, slot_index, mgid, generation, worker_mask = worker_lookup(
        b, ingress, job_valid, job_params, w_keys, w_vals, False)
    round_state = ROUND_SAME
    index = np.int64(0)
    members = _u32(b, MEMBERS)
    if drop == D_NONE:
        if slot_index + _cells(b) > regs_owner.shape[0]:  # the controller never installs such a range
            return DROP_PORT, False, mgid
        pool = np.int64(b[POOL])
        index = slot_index * POOLS + pool
        stale = slot_owner(regs_owner, slot_index, generation)
        round_state = round_check(regs_rounds, slot_index, pool, _u16(b, ROUND), stale)
        if round_state != ROUND_OLD:
            drop = member_check(regs_members, index, round_state, members)
    mismatch = False
    if drop == D_NONE and round_state != ROUND_OLD:
        mismatch = exchange_check(regs_exchanges, index, round_state, _u32(b, EXCHANGE))
    if drop != D_NONE:
        if drop != D_UNKNOWN_JOB:
            _bump(counters[P_REJECTS], counters[B_REJECTS], job, length)
        _bump(counters[P_DROPS], counters[B_DROPS], drop, length)
        return DROP_PORT, False, mgid
    if round_state == ROUND_OLD:  # a copy of a superseded round
        _bump(counters[P_DUPS], counters[B_DUPS], job, length)
        return DROP_PORT, False, mgid
    first, fresh = bitmap_check(regs_bitmaps, index, round_state, worker_mask)
    complete, late = worker_count(regs_counts, index, first, fresh, members, num_workers)
    has_up = up_valid[job]
    level = level_state(regs_levels, index, first, has_up and complete and not late)
    op = OP_NONE
    to_group = False
    to_up = False
    mismatch = mismatch and fresh and not late
    if fresh and not late:
        if mismatch:  # another collective's: not added, counted as refused, but it completes the round if last
            _bump(counters[P_REJECTS], counters[B_REJECTS], job, length)
            _bump(counters[P_DROPS], counters[B_DROPS], D_EXCHANGE, length)
            op = OP_READ if complete else OP_NONE
        else:
            _bump(counters[P_CONTRIB], counters[B_CONTRIB], job, length)
            op = OP_WRITE if first else OP_MERGE
        if complete:
            if has_up:
                to_up = True
            else:
                to_group = True
                _bump(counters[P_RESULTS], counters[B_RESULTS], job, length)
    elif not fresh and complete:
        op = OP_READ
        _bump(counters[P_RETX], counters[B_RETX], job, length)
        to_up = has_up and level != LEVEL_FINAL
    else:
        _bump(counters[P_DUPS], counters[B_DUPS], job, length)
    round_flags(b, regs_flags, index, op, mismatch)
    if op != OP_NONE:
        exponent_max(b, regs_exps, index, op)
        value_sum(b, regs_values, index, op)
    if to_up:
        return up_delivery(b, frame, up_params[job], fresh), False, mgid
    if not (complete and not late):  # absorbed into the slot, or a duplicate
        return DROP_PORT, False, mgid
    return result_delivery(b, frame, ingress, to_group), to_group, mgid


@njit(cache=True, inline="always")
def _lengths_ok(b):
    """The IPv4 and UDP lengths of the packet's width code (a defined one), and no fragment."""
    if _u16(b, IP + 6) & 0x3FFF:
        return False
    if b[WIDTH] == 0:
        return _u16(b, IP + 2) == IPV4_TOTAL_LENGTH and _u16(b, UDP + 4) == UDP_LENGTH
    if b[WIDTH] == WIDE:
        return _u16(b, IP + 2) == WIDE_IPV4_TOTAL_LENGTH and _u16(b, UDP + 4) == WIDE_UDP_LENGTH
    return False


@njit(cache=True, inline="always")
def netagg_ingress(b, frame, length, ingress, tables, counters, regs):
    """NetaggIngress.apply. Returns (egress_spec, to_group, mgid); egress_spec DROP_PORT: dropped (mark_to_drop)."""
    job_valid, job_params, w_keys, w_vals, src_keys, src_vals, route_vm, route_out = tables[:8]
    up_valid, up_params, dn_keys, dn_vals = tables[12:]
    error, ipv4, udp, netagg = netagg_parser(b, length)
    drop = D_NONE
    down = False
    down_job = np.int64(0)
    if error:
        drop = D_MALFORMED
    elif not ipv4:
        drop = D_NOT_IPV4
    else:
        if netagg and b[FLAGS] & FLAG_RESULT:  # a parent's result on the up port is not a forgery
            down, down_job = down_link(b, ingress, dn_keys, dn_vals)
        if not down:
            drop = source_guard(b, udp, ingress, src_keys, src_vals)
    egress_spec = DROP_PORT
    if drop != D_NONE:
        pass  # counted below
    elif not netagg:
        drop, egress_spec = ipv4_forward(b, frame, route_vm, route_out)
    elif b[NA_VERSION] != VERSION:
        drop = D_BAD_VERSION
    elif not _lengths_ok(b):
        drop = D_MALFORMED
    elif b[FLAGS] & FLAG_RESULT and not down:
        drop = D_RESULT_FROM_HOST
    elif down:
        _put16(b, JOB, down_job)  # from here on a packet of the local job
        return _down(b, frame, length, ingress, job_valid, job_params, w_keys, w_vals, counters, regs)
    else:
        return _aggregate(b, frame, length, ingress, job_valid, job_params, w_keys, w_vals, up_valid, up_params,
                          counters, regs)
    if drop != D_NONE:
        _bump(counters[P_DROPS], counters[B_DROPS], drop, length)
        return DROP_PORT, False, np.int64(0)
    return egress_spec, False, np.int64(0)


@njit(cache=True, inline="always")
def result_rewrite(b, mgid, rid, rep_keys, rep_vals):
    """ResultRewrite: the replica's receiver from replicas[(mgid, rid)]. Returns False on a miss (no_replica)."""
    key = (mgid << 16) | rid
    mask = rep_keys.shape[0] - 1
    h = _slot_of(key, mask)
    while rep_keys[h] != -1:
        if rep_keys[h] == key:
            mac = rep_vals[h, 0]
            for i in range(6):
                b[i] = (mac >> (8 * (5 - i))) & 0xFF
            _put32(b, IP + 16, rep_vals[h, 1])
            _put16(b, UDP + 2, rep_vals[h, 2])
            return True
        h = (h + 1) & mask
    return False


@njit(cache=True, inline="always")
def netagg_egress(b, mgid, rid, rep_keys, rep_vals, egress_drops, egress_drop_bytes):
    """NetaggEgress.apply for a copy of a group packet. Returns False when the copy is dropped (and counted in
    ``egress_drop_reasons``, whose two arrays it takes)."""
    if result_rewrite(b, mgid, rid, rep_keys, rep_vals):
        return True
    _bump(egress_drops, egress_drop_bytes, D_NO_REPLICA, 0)
    return False


@njit(cache=True, inline="always")
def netagg_compute_checksum(b):
    """NetaggComputeChecksum: the IPv4 checksum of a header without options."""
    if (b[IP] & 0x0F) == 5:
        _ipv4_checksum(b)


@njit(cache=True, nogil=True)
def run_batch(in_buf, in_len, in_port, count, work, out_buf, out_len, out_port, max_out, tables, counters, regs):
    """Frames ``0..count-1`` in order, each through V1Switch(NetaggParser, NetaggIngress, the replication
    engine, NetaggEgress, NetaggComputeChecksum, the deparser); returns (frames consumed, frames emitted).

    ``tables``: ``fastpath.CompiledTables.arrays()``; ``counters``: the (packets, bytes) arrays of each of
    ``fastpath.COUNTERS``; ``regs``: ``fastpath.FastRegisters.arrays()``. Stops early when the next frame could
    overflow ``out_buf`` (``max_out``: the most frames one input can emit); the caller sends what was emitted
    and calls again.

    The replication loop stays here rather than in an inlined function of its own: ``counters`` handed down
    one more inlined level cost a third of the throughput (numba copies the tuple of arrays at each use)."""
    n = 0
    cap = out_buf.shape[0]
    rep_keys, rep_vals, grp_off, grp_items = tables[8:12]
    for i in range(count):
        if n + max_out > cap:
            return i, n
        frame = in_buf[i]
        length = in_len[i]
        _copy(work, 0, frame, 0, length)  # the packet being processed; ``frame`` stays as received
        egress_spec, to_group, mgid = netagg_ingress(work, frame, length, in_port[i], tables, counters, regs)
        if to_group:  # the replication engine: a copy per replica of group mgid
            if mgid >= grp_off.shape[0] - 1:
                continue
            for g in range(grp_off[mgid], grp_off[mgid + 1]):
                if netagg_egress(work, mgid, grp_items[g, 1], rep_keys, rep_vals, counters[P_EGRESS_DROPS],
                                 counters[B_EGRESS_DROPS]):
                    netagg_compute_checksum(work)
                    n = _emit(work, length, grp_items[g, 0], out_buf, out_len, out_port, n)
        elif egress_spec != DROP_PORT:
            netagg_compute_checksum(work)
            n = _emit(work, length, egress_spec, out_buf, out_len, out_port, n)
    return count, n


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
