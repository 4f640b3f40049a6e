"""A tree of switches (docs/hierarchy.md): a job's completed partial goes up, the parent's result comes down.

The switch under test plays one level at a time, and PTF plays the others: the parent behind the
up port (``PARENT_PORT``), or the children on a parent switch's ports. The last case builds a whole
two-level tree out of the one switch (two leaf segments and a root segment, the harness carrying
packets between their ports as the inter-switch links would) for a job of 64 workers, which no
single switch segment can hold (one 32-bit bitmap per slot).
"""

from __future__ import annotations

import time

from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from netagg import dataplane as dp
from netagg import wire
from netagg.dataplane import DropReason

from base_test import (
    AGGREGATOR_IP,
    PACKET_TIMEOUT,
    SWITCH_MAC,
    Job,
    Netagg,
    NetaggTest,
    Worker,
    contribution,
    int32,
    make_workers,
    netagg_payload,
    result_for,
)

#: The parent switch, behind port 8.
PARENT_PORT = 8
PARENT_MAC = "02:00:00:00:0f:fe"
PARENT_IP = "10.98.0.254"
#: The UDP port a switch's up packets leave from and its parent's results come back to.
UP_UDP = wire.NETAGG_TREE_UDP_PORT


def _ip(text: str) -> int:
    return int.from_bytes(bytes(int(part) for part in text.split(".")), "big")


def _mac(text: str) -> int:
    return int(text.replace(":", ""), 16)


class _Tree(NetaggTest):
    """Up and down links, and the packets that cross them."""

    parent_job = 77
    parent_rank = 2

    def add_links(self, job: Job, port: int, parent_ip: str, parent_job: int, parent_rank: int,
                  parent_mac: str = PARENT_MAC) -> None:
        self.insert(dp.TABLE_UP_LINKS, {"job_id": job.job_id}, dp.ACTION_SET_UP_LINK, {
            "port": port, "parent_job": parent_job, "parent_rank": parent_rank, "parent_mac": _mac(parent_mac),
            "parent_addr": _ip(parent_ip)})
        self.insert(dp.TABLE_DOWN_LINKS, {"ingress_port": port, "ipv4_src": _ip(parent_ip), "job_id": parent_job},
                    dp.ACTION_SET_DOWN_LINK, {"job": job.job_id})

    def up_for(self, sent, values: list[int], exponent: int, resend: bool = False, parent_job: int | None = None,
               parent_rank: int | None = None, parent_ip: str = PARENT_IP, round_flags: int = 0):
        """The contribution this switch sends its parent for ``sent`` (the completing or resent packet): of the
        flags only the round's (``round_flags``) and RETRANSMIT on a resend; ``exchange`` echoed."""
        hdr = sent[Netagg]
        return (Ether(src=SWITCH_MAC, dst=PARENT_MAC)
                / IP(src=AGGREGATOR_IP, dst=parent_ip, id=sent[IP].id, flags=sent[IP].flags, ttl=64)
                / UDP(sport=UP_UDP, dport=wire.NETAGG_UDP_PORT, chksum=0)
                / netagg_payload(values, job_id=self.parent_job if parent_job is None else parent_job,
                                 slot=hdr.slot, pool=hdr.pool,
                                 rank=self.parent_rank if parent_rank is None else parent_rank,
                                 exponent=exponent, seq=hdr.seq, round=hdr.round, members=0, exchange=hdr.exchange,
                                 flags=round_flags | (wire.FLAG_RETRANSMIT if resend else 0)))

    def down(self, values: list[int], exponent: int, slot: int = 0, pool: int = 0, round: int = 1, seq: int = 0,
             src: str = PARENT_IP, job_id: int | None = None, sport: int = wire.NETAGG_UDP_PORT, round_flags: int = 0,
             exchange: int = 0):
        """The parent's result for this switch, as the parent sends it (to the up link's address and port)."""
        return (Ether(src=PARENT_MAC, dst=SWITCH_MAC)
                / IP(src=src, dst=AGGREGATOR_IP, id=0x4321, flags=0, ttl=64)
                / UDP(sport=sport, dport=UP_UDP, chksum=0)
                / netagg_payload(values, job_id=self.parent_job if job_id is None else job_id, slot=slot, pool=pool,
                                 rank=0, exponent=exponent, seq=seq, round=round, exchange=exchange,
                                 flags=wire.FLAG_RESULT | round_flags))

    def down_result(self, down_pkt, job: Job, to: Worker, values: list[int], exponent: int):
        """What a worker of ``job`` receives when this switch passes the parent's result down."""
        hdr = down_pkt[Netagg]
        header = {f.name: getattr(hdr, f.name) for f in wire.HEADER_FIELDS}
        header.update(job_id=job.job_id, exponent=exponent)
        return (Ether(src=SWITCH_MAC, dst=to.mac)
                / IP(src=AGGREGATOR_IP, dst=to.ip, id=down_pkt[IP].id, flags=down_pkt[IP].flags, ttl=64)
                / UDP(sport=wire.NETAGG_UDP_PORT, dport=to.udp_port, chksum=0)
                / netagg_payload(values, **header))


