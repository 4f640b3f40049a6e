"""Results come only from the switch: a host cannot pose as the aggregator or as a parameter server.

The attack of issue 11: from another tenant's port, a RESULT addressed to a worker's own UDP
port (so not to the netagg port, and not parsed as netagg) with the aggregator's address and
the netagg source port. Without SourceGuard the switch routes it to the worker unchanged.
"""

from __future__ import annotations

from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from netagg import dataplane as dp
from netagg import wire
from netagg.dataplane import DropReason
from netagg.scapy_layers import netagg_payload

from base_test import AGGREGATOR_IP, SWITCH_MAC, NetaggTest, Worker, contribution, make_workers, result_for

#: A parameter server behind port 7 (ps and fallback modes: workers accept results from it).
PS = Worker(rank=0, port=7, mac="02:00:00:00:07:07", ip="10.99.7.7", udp_port=29000)
#: Tenant B's host, on a port of its own.
ATTACKER_PORT = 8


def _ip(text: str) -> int:
    return int.from_bytes(bytes(int(part) for part in text.split(".")), "big")


class _SourceGuard(NetaggTest):
    """A two-worker job (tenant A), routes to its workers and the PS, and the controller's source entries."""

    def setUp(self) -> None:
        super().setUp()
        self.workers = make_workers(2)
        self.job = self.add_job(self.workers)
        for w in [*self.workers, PS]:
            self.insert(dp.TABLE_ROUTES, {"ipv4_dst": (_ip(w.ip), 32)}, dp.ACTION_FORWARD,
                        {"port": w.port, "dst_mac": int(w.mac.replace(":", ""), 16)})
        self.insert(dp.TABLE_SOURCES, {"ipv4_src": _ip(AGGREGATOR_IP)}, dp.ACTION_SWITCH_ONLY, {})
        self.insert(dp.TABLE_SOURCES, {"ipv4_src": _ip(PS.ip)}, dp.ACTION_BIND_TO_PORT, {"port": PS.port})

    def forged_result(self, src_ip: str, sport: int, to: Worker, values: int = 12345) -> Ether:
        """A RESULT for ``to``'s slot 0, pool 0, next block, as a forger would write it."""
        return (Ether(src="02:00:00:00:0b:0b", dst=SWITCH_MAC)
                / IP(src=src_ip, dst=to.ip, ttl=64)
                / UDP(sport=sport, dport=to.udp_port)
                / netagg_payload([values] * wire.K, job_id=self.job.job_id, slot=0, pool=0, rank=to.rank,
                                 seq=0, round=1, flags=wire.FLAG_RESULT))

    def assert_spoof_dropped(self, port: int, pkt) -> None:
        drops = self.drops()
        before = self.job_counters(self.job)
        self.send(port, pkt)
        self.expect_nothing()
        after = self.drops()
        self.assertEqual(after[DropReason.SPOOFED_SOURCE] - drops[DropReason.SPOOFED_SOURCE], 1)
        others = {r: after[r] - drops[r] for r in DropReason if r != DropReason.SPOOFED_SOURCE and after[r] != drops[r]}
        self.assertFalse(others, f"other drop counters moved: {others}")
        self.assertEqual(self.job_counters(self.job), before)

    def assert_job_still_works(self) -> None:
        packets = [contribution(self.job, w, [w.rank + 1] * wire.K) for w in self.workers]
        for w, p in zip(self.workers, packets):
            self.send(w.port, p)
        self.expect_on_ports([(w.port, result_for(packets[-1], w, [3] * wire.K, 0)) for w in self.workers])


class ForgedResultFromAnotherPort(_SourceGuard):
    """The issue's attack: aggregator address, netagg source port, worker's own UDP port as destination."""

    def runTest(self) -> None:
        for w in self.workers:
            self.assert_spoof_dropped(ATTACKER_PORT, self.forged_result(AGGREGATOR_IP, wire.NETAGG_UDP_PORT, w))
        # From the worker's own port too: no host may send from the aggregator address and port.
        self.assert_spoof_dropped(self.workers[1].port,
                                  self.forged_result(AGGREGATOR_IP, wire.NETAGG_UDP_PORT, self.workers[0]))
        self.assert_job_still_works()


class NetaggSourcePortFromHost(_SourceGuard):
    """Any source address with the netagg source port is a forged result, whatever the destination."""

    def runTest(self) -> None:
        self.assert_spoof_dropped(ATTACKER_PORT, self.forged_result("10.99.8.8", wire.NETAGG_UDP_PORT,
                                                                    self.workers[0]))
        plain = (Ether(dst=SWITCH_MAC) / IP(src="10.99.1.1", dst=PS.ip)
                 / UDP(sport=wire.NETAGG_UDP_PORT, dport=40000) / bytes(50))
        self.assert_spoof_dropped(self.workers[0].port, plain)


class AggregatorAddressToNonNetaggPort(_SourceGuard):
    """The aggregator address belongs to the switch: dropped from any port and any source port."""

    def runTest(self) -> None:
        self.assert_spoof_dropped(ATTACKER_PORT, self.forged_result(AGGREGATOR_IP, 5555, self.workers[0]))
        ping = Ether(dst=SWITCH_MAC) / IP(src=AGGREGATOR_IP, dst=self.workers[1].ip) / UDP(sport=7, dport=7) / b"x"
        self.assert_spoof_dropped(self.workers[0].port, ping)
        self.assert_job_still_works()


class ForgedResultFromPsAddress(_SourceGuard):
    """The PS's address is bound to the PS's port: a result 'from the PS' on any other port is dropped."""

    def runTest(self) -> None:
        forged = self.forged_result(PS.ip, PS.udp_port, self.workers[0])
        self.assert_spoof_dropped(ATTACKER_PORT, forged)
        self.assert_spoof_dropped(self.workers[1].port, forged)
        # The PS itself, on its own port, is forwarded as before (it reflects results in ps mode).
        self.send(PS.port, forged)
        expected = forged.copy()
        expected[Ether].src, expected[Ether].dst, expected[IP].ttl = SWITCH_MAC, self.workers[0].mac, 63
        expected[IP].chksum = None
        self.expect(self.workers[0].port, Ether(bytes(expected)))
        self.expect_nothing()
        self.assert_job_still_works()
