"""The MLfabric scheduler's decisions, deterministically: pure plans over request lists, a fake clock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netagg.mlfabric.grants import GrantService
from netagg.mlfabric.scheduler import AGGREGATE, DEFER, DROP, SEND, BandwidthEstimator, Scheduler, TransferRequest

MB = 1_000_000


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def req(rank: int, size: int = MB, version: int = 10, norm: float = 1.0, arrival: float = 0.0) -> TransferRequest:
    return TransferRequest(rank=rank, update_id=f"{rank}:{version}", version=version, size=size, norm=norm,
                           arrival=arrival)


def test_shortest_job_first_by_size_over_measured_bandwidth_with_back_to_back_slots():
    clock = FakeClock(100.0)
    sched = Scheduler(None, aggregate=False, clock=clock)
    # rank 0: 1 MB at 1 MB/s = 1 s; rank 1: 1 MB at 4 MB/s = 0.25 s; rank 2: 0.2 MB at 0.1 MB/s = 2 s.
    plan = sched.plan([req(0), req(1), req(2, size=MB // 5)], server_version=10,
                      bandwidth={0: 1 * MB, 1: 4 * MB, 2: MB // 10})
    assert [d.rank for d in plan.decisions] == [1, 0, 2]
    assert all(d.action == SEND for d in plan.decisions)
    slots = [(d.slot.start, d.slot.end) for d in plan.decisions]
    assert slots == [(100.0, 100.25), (100.25, 101.25), (101.25, 103.25)]
    assert plan.link_free_at == 103.25 and plan.granted_gradients == 3
    # Predicted versions count the gradients ahead: 10, 11, 12 (the updates were computed on 10).
    assert [d.predicted_delay for d in plan.decisions] == [0, 1, 2]


def test_ties_go_to_the_larger_gradient_norm_then_the_earlier_arrival():
    sched = Scheduler(None, aggregate=False, clock=FakeClock())
    plan = sched.plan([req(0, norm=1.0, arrival=2.0), req(1, norm=5.0, arrival=3.0), req(2, norm=1.0, arrival=1.0)],
                      server_version=10)
    assert [d.rank for d in plan.decisions] == [1, 2, 0]


def test_slots_start_after_the_link_backlog():
    sched = Scheduler(None, aggregate=False, clock=FakeClock(100.0), default_bandwidth=MB)
    plan = sched.plan([req(0)], server_version=10, link_free_at=105.0)
    assert plan.decisions[0].slot.start == 105.0 and plan.link_free_at == 106.0


def test_updates_that_cannot_meet_the_delay_bound_are_dropped_before_sending():
    sched = Scheduler(2, aggregate=False, clock=FakeClock())
    # PS at version 12 with 1 gradient in flight; equal transfer times, so rank order: rank 0 applies at
    # 13 (delay 1), rank 1's update (computed on 10) would apply at 14: delay 4 > 2, dropped.
    plan = sched.plan([req(0, version=12), req(1, version=10), req(2, version=11, size=2 * MB)],
                      server_version=12, in_flight=1, bandwidth={0: MB, 1: MB, 2: MB})
    by_rank = {d.rank: d for d in plan.decisions}
    assert by_rank[0].action == SEND and by_rank[0].predicted_delay == 1
    assert by_rank[1].action == DROP and by_rank[1].predicted_delay == 4 and "bound 2" in by_rank[1].reason
    # Rank 2's update (longer) comes after rank 0's, the dropped one not counted: 12 + 1 + 1 - 11 = 3 > 2.
    assert by_rank[2].action == DROP and by_rank[2].predicted_delay == 3
    assert by_rank[1].slot is None and plan.granted_gradients == 1


def test_a_dropped_update_does_not_count_against_later_ones():
    sched = Scheduler(1, aggregate=False, clock=FakeClock())
    plan = sched.plan([req(0, version=5, size=MB // 2), req(1, version=9, size=MB)], server_version=9,
                      bandwidth={0: MB, 1: MB})
    assert [(d.rank, d.action, d.predicted_delay) for d in plan.decisions] == [(1, SEND, 0), (0, DROP, 4)]


def test_updates_queued_behind_a_busy_link_are_aggregated_at_an_idle_worker():
    clock = FakeClock(100.0)
    sched = Scheduler(None, clock=clock, default_bandwidth=MB)
    # The PS link is busy for 2 more seconds; 4 updates of 1 s each wait. Workers 4 and 5 are idle; 5 is faster.
    requests = [req(r, arrival=r) for r in range(4)]
    plan = sched.plan(requests, server_version=10, idle=[4, 5], bandwidth={5: 2 * MB}, link_free_at=102.0)
    assert len(plan.groups) == 1
    group = plan.groups[0]
    assert group.aggregator == 5
    # Best total completion: two members (at min(1, 2) MB/s: 1 s each on worker 5's link) arrive by 102,
    # the aggregate (1 MB at 2 MB/s) takes [102, 102.5]; the other two go direct after it.
    assert group.members == ("0:10", "1:10") and group.count == 2
    assert (group.slot.start, group.slot.end) == (102.0, 102.5)
    actions = {d.rank: d for d in plan.decisions}
    assert [actions[r].action for r in range(4)] == [AGGREGATE, AGGREGATE, SEND, SEND]
    assert (actions[0].slot.start, actions[0].slot.end) == (100.0, 101.0)
    assert (actions[1].slot.start, actions[1].slot.end) == (101.0, 102.0)
    assert actions[0].group == actions[1].group == group.group and actions[0].aggregator == 5
    assert (actions[2].slot.start, actions[3].slot.start) == (102.5, 103.5)
    # Both members apply at the version the first would have seen; the rest count them ahead.
    assert actions[0].predicted_version == actions[1].predicted_version == 10
    assert [actions[2].predicted_version, actions[3].predicted_version] == [12, 13]
    assert plan.link_free_at == 104.5 and plan.granted_gradients == 4


def test_no_aggregation_when_the_link_is_free_or_nobody_is_idle():
    sched = Scheduler(None, clock=FakeClock(100.0), default_bandwidth=MB)
    requests = [req(r) for r in range(4)]
    free = sched.plan(requests, server_version=10, idle=[4], link_free_at=0.0)
    assert not free.groups and all(d.action == SEND for d in free.decisions)
    busy_no_idle = sched.plan(requests, server_version=10, idle=[], link_free_at=105.0)
    assert not busy_no_idle.groups
    # A sender of this batch is never its aggregator.
    busy_sender_idle = sched.plan(requests, server_version=10, idle=[0, 1], link_free_at=105.0)
    assert not busy_sender_idle.groups


def test_aggregation_never_raises_a_predicted_delay():
    sched = Scheduler(3, clock=FakeClock(100.0), default_bandwidth=MB)
    requests = [req(r, version=10) for r in range(4)]
    direct = Scheduler(3, aggregate=False, clock=FakeClock(100.0), default_bandwidth=MB).plan(
        requests, server_version=10, link_free_at=102.0)
    aggregated = sched.plan(requests, server_version=10, idle=[7], link_free_at=102.0)
    assert aggregated.groups
    before = {d.update_id: d.predicted_delay for d in direct.decisions}
    for d in aggregated.decisions:
        assert d.predicted_delay <= before[d.update_id]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4 * MB), st.integers(0, 20), st.floats(0, 10)), min_size=1, max_size=8),
       st.floats(0, 5), st.integers(0, 6), st.one_of(st.none(), st.integers(0, 6)))
def test_plans_never_overlap_and_respect_the_bound(items, backlog, in_flight, bound):
    clock = FakeClock(50.0)
    sched = Scheduler(bound, clock=clock, default_bandwidth=MB)
    requests = [TransferRequest(rank=i, update_id=f"u{i}", version=v, size=size, norm=norm)
                for i, (size, v, norm) in enumerate(items)]
    bandwidth = {i: (i % 3 + 1) * MB / 2 for i in range(len(items) + 2)}
    plan = sched.plan(requests, server_version=20, in_flight=in_flight, bandwidth=bandwidth,
                      idle=[len(items), len(items) + 1], link_free_at=50.0 + backlog)
    assert sorted(d.update_id for d in plan.decisions) == sorted(r.update_id for r in requests)
    # The PS's link: direct slots and aggregate slots never overlap, none starts before now or the backlog.
    ps_slots = sorted([(d.slot.start, d.slot.end) for d in plan.decisions if d.action == SEND]
                      + [(g.slot.start, g.slot.end) for g in plan.groups])
    for (_, end), (start, _) in pairwise(ps_slots):
        assert start >= end - 1e-9
    assert all(start >= 50.0 + backlog - 1e-9 for start, _ in ps_slots)
    # Each aggregator's link: members arrive one after another.
    for group in plan.groups:
        members = sorted((d.slot.start, d.slot.end) for d in plan.decisions if d.group == group.group)
        for (_, end), (start, _) in pairwise(members):
            assert start >= end - 1e-9
        assert group.slot.start >= members[-1][1] - 1e-9
    for d in plan.decisions:
        if d.action == DROP:
            assert bound is not None and d.predicted_delay > bound
        elif bound is not None:
            assert d.predicted_delay <= bound
    assert plan.granted_gradients == sum(1 for d in plan.decisions if d.action != DROP)


def test_bandwidth_estimator_smooths_and_ignores_unmeasurable_samples():
    est = BandwidthEstimator(default=5.0, alpha=0.5)
    assert est.get(1) == 5.0
    est.observe(1, 1000, 1.0)
    est.observe(1, 3000, 1.0)
    assert est.get(1) == 2000.0
    est.observe(1, 1000, 0.0001)  # too short to measure
    est.observe(1, 0, 1.0)
    assert est.get(1) == 2000.0 and est.snapshot() == {1: 2000.0}


def test_grant_service_batches_until_every_idle_worker_asked_and_grants_in_order():
    service = GrantService(Scheduler(None, aggregate=False, default_bandwidth=1e9), lambda: 0, batch_window=30.0)
    for rank in range(3):
        service.register(rank, can_aggregate=False)
    decisions: dict[int, object] = {}

    def ask(rank: int) -> None:
        decisions[rank] = service.request(TransferRequest(rank, f"{rank}:0", 0, 1000, arrival=service.clock()),
                                          timeout=20)

    threads = [threading.Thread(target=ask, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # One batch (planned when the third worker asked, long before the 30 s window), three grants.
    assert service.stats.batches == 1 and service.stats.sent == 3
    assert sorted(d.action for d in decisions.values()) == [SEND] * 3
    service.settled([f"{r}:0" for r in range(3)])
    assert not service._in_flight


def test_grant_service_reports_an_unknown_group():
    service = GrantService(Scheduler(None), lambda: 0)
    with pytest.raises(KeyError, match="no aggregation group 9"):
        service.group_slot(9, timeout=1)


def test_queued_updates_are_summed_in_the_switch_all_at_once_and_the_fastest_member_pushes():
    # 1 MB updates. Ranks 0-2 at 1 MB/s, rank 3 at 4 MB/s; nobody idle to aggregate at.
    clock = FakeClock(10.0)
    sched = Scheduler(None, clock=clock, default_bandwidth=MB)
    requests = [TransferRequest(r, f"{r}:0", 0, MB, norm=10.0 - r) for r in range(4)]
    rates = {0: MB, 1: MB, 2: MB, 3: 4 * MB}
    direct = sched.plan(requests, server_version=0, bandwidth=rates)
    assert not direct.groups  # no switch, nobody idle: four transfers back to back
    plan = sched.plan(requests, server_version=0, bandwidth=rates, switch=True)
    (group,) = plan.groups
    assert group.at_switch
    # Rank 3 (0.25 s) goes first, direct; the three 1 s transfers queued behind it go to the switch at once:
    # their subset round ends at 11.0, and the fastest member (rank 0, lowest of equals) pushes at 1 MB/s.
    assert plan.decision("3:0").action == SEND and plan.decision("3:0").slot.end == pytest.approx(10.25)
    assert set(group.members) == {"0:0", "1:0", "2:0"} and group.aggregator == 0
    for member in group.members:
        d = plan.decision(member)
        assert d.action == AGGREGATE and d.group == group.group and d.aggregator == 0
        assert (d.slot.start, d.slot.end) == pytest.approx((10.0, 11.0))  # in parallel, each on its own link
        assert d.predicted_version == 1  # applied after rank 3's update, not later than direct
    assert (group.slot.start, group.slot.end) == pytest.approx((11.0, 12.0))
    assert group.count == 3 and plan.granted_gradients == 4
    assert plan.link_free_at == pytest.approx(12.0)  # against 13.25 for the four direct transfers
    assert direct.link_free_at == pytest.approx(13.25)


def test_gang_sums_the_fastest_requests_in_one_switch_group_and_defers_the_straggler():
    # Ranks 0-2 at 4 MB/s (0.25 s per MB), rank 3 at 1 MB/s (1 s): gradients per second of the round are
    # 1/0.5 (rank 0 alone), 2/0.75, 3/0.75 and 4/1.5, so the group is ranks 0-2; rank 3 waits for the next.
    clock = FakeClock(10.0)
    sched = Scheduler(8, clock=clock)
    requests = [TransferRequest(r, f"{r}:0", 5, MB, arrival=10.0) for r in range(4)]
    rates = {0: 4 * MB, 1: 4 * MB, 2: 4 * MB, 3: MB}
    plan = sched.plan(requests, server_version=5, bandwidth=rates, switch=True, gang=True)
    (group,) = plan.groups
    assert group.at_switch and set(group.members) == {"0:0", "1:0", "2:0"} and group.aggregator == 0
    assert (group.slot.start, group.slot.end) == pytest.approx((10.25, 10.5))
    for member in group.members:  # all applied at once, at the version they were computed on
        assert plan.decision(member).action == AGGREGATE and plan.decision(member).predicted_delay == 0
    straggler = plan.decision("3:0")
    assert straggler.action == DEFER and straggler.slot is None and straggler.predicted_delay == 3
    assert plan.granted_gradients == 3 and plan.link_free_at == pytest.approx(10.5)
    # Without gang the same batch is planned by cost: the head goes direct.
    assert sched.plan(requests, server_version=5, bandwidth=rates, switch=True).decision("0:0").action == SEND


def test_gang_drops_what_the_group_would_make_too_late_and_sends_what_waited_too_long():
    clock = FakeClock(10.0)
    sched = Scheduler(2, clock=clock, max_defer=1.0)
    rates = {0: 4 * MB, 1: 4 * MB, 2: MB // 2, 3: MB // 2}  # groups: 2 / (0.25 + 0.5) s beats 4 / (2 + 0.5) s
    requests = [TransferRequest(0, "0:1", 5, MB, arrival=10.0), TransferRequest(1, "1:1", 5, MB, arrival=10.0),
                TransferRequest(2, "2:1", 4, MB, arrival=10.0),  # after the group and rank 3: delay 4 > 2
                TransferRequest(3, "3:1", 5, MB, arrival=8.5)]  # deferred since 8.5: sent after the group
    plan = sched.plan(requests, server_version=5, bandwidth=rates, switch=True, gang=True)
    assert set(plan.groups[0].members) == {"0:1", "1:1"}
    assert plan.decision("2:1").action == DROP and plan.decision("2:1").predicted_delay == 4
    late = plan.decision("3:1")
    assert late.action == SEND and late.predicted_delay == 2
    assert late.slot.start == pytest.approx(plan.groups[0].slot.end) and late.slot.end == pytest.approx(12.5)
    assert plan.granted_gradients == 3 and plan.link_free_at == pytest.approx(12.5)
    # Alone in its batch, or with a much slower one, the fastest pushes its own update (k = 1).
    alone = sched.plan([TransferRequest(0, "0:2", 7, MB, arrival=10.0)], server_version=7, switch=True, gang=True)
    assert alone.decisions[0].action == SEND and not alone.groups
    pair = sched.plan([TransferRequest(0, "0:3", 7, MB, arrival=10.0), TransferRequest(2, "2:3", 7, MB, arrival=10.0)],
                      server_version=7, bandwidth=rates, switch=True, gang=True)  # 1 / 0.5 s against 2 / 2.5 s
    assert pair.decision("0:3").action == SEND and pair.decision("2:3").action == DEFER and not pair.groups


def test_gang_grant_service_waits_for_the_group_in_flight_and_groups_the_deferred_with_the_next_batch():
    # A 30 s window: every batch below is planned because every worker it waits for asked.
    service = GrantService(Scheduler(None, default_bandwidth=1e6, max_defer=30.0), lambda: 0,
                           batch_window=30.0, switch_slots=64, gang=True)
    for rank in range(3):
        service.register(rank)
    service.hint(2, 1e4)  # rank 2 says it is slow: 0.1 s for its 1000 bytes, against 1 ms
    decisions: dict[str, object] = {}

    def ask(rank: int, step: int) -> threading.Thread:
        def run() -> None:
            decisions[f"{rank}:{step}"] = service.request(
                TransferRequest(rank, f"{rank}:{step}", 0, 1000, arrival=service.clock()), timeout=20)
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    late = ask(2, 0)
    late.join(0.2)
    assert late.is_alive() and service.stats.batches == 0  # the batch waits for ranks 0 and 1
    first = [ask(0, 0), ask(1, 0)]
    for t in first:
        t.join(10)
    # One batch of all three: ranks 0 and 1 form the group, the slow rank 2 is deferred.
    assert {decisions["0:0"].action, decisions["1:0"].action} == {AGGREGATE} and service.stats.groups == 1
    grant = service.switch_grant(decisions["0:0"].group)
    assert grant["members"] == 0b011 and {p[0] for p in grant["parts"]} == {"0:0", "1:0"}
    late.join(0.3)
    assert late.is_alive() and service.stats.deferred == 1
    service.hint(2, 1e6)  # as fast as the others now
    again = [ask(0, 1), ask(1, 1)]  # while the group is in flight: nothing is planned
    for t in again:
        t.join(0.3)
    assert all(t.is_alive() for t in again) and service.stats.batches == 1
    service.settled(["0:0", "1:0"])
    for t in [late, *again]:
        t.join(10)
    assert {decisions[k].action for k in ("2:0", "0:1", "1:1")} == {AGGREGATE}
    assert service.stats.batches == 2  # not one for rank 2 alone: the batch waited for the others
    assert decisions["2:0"].group == decisions["0:1"].group == decisions["1:1"].group
    assert service.stats.groups == 2 and service.stats.sent == 0 and service.snapshot()["hints"] == {"2": 1e6}
    # Slow again: a batch no longer waits for rank 2 (its 30 s window would otherwise run out first).
    service.hint(2, 1e4)
    service.settled(["2:0", "0:1", "1:1"])
    third = [ask(0, 2), ask(1, 2)]
    for t in third:
        t.join(10)
    assert not any(t.is_alive() for t in third) and service.stats.groups == 3


def _ask(service: GrantService, decisions: dict, rank: int, step: int, on: int) -> threading.Thread:
    """Rank ``rank``'s request for step ``step``, computed on version ``on``, from a thread of its own (the
    decision lands in ``decisions["rank:step"]``)."""
    def run() -> None:
        decisions[f"{rank}:{step}"] = service.request(
            TransferRequest(rank, f"{rank}:{step}", on, 1000, arrival=service.clock()), timeout=20)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _three_on_version_4(window: float, max_defer: float = 1.0) -> tuple[dict, GrantService, dict,
                                                                       Callable[..., threading.Thread]]:
    """Gang rounds of three registered ranks at version 4 (``version["now"]`` moves it): the version, the service,
    the decisions and an ``ask(rank, step, on)`` that starts a request."""
    version = {"now": 4}
    service = GrantService(Scheduler(None, default_bandwidth=1e6, max_defer=max_defer), lambda: version["now"],
                           batch_window=window, switch_slots=64, gang=True)
    for rank in range(3):
        service.register(rank)
    decisions: dict = {}

    def ask(rank: int, step: int, on: int) -> threading.Thread:
        return _ask(service, decisions, rank, step, on)

    return version, service, decisions, ask


def test_gang_drops_a_stale_request_and_waits_for_its_fresh_one_while_the_window_is_open():
    _, service, decisions, ask = _three_on_version_4(window=30.0)

    fresh = [ask(0, 0, 4), ask(1, 0, 4)]
    stale = ask(2, 0, 1)  # computed on version 1: the round sums version 4
    stale.join(10)
    drop = decisions["2:0"]
    assert drop.action == DROP and drop.reason.startswith("stale") and drop.predicted_version == 4
    for t in fresh:
        t.join(0.3)
    assert all(t.is_alive() for t in fresh) and service.stats.groups == 0  # they wait for rank 2's fresh one
    again = ask(2, 1, 4)
    for t in [*fresh, again]:
        t.join(10)
    assert {decisions[k].action for k in ("0:0", "1:0", "2:1")} == {AGGREGATE}
    assert service.stats.groups == 1 and service.stats.refreshed == 1
    group = decisions["0:0"].group
    assert set(service.switch_grant(group)["parts"][i][0] for i in range(3)) == {"0:0", "1:0", "2:1"}


def test_gang_sends_a_stale_request_it_does_not_group_after_the_group_at_once():
    # Rank 2 (1 MB/s) computed on version 4, the group (ranks 0 and 1, 4 MB/s) sums version 5: no later group
    # sums version 4, so deferring it would only age it. It goes to the PS right after the group, within the bound.
    clock = FakeClock(10.0)
    sched = Scheduler(4, clock=clock, max_defer=1.0)
    rates = {0: 4 * MB, 1: 4 * MB, 2: MB}
    requests = [TransferRequest(0, "0:1", 5, MB, arrival=10.0), TransferRequest(1, "1:1", 5, MB, arrival=10.0),
                TransferRequest(2, "2:1", 4, MB, arrival=10.0)]
    plan = sched.plan(requests, server_version=5, bandwidth=rates, switch=True, gang=True)
    assert set(plan.groups[0].members) == {"0:1", "1:1"}
    late = plan.decision("2:1")
    assert late.action == SEND and late.predicted_delay == 3 and late.predicted_version == 7
    assert late.slot.start == pytest.approx(plan.groups[0].slot.end)
    assert plan.granted_gradients == 3
    # A fresh one as slow is still deferred: the next group may sum it.
    fresh = sched.plan([*requests[:2], TransferRequest(2, "2:2", 5, MB, arrival=10.0)], server_version=5,
                       bandwidth=rates, switch=True, gang=True)
    assert fresh.decision("2:2").action == DEFER


def test_gang_grant_service_keeps_a_slow_workers_stale_request_and_sends_it_after_the_group():
    # Rank 2 is too slow to join a group (a quarter of the others' rate): were its stale request dropped, it would
    # pull the newest model over its slow link and be stale again, and none of its updates would ever count.
    version = {"now": 4}
    service = GrantService(Scheduler(4, default_bandwidth=1e6), lambda: version["now"], batch_window=30.0,
                           switch_slots=64, gang=True)
    for rank in range(3):
        service.register(rank)
    service.hint(2, 2.5e5)
    decisions: dict[str, object] = {}

    def ask(rank: int, on: int) -> threading.Thread:
        return _ask(service, decisions, rank, 0, on)

    slow = ask(2, 2)  # computed on version 2; the round sums version 4
    slow.join(0.2)
    threads = [slow, ask(0, 4), ask(1, 4)]
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert {decisions["0:0"].action, decisions["1:0"].action} == {AGGREGATE}
    kept = decisions["2:0"]
    assert kept.action == SEND and kept.predicted_delay == 4 and service.stats.refreshed == 0
    assert service.stats.groups == 1 and service.stats.sent == 1 and service.stats.dropped == 0


def test_gang_with_the_ps_in_the_group_takes_a_member_up_to_three_times_as_slow():
    # The PS receives the sum in the exchange, so nobody pushes it: a round of k takes t_k + p (the next model's
    # send), not t_k + 2p. Rank 0 at 4 MB/s (0.25 s), rank 1 2.5 times as slow (0.625 s): 2 / 0.875 s beats
    # 1 / 0.5 s with the PS in the group, not without (2 / 1.125 s); 3.5 times as slow never joins.
    sched = Scheduler(8, clock=FakeClock(10.0))

    def plan(slowdown: float, sum_at_ps: bool):
        requests = [TransferRequest(r, f"{r}:0", 5, MB, arrival=10.0) for r in range(2)]
        return sched.plan(requests, server_version=5, bandwidth={0: 4 * MB, 1: 4 * MB / slowdown}, switch=True,
                          gang=True, sum_at_ps=sum_at_ps)

    assert plan(2.5, sum_at_ps=True).groups[0].members == ("0:0", "1:0") and not plan(2.5, sum_at_ps=False).groups
    assert plan(2.5, sum_at_ps=False).decision("0:0").action == SEND
    # 3.5 times as slow never joins; with the PS in the group the fastest goes through the switch alone with it
    # (its next model comes back in the same exchange), not to the PS.
    alone = plan(3.5, sum_at_ps=True)
    assert [g.members for g in alone.groups] == [("0:0",)] and alone.decision("0:0").action == AGGREGATE
    assert alone.decision("1:0").action != AGGREGATE


def test_gang_a_lone_request_waits_for_its_fast_partner_up_to_max_defer():
    """With a short window a lone request would go to the PS alone while its partner is busy or getting its next
    model, and the partner alone after it: the workers would take turns. It waits for the partner (max_defer)."""
    service = GrantService(Scheduler(None, default_bandwidth=1e6, max_defer=5.0), lambda: 0, batch_window=0.05,
                           switch_slots=64, gang=True)
    for rank in range(2):
        service.register(rank)
    decisions: dict = {}
    first = _ask(service, decisions, 0, 0, on=0)
    first.join(0.5)  # ten windows: still waiting for rank 1
    assert first.is_alive() and service.stats.batches == 0
    second = _ask(service, decisions, 1, 0, on=0)
    for t in (first, second):
        t.join(10)
    assert decisions["0:0"].action == decisions["1:0"].action == AGGREGATE and service.stats.groups == 1
    assert service.stats.batches == 1 and service.stats.sent == 0
    # Not longer than max_defer: then it goes alone.
    service = GrantService(Scheduler(None, default_bandwidth=1e6, max_defer=0.3), lambda: 0, batch_window=0.05,
                           switch_slots=64, gang=True)
    for rank in range(2):
        service.register(rank)
    alone = _ask(service, decisions, 0, 1, on=0)
    alone.join(10)
    assert decisions["0:1"].action == SEND and service.stats.batches == 1


def test_gang_a_lone_request_beside_a_slow_workers_waits_for_its_fast_partner():
    # A slow worker's request joins no group; beside it a fast worker's request is still alone, and waits for its
    # partner instead of going to the PS alone (the fast two would take turns).
    service = GrantService(Scheduler(None, default_bandwidth=1e6, max_defer=5.0), lambda: 0, batch_window=0.05,
                           switch_slots=64, gang=True)
    for rank, rate in enumerate((1e6, 1e6, 1e4)):
        service.register(rank)
        service.hint(rank, rate)
    decisions: dict = {}
    first, slow = _ask(service, decisions, 0, 0, on=0), _ask(service, decisions, 2, 0, on=0)
    first.join(0.5)  # ten windows: still waiting for rank 1
    assert first.is_alive() and service.stats.batches == 0
    second = _ask(service, decisions, 1, 0, on=0)
    for t in (first, second, slow):
        t.join(10)
    assert decisions["0:0"].action == decisions["1:0"].action == AGGREGATE and service.stats.groups == 1
    assert decisions["0:0"].group == decisions["1:0"].group and decisions["2:0"].action != AGGREGATE


def test_gang_batches_wait_for_the_workers_that_would_join_the_group():
    # Without the PS in the group a member up to twice as slow joins; with it, up to three times.
    for ps_member, waited in ((None, {0, 1}), (3, {0, 1, 2})):
        service = GrantService(Scheduler(None), lambda: 0, switch_slots=64, gang=True, ps_member=ps_member)
        for rank, rate in enumerate((3e6, 1.6e6, 1.2e6)):
            service.register(rank)
            service.hint(rank, rate)
        assert service._expected() == waited


def test_gang_batches_wait_for_a_worker_with_no_rate_once_and_again_once_it_has_one():
    service = GrantService(Scheduler(None, default_bandwidth=1e6), lambda: 0, batch_window=0.4, switch_slots=64,
                           gang=True)
    for rank in range(3):
        service.register(rank)
    for rank in (0, 1):
        service.hint(rank, 1e6)
    decisions: dict = {}

    def batch(step: int) -> float:
        began = service.clock()
        threads = [_ask(service, decisions, rank, step, on=0) for rank in (0, 1)]
        for t in threads:
            t.join(10)
        service.settled([f"0:{step}", f"1:{step}"])
        assert decisions[f"0:{step}"].action == decisions[f"1:{step}"].action == AGGREGATE
        return service.clock() - began

    assert batch(0) >= 0.35  # rank 2 has no rate: as fast as the default, the batch waits its window for it
    assert batch(1) < 0.3  # it did not come: not waited for again
    service.hint(2, 1e6)  # its first request told its rate: as fast as the others
    assert batch(2) >= 0.35
    # The same for a worker with a rate (measured: one whose link had fallen since, getting its models for seconds):
    # once a batch waited for it in vain, the next do not, until it asks again.
    assert batch(3) < 0.3 and batch(4) < 0.3
    late = _ask(service, decisions, 2, 0, on=0)  # it asks: waited for again
    late.join(10)
    service.settled(["2:0"])
    assert batch(5) >= 0.35


def test_gang_with_the_ps_a_batch_of_only_slow_workers_is_pushed_not_summed_alone_in_the_switch():
    """A slow worker alone in the switch would hold the job's one switch group at its link's pace while the fast
    workers' next requests waited: with the PS in the groups its request is pushed (the PS holds it for the fast
    ones' next group). A fast worker alone still goes through the switch with the PS."""
    service = GrantService(Scheduler(None, default_bandwidth=1e6, max_defer=0.2), lambda: 0, batch_window=0.05,
                           switch_slots=64, gang=True, ps_member=3)
    for rank, rate in enumerate((1e6, 1e6, 1e5)):
        service.register(rank)
        service.hint(rank, rate)
    decisions: dict = {}
    _ask(service, decisions, 2, 0, on=0).join(10)
    assert decisions["2:0"].action == SEND and service.stats.groups == 0 and service.stats.sent == 1
    service.settled(["2:0"])
    _ask(service, decisions, 0, 0, on=1).join(10)  # its partner does not come within max_defer: alone, with the PS
    assert decisions["0:0"].action == AGGREGATE and service.stats.groups == 1
    assert service.switch_grant(decisions["0:0"].group)["ps"] == 3
    # The plan itself: no group where the batch may not form one, every request sent in slot order.
    plan = Scheduler(None, clock=FakeClock(10.0)).plan(
        [req(1, version=5), req(2, version=5)], server_version=5, bandwidth={1: 4 * MB, 2: MB}, switch=True,
        gang=True, sum_at_ps=True, form_group=False)
    assert not plan.groups and [d.action for d in plan.decisions] == [SEND, SEND]
    assert [(d.rank, d.slot.start, d.slot.end) for d in plan.decisions] == [(1, 10.0, 10.25), (2, 10.25, 11.25)]