class _Leaf(_Tree):
    """A job of three workers on ports 1..3 whose segment here is a leaf: parent job 77, rank 2 there."""

    def setUp(self) -> None:
        super().setUp()
        self.workers = make_workers(3)
        self.job = self.add_job(self.workers)
        self.add_links(self.job, PARENT_PORT, PARENT_IP, self.parent_job, self.parent_rank)

    def complete_round(self, values: list[list[int]], exponents: list[int], **fields: int):
        """Every worker's contribution; returns the completing packet (its up packet is left to the caller)."""
        packets = [contribution(self.job, w, v, exponent=e, **fields)
                   for w, v, e in zip(self.workers, values, exponents)]
        for w, p in zip(self.workers, packets):
            self.send(w.port, p)
        return packets[-1]


class LeafSendsTheCompletedPartialUp(_Leaf):
    """A completed round leaves once, to the parent, as one contribution: the local sum and maximum exponent
    under the parent's job id and this switch's rank there; no worker gets a result yet."""

    def runTest(self) -> None:
        before = self.job_counters(self.job)
        last = self.complete_round([[1] * wire.K, [2] * wire.K, [-10] * wire.K], [3, -5, 1], seq=7)
        self.expect(PARENT_PORT, self.up_for(last, [-7] * wire.K, 3))
        self.expect_nothing()
        after = self.job_counters(self.job)
        self.assertEqual(after["contributions"] - before["contributions"], 3)
        self.assertEqual(after["results"], before["results"])  # the round's result is the parent's to give


class ParentResultGoesDownToTheWorkers(_Leaf):
    """The parent's result replaces the partial and reaches every local worker, with the root's exponent."""

    def runTest(self) -> None:
        last = self.complete_round([[1] * wire.K] * 3, [0, 0, 0], seq=4)
        self.expect(PARENT_PORT, self.up_for(last, [3] * wire.K, 0))
        before = self.job_counters(self.job)
        total = list(range(-32, 32))
        down = self.down(total, 9, seq=4)
        self.send(PARENT_PORT, down)
        self.expect_on_ports([(w.port, self.down_result(down, self.job, w, total, 9)) for w in self.workers])
        self.expect_nothing()
        self.assertEqual(self.job_counters(self.job)["results"] - before["results"], 1)
        # A worker that lost it resends: the stored final result comes back, nothing goes up.
        resend = contribution(self.job, self.workers[0], [5] * wire.K, seq=4, flags=wire.FLAG_RETRANSMIT)
        self.send(self.workers[0].port, resend)
        self.expect(self.workers[0].port, result_for(resend, self.workers[0], total, 9))
        self.expect_nothing()


