"""MLfabric's network-aware update scheduler: a pure function of a batch of transfer requests.

Given the pending requests (rank, model version, update size, gradient norm), the
senders' measured bandwidths, the PS's version and its link's backlog, and the time
(an injectable clock), :meth:`Scheduler.plan` decides for every request:

1. **Order**: shortest job first by estimated transfer time ``size / bandwidth``
   (ties: larger gradient norm, then earlier arrival, then rank).
2. **Drop** what cannot meet the delay bound: walking that order, an update's predicted
   delay is ``server_version + in_flight + gradients ahead of it - its version``; above the
   bound it is dropped before a byte is sent.
3. **Slots**: each kept update gets a transfer slot on the PS's link, back to back from
   ``max(now, link_free_at)``: no two overlap, and the PS applies them in slot order.
4. **Aggregate** updates that would queue for later (slot start after ``now``): they can
   instead go to an idle worker (no request in this batch, its link free), which sums them
   and sends one update to the PS. Members send to the aggregator in non-overlapping slots
   on its link (at ``min`` of both bandwidths); the aggregate's slot on the PS link starts
   when the last member arrived and the updates ahead of it are done. Of the choices
   "aggregate the first k queued updates" (k >= ``min_aggregate``) or none, the plan takes
   the one with the smallest total completion time over gradients (SJF's own objective),
   none on a tie. Aggregation never raises a member's predicted delay: every member is
   applied at the version the first of them would have seen.
5. **In the switch** (``switch=True``: the job has switch slots and none of its subset rounds is
   in flight): the first k queued updates can instead be summed in the switch, a subset round
   of exactly those members. They send at once, each on its own link; the sum is ready when
   the slowest arrived and reaches every member, and the fastest member (the **leader**)
   pushes it in the aggregate's slot. Switch and idle-worker options compete on the same cost.
6. **Gang** (``gang=True`` with ``switch=True``: the PS multicasts every version, so one version per
   batch serves every worker): the batch's ``k`` fastest kept requests are summed in the switch as
   one group, ``k`` maximising gradients per second of the round, ``k / (t_k + 2p)`` (``t_k``: the
   k-th fastest transfer, ``p``: the fastest member's push of the sum, and about as long the new
   model's send; ties: the larger ``k``); ``k = 1`` (``1 / 2t_1``) means the fastest pushes its
   own update to the PS. So a member up to twice as slow as the fastest joins it. With the PS in the
   group (``sum_at_ps``) nobody pushes the sum, ``k / (t_k + p)``: up to three times as slow, and ``k = 1``
   is a group too (the fastest and the PS: its next model comes back in the same exchange), unless the caller
   says the batch forms no group (``form_group``: only slow workers in it), and then every request is sent.
   Every other kept request is **deferred** to the next batch while its delay still fits the bound after
   this group, else dropped; one that waited ``max_defer`` seconds, or one computed on an older
   version than the group's (no later group sums its version), is sent to the PS after the group.

The class keeps no state but the clock and a group counter; the caller
(:class:`~netagg.mlfabric.grants.GrantService`) carries ``link_free_at`` and the
in-flight count from one batch to the next.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

SEND, AGGREGATE, DROP, DEFER = "send", "aggregate", "drop", "defer"


@dataclass(frozen=True)
class TransferRequest:
    """A worker asks to send one update."""

    rank: int
    update_id: str
    version: int
    size: int
    norm: float = 0.0
    arrival: float = 0.0
    #: Gradients summed in the update (1 for a worker's own).
    count: int = 1


@dataclass(frozen=True)
class Slot:
    """A transfer interval on one link (scheduler clock, seconds)."""

    start: float
    end: float


@dataclass(frozen=True)
class Decision:
    """What one request may do.

    ``send``: to the PS in ``slot`` (PS link). ``aggregate``: to worker ``aggregator`` in
    ``slot`` (the aggregator's link), as part of ``group``. ``drop``: not at all. ``defer``:
    nothing yet, planned again with the next batch (gang mode).
    """

    update_id: str
    rank: int
    action: str
    slot: Slot | None = None
    predicted_version: int | None = None
    predicted_delay: int | None = None
    group: int | None = None
    aggregator: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class AggregateGroup:
    """Updates summed at ``aggregator`` and sent to the PS in ``slot`` as one update."""

    group: int
    aggregator: int
    members: tuple[str, ...]
    slot: Slot
    size: int
    count: int
    predicted_version: int
    #: Summed in the switch (a subset round of the members; ``aggregator`` is the leader, who pushes it).
    at_switch: bool = False


@dataclass(frozen=True)
class Plan:
    """The decisions for one batch, in the order the PS is predicted to apply them."""

    decisions: tuple[Decision, ...]
    groups: tuple[AggregateGroup, ...]
    #: When the PS's link is free again after this plan.
    link_free_at: float
    #: Gradients this plan will add to the PS's version (sent or aggregated, not dropped).
    granted_gradients: int

    def decision(self, update_id: str) -> Decision:
        return next(d for d in self.decisions if d.update_id == update_id)

    def group(self, group: int) -> AggregateGroup:
        return next(g for g in self.groups if g.group == group)


class BandwidthEstimator:
    """Per-rank sending bandwidth (bytes/s): an exponentially weighted mean of measured transfers."""

    def __init__(self, default: float, alpha: float = 0.3, min_seconds: float = 0.002) -> None:
        self.default = default
        self.alpha = alpha
        self.min_seconds = min_seconds
        self._rate: dict[int, float] = {}

    def observe(self, rank: int, nbytes: int, seconds: float, *, falls_at_once: bool = False) -> None:
        """One transfer of ``nbytes`` took ``seconds`` (too short to measure: ignored). ``falls_at_once``: a
        sample below the estimate replaces it (a rise is still averaged in)."""
        if nbytes <= 0 or seconds < self.min_seconds:
            return
        sample = nbytes / seconds
        old = self._rate.get(rank)
        if old is None or (falls_at_once and sample < old):
            self._rate[rank] = sample
        else:
            self._rate[rank] = (1 - self.alpha) * old + self.alpha * sample

    def raise_to(self, rank: int, nbytes: int, seconds: float) -> bool:
        """``rank`` sent at least ``nbytes`` in ``seconds``: an estimate below that rate (the default where it has
        none) becomes it, a higher one is kept. Whether it changed (too short to measure: no)."""
        if nbytes <= 0 or seconds < self.min_seconds or nbytes / seconds <= self.get(rank):
            return False
        self._rate[rank] = nbytes / seconds
        return True

    def get(self, rank: int) -> float:
        return self._rate.get(rank, self.default)

    def snapshot(self) -> dict[int, float]:
        return dict(self._rate)


class Scheduler:
    """Plans batches of transfer requests (see the module docstring)."""

    def __init__(self, delay_bound: int | None, *, default_bandwidth: float = 1.25e6, aggregate: bool = True,
                 min_aggregate: int = 2, max_defer: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if min_aggregate < 2:
            raise ValueError("an aggregate needs at least 2 members")
        self.max_defer = max_defer
        self.delay_bound = delay_bound
        self.default_bandwidth = default_bandwidth
        self.aggregate = aggregate
        self.min_aggregate = min_aggregate
        self.clock = clock
        self._groups = itertools.count(1)

    def plan(self, requests: Sequence[TransferRequest], *, server_version: int, in_flight: int = 0,
             bandwidth: Mapping[int, float] | None = None, idle: Sequence[int] = (),
             link_free_at: float = 0.0, switch: bool = False, gang: bool = False, sum_at_ps: bool = False,
             form_group: bool = True) -> Plan:
        """Decide every request of the batch.

        ``server_version``: the PS's version now; ``in_flight``: gradients granted earlier
        and not applied yet; ``bandwidth``: bytes/s per rank (default ``default_bandwidth``);
        ``idle``: ranks that may aggregate; ``link_free_at``: end of the last granted slot;
        ``switch``: a subset round in the switch may be formed; ``gang``: with ``switch``, plan the
        batch as one switch group (item 6 of the module docstring); ``form_group`` False (gang): no group of this
        batch, every kept request is sent to the PS (a batch of slow workers only, see GrantService).
        """
        now = self.clock()
        rates = dict(bandwidth or {})

        def rate(rank: int) -> float:
            return max(rates.get(rank, self.default_bandwidth), 1e-9)

        order = sorted(requests, key=lambda r: (r.size / rate(r.rank), -r.norm, r.arrival, r.rank, r.update_id))
        base = server_version + in_flight
        drops: list[Decision] = []
        kept: list[TransferRequest] = []
        ahead = 0
        gang = gang and switch
        for req in order:
            delay = base + (0 if gang else ahead) - req.version  # a gang's members all apply at ``base``
            if self.delay_bound is not None and delay > self.delay_bound:
                drops.append(Decision(req.update_id, req.rank, DROP, predicted_version=base + ahead,
                                      predicted_delay=delay,
                                      reason=f"predicted delay {delay} > bound {self.delay_bound}"))
            else:
                kept.append(req)
                ahead += req.count
        start = max(now, link_free_at)
        durations = [req.size / rate(req.rank) for req in kept]
        if gang and kept and not form_group:
            direct = self._direct(kept, durations, start, base)
            ends = [d.slot.end for d in direct if d.slot is not None]
            return Plan(tuple(direct) + tuple(drops), (), max([link_free_at, *ends]), ahead)
        if gang and kept:
            return self._gang(kept, rate, now, start, base, drops, link_free_at, sum_at_ps)
        direct = self._direct(kept, durations, start, base)
        best_cost, best = self._cost(direct), (direct, ())
        queued = sum(1 for d in direct if d.slot is not None and d.slot.start > now)
        senders = {req.rank for req in requests}
        candidates = sorted((r for r in idle if r not in senders), key=lambda r: (-rate(r), r))
        aggregators: list[int | None] = candidates[:1] + ([None] if switch else [])
        if self.aggregate and queued >= self.min_aggregate:
            first_queued = len(kept) - queued
            for aggregator in aggregators:  # None: the switch
                for k in range(self.min_aggregate, queued + 1):
                    option = self._with_aggregate(kept, durations, first_queued, k, aggregator, rate, start, now,
                                                  base)
                    cost = self._cost(option[0], option[1])
                    if cost < best_cost - 1e-12:
                        best_cost, best = cost, option
        decisions, groups = best
        if groups:  # number the chosen group now, so rejected options consume no id
            group_id = next(self._groups)
            groups = tuple(AggregateGroup(group_id, g.aggregator, g.members, g.slot, g.size, g.count,
                                          g.predicted_version, g.at_switch) for g in groups)
            decisions = [Decision(d.update_id, d.rank, d.action, d.slot, d.predicted_version, d.predicted_delay,
                                  group_id, d.aggregator) if d.action == AGGREGATE else d for d in decisions]
        ends = [d.slot.end for d in decisions if d.action == SEND and d.slot] + [g.slot.end for g in groups]
        return Plan(tuple(decisions) + tuple(drops), tuple(groups), max([link_free_at, *ends]), ahead)

    # -- internals -------------------------------------------------------------
    def _gang(self, kept: list[TransferRequest], rate: Callable[[int], float], now: float, start: float, base: int,
              drops: list[Decision], link_free_at: float, sum_at_ps: bool = False) -> Plan:
        """The fastest ``k`` of ``kept`` in one switch group; the others deferred, sent after it, or dropped."""
        by_speed = sorted(kept, key=lambda r: (r.size / rate(r.rank), r.rank, r.update_id))
        leader = by_speed[0].rank
        # A round ends with the new model's send through the switch: about one push of the fastest (``p``).
        push = by_speed[0].size / rate(leader)
        best_k, best_rate = 1, 1.0 / (push + push)  # k = 1: the fastest pushes its own
        for k in range(self.min_aggregate, len(by_speed) + 1):
            ready = by_speed[k - 1].size / rate(by_speed[k - 1].rank)
            push = max(r.size for r in by_speed[:k]) / rate(leader)
            # With the PS in the group the sum reaches it in the exchange: no leader pushes it (``t_k + p``).
            if (throughput := k / (ready + push + (0.0 if sum_at_ps else push))) >= best_rate - 1e-12:
                best_k, best_rate = k, throughput
        decisions: list[Decision] = []
        groups: tuple[AggregateGroup, ...] = ()
        cursor = start
        if best_k == 1 and not sum_at_ps:
            first = by_speed[0]
            decisions.append(Decision(first.update_id, first.rank, SEND, Slot(start, start + first.size / rate(leader)),
                                      base, base - first.version))
            cursor = decisions[0].slot.end
        # With the PS in the group even the fastest alone goes through the switch with it: it sends its update and
        # gets the sum back (its own, quantized as the PS applies it) in one exchange, and computes the next model
        # itself, where a push would be followed by the new version's send.
        members = by_speed[:best_k] if best_k > 1 or sum_at_ps else []
        ahead = first.count if not members else sum(r.count for r in members)
        if members:
            group_id = next(self._groups)
            ready = now + max(r.size / rate(r.rank) for r in members)
            size = max(r.size for r in members)
            slot = Slot(max(ready, start), max(ready, start) + size / rate(leader))
            cursor = slot.end
            groups = (AggregateGroup(group_id, leader, tuple(r.update_id for r in members), slot, size, ahead,
                                     base, True),)
            decisions = [Decision(r.update_id, r.rank, AGGREGATE, Slot(now, now + r.size / rate(r.rank)), base,
                                  base - r.version, group_id, leader) for r in members]
        chosen = {r.update_id for r in by_speed[:best_k]}
        for req in kept:
            if req.update_id in chosen:
                continue
            delay = base + ahead - req.version
            if self.delay_bound is not None and delay > self.delay_bound:
                drops.append(Decision(req.update_id, req.rank, DROP, predicted_version=base + ahead,
                                      predicted_delay=delay, reason=f"not in this round's switch group; predicted "
                                                                    f"delay {delay} > bound {self.delay_bound}"))
            elif req.version >= base and now - req.arrival < self.max_defer:
                decisions.append(Decision(req.update_id, req.rank, DEFER, predicted_version=base + ahead,
                                          predicted_delay=delay, reason="waits for the next round's switch group"))
            else:  # deferred long enough, or stale (no later group sums its version): to the PS after the group
                slot = Slot(cursor, cursor + req.size / rate(req.rank))
                cursor = slot.end
                decisions.append(Decision(req.update_id, req.rank, SEND, slot, base + ahead, delay))
                ahead += req.count
        return Plan(tuple(decisions) + tuple(drops), groups, max(link_free_at, cursor), ahead)

    @staticmethod
    def _direct(kept: list[TransferRequest], durations: list[float], start: float, base: int) -> list[Decision]:
        out, cursor, ahead = [], start, 0
        for req, duration in zip(kept, durations):
            out.append(Decision(req.update_id, req.rank, SEND, Slot(cursor, cursor + duration), base + ahead,
                                base + ahead - req.version))
            cursor += duration
            ahead += req.count
        return out

    def _with_aggregate(self, kept: list[TransferRequest], durations: list[float], first: int, k: int,
                        aggregator: int | None, rate: Callable[[int], float], start: float, now: float,
                        base: int) -> tuple[list[Decision], tuple[AggregateGroup, ...]]:
        """Head direct, then kept[first:first+k] summed at ``aggregator`` (None: in the switch), then the rest."""
        head, members, tail = kept[:first], kept[first:first + k], kept[first + k:]
        decisions = self._direct(head, durations[:first], start, base)
        head_end = decisions[-1].slot.end if decisions else start
        ahead = sum(r.count for r in head)
        at_switch = aggregator is None
        if at_switch:  # the fastest member leads: it pushes the sum
            aggregator = min(members, key=lambda r: (-rate(r.rank), r.rank)).rank
        link_rate = rate(aggregator)
        cursor = ready = now
        member_decisions = []
        for req in members:
            if at_switch:  # every member on its own link, all at once
                slot = Slot(now, now + req.size / rate(req.rank))
            else:  # one after the other on the aggregator's link
                slot = Slot(cursor, cursor + req.size / min(rate(req.rank), link_rate))
                cursor = slot.end
            ready = max(ready, slot.end)
            member_decisions.append(Decision(req.update_id, req.rank, AGGREGATE, slot, base + ahead,
                                             base + ahead - req.version, 0, aggregator))
        size = max(r.size for r in members)
        agg_slot = Slot(max(ready, head_end), max(ready, head_end) + size / link_rate)
        count = sum(r.count for r in members)
        group = AggregateGroup(0, aggregator, tuple(r.update_id for r in members), agg_slot, size, count,
                               base + ahead, at_switch)
        tail_decisions = self._direct(tail, durations[first + k:], agg_slot.end, base + ahead + count)
        return decisions + member_decisions + tail_decisions, (group,)

    @staticmethod
    def _cost(decisions: Sequence[Decision], groups: Sequence[AggregateGroup] = ()) -> float:
        """Total completion time over gradients (an aggregated gradient completes with its aggregate)."""
        total = sum(d.slot.end for d in decisions if d.action == SEND and d.slot is not None)
        total += sum(g.slot.end * len(g.members) for g in groups)
        return total