def test_gang_plans_with_the_newer_of_a_workers_hint_and_what_the_ps_measured():
    """A worker computing its models from its groups' sums sends the same hint (its first pull's) with every
    request: a closed group's measurement of it, newer, is what the batches plan with, until its hint changes."""
    clock = FakeClock(0.0)
    service = GrantService(Scheduler(None, clock=clock), lambda: 0, switch_slots=64, gang=True, ps_member=3)
    for rank in range(3):
        service.register(rank)
        service.hint(rank, 3e6)
    assert service._expected() == {0, 1, 2}
    clock.now = 1.0
    service.observe(2, 500_000, 1.0)  # its group closed with a sixth of its update in after 1 s
    service.hint(2, 3e6)  # the same hint again: no newer than the measurement
    assert service._rates()[2] == pytest.approx(5e5) and service._expected() == {0, 1}
    clock.now = 2.0
    service.hint(2, 2.9e6)  # it pulled again: a new hint
    assert service._rates()[2] == 2.9e6 and service._expected() == {0, 1, 2}
    # Without gang rounds only the measurements count, as before.
    plain = GrantService(Scheduler(None), lambda: 0)
    plain.hint(0, 3e6)
    assert 0 not in plain._rates()


def _refresh_cycle(window: float, max_defer: float,
                   refresh: float) -> tuple[GrantService, dict, Callable[..., threading.Thread], threading.Thread]:
    """Ranks 0 and 1 ask on version 4, rank 2 on version 1 (dropped as stale) and again ``refresh`` s later on 4,
    after the pair was planned without it; the pair's group is then applied (version 6)."""
    version, service, decisions, ask = _three_on_version_4(window, max_defer)

    pair = [ask(0, 0, 4), ask(1, 0, 4)]
    ask(2, 0, 1).join(10)
    assert decisions["2:0"].action == DROP
    time.sleep(refresh)
    for t in pair:
        t.join(10)
    assert service.stats.groups == 1 and "2:1" not in decisions  # planned without it: it came too late
    late = ask(2, 1, 4)  # its fresh start, while the pair's group is in flight
    time.sleep(0.05)
    version["now"] = 6
    service.settled(["0:0", "1:0"])
    return service, decisions, ask, late


