"""The scheduler at work inside the PS: batches requests, plans them, answers each at its slot.

A worker's ``request`` blocks in :meth:`GrantService.request` until its batch is
planned (when every registered worker that has nothing in flight has asked, or after
``batch_window`` seconds) and then until its slot starts: the answer *is* the grant,
so a worker sends only when granted. An aggregator's ``agg_grant`` waits for the
aggregate's slot the same way. The PS reports each applied or dropped update
(:meth:`settled`) and each measured transfer (:meth:`observe`); a grant whose update
never arrives expires ``grace`` seconds after its slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from netagg.mlfabric.scheduler import (
    AGGREGATE,
    DROP,
    AggregateGroup,
    BandwidthEstimator,
    Decision,
    Scheduler,
    TransferRequest,
)


@dataclass
class _Pending:
    request: TransferRequest
    decision: Decision | None = None


@dataclass
class GrantStats:
    """What the scheduler decided so far."""

    batches: int = 0
    sent: int = 0
    aggregated: int = 0
    groups: int = 0
    dropped: int = 0
    expired: int = 0
    #: (start, end) of every slot granted on the PS's link (direct sends and aggregates), in time order.
    ps_slots: list[tuple[float, float]] = field(default_factory=list)


class GrantService:
    """Thread-safe batching and granting around a :class:`Scheduler`."""

    def __init__(self, scheduler: Scheduler, version: Callable[[], int], *, batch_window: float = 0.01,
                 grace: float = 2.0, keep_slots: int = 10_000) -> None:
        self.scheduler = scheduler
        self.clock = scheduler.clock
        self.version = version
        self.batch_window = batch_window
        self.grace = grace
        self.keep_slots = keep_slots
        self.bandwidth = BandwidthEstimator(scheduler.default_bandwidth)
        self.stats = GrantStats()
        self._registered: set[int] = set()
        self._aggregators: set[int] = set()
        self._pending: list[_Pending] = []
        #: update id -> (gradients, rank, expiry) for granted updates not yet applied or dropped.
        self._in_flight: dict[str, tuple[int, int, float]] = {}
        self._groups: dict[int, AggregateGroup] = {}
        self._busy_until: dict[int, float] = {}
        self._link_free_at = 0.0
        self._cond = threading.Condition()

    def register(self, rank: int, can_aggregate: bool = True) -> None:
        """A worker joined; ``can_aggregate``: it runs an aggregation endpoint (it may be chosen as aggregator)."""
        with self._cond:
            self._registered.add(rank)
            if can_aggregate:
                self._aggregators.add(rank)
            self._cond.notify_all()

    def snapshot(self) -> dict:
        """The decision counters, granted PS-link slots and bandwidth estimates, copied under the lock."""
        with self._cond:
            return {**asdict(self.stats), "bandwidth": {str(k): v for k, v in self.bandwidth.snapshot().items()},
                    "in_flight": len(self._in_flight)}

    def group_members(self, group: int) -> tuple[str, ...]:
        """The update ids aggregated in ``group`` (KeyError if unknown or expired)."""
        with self._cond:
            return self._groups[group].members

    def observe(self, rank: int, nbytes: int, seconds: float) -> None:
        with self._cond:
            self.bandwidth.observe(rank, nbytes, seconds)

    def settled(self, update_ids: list[str]) -> None:
        """These updates were applied or dropped at the PS: no longer in flight."""
        with self._cond:
            for update_id in update_ids:
                self._in_flight.pop(update_id, None)
            self._cond.notify_all()

    def request(self, request: TransferRequest, timeout: float = 30.0) -> Decision:
        """Plan ``request`` with its batch; returns at the start of its slot (drops: at once)."""
        deadline = time.monotonic() + timeout
        entry = _Pending(request)
        with self._cond:
            self._registered.add(request.rank)
            self._pending.append(entry)
            self._cond.notify_all()
            while entry.decision is None:
                wait = self._batch_wait()
                if wait <= 0:
                    self._plan()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    self._pending.remove(entry)
                    raise TimeoutError(f"no scheduling decision for {request.update_id} within {timeout} s")
                self._cond.wait(min(wait, left))
        decision = entry.decision
        if decision.action != DROP and decision.slot is not None:
            self._sleep_until(decision.slot.start, deadline)
        return decision

    def group_slot(self, group: int, timeout: float = 30.0) -> AggregateGroup:
        """The aggregator of ``group`` waits here for the aggregate's slot; raises KeyError if unknown."""
        with self._cond:
            planned = self._groups.get(group)
        if planned is None:
            raise KeyError(f"no aggregation group {group} (unknown or expired)")
        self._sleep_until(planned.slot.start, time.monotonic() + timeout)
        return planned

    # -- internals (holding the lock) ------------------------------------------
    def _batch_wait(self) -> float:
        """Seconds until the pending batch is due (<= 0: plan now)."""
        if not self._pending:
            return self.batch_window
        self._expire()
        busy = {rank for _, rank, _ in self._in_flight.values()}
        asking = {p.request.rank for p in self._pending}
        if not (self._registered - busy - asking):
            return 0.0
        oldest = min(p.request.arrival for p in self._pending)
        return oldest + self.batch_window - self.clock()

    def _expire(self) -> None:
        now = self.clock()
        for update_id, (_, _, expiry) in list(self._in_flight.items()):
            if expiry < now:
                del self._in_flight[update_id]
                self.stats.expired += 1
        for group, planned in list(self._groups.items()):
            if planned.slot.end + self.grace < now:
                del self._groups[group]

    def _plan(self) -> None:
        batch, self._pending = self._pending, []
        now = self.clock()
        asking = {p.request.rank for p in batch}
        idle = sorted(r for r in self._aggregators
                      if r not in asking and self._busy_until.get(r, 0.0) <= now
                      and r not in {rank for _, rank, _ in self._in_flight.values()})
        plan = self.scheduler.plan([p.request for p in batch], server_version=self.version(),
                                   in_flight=sum(c for c, _, _ in self._in_flight.values()),
                                   bandwidth=self.bandwidth.snapshot(), idle=idle,
                                   link_free_at=self._link_free_at)
        self._link_free_at = plan.link_free_at
        self.stats.batches += 1
        slots = []
        for entry in batch:
            decision = plan.decision(entry.request.update_id)
            entry.decision = decision
            if decision.action == DROP:
                self.stats.dropped += 1
                continue
            assert decision.slot is not None
            self._in_flight[decision.update_id] = (entry.request.count, entry.request.rank,
                                                   decision.slot.end + self.grace)
            self._busy_until[entry.request.rank] = decision.slot.end
            if decision.action == AGGREGATE:
                self.stats.aggregated += 1
            else:
                self.stats.sent += 1
                slots.append((decision.slot.start, decision.slot.end))
        for group in plan.groups:
            self._groups[group.group] = group
            self._busy_until[group.aggregator] = group.slot.end
            self.stats.groups += 1
            slots.append((group.slot.start, group.slot.end))
            for member in group.members:  # members stay in flight until the aggregate is applied
                count, rank, _ = self._in_flight[member]
                self._in_flight[member] = (count, rank, group.slot.end + self.grace)
        self.stats.ps_slots.extend(sorted(slots))
        del self.stats.ps_slots[:-self.keep_slots]
        self._cond.notify_all()

    def _sleep_until(self, start: float, deadline: float) -> None:
        while (left := start - self.clock()) > 0 and time.monotonic() < deadline:
            time.sleep(min(left, 0.05))

