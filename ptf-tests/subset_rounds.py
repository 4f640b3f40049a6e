"""Subset rounds: a round of some of a job's workers (``members``), fixed by its first packet."""

from __future__ import annotations

from netagg import wire
from netagg.dataplane import DropReason

from base_test import NetaggTest, contribution, make_workers, result_for


def _members(*workers) -> int:
    return wire.members_of(w.rank for w in workers)


class SubsetRoundCompletesWithItsMembers(NetaggTest):
    """Two of four workers complete the round; the result goes to the job's group."""

    def runTest(self) -> None:
        workers = make_workers(4)
        job = self.add_job(workers)
        members = _members(workers[1], workers[3])
        before = self.job_counters(job)
        first = contribution(job, workers[1], [10] * wire.K, slot=2, exponent=-4, seq=5, members=members)
        self.send(workers[1].port, first)
        self.expect_nothing()
        last = contribution(job, workers[3], [-3] * wire.K, slot=2, exponent=6, seq=5, members=members)
        self.send(workers[3].port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [7] * wire.K, 6)) for w in workers])
        self.expect_nothing()
        after = self.job_counters(job)
        self.assertEqual(after["contributions"] - before["contributions"], 2)
        self.assertEqual(after["results"] - before["results"], 1)


class OutsiderOfASubsetRoundIsDropped(NetaggTest):
    """A worker of the job that is not a member is dropped and counted; the round is untouched."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers)
        members = _members(workers[0], workers[1])
        drops, before = self.drops(), self.job_counters(job)
        self.send(workers[0].port, contribution(job, workers[0], [1] * wire.K, members=members))
        self.send(workers[2].port, contribution(job, workers[2], [100] * wire.K, members=members))
        self.expect_nothing()
        last = contribution(job, workers[1], [2] * wire.K, members=members)
        self.send(workers[1].port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [3] * wire.K, 0)) for w in workers])
        after = self.job_counters(job)
        self.assertEqual(self.drops()[DropReason.NOT_A_MEMBER] - drops[DropReason.NOT_A_MEMBER], 1)
        self.assertEqual(after["rejects"] - before["rejects"], 1)
        self.assertEqual(after["contributions"] - before["contributions"], 2)


class OtherMembersThanTheRoundsAreDropped(NetaggTest):
    """The first packet fixes the members: a packet naming others, or the whole job, changes nothing."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers)
        members = _members(workers[0], workers[1])
        drops = self.drops()
        self.send(workers[0].port, contribution(job, workers[0], [1] * wire.K, members=members))
        self.send(workers[1].port, contribution(job, workers[1], [50] * wire.K, members=_members(*workers)))
        self.send(workers[1].port, contribution(job, workers[1], [60] * wire.K))  # members 0: the whole job
        self.expect_nothing()
        self.assertEqual(self.drops()[DropReason.MEMBERS_MISMATCH] - drops[DropReason.MEMBERS_MISMATCH], 2)
        last = contribution(job, workers[1], [2] * wire.K, members=members)
        self.send(workers[1].port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [3] * wire.K, 0)) for w in workers])


class SubsetRoundUnderLoss(NetaggTest):
    """A member's duplicate before completion is absorbed; a member that lost the result resends and
    gets it alone; a copy of the round after the slot moved on changes nothing."""

    def runTest(self) -> None:
        workers = make_workers(4)
        job = self.add_job(workers)
        members = _members(workers[0], workers[2], workers[3])
        packets = {w.rank: contribution(job, w, [w.rank] * wire.K, seq=8, members=members)
                   for w in (workers[0], workers[2], workers[3])}
        self.send(workers[0].port, packets[0])
        self.send(workers[0].port, packets[0])  # duplicate
        self.send(workers[2].port, packets[2])
        self.expect_nothing()
        self.send(workers[3].port, packets[3])
        self.expect_on_ports([(w.port, result_for(packets[3], w, [5] * wire.K, 0)) for w in workers])
        before = self.job_counters(job)
        resend = contribution(job, workers[2], [99] * wire.K, seq=8, members=members, flags=wire.FLAG_RETRANSMIT)
        self.send(workers[2].port, resend)
        self.expect(workers[2].port, result_for(resend, workers[2], [5] * wire.K, 0))
        self.expect_nothing()
        after = self.job_counters(job)
        self.assertEqual(after["retransmit_results"] - before["retransmit_results"], 1)
        self.assertEqual(after["duplicates"] - before["duplicates"], 0)
        # Round 3 of the slot (pool 0 again) for the whole job; then a stale copy of round 1.
        full = [contribution(job, w, [1] * wire.K, round=3) for w in workers]
        for w, p in zip(workers, full):
            self.send(w.port, p)
        self.expect_on_ports([(w.port, result_for(full[-1], w, [4] * wire.K, 0)) for w in workers])
        self.send(workers[0].port, packets[0])
        self.expect_nothing()


class SubsetAndWholeJobRoundsShareASlot(NetaggTest):
    """A slot's rounds alternate between a subset and the whole job; each completes by its own members."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers)
        members = _members(workers[2])
        only = contribution(job, workers[2], [9] * wire.K, slot=1, pool=0, round=1, members=members)
        self.send(workers[2].port, only)  # a one-member round completes at once
        self.expect_on_ports([(w.port, result_for(only, w, [9] * wire.K, 0)) for w in workers])
        full = [contribution(job, w, [2] * wire.K, slot=1, pool=1, round=2) for w in workers]
        for w, p in zip(workers[:2], full[:2]):
            self.send(w.port, p)
        self.expect_nothing()
        self.send(workers[2].port, full[2])
        self.expect_on_ports([(w.port, result_for(full[2], w, [6] * wire.K, 0)) for w in workers])


class ParameterServerAsAZeroMemberGetsTheSumAndRecoversIt(NetaggTest):
    """MLfabric's PS as a member of a switch group (docs/mlfabric.md, "The PS in the switch groups"): it
    contributes zeros with the no-magnitude exponent first, so neither the sums nor the round's exponent move;
    the last worker's packet sends the sum to the whole group (the PS included); the PS, having lost it,
    resends its zeros and gets the stored sum back alone, and a second loss is repaired the same way."""

    def runTest(self) -> None:
        workers = make_workers(4)  # ranks 0..2: the workers; rank 3: the PS
        job = self.add_job(workers)
        ps = workers[3]
        members = _members(workers[0], workers[2], ps)
        zeros = contribution(job, ps, [0] * wire.K, slot=1, seq=11, exponent=-128, members=members)
        self.send(ps.port, zeros)
        first = contribution(job, workers[0], [-7] * wire.K, slot=1, seq=11, exponent=-20, members=members)
        self.send(workers[0].port, first)
        self.expect_nothing()
        last = contribution(job, workers[2], [3] * wire.K, slot=1, seq=11, exponent=-22, members=members)
        self.send(workers[2].port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [-4] * wire.K, -20)) for w in workers])
        before = self.job_counters(job)
        for _ in range(2):  # the copy to the PS was lost (twice): its resends are answered from storage
            resend = contribution(job, ps, [0] * wire.K, slot=1, seq=11, exponent=-128, members=members,
                                  flags=wire.FLAG_RETRANSMIT)
            self.send(ps.port, resend)
            self.expect(ps.port, result_for(resend, ps, [-4] * wire.K, -20))
            self.expect_nothing()
        after = self.job_counters(job)
        self.assertEqual(after["retransmit_results"] - before["retransmit_results"], 2)
        self.assertEqual(after["results"] - before["results"], 0)
        self.assertEqual(after["contributions"] - before["contributions"], 0)
