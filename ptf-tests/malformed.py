"""Malformed input: dropped and counted, never aggregated."""

from __future__ import annotations

from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import ARP, Ether

from netagg import wire
from netagg.dataplane import DropReason

from base_test import AGGREGATOR_IP, SWITCH_MAC, NetaggTest, contribution, make_workers, result_for


class _Malformed(NetaggTest):
    def assert_dropped(self, port: int, frame: bytes, reason: DropReason) -> None:
        drops = self.drops()
        self.send(port, frame)
        self.expect_nothing()
        after = self.drops()
        self.assertEqual(after[reason] - drops[reason], 1, reason.name)
        others = {r: after[r] - drops[r] for r in DropReason if r != reason and after[r] != drops[r]}
        self.assertFalse(others, f"other drop counters moved: {others}")

    def assert_job_still_works(self, job, workers) -> None:
        packets = [contribution(job, w, [2] * wire.K) for w in workers]
        for w, p in zip(workers, packets):
            self.send(w.port, p)
        self.expect_on_ports([(w.port, result_for(packets[-1], w, [4] * wire.K, 0)) for w in workers])


class Truncated(_Malformed):
    """Cut anywhere inside the netagg header or values: dropped as malformed."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        full = bytes(contribution(job, workers[0], [9] * wire.K))
        for cut in (wire.FRAME_BYTES - 1, wire.FRAME_BYTES - wire.PAYLOAD_BYTES, 14 + 20 + 8 + 3):
            self.assert_dropped(workers[0].port, full[:cut], DropReason.MALFORMED)
        self.assert_job_still_works(job, workers)


class WrongLengths(_Malformed):
    """IPv4/UDP lengths that disagree with a netagg packet, or trailing bytes."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        pkt = contribution(job, workers[0], [9] * wire.K)
        longer = bytes(pkt / b"extra-bytes")
        self.assert_dropped(workers[0].port, longer, DropReason.MALFORMED)
        bad_udp = pkt.copy()
        bad_udp[UDP].len = 100
        self.assert_dropped(workers[0].port, bytes(bad_udp), DropReason.MALFORMED)
        self.assert_job_still_works(job, workers)


class Fragmented(_Malformed):
    """An IPv4 fragment to the netagg port is never aggregated."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        pkt = contribution(job, workers[0], [9] * wire.K)
        pkt[IP].flags = "MF"
        self.assert_dropped(workers[0].port, bytes(pkt), DropReason.MALFORMED)
        self.assert_job_still_works(job, workers)


class WrongWidth(_Malformed):
    """An undefined width code (2, 255) is malformed, and so is the wide code (1) on a narrow packet's 64 values
    (its lengths are a narrow packet's; ptf-tests/wide_packets.py has the other shapes)."""

    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        for width in (1, 2, 255):
            pkt = contribution(job, workers[0], [9] * wire.K, width=width)
            self.assert_dropped(workers[0].port, bytes(pkt), DropReason.MALFORMED)
        self.assert_job_still_works(job, workers)


class WrongVersion(_Malformed):
    def runTest(self) -> None:
        workers = make_workers(2)
        job = self.add_job(workers)
        pkt = contribution(job, workers[0], [9] * wire.K, version=wire.VERSION + 1)
        self.assert_dropped(workers[0].port, bytes(pkt), DropReason.BAD_VERSION)
        self.assert_job_still_works(job, workers)


class NotIpv4(_Malformed):
    """ARP and runt frames are dropped and counted."""

    def runTest(self) -> None:
        arp = Ether(dst="ff:ff:ff:ff:ff:ff", src="02:00:00:00:01:01") / ARP(pdst=AGGREGATOR_IP)
        self.assert_dropped(1, bytes(arp), DropReason.NOT_IPV4)
        runt = bytes(Ether(dst=SWITCH_MAC, src="02:00:00:00:01:01", type=0x0800)) + b"\x45\x00"
        self.assert_dropped(1, runt, DropReason.MALFORMED)
