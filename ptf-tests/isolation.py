"""Tenant isolation: only registered workers touch only their job's slots."""

from __future__ import annotations

from netagg import wire
from netagg.dataplane import DropReason

from base_test import NetaggTest, Worker, contribution, make_workers, result_for


class _Rejected(NetaggTest):
    """Sends one bad packet; asserts it is dropped, counted, and changes no slot."""

    def assert_rejected(self, job, port: int, pkt, reason: DropReason, job_reject: bool = True) -> None:
        drops = self.drops()
        before = self.job_counters(job)
        self.send(port, pkt)
        self.expect_nothing()
        self.assertEqual(self.drops()[reason] - drops[reason], 1, reason.name)
        after = self.job_counters(job)
        self.assertEqual(after["rejects"] - before["rejects"], 1 if job_reject else 0)
        self.assertEqual(after["contributions"], before["contributions"])

    def assert_slot_clean(self, job, workers) -> None:
        """The slot still aggregates exactly the registered workers' values."""
        packets = [contribution(job, w, [w.rank + 1] * wire.K) for w in workers]
        for w, p in zip(workers, packets):
            self.send(w.port, p)
        total = sum(w.rank + 1 for w in workers)
        self.expect_on_ports([(w.port, result_for(packets[-1], w, [total] * wire.K, 0)) for w in workers])


class UnknownSource(_Rejected):
    """A host that is not a worker of the job (unknown IP/port) is dropped."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        intruder = Worker(rank=0, port=3, mac="02:00:00:00:09:09", ip="10.99.9.9", udp_port=40000)
        self.assert_rejected(job, intruder.port, contribution(job, intruder, [666] * wire.K),
                             DropReason.UNKNOWN_WORKER)
        # Same IP as a worker but another UDP port: still unknown.
        wrong_port = Worker(0, workers[0].port, workers[0].mac, workers[0].ip, workers[0].udp_port + 100)
        self.assert_rejected(job, wrong_port.port, contribution(job, wrong_port, [666] * wire.K),
                             DropReason.UNKNOWN_WORKER)
        self.assert_slot_clean(job, workers)


class ForgedAddressFromAnotherPort(_Rejected):
    """A host that forges a worker's IPv4 address and UDP port, sending from its own switch port, is dropped."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        other_port = next(p for p in range(1, 9) if p not in {w.port for w in workers})
        forged = contribution(job, workers[0], [666] * wire.K)  # worker 0's addresses, rank and slot
        self.assert_rejected(job, other_port, forged, DropReason.UNKNOWN_WORKER)
        self.assert_slot_clean(job, workers)


class WrongJob(_Rejected):
    """A worker of job A naming job B (or a job that does not exist) is dropped."""

    def runTest(self) -> None:
        workers_a = make_workers(2)
        workers_b = make_workers(2, first_ip=50)
        job_a = self.add_job(workers_a, slot_base=0, slot_count=2)
        job_b = self.add_job(workers_b, slot_base=2, slot_count=2)
        spoof = contribution(job_a, workers_a[0], [666] * wire.K, job_id=job_b.job_id)
        self.assert_rejected(job_b, workers_a[0].port, spoof, DropReason.UNKNOWN_WORKER)
        drops = self.drops()
        self.send(workers_a[0].port, contribution(job_a, workers_a[0], [1] * wire.K, job_id=999))
        self.expect_nothing()
        self.assertEqual(self.drops()[DropReason.UNKNOWN_JOB] - drops[DropReason.UNKNOWN_JOB], 1)
        self.assert_slot_clean(job_b, workers_b)
        self.assert_slot_clean(job_a, workers_a)


class SlotOutOfRange(_Rejected):
    """Slot index >= the job's slot count never reaches a neighbour's slot."""

    def runTest(self) -> None:
        workers = make_workers(2)
        neighbour_workers = make_workers(2, first_ip=60)
        job = self.add_job(workers, slot_base=40, slot_count=2)
        neighbour = self.add_job(neighbour_workers, slot_base=42, slot_count=2)
        # Slot 2 of job = absolute 42 = the neighbour's slot 0.
        self.assert_rejected(job, workers[0].port, contribution(job, workers[0], [666] * wire.K, slot=2),
                             DropReason.SLOT_OUT_OF_RANGE)
        self.assert_rejected(job, workers[0].port, contribution(job, workers[0], [666] * wire.K, slot=0xFFFF),
                             DropReason.SLOT_OUT_OF_RANGE)
        self.assert_slot_clean(neighbour, neighbour_workers)


