"""Everything that is not netagg is routed by IPv4 longest prefix."""

from __future__ import annotations

from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import Ether

from netagg import dataplane as dp
from netagg import wire
from netagg.dataplane import DropReason

from base_test import SWITCH_MAC, NetaggTest

PS_MAC = "02:00:00:00:02:01"


class _Routes(NetaggTest):
    def setUp(self) -> None:
        super().setUp()
        self.insert(dp.TABLE_ROUTES, {"ipv4_dst": (0x0A630000, 16)}, dp.ACTION_FORWARD,
                    {"port": 2, "dst_mac": 0x020000000201})
        self.insert(dp.TABLE_ROUTES, {"ipv4_dst": (0x0A630500, 24)}, dp.ACTION_FORWARD,
                    {"port": 5, "dst_mac": 0x020000000505})


class Ipv4Forward(_Routes):
    """Longest prefix wins; MACs rewritten, TTL decremented, checksum recomputed, payload intact."""

    def runTest(self) -> None:
        for dst, port, mac in (("10.99.3.3", 2, PS_MAC), ("10.99.5.7", 5, "02:00:00:00:05:05")):
            pkt = (Ether(src="02:00:00:00:01:01", dst=SWITCH_MAC) / IP(src="10.99.1.1", dst=dst, ttl=9)
                   / UDP(sport=1000, dport=9000) / b"parameter-server-traffic")
            expected = (Ether(src=SWITCH_MAC, dst=mac) / IP(src="10.99.1.1", dst=dst, ttl=8)
                        / UDP(sport=1000, dport=9000) / b"parameter-server-traffic")
            self.send(1, pkt)
            self.expect(port, expected)
        tcp = Ether(dst=SWITCH_MAC) / IP(src="10.99.1.1", dst="10.99.4.4") / TCP(dport=80) / b"baseline"
        self.send(3, tcp)
        exp = tcp.copy()
        exp[Ether].src, exp[Ether].dst, exp[IP].ttl = SWITCH_MAC, PS_MAC, 63
        exp[IP].chksum = None
        self.expect(2, Ether(bytes(exp)))
        self.expect_nothing()


class FromNetaggPortIsDropped(_Routes):
    """UDP *from* the netagg port can only be a forged result: hosts never send from it (spoofing.py)."""

    def runTest(self) -> None:
        drops = self.drops()
        pkt = (Ether(dst=SWITCH_MAC) / IP(src="10.99.1.1", dst="10.99.5.1")
               / UDP(sport=wire.NETAGG_UDP_PORT, dport=40000) / bytes(50))
        self.send(1, pkt)
        self.expect_nothing()
        after = self.drops()
        self.assertEqual(after[DropReason.SPOOFED_SOURCE] - drops[DropReason.SPOOFED_SOURCE], 1)


class NoRouteAndTtl(_Routes):
    def runTest(self) -> None:
        drops = self.drops()
        self.send(1, Ether(dst=SWITCH_MAC) / IP(dst="192.168.1.1") / UDP() / b"x")
        self.send(1, Ether(dst=SWITCH_MAC) / IP(dst="10.99.3.3", ttl=1) / UDP() / b"x")
        self.expect_nothing()
        after = self.drops()
        self.assertEqual(after[DropReason.NO_ROUTE] - drops[DropReason.NO_ROUTE], 1)
        self.assertEqual(after[DropReason.TTL_EXPIRED] - drops[DropReason.TTL_EXPIRED], 1)