def test_gang_waits_for_a_fresh_start_as_long_as_that_worker_s_last_one_took():
    # Rank 2's stale request is dropped. Its first fresh start is of unknown length: the pair waits for it up to twice
    # the 0.5 s window, and it asks after 0.75 s (with only the window it missed the first two groups of every run of
    # the dynamic cluster by 60-70 ms). The next time the pair waits a quarter longer than that, 0.94 s, and the
    # three form one group again. Before, the pair went on without it at the end of every window, and its request,
    # arriving during their group, was stale again (the dynamic cluster's third worker, 7 groups in a row).
    version, service, decisions, ask = _three_on_version_4(window=0.5, max_defer=3.0)

    for step, (on, stale_on) in enumerate(((4, 1), (6, 4))):
        pair = [ask(0, step, on), ask(1, step, on)]
        ask(2, 2 * step, stale_on).join(10)
        assert decisions[f"2:{2 * step}"].action == DROP
        time.sleep(0.65)
        assert all(t.is_alive() for t in pair)  # past the 0.5 s window: still waiting for rank 2
        if step:
            assert service._refresh_seconds[2] >= 0.75
        time.sleep(0.1)
        fresh = ask(2, 2 * step + 1, on)
        for t in [*pair, fresh]:
            t.join(10)
        members = (f"0:{step}", f"1:{step}", f"2:{2 * step + 1}")
        assert {decisions[k].action for k in members} == {AGGREGATE}
        assert len({decisions[k].group for k in members}) == 1 and service.stats.groups == step + 1
        version["now"] = 6
        service.settled(list(members))


