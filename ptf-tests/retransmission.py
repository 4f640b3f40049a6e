"""Exactly-once under duplication and loss: duplicates, resent results, previous pool."""

from __future__ import annotations

from netagg import wire

from base_test import NetaggTest, contribution, make_workers, result_for


class DuplicateIgnored(NetaggTest):
    """A second copy of a contribution before the round completes is dropped and counted."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers)
        before = self.job_counters(job)
        first = contribution(job, workers[0], [5] * wire.K)
        self.send(workers[0].port, first)
        self.send(workers[0].port, contribution(job, workers[0], [5] * wire.K, flags=wire.FLAG_RETRANSMIT))
        self.expect_nothing()
        self.send(workers[1].port, contribution(job, workers[1], [1] * wire.K))
        last = contribution(job, workers[2], [1] * wire.K)
        self.send(workers[2].port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [7] * wire.K, 0)) for w in workers])
        after = self.job_counters(job)
        self.assertEqual(after["duplicates"] - before["duplicates"], 1)
        self.assertEqual(after["contributions"] - before["contributions"], 3)


class RetransmitAfterCompletion(NetaggTest):
    """A worker that lost the result resends and gets it back, unicast to it alone."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers)
        packets = [contribution(job, w, [w.rank + 1] * wire.K, exponent=w.rank, seq=9) for w in workers]
        for w, p in zip(workers, packets):
            self.send(w.port, p)
        self.expect_on_ports([(w.port, result_for(packets[-1], w, [6] * wire.K, 2)) for w in workers])
        before = self.job_counters(job)
        resend = contribution(job, workers[0], [999] * wire.K, exponent=50, seq=9, flags=wire.FLAG_RETRANSMIT)
        self.send(workers[0].port, resend)
        # The stored sums and exponent, not the resent packet's values.
        self.expect(workers[0].port, result_for(resend, workers[0], [6] * wire.K, 2))
        self.expect_nothing()
        after = self.job_counters(job)
        self.assertEqual(after["retransmit_results"] - before["retransmit_results"], 1)
        self.assertEqual(after["contributions"], before["contributions"])


class RetransmitFromPreviousPool(NetaggTest):
    """A worker still on pool 0 gets pool 0's result while others already use pool 1."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        p0 = [contribution(job, w, [1] * wire.K, pool=0, seq=1, round=1) for w in workers]
        for w, p in zip(workers, p0):
            self.send(w.port, p)
        self.expect_on_ports([(w.port, result_for(p0[-1], w, [2] * wire.K, 0)) for w in workers])
        # Worker 1 moves on to pool 1; worker 0 lost its result and resends pool 0.
        self.send(workers[1].port, contribution(job, workers[1], [40] * wire.K, pool=1, seq=2, round=2))
        resend = contribution(job, workers[0], [1] * wire.K, pool=0, seq=1, round=1, flags=wire.FLAG_RETRANSMIT)
        self.send(workers[0].port, resend)
        self.expect(workers[0].port, result_for(resend, workers[0], [2] * wire.K, 0))
        self.expect_nothing()
        # Pool 1 then completes normally.
        last = contribution(job, workers[0], [2] * wire.K, pool=1, seq=2, round=2)
        self.send(workers[0].port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [42] * wire.K, 0)) for w in workers])


class SlotReuseAndRetransmit(NetaggTest):
    """After a reused pool completes again, a resend returns the new round's result."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers, slot_count=1)
        for round_, pool in enumerate((0, 1, 0)):
            packets = [contribution(job, w, [round_ + 1] * wire.K, pool=pool, seq=round_, round=round_ + 1)
                       for w in workers]
            for w, p in zip(workers, packets):
                self.send(w.port, p)
            self.expect_on_ports([(w.port, result_for(packets[-1], w, [2 * (round_ + 1)] * wire.K, 0))
                                  for w in workers])
        resend = contribution(job, workers[1], [0] * wire.K, pool=0, seq=2, round=3, flags=wire.FLAG_RETRANSMIT)
        self.send(workers[1].port, resend)
        self.expect(workers[1].port, result_for(resend, workers[1], [6] * wire.K, 0))
        self.expect_nothing()


class DuplicateOfEveryWorkerBeforeCompletion(NetaggTest):
    """Each worker's packet twice, interleaved: the sum counts each worker once."""

    def runTest(self) -> None:
        workers = make_workers(4)
        job = self.add_job(workers)
        before = self.job_counters(job)
        packets = [contribution(job, w, [1 << w.rank] * wire.K) for w in workers]
        for w, p in zip(workers[:-1], packets[:-1]):
            self.send(w.port, p)
            self.send(w.port, p)
        self.expect_nothing()
        self.send(workers[-1].port, packets[-1])
        self.expect_on_ports([(w.port, result_for(packets[-1], w, [15] * wire.K, 0)) for w in workers])
        self.assertEqual(self.job_counters(job)["duplicates"] - before["duplicates"], 3)


class DelayedCopyOfAnEarlierRound(NetaggTest):
    """A copy of round 1 delayed until everyone moved on never starts or joins another round."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers, slot_count=1)
        for round_, pool in ((1, 0), (2, 1)):
            packets = [contribution(job, w, [round_ * 10] * wire.K, pool=pool, seq=round_, round=round_)
                       for w in workers]
            for w, p in zip(workers, packets):
                self.send(w.port, p)
            self.expect_on_ports([(w.port, result_for(packets[-1], w, [round_ * 20] * wire.K, 0))
                                  for w in workers])
        # Worker 0's resend of round 1 arrives after round 2 completed (both pools' bitmaps
        # full, no round in progress): it gets round 1's stored result back, nothing is added.
        stale = contribution(job, workers[0], [999] * wire.K, pool=0, seq=1, round=1, flags=wire.FLAG_RETRANSMIT)
        self.send(workers[0].port, stale)
        self.expect(workers[0].port, result_for(stale, workers[0], [20] * wire.K, 0))
        self.expect_nothing()
        # Round 3 starts in pool 0; the same stale copy is now older than the pool's round.
        before = self.job_counters(job)
        third = [contribution(job, w, [7] * wire.K, pool=0, seq=3, round=3) for w in workers]
        self.send(workers[1].port, third[1])
        # Packets from different ports have no order inside the switch: let round 3 start first.
        self.wait_for_counter(job, "contributions", before["contributions"] + 1)
        self.send(workers[0].port, stale)
        self.expect_nothing()
        self.assertEqual(self.job_counters(job)["duplicates"] - before["duplicates"], 1)
        self.send(workers[0].port, third[0])
        self.expect_on_ports([(w.port, result_for(third[0], w, [14] * wire.K, 0)) for w in workers])
