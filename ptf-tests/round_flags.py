"""Round flags (docs/protocol.md, "Round flags: non-finite values and collectives out of step").

A round ORs its contributions' NaN / +inf / -inf flags and returns them with its result; a contribution that
names another collective (``exchange``) is not added, counts towards completion, and marks the round
OUT_OF_STEP, which its result carries to every member. Packets from different ports have no order inside the
switch, so where the order of contributions matters (the first fixes the round's exchange) a test waits for the
switch to have taken one before it sends the next.
"""

from __future__ import annotations

from netagg import wire
from netagg.dataplane import DropReason

from base_test import NetaggTest, contribution, make_workers, result_for

NAN, POS_INF, NEG_INF, OUT_OF_STEP = wire.FLAG_NAN, wire.FLAG_POS_INF, wire.FLAG_NEG_INF, wire.FLAG_OUT_OF_STEP
#: Two collectives of the same size, one after the other: what ranks out of step send into one round.
EXCHANGE = wire.exchange_id(7, 4)
OTHER_EXCHANGE = wire.exchange_id(8, 4)


class NonFiniteFlagsAreOredIntoTheResult(NetaggTest):
    """NaN from one worker, +inf from another: the result to the group carries both (and the sums of the finite
    values); a resend gets them with the stored result, whatever its own flags; the next round of the pool
    starts its flags afresh."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers)
        before = self.job_counters(job)
        flags = [NAN, POS_INF, 0]
        packets = [contribution(job, w, [w.rank + 1] * wire.K, exponent=w.rank, seq=3, flags=f, exchange=EXCHANGE)
                   for w, f in zip(workers, flags)]
        for w, p in zip(workers[:-1], packets[:-1]):
            self.send(w.port, p)
        self.expect_nothing()
        self.send(workers[-1].port, packets[-1])
        self.expect_on_ports([(w.port, result_for(packets[-1], w, [6] * wire.K, 2, NAN | POS_INF)) for w in workers])
        self.expect_nothing()
        after = self.job_counters(job)
        self.assertEqual(after["contributions"] - before["contributions"], 3)
        self.assertEqual(after["results"] - before["results"], 1)
        # A worker that lost the result resends, flagging -inf now: the stored flags come back, and a second
        # resend shows that the first changed nothing.
        for resend_flags in (wire.FLAG_RETRANSMIT | NEG_INF, wire.FLAG_RETRANSMIT):
            resend = contribution(job, workers[2], [99] * wire.K, seq=3, flags=resend_flags, exchange=EXCHANGE)
            self.send(workers[2].port, resend)
            self.expect(workers[2].port, result_for(resend, workers[2], [6] * wire.K, 2, NAN | POS_INF))
            self.expect_nothing()
        # The slot's next use of pool 0 (round 3): only -inf this time.
        third = [contribution(job, w, [1] * wire.K, round=3, seq=4, flags=NEG_INF if w.rank == 1 else 0,
                              exchange=EXCHANGE) for w in workers]
        for w, p in zip(workers[:-1], third[:-1]):
            self.send(w.port, p)
        self.expect_nothing()
        self.send(workers[-1].port, third[-1])
        self.expect_on_ports([(w.port, result_for(third[-1], w, [3] * wire.K, 0, NEG_INF)) for w in workers])
        self.expect_nothing()


class CompletingContributionsFlagsAreMerged(NetaggTest):
    """The completing packet's own flags are ORed too, and reach every member (NaN and -inf with +inf)."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        first = contribution(job, workers[0], [5] * wire.K, slot=1, flags=POS_INF)
        self.send(workers[0].port, first)
        self.expect_nothing()
        last = contribution(job, workers[1], [-5] * wire.K, slot=1, flags=NAN | NEG_INF)
        self.send(workers[1].port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [0] * wire.K, 0, NAN | POS_INF | NEG_INF))
                              for w in workers])
        self.expect_nothing()


