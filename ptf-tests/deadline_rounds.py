"""Deadline rounds (docs/protocol.md, "Closing a round at a deadline"): a member closes a round early.

A close request is a member's contribution (or its resend) with ``FLAG_CLOSE``: processed as a contribution,
then, if the round is still incomplete, it completes now and leaves once to the job's group as the result —
the stored sums and exponent, RESULT | CLOSE with the round flags, and ``members`` = the bitmap of the
contributions in the sum. A closed round changes no more: every later packet of it is answered to its sender
alone from storage (a late member's values are never added: LATE_FOR_CLOSED_ROUND). A close that completes
the round normally, or reaches a complete round, behaves as without the flag. Forged closes are refused like
any forged contribution; a close on a tree's leaf, or a parent's result with CLOSE, is CLOSE_REFUSED.

Packets from different ports have no order inside the switch, so where the order matters (what is in the sum
when the close arrives) a test waits for the switch to have taken a packet before it sends the next. The
narrow jobs here share cells 200.. so that each test meets rounds the module's other tests closed there (in
another generation); the wide job lives at cell 400.
"""

from __future__ import annotations

from tree_levels import PARENT_IP, PARENT_PORT, _Tree

from netagg import dataplane as dp
from netagg import wire
from netagg.dataplane import DropReason

from base_test import Netagg, NetaggTest, Worker, _ip, contribution, int32, make_workers, result_for

CLOSE, RETRANSMIT = wire.FLAG_CLOSE, wire.FLAG_RETRANSMIT
NAN, POS_INF, OUT_OF_STEP = wire.FLAG_NAN, wire.FLAG_POS_INF, wire.FLAG_OUT_OF_STEP
EXCHANGE = wire.exchange_id(11, 4)
OTHER_EXCHANGE = wire.exchange_id(12, 4)
#: The cells the narrow jobs of this module use (clear of the other modules' jobs).
SLOT_BASE = 200
WIDE = wire.WIDE_K


def _members(*workers) -> int:
    return wire.members_of(w.rank for w in workers)


