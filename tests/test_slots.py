"""The shared slot rules (netagg/slots.py): the cases the P4 program distinguishes."""

import numpy as np

from netagg import wire
from netagg.dataplane import ValueOp
from netagg.slots import RoundState, SlotRegisters


def _values(v: int) -> np.ndarray:
    return np.full(wire.K, v, np.int32)


def test_round_first_merge_complete_then_resend():
    regs = SlotRegisters(4)
    d = regs.decide(2, 0, 1, 0b01, 2, generation=7)
    assert (d.op, d.round_state, d.first, d.fresh, d.complete) == (ValueOp.WRITE, RoundState.NEW, True, True, False)
    regs.sums(regs.pool_index(2, 0), d.op, _values(5))
    d = regs.decide(2, 0, 1, 0b01, 2, generation=7)
    assert (d.op, d.fresh, d.delivers) == (ValueOp.NONE, False, False)  # duplicate before completion
    d = regs.decide(2, 0, 1, 0b10, 2, generation=7)
    assert (d.op, d.round_state, d.complete, d.delivers) == (ValueOp.MERGE, RoundState.SAME, True, True)
    np.testing.assert_array_equal(regs.sums(regs.pool_index(2, 0), d.op, _values(-7)), _values(-2))
    d = regs.decide(2, 0, 1, 0b01, 2, generation=7)
    assert (d.op, d.fresh, d.delivers) == (ValueOp.READ, False, True)  # resend after completion


def test_a_delayed_copy_after_everyone_moved_on_is_never_a_new_round():
    regs = SlotRegisters(1)
    for mask in (0b01, 0b10):
        regs.decide(0, 0, 1, mask, 2, generation=1)  # round 1 (pool 0) completes
    for mask in (0b01, 0b10):
        regs.decide(0, 1, 2, mask, 2, generation=1)  # round 2 (pool 1) completes: all moved on
    d = regs.decide(0, 0, 1, 0b01, 2, generation=1)  # worker 0's delayed round-1 copy
    assert d.round_state == RoundState.SAME and d.op == ValueOp.READ  # answered, not added
    d = regs.decide(0, 0, 3, 0b10, 2, generation=1)  # round 3 starts in pool 0
    assert d.round_state == RoundState.NEW and d.op == ValueOp.WRITE
    d = regs.decide(0, 0, 1, 0b01, 2, generation=1)  # the round-1 copy again: now OLD
    assert d.round_state == RoundState.OLD and d.op == ValueOp.NONE and not d.delivers


def test_round_numbers_wrap_modulo_2_16():
    regs = SlotRegisters(1)
    assert regs.decide(0, 0, 0xFFFF, 1, 1, generation=1).round_state == RoundState.NEW
    assert regs.decide(0, 0, 1, 1, 1, generation=1).round_state == RoundState.NEW  # 0xFFFF + 2
    assert regs.decide(0, 0, 0xFFFF, 1, 1, generation=1).round_state == RoundState.OLD


def test_new_generation_takes_the_slot_over_in_both_pools():
    regs = SlotRegisters(1)
    regs.decide(0, 0, 5, 0b001, 3, generation=1)
    regs.decide(0, 1, 6, 0b010, 3, generation=1)
    d = regs.decide(0, 0, 5, 0b001, 2, generation=2)  # same round number, new job
    assert d.round_state == RoundState.NEW and d.first and d.op == ValueOp.WRITE and regs.owner[0] == 2
    d = regs.decide(0, 1, 5, 0b010, 2, generation=2)  # the other pool: its old bits do not count
    assert d.round_state == RoundState.NEW and d.first


def test_exponent_signed_max_and_modular_sums():
    regs = SlotRegisters(1)
    index = regs.pool_index(0, 1)
    assert regs.exponent(index, ValueOp.WRITE, -5) == -5
    assert regs.exponent(index, ValueOp.MERGE, -9) == -5
    assert regs.exponent(index, ValueOp.MERGE, 3) == 3
    assert regs.exponent(index, ValueOp.READ, 100) == 3
    regs.sums(index, ValueOp.WRITE, _values(2**31 - 1))
    np.testing.assert_array_equal(regs.sums(index, ValueOp.MERGE, _values(1)), _values(-(2**31)))