class LostUpPacketIsSentAgainOnAWorkersResend(_Leaf):
    """While the parent's result is outstanding, a worker's resend sends the stored partial up again
    (FLAG_RETRANSMIT), not the partial back to the worker; then the result comes down once."""

    def runTest(self) -> None:
        last = self.complete_round([[4] * wire.K] * 3, [1, 2, 0], seq=2)
        self.expect(PARENT_PORT, self.up_for(last, [12] * wire.K, 2))  # "lost" on the link
        before = self.job_counters(self.job)
        resend = contribution(self.job, self.workers[1], [99] * wire.K, exponent=50, seq=2,
                              flags=wire.FLAG_RETRANSMIT)
        self.send(self.workers[1].port, resend)
        self.expect(PARENT_PORT, self.up_for(resend, [12] * wire.K, 2, resend=True))
        self.expect_nothing()
        self.assertEqual(self.job_counters(self.job)["retransmit_results"] - before["retransmit_results"], 1)
        down = self.down([36] * wire.K, 2, seq=2)
        self.send(PARENT_PORT, down)
        self.expect_on_ports([(w.port, self.down_result(down, self.job, w, [36] * wire.K, 2)) for w in self.workers])
        # The parent answering the other resends too: a duplicate result changes and sends nothing.
        self.send(PARENT_PORT, self.down([1000] * wire.K, 7, seq=2))
        self.expect_nothing()
        self.assertEqual(self.job_counters(self.job)["duplicates"] - before["duplicates"], 1)


class StaleAndEarlyResultsFromTheParentChangeNothing(_Leaf):
    """A parent's result for a round that has not gone up, for another round, or for a slot outside the
    job's range is dropped: counted, nothing sent, the slot untouched."""

    def runTest(self) -> None:
        before = self.job_counters(self.job)
        self.send(self.workers[0].port, contribution(self.job, self.workers[0], [1] * wire.K, round=1))
        self.wait_for_counter(self.job, "contributions", before["contributions"] + 1)
        self.send(PARENT_PORT, self.down([500] * wire.K, 0, round=1))  # the round is still collecting
        self.send(PARENT_PORT, self.down([500] * wire.K, 0, round=9))  # not this slot's round
        self.send(PARENT_PORT, self.down([500] * wire.K, 0, pool=1, round=2))  # a round never started here
        self.expect_nothing()
        drops = self.drops()
        self.send(PARENT_PORT, self.down([500] * wire.K, 0, slot=40))  # outside the job's slots
        self.expect_nothing()
        self.assertEqual(self.drops()[DropReason.SLOT_OUT_OF_RANGE] - drops[DropReason.SLOT_OUT_OF_RANGE], 1)
        after = self.job_counters(self.job)
        self.assertEqual(after["duplicates"] - before["duplicates"], 3)
        self.assertEqual(after["results"], before["results"])
        for w in self.workers[1:]:
            self.send(w.port, contribution(self.job, w, [1] * wire.K, round=1))
        last_up = self.up_for(contribution(self.job, self.workers[2], [1] * wire.K, round=1), [3] * wire.K, 0)
        self.expect(PARENT_PORT, last_up)  # the early results were not summed in
        down = self.down([3] * wire.K, 0, round=1)
        self.send(PARENT_PORT, down)
        self.expect_on_ports([(w.port, self.down_result(down, self.job, w, [3] * wire.K, 0)) for w in self.workers])


class ForgedParentResultsAreDropped(_Leaf):
    """Only the parent's address on the up port, for the parent job of this link, is a result from above:
    the same packet from a worker's port, from another address, or for another job is a host's forgery."""

    def runTest(self) -> None:
        last = self.complete_round([[2] * wire.K] * 3, [0, 0, 0])
        self.expect(PARENT_PORT, self.up_for(last, [6] * wire.K, 0))
        forged = [
            (self.workers[0].port, self.down([666] * wire.K, 0)),  # a host's port
            (PARENT_PORT, self.down([666] * wire.K, 0, src="10.98.0.7")),  # not the parent's address
            (PARENT_PORT, self.down([666] * wire.K, 0, job_id=self.parent_job + 1)),  # another parent job
        ]
        drops = self.drops()
        before = self.job_counters(self.job)
        for port, pkt in forged:
            self.send(port, pkt)
        self.expect_nothing()
        after = self.drops()
        self.assertEqual(after[DropReason.SPOOFED_SOURCE] - drops[DropReason.SPOOFED_SOURCE], 3)
        self.assertEqual(self.job_counters(self.job), before)
        # From another source port the same packet is a plain host's RESULT.
        self.send(self.workers[0].port, self.down([666] * wire.K, 0, src=self.workers[0].ip, sport=5555))
        self.expect_nothing()
        self.assertEqual(self.drops()[DropReason.RESULT_FROM_HOST] - after[DropReason.RESULT_FROM_HOST], 1)
        down = self.down([6] * wire.K, 0)
        self.send(PARENT_PORT, down)
        self.expect_on_ports([(w.port, self.down_result(down, self.job, w, [6] * wire.K, 0)) for w in self.workers])