def _chunked(base: int) -> list[int]:
    """256 values that differ in every chunk and within it (a value landing in another chunk's cell shows)."""
    return [base + 1000 * c + i for c in range(WIDE // wire.K) for i in range(wire.K)]


class _Counting:
    """Assertions on the job and drop counters around a step (a mixin of a NetaggTest)."""

    def assert_job_moved(self, job, before: dict[str, int], **moved: int) -> None:
        """Each job counter moved by ``moved[name]`` since ``before`` (0 for those not named)."""
        after = self.job_counters(job)
        unknown = set(moved) - set(dp.JOB_COUNTERS)
        self.assertFalse(unknown, f"no such job counters: {unknown}")
        got = {name: after[name] - before[name] for name in dp.JOB_COUNTERS}
        self.assertEqual(got, {name: moved.get(name, 0) for name in dp.JOB_COUNTERS})

    def assert_drops_moved(self, before: dict[DropReason, int], moved: dict[DropReason, int] | None = None) -> None:
        """Exactly the drop counters in ``moved`` moved, each by its count, since ``before``."""
        after = self.drops()
        got = {reason: after[reason] - before[reason] for reason in DropReason if after[reason] != before[reason]}
        self.assertEqual(got, moved or {})


class _Deadline(NetaggTest, _Counting):
    """Helpers: send a packet and wait until the switch has taken it."""

    def send_taken(self, job, worker: Worker, pkt, counter: str) -> None:
        """Send ``pkt`` from ``worker``'s port and wait for the job's ``counter`` to move."""
        target = self.job_counters(job)[counter] + 1
        self.send(worker.port, pkt)
        self.wait_for_counter(job, counter, target)

    def assert_answered(self, worker: Worker, pkt, values: list[int], exponent: int, round_flags: int,
                        members: int | None = None) -> None:
        """``pkt`` from ``worker`` is answered to ``worker`` alone with the stored result, and nothing else leaves."""
        self.send(worker.port, pkt)
        self.expect_on_ports([(worker.port, result_for(pkt, worker, values, exponent, round_flags, members))])
        self.expect_nothing()


class CloseReleasesThePartialSumToTheGroup(_Deadline):
    """Four workers; ranks 0 and 1 contribute (NaN from rank 0), rank 2 contributes with CLOSE: rank 3 is missing.
    The close leaves once, to every worker (rank 3 too), as the result: the three contributions' sums and
    maximum exponent, RESULT | CLOSE | NAN, members = 0b0111. Counted as a contribution and a result."""

    def runTest(self) -> None:
        workers = make_workers(4)
        job = self.add_job(workers, slot_base=SLOT_BASE, slot_count=4)
        drops, before = self.drops(), self.job_counters(job)
        self.send_taken(job, workers[0], contribution(job, workers[0], [10] * wire.K, slot=1, exponent=-3, seq=4,
                                                      flags=NAN, exchange=EXCHANGE), "contributions")
        self.send_taken(job, workers[1], contribution(job, workers[1], list(range(wire.K)), slot=1, exponent=7,
                                                      seq=4, exchange=EXCHANGE), "contributions")
        self.expect_nothing()
        close = contribution(job, workers[2], [-4] * wire.K, slot=1, exponent=2, seq=4, flags=CLOSE,
                             exchange=EXCHANGE)
        self.send(workers[2].port, close)
        total = [10 + v - 4 for v in range(wire.K)]
        members = _members(*workers[:3])
        self.expect_on_ports([(w.port, result_for(close, w, total, 7, CLOSE | NAN, members)) for w in workers])
        self.expect_nothing()
        self.assert_job_moved(job, before, contributions=3, results=1)
        self.assert_drops_moved(drops)


class CloseOfASubsetRound(_Deadline):
    """A subset round of ranks {0, 2, 3, 4} of a five-worker job: ranks 0 and 3 contribute, then rank 0 resends its
    contribution with CLOSE (how a host closes at its deadline): the round is released once, to the whole
    group, with members = {0, 3} and the two contributions' sums (rank 0's once). The resend's close counts as a
    result only (it contributed before); its RETRANSMIT flag stays."""

    def runTest(self) -> None:
        workers = make_workers(5)
        job = self.add_job(workers, slot_base=SLOT_BASE, slot_count=4)
        members = _members(workers[0], workers[2], workers[3], workers[4])
        drops, before = self.drops(), self.job_counters(job)
        first = contribution(job, workers[0], [100] * wire.K, slot=2, exponent=1, seq=9, members=members)
        self.send_taken(job, workers[0], first, "contributions")
        self.send_taken(job, workers[3], contribution(job, workers[3], [-1] * wire.K, slot=2, exponent=-6, seq=9,
                                                      members=members), "contributions")
        self.expect_nothing()
        close = contribution(job, workers[0], [100] * wire.K, slot=2, exponent=1, seq=9, members=members,
                             flags=CLOSE | RETRANSMIT)
        self.send(workers[0].port, close)
        inside = _members(workers[0], workers[3])
        self.expect_on_ports([(w.port, result_for(close, w, [99] * wire.K, 1, CLOSE, inside)) for w in workers])
        self.expect_nothing()
        self.assert_job_moved(job, before, contributions=2, results=1)
        self.assert_drops_moved(drops)


class LateMemberIsAnsweredAndNeverAdded(_Deadline):
    """After a close, a member that had not contributed sends its contribution: it is answered alone with the
    stored result (CLOSE, members without its bit), counted in retransmit_results and
    drop_reasons[LATE_FOR_CLOSED_ROUND] (not a job reject), and not added: its resend, and a contributor's
    resend, still get the same sum. A late packet of another collective also learns OUT_OF_STEP, which the
    round's own result does not gain."""

    def runTest(self) -> None:
        workers = make_workers(4)
        job = self.add_job(workers, slot_base=SLOT_BASE, slot_count=4)
        w0, w1, w2, w3 = workers
        self.send_taken(job, w0, contribution(job, w0, [5] * wire.K, exponent=3, seq=2, exchange=EXCHANGE),
                        "contributions")
        close = contribution(job, w1, [6] * wire.K, exponent=-2, seq=2, flags=CLOSE | POS_INF, exchange=EXCHANGE)
        self.send(w1.port, close)
        inside = _members(w0, w1)
        self.expect_on_ports([(w.port, result_for(close, w, [11] * wire.K, 3, CLOSE | POS_INF, inside))
                              for w in workers])
        self.expect_nothing()
        drops, before = self.drops(), self.job_counters(job)
        # Rank 2 arrives late, with another exponent and flags: answered alone, not added.
        late = contribution(job, w2, [1000] * wire.K, exponent=40, seq=2, flags=NAN, exchange=EXCHANGE)
        self.assert_answered(w2, late, [11] * wire.K, 3, CLOSE | POS_INF, inside)
        self.assert_job_moved(job, before, retransmit_results=1)
        self.assert_drops_moved(drops, {DropReason.LATE_FOR_CLOSED_ROUND: 1})
        # Its resend: still late (its bit was never set), still the same answer.
        resend = contribution(job, w2, [1000] * wire.K, exponent=40, seq=2, flags=RETRANSMIT, exchange=EXCHANGE)
        self.assert_answered(w2, resend, [11] * wire.K, 3, CLOSE | POS_INF, inside)
        # Rank 3, late and of another collective: OUT_OF_STEP in its answer only.
        stray = contribution(job, w3, [7] * wire.K, exponent=1, seq=2, exchange=OTHER_EXCHANGE)
        self.assert_answered(w3, stray, [11] * wire.K, 3, CLOSE | POS_INF | OUT_OF_STEP, inside)
        # A contributor that lost the result resends: the same sum, members and flags (no OUT_OF_STEP).
        again = contribution(job, w0, [5] * wire.K, exponent=3, seq=2, flags=RETRANSMIT, exchange=EXCHANGE)
        self.assert_answered(w0, again, [11] * wire.K, 3, CLOSE | POS_INF, inside)
        self.assert_job_moved(job, before, retransmit_results=4)
        self.assert_drops_moved(drops, {DropReason.LATE_FOR_CLOSED_ROUND: 3})


class RoundIsReleasedOnce(_Deadline):
    """Duplicates of the close request, the closer's resend (with CLOSE or without), and a second member's close
    after the first: each is answered to its sender alone with the stored result, never released to the group
    again; none is a late contribution."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers, slot_base=SLOT_BASE, slot_count=4)
        w0, w1 = workers[:2]
        self.send_taken(job, w0, contribution(job, w0, [2] * wire.K, slot=3, exponent=-1, seq=6), "contributions")
        close = contribution(job, w1, [3] * wire.K, slot=3, exponent=-9, seq=6, flags=CLOSE)
        self.send(w1.port, close)
        inside = _members(w0, w1)
        self.expect_on_ports([(w.port, result_for(close, w, [5] * wire.K, -1, CLOSE, inside)) for w in workers])
        self.expect_nothing()
        drops, before = self.drops(), self.job_counters(job)
        for pkt, worker in (
            (close, w1),  # a duplicate of the close request
            (close, w1),
            (contribution(job, w1, [3] * wire.K, slot=3, exponent=-9, seq=6, flags=CLOSE | RETRANSMIT), w1),
            (contribution(job, w1, [3] * wire.K, slot=3, exponent=-9, seq=6, flags=RETRANSMIT), w1),
            (contribution(job, w0, [2] * wire.K, slot=3, exponent=-1, seq=6, flags=CLOSE | RETRANSMIT), w0),
        ):
            self.assert_answered(worker, pkt, [5] * wire.K, -1, CLOSE, inside)
        self.assert_job_moved(job, before, retransmit_results=5)
        self.assert_drops_moved(drops)


class CloseThatCompletesTheRoundIsNoClose(_Deadline):
    """A close request that is the round's last expected contribution completes it normally: the result carries
    no CLOSE and echoes the packet's members (a subset round's here). A close request to a complete round is
    a resend: the stored result to its sender alone, without CLOSE. So is a close of the whole job's round
    after its last contribution."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers, slot_base=SLOT_BASE, slot_count=4)
        w0, w1, w2 = workers
        members = _members(w0, w2)
        drops, before = self.drops(), self.job_counters(job)
        self.send_taken(job, w0, contribution(job, w0, [8] * wire.K, slot=1, exponent=4, seq=3, members=members),
                        "contributions")
        last = contribution(job, w2, [-2] * wire.K, slot=1, exponent=0, seq=3, members=members, flags=CLOSE)
        self.send(w2.port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [6] * wire.K, 4)) for w in workers])
        self.expect_nothing()
        expected = result_for(last, w0, [6] * wire.K, 4)[Netagg]  # what every worker got
        self.assertEqual((expected.members, expected.flags & CLOSE), (members, 0))
        self.assert_job_moved(job, before, contributions=2, results=1)
        resend = contribution(job, w0, [8] * wire.K, slot=1, exponent=4, seq=3, members=members,
                              flags=CLOSE | RETRANSMIT)
        self.assert_answered(w0, resend, [6] * wire.K, 4, 0)
        self.assert_job_moved(job, before, contributions=2, results=1, retransmit_results=1)
        # The whole job's round in slot 2: every worker, the last with CLOSE; then rank 1's close again.
        packets = [contribution(job, w, [w.rank + 1] * wire.K, slot=2, seq=4) for w in workers]
        for w, p in zip(workers[:-1], packets[:-1]):
            self.send_taken(job, w, p, "contributions")
        last = contribution(job, w2, [3] * wire.K, slot=2, seq=4, flags=CLOSE)
        self.send(w2.port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [6] * wire.K, 0)) for w in workers])
        self.expect_nothing()
        self.assert_answered(w1, contribution(job, w1, [2] * wire.K, slot=2, seq=4, flags=CLOSE), [6] * wire.K, 0, 0)
        self.assert_job_moved(job, before, contributions=5, results=2, retransmit_results=2)
        self.assert_drops_moved(drops)


