"""The scheduler at work inside the PS: batches requests, plans them, answers each at its slot.

A worker's ``request`` blocks in :meth:`GrantService.request` until its batch is
planned (when every registered worker that has nothing in flight has asked, or after
``batch_window`` seconds; in gang rounds, every such worker at least half as fast as the
fastest, but not one a batch already waited for in vain, until it asks again) and then until
its slot starts: the answer *is* the grant, so a worker sends only when granted. An
aggregator's ``agg_grant`` waits for the aggregate's slot the same way. The PS reports each
applied or dropped update (:meth:`settled`) and each measured transfer (:meth:`observe`); a
grant whose update never arrives expires ``grace`` seconds after its slot.

With ``switch_slots`` (the job's switch slots, ``switch_aggregation``), a group may be summed in
the switch as a subset round of its members: one such group at a time (they share the job's
slots), each with a round base past the previous one's rounds (:meth:`switch_round`). A node
that took over as primary starts ``SWITCH_ROUND_MARGIN`` past the rounds of the last
aggregate it applied (``switch_floor``, replicated with the updates), so that its first subset
rounds are new to the switch even if some of the old primary's groups were never applied
(the primary replicates :attr:`switch_next` with every update it applies).

With ``gang`` as well (the PS multicasts its versions), every batch is one switch group (the
scheduler's item 6): a batch is not planned while a switch group is in flight, and a deferred
request stays pending, planned again with the next batch (which is due once a request that
was not deferred arrived, or once the oldest deferred one waited the scheduler's ``max_defer``).
A gang round sums gradients of one version: a request computed on an older version than the
newest in its batch, from a worker fast enough to join the group, is dropped as ``stale`` (its
worker starts again from the newest), and the batch waits for that worker's fresh request: while
the window is open, or, once such a fresh start of that worker was timed, a quarter longer than
it took, unless that is more than twice the window or ``max_defer`` (then not at all)
(:meth:`_drop_stale`, :meth:`_due`). A slower worker's stale request is kept: the scheduler sends
it to the PS after the group if its delay fits the bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from netagg import wire
from netagg.hoststack.transport import subset_round_uses
from netagg.mlfabric.scheduler import (
    AGGREGATE,
    DEFER,
    DROP,
    AggregateGroup,
    BandwidthEstimator,
    Decision,
    Scheduler,
    TransferRequest,
)

log = logging.getLogger(__name__)

#: How far past the replicated floor a new primary starts its subset rounds (< 2**15: still "ahead").
SWITCH_ROUND_MARGIN = 1 << 14
#: The reason that starts a drop of a gang round's stale request: the worker starts again from the newest version.
STALE = "stale"
#: Updates whose subset exchange would use more rounds per slot than this go direct or to a worker.
MAX_SWITCH_ROUND_USES = 1 << 12
#: A switch group with the PS as a member closes its rounds at this factor times its planned transfer (its slowest
#: member's): a member whose link fell since the plan no longer holds up the others ...
SWITCH_DEADLINE = 1.25
#: ... but never sooner than this (seconds): small updates, a busy host's wake-ups.
SWITCH_DEADLINE_FLOOR = 0.2
#: A switch group without the PS (nobody closes its rounds) is given up by its members at this factor times its
#: planned transfer, and they push their own updates: a member whose link collapsed (measured: a two-member group
#: took 28 s and 41 s instead of 0.4 s) holds the others up no longer than that ...
SWITCH_GIVE_UP = 4.0
#: ... and never sooner than this (seconds).
SWITCH_GIVE_UP_FLOOR = 2.0


def switch_round_uses(size: int, slot_count: int, width: int = wire.K) -> int:
    """Round numbers a subset exchange of a ``size``-byte float32 update uses per slot (``width`` values per
    packet: the job's)."""
    return subset_round_uses(-(-size // (4 * width)), slot_count)


@dataclass
class _Pending:
    request: TransferRequest
    decision: Decision | None = None
    #: Deferred by an earlier batch (gang mode).
    deferred: bool = False


@dataclass
class GrantStats:
    """What the scheduler decided so far."""

    batches: int = 0
    sent: int = 0
    #: Requests deferred to a later batch (counted once per batch that deferred them).
    deferred: int = 0
    #: Gang rounds: requests dropped as computed on an older version than the round's (their workers refresh).
    refreshed: int = 0
    aggregated: int = 0
    groups: int = 0
    dropped: int = 0
    expired: int = 0
    #: (start, end) of every slot granted on the PS's link (direct sends and aggregates), in time order.
    ps_slots: list[tuple[float, float]] = field(default_factory=list)


class GrantService:
    """Thread-safe batching and granting around a :class:`Scheduler`."""

    def __init__(self, scheduler: Scheduler, version: Callable[[], int], *, batch_window: float = 0.01,
                 grace: float = 2.0, keep_slots: int = 10_000, switch_slots: int = 0, switch_width: int = wire.K,
                 switch_floor: Callable[[], int] = lambda: 0, gang: bool = False, ps_member: int | None = None,
                 on_switch_group: Callable[[dict, int], None] | None = None,
                 switch_deadline: float = SWITCH_DEADLINE,
                 take_held: Callable[[int], list[tuple[str, int, int]]] | None = None) -> None:
        """``ps_member``: the PS's own rank in the job's switch groups (``ps_members``): every switch group's
        members include it, and ``on_switch_group(grant, size)`` is called (under the lock: it must not block)
        as each is planned, so that the PS takes part and receives the sum; no member is told to push it.
        ``switch_deadline``: with a PS member, each group's grant carries ``deadline``: this factor times the
        group's planned transfer (its slowest member's, at the rates the plan used; at least
        ``SWITCH_DEADLINE_FLOOR`` s). The PS closes the group's rounds still open then; a member that has not
        arrived misses them (docs/mlfabric.md, "Deadline rounds"). 0: groups wait for every member.
        ``take_held(group)``: with a PS member, the parts of the single pushes the PS holds for the next switch group
        (mlfabric/held_pushes.py), called under the lock as each group is planned: they join its parts (``held``),
        and the PS's contribution to the sum is theirs."""
        if switch_deadline < 0:
            raise ValueError(f"switch_deadline {switch_deadline}: must be >= 0")
        self.switch_deadline = switch_deadline
        self.scheduler = scheduler
        self.clock = scheduler.clock
        self.version = version
        self.batch_window = batch_window
        self.grace = grace
        self.keep_slots = keep_slots
        self.bandwidth = BandwidthEstimator(scheduler.default_bandwidth)
        #: Rates workers report for themselves (:meth:`hint`): gang rounds plan with these where known.
        self.hints: dict[int, float] = {}
        #: When each rank's hint last changed, and when it was last measured here: the newer one plans.
        self._hinted_at: dict[int, float] = {}
        self._measured_at: dict[int, float] = {}
        self.stats = GrantStats()
        self._registered: set[int] = set()
        #: Gang rounds: workers a batch waited for in vain (not busy with an update, no request); batches wait for
        #: them again once they ask (or tell their rate), not before.
        self._missed: set[int] = set()
        #: Gang rounds: when each worker whose stale request was dropped was told to start again (_drop_stale), and
        #: how long its last such fresh start took until its next request (its model's fetch and its compute).
        self._refreshing: dict[int, float] = {}
        self._refresh_seconds: dict[int, float] = {}
        #: When the last switch group was over (the window of a batch that waited through it runs from then).
        self._switch_free_at = float("-inf")
        #: The last wait logged at DEBUG (_trace).
        self._traced: tuple[str, set[int]] | None = None
        self._aggregators: set[int] = set()
        self._pending: list[_Pending] = []
        #: update id -> (gradients, rank, expiry) for granted updates not yet applied or dropped.
        self._in_flight: dict[str, tuple[int, int, float]] = {}
        self._groups: dict[int, AggregateGroup] = {}
        self._busy_until: dict[int, float] = {}
        self._link_free_at = 0.0
        self.switch_slots = switch_slots
        self.switch_width = switch_width
        self.gang = gang and switch_slots > 0
        self._switch_floor = switch_floor
        #: Round base of the next subset round (None: not yet decided, see the module docstring).
        self._switch_next: int | None = None
        #: group -> what its members are told (:meth:`switch_grant`), for the switch group in flight (at most one).
        self._switch_grants: dict[int, dict] = {}
        self.ps_member = ps_member if switch_slots else None
        self._on_switch_group = on_switch_group
        self._take_held = take_held
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
                    "hints": {str(k): v for k, v in self.hints.items()},
                    "in_flight": len(self._in_flight)}

    def group_members(self, group: int) -> tuple[str, ...]:
        """The update ids aggregated in ``group`` (KeyError if unknown or expired)."""
        with self._cond:
            return self._groups[group].members

    def observe(self, rank: int, nbytes: int, seconds: float, *, at_least: bool = False,
                closed: bool = False) -> None:
        """A transfer of ``rank``'s measured here: a push, or a switch group closed at its deadline. ``at_least``:
        it only shows that ``rank``'s rate is at least this (another member held it back): a lower estimate is
        raised to it, a higher one kept. ``closed``: what the slowest member of a group closed at its deadline got
        in: a fall is taken at once (see :meth:`FabricServer._observe_closed`)."""
        with self._cond:
            if at_least:
                if not self.bandwidth.raise_to(rank, nbytes, seconds):
                    return
            else:
                self.bandwidth.observe(rank, nbytes, seconds, falls_at_once=closed)
            if nbytes > 0 and seconds >= self.bandwidth.min_seconds:
                self._measured_at[rank] = self.clock()

    def hint(self, rank: int, rate: float) -> None:
        """``rank`` received the model through the switch at ``rate`` bytes/s lately. In gang rounds only the
        leader pushes to the PS, so pushes measure the leaders; the members' own hints cover the others."""
        with self._cond:
            if self.hints.get(rank) != rate:  # the same rate again (its last pull's) is no new measurement
                self._hinted_at[rank] = self.clock()
            self.hints[rank] = rate
            self._missed.discard(rank)

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
            self._missed.discard(request.rank)
            if (dropped := self._refreshing.pop(request.rank, None)) is not None:
                self._refresh_seconds[request.rank] = self.clock() - dropped
            self._pending.append(entry)
            self._cond.notify_all()
            log.debug("request %s on version %d", request.update_id, request.version)
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

    def switch_group_in_flight(self) -> bool:
        """Whether a switch group was granted and is not yet applied, dropped or expired."""
        with self._cond:
            return bool(self._switch_grants)

    def switch_grant(self, group: int) -> dict | None:
        """What the members of switch group ``group`` need (None if it is not one in flight): the members'
        bitmap, the round base (mod 2**16), the leader (who pushes the sum) and the parts it pushes; with a PS
        member, ``ps``: its rank (the PS receives the sum from the switch; nobody pushes it)."""
        with self._cond:
            grant = self._switch_grants.get(group)
            return None if grant is None else {**grant, "parts": [list(p) for p in grant["parts"]]}

    def switch_parts_besides(self, update_id: str) -> list[str]:
        """The other parts of the switch group in flight that holds ``update_id`` (none if no such group)."""
        with self._cond:
            for grant in self._switch_grants.values():
                ids = [str(p[0]) for p in grant["parts"]]
                if update_id in ids:
                    return [i for i in ids if i != update_id]
            return []

    def in_switch_group(self, update_id: str) -> bool:
        """Whether ``update_id`` is a part of a switch group in flight."""
        with self._cond:
            return any(update_id == str(p[0]) for grant in self._switch_grants.values() for p in grant["parts"])

    def switch_group_over(self, group: int) -> None:
        """Switch group ``group`` is over for the PS: its sum was applied, or the PS's part failed (none of its
        rounds completes for the PS). The job's slots are free for the next group (whose rounds are past this
        one's) while members left out of the sum, or all of them after a failure, push their own updates."""
        with self._cond:
            if self._switch_grants.pop(group, None) is not None:
                self._switch_free_at = self.clock()
            self._cond.notify_all()

    @property
    def switch_next(self) -> int:
        """Past every round this node's subset rounds used so far (unwrapped; 0 before the first)."""
        with self._cond:
            return self._switch_next or 0

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
        if self.gang and self._switch_fits(self._pending):
            if self._switch_grants:  # one round at a time: wait until its group is applied or expired
                self._trace("switch group in flight", set(self._switch_grants))
                return self.batch_window
            if all(p.deferred for p in self._pending):  # nothing new since they were deferred
                oldest = min(p.request.arrival for p in self._pending)
                return oldest + self.scheduler.max_defer - self.clock()
        busy = {rank for _, rank, _ in self._in_flight.values()}
        asking = {p.request.rank for p in self._pending}
        expected = self._expected()
        joining = [p for p in self._pending if p.request.rank in expected]
        if self.gang and len({p.request.rank for p in joining}) == 1 and self._switch_fits(self._pending):
            in_groups = {self._in_flight[m][1] for g in self._switch_grants for m in self._groups[g].members
                         if g in self._groups and m in self._in_flight}
            # A partner getting the newest model after its stale request was dropped is waited for as _due says
            # (as long as its last fresh start took, or the window), not max_defer: measured, the dynamic
            # cluster's slow worker, rated at the default, asked 6 s late with a stale gradient, was dropped, and
            # the fast worker's next request waited its whole max_defer (1 s) for a fresh one that took 4 s.
            if (expected - in_groups - asking) - set(self._refreshing):
                self._trace("lone request waits for", expected - in_groups - asking)
                # Gang rounds: a lone request of a worker fast enough to join a group waits for its fast partners
                # up to max_defer, also while they are busy with their own updates or getting their next model, and
                # also beside slow workers' requests (which join no group): planned at once, it would go to the PS
                # alone, and each partner, asking while it is in flight, alone after it; the workers would take
                # turns instead of summing in the switch (measured: a slow worker's request in every other batch
                # sent the fast two to the PS one by one).
                return min(p.request.arrival for p in joining) + self.scheduler.max_defer - self.clock()
        if not (expected - busy - asking):
            return 0.0
        self._trace("batch waits for", expected - busy - asking)
        # The window runs from the first request not deferred (a deferred one has had its window), or in gang rounds
        # from the end of the last switch group where the batch waited through it: its members are about to ask
        # again. Measured before: a request deferred by the fast pair's group, beside a slow worker's, was planned
        # the moment that group was over, alone in the switch at its slower link's pace (0.8 s), while the pair
        # asked 10-100 ms later and waited for it.
        oldest = min((p.request.arrival for p in self._pending if not p.deferred),
                     default=min(p.request.arrival for p in self._pending))
        if self.gang:
            oldest = max(oldest, self._switch_free_at)
        return self._due(oldest, expected - busy - asking) - self.clock()

    def _trace(self, why: str, whom: set[int]) -> None:
        """Debug log of what a batch waits for (once per change)."""
        if log.isEnabledFor(logging.DEBUG) and (why, whom) != self._traced:
            self._traced = (why, set(whom))
            log.debug("%s %s (pending %s)", why, sorted(whom), [p.request.update_id for p in self._pending])

    def _due(self, oldest: float, awaited: set[int]) -> float:
        """When a batch whose first request came at ``oldest`` is planned while it waits for ``awaited``: at the end
        of its window; for a worker getting the newest model after its stale request was dropped (_drop_stale), once
        a quarter more than its last such fresh start took has passed, unless that is more than twice the window (or
        ``max_defer``) after ``oldest`` (then it is not waited for at all); its first fresh start, of unknown length,
        up to twice the window. ``oldest`` itself when nobody is worth waiting for.
        Measured: the dynamic cluster's third worker (100 ms of compute more, its model over its own link) took
        0.35-0.4 s to ask again; every batch of the fast two waited its 0.3 s window for it, planned without it,
        and its request, arriving during their group, was stale again: 7 groups in a row, 2.1 s of a 14.8 s run.
        With only the window for its first fresh start, it missed the first two groups of every run by 60-70 ms."""
        # At most twice the window: a worker whose fresh start takes longer holds the others for more than its
        # gradient adds to their group.
        now, limit = self.clock(), min(self.scheduler.max_defer, 2 * self.batch_window)
        due = None
        for rank in awaited:
            dropped, took = self._refreshing.get(rank), self._refresh_seconds.get(rank)
            until = oldest + self.batch_window
            if dropped is not None:
                expect = None if took is None else dropped + 1.25 * took
                if now > dropped + limit or (expect is not None and expect > oldest + limit):
                    continue  # not coming in time
                until = max(until, expect if expect is not None else min(oldest, dropped) + limit)
            due = until if due is None else max(due, until)
        return oldest if due is None else due

    def _expected(self) -> set[int]:
        """The workers a batch waits for: all registered ones; in gang rounds those at least half as fast as the
        fastest (a third with the PS in the group; a slower one would not join the group: see the scheduler's item
        6), and of them not one a batch already waited for in vain, until it asks again. Measured: the slow one of
        the static cluster got no versions through the switch and sent no rate, and every batch waited its whole
        window for it; in the dynamic cluster a worker whose link had fallen since its last request (its rate was
        that request's) spent 12-16 s getting models, and every batch of the fast two waited its window for it."""
        if not self.gang:
            return self._registered
        return self._fast(self._registered - self._missed)

    def _fast(self, ranks: set[int]) -> set[int]:
        """Of ``ranks``, those fast enough to join the fastest's group (gang rounds; see :meth:`_expected`)."""
        rates = self._rates()
        rate = {r: rates.get(r, self.scheduler.default_bandwidth) for r in ranks}
        fastest = max(rate.values(), default=0.0)
        return {r for r, v in rate.items() if v >= fastest / (3 if self.ps_member is not None else 2)}

    def _rates(self) -> dict[int, float]:
        """Bytes/s per rank to plan with: measured here (pushes, closed switch groups), and in gang rounds the
        workers' own hints where newer. A worker that computes its models from its groups' sums never pulls again,
        and its hint stays that of its first pull, when every worker pulled at once: measured, the dynamic cluster's
        two slow workers, after a first group that closed at its deadline with half their values missing, were
        still rated as fast as the others, and took the switch as a group of their own for 1.8 s."""
        measured = self.bandwidth.snapshot()
        if not self.gang:
            return measured
        return {**measured, **{rank: rate for rank, rate in self.hints.items()
                               if self._hinted_at.get(rank, 0.0) >= self._measured_at.get(rank, float("-inf"))}}

    def _expire(self) -> None:
        now = self.clock()
        for update_id, (_, _, expiry) in list(self._in_flight.items()):
            if expiry < now:
                del self._in_flight[update_id]
                self.stats.expired += 1
        for group, planned in list(self._groups.items()):
            if planned.slot.end + self.grace < now:
                del self._groups[group]
        for group in list(self._switch_grants):
            if group not in self._groups or not any(m in self._in_flight for m in self._groups[group].members):
                del self._switch_grants[group]  # applied, dropped or expired: the switch's slots are free
                self._switch_free_at = now

    def _switch_fits(self, batch: list[_Pending]) -> bool:
        """The job has switch slots and every update of ``batch`` fits a subset exchange."""
        return bool(self.switch_slots) and all(
            switch_round_uses(p.request.size, self.switch_slots, self.switch_width) <= MAX_SWITCH_ROUND_USES
            for p in batch)

    def _switch_possible(self, batch: list[_Pending]) -> bool:
        return not self._switch_grants and self._switch_fits(batch)

    def _drop_stale(self, batch: list[_Pending], now: float) -> list[_Pending] | None:
        """Gang rounds sum gradients of one version: where the batch has requests computed on the newest
        (``base``), the older ones are dropped, their workers told to start from ``base``. If such a worker is
        one the batch waits for and the window is still open, the others wait for its fresh request (returns
        None: nothing else is planned now); else returns the batch without the dropped ones."""
        base = self.version() + sum(c for c, _, _ in self._in_flight.values())
        fresh = [p for p in batch if p.request.version >= base]
        # Only a worker the batch waits for (one fast enough to join the group) starts again: a slower one would
        # be stale again by the time its fresh request came (its model arrives over its slow link), so none of its
        # updates would ever count. Its stale one stays, and the scheduler sends it after the group within the
        # delay bound, as async would.
        expected = self._expected()
        stale = [p for p in batch if p.request.version < base and not p.deferred and p.request.rank in expected]
        if not fresh or not stale:
            return batch
        for entry in stale:
            delay = base - entry.request.version
            entry.decision = Decision(entry.request.update_id, entry.request.rank, DROP, predicted_version=base,
                                      predicted_delay=delay, reason=f"{STALE}: computed on version "
                                      f"{entry.request.version}, this round sums version {base}")
            self.stats.dropped += 1
            self.stats.refreshed += 1
            self._refreshing[entry.request.rank] = now
            log.debug("%s dropped: computed on version %d, the round sums %d", entry.request.update_id,
                      entry.request.version, base)
        rest = [p for p in batch if p not in stale]
        oldest = min(p.request.arrival for p in fresh)
        if self._due(oldest, {p.request.rank for p in stale}) > now:
            self._pending = rest + self._pending
            self._cond.notify_all()
            return None
        return rest

    def _plan(self) -> None:
        batch, self._pending = self._pending, []
        now = self.clock()
        if self.gang and self._switch_fits(batch):
            kept = self._drop_stale(batch, now)
            if kept is None:
                return
            batch = kept
        expected = self._expected() if self.gang else set()
        if expected & {p.request.rank for p in batch}:
            # A worker this batch waited for in vain (not busy, did not ask): not again until it asks. Only a batch
            # with a request of the group's: one of only slow or stale requests, planned as soon as the last group
            # was applied, waited for nobody (measured: a slow worker's request, planned the moment the fast three's
            # group was applied, marked all three missed; the first of them to ask then went alone, and the three
            # took turns from then on: 1 or 2 in a group instead of 3, for the rest of the run).
            self._missed |= expected - {p.request.rank for p in batch} - {
                rank for _, rank, _ in self._in_flight.values()}
        asking = {p.request.rank for p in batch}
        idle = sorted(r for r in self._aggregators
                      if r not in asking and self._busy_until.get(r, 0.0) <= now
                      and r not in {rank for _, rank, _ in self._in_flight.values()})
        # With the PS in the groups, a batch of only slow workers (none fast enough to join the fastest's group)
        # forms no group: its requests are pushed, and the PS holds each for the next group of the fast ones (held
        # pushes). A group of its own would hold the job's one switch group at its slow links' pace while the fast
        # workers' next requests waited (measured: the slow worker of the dynamic cluster alone in the switch for
        # 1.7 s, the three others waiting as long).
        fast = self._fast(self._registered) if self.gang and self.ps_member is not None else set()
        form_group = not fast or any(p.request.rank in fast for p in batch)
        plan = self.scheduler.plan([p.request for p in batch], server_version=self.version(),
                                   in_flight=sum(c for c, _, _ in self._in_flight.values()),
                                   bandwidth=self._rates(), idle=idle,
                                   link_free_at=self._link_free_at, switch=self._switch_possible(batch),
                                   gang=self.gang, sum_at_ps=self.ps_member is not None, form_group=form_group)
        self._link_free_at = plan.link_free_at
        self.stats.batches += 1
        slots = []
        for entry in batch:
            decision = plan.decision(entry.request.update_id)
            if decision.action == DEFER:
                entry.deferred = True
                self._pending.append(entry)
                self.stats.deferred += 1
                continue
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
            if group.at_switch:
                if self._switch_next is None:
                    self._switch_next = self._switch_floor() + SWITCH_ROUND_MARGIN
                parts = [[p.request.update_id, p.request.rank, p.request.version]
                         for p in batch if p.decision is not None and p.decision.group == group.group]
                ranks = [rank for _, rank, _ in parts]
                held = [list(p) for p in self._take_held(group.group)] \
                    if self.ps_member is not None and self._take_held is not None else []
                grant = {"members": wire.members_of(ranks if self.ps_member is None else [*ranks, self.ps_member]),
                         "round": self._switch_next & 0xFFFF, "leader": group.aggregator, "parts": parts + held}
                if held:
                    grant["held"] = [p[0] for p in held]
                planned = max((p.decision.slot.end - p.decision.slot.start for p in batch
                               if p.decision is not None and p.decision.group == group.group
                               and p.decision.slot is not None), default=0.0)
                if self.ps_member is not None:
                    grant["ps"] = self.ps_member
                    if self.switch_deadline > 0:
                        grant["deadline"] = max(SWITCH_DEADLINE_FLOOR, self.switch_deadline * planned)
                else:
                    grant["give_up"] = max(SWITCH_GIVE_UP_FLOOR, SWITCH_GIVE_UP * planned)
                self._switch_grants[group.group] = grant
                self._switch_next += switch_round_uses(group.size, self.switch_slots, self.switch_width)
                if self.ps_member is not None and self._on_switch_group is not None:
                    self._on_switch_group({**grant, "parts": [list(p) for p in grant["parts"]],
                                           "group": group.group}, group.size)
            self._busy_until[group.aggregator] = group.slot.end
            self.stats.groups += 1
            slots.append((group.slot.start, group.slot.end))
            for member in group.members:  # members stay in flight until the aggregate is applied
                count, rank, _ = self._in_flight[member]
                self._in_flight[member] = (count, rank, group.slot.end + self.grace)
        self.stats.ps_slots.extend(sorted(slots))
        del self.stats.ps_slots[:-self.keep_slots]
        self._cond.notify_all()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("batch at version %d: %s; groups %s; rates (kB/s) %s", self.version(),
                      [(p.request.update_id, p.request.version, "defer" if p.decision is None else p.decision.action)
                       for p in batch], [list(g.members) for g in plan.groups],
                      {rank: round(rate / 1e3) for rank, rate in sorted(self._rates().items())})

    def _sleep_until(self, start: float, deadline: float) -> None:
        while (left := start - self.clock()) > 0 and time.monotonic() < deadline:
            time.sleep(min(left, 0.05))