class RoundFlagsGoUpAndComeDown(_Leaf):
    """The leaf's partial carries its round's flags up (NaN and -inf of two workers), its resend too; the parent's
    result carries the whole tree's flags, which replace the leaf's and reach every local worker, and a local
    resend after that gets them with the stored final result."""

    def runTest(self) -> None:
        exchange = wire.exchange_id(3, 1)
        flags = [wire.FLAG_NAN, 0, wire.FLAG_NEG_INF]
        packets = [contribution(self.job, w, [w.rank] * wire.K, exponent=-w.rank, seq=9, flags=f, exchange=exchange)
                   for w, f in zip(self.workers, flags)]
        for w, p in zip(self.workers, packets):
            self.send(w.port, p)
        leaf_flags = wire.FLAG_NAN | wire.FLAG_NEG_INF
        self.expect(PARENT_PORT, self.up_for(packets[-1], [3] * wire.K, 0, round_flags=leaf_flags))
        self.expect_nothing()
        resend = contribution(self.job, self.workers[1], [0] * wire.K, seq=9, flags=wire.FLAG_RETRANSMIT,
                              exchange=exchange)
        self.send(self.workers[1].port, resend)
        self.expect(PARENT_PORT, self.up_for(resend, [3] * wire.K, 0, resend=True, round_flags=leaf_flags))
        self.expect_nothing()
        tree_flags = wire.FLAG_POS_INF | wire.FLAG_OUT_OF_STEP  # what the parent's round ORed (another leaf's)
        down = self.down([30] * wire.K, 4, seq=9, round_flags=tree_flags, exchange=exchange)
        self.send(PARENT_PORT, down)
        self.expect_on_ports([(w.port, self.down_result(down, self.job, w, [30] * wire.K, 4)) for w in self.workers])
        self.expect_nothing()
        final = contribution(self.job, self.workers[0], [0] * wire.K, seq=9, flags=wire.FLAG_RETRANSMIT | wire.FLAG_NAN,
                             exchange=exchange)
        self.send(self.workers[0].port, final)
        self.expect(self.workers[0].port, result_for(final, self.workers[0], [30] * wire.K, 4, tree_flags))
        self.expect_nothing()


class LeafSendsAnOutOfStepPartialUp(_Leaf):
    """The leaf's round is completed by a contribution of another collective: the stored partial (without it)
    goes up marked OUT_OF_STEP, so the root's result marks every worker of the tree."""

    def runTest(self) -> None:
        exchange, other = wire.exchange_id(5, 2), wire.exchange_id(6, 2)
        drops, before = self.drops(), self.job_counters(self.job)
        for w in self.workers[:2]:
            taken = self.job_counters(self.job)["contributions"] + 1
            self.send(w.port, contribution(self.job, w, [w.rank + 1] * wire.K, exponent=w.rank, seq=2,
                                           exchange=exchange))
            self.wait_for_counter(self.job, "contributions", taken)
        last = contribution(self.job, self.workers[2], [100] * wire.K, exponent=20, seq=2, flags=wire.FLAG_NAN,
                            exchange=other)
        self.send(self.workers[2].port, last)
        self.expect(PARENT_PORT, self.up_for(last, [3] * wire.K, 1, round_flags=wire.FLAG_OUT_OF_STEP))
        self.expect_nothing()
        after = self.job_counters(self.job)
        self.assertEqual(self.drops()[DropReason.EXCHANGE_MISMATCH] - drops[DropReason.EXCHANGE_MISMATCH], 1)
        self.assertEqual(after["rejects"] - before["rejects"], 1)
        self.assertEqual(after["contributions"] - before["contributions"], 2)
        self.assertEqual(after["results"], before["results"])