class CloseOfAnotherCollective(_Deadline):
    """A close request naming another collective than the round's: not added (EXCHANGE_MISMATCH, a job reject, no
    contribution), but it closes the round: the result carries the stored sums, OUT_OF_STEP | CLOSE, and the
    bitmap with its bit (it counted towards completion, as a mismatched contribution does)."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers, slot_base=SLOT_BASE, slot_count=4)
        w0, w1, w2 = workers
        drops, before = self.drops(), self.job_counters(job)
        self.send_taken(job, w0, contribution(job, w0, [9] * wire.K, exponent=2, seq=5, exchange=EXCHANGE),
                        "contributions")
        close = contribution(job, w1, [500] * wire.K, exponent=30, seq=5, flags=CLOSE | NAN, exchange=OTHER_EXCHANGE)
        self.send(w1.port, close)
        inside = _members(w0, w1)
        self.expect_on_ports([(w.port, result_for(close, w, [9] * wire.K, 2, CLOSE | OUT_OF_STEP, inside))
                              for w in workers])
        self.expect_nothing()
        self.assert_job_moved(job, before, contributions=1, results=1, rejects=1)
        self.assert_drops_moved(drops, {DropReason.EXCHANGE_MISMATCH: 1})
        late = contribution(job, w2, [1] * wire.K, seq=5, exchange=EXCHANGE)
        self.assert_answered(w2, late, [9] * wire.K, 2, CLOSE | OUT_OF_STEP, inside)
        self.assert_job_moved(job, before, contributions=1, results=1, rejects=1, retransmit_results=1)
        self.assert_drops_moved(drops, {DropReason.EXCHANGE_MISMATCH: 1, DropReason.LATE_FOR_CLOSED_ROUND: 1})


class ForgedClosesAreRefused(_Deadline):
    """A subset round of ranks {0, 1, 2} of a four-worker job, rank 0 in. Close requests from another tenant's
    worker (its own address, naming this job), from a host on another port forging rank 1's address (with and
    without the controller's source binding), from rank 1 claiming rank 2, from rank 3 (not a member) and from
    rank 1 naming other members: each is refused with its usual drop reason, changes nothing and releases
    nothing; the round then completes normally (no CLOSE, members echoed) with the members' sums."""

    def runTest(self) -> None:
        workers = make_workers(4)
        job = self.add_job(workers, slot_base=SLOT_BASE, slot_count=4)
        tenant_b = [Worker(rank=r, port=6 + r, mac=f"02:00:00:00:0b:{r:02x}", ip=f"10.99.2.{1 + r}",
                           udp_port=43000 + r) for r in range(2)]
        other = self.add_job(tenant_b, slot_base=SLOT_BASE + 8, slot_count=2)
        w0, w1, w2, w3 = workers
        members = _members(w0, w1, w2)
        self.send_taken(job, w0, contribution(job, w0, [1] * wire.K, slot=2, seq=7, members=members),
                        "contributions")
        forged_w1 = Worker(rank=1, port=8, mac="02:00:00:00:0e:0e", ip=w1.ip, udp_port=w1.udp_port)
        attempts = [
            # Tenant B's worker, from its own port, naming tenant A's job and a rank of it.
            (tenant_b[0], contribution(job, tenant_b[0], [666] * wire.K, slot=2, seq=7, members=members,
                                       flags=CLOSE, rank=1), DropReason.UNKNOWN_WORKER, True),
            # Rank 1's address and UDP port, from another switch port.
            (forged_w1, contribution(job, forged_w1, [666] * wire.K, slot=2, seq=7, members=members, flags=CLOSE),
             DropReason.UNKNOWN_WORKER, True),
            # Rank 1 claiming to be rank 2.
            (w1, contribution(job, w1, [666] * wire.K, slot=2, seq=7, members=members, flags=CLOSE, rank=2),
             DropReason.RANK_MISMATCH, True),
            # Rank 3, a worker of the job but not a member of the round.
            (w3, contribution(job, w3, [666] * wire.K, slot=2, seq=7, members=members, flags=CLOSE),
             DropReason.NOT_A_MEMBER, True),
            # Rank 1 naming other members than the round's: it changes nothing.
            (w1, contribution(job, w1, [666] * wire.K, slot=2, seq=7, members=_members(w0, w1), flags=CLOSE),
             DropReason.MEMBERS_MISMATCH, True),
        ]
        for sender, pkt, reason, job_reject in attempts:
            self.assert_refused(job, sender.port, pkt, reason, job_reject)
        # The controller binds rank 1's address to its port: the forgery is a spoofed source now (no job counter).
        self.insert(dp.TABLE_SOURCES, {"ipv4_src": _ip(w1.ip)}, dp.ACTION_BIND_TO_PORT, {"port": w1.port})
        self.assert_refused(job, forged_w1.port, attempts[1][1], DropReason.SPOOFED_SOURCE, False)
        self.assertEqual(self.job_counters(other)["rejects"], 0)
        before = self.job_counters(job)
        self.send_taken(job, w1, contribution(job, w1, [2] * wire.K, slot=2, seq=7, members=members),
                        "contributions")
        self.expect_nothing()
        last = contribution(job, w2, [3] * wire.K, slot=2, seq=7, members=members)
        self.send(w2.port, last)
        self.expect_on_ports([(w.port, result_for(last, w, [6] * wire.K, 0)) for w in workers])
        self.expect_nothing()
        self.assert_job_moved(job, before, contributions=2, results=1)

    def assert_refused(self, job, port: int, pkt, reason: DropReason, job_reject: bool) -> None:
        drops, before = self.drops(), self.job_counters(job)
        self.send(port, pkt)
        self.expect_nothing()
        self.assert_drops_moved(drops, {reason: 1})
        self.assert_job_moved(job, before, rejects=1 if job_reject else 0)