class SingleContributionKeepsItsFlags(NetaggTest):
    """A one-worker job's only contribution completes the round: its flags are the round's."""

    def runTest(self) -> None:
        workers = make_workers(1)
        job = self.add_job(workers)
        only = contribution(job, workers[0], [4] * wire.K, flags=NAN | OUT_OF_STEP, exchange=EXCHANGE)
        self.send(workers[0].port, only)
        self.expect(workers[0].port, result_for(only, workers[0], [4] * wire.K, 0, NAN | OUT_OF_STEP))
        self.expect_nothing()


class _OutOfStep(NetaggTest):
    """Three workers; helpers that send a contribution and wait until the switch has taken it."""

    def setUp(self) -> None:
        super().setUp()
        self.workers = make_workers(3)
        self.job = self.add_job(self.workers)

    def send_taken(self, worker, pkt, counter: str) -> None:
        """Send ``pkt`` and wait for the job's ``counter`` to move (the switch has processed it)."""
        target = self.job_counters(self.job)[counter] + 1
        self.send(worker.port, pkt)
        self.wait_for_counter(self.job, counter, target)


class ContributionOfAnotherExchangeIsNotAdded(_OutOfStep):
    """Worker 1 names another collective than the round's first packet: its values, exponent and own flags are
    not added; it is counted in drop_reasons[EXCHANGE_MISMATCH] and job_rejects; its bit counts towards
    completion, so worker 2's packet completes the round, whose result carries OUT_OF_STEP to every worker.
    A copy of worker 1's packet before completion is a duplicate (its bit is set)."""

    def runTest(self) -> None:
        w0, w1, w2 = self.workers
        drops, before = self.drops(), self.job_counters(self.job)
        self.send_taken(w0, contribution(self.job, w0, [10] * wire.K, exponent=-3, seq=5, exchange=EXCHANGE),
                        "contributions")
        stray = contribution(self.job, w1, [1000] * wire.K, exponent=40, seq=5, flags=NAN, exchange=OTHER_EXCHANGE)
        self.send_taken(w1, stray, "rejects")
        self.send_taken(w1, stray, "duplicates")
        self.expect_nothing()
        last = contribution(self.job, w2, [-4] * wire.K, exponent=-5, seq=5, flags=POS_INF, exchange=EXCHANGE)
        self.send(w2.port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [6] * wire.K, -3, OUT_OF_STEP | POS_INF))
                              for w in self.workers])
        self.expect_nothing()
        after, drops_after = self.job_counters(self.job), self.drops()
        self.assertEqual(drops_after[DropReason.EXCHANGE_MISMATCH] - drops[DropReason.EXCHANGE_MISMATCH], 1)
        moved = {r: drops_after[r] - drops[r] for r in DropReason if r != DropReason.EXCHANGE_MISMATCH
                 and drops_after[r] != drops[r]}
        self.assertFalse(moved, f"other drop counters moved: {moved}")
        self.assertEqual(after["rejects"] - before["rejects"], 1)
        self.assertEqual(after["contributions"] - before["contributions"], 2)
        self.assertEqual(after["duplicates"] - before["duplicates"], 1)
        self.assertEqual(after["results"] - before["results"], 1)
        # A resend after completion, of either collective, gets the stored result with OUT_OF_STEP; it is a
        # resend, never a mismatch.
        for worker, exchange in ((w1, OTHER_EXCHANGE), (w0, OTHER_EXCHANGE), (w2, EXCHANGE)):
            resend = contribution(self.job, worker, [77] * wire.K, exponent=60, seq=5, flags=wire.FLAG_RETRANSMIT,
                                  exchange=exchange)
            self.send(worker.port, resend)
            self.expect(worker.port, result_for(resend, worker, [6] * wire.K, -3, OUT_OF_STEP | POS_INF))
            self.expect_nothing()
        final = self.job_counters(self.job)
        self.assertEqual(final["retransmit_results"] - after["retransmit_results"], 3)
        self.assertEqual(final["rejects"], after["rejects"])
        self.assertEqual(self.drops()[DropReason.EXCHANGE_MISMATCH], drops_after[DropReason.EXCHANGE_MISMATCH])