def test_a_subset_round_completes_with_its_members_and_fixes_them_for_the_round():
    regs = SlotRegisters(2)
    members = wire.members_of([0, 2])  # of a job of 3 workers
    d = regs.decide(1, 0, 1, 0b001, 3, generation=7, members=members)
    assert (d.op, d.first, d.complete) == (ValueOp.WRITE, True, False)
    regs.sums(regs.pool_index(1, 0), d.op, _values(5))
    before = regs.snapshot()
    d = regs.decide(1, 0, 1, 0b100, 3, generation=7, members=0b111)  # other members: refused, nothing changes
    assert d.members_mismatch and d.op == ValueOp.NONE and not d.delivers
    d = regs.decide(1, 0, 1, 0b100, 3, generation=7, members=0)  # a whole-job packet in a subset round, too
    assert d.members_mismatch
    for name, array in regs.snapshot().items():
        np.testing.assert_array_equal(array, before[name], err_msg=name)
    d = regs.decide(1, 0, 1, 0b100, 3, generation=7, members=members)
    assert (d.op, d.complete, d.delivers) == (ValueOp.MERGE, True, True)  # two of three workers complete it
    np.testing.assert_array_equal(regs.sums(regs.pool_index(1, 0), d.op, _values(2)), _values(7))
    d = regs.decide(1, 0, 1, 0b001, 3, generation=7, members=members)
    assert (d.op, d.delivers) == (ValueOp.READ, True)  # a member's resend after completion gets the result
    # The slot's next round is the whole job's again: three contributions.
    for mask, complete in ((0b001, False), (0b010, False), (0b100, True)):
        d = regs.decide(1, 1, 2, mask, 3, generation=7)
        assert d.complete == complete and not d.members_mismatch


def test_a_one_member_round_completes_at_once():
    regs = SlotRegisters(1)
    d = regs.decide(0, 0, 1, 1 << 31, 32, generation=1, members=1 << 31)
    assert (d.op, d.first, d.complete, d.delivers) == (ValueOp.WRITE, True, True, True)


def _round(regs: SlotRegisters, slot: int, pool: int, round_: int, values: dict[int, int], n: int,
           generation: int) -> list[tuple[int, np.ndarray | None]]:
    """Each rank of ``values`` sends its packet of the round (values[rank] everywhere); returns, per
    packet, (rank, the sums it leaves with, or None when nothing leaves)."""
    out = []
    for rank, value in values.items():
        d = regs.decide(slot, pool, round_, 1 << rank, n, generation)
        sums = regs.sums(regs.pool_index(slot, pool), d.op, _values(value)) if d.op != ValueOp.NONE else None
        out.append((rank, sums if d.delivers else None))
    return out


def test_a_slot_taken_over_marks_the_other_pool_two_rounds_behind():
    regs = SlotRegisters(1)
    d = regs.decide(0, 1, 10, 0b01, 2, generation=3)
    assert d.round_state == RoundState.NEW and regs.rounds[1][0] == 10 and regs.rounds[0][0] == 8
    # Round 9 (the other pool's, the round before this one) is still ahead: it starts afresh ...
    assert regs.decide(0, 0, 9, 0b01, 2, generation=3).round_state == RoundState.NEW
    # ... and round 7 (behind the mark) is an old copy. Round 8, the mark itself, is never sent in pool 0
    # (rounds alternate pools), so a taken-over pool is never SAME with what it held before.
    regs = SlotRegisters(1)
    regs.decide(0, 1, 10, 0b01, 2, generation=3)
    assert regs.decide(0, 0, 7, 0b01, 2, generation=3).round_state == RoundState.OLD
    regs = SlotRegisters(1)
    regs.decide(0, 1, 0, 0b01, 2, generation=3)  # modulo 2**16
    assert regs.rounds[0][0] == 0xFFFE and regs.decide(0, 0, 0xFFFF, 0b01, 2, generation=3).first


