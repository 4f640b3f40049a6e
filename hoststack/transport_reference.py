"""The transport's per-batch steps in numpy: the readable reference of ``transport_kernels``.

:func:`accept_results` checks and applies a batch of received datagrams and :func:`fill_packets`
builds a batch of outgoing packets in the transport's preallocated rows
(:class:`~netagg.hoststack.transport.Exchange` calls one or the other implementation; the compiled
twins in :mod:`~netagg.hoststack.transport_kernels` have the same arguments, effects and results,
which ``tests/test_hoststack_fastpath.py`` checks on random and adversarial batches).
"""

from __future__ import annotations

import numpy as np

from netagg import wire
from netagg.hoststack import quantization as qz
from netagg.hoststack.packets import PROBE_SEQ_BIT, SEQ_MASK, headers, packet_dtype

_HEADER_BYTES = wire.HEADER_BYTES


def accept_results(buf: np.ndarray, lengths: np.ndarray, names: np.ndarray, count: int, allowed: np.ndarray,
                          job_id: int, slot_base: int, seq0: int, window: int, num_blocks: int, expect: np.ndarray,
                          retries: np.ndarray, sent_at: np.ndarray, next_pool: np.ndarray, now: float,
                          sums: np.ndarray, global_exp: np.ndarray, exchange: int, closable: int,
                          result_flags: np.ndarray, result_members: np.ndarray, alarm: np.ndarray,
                          acc_slots: np.ndarray, following: np.ndarray, acc_closed: np.ndarray,
                          superseded: np.ndarray,
                          rtts: np.ndarray) -> tuple[int, int, int, int, int, int]:
    """Check and apply ``count`` received datagrams (``buf[i, :lengths[i]]`` from sockaddr ``names[i]``).

    ``sums``: one row of bytes per block (``(num_blocks, 4k)``, k the job's width). Per datagram, in order: a
    sender not in ``allowed`` (IPv4 << 16 | port) is foreign; a size other than the width's
    (``wire.netagg_bytes(k)``), another version, no RESULT flag or another job is malformed; a
    slot (less ``slot_base``: the first of this transport's slots) outside ``expect`` or a
    (round << 33 | pool << 32 | seq) other than ``expect[slot]`` is
    stale (so is a second copy of a result in the batch). An accepted result clears
    ``expect[slot]``, flips ``next_pool[slot]``, yields a round trip ``now - sent_at[slot]``
    unless the slot was retransmitted (Karn; ``retries[slot]`` is reset) or the round was closed, copies a data
    block's values into its row of ``sums`` and writes the exponent into ``global_exp`` of
    the slot's next block, if any (for a probe: block ``slot``), its non-finite and CLOSE flags into
    ``result_flags[block]`` and its ``members`` into ``result_members[block]`` (a closed round: who is in
    the sum). A result for the (round, pool) a slot has outstanding whose flags say
    OUT_OF_STEP or whose ``exchange`` is not this worker's is stale too, whatever its seq, and the first
    one of them writes ``alarm`` = [1, its exchange, its slot] (docs/protocol.md, "Collectives out of
    step"); so is one that says CLOSE (a round closed at a deadline) when ``closable`` is 0: alarm
    [2, its exchange, its slot]. Writes the accepted slots and
    their next blocks into ``acc_slots``/``following``, for each a closed round's ``members`` (who is in its sum;
    -1: not closed) into ``acc_closed``, and the round trips into ``rtts``. With ``closable``, a result for a
    slot whose round is two or more ahead of the one it has outstanding sets ``superseded[slot]``: the others
    finished that round and the one after, and the switch no longer holds it. Returns
    (accepted, round trips, foreign, malformed, stale, data blocks done). The compiled
    ``transport_kernels.accept_results`` does the same in one pass.
    """
    name = names[:count].astype(np.int64)
    source = (name[:, 4] << 40) | (name[:, 5] << 32) | (name[:, 6] << 24) | (name[:, 7] << 16) \
        | (name[:, 2] << 8) | name[:, 3]
    known = np.isin(source, allowed)
    rows = buf[:count]
    hdr = headers(rows)
    payload = sums.shape[1]
    valid = known & (lengths[:count] == _HEADER_BYTES + payload) & (hdr["version"] == wire.VERSION) \
        & ((hdr["flags"] & wire.FLAG_RESULT) != 0) & (hdr["job_id"] == job_id)
    slot = hdr["slot"].astype(np.int64) - slot_base
    seq = hdr["seq"].astype(np.int64)
    key = (hdr["round"].astype(np.int64) << 33) | (hdr["pool"].astype(np.int64) << 32) | seq
    candidate = valid & (slot >= 0) & (slot < expect.shape[0])
    outstanding = np.full(count, -1, np.int64)
    outstanding[candidate] = expect[slot[candidate]]
    theirs = hdr["exchange"].astype(np.int64)
    refused = ((hdr["flags"] & wire.FLAG_OUT_OF_STEP) != 0) | (theirs != exchange)
    unwanted_close = ((hdr["flags"] & wire.FLAG_CLOSE) != 0) & (closable == 0)
    out_of_step = candidate & (outstanding != -1) & ((outstanding >> 32) == (key >> 32)) & (refused | unwanted_close)
    candidate &= ~out_of_step
    candidate[candidate] = outstanding[candidate] == key[candidate]
    matching = np.flatnonzero(candidate)
    accepted = np.sort(matching[np.unique(slot[matching], return_index=True)[1]])  # first copy per slot
    # As the one-pass kernel sees them: a row after the accepted result of its slot finds nothing outstanding.
    accepted_at = dict(zip(slot[accepted].tolist(), accepted.tolist(), strict=True))
    if out_of_step.any() and alarm[0] == 0:
        for row in np.flatnonzero(out_of_step).tolist():
            if accepted_at.get(int(slot[row]), count) > row:
                alarm[:] = (1 if refused[row] else 2, theirs[row], slot[row])
                break
    if closable:
        rounds_ahead = (hdr["round"].astype(np.int64) - (outstanding >> 33)) & 0xFFFF
        gone = (outstanding != -1) & ~out_of_step & (outstanding != key) & (rounds_ahead >= 2) \
            & (rounds_ahead < 0x8000)
        for row in np.flatnonzero(gone).tolist():
            if accepted_at.get(int(slot[row]), count) > row:
                superseded[slot[row]] = 1
    slots = slot[accepted]
    expect[slots] = -1
    next_pool[slots] ^= 1
    # Karn (no sample of a resent packet); nor of a closed round, whose wait measured its deadline, not the path.
    fresh = (retries[slots] == 0) & ((hdr["flags"][accepted] & wire.FLAG_CLOSE) == 0)
    n_rtt = int(fresh.sum())
    rtts[:n_rtt] = now - sent_at[slots[fresh]]
    retries[slots] = 0
    seq = seq[accepted]
    probe = (seq & PROBE_SEQ_BIT) != 0
    block = (seq - seq0) & SEQ_MASK
    data = ~probe
    sums[block[data]] = rows[accepted[data], _HEADER_BYTES:_HEADER_BYTES + payload]
    result_flags[block[data]] = hdr["flags"][accepted[data]] & (wire.NONFINITE_FLAGS | wire.FLAG_CLOSE)
    result_members[block[data]] = hdr["members"][accepted[data]]
    nxt = np.where(probe, slots, block + window)
    ready = nxt < num_blocks
    global_exp[nxt[ready]] = hdr["exponent"][accepted][ready]
    n_acc = accepted.shape[0]
    acc_slots[:n_acc] = slots
    following[:n_acc] = nxt
    acc_closed[:n_acc] = np.where((hdr["flags"][accepted] & wire.FLAG_CLOSE) != 0,
                                  hdr["members"][accepted].astype(np.int64), -1)
    n_valid = int(valid.sum())
    return n_acc, n_rtt, count - int(known.sum()), int(known.sum()) - n_valid, n_valid - n_acc, int(data.sum())