class ParentSumsItsChildrenLikeWorkers(NetaggTest):
    """On the parent switch a child is a worker at the child's address and up port: two children's partials
    are summed once each, the result goes to both children, and a child's resend gets the stored result."""

    def runTest(self) -> None:
        children = [Worker(rank=0, port=6, mac="02:00:00:00:06:fe", ip="10.97.6.254", udp_port=UP_UDP),
                    Worker(rank=1, port=7, mac="02:00:00:00:07:fe", ip="10.97.7.254", udp_port=UP_UDP)]
        job = self.add_job(children)
        first = contribution(job, children[0], [10] * wire.K, exponent=4, seq=1)
        self.send(children[0].port, first)
        self.send(children[0].port, contribution(job, children[0], [10] * wire.K, exponent=4, seq=1,
                                                 flags=wire.FLAG_RETRANSMIT))
        # The duplicate first: a target may take two ports' packets in either order (BMv2 reads each port on its
        # own), and after the last child's packet the same resend would be answered.
        self.wait_for_counter(job, "duplicates", 1)
        last = contribution(job, children[1], [-3] * wire.K, exponent=6, seq=1)
        self.send(children[1].port, last)
        self.expect_on_ports([(c.port, result_for(last, c, [7] * wire.K, 6)) for c in children])
        resend = contribution(job, children[0], [10] * wire.K, exponent=4, seq=1, flags=wire.FLAG_RETRANSMIT)
        self.send(children[0].port, resend)
        self.expect(children[0].port, result_for(resend, children[0], [7] * wire.K, 6))
        self.expect_nothing()


class SixtyFourWorkersThroughATwoLevelTree(_Tree):
    """A job of 64 workers: two leaf segments of 32 (ports 1..4 and 5..6), each with its up link to a root
    segment on the same switch (leaf A up on port 8, leaf B up on port 7); the harness is the wire between
    the levels: what leaves port 8 or 7 comes back into port 7 or 8 ... as on a link to another switch.
    Every worker gets the sum of all 64 contributions, in two rounds with loss of an up packet."""

    def runTest(self) -> None:
        # The root's segment: two children, the leaves, at this switch's address with one up port each.
        # Up packets of leaf A leave on port 8, and the harness brings them in on port 7 (and B: 7 -> 8).
        leaf_ports = {"A": (8, 7), "B": (7, 8)}  # up port, the port its up packets arrive on
        children = [Worker(rank=i, port=arrive, mac=SWITCH_MAC, ip=AGGREGATOR_IP, udp_port=UP_UDP)
                    for i, (_, arrive) in enumerate(leaf_ports.values())]
        root = self.add_job(children, slot_base=100, slot_count=2)
        # The root's result for a leaf leaves on the port its up packets arrive on and comes back in on its up
        # port: the replicas already send child i's copy to children[i].port.
        leaves = {}
        for i, name in enumerate(leaf_ports):
            up_port, _ = leaf_ports[name]
            ports = (1, 2, 3, 4) if name == "A" else (5, 6)
            workers = [Worker(rank=r, port=ports[r % len(ports)], mac=f"02:00:00:{i:02x}:01:{r:02x}",
                              ip=f"10.99.{10 + i}.{1 + r}", udp_port=41000 + r) for r in range(32)]
            job = self.add_job(workers, slot_base=10 * i, slot_count=2)
            self.add_links(job, up_port, AGGREGATOR_IP, root.job_id, i, parent_mac=SWITCH_MAC)
            leaves[name] = (job, workers)
        everyone = [(job, w) for job, workers in leaves.values() for w in workers]
        for round_, pool in ((1, 0), (2, 1)):
            values = {(job.job_id, w.rank): [(job.job_id * 1000 + w.rank * 7 + round_ + k) % 997 - 400
                                             for k in range(wire.K)] for job, w in everyone}
            exps = {(job.job_id, w.rank): (w.rank + job.job_id + round_) % 9 - 4 for job, w in everyone}
            for job, w in everyone:
                key = (job.job_id, w.rank)
                self.send(w.port, contribution(job, w, values[key], exponent=exps[key], round=round_, pool=pool,
                                               seq=round_))
            total = int32([sum(values[key][k] for key in values) for k in range(wire.K)])
            top = max(exps.values())
            got = self._relay_until_results(leaves, lose_first_up=round_ == 2, resend_from=leaves["A"])
            for job, workers in leaves.values():
                for w in workers:
                    hdr, vals = got[(w.port, w.ip, w.udp_port)]
                    self.assertEqual(list(vals), total, f"worker {w.ip}")
                    self.assertEqual((hdr.job_id, hdr.exponent, hdr.round, hdr.pool), (job.job_id, top, round_, pool))
        self.expect_nothing()

    def _relay_until_results(self, leaves: dict, lose_first_up: bool, resend_from) -> dict:
        """Carry packets 8 -> 7 and 7 -> 8 (the inter-switch link) and collect the workers' results, until
        every worker of both leaves has one. ``lose_first_up``: drop the first up packet that leaves port 8
        (leaf A's partial); a worker of leaf A then resends, which sends the partial up again."""
        wanted = {(w.port, w.ip, w.udp_port) for _, workers in leaves.values() for w in workers}
        got: dict = {}
        dropped = resent = False
        deadline = time.time() + 6 * PACKET_TIMEOUT
        while wanted - set(got) and time.time() < deadline:
            result = self.dataplane.poll(timeout=0.3)
            if not isinstance(result, self.dataplane.PollSuccess):
                if dropped and not resent:  # leaf A's worker timed out: its resend sends the partial up again
                    job, workers = resend_from
                    self.send(workers[0].port, contribution(job, workers[0], [0] * wire.K, round=2, pool=1, seq=2,
                                                            flags=wire.FLAG_RETRANSMIT))
                    resent = True
                continue
            pkt = Ether(bytes(result.packet))
            if result.port in (7, 8):
                if lose_first_up and result.port == 8 and not dropped and not pkt[Netagg].flags & wire.FLAG_RESULT:
                    dropped = True  # the first up packet of leaf A never arrives
                    continue
                self.send(15 - result.port, pkt)
                continue
            self.assertTrue(pkt[Netagg].flags & wire.FLAG_RESULT, pkt.summary())
            key = (result.port, pkt[IP].dst, pkt[UDP].dport)
            self.assertNotIn(key, got, f"a second result for {key}")
            got[key] = (pkt[Netagg], pkt[Netagg].payload.values)
        self.assertFalse(wanted - set(got), f"{len(wanted - set(got))} workers got no result")
        return got