def test_gang_does_not_wait_for_a_worker_whose_fresh_start_takes_longer_than_max_defer():
    # Its last fresh start took 1.5 s against max_defer 1 s (and twice the window, 1.6 s): the pair no longer waits
    # for it, not even the window.
    service, decisions, ask, late = _refresh_cycle(window=0.8, max_defer=1.0, refresh=1.5)
    assert service._refresh_seconds[2] >= 1.5
    began = time.monotonic()
    pair = [ask(0, 1, 6), ask(1, 1, 6)]
    for t in [*pair, late]:
        t.join(10)
    assert decisions["2:1"].action == DROP and {decisions[k].action for k in ("0:1", "1:1")} == {AGGREGATE}
    assert time.monotonic() - began < 0.6  # not the 0.8 s window


def test_gang_a_batch_of_only_a_slow_workers_request_marks_no_fast_worker_missed():
    """The fast pair's group was just applied and neither has asked again when the slow worker's request (not one
    the group waits for) is planned: that batch waited for nobody, so the first of the pair to ask still waits for
    the other (a lone request) instead of going alone."""
    service = GrantService(Scheduler(None, default_bandwidth=1e6, max_defer=5.0), lambda: 0, batch_window=0.05,
                           switch_slots=64, gang=True, ps_member=3)
    for rank, rate in enumerate((1e6, 1e6, 1e5)):
        service.register(rank)
        service.hint(rank, rate)
    decisions: dict = {}
    _ask(service, decisions, 2, 0, on=0).join(10)
    assert decisions["2:0"].action == SEND and service._missed == set()
    first = _ask(service, decisions, 0, 0, on=0)
    first.join(0.5)  # ten windows: still waiting for rank 1
    assert first.is_alive() and service.stats.groups == 0
    second = _ask(service, decisions, 1, 0, on=0)
    for t in (first, second):
        t.join(10)
    assert decisions["0:0"].action == decisions["1:0"].action == AGGREGATE
    assert decisions["0:0"].group == decisions["1:0"].group and service.stats.groups == 1


