"""Moves of a running job's slots (docs/controller.md, "Fair shares that move"): the controller modifies the job's
entry (new range, new generation) once every worker is at the switch point, and the data plane takes the new
range from the next packet: a shrunk job's slots past its new count are refused, its kept slots start afresh
(the new generation takes them over: the old rounds' sums are never read back), and a job moved elsewhere
aggregates in its new cells."""

from __future__ import annotations

import itertools

from netagg import dataplane as dp
from netagg import wire
from netagg.dataplane import DropReason

from base_test import NetaggTest, contribution, make_workers, result_for

_new_generations = itertools.count(5000)


class _Moved(NetaggTest):
    def move(self, job, slot_base: int, slot_count: int) -> None:
        """What the controller's commit writes: the job's entry with its new range and a fresh generation."""
        job.slot_base, job.slot_count, job.generation = slot_base, slot_count, next(_new_generations)
        self.client.modify_entry(dp.TABLE_JOBS, {"job_id": job.job_id}, dp.ACTION_SET_JOB, {
            "num_workers": len(job.workers), "slot_base": slot_base, "slot_count": slot_count,
            "mgid": job.mgid, "generation": job.generation, "width": job.width})

    def complete(self, job, slot: int, value: int, round_: int, pool: int = 0) -> None:
        packets = [contribution(job, w, [value] * wire.K, slot=slot, pool=pool, round=round_) for w in job.workers]
        for w, p in zip(job.workers, packets):
            self.send(w.port, p)
        total = value * len(job.workers)
        self.expect_on_ports([(w.port, result_for(packets[-1], w, [total] * wire.K, 0)) for w in job.workers])


class ShrunkJobRefusesItsOldSlotsAndStartsItsKeptOnesAfresh(_Moved):
    def runTest(self) -> None:
        job = self.add_job(make_workers(2), slot_base=130, slot_count=4)
        for slot in range(4):
            self.complete(job, slot, 7, round_=1)
        self.move(job, 130, 2)
        drops = self.drops()
        self.send(job.workers[0].port, contribution(job, job.workers[0], [1] * wire.K, slot=3, round=2))
        self.expect_nothing()
        self.assertEqual(self.drops()[DropReason.SLOT_OUT_OF_RANGE] - drops[DropReason.SLOT_OUT_OF_RANGE], 1)
        # The workers' rows start afresh after a move (round 1 in pool 0 again): a new round, not a resend of the
        # old generation's round 1, whose sum (14) must not come back.
        first = contribution(job, job.workers[0], [2] * wire.K, slot=0, round=1)
        self.send(job.workers[0].port, first)
        self.expect_nothing()
        last = contribution(job, job.workers[1], [3] * wire.K, slot=0, round=1)
        self.send(job.workers[1].port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [5] * wire.K, 0)) for w in job.workers])


class JobMovedElsewhereAggregatesInItsNewCells(_Moved):
    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers, slot_base=140, slot_count=2)
        self.complete(job, 1, 4, round_=1)
        self.move(job, 150, 4)  # grown, elsewhere
        self.complete(job, 3, 9, round_=1)  # a slot it did not have
        self.complete(job, 1, 6, round_=1)  # a slot it had: afresh at its new cell
        # A job given the old cells meanwhile sees none of the moved job's state there.
        neighbour = self.add_job(make_workers(2, first_ip=20, udp_base=41000), slot_base=140, slot_count=2)
        self.complete(neighbour, 1, 1, round_=1)


class WideJobShrinksInWholeSlots(_Moved):
    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers, slot_base=160, slot_count=2, k=wire.WIDE_K)
        self.move(job, 160, 1)
        drops = self.drops()
        self.send(workers[0].port, contribution(job, workers[0], [1] * wire.WIDE_K, slot=1))
        self.expect_nothing()
        self.assertEqual(self.drops()[DropReason.SLOT_OUT_OF_RANGE] - drops[DropReason.SLOT_OUT_OF_RANGE], 1)
        packets = [contribution(job, w, [w.rank + 1] * wire.WIDE_K, slot=0) for w in workers]
        for w, p in zip(workers, packets):
            self.send(w.port, p)
        self.expect_on_ports([(w.port, result_for(packets[-1], w, [3] * wire.WIDE_K, 0)) for w in workers])
