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

from netagg import wire
from netagg.hoststack.codec_kernels import quantize_row
from netagg.hoststack.packets import PROBE_SEQ_BIT, SEQ_MASK

wire.check_compiled_layout(__name__, version=3, header_bytes=24, k=64)  # see check_compiled_layout

_K = wire.K
_HEADER = wire.HEADER_BYTES
_PAYLOAD = wire.PAYLOAD_BYTES
_NETAGG = wire.NETAGG_BYTES
_VERSION = wire.VERSION
_RESULT = wire.FLAG_RESULT
_OUT_OF_STEP = wire.FLAG_OUT_OF_STEP
_NONFINITE = wire.NONFINITE_FLAGS
_EXCHANGE_AT = wire.HEADER_BYTES - 4
assert [f.name for f in wire.HEADER_FIELDS][-1] == "exchange"
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
                   sent_at, next_pool, now, sums, global_exp, exchange, result_flags, alarm, acc_slots, following,
                   rtts):  # pragma: no cover
    """See ``transport_reference.accept_results`` (the reference): same arguments, same effects and result."""
    used = expect.shape[0]
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
        if lengths[i] != _NETAGG or row[0] != _VERSION or (row[1] & _RESULT) == 0 or _be(row, 2, 2) != job_id:
            malformed += 1
            continue
        slot = _be(row, 4, 2) - slot_base
        seq = _be(row, 12, 4)
        key = (_be(row, 10, 2) << np.int64(33)) | (np.int64(row[6]) << np.int64(32)) | seq
        if slot < 0 or slot >= used:
            stale += 1
            continue
        outstanding = expect[slot]
        if outstanding != -1 and (outstanding >> np.int64(32)) == (key >> np.int64(32)) and (
                (row[1] & _OUT_OF_STEP) != 0 or _be(row, _EXCHANGE_AT, 4) != exchange):
            if alarm[0] == 0:
                alarm[0] = 1
                alarm[1] = _be(row, _EXCHANGE_AT, 4)
                alarm[2] = slot
            stale += 1
            continue
        if outstanding != key:
            stale += 1
            continue
        expect[slot] = -1
        next_pool[slot] ^= np.uint8(1)
        if retries[slot] == 0:
            rtts[n_rtt] = now - sent_at[slot]
            n_rtt += 1
        else:
            retries[slot] = 0
        if seq & _PROBE:
            nxt = slot
        else:
            block = (seq - seq0) & _MASK
            start = block * _PAYLOAD
            out = sums[start:start + _PAYLOAD]  # loops over views from 0 vectorize; offsets on both sides do not
            values = row[_HEADER:_HEADER + _PAYLOAD]
            for j in range(_PAYLOAD):
                out[j] = values[j]
            result_flags[block] = row[1] & _NONFINITE
            done += 1
            nxt = block + window
        if nxt < num_blocks:
            exponent = np.int32(row[8])
            global_exp[nxt] = exponent - 256 if exponent >= 128 else exponent
        acc_slots[n_acc] = slot
        following[n_acc] = nxt
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
            for j in range(_K):
                values[_HEADER // 4 + j] = np.uint32(0)
        else:
            seq = (b + seq0) & _MASK
            exponent = ahead[b + window]
            g = np.int32(global_exp[b]) + 128
            quantize_row(blocks[b], enc_a[g], enc_b[g], values, _HEADER // 4)
        pool = next_pool[s]
        round_ = np.uint16(rounds[s] + np.uint16(1))
        rounds[s] = round_
        row[1] = 0  # clears FLAG_RETRANSMIT left by an earlier resend from this row
        row[6] = pool
        row[8] = np.uint8(np.int32(exponent) & 0xFF)
        row[10] = np.uint8(round_ >> np.uint16(8))
        row[11] = np.uint8(round_ & np.uint16(0xFF))
        for j in range(4):
            row[12 + j] = np.uint8((seq >> np.int64(24 - 8 * j)) & np.int64(0xFF))
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
