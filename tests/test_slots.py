"""The shared slot rules (netagg/slots.py): the cases the P4 program distinguishes."""

import numpy as np

from netagg import wire
from netagg.dataplane import ValueOp
from netagg.slots import SlotRegisters


def _values(v: int) -> np.ndarray:
    return np.full(wire.K, v, np.int32)


def test_round_first_merge_complete_then_resend():
    regs = SlotRegisters(4)
    d = regs.decide(2, 0, 0b01, 2, generation=7)
    assert (d.op, d.first, d.fresh, d.complete) == (ValueOp.WRITE, True, True, False)
    regs.sums(regs.pool_index(2, 0), d.op, _values(5))
    d = regs.decide(2, 0, 0b01, 2, generation=7)
    assert (d.op, d.fresh, d.delivers) == (ValueOp.NONE, False, False)  # duplicate before completion
    d = regs.decide(2, 0, 0b10, 2, generation=7)
    assert (d.op, d.complete, d.delivers) == (ValueOp.MERGE, True, True)
    np.testing.assert_array_equal(regs.sums(regs.pool_index(2, 0), d.op, _values(-7)), _values(-2))
    d = regs.decide(2, 0, 0b01, 2, generation=7)
    assert (d.op, d.fresh, d.delivers) == (ValueOp.READ, False, True)  # resend after completion


def test_late_copy_of_a_completed_round_is_not_added():
    regs = SlotRegisters(1)
    for mask in (0b01, 0b10):
        regs.decide(0, 0, mask, 2, generation=1)
    regs.decide(0, 1, 0b01, 2, generation=1)  # worker 0 moved on: its pool-0 bit is cleared
    d = regs.decide(0, 0, 0b01, 2, generation=1)  # a late copy of worker 0's pool-0 packet
    assert d.late and d.op == ValueOp.NONE and not d.delivers


def test_new_generation_takes_the_slot_over():
    regs = SlotRegisters(1)
    regs.decide(0, 0, 0b001, 3, generation=1)
    regs.decide(0, 1, 0b010, 3, generation=1)
    d = regs.decide(0, 0, 0b001, 2, generation=2)
    assert d.first and d.op == ValueOp.WRITE and regs.owner[0] == 2
    assert regs.bitmaps[1][0] == 0  # the old job's pool-1 bits are gone too


def test_exponent_signed_max_and_modular_sums():
    regs = SlotRegisters(1)
    index = regs.pool_index(0, 1)
    assert regs.exponent(index, ValueOp.WRITE, -5) == -5
    assert regs.exponent(index, ValueOp.MERGE, -9) == -5
    assert regs.exponent(index, ValueOp.MERGE, 3) == 3
    assert regs.exponent(index, ValueOp.READ, 100) == 3
    regs.sums(index, ValueOp.WRITE, _values(2**31 - 1))
    np.testing.assert_array_equal(regs.sums(index, ValueOp.MERGE, _values(1)), _values(-(2**31)))
