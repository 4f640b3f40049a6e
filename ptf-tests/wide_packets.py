"""Wide packets (docs/protocol.md, "Wide packets"): a job of width 256 sends 256 values per packet.

A wide slot takes four consecutive cells: its round state lives in the first, value chunk c (values
64c .. 64c + 63) in cell first + c. A packet whose width is not its job's is WRONG_WIDTH (a job reject); an
undefined width code, or lengths other than the code's, is MALFORMED. Everything else (rounds, resends,
duplicates, round flags, trees) works as for narrow packets. The jobs here live from cell 300 up, clear of
the other modules' narrow jobs.
"""

from __future__ import annotations

import random

from scapy.layers.inet import IP, UDP
from tree_levels import PARENT_IP, PARENT_PORT, _Tree

from netagg import wire
from netagg.dataplane import DropReason

from base_test import NetaggTest, contribution, int32, make_workers, result_for

WIDE = wire.WIDE_K
NAN, POS_INF, OUT_OF_STEP = wire.FLAG_NAN, wire.FLAG_POS_INF, wire.FLAG_OUT_OF_STEP
EXCHANGE = wire.exchange_id(3, 9)
OTHER_EXCHANGE = wire.exchange_id(4, 9)


def _random_values(rng: random.Random, k: int = WIDE) -> list[int]:
    return [rng.randint(-(2**24), 2**24) for _ in range(k)]