def test_the_round_before_a_takeover_never_reads_the_previous_jobs_registers():
    """The old job completed round 9 in pool 0 with both bits set; the new job's first packets on the slot are
    round 10 (pool 1) and then round 9 (pool 0). With the other pool marked one round behind, round 9 would be
    SAME: rank 0's packet would read the old job's sums back (a retransmission after completion)."""
    regs = SlotRegisters(1)
    for rank in (0, 1):
        regs.decide(0, 0, 9, 1 << rank, 2, generation=1)
    regs.sums(0, ValueOp.WRITE, _values(666))
    regs.decide(0, 1, 10, 0b01, 2, generation=2)
    d = regs.decide(0, 0, 9, 0b01, 2, generation=2)
    assert (d.round_state, d.op, d.first, d.delivers) == (RoundState.NEW, ValueOp.WRITE, True, False)
    np.testing.assert_array_equal(regs.sums(0, d.op, _values(1)), _values(1))
    d = regs.decide(0, 0, 9, 0b10, 2, generation=2)
    assert d.delivers and d.op == ValueOp.MERGE
    np.testing.assert_array_equal(regs.sums(0, d.op, _values(2)), _values(3))


def test_after_a_register_reset_the_round_a_worker_lost_and_the_next_one_both_complete():
    """A switch restart (every register zero, the same job and generation re-installed) while ranks 0 and 1
    have round r-1's result and are on round r, and rank 2 lost that result: the leaders' round r packets
    arrive first, then every worker's round r-1 (the laggard's resend and the leaders' shadow copies), then
    the laggard's round r. Both rounds complete, each with its own exact sums, each exactly once."""
    n, generation, r = 3, 77, 41
    for first_pool in (0, 1):  # round r in pool 0 or 1
        for leaders_first in (True, False):
            regs = SlotRegisters(2)
            regs.decide(1, first_pool, r, 0b001, n, generation)  # state before the restart: lost anyway
            regs.reset()
            previous = {rank: 10 + rank for rank in range(n)}  # round r-1: 10 + 11 + 12 = 33
            current = {rank: 100 * (rank + 1) for rank in range(n)}  # round r: 600
            p, q = first_pool, 1 - first_pool
            out = []
            if leaders_first:
                out += _round(regs, 1, p, r, {0: current[0], 1: current[1]}, n, generation)
                out += _round(regs, 1, q, r - 1, previous, n, generation)
            else:
                out += _round(regs, 1, q, r - 1, {2: previous[2]}, n, generation)
                out += _round(regs, 1, p, r, {0: current[0], 1: current[1]}, n, generation)
                out += _round(regs, 1, q, r - 1, {0: previous[0], 1: previous[1]}, n, generation)
            out += _round(regs, 1, p, r, {2: current[2]}, n, generation)
            delivered = [sums for _, sums in out if sums is not None]
            assert len(delivered) == 2, (first_pool, leaders_first)
            np.testing.assert_array_equal(delivered[0], _values(33))
            np.testing.assert_array_equal(delivered[1], _values(600))
            # The laggard's resend of round r-1 after its round r packet is an old copy now (r-1 is complete:
            # answered from storage; a copy of r-2 would be OLD).
            d = regs.decide(1, q, r - 1, 0b100, n, generation)
            assert d.op == ValueOp.READ and d.delivers
            assert regs.decide(1, p, r - 2, 0b100, n, generation).round_state == RoundState.OLD


def _agg(regs: SlotRegisters, mask: int, value: int, *, round_: int = 1, close: bool = False, members: int = 0,
         workers: int = 3, exchange: int = 0, has_up: bool = False):
    flags = wire.FLAG_CLOSE if close else 0
    return regs.aggregate(0, 0, round_, mask, workers, 1, members, 0, _values(value), has_up=has_up, flags=flags,
                          exchange=exchange)