def fill_packets(slots: np.ndarray, block_ids: np.ndarray, blocks: np.ndarray, local_exp: np.ndarray,
                        global_exp: np.ndarray, ahead: np.ndarray, seq0: int, probe0: int, window: int,
                        enc_a: np.ndarray, enc_b: np.ndarray, raw: np.ndarray, words: np.ndarray,
                        next_pool: np.ndarray, rounds: np.ndarray, expect: np.ndarray, sent_at: np.ndarray,
                        now: float, keys: np.ndarray) -> int:
    """Build the packets of ``slots`` in their rows of ``raw`` (``packet_dtype(k)`` bytes, k = ``blocks.shape[1]``;
    ``words`` is its uint32 view).

    ``block_ids[i]`` is the data block slot ``slots[i]`` carries, or -1 for the slot's probe
    (zeros, ``seq = PROBE_SEQ_BIT | probe0 + slot``); a data block is quantized with its global
    exponent and gets ``seq = seq0 + block``; the exponent field is ``ahead`` of the block one
    window on (a probe: of block ``slot``). Each row gets the slot's pool, its next round
    (``rounds`` += 1) and flags 0; ``keys``, ``expect`` and ``sent_at`` (``now``) get what its
    result must echo. Returns -1, with nothing written, if a global exponent is below this
    worker's (a protocol violation), else 0. ``transport_kernels.fill_packets`` is the compiled twin.
    """
    probe = block_ids < 0
    data = np.flatnonzero(~probe)
    data_blocks = block_ids[data]
    g = global_exp[data_blocks]
    if (g < local_exp[data_blocks]).any():
        return -1
    packets = raw.view(packet_dtype(blocks.shape[1]))[:, 0]
    packets["values"][slots[probe]] = 0
    if data.size:
        packets["values"][slots[data]] = qz.quantize_scaled(blocks[data_blocks], g, enc_a, enc_b)
    seqs = np.where(probe, PROBE_SEQ_BIT | ((probe0 + slots) & SEQ_MASK), (block_ids + seq0) & SEQ_MASK)
    hdr = packets["hdr"]
    hdr["seq"][slots] = seqs
    hdr["exponent"][slots] = np.where(probe, ahead[slots], ahead[block_ids + window])
    hdr["flags"][slots] = 0
    pools = next_pool[slots]
    hdr["pool"][slots] = pools
    next_rounds = rounds[slots] + np.uint16(1)
    rounds[slots] = next_rounds
    hdr["round"][slots] = next_rounds
    keys[:] = (next_rounds.astype(np.int64) << 33) | (pools.astype(np.int64) << 32) | seqs
    expect[slots] = keys
    sent_at[slots] = now
    return 0