def test_gang_a_request_that_waited_through_a_group_waits_for_its_members_to_ask_again():
    """Rank 2 (slower than the pair, still fast enough to join it) was deferred by the pair's group, and a slow
    worker asked meanwhile: once the group is over, that batch waits for the pair's next requests (their window
    runs from the group's end) instead of putting rank 2 alone in the switch at its own pace."""
    service = GrantService(Scheduler(None, default_bandwidth=1e6, max_defer=1.0), lambda: 0, batch_window=0.3,
                           switch_slots=64, gang=True, ps_member=4)
    for rank, rate in enumerate((1e6, 1e6, 4e5, 1e4)):
        service.register(rank)
        service.hint(rank, rate)
    decisions: dict = {}
    pair = [_ask(service, decisions, rank, 0, on=0) for rank in (0, 1)]
    deferred = _ask(service, decisions, 2, 0, on=0)
    for t in pair:
        t.join(10)
    group = decisions["0:0"].group
    assert service.group_members(group) == ("0:0", "1:0") and deferred.is_alive()
    slow = _ask(service, decisions, 3, 0, on=0)
    slow.join(0.4)  # more than a window: the slow worker's request waits through the group
    assert slow.is_alive() and deferred.is_alive()
    service.settled(["0:0", "1:0"])
    service.switch_group_over(group)
    time.sleep(0.05)  # the pair computes ...
    again = [_ask(service, decisions, rank, 1, on=0) for rank in (0, 1)]  # ... and asks again
    for t in again:
        t.join(10)
    assert decisions["0:1"].action == AGGREGATE and decisions["0:1"].group == decisions["1:1"].group
    # Rank 2 joined the pair's group or still waits (for the next, or the PS): no group of its own before it.
    assert "2:0" not in decisions or decisions["2:0"].group == decisions["0:1"].group
    service.settled(["0:1", "1:1"])
    service.switch_group_over(decisions["0:1"].group)
    for t in (deferred, slow):
        t.join(10)


def test_gang_a_lone_request_waits_for_a_refreshing_partner_only_as_a_batch_would():
    """Rank 1's stale request is dropped (it starts again from the newest version): rank 0's request, alone, waits
    for its fresh one as any batch would (the window, its fresh start's first time), not max_defer."""
    service = GrantService(Scheduler(None, default_bandwidth=1e6, max_defer=5.0), lambda: 4, batch_window=0.2,
                           switch_slots=64, gang=True)
    for rank in range(2):
        service.register(rank)
    decisions: dict = {}
    began = time.monotonic()
    fresh, stale = _ask(service, decisions, 0, 0, on=4), _ask(service, decisions, 1, 0, on=1)
    for t in (fresh, stale):
        t.join(10)
    assert decisions["1:0"].action == DROP and decisions["0:0"].action == SEND  # alone: to the PS
    assert time.monotonic() - began < 2.0  # the 0.2 s window, not max_defer (5 s)
