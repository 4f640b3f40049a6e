"""Aggregation: sums, exponent max, both pool versions, slot reuse."""

from __future__ import annotations

import random

from netagg import wire

from base_test import NetaggTest, contribution, int32, make_workers, result_for


def _random_values(rng: random.Random) -> list[int]:
    return [rng.randint(-(2**24), 2**24) for _ in range(wire.K)]


class _Reduction(NetaggTest):
    """All workers contribute once; the last one triggers the multicast result."""

    num_workers = 2

    def runTest(self) -> None:
        rng = random.Random(self.num_workers)
        workers = make_workers(self.num_workers)
        job = self.add_job(workers)
        before = self.job_counters(job)
        contributions = [_random_values(rng) for _ in workers]
        exponents = [rng.randint(-20, 20) for _ in workers]
        packets = [contribution(job, w, v, slot=1, exponent=e, seq=77)
                   for w, v, e in zip(workers, contributions, exponents)]
        for w, pkt in zip(workers[:-1], packets[:-1]):
            self.send(w.port, pkt)
        self.expect_nothing()  # absorbed until the last contribution
        self.send(workers[-1].port, packets[-1])
        total = int32(map(sum, zip(*contributions)))
        self.expect_on_ports([(w.port, result_for(packets[-1], w, total, max(exponents))) for w in workers])
        self.expect_nothing()
        after = self.job_counters(job)
        self.assertEqual(after["contributions"] - before["contributions"], self.num_workers)
        self.assertEqual(after["results"] - before["results"], 1)
        self.assertEqual(after["duplicates"] - before["duplicates"], 0)


class BasicReduction2(_Reduction):
    num_workers = 2


class BasicReduction3(_Reduction):
    num_workers = 3


class BasicReduction32(_Reduction):
    num_workers = 32


class SingleWorkerJob(_Reduction):
    """A one-worker job completes on its only contribution."""

    num_workers = 1


class SumWrapsModulo(NetaggTest):
    """Sums are int32 two's complement: negative values and wrap-around as on the wire."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        a = [-5, 2**31 - 1, -(2**31), 7] * (wire.K // 4)
        b = [3, 1, -1, -7] * (wire.K // 4)
        pa, pb = contribution(job, workers[0], a), contribution(job, workers[1], b)
        self.send(workers[0].port, pa)
        self.send(workers[1].port, pb)
        total = int32(x + y for x, y in zip(a, b))
        self.expect_on_ports([(w.port, result_for(pb, w, total, 0)) for w in workers])


class ExponentMax(NetaggTest):
    """The result carries the signed maximum of the workers' exponents."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers)
        exponents = [-7, -120, -3]
        packets = [contribution(job, w, [1] * wire.K, exponent=e) for w, e in zip(workers, exponents)]
        for w, p in zip(workers, packets):
            self.send(w.port, p)
        self.expect_on_ports([(w.port, result_for(packets[-1], w, [3] * wire.K, -3)) for w in workers])


class OtherPoolReduction(NetaggTest):
    """Pool version 1 of a slot aggregates just like pool 0."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers, slot_base=8, slot_count=2)
        packets = [contribution(job, w, [10 + w.rank] * wire.K, slot=1, pool=1) for w in workers]
        for w, p in zip(workers, packets):
            self.send(w.port, p)
        self.expect_on_ports([(w.port, result_for(packets[-1], w, [21] * wire.K, 0)) for w in workers])


class SlotReuse(NetaggTest):
    """A slot alternates pools round after round; each round overwrites the old sums."""

    def runTest(self) -> None:
        workers = make_workers(3)
        job = self.add_job(workers, slot_count=1)
        for round_ in range(5):
            pool = round_ % 2
            packets = [contribution(job, w, [round_ * 10 + w.rank] * wire.K, pool=pool, seq=round_,
                                    round=round_ + 1) for w in workers]
            for w, p in zip(workers, packets):
                self.send(w.port, p)
            total = [sum(round_ * 10 + w.rank for w in workers)] * wire.K
            self.expect_on_ports([(w.port, result_for(packets[-1], w, total, 0)) for w in workers])
        self.expect_nothing()


class SlotsAreIndependent(NetaggTest):
    """Different slots of one job aggregate separately and land in their own registers."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers, slot_base=20, slot_count=3)
        for slot in range(3):
            self.send(workers[0].port, contribution(job, workers[0], [slot + 1] * wire.K, slot=slot, seq=slot))
        self.expect_nothing()
        for slot in reversed(range(3)):
            last = contribution(job, workers[1], [10] * wire.K, slot=slot, seq=slot)
            self.send(workers[1].port, last)
            self.expect_on_ports([(w.port, result_for(last, w, [slot + 11] * wire.K, 0)) for w in workers])


class PsModeForwarding(NetaggTest):
    """With only the parameter server in the group, the aggregate goes to the PS alone."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        ps = make_workers(1, first_ip=200, udp_base=9000)[0]
        self.client.set_multicast_group(job.mgid, [(ps.port, 1)])
        self.client.modify_entry(
            "NetaggEgress.result_rewrite.replicas", {"mgid": job.mgid, "rid": 1},
            "NetaggEgress.result_rewrite.set_destination",
            {"dst_mac": int(ps.mac.replace(":", ""), 16),
             "dst_addr": int.from_bytes(bytes(int(x) for x in ps.ip.split(".")), "big"),
             "dst_port": ps.udp_port},
        )
        packets = [contribution(job, w, [w.rank + 1] * wire.K) for w in workers]
        for w, p in zip(workers, packets):
            self.send(w.port, p)
        self.expect(ps.port, result_for(packets[-1], ps, [3] * wire.K, 0))
        self.expect_nothing()
