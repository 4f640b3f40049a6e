"""The transport's slot rows on their own (hoststack/slot_rows.py): headers from the wire format, shadows, recovery
copies, and the round state a failover marks and restores."""

from __future__ import annotations

import numpy as np
import pytest

from netagg import wire
from netagg.hoststack.packets import SEQ_MASK
from netagg.hoststack.slot_rows import SlotRows


@pytest.mark.parametrize("k", sorted(wire.WIDTH_CODES))
def test_rows_are_packets_of_the_job_s_width_with_its_header(k):
    rows = SlotRows(k, job_id=7, rank=3, slot_base=100, slot_count=4)
    assert rows.raw.shape == (4, wire.netagg_bytes(k))
    for s in range(4):
        header, values = wire.unpack(rows.raw[s].tobytes())
        assert (header.version, header.job_id, header.rank, header.slot) == (wire.VERSION, 7, 3, 100 + s)
        assert len(values) == k


def test_a_new_packet_makes_the_last_one_the_shadow_and_copies_carry_the_retransmit_flag():
    rows = SlotRows(wire.K, 1, 0, 0, 3)
    rows.prepare(np.array([0, 1]), np.zeros(2, np.int64), ident=0xAB)
    rows.raw[0, -1], rows.raw[1, -1] = 1, 2  # the first packets, as "sent"
    first = rows.raw[:2].copy()
    rows.prepare(np.array([0]), np.zeros(1, np.int64), ident=0xAB)
    rows.raw[0, -1] = 9  # slot 0's second packet
    np.testing.assert_array_equal(rows.shadow[0], first[0])
    assert rows.uses.tolist() == [2, 1, 0]
    # Slot 0 has its second packet outstanding: its shadow (the first) is the answered one; slot 1's only packet is
    # answered (nothing outstanding); slot 2 never carried one; slot 1 with a packet outstanding has no shadow.
    copied = rows.answered_copies(np.array([0, 1, 2]), np.array([True, False, False]))
    assert copied.tolist() == [0, 1]
    for row, expected in zip(rows.resend[:2], (first[0], first[1]), strict=True):
        assert row[1] == expected[1] | wire.FLAG_RETRANSMIT and row[-1] == expected[-1]
    assert rows.answered_copies(np.array([1]), np.array([True])).shape == (0,)
    assert rows.raw[0, 1] & wire.FLAG_RETRANSMIT == 0  # the rows themselves are untouched


def test_the_round_state_is_marked_restored_and_advanced():
    rows = SlotRows(wire.K, 1, 0, 0, 4)
    rows.rounds[:] = [5, 6, 7, 8]
    rows.next_pool[:] = [1, 0, 1, 0]
    rows.advance(SEQ_MASK, 4)
    mark = rows.mark()
    assert (rows.seq, rows.probe_seq) == (SEQ_MASK, 4)
    rows.advance(3, 4)
    rows.rounds += 1
    rows.next_pool ^= 1
    assert (rows.seq, rows.probe_seq) == (2, 8)  # block ids wrap at 31 bits
    rows.restore(mark)
    assert (rows.seq, rows.probe_seq) == (SEQ_MASK, 4)
    assert rows.rounds.tolist() == [5, 6, 7, 8] and rows.next_pool.tolist() == [1, 0, 1, 0]
    rows.start_subset(0x1_0003, members=0b101)
    assert rows.rounds.tolist() == [3] * 4 and rows.next_pool.tolist() == [1] * 4
    assert (rows.seq, rows.probe_seq, rows.members) == (0, 0, 0b101)
    rows.uses[:] = 5
    rows.forget_shadows()
    assert not rows.uses.any()