class MismatchedContributionCompletesTheRound(_OutOfStep):
    """The last contribution names another collective: it is not added, but it completes the round and leaves
    to the group as its result — the stored sums and exponent, OUT_OF_STEP with the round's flags, its own
    header fields otherwise; a resend then gets the same."""

    def runTest(self) -> None:
        w0, w1, w2 = self.workers
        drops, before = self.drops(), self.job_counters(self.job)
        self.send_taken(w0, contribution(self.job, w0, [3] * wire.K, slot=2, exponent=1, seq=6, flags=NEG_INF,
                                         exchange=EXCHANGE), "contributions")
        self.send_taken(w1, contribution(self.job, w1, [4] * wire.K, slot=2, exponent=2, seq=6, exchange=EXCHANGE),
                        "contributions")
        self.expect_nothing()
        last = contribution(self.job, w2, [500] * wire.K, slot=2, exponent=30, seq=6, flags=NAN,
                            exchange=OTHER_EXCHANGE)
        self.send(w2.port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [7] * wire.K, 2, OUT_OF_STEP | NEG_INF))
                              for w in self.workers])
        self.expect_nothing()
        after = self.job_counters(self.job)
        self.assertEqual(self.drops()[DropReason.EXCHANGE_MISMATCH] - drops[DropReason.EXCHANGE_MISMATCH], 1)
        self.assertEqual(after["rejects"] - before["rejects"], 1)
        self.assertEqual(after["contributions"] - before["contributions"], 2)
        self.assertEqual(after["results"] - before["results"], 1)
        resend = contribution(self.job, w2, [500] * wire.K, slot=2, exponent=30, seq=6,
                              flags=wire.FLAG_RETRANSMIT | NAN, exchange=OTHER_EXCHANGE)
        self.send(w2.port, resend)
        self.expect(w2.port, result_for(resend, w2, [7] * wire.K, 2, OUT_OF_STEP | NEG_INF))
        self.expect_nothing()


class AbortContributionMarksTheRound(_OutOfStep):
    """An abort contribution (zeros, exponent -128, flags OUT_OF_STEP, the same exchange) is added like any
    other: the round completes OUT_OF_STEP for everyone, its sums untouched by the zeros."""

    def runTest(self) -> None:
        w0, w1, w2 = self.workers
        self.send_taken(w0, contribution(self.job, w0, [2] * wire.K, exchange=EXCHANGE), "contributions")
        self.send_taken(w1, contribution(self.job, w1, [0] * wire.K, exponent=-128, flags=OUT_OF_STEP,
                                         exchange=EXCHANGE), "contributions")
        last = contribution(self.job, w2, [5] * wire.K, exchange=EXCHANGE)
        self.send(w2.port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [7] * wire.K, 0, OUT_OF_STEP)) for w in self.workers])
        self.expect_nothing()


class NewRoundTakesTheExchangeOfItsFirstPacket(_OutOfStep):
    """Each round of a slot fixes its own collective: after a round of one exchange, the pool's next round of
    another exchange is not out of step."""

    def runTest(self) -> None:
        for round_, exchange in ((1, EXCHANGE), (3, OTHER_EXCHANGE)):
            packets = [contribution(self.job, w, [w.rank] * wire.K, round=round_, seq=round_, exchange=exchange)
                       for w in self.workers]
            for w, p in zip(self.workers[:-1], packets[:-1]):
                self.send(w.port, p)
            self.expect_nothing()
            self.send(self.workers[-1].port, packets[-1])
            self.expect_on_ports([(w.port, result_for(packets[-1], w, [3] * wire.K, 0)) for w in self.workers])
            self.expect_nothing()