class NextRoundOfThePoolOpensNormally(_Deadline):
    """Round 1 (pool 0) is closed by rank 1 with ranks 0 and 1 in; round 2 (pool 1) is closed by rank 3's close as
    its first packet (released with rank 3 alone); round 3 (pool 0 again) opens normally: it waits for every
    worker and completes without CLOSE. A late packet of round 1 is then OLD: a duplicate, nothing leaves."""

    def runTest(self) -> None:
        workers = make_workers(4)
        job = self.add_job(workers, slot_base=SLOT_BASE, slot_count=4)
        w0, w1, w2, w3 = workers
        before = self.job_counters(job)
        self.send_taken(job, w0, contribution(job, w0, [1] * wire.K, round=1, pool=0, seq=1), "contributions")
        close = contribution(job, w1, [2] * wire.K, round=1, pool=0, seq=1, flags=CLOSE)
        self.send(w1.port, close)
        self.expect_on_ports([(w.port, result_for(close, w, [3] * wire.K, 0, CLOSE, _members(w0, w1)))
                              for w in workers])
        self.expect_nothing()
        first_close = contribution(job, w3, [40] * wire.K, round=2, pool=1, seq=2, exponent=5, flags=CLOSE)
        self.send(w3.port, first_close)
        self.expect_on_ports([(w.port, result_for(first_close, w, [40] * wire.K, 5, CLOSE, w3.mask))
                              for w in workers])
        self.expect_nothing()
        self.assert_job_moved(job, before, contributions=3, results=2)
        third = [contribution(job, w, [w.rank * 10] * wire.K, round=3, pool=0, seq=3, exponent=-w.rank)
                 for w in workers]
        for w, p in zip(workers[:-1], third[:-1]):
            self.send_taken(job, w, p, "contributions")
        self.expect_nothing()  # the round waits for rank 3: no longer closed
        self.send(w3.port, third[-1])
        self.expect_on_ports([(w.port, result_for(third[-1], w, [60] * wire.K, 0)) for w in workers])
        self.expect_nothing()
        self.assert_job_moved(job, before, contributions=7, results=3)
        drops, before = self.drops(), self.job_counters(job)
        self.send(w2.port, contribution(job, w2, [99] * wire.K, round=1, pool=0, seq=1))
        self.wait_for_counter(job, "duplicates", before["duplicates"] + 1)
        self.expect_nothing()
        self.assert_job_moved(job, before, duplicates=1)
        self.assert_drops_moved(drops)


