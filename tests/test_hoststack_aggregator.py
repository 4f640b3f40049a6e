"""The PS's software aggregator follows the switch's rules (docs/protocol.md, steps 1-5)."""

from __future__ import annotations

import numpy as np
import pytest

from netagg import wire
from netagg.hoststack.aggregator import SoftAggregator

JOB = 9
ADDR = [("127.0.0.1", 40000 + r) for r in range(4)]


def packet(rank: int, slot: int = 0, pool: int = 0, seq: int = 1, exponent: int = 0, values=None,
           flags: int = 0, job: int = JOB, round_: int = 1, members: int = 0) -> bytes:
    vals = np.full(wire.K, rank + 1, np.int32) if values is None else np.asarray(values, np.int32)
    return wire.pack(wire.Header(job_id=job, slot=slot, pool=pool, rank=rank, seq=seq, exponent=exponent,
                                 flags=flags, round=round_, members=members), vals)


def contribute(agg: SoftAggregator, rank: int, **kw):
    return agg.handle(packet(rank, **kw), ADDR[rank])


def test_the_last_contribution_completes_with_sums_and_max_exponent_to_the_group():
    agg = SoftAggregator(JOB, 3, slot_count=4)
    assert contribute(agg, 0, exponent=-3, seq=77) is None
    assert contribute(agg, 1, exponent=5, seq=77) is None
    outcome = contribute(agg, 2, exponent=2, seq=77)
    assert outcome is not None and outcome.to_group
    header, values = wire.unpack(outcome.packet)
    assert header.flags == wire.FLAG_RESULT | wire.FLAG_PS_FORWARDED
    assert (header.exponent, header.seq, header.slot, header.pool, header.rank) == (5, 77, 0, 0, 2)
    np.testing.assert_array_equal(values, 1 + 2 + 3)
    assert sorted(agg.group()) == ADDR[:3]
    assert (agg.stats.contributions, agg.stats.results) == (3, 1)


def test_retransmissions_before_completion_are_dropped_after_answered_to_the_sender():
    agg = SoftAggregator(JOB, 2, slot_count=1)
    assert contribute(agg, 0) is None
    assert contribute(agg, 0, flags=wire.FLAG_RETRANSMIT) is None  # incomplete: duplicate
    assert agg.stats.duplicates == 1
    first = contribute(agg, 1)
    again = contribute(agg, 0, flags=wire.FLAG_RETRANSMIT)  # complete: stored result, to rank 0 only
    assert not again.to_group
    h_first, v_first = wire.unpack(first.packet)
    h_again, v_again = wire.unpack(again.packet)
    np.testing.assert_array_equal(v_first, v_again)
    assert h_again.exponent == h_first.exponent
    assert h_again.flags == wire.FLAG_RESULT | wire.FLAG_PS_FORWARDED | wire.FLAG_RETRANSMIT
    assert agg.stats.retransmit_results == 1 and agg.stats.contributions == 2


def test_rounds_alternate_pools_and_a_delayed_copy_of_an_earlier_round_is_never_added():
    agg = SoftAggregator(JOB, 2, slot_count=1)
    contribute(agg, 0, pool=0, round_=1, values=np.full(wire.K, 10))
    assert contribute(agg, 1, pool=0, round_=1, values=np.full(wire.K, 20)).to_group
    # Rank 1 moves on to round 2 (pool 1); then a delayed copy of its round-1 packet arrives:
    # the same round, its bit set: answered with the stored sum, to rank 1 alone, never added.
    assert contribute(agg, 1, pool=1, round_=2, values=np.full(wire.K, 2)) is None
    late = contribute(agg, 1, pool=0, round_=1, values=np.full(wire.K, 20))
    assert not late.to_group
    np.testing.assert_array_equal(wire.unpack(late.packet)[1], 30)
    outcome = contribute(agg, 0, pool=1, round_=2, values=np.full(wire.K, 1))
    assert outcome.to_group
    np.testing.assert_array_equal(wire.unpack(outcome.packet)[1], 3)
    # Round 3 reuses pool 0 and starts afresh (the first contribution overwrites) ...
    contribute(agg, 0, pool=0, round_=3, values=np.full(wire.K, 100))
    # ... and a copy of round 1 arriving now is older than the pool's round: dropped, counted.
    duplicates = agg.stats.duplicates
    assert contribute(agg, 1, pool=0, round_=1, values=np.full(wire.K, 20)) is None
    assert agg.stats.duplicates == duplicates + 1
    outcome = contribute(agg, 1, pool=0, round_=3, values=np.full(wire.K, 200))
    np.testing.assert_array_equal(wire.unpack(outcome.packet)[1], 300)


