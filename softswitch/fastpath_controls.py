"""One numba function per control of ``p4src/v1model`` (named after its instance in ``netagg.p4``), each inlined
(``inline="always"``) into :func:`~netagg.softswitch.fastpath_kernels.run_batch`; see that module's docs."""

from __future__ import annotations

import numpy as np
from numba import njit

from netagg import wire
from netagg.softswitch.fastpath_defs import (
    D_BAD_POOL,
    D_MEMBERS,
    D_NO_ROUTE,
    D_NONE,
    D_NOT_MEMBER,
    D_RANK,
    D_SLOT_RANGE,
    D_SPOOFED,
    D_TTL,
    D_UNKNOWN_JOB,
    D_UNKNOWN_WORKER,
    D_WRONG_WIDTH,
    ECN_CE,
    ECN_MASK,
    EXPONENT,
    FLAG_OUT_OF_STEP,
    FLAG_RESULT,
    FLAG_RETRANSMIT,
    FLAGS,
    FRAME_BYTES,
    IP,
    JOB,
    LEVEL_FINAL,
    LEVEL_OPEN,
    LEVEL_UP,
    MEMBERS,
    NETAGG_PORT,
    NOT_STORED_FLAGS,
    OP_MERGE,
    OP_WRITE,
    POOL,
    POOLS,
    RANK,
    RESULT_TTL,
    ROUND_CE,
    ROUND_FLAGS,
    ROUND_NEW,
    ROUND_OLD,
    ROUND_SAME,
    SLOT,
    SRC_SWITCH_ONLY,
    STORED_FLAGS,
    TREE_PORT,
    UDP,
    VALUES,
    WIDE,
    WIDE_CELLS,
    WIDE_FRAME_BYTES,
    WIDTH,
    K,
    _copy,
    _put16,
    _put32,
    _slot_of,
    _u16,
    _u32,
)

wire.check_compiled_layout(__name__, "v4 K=64 widths=64,256 version:8,flags:8,job_id:16,slot:16,pool:8,rank:8,"
                                     "exponent:8s,width:8,round:16,seq:32,members:32,exchange:32")

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
    instead), and ROUND_CE when it arrived with ECN CE; the packet leaves with the round's stored flags (its
    ``FLAG_CLOSE`` too) in place of its own (``leave_with_round``)."""
    mark = ROUND_CE if (b[IP + 1] & ECN_MASK) == ECN_CE else 0
    if mismatch:
        regs_flags[index] |= FLAG_OUT_OF_STEP | mark
    elif op == OP_WRITE:
        regs_flags[index] = (b[FLAGS] & ROUND_FLAGS) | mark
    elif op == OP_MERGE:
        regs_flags[index] |= (b[FLAGS] & ROUND_FLAGS) | mark
    leave_with_round(b, regs_flags[index])


@njit(cache=True, inline="always")
def leave_with_round(b, stored):
    """The packet's flags take the round's ``STORED_FLAGS``; a round with ``ROUND_CE`` marks it ECN CE."""
    b[FLAGS] = (b[FLAGS] & NOT_STORED_FLAGS) | (stored & STORED_FLAGS)
    if stored & ROUND_CE:
        b[IP + 1] |= ECN_CE


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
