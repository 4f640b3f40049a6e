"""Moving running jobs' slots: fair shares that follow the jobs on the switch (docs/controller.md, "Fair shares
that move").

A **move** gives a running job a new slot range (smaller, larger in place, or elsewhere) under a fresh generation,
without stopping it. Its steps, each written to the database before it is acted on:

1. **Start** (:meth:`Moves.start`): the move's row (new range, new generation) is written and the cells the new
   range needs beyond the old one are reserved; the job keeps its old range on the switch meanwhile.
2. **Agree** (:meth:`Moves.ask`, ``ready`` false): every worker asks before each exchange it starts while the
   move is pending (hoststack/moves.py). Until every rank has asked, the answer is "run it on the old slots", and
   the largest such exchange is recorded (``answered``). When the last rank asks, the switch point is one past
   it (``switch_at``): no worker can have started an exchange past ``answered`` without asking.
3. **Switch** (``ready`` true): a worker at the switch point has every result of the exchanges before it. When every
   rank is there nothing is in flight in the old range: the job's row takes the new range and generation (one
   transaction, which also frees the cells left behind), the switch gets the job's new entry, and each worker is
   answered ``go``. Every slot of the new range is taken over afresh at its first packet (the generation check).

A move not decided within :data:`DECIDE_SECONDS` (a worker that does not follow moves; :data:`SWITCH_SECONDS` once
every rank learned of it: a job whose exchanges are far apart), or not switched within :data:`SWITCH_SECONDS` (a
rank that died), or a worker that is on its PS after a failover, gives the move up. A worker names the move it
follows in each request, so one that reaches the switch point of a move given up meanwhile is told so even when the
job has another move by then:
its reserved cells go back, and every worker stays on, or returns to, the old range (an answer ``aborted`` at the
switch point, or no move at all). A job whose workers never asked is not moved again until the controller restarts.

A controller restart at any step finds the row: the reserved cells are reserved again (``reserve_all``); a
decided switch point stands; the ranks at the switch point ask again until every one is counted; a move already
committed answers ``go`` once the switch holds the job's new entry.

**Fair shares** (:meth:`Moves.rebalance`, every second from the daemon, and for a newcomer in
:meth:`Moves.make_room`): each job's share is its weighted max-min share (``shares.py``); a job well above its share
while another is below shrinks, and a job below its share grows into free cells.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from netagg.controller.allocator import AllocationError, SlotAllocator, SlotRange
from netagg.controller.errors import P4RuntimeError, ServiceError
from netagg.controller.shares import Claim, fair_cells
from netagg.controller.store import JobRecord, MoveRecord

if TYPE_CHECKING:
    from netagg.controller.service import JobService

log = logging.getLogger("netagg.controller")

#: A move whose switch point is not decided this long after it started is given up (a worker not following).
DECIDE_SECONDS = 20.0
#: A decided move whose ranks are not all at the switch point this long after it started is given up.
SWITCH_SECONDS = 300.0


def move_threshold(held: int, unit: int) -> int:
    """The least change of a job's cells worth a move: one slot, and an eighth of what it holds."""
    return max(unit, held // 8 // unit * unit)


class Moves:
    """The moves of one controller's jobs (see the module docstring). Every method takes the service's lock."""

    def __init__(self, service: JobService) -> None:
        self.service = service
        self.store = service.store
        self.config = service.config
        #: Per job with a move pending: the ranks that learned of it (a poll), that asked (the decision needs all),
        #: and that are at the switch point; per job, the generation before its last commit (its late ranks' go).
        self._polled: dict[int, set[int]] = {}
        self._asked: dict[int, set[int]] = {}
        self._ready: dict[int, set[int]] = {}
        self._previous: dict[int, int] = {}
        #: (job, generation) whose new entry this controller wrote to the switch since it started.
        self._installed: set[tuple[int, int]] = set()
        #: Jobs not moved again (their workers did not follow a move), with why.
        self.pinned: dict[int, str] = {}
        #: Newcomers waiting for room (make_room): their claims count in every share computed meanwhile.
        self._newcomers: dict[int, Claim] = {}
        self._newcomer_ids = iter(range(-1, -(1 << 30), -1))
        #: started / committed / aborted, for the metrics; and per job its last move's description.
        self.counts: Counter[str] = Counter()
        self.last: dict[int, str] = {}

    @property
    def enabled(self) -> bool:
        """Whether jobs move: the controller has an endpoint for workers and drives one switch."""
        return self.config.worker_address is not None and self.config.topology is None

    @property
    def _lock(self) -> threading.RLock:
        return self.service.lock

    @property
    def _allocator(self) -> SlotAllocator:
        allocator = self.service.allocator
        assert isinstance(allocator, SlotAllocator)
        return allocator

    def why_not(self, job: JobRecord) -> str | None:
        """Why ``job``'s slots cannot move (None: they can)."""
        if not self.enabled:
            return "the controller moves no jobs (no controller.worker_address, or a tree of switches)"
        if job.mode != "allreduce":
            return f"mode {job.mode}"
        if job.threads != 1 or job.switch_aggregation or job.senders or job.distribution is not None \
                or job.distribution_of is not None:
            return "its slots are split among threads, switch groups or a model distribution"
        if not job.secret:
            return "it has no job secret (made before secrets)"
        if job.state != "active":
            return f"it is {job.state}"
        return self.pinned.get(job.job_id)

    # -- the allocator's view ------------------------------------------------
    @staticmethod
    def extra_cells(job: JobRecord, move: MoveRecord) -> list[SlotRange]:
        """The cells ``move`` holds beyond ``job``'s range (reserved while it is pending)."""
        return _minus(SlotRange(move.slot_base, move.slot_count * job.cells), SlotRange(job.slot_base, job.cell_count))

    @staticmethod
    def left_cells(job: JobRecord, move: MoveRecord) -> list[SlotRange]:
        """The cells of ``job``'s range that ``move`` leaves (freed when it commits)."""
        return _minus(SlotRange(job.slot_base, job.cell_count), SlotRange(move.slot_base, move.slot_count * job.cells))

    def reserve_all(self) -> None:
        """Reserve the extra cells of every move in the database (at start, after the jobs' own ranges)."""
        for move in self.store.moves():
            job = self.store.get(move.job_id)
            for extra in [] if job is None else self.extra_cells(job, move):
                self._allocator.reserve(extra)

    def _release(self, ranges: list[SlotRange]) -> None:
        for one in ranges:
            self._allocator.release(one)

    def forget(self, job: JobRecord) -> None:
        """``job`` is being deleted: give its move's extra cells back (the row goes with the job's)."""
        with self._lock:
            move = self.store.move(job.job_id)
            if move is not None:
                self._release(self.extra_cells(job, move))
            self._polled.pop(job.job_id, None)
            self._asked.pop(job.job_id, None)
            self._ready.pop(job.job_id, None)

    # -- starting and giving up ---------------------------------------------
    def start(self, job: JobRecord, cells: int, reason: str, base: int | None = None) -> MoveRecord | None:
        """Start moving ``job`` to ``cells`` cells (a whole number of its slots): at cell ``base`` when given (its
        cells there must be free or its own), else in place where it shrinks or the cells after it are free, else
        to the first free range that holds them (or the most a free range holds, if that is still more than it
        has). None: no move (no room, or already moving)."""
        with self._lock:
            if self.store.move(job.job_id) is not None or self.why_not(job) is not None:
                return None
            unit, held = job.cells, job.cell_count
            cells = cells // unit * unit
            if cells < unit or (cells == held and base in (None, job.slot_base)):
                return None
            target = self._place(job, cells, base)
            if target is None:
                return None
            move = MoveRecord(job.job_id, 0, target.base, target.count // unit, reason, time.time())
            reserved: list[SlotRange] = []
            try:
                for extra in self.extra_cells(job, move):
                    self._allocator.reserve(extra)
                    reserved.append(extra)
                with self.store.transaction() as conn:
                    move.generation = self.store.next_generation(conn)
                    self.store.insert_move(conn, move)
            except AllocationError:
                self._release(reserved)
                return None
            except BaseException:
                self._release(reserved)
                raise
            self._asked[job.job_id], self._ready[job.job_id] = set(), set()
            self.counts["started"] += 1
            kind = "shrink" if move.slot_count < job.slot_count else "grow" if move.slot_count > job.slot_count \
                else "move"
            self.last[job.job_id] = f"{kind} {job.slot_count} -> {move.slot_count} slots ({reason})"
            log.info("job %d (%s): moving its slots: %d -> %d (cells %d..%d, generation %d): %s", job.job_id,
                     job.tenant, job.slot_count, move.slot_count, move.slot_base,
                     move.slot_base + move.slot_count * unit - 1, move.generation, reason)
            return move

    def _place(self, job: JobRecord, cells: int, base: int | None) -> SlotRange | None:
        """Where ``job``'s ``cells`` go (see :meth:`start`); nothing is reserved here."""
        if base is not None:
            return SlotRange(base, cells)
        held = job.cell_count
        if cells <= held or self._allocator.is_free(SlotRange(job.slot_base + held, cells - held)):
            return SlotRange(job.slot_base, cells)
        # As a new job's cells are chosen, and more than it has.
        return self._allocator.find(cells, min(cells, held + job.cells), unit=job.cells)

    def abort(self, job_id: int, why: str) -> None:
        """Give the job's move up (before it commits): its extra cells go back; every worker stays on the old range."""
        with self._lock:
            move, job = self.store.move(job_id), self.store.get(job_id)
            if move is None or job is None:
                return
            self.store.delete_move(job_id)
            self._release(self.extra_cells(job, move))
            self._polled.pop(job_id, None)
            self._asked.pop(job_id, None)
            self._ready.pop(job_id, None)
            self.counts["aborted"] += 1
            self.last[job_id] = f"move to {move.slot_count} slots given up: {why}"
            log.warning("job %d: move to %d slots given up: %s", job_id, move.slot_count, why)

    def expire(self, now: float | None = None) -> None:
        """Give up the moves that took too long (module docstring)."""
        now = time.time() if now is None else now
        with self._lock:
            for move in self.store.moves():
                age = now - move.created
                if not self.enabled:  # restarted without a worker endpoint: nobody can follow it
                    self.abort(move.job_id, "the controller no longer moves jobs (no controller.worker_address)")
                elif move.switch_at is None and age > self._decide_seconds(move):
                    silent = not self._asked.get(move.job_id) and not self._polled.get(move.job_id)
                    self.abort(move.job_id, f"not every rank asked within {self._decide_seconds(move):g} s")
                    if silent:
                        self.pinned[move.job_id] = "its workers do not follow moves (none asked)"
                elif move.switch_at is not None and age > SWITCH_SECONDS:
                    self.abort(move.job_id, f"not every rank reached the switch point within {SWITCH_SECONDS:g} s")

    def _decide_seconds(self, move: MoveRecord) -> float:
        job = self.store.get(move.job_id)
        learned = self._polled.get(move.job_id, set()) | self._asked.get(move.job_id, set())
        return SWITCH_SECONDS if job is not None and len(learned) >= len(job.workers) else DECIDE_SECONDS

    # -- the workers' requests ---------------------------------------------------
    def poll(self, job: JobRecord, rank: int, generation: int) -> dict:
        """Whether the job (as its worker of ``generation`` knows it) has a move pending: its new generation, or
        None; and the job's generation."""
        move = self.store.move(job.job_id)
        pending = move is not None and generation == job.generation
        if pending and 0 <= rank < len(job.workers):
            with self._lock:
                self._polled.setdefault(job.job_id, set()).add(rank)
        return {"move": move.generation if pending else None, "generation": job.generation}

    def ask(self, job: JobRecord, rank: int, generation: int, exchange: int, ready: bool, on_ps: bool,
            following: int | None = None) -> dict:
        """A worker's ``move`` request before exchange ``exchange`` (module docstring); ``following``: the
        generation of the move it follows (None: the current one). ValueError when it breaks the rules."""
        if not (0 <= rank < len(job.workers)) or exchange < 0:
            raise ValueError(f"rank {rank} or exchange {exchange} out of range")
        with self._lock:
            job = self.store.get(job.job_id) or job
            move = self.store.move(job.job_id)
            if generation != job.generation:
                if ready and self._newer(job, generation):
                    return self._go(job)  # committed while this rank waited (or before a restart)
                raise ValueError(f"job {job.job_id} is at generation {job.generation}, not {generation}")
            if move is None or (ready and following is not None and following != move.generation):
                return {"move": None, "state": "aborted"}  # the move it followed was given up
            ranks = set(range(len(job.workers)))
            if not ready:
                if move.switch_at is not None:  # decided: a rank that ran the last old exchange learns it here
                    if exchange > move.switch_at:
                        raise ValueError(f"exchange {exchange} is past the switch point {move.switch_at}")
                    return {"move": move.generation, "switch_at": move.switch_at}
                asked = self._asked.setdefault(job.job_id, set())
                asked.add(rank)
                answered = max(move.answered, exchange)
                switch_at = move.switch_at
                if switch_at is None and asked >= ranks:
                    switch_at = answered + 1
                if (answered, switch_at) != (move.answered, move.switch_at):
                    self.store.set_move_progress(job.job_id, answered, switch_at)
                return {"move": move.generation, "switch_at": switch_at}
            if move.switch_at is None or exchange != move.switch_at:
                raise ValueError(f"exchange {exchange} is not the switch point ({move.switch_at})")
            if on_ps:
                self.abort(job.job_id, f"rank {rank} runs its exchanges at the PS (failover)")
                return {"move": None, "state": "aborted"}
            here = self._ready.setdefault(job.job_id, set())
            here.add(rank)
            if not here >= ranks:
                return {"state": "wait"}
            return self._commit(job, move)

    def _newer(self, job: JobRecord, generation: int) -> bool:
        """Whether ``generation`` is the job's before its last commit (a rank that waited at that switch point); after
        a restart, any older one."""
        return self._previous.get(job.job_id, generation) == generation and job.generation > generation

    def _commit(self, job: JobRecord, move: MoveRecord) -> dict:
        left = self.left_cells(job, move)
        self.store.commit_move(move)
        self._release(left)
        self._previous[job.job_id] = job.generation
        self._polled.pop(job.job_id, None)
        self._asked.pop(job.job_id, None)
        self._ready.pop(job.job_id, None)
        self.counts["committed"] += 1
        self.last[job.job_id] = f"{job.slot_count} -> {move.slot_count} slots ({move.reason})"
        moved = self.store.get(job.job_id)
        assert moved is not None
        log.info("job %d: its workers switched to %d slots (generation %d)", job.job_id, move.slot_count,
                 move.generation)
        return self._go(moved)

    def _go(self, job: JobRecord) -> dict:
        """``go`` once the switch holds the job's entry of its current generation (written here if not yet)."""
        if (job.job_id, job.generation) not in self._installed:
            try:
                self.service.fabric.install(job, [j for j in self.store.all() if j.job_id != job.job_id])
            except (P4RuntimeError, OSError) as err:
                log.warning("job %d: cannot write its moved slots to the switch yet: %s", job.job_id, err)
                return {"state": "wait"}
            self._installed.add((job.job_id, job.generation))
        return {"state": "go", "slot_count": job.slot_count, "generation": job.generation}

    # -- fair shares ---------------------------------------------------------------
    def claims(self, jobs: list[JobRecord], pending_fixed: bool = True) -> list[Claim]:
        """Every job's claim on the switch; ``pending_fixed``: a job with a move pending counts what the move gives
        it, and is not moved again meanwhile (what the rebalance acts on), else as if it had no move pending."""
        capacity, per_tenant = self.config.slot_capacity, Counter(j.tenant for j in jobs if j.uses_switch)
        pending = {m.job_id: m for m in self.store.moves()} if pending_fixed else {}
        claims = []
        for job in jobs:
            if not job.uses_switch:
                continue
            limits = self.config.tenant_limits.get(job.tenant)
            weight = (limits.weight if limits is not None else 1.0) / per_tenant[job.tenant]
            move = pending.get(job.job_id)
            held = job.cell_count if move is None else move.slot_count * job.cells
            want = min(job.slots_wanted * job.cells, capacity // job.cells * job.cells)
            claims.append(Claim(job.job_id, want, job.cells, min(self.config.min_slots * job.cells, want), weight,
                                held, movable=move is None and self.why_not(job) is None))
        return claims

    def shares(self) -> dict[int, int]:
        """Each job's fair share in cells now (newcomers waiting for room included, under negative ids)."""
        with self._lock:
            claims = self.claims(self.store.all(), pending_fixed=False) + list(self._newcomers.values())
            return fair_cells(self.config.slot_capacity, claims)

    def rebalance(self) -> list[MoveRecord]:
        """Start the moves that bring jobs toward their fair shares (module docstring); returns them."""
        if not self.enabled:
            return []
        started = []
        with self._lock:
            jobs = {j.job_id: j for j in self.store.all()}
            claims = self.claims(list(jobs.values()))
            shares = fair_cells(self.config.slot_capacity, claims + list(self._newcomers.values()))
            needy = any(shares[c.job_id] > c.held for c in claims) or bool(self._newcomers)
            for c in claims:  # shrinks first: they free what the grows take
                if c.movable and needy and c.held - shares[c.job_id] >= move_threshold(c.held, c.unit):
                    move = self.start(jobs[c.job_id], shares[c.job_id], f"fair share {shares[c.job_id]} cells")
                    started += [move] if move else []
            blocked = [shares[n.job_id] for n in self._newcomers.values()]
            for c in claims:
                if c.movable and shares[c.job_id] - c.held >= move_threshold(c.held, c.unit):
                    move = self.start(jobs[c.job_id], shares[c.job_id], f"fair share {shares[c.job_id]} cells")
                    started += [move] if move else []
                    if move is None or move.slot_count * c.unit < shares[c.job_id]:
                        blocked.append(shares[c.job_id])
            if blocked and not started and not self.store.moves():
                move = self._compact(jobs, min(blocked))
                started += [move] if move else []
        return started

    def _compact(self, jobs: dict[int, JobRecord], need: int) -> MoveRecord | None:
        """Free cells enough for ``need`` but in pieces: slide the first job after a hole down into it (same size,
        a fresh generation), so the free cells come together (one slide per call)."""
        allocator = self._allocator
        if allocator.largest_free() >= need or allocator.free_cells < need:
            return None
        holes = {free.end: free for free in allocator.free_ranges}
        for job in sorted(jobs.values(), key=lambda j: j.slot_base):
            hole = holes.get(job.slot_base)
            if hole is not None and job.uses_switch and self.why_not(job) is None:
                return self.start(job, job.cell_count, f"compaction: free cells together for {need}", base=hole.base)
        return None

    def make_room(self, want: int, unit: int, weight: float, wait: float) -> int:
        """A newcomer of ``want`` cells (whole ``unit``s, ``weight``) arrives: start the shrinks its fair share
        needs, wait up to ``wait`` seconds for them to free the cells, and return its share in cells."""
        key = next(self._newcomer_ids)
        claim = Claim(key, want, unit, min(self.config.min_slots * unit, want), weight, 0)
        with self._lock:
            self._newcomers[key] = claim
        try:
            deadline = time.monotonic() + wait
            while True:
                with self._lock:
                    self.rebalance()
                    share = self.shares()[key]
                    if self._allocator.largest_free() >= share or not self.store.moves() \
                            or time.monotonic() >= deadline:
                        return share
                time.sleep(0.02)
        finally:
            with self._lock:
                self._newcomers.pop(key, None)

    def describe(self, job: JobRecord) -> dict:
        """What ``job show`` and ``top`` print about the job's share and moves."""
        move = self.store.move(job.job_id)
        shares = self.shares() if self.enabled else {}
        return {
            "fair_share_cells": shares.get(job.job_id),
            "moving": None if move is None else {
                "slot_count": move.slot_count, "generation": move.generation, "switch_at": move.switch_at,
                "reason": move.reason},
            "last_move": self.last.get(job.job_id),
            "movable": self.why_not(job) or "yes",
        }


def _minus(a: SlotRange, b: SlotRange) -> list[SlotRange]:
    """The cells of ``a`` not in ``b`` (none, one or two ranges)."""
    pieces = [SlotRange(a.base, min(a.end, b.base) - a.base), SlotRange(max(a.base, b.end), a.end - max(a.base, b.end))]
    return [p for p in pieces if p.count > 0]


def newcomer_weight(service: JobService, tenant: str) -> float:
    """A new job's weight: its tenant's, shared with the tenant's running jobs."""
    limits = service.config.tenant_limits.get(tenant)
    mine = sum(1 for j in service.store.all() if j.tenant == tenant and j.uses_switch)
    return (limits.weight if limits is not None else 1.0) / (mine + 1)


__all__ = ["DECIDE_SECONDS", "SWITCH_SECONDS", "Moves", "ServiceError", "move_threshold", "newcomer_weight"]