class TwoTenantsShareTheUpLink(_Tree):
    """Two tenants' leaf segments behind the same up port, to parent jobs 77 and 78: each parent result goes to
    its own tenant's workers only, and one tenant's result changes nothing of the other's round."""

    def runTest(self) -> None:
        tenant_a = make_workers(2)
        tenant_b = make_workers(2, first_ip=20, udp_base=42000)
        job_a = self.add_job(tenant_a, slot_base=0)
        job_b = self.add_job(tenant_b, slot_base=4)
        self.add_links(job_a, PARENT_PORT, PARENT_IP, 77, 0)
        self.add_links(job_b, PARENT_PORT, PARENT_IP, 78, 1)
        for job, workers, value, parent_job, rank in ((job_a, tenant_a, 1, 77, 0), (job_b, tenant_b, 2, 78, 1)):
            packets = [contribution(job, w, [value] * wire.K) for w in workers]
            for w, p in zip(workers, packets):
                self.send(w.port, p)
            self.expect(PARENT_PORT, self.up_for(packets[-1], [2 * value] * wire.K, 0, parent_job=parent_job,
                                                 parent_rank=rank))
        before_a = self.job_counters(job_a)
        down_b = self.down([222] * wire.K, 0, job_id=78)
        self.send(PARENT_PORT, down_b)
        self.expect_on_ports([(w.port, self.down_result(down_b, job_b, w, [222] * wire.K, 0)) for w in tenant_b])
        self.expect_nothing()
        self.assertEqual(self.job_counters(job_a), before_a)  # tenant A's round is still up, untouched
        down_a = self.down([111] * wire.K, 0, job_id=77)
        self.send(PARENT_PORT, down_a)
        self.expect_on_ports([(w.port, self.down_result(down_a, job_a, w, [111] * wire.K, 0)) for w in tenant_a])
        self.expect_nothing()
