"""Congestion marks (docs/protocol.md, "Congestion marks"): ECN through the aggregation.

A switch that sums a round makes one result of many contributions, so the ECN bits of the contributions would
be lost with them: as ATP does, a round one of whose contributions arrived CE-marked (a queue on that worker's
way was filling up) sends its result CE-marked to every member, whichever packet completed it; a resend's
answer from storage, and a closed round's answer, keep the mark; the slot's next round starts unmarked. An
unmarked round's result keeps the completing packet's own TOS. Hosts send ECT(0).
"""

from __future__ import annotations

from netagg import wire

from base_test import NetaggTest, contribution, make_workers, result_for

ECT0, CE = wire.ECN_ECT0, wire.ECN_CE
#: A DSCP beside the ECN bits: the switch changes only the two ECN bits.
DSCP = 0x28 << 2


class CongestionMarkOfOneContributionReachesEveryMember(NetaggTest):
    """Three workers: rank 0's contribution arrives CE, the others ECT(0) (the completing one too): the result
    leaves CE to all three, its DSCP unchanged; rank 1's resend is answered CE from storage; the slot's next
    round of the same pool, all ECT(0), leaves ECT(0); a round whose only mark is on its completing packet
    leaves CE."""

    def complete_round(self, workers: list, packets: list, total: int, ce: bool) -> None:
        """Each worker's packet of one round, the last one completing it: its result reaches every worker, with
        every value ``total``, CE-marked or with the completing packet's TOS."""
        for w, p in zip(workers[:-1], packets[:-1]):
            self.send(w.port, p)
        self.expect_nothing()
        self.send(workers[-1].port, packets[-1])
        self.expect_on_ports([(w.port, result_for(packets[-1], w, [total] * wire.K, 0, ce=ce)) for w in workers])
        self.expect_nothing()

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers)
        tos = [DSCP | CE, DSCP | ECT0, DSCP | ECT0]
        first = [contribution(job, w, [w.rank + 1] * wire.K, seq=3, tos=t) for w, t in zip(workers, tos)]
        self.complete_round(workers, first, 6, ce=True)
        resend = contribution(job, workers[1], [2] * wire.K, seq=3, flags=wire.FLAG_RETRANSMIT, tos=ECT0)
        self.send(workers[1].port, resend)
        self.expect(workers[1].port, result_for(resend, workers[1], [6] * wire.K, 0, ce=True))
        self.expect_nothing()
        # Round 3 (pool 0 again): nothing marked.
        third = [contribution(job, w, [1] * wire.K, round=3, seq=4, tos=ECT0) for w in workers]
        self.complete_round(workers, third, 3, ce=False)
        # Slot 1: only the completing packet is marked.
        fourth = [contribution(job, w, [2] * wire.K, slot=1, seq=5, tos=CE if w.rank == 2 else ECT0)
                  for w in workers]
        self.complete_round(workers, fourth, 6, ce=True)


class ClosedRoundKeepsItsCongestionMark(NetaggTest):
    """A deadline round: rank 0 arrives CE, rank 1 closes the round (ECT(0)) without rank 2: the partial result
    leaves CE with CLOSE to the group; late rank 2 (ECT(0)) is answered from storage, still CE."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers)
        first = contribution(job, workers[0], [5] * wire.K, slot=2, seq=7, tos=CE)
        self.send(workers[0].port, first)
        self.expect_nothing()
        close = contribution(job, workers[1], [1] * wire.K, slot=2, seq=7, flags=wire.FLAG_CLOSE, tos=ECT0)
        self.send(workers[1].port, close)
        members = (1 << workers[0].rank) | (1 << workers[1].rank)
        self.expect_on_ports([(w.port, result_for(close, w, [6] * wire.K, 0, wire.FLAG_CLOSE, members, ce=True))
                              for w in workers])
        self.expect_nothing()
        late = contribution(job, workers[2], [9] * wire.K, slot=2, seq=7, tos=ECT0)
        self.send(workers[2].port, late)
        self.expect(workers[2].port, result_for(late, workers[2], [6] * wire.K, 0, wire.FLAG_CLOSE, members,
                                                ce=True))
        self.expect_nothing()