def _chunked(base: int) -> list[int]:
    """256 values that differ in every chunk and within it: a value landing in another chunk's cell shows."""
    return [base + 1000 * c + i for c in range(WIDE // wire.K) for i in range(wire.K)]


class _Wide(NetaggTest):
    """Helpers: send a whole round, check the drop and job counters around one packet."""

    def send_round(self, job, workers, values: list[list[int]], exponents: list[int] | None = None, **fields: int):
        """Every worker's contribution, the last one completing the round; returns the packets."""
        exponents = exponents or [0] * len(workers)
        packets = [contribution(job, w, v, exponent=e, **fields) for w, v, e in zip(workers, values, exponents)]
        for w, p in zip(workers, packets):
            self.send(w.port, p)
        return packets

    def assert_round_exact(self, job, workers, values: list[list[int]], exponents: list[int] | None = None,
                           **fields: int) -> None:
        """A whole round in one slot: every worker gets the exact sums and the maximum exponent."""
        exponents = exponents or [0] * len(workers)
        packets = self.send_round(job, workers, values, exponents, **fields)
        total = int32(map(sum, zip(*values)))
        self.expect_on_ports([(w.port, result_for(packets[-1], w, total, max(exponents))) for w in workers])

    def assert_dropped(self, job, port: int, pkt, reason: DropReason, job_reject: bool) -> None:
        """``pkt`` is dropped as ``reason`` alone, counted in job_rejects iff ``job_reject``, and adds nothing."""
        drops, before = self.drops(), self.job_counters(job)
        self.send(port, pkt)
        self.expect_nothing()
        after_drops, after = self.drops(), self.job_counters(job)
        self.assertEqual(after_drops[reason] - drops[reason], 1, reason.name)
        others = {r: after_drops[r] - drops[r] for r in DropReason if r != reason and after_drops[r] != drops[r]}
        self.assertFalse(others, f"other drop counters moved: {others}")
        self.assertEqual(after["rejects"] - before["rejects"], 1 if job_reject else 0)
        self.assertEqual(after["contributions"], before["contributions"])


class WideRoundSumsExactly(_Wide):
    """Three workers, 256 random values each: the result carries the exact sums in all four chunks and the
    maximum exponent, to every worker, once; the first two contributions are absorbed."""

    def runTest(self) -> None:
        rng = random.Random(256)
        workers = make_workers(3)
        job = self.add_job(workers, slot_base=300, slot_count=2, k=WIDE)
        before = self.job_counters(job)
        values = [_random_values(rng) for _ in workers]
        exponents = [-4, 11, 2]
        packets = [contribution(job, w, v, slot=1, exponent=e, seq=21) for w, v, e in zip(workers, values, exponents)]
        self.assertEqual(len(packets[0]), wire.frame_bytes(WIDE))
        for w, p in zip(workers[:-1], packets[:-1]):
            self.send(w.port, p)
        self.expect_nothing()
        self.send(workers[-1].port, packets[-1])
        total = int32(map(sum, zip(*values)))
        self.expect_on_ports([(w.port, result_for(packets[-1], w, total, 11)) for w in workers])
        self.expect_nothing()
        after = self.job_counters(job)
        self.assertEqual(after["contributions"] - before["contributions"], 3)
        self.assertEqual(after["results"] - before["results"], 1)
        self.assertEqual(after["duplicates"] - before["duplicates"], 0)
        # The other pool, and the same pool's next round, of slot 0: each round overwrites the last one's sums.
        for round_ in (1, 2, 3):
            self.assert_round_exact(job, workers, [_random_values(rng) for _ in workers], [round_, 0, -round_],
                                    pool=(round_ - 1) % 2, round=round_, seq=round_)
        self.expect_nothing()


class WideSumsWrapModulo(_Wide):
    """Sums are int32 two's complement in every chunk, as on the wire."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers, slot_base=304, slot_count=1, k=WIDE)
        a = [-5, 2**31 - 1, -(2**31), 7] * (WIDE // 4)
        b = [3, 1, -1, -7] * (WIDE // 4)
        self.assert_round_exact(job, workers, [a, b])


class WideResendGetsTheStoredResult(_Wide):
    """After completion, a resend (whatever its values and exponent) gets the stored wide result back, to the
    sender only, as often as it asks; nothing changes in the slot."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers, slot_base=308, slot_count=2, k=WIDE)
        values = [_chunked(1), _chunked(-7)]
        packets = self.send_round(job, workers, values, [3, -2], slot=1, seq=9)
        total = int32(map(sum, zip(*values)))
        self.expect_on_ports([(w.port, result_for(packets[-1], w, total, 3)) for w in workers])
        before = self.job_counters(job)
        for _ in range(2):
            resend = contribution(job, workers[0], [99] * WIDE, slot=1, exponent=50, seq=9,
                                  flags=wire.FLAG_RETRANSMIT)
            self.send(workers[0].port, resend)
            self.expect(workers[0].port, result_for(resend, workers[0], total, 3))
            self.expect_nothing()
        after = self.job_counters(job)
        self.assertEqual(after["retransmit_results"] - before["retransmit_results"], 2)
        self.assertEqual(after["contributions"], before["contributions"])


class WideDuplicateIsAbsorbed(_Wide):
    """A copy of a worker's wide contribution before the round completes is a duplicate: counted, not added."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers, slot_base=312, slot_count=1, k=WIDE)
        before = self.job_counters(job)
        first = contribution(job, workers[0], _chunked(5), exponent=1, seq=4)
        self.send(workers[0].port, first)
        self.wait_for_counter(job, "contributions", before["contributions"] + 1)
        self.send(workers[0].port, first)
        self.wait_for_counter(job, "duplicates", before["duplicates"] + 1)
        self.expect_nothing()
        last = contribution(job, workers[1], _chunked(-3), exponent=-1, seq=4)
        self.send(workers[1].port, last)
        total = int32(a + b for a, b in zip(_chunked(5), _chunked(-3)))
        self.expect_on_ports([(w.port, result_for(last, w, total, 1)) for w in workers])
        self.expect_nothing()
        after = self.job_counters(job)
        self.assertEqual(after["contributions"] - before["contributions"], 2)
        self.assertEqual(after["duplicates"] - before["duplicates"], 1)
        self.assertEqual(after["results"] - before["results"], 1)


class WrongWidthIsRefused(_Wide):
    """A narrow packet to a wide job and a wide packet to a narrow job: WRONG_WIDTH, a job reject; a packet
    of the wrong width in the middle of a round changes nothing in it."""

    def runTest(self) -> None:
        wide_workers = make_workers(2)
        narrow_workers = make_workers(2, first_ip=70)
        wide = self.add_job(wide_workers, slot_base=316, slot_count=2, k=WIDE)
        narrow = self.add_job(narrow_workers, slot_base=324, slot_count=2)
        # Each job's round is open: worker 0 has contributed.
        wide_before, narrow_before = self.job_counters(wide), self.job_counters(narrow)
        wide_first = contribution(wide, wide_workers[0], _chunked(1))
        narrow_first = contribution(narrow, narrow_workers[0], [1] * wire.K)
        self.send(wide_workers[0].port, wide_first)
        self.send(narrow_workers[0].port, narrow_first)
        self.wait_for_counter(wide, "contributions", wide_before["contributions"] + 1)
        self.wait_for_counter(narrow, "contributions", narrow_before["contributions"] + 1)
        for slot in (0, 1):
            self.assert_dropped(wide, wide_workers[1].port,
                                contribution(wide, wide_workers[1], [666] * wire.K, slot=slot),
                                DropReason.WRONG_WIDTH, job_reject=True)
            self.assert_dropped(narrow, narrow_workers[1].port,
                                contribution(narrow, narrow_workers[1], [666] * WIDE, slot=slot),
                                DropReason.WRONG_WIDTH, job_reject=True)
        # Out of range too: the width is checked first (a wide packet names cells a narrow slot does not own).
        self.assert_dropped(narrow, narrow_workers[1].port,
                            contribution(narrow, narrow_workers[1], [666] * WIDE, slot=9),
                            DropReason.WRONG_WIDTH, job_reject=True)
        wide_last = contribution(wide, wide_workers[1], _chunked(2))
        self.send(wide_workers[1].port, wide_last)
        wide_total = int32(a + b for a, b in zip(_chunked(1), _chunked(2)))
        self.expect_on_ports([(w.port, result_for(wide_last, w, wide_total, 0)) for w in wide_workers])
        narrow_last = contribution(narrow, narrow_workers[1], [2] * wire.K)
        self.send(narrow_workers[1].port, narrow_last)
        self.expect_on_ports([(w.port, result_for(narrow_last, w, [3] * wire.K, 0)) for w in narrow_workers])
        self.expect_nothing()


class MalformedWidths(_Wide):
    """An undefined width code, the wide code on 64 values, the narrow code on 256 values, and a wide packet
    with a wrong or truncated length: MALFORMED (not a job reject), to a wide job and to a narrow one."""

    def runTest(self) -> None:
        wide_workers = make_workers(2)
        narrow_workers = make_workers(2, first_ip=80)
        wide = self.add_job(wide_workers, slot_base=328, slot_count=1, k=WIDE)
        narrow = self.add_job(narrow_workers, slot_base=332, slot_count=1)
        for job, w in ((wide, wide_workers[0]), (narrow, narrow_workers[0])):
            shapes = [
                contribution(job, w, [9] * WIDE, width=2),
                contribution(job, w, [9] * wire.K, width=2),
                contribution(job, w, [9] * wire.K, width=255),
                contribution(job, w, [9] * wire.K, width=1),  # wide header, 64 values (a parser error)
                contribution(job, w, [9] * WIDE, width=0),  # narrow header, 256 values (lengths)
            ]
            bad_udp = contribution(job, w, [9] * WIDE)
            bad_udp[UDP].len = wire.udp_length(wire.K)
            bad_ip = contribution(job, w, [9] * WIDE)
            bad_ip[IP].len = wire.ipv4_total_length(wire.K)
            shapes += [bad_udp, bad_ip]
            # The wide code with narrow lengths, yet 256 values on the wire.
            liar = contribution(job, w, [9] * WIDE)
            liar[IP].len, liar[UDP].len = wire.ipv4_total_length(wire.K), wire.udp_length(wire.K)
            shapes.append(liar)
            frames = [bytes(p) for p in shapes]
            full = bytes(contribution(job, w, [9] * WIDE))
            longer = bytes(contribution(job, w, [9] * WIDE) / b"trailer")  # lengths that count the trailer
            frames += [full[:-1], full[:wire.frame_bytes(wire.K)], longer]
            for frame in frames:
                self.assert_dropped(job, w.port, frame, DropReason.MALFORMED, job_reject=False)
        self.assert_round_exact(wide, wide_workers, [_chunked(1), _chunked(2)])
        self.assert_round_exact(narrow, narrow_workers, [[1] * wire.K, [2] * wire.K])
        self.expect_nothing()


class WideSlotsStayInTheirCells(_Wide):
    """Neighbours in adjacent cell ranges: narrow job A (cells 340..343), wide job B (344..351, two slots),
    narrow job C (352..355). A wide packet to A's top slot is refused (it would reach B's cells); B's rounds
    in both slots, with every chunk distinct, leave A's and C's open rounds exact, and theirs leave B's."""

    def runTest(self) -> None:
        a_workers, b_workers, c_workers = make_workers(2), make_workers(2, first_ip=90), make_workers(2, first_ip=100)
        a = self.add_job(a_workers, slot_base=340, slot_count=4)
        b = self.add_job(b_workers, slot_base=344, slot_count=2, k=WIDE)
        c = self.add_job(c_workers, slot_base=352, slot_count=4)
        self.assertEqual((a.cell(a.slot_count), b.cell(b.slot_count)), (b.slot_base, c.slot_base))
        # Open rounds on each side of B: A's top slot, C's bottom slot, and B's slot 1.
        before = {job.job_id: self.job_counters(job)["contributions"] for job in (a, b, c)}
        a_first = contribution(a, a_workers[0], [10] * wire.K, slot=3)
        c_first = contribution(c, c_workers[0], [20] * wire.K, slot=0)
        b_first = contribution(b, b_workers[0], _chunked(30), slot=1)
        for w, p in ((a_workers[0], a_first), (c_workers[0], c_first), (b_workers[0], b_first)):
            self.send(w.port, p)
        for job in (a, b, c):
            self.wait_for_counter(job, "contributions", before[job.job_id] + 1)
        # A's top slot cannot take a wide packet: it would write B's first three cells.
        self.assert_dropped(a, a_workers[1].port, contribution(a, a_workers[1], [666] * WIDE, slot=3),
                            DropReason.WRONG_WIDTH, job_reject=True)
        # B's slot 0 completes (its chunks 1..3 are the cells between its slot 0 and slot 1).
        self.assert_round_exact(b, b_workers, [_chunked(1), _chunked(-500)], [2, 5])
        # B's slot 1 (its chunk 3 is the cell next to C's slot 0) completes.
        b_last = contribution(b, b_workers[1], _chunked(7), slot=1)
        self.send(b_workers[1].port, b_last)
        total = int32(x + y for x, y in zip(_chunked(30), _chunked(7)))
        self.expect_on_ports([(w.port, result_for(b_last, w, total, 0)) for w in b_workers])
        # A's and C's rounds kept their first contributions.
        a_last = contribution(a, a_workers[1], [1] * wire.K, slot=3)
        self.send(a_workers[1].port, a_last)
        self.expect_on_ports([(w.port, result_for(a_last, w, [11] * wire.K, 0)) for w in a_workers])
        c_last = contribution(c, c_workers[1], [2] * wire.K, slot=0)
        self.send(c_workers[1].port, c_last)
        self.expect_on_ports([(w.port, result_for(c_last, w, [22] * wire.K, 0)) for w in c_workers])
        self.expect_nothing()


class WideAndNarrowSideBySide(_Wide):
    """A wide job and a narrow job in adjacent cell ranges run rounds in all their slots, interleaved: every
    round of both is exact."""

    def runTest(self) -> None:
        rng = random.Random(7)
        w_workers, n_workers = make_workers(3), make_workers(2, first_ip=110)
        n = self.add_job(n_workers, slot_base=360, slot_count=4)
        w = self.add_job(w_workers, slot_base=364, slot_count=3, k=WIDE)
        wide_values = {s: [_random_values(rng) for _ in w_workers] for s in range(w.slot_count)}
        narrow_values = {s: [_random_values(rng, wire.K) for _ in n_workers] for s in range(n.slot_count)}
        # Every worker's first contributions, slot by slot, before any round completes.
        for s in range(max(w.slot_count, n.slot_count)):
            if s < w.slot_count:
                for worker, v in zip(w_workers[:-1], wide_values[s][:-1]):
                    self.send(worker.port, contribution(w, worker, v, slot=s, seq=s))
            if s < n.slot_count:
                self.send(n_workers[0].port, contribution(n, n_workers[0], narrow_values[s][0], slot=s, seq=s))
        self.wait_for_counter(w, "contributions", (len(w_workers) - 1) * w.slot_count)  # a new job: from 0
        self.wait_for_counter(n, "contributions", n.slot_count)
        self.expect_nothing()
        for s in range(max(w.slot_count, n.slot_count)):
            if s < n.slot_count:
                last = contribution(n, n_workers[-1], narrow_values[s][-1], slot=s, seq=s)
                self.send(n_workers[-1].port, last)
                total = int32(map(sum, zip(*narrow_values[s])))
                self.expect_on_ports([(x.port, result_for(last, x, total, 0)) for x in n_workers])
            if s < w.slot_count:
                last = contribution(w, w_workers[-1], wide_values[s][-1], slot=s, seq=s)
                self.send(w_workers[-1].port, last)
                total = int32(map(sum, zip(*wide_values[s])))
                self.expect_on_ports([(x.port, result_for(last, x, total, 0)) for x in w_workers])
        self.expect_nothing()


class WideRoundFlags(_Wide):
    """Round flags in a wide round as in a narrow one: NaN and +inf ORed into the result; a contribution of
    another collective is not added (none of its four chunks), counts towards completion and marks the round
    OUT_OF_STEP, which a resend gets back with the stored wide sums."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers, slot_base=380, slot_count=2, k=WIDE)
        flags = [NAN, POS_INF, 0]
        packets = [contribution(job, w, _chunked(w.rank), exponent=w.rank, seq=3, flags=f, exchange=EXCHANGE)
                   for w, f in zip(workers, flags)]
        for w, p in zip(workers, packets):
            self.send(w.port, p)
        total = int32(map(sum, zip(*(_chunked(w.rank) for w in workers))))
        self.expect_on_ports([(w.port, result_for(packets[-1], w, total, 2, NAN | POS_INF)) for w in workers])
        self.expect_nothing()
        # Slot 1: worker 1 names another collective.
        w0, w1, w2 = workers
        drops, before = self.drops(), self.job_counters(job)
        self.send(w0.port, contribution(job, w0, _chunked(10), slot=1, exponent=-3, seq=5, exchange=EXCHANGE))
        self.wait_for_counter(job, "contributions", before["contributions"] + 1)
        stray = contribution(job, w1, [1000] * WIDE, slot=1, exponent=40, seq=5, flags=NAN, exchange=OTHER_EXCHANGE)
        self.send(w1.port, stray)
        self.wait_for_counter(job, "rejects", before["rejects"] + 1)
        self.expect_nothing()
        last = contribution(job, w2, _chunked(-4), slot=1, exponent=-5, seq=5, flags=POS_INF, exchange=EXCHANGE)
        self.send(w2.port, last)
        total = int32(a + b for a, b in zip(_chunked(10), _chunked(-4)))
        self.expect_on_ports([(w.port, result_for(last, w, total, -3, OUT_OF_STEP | POS_INF)) for w in workers])
        self.expect_nothing()
        self.assertEqual(self.drops()[DropReason.EXCHANGE_MISMATCH] - drops[DropReason.EXCHANGE_MISMATCH], 1)
        resend = contribution(job, w1, [77] * WIDE, slot=1, seq=5, flags=wire.FLAG_RETRANSMIT, exchange=OTHER_EXCHANGE)
        self.send(w1.port, resend)
        self.expect(w1.port, result_for(resend, w1, total, -3, OUT_OF_STEP | POS_INF))
        self.expect_nothing()
        after = self.job_counters(job)
        self.assertEqual(after["contributions"] - before["contributions"], 2)
        self.assertEqual(after["rejects"] - before["rejects"], 1)
        self.assertEqual(after["results"] - before["results"], 1)


class WideLeafUpAndDown(_Tree):
    """A wide job's segment as a leaf: the completed wide partial goes up (256 sums, the maximum exponent);
    the parent's wide result comes down to every worker, and a resend then gets it; a narrow result from the
    parent for the wide job is WRONG_WIDTH."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers, slot_base=390, slot_count=2, k=WIDE)
        self.add_links(job, PARENT_PORT, PARENT_IP, self.parent_job, self.parent_rank)
        values = [_chunked(w.rank * 3) for w in workers]
        packets = [contribution(job, w, v, slot=1, exponent=e, seq=8) for w, v, e in zip(workers, values, (1, 6, -2))]
        for w, p in zip(workers, packets):
            self.send(w.port, p)
        partial = int32(map(sum, zip(*values)))
        self.expect(PARENT_PORT, self.up_for(packets[-1], partial, 6))
        self.expect_nothing()
        # A narrow result for the wide job's slot: refused, the round still waits for the parent.
        drops, before = self.drops(), self.job_counters(job)
        self.send(PARENT_PORT, self.down([5] * wire.K, 9, slot=1, seq=8))
        self.expect_nothing()
        self.assertEqual(self.drops()[DropReason.WRONG_WIDTH] - drops[DropReason.WRONG_WIDTH], 1)
        self.assertEqual(self.job_counters(job)["rejects"] - before["rejects"], 1)
        final = _chunked(-100000)
        down = self.down(final, 9, slot=1, seq=8)
        self.send(PARENT_PORT, down)
        self.expect_on_ports([(w.port, self.down_result(down, job, w, final, 9)) for w in workers])
        self.expect_nothing()
        resend = contribution(job, workers[1], [5] * WIDE, slot=1, seq=8, flags=wire.FLAG_RETRANSMIT)
        self.send(workers[1].port, resend)
        self.expect(workers[1].port, result_for(resend, workers[1], final, 9))
        self.expect_nothing()
