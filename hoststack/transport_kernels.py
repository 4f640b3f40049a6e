"""Compiled per-batch kernels of the transport (used when numba is installed).

:func:`accept_results` checks and applies a batch of received datagrams, :func:`fill_packets`
builds a batch of outgoing packets in the transport's preallocated rows, and
:func:`rto_samples` feeds round trips to the RFC 6298 estimator. Each does in one compiled
pass exactly what its numpy reference in :mod:`netagg.hoststack.transport_reference` does
(``tests/test_hoststack_fastpath.py`` compares them on random and adversarial batches);
without numba the references run and only speed changes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from netagg import layout, wire
from netagg.hoststack.codec_kernels import quantize_row
from netagg.hoststack.packets import PROBE_SEQ_BIT, SEQ_MASK

wire.check_compiled_layout(__name__, "v4 K=64 widths=64,256 version:8,flags:8,job_id:16,slot:16,pool:8,rank:8,"
                                     "exponent:8s,width:8,round:16,seq:32,members:32,exchange:32")

_HEADER = wire.HEADER_BYTES
_VERSION = wire.VERSION
_RESULT = wire.FLAG_RESULT
_OUT_OF_STEP = wire.FLAG_OUT_OF_STEP
_CLOSE = wire.FLAG_CLOSE
_KEPT_FLAGS = wire.NONFINITE_FLAGS | wire.FLAG_CLOSE
# The header's fields (netagg.layout, from wire.HEADER_FIELDS).
_VERSION_AT, _FLAGS_AT, _JOB_AT, _SLOT_AT, _POOL_AT = (layout.VERSION_AT, layout.FLAGS_AT, layout.JOB_AT,
                                                       layout.SLOT_AT, layout.POOL_AT)
_EXPONENT_AT, _ROUND_AT, _SEQ_AT, _EXCHANGE_AT = layout.EXPONENT_AT, layout.ROUND_AT, layout.SEQ_AT, layout.EXCHANGE_AT
_MEMBERS_AT = layout.MEMBERS_AT
_PROBE = np.int64(PROBE_SEQ_BIT)
_MASK = np.int64(SEQ_MASK)


@njit(cache=True, nogil=True, inline="always")
def _be(row: np.ndarray, start: int, width: int) -> np.int64:
    value = np.int64(0)
    for i in range(width):
        value = (value << np.int64(8)) | np.int64(row[start + i])
    return value


@njit(cache=True, nogil=True)
def accept_results(buf, lengths, names, count, allowed, job_id, slot_base, seq0, window, num_blocks, expect, retries,
                   sent_at, next_pool, now, sums, global_exp, exchange, closable, result_flags, result_members,
                   alarm, acc_slots, following, acc_closed, superseded, rtts):  # pragma: no cover
    """See ``transport_reference.accept_results`` (the reference): same arguments, same effects and result."""
    used = expect.shape[0]
    payload = sums.shape[1]
    foreign = malformed = stale = done = n_acc = n_rtt = 0
    for i in range(count):
        name = names[i]
        source = (_be(name, 4, 4) << np.int64(16)) | _be(name, 2, 2)
        known = False
        for peer in allowed:
            if np.int64(peer) == source:
                known = True
        if not known:
            foreign += 1
            continue
        row = buf[i]
        if lengths[i] != _HEADER + payload or row[_VERSION_AT] != _VERSION or (row[_FLAGS_AT] & _RESULT) == 0 \
                or _be(row, _JOB_AT, 2) != job_id:
            malformed += 1
            continue
        slot = _be(row, _SLOT_AT, 2) - slot_base
        seq = _be(row, _SEQ_AT, 4)
        key = (_be(row, _ROUND_AT, 2) << np.int64(33)) | (np.int64(row[_POOL_AT]) << np.int64(32)) | seq
        if slot < 0 or slot >= used:
            stale += 1
            continue
        outstanding = expect[slot]
        refused = (row[_FLAGS_AT] & _OUT_OF_STEP) != 0 or _be(row, _EXCHANGE_AT, 4) != exchange
        if outstanding != -1 and (outstanding >> np.int64(32)) == (key >> np.int64(32)) and (
                refused or ((row[_FLAGS_AT] & _CLOSE) != 0 and closable == 0)):
            if alarm[0] == 0:
                alarm[0] = 1 if refused else 2
                alarm[1] = _be(row, _EXCHANGE_AT, 4)
                alarm[2] = slot
            stale += 1
            continue
        if outstanding != key:
            if closable != 0 and outstanding != -1:
                ahead = (_be(row, _ROUND_AT, 2) - (outstanding >> np.int64(33))) & 0xFFFF
                if 2 <= ahead < 0x8000:  # a round two or more ahead completed: the outstanding one is gone
                    superseded[slot] = 1
            stale += 1
            continue
        expect[slot] = -1
        next_pool[slot] ^= np.uint8(1)
        if retries[slot] == 0:
            if (row[_FLAGS_AT] & _CLOSE) == 0:  # a closed round's wait measured its deadline, not the path
                rtts[n_rtt] = now - sent_at[slot]
                n_rtt += 1
        else:
            retries[slot] = 0
        if seq & _PROBE:
            nxt = slot
        else:
            block = (seq - seq0) & _MASK
            out = sums[block]  # loops over views from 0 vectorize; offsets on both sides do not
            values = row[_HEADER:_HEADER + payload]
            for j in range(payload):
                out[j] = values[j]
            result_flags[block] = row[_FLAGS_AT] & _KEPT_FLAGS
            result_members[block] = _be(row, _MEMBERS_AT, 4)
            done += 1
            nxt = block + window
        if nxt < num_blocks:
            exponent = np.int32(row[_EXPONENT_AT])
            global_exp[nxt] = exponent - 256 if exponent >= 128 else exponent
        acc_slots[n_acc] = slot
        following[n_acc] = nxt
        acc_closed[n_acc] = _be(row, _MEMBERS_AT, 4) if (row[_FLAGS_AT] & _CLOSE) != 0 else np.int64(-1)
        n_acc += 1
    return n_acc, n_rtt, foreign, malformed, stale, done


@njit(cache=True, nogil=True)
def fill_packets(slots, block_ids, blocks, local_exp, global_exp, ahead, seq0, probe0, window, enc_a, enc_b,
                 raw, words, next_pool, rounds, expect, sent_at, now, keys):  # pragma: no cover
    """See ``transport_reference.fill_packets`` (the reference): same arguments, same effects and result."""
    n = slots.shape[0]
    for i in range(n):
        b = block_ids[i]
        if b >= 0 and global_exp[b] < local_exp[b]:
            return -1
    for i in range(n):
        s = slots[i]
        b = block_ids[i]
        row, values = raw[s], words[s]
        if b < 0:
            seq = _PROBE | ((probe0 + s) & _MASK)
            exponent = ahead[s]
            for j in range(blocks.shape[1]):
                values[_HEADER // 4 + j] = np.uint32(0)
        else:
            seq = (b + seq0) & _MASK
            exponent = ahead[b + window]
            g = np.int32(global_exp[b]) + 128
            quantize_row(blocks[b], enc_a[g], enc_b[g], values, _HEADER // 4)
        pool = next_pool[s]
        round_ = np.uint16(rounds[s] + np.uint16(1))
        rounds[s] = round_
        row[_FLAGS_AT] = 0  # clears FLAG_RETRANSMIT left by an earlier resend from this row
        row[_POOL_AT] = pool
        row[_EXPONENT_AT] = np.uint8(np.int32(exponent) & 0xFF)
        row[_ROUND_AT] = np.uint8(round_ >> np.uint16(8))
        row[_ROUND_AT + 1] = np.uint8(round_ & np.uint16(0xFF))
        for j in range(4):
            row[_SEQ_AT + j] = np.uint8((seq >> np.int64(24 - 8 * j)) & np.int64(0xFF))
        key = (np.int64(round_) << np.int64(33)) | (np.int64(pool) << np.int64(32)) | seq
        keys[i] = key
        expect[s] = key
        sent_at[s] = now
    return 0


@njit(cache=True, nogil=True)
def rto_samples(srtt, rttvar, granularity, minimum, maximum, rtts):  # pragma: no cover
    """``RtoEstimator.sample`` for each of ``rtts`` in order (``srtt`` NaN: no sample yet); returns
    (srtt, rttvar, rto), or NaN for rto when ``rtts`` is empty."""
    rto = np.nan
    for rtt in rtts:
        if np.isnan(srtt):
            srtt, rttvar = rtt, rtt / 2
        else:
            rtt = min(rtt, 2 * srtt)
            rttvar = 0.75 * rttvar + 0.25 * abs(srtt - rtt)
            srtt = 0.875 * srtt + 0.125 * rtt
        rto = min(max(srtt + max(granularity, 4 * rttvar), minimum), maximum)
    return srtt, rttvar, rto