def test_a_close_request_releases_the_partial_sum_once_with_its_contributors():
    from netagg.slots import Delivery
    regs = SlotRegisters(1)
    assert _agg(regs, 0b001, 5).delivery == Delivery.NONE  # rank 0 contributes
    v = _agg(regs, 0b010, 7, close=True)  # rank 1 contributes and closes: rank 2 is missing
    assert v.delivery == Delivery.GROUP and v.members == 0b011 and v.round_flags & wire.FLAG_CLOSE
    assert v.counts == ("contributions", "results")
    np.testing.assert_array_equal(v.values, _values(12))
    late = _agg(regs, 0b100, 100)  # rank 2 arrives late: not added, answered alone with who is in
    assert late.delivery == Delivery.SENDER and late.late_for_close and late.members == 0b011
    np.testing.assert_array_equal(late.values, _values(12))
    assert regs.bitmaps[0] == 0b011  # the late bit is not set: the round's contributors stay those of the sum
    again = _agg(regs, 0b010, 7, close=True)  # the closer's resend: answered, not a second release
    assert again.delivery == Delivery.SENDER and not again.late_for_close and again.counts == ("retransmit_results",)
    np.testing.assert_array_equal(_agg(regs, 0b100, 100).values, _values(12))  # the late one again: still 12
    nxt = _agg(regs, 0b001, 1, round_=3)  # the pool's next round opens: no longer closed
    assert nxt.delivery == Delivery.NONE and not regs.flags[0] & wire.FLAG_CLOSE


def test_a_close_to_a_complete_round_changes_nothing_and_a_resend_can_close():
    from netagg.slots import Delivery
    regs = SlotRegisters(1)
    _agg(regs, 0b01, 1, workers=2)
    full = _agg(regs, 0b10, 2, workers=2, close=True)  # the last contribution: complete, not closed
    assert full.delivery == Delivery.GROUP and full.members is None and not full.round_flags & wire.FLAG_CLOSE
    regs = SlotRegisters(1)
    _agg(regs, 0b01, 1)
    resend = _agg(regs, 0b01, 1, close=True)  # rank 0's resend closes: its values are in once
    assert resend.delivery == Delivery.GROUP and resend.members == 0b01 and resend.counts == ("results",)
    np.testing.assert_array_equal(resend.values, _values(1))


def test_a_close_on_a_segment_with_an_up_link_is_refused_before_any_register_changes():
    from netagg.dataplane import DropReason
    regs = SlotRegisters(1)
    v = _agg(regs, 0b01, 1, close=True, has_up=True)
    assert v.drop == DropReason.CLOSE_REFUSED and regs.rounds[0][0] == 0 and regs.owner[0] == 0
    down = regs.accept_down(0, 0, 1, 1, 0, _values(1), wire.FLAG_RESULT | wire.FLAG_CLOSE)
    assert down.drop == DropReason.CLOSE_REFUSED


def test_a_closed_subset_round_still_refuses_outsiders_and_other_members():
    from netagg.dataplane import DropReason
    from netagg.slots import Delivery
    regs = SlotRegisters(1)
    _agg(regs, 0b001, 3, members=0b011)
    closed = _agg(regs, 0b001, 3, members=0b011, close=True)
    assert closed.delivery == Delivery.GROUP and closed.members == 0b001
    assert _agg(regs, 0b010, 3, members=0b111).drop == DropReason.MEMBERS_MISMATCH
    late = _agg(regs, 0b010, 3, members=0b011)
    assert late.late_for_close and late.members == 0b001


def test_a_late_contribution_of_another_collective_learns_it_is_out_of_step():
    regs = SlotRegisters(1)
    _agg(regs, 0b01, 1, exchange=9, close=True)
    late = _agg(regs, 0b10, 1, exchange=8)
    assert late.late_for_close and late.round_flags & wire.FLAG_OUT_OF_STEP
    assert not regs.flags[0] & wire.FLAG_OUT_OF_STEP  # the round's own result is unchanged