class SpoofedRank(_Rejected):
    """A worker claiming another rank is dropped; it cannot set another worker's bit."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        spoof = contribution(job, workers[0], [666] * wire.K, rank=1)
        self.assert_rejected(job, workers[0].port, spoof, DropReason.RANK_MISMATCH)
        self.assert_slot_clean(job, workers)


class BadPool(_Rejected):
    """Pool versions other than 0 and 1 are dropped."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        self.assert_rejected(job, workers[0].port, contribution(job, workers[0], [666] * wire.K, pool=2),
                             DropReason.BAD_POOL)
        self.assert_slot_clean(job, workers)


class ResultFromHost(_Rejected):
    """A host cannot inject a RESULT (that would be multicast to the job)."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        forged = contribution(job, workers[0], [666] * wire.K, flags=wire.FLAG_RESULT)
        self.assert_rejected(job, workers[0].port, forged, DropReason.RESULT_FROM_HOST, job_reject=False)
        self.assert_slot_clean(job, workers)


class SlotStateDoesNotLeakAcrossJobs(NetaggTest):
    """A job deleted mid-round leaves partial sums; the next job on those slots never sees them."""

    def runTest(self) -> None:
        old_workers = make_workers(3)
        old = self.add_job(old_workers, slot_base=100, slot_count=2)
        # Two of three contribute to both pools of slot 0, then the job is deleted.
        for pool in (0, 1):
            for w in old_workers[:2]:
                self.send(w.port, contribution(old, w, [1000] * wire.K, pool=pool, exponent=100))
        self.expect_nothing()
        self.delete_job(old)
        # A new job (same hosts, new generation) gets the same slots.
        new = self.add_job(old_workers[:2], slot_base=100, slot_count=2)
        for pool in (0, 1):
            packets = [contribution(new, w, [w.rank + 1] * wire.K, pool=pool, exponent=-1) for w in old_workers[:2]]
            self.send(old_workers[0].port, packets[0])
            self.expect_nothing()  # not completed by the old job's bitmap or count
            self.send(old_workers[1].port, packets[1])
            self.expect_on_ports([(w.port, result_for(packets[1], w, [3] * wire.K, -1)) for w in old_workers[:2]])


class TakenOverSlotStartsTheRoundBeforeAfresh(NetaggTest):
    """A slot taken over (new generation, as after a switch restart) by round 2 marks its other pool two rounds
    behind: round 1 there is then a new round of the new job, not the old job's completed one (one behind, the
    resend below would have read the old job's sums back), and both rounds complete with their own sums."""

    def runTest(self) -> None:
        workers = make_workers(2)
        old = self.add_job(workers, slot_base=110, slot_count=1)
        first = [contribution(old, w, [500] * wire.K, pool=0, round=1) for w in workers]
        for w, p in zip(workers, first):
            self.send(w.port, p)
        self.expect_on_ports([(w.port, result_for(first[-1], w, [1000] * wire.K, 0)) for w in workers])
        self.delete_job(old)
        new = self.add_job(workers, slot_base=110, slot_count=1)
        before = self.job_counters(new)
        # Worker 1 is on round 2 (pool 1); worker 0 still resends round 1 (pool 0), as does worker 1's shadow copy.
        ahead = contribution(new, workers[1], [20] * wire.K, pool=1, seq=2, round=2)
        self.send(workers[1].port, ahead)
        self.wait_for_counter(new, "contributions", before["contributions"] + 1)
        resend = contribution(new, workers[0], [1] * wire.K, pool=0, seq=1, round=1, flags=wire.FLAG_RETRANSMIT)
        self.send(workers[0].port, resend)
        self.wait_for_counter(new, "contributions", before["contributions"] + 2)
        self.expect_nothing()  # it started a new round 1: no answer with the old job's stored result
        shadow = contribution(new, workers[1], [2] * wire.K, pool=0, seq=1, round=1, flags=wire.FLAG_RETRANSMIT)
        self.send(workers[1].port, shadow)
        self.expect_on_ports([(w.port, result_for(shadow, w, [3] * wire.K, 0)) for w in workers])
        last = contribution(new, workers[0], [10] * wire.K, pool=1, seq=2, round=2)
        self.send(workers[0].port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [30] * wire.K, 0)) for w in workers])
        self.expect_nothing()
        after = self.job_counters(new)
        self.assertEqual(after["results"] - before["results"], 2)
        self.assertEqual(after["contributions"] - before["contributions"], 4)
