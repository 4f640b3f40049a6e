"""The netagg program compiled with numba: one call runs a whole batch of frames through it.

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

from netagg import wire
from netagg.softswitch.fastpath_controls import (
    _cells,
    bitmap_check,
    down_link,
    exchange_check,
    exponent_max,
    ipv4_forward,
    leave_with_round,
    level_state,
    member_check,
    netagg_parser,
    result_delivery,
    round_check,
    round_flags,
    slot_owner,
    source_guard,
    up_delivery,
    value_sum,
    worker_count,
    worker_lookup,
)
from netagg.softswitch.fastpath_defs import (
    B_CONTRIB,
    B_DROPS,
    B_DUPS,
    B_EGRESS_DROPS,
    B_REJECTS,
    B_RESULTS,
    B_RETX,
    D_BAD_VERSION,
    D_CLOSE_REFUSED,
    D_EXCHANGE,
    D_LATE_CLOSED,
    D_MALFORMED,
    D_NO_REPLICA,
    D_NONE,
    D_NOT_IPV4,
    D_RESULT_FROM_HOST,
    D_UNKNOWN_JOB,
    DROP_PORT,
    EXCHANGE,
    FLAG_CLOSE,
    FLAG_OUT_OF_STEP,
    FLAG_RESULT,
    FLAGS,
    IP,
    IPV4_TOTAL_LENGTH,
    JOB,
    LEVEL_FINAL,
    LEVEL_UP,
    MEMBERS,
    NA_VERSION,
    OP_MERGE,
    OP_NONE,
    OP_READ,
    OP_WRITE,
    P_CONTRIB,
    P_DROPS,
    P_DUPS,
    P_EGRESS_DROPS,
    P_REJECTS,
    P_RESULTS,
    P_RETX,
    POOL,
    POOLS,
    ROUND,
    ROUND_OLD,
    ROUND_SAME,
    UDP,
    UDP_LENGTH,
    VERSION,
    WIDE,
    WIDE_IPV4_TOTAL_LENGTH,
    WIDE_UDP_LENGTH,
    WIDTH,
    _bump,
    _copy,
    _emit,
    _ipv4_checksum,
    _put16,
    _put32,
    _slot_of,
    _u16,
    _u32,
)

wire.check_compiled_layout(__name__, "v4 K=64 widths=64,256 version:8,flags:8,job_id:16,slot:16,pool:8,rank:8,"
                                     "exponent:8s,width:8,round:16,seq:32,members:32,exchange:32")

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
    if drop == D_NONE and b[FLAGS] & FLAG_CLOSE:  # a closed round's bitmap names the parent's ranks
        drop = D_CLOSE_REFUSED
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
    close = (b[FLAGS] & FLAG_CLOSE) != 0
    has_up = up_valid[job]
    if drop == D_NONE and close and has_up:  # deadline rounds are one switch's: refused before any register
        drop = D_CLOSE_REFUSED
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
    if round_state == ROUND_SAME and regs_flags[index] & FLAG_CLOSE:  # CloseCheck: closed at a deadline
        return _closed_answer(b, frame, length, ingress, job, index, worker_mask, mismatch, counters, regs), \
            False, mgid
    first, fresh = bitmap_check(regs_bitmaps, index, round_state, worker_mask)
    complete, late = worker_count(regs_counts, index, first, fresh, members, num_workers)
    closes = close and not complete and not late
    if closes:  # the close request completes the round with the contributions it has
        regs_counts[index] = 0
        complete = True
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
    elif closes:  # a resend's close request: the round's result, to the group
        op = OP_READ
        to_group = True
        _bump(counters[P_RESULTS], counters[B_RESULTS], job, length)
    elif not fresh and complete:
        op = OP_READ
        _bump(counters[P_RETX], counters[B_RETX], job, length)
        to_up = has_up and level != LEVEL_FINAL
    else:
        _bump(counters[P_DUPS], counters[B_DUPS], job, length)
    round_flags(b, regs_flags, index, op, mismatch)
    if closes:  # the result says the round was closed, and who is in its sum
        regs_flags[index] |= FLAG_CLOSE
        b[FLAGS] |= FLAG_CLOSE
        _put32(b, MEMBERS, np.int64(regs_bitmaps[index]))
    if op != OP_NONE:
        exponent_max(b, regs_exps, index, op)
        value_sum(b, regs_values, index, op)
    if to_up:
        return up_delivery(b, frame, up_params[job], fresh), False, mgid
    if not (complete and not late):  # absorbed into the slot, or a duplicate
        return DROP_PORT, False, mgid
    return result_delivery(b, frame, ingress, to_group), to_group, mgid


@njit(cache=True, inline="always")
def _closed_answer(b, frame, length, ingress, job, index, worker_mask, mismatch, counters, regs):
    """A packet for a round closed at a deadline (CloseCheck): no register changes; the stored result (its flags,
    the contributors' bitmap in ``members``) back to the sender alone. A new contribution is late: not added,
    counted as LATE_FOR_CLOSED_ROUND; one of another collective also learns OUT_OF_STEP.

    Returns egress_spec (the ingress port)."""
    regs_bitmaps, regs_exps, regs_values, regs_flags = regs[3], regs[5], regs[6], regs[9]
    bitmap = np.int64(regs_bitmaps[index])
    fresh = (bitmap & worker_mask) == 0
    _bump(counters[P_RETX], counters[B_RETX], job, length)
    if fresh:
        _bump(counters[P_DROPS], counters[B_DROPS], D_LATE_CLOSED, length)
    leave_with_round(b, regs_flags[index])
    if mismatch and fresh:
        b[FLAGS] |= FLAG_OUT_OF_STEP
    _put32(b, MEMBERS, bitmap)
    exponent_max(b, regs_exps, index, OP_READ)
    value_sum(b, regs_values, index, OP_READ)
    return result_delivery(b, frame, ingress, False)


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