def test_sums_wrap_modulo_2_32_like_the_switch():
    agg = SoftAggregator(JOB, 2, slot_count=1)
    contribute(agg, 0, values=np.full(wire.K, 2**31 - 1))
    outcome = contribute(agg, 1, values=np.full(wire.K, 1))
    np.testing.assert_array_equal(wire.unpack(outcome.packet)[1], -(2**31))


def test_a_single_worker_job_completes_at_once():
    agg = SoftAggregator(JOB, 1, slot_count=1)
    outcome = contribute(agg, 0, exponent=-7)
    assert outcome.to_group and wire.unpack(outcome.packet)[0].exponent == -7


@pytest.mark.parametrize(("data", "source", "reason"), [
    (packet(0)[:-1], ADDR[0], "MALFORMED"),
    (bytes([wire.VERSION + 1]) + packet(0)[1:], ADDR[0], "BAD_VERSION"),
    (packet(0, flags=wire.FLAG_RESULT), ADDR[0], "RESULT_FROM_HOST"),
    (packet(0, job=JOB + 1), ADDR[0], "UNKNOWN_JOB"),
    (packet(0, slot=4), ADDR[0], "SLOT_OUT_OF_RANGE"),
    (packet(0)[:6] + b"\x02" + packet(0)[7:], ADDR[0], "BAD_POOL"),
    (packet(3), ADDR[3], "UNKNOWN_WORKER"),  # rank >= num_workers
    (packet(1), ADDR[0], "RANK_MISMATCH"),  # ADDR[0] is pinned to rank 0
    (packet(0), ADDR[2], "UNKNOWN_WORKER"),  # rank 0 is pinned to ADDR[0]
])
def test_bad_packets_are_dropped_and_counted_without_state_changes(data, source, reason):
    agg = SoftAggregator(JOB, 3, slot_count=4)
    assert contribute(agg, 0, slot=1) is None  # pins ADDR[0] to rank 0
    assert agg.handle(data, source) is None
    assert agg.stats.drops == {reason: 1}
    assert agg.stats.contributions == 1 and agg.registers.bitmaps[0] == 0


def test_a_fixed_worker_table_rejects_unknown_addresses():
    agg = SoftAggregator(JOB, 2, slot_count=1, workers={ADDR[0]: 0, ADDR[1]: 1})
    assert agg.handle(packet(1), ("127.0.0.1", 1)) is None
    assert agg.stats.drops == {"UNKNOWN_WORKER": 1}
    contribute(agg, 0)
    assert contribute(agg, 1).to_group


def test_registered_workers_only_when_registration_is_required():
    agg = SoftAggregator(JOB, 2, slot_count=4, workers={})  # a job with a secret: no learning
    assert agg.handle(packet(0), ADDR[0]) is None and agg.stats.drops["UNKNOWN_WORKER"] == 1
    agg.register(0, ADDR[0])
    agg.register(1, ADDR[2])
    agg.register(1, ADDR[1])  # a restarted worker registers its new address: the old one is forgotten
    assert agg.group() == [ADDR[0], ADDR[1]] and ADDR[2] not in agg.rank_of
    with pytest.raises(ValueError, match="already registered as rank 0"):
        agg.register(1, ADDR[0])
    with pytest.raises(ValueError, match=r"not in 0\.\.1"):
        agg.register(2, ADDR[3])
    assert contribute(agg, 0) is None
    outcome = contribute(agg, 1)
    assert outcome is not None and outcome.to_group
    assert agg.handle(packet(1, seq=2, pool=1), ADDR[2]) is None  # the forgotten address is a stranger
    assert agg.stats.drops["UNKNOWN_WORKER"] == 2


def test_a_subset_round_as_the_switch_does_it():
    agg = SoftAggregator(JOB, 4, slot_count=4)
    members = wire.members_of([1, 3])
    assert contribute(agg, 0, members=members) is None  # not a member
    assert agg.stats.drops == {"NOT_A_MEMBER": 1}
    assert contribute(agg, 1, members=members) is None
    assert contribute(agg, 3, members=0b1111) is None  # other members than the round's: nothing changes
    assert agg.stats.drops["MEMBERS_MISMATCH"] == 1
    outcome = contribute(agg, 3, members=members)
    assert outcome is not None and outcome.to_group
    header, values = wire.unpack(outcome.packet)
    assert header.members == members
    np.testing.assert_array_equal(values, 2 + 4)
    resend = contribute(agg, 1, members=members)
    assert resend is not None and not resend.to_group
    assert (agg.stats.contributions, agg.stats.results, agg.stats.retransmit_results) == (2, 1, 1)