class _Leaf(_Tree):
    """A job of three workers whose segment here is a tree's leaf (up link on PARENT_PORT)."""

    def setUp(self) -> None:
        super().setUp()
        self.workers = make_workers(3)
        self.job = self.add_job(self.workers, slot_base=SLOT_BASE, slot_count=4)
        self.add_links(self.job, PARENT_PORT, PARENT_IP, self.parent_job, self.parent_rank)


class CloseIsRefusedOnATreeLeaf(_Leaf, _Counting):
    """A worker's close request on a leaf segment — to an open round, as a round's first packet, a resend with
    CLOSE, and after the parent's result — is dropped as CLOSE_REFUSED (a job reject) before any register
    changes: the round completes with every contribution and its partial goes up without CLOSE. A parent's
    result carrying CLOSE is refused the same way; the round still takes the parent's plain result."""

    def runTest(self) -> None:
        w0, w1, w2 = self.workers
        self.send(w0.port, contribution(self.job, w0, [1] * wire.K, slot=1, seq=3))
        self.wait_for_counter(self.job, "contributions", 1)
        refused = [
            (w1, contribution(self.job, w1, [500] * wire.K, slot=1, seq=3, flags=CLOSE)),  # to the open round
            (w0, contribution(self.job, w0, [1] * wire.K, slot=1, seq=3, flags=CLOSE | RETRANSMIT)),  # a resend
            (w2, contribution(self.job, w2, [500] * wire.K, slot=2, seq=4, flags=CLOSE)),  # a new round's first
        ]
        for w, pkt in refused:
            self.assert_close_refused(w.port, pkt)
        # Slot 1 completes with all three (w1's refused values not in it), and slot 2 needs all three too.
        packets = [contribution(self.job, w, [w.rank + 1] * wire.K, slot=1, seq=3) for w in self.workers]
        for w, p in zip(self.workers[1:], packets[1:]):
            self.send(w.port, p)
        self.expect_on_ports([(PARENT_PORT, self.up_for(packets[-1], [6] * wire.K, 0))])
        self.expect_nothing()
        second = [contribution(self.job, w, [10] * wire.K, slot=2, seq=4) for w in self.workers]
        for w, p in zip(self.workers[:-1], second[:-1]):
            self.send(w.port, p)
        self.wait_for_counter(self.job, "contributions", 5)
        self.expect_nothing()
        self.send(w2.port, second[-1])
        self.expect_on_ports([(PARENT_PORT, self.up_for(second[-1], [30] * wire.K, 0))])
        self.expect_nothing()
        # The parent's result of a closed round: refused; the plain one comes down.
        self.assert_close_refused(PARENT_PORT, self.down([7] * wire.K, 1, slot=1, seq=3, round_flags=CLOSE))
        down = self.down([60] * wire.K, 2, slot=1, seq=3)
        self.send(PARENT_PORT, down)
        self.expect_on_ports([(w.port, self.down_result(down, self.job, w, [60] * wire.K, 2)) for w in self.workers])
        self.expect_nothing()
        # A close after the final result: still refused (not answered).
        self.assert_close_refused(w1.port, contribution(self.job, w1, [2] * wire.K, slot=1, seq=3,
                                                        flags=CLOSE | RETRANSMIT))

    def assert_close_refused(self, port: int, pkt) -> None:
        drops, before = self.drops(), self.job_counters(self.job)
        self.send(port, pkt)
        self.expect_nothing()
        self.assert_drops_moved(drops, {DropReason.CLOSE_REFUSED: 1})
        self.assert_job_moved(self.job, before, rejects=1)


class WideRoundClose(_Deadline):
    """A wide job (256 values, four cells per slot): ranks 0 and 1 contribute, rank 1 closes by resending; every
    worker gets the two contributions' sums in all four chunks with CLOSE and members 0b011; rank 2's late wide
    contribution is answered alone and added in no chunk; the pool's next round is exact again."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers, slot_base=400, slot_count=2, k=WIDE)
        w0, w1, w2 = workers
        drops, before = self.drops(), self.job_counters(job)
        self.send_taken(job, w0, contribution(job, w0, _chunked(1), slot=1, exponent=6, seq=8), "contributions")
        self.send_taken(job, w1, contribution(job, w1, _chunked(-5000), slot=1, exponent=-1, seq=8),
                        "contributions")
        self.expect_nothing()
        close = contribution(job, w1, _chunked(-5000), slot=1, exponent=-1, seq=8, flags=CLOSE | RETRANSMIT)
        self.assertEqual(len(close), wire.frame_bytes(WIDE))
        self.send(w1.port, close)
        total = int32(a + b for a, b in zip(_chunked(1), _chunked(-5000)))
        inside = _members(w0, w1)
        self.expect_on_ports([(w.port, result_for(close, w, total, 6, CLOSE, inside)) for w in workers])
        self.expect_nothing()
        self.assert_job_moved(job, before, contributions=2, results=1)
        late = contribution(job, w2, _chunked(70000), slot=1, exponent=20, seq=8)
        self.assert_answered(w2, late, total, 6, CLOSE, inside)
        again = contribution(job, w0, [0] * WIDE, slot=1, exponent=6, seq=8, flags=RETRANSMIT)
        self.assert_answered(w0, again, total, 6, CLOSE, inside)
        self.assert_job_moved(job, before, contributions=2, results=1, retransmit_results=2)
        self.assert_drops_moved(drops, {DropReason.LATE_FOR_CLOSED_ROUND: 1})
        # Round 3 of slot 1 (pool 0 again): every worker, no CLOSE.
        values = [_chunked(7 * w.rank) for w in workers]
        packets = [contribution(job, w, v, slot=1, round=3, seq=9) for w, v in zip(workers, values)]
        for w, p in zip(workers[:-1], packets[:-1]):
            self.send_taken(job, w, p, "contributions")
        self.expect_nothing()
        self.send(w2.port, packets[-1])
        total = int32(map(sum, zip(*values)))
        self.expect_on_ports([(w.port, result_for(packets[-1], w, total, 0)) for w in workers])
        self.expect_nothing()
