"""Base class of the netagg PTF suite: one P4Runtime session, entries removed after each test.

Test parameters (``--test-params``): ``grpcaddr`` (default 127.0.0.1:9559),
``p4info``, ``config`` (BMv2 JSON, empty for the software target), ``device_id``.
Switch ports 1..8 are wired to PTF ports 1..8.
"""

from __future__ import annotations

import atexit
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import ptf
import ptf.testutils as tu
from ptf.base_tests import BaseTest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Packet

from netagg import dataplane as dp
from netagg import wire
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.scapy_layers import Netagg, NetaggValues, netagg_payload

SWITCH_MAC = "02:00:00:00:00:fe"
AGGREGATOR_IP = "10.99.0.254"
PORTS = range(1, 9)
#: Quiet period after which a test concludes that no (more) packets come.
NO_PACKET_TIMEOUT = 0.5
#: Time a test waits for an expected packet.
PACKET_TIMEOUT = 3.0

_client: P4RuntimeClient | None = None
# Job ids and generations unique within one PTF run, so that every test meets
# slots that an earlier test's job left behind (the stale-slot path).
_job_ids = itertools.count(1)
_generations = itertools.count(1000)


def _session() -> P4RuntimeClient:
    """One primary P4Runtime session for the whole run; the pipeline is pushed when it opens."""
    global _client
    if _client is None:
        params = tu.test_params_get()
        client = P4RuntimeClient(params.get("grpcaddr", "127.0.0.1:9559"),
                                 device_id=int(params.get("device_id", 1)), election_id=(0, 1))
        client.connect()
        config = params.get("config") or ""
        device_config = Path(config).read_bytes() if config else b""
        client.set_pipeline(params.get("p4info", str(dp.P4INFO_PATH)), device_config)
        atexit.register(client.close)
        _client = client
    return _client


@dataclass(frozen=True)
class Worker:
    """A worker endpoint as the switch sees it."""

    rank: int
    port: int
    mac: str
    ip: str
    udp_port: int

    @property
    def mask(self) -> int:
        return 1 << self.rank


def make_workers(count: int, first_ip: int = 1, udp_base: int = 40000) -> list[Worker]:
    """``count`` workers spread over the 8 ports, distinct (IP, UDP port) each."""
    return [
        Worker(rank=r, port=PORTS[r % len(PORTS)], mac=f"02:00:00:00:01:{r:02x}",
               ip=f"10.99.1.{first_ip + r}", udp_port=udp_base + r)
        for r in range(count)
    ]


@dataclass
class Job:
    """What a test installed for one job (``k``: its values per packet, ``wire.K`` or ``wire.WIDE_K``)."""

    job_id: int
    workers: list[Worker]
    slot_base: int
    slot_count: int
    generation: int
    k: int = wire.K

    @property
    def mgid(self) -> int:
        return self.job_id

    @property
    def width(self) -> int:
        """The job's width code (``set_job``'s last parameter)."""
        return wire.width_code(self.k)

    def cell(self, slot: int) -> int:
        """The first cell of the job-relative ``slot`` (a slot takes ``wire.cells_of(k)`` cells)."""
        return self.slot_base + slot * wire.cells_of(self.k)


class NetaggTest(BaseTest):
    """Connects to the switch, pushes the pipeline once per run, cleans up every test."""

    def setUp(self) -> None:
        BaseTest.setUp(self)
        self.dataplane = ptf.dataplane_instance
        self.dataplane.flush()
        self.client = _session()
        self._undo: list = []
        self._job_undo: dict[int, list] = {}

    def tearDown(self) -> None:
        for undo in reversed(self._undo):
            undo()
        BaseTest.tearDown(self)

    # -- control plane -----------------------------------------------------
    def insert(self, table: str, match: dict, action: str, params: dict, undo: list | None = None) -> None:
        """Insert an entry that tearDown (or ``undo``'s owner) deletes again."""
        self.client.insert_entry(table, match, action, params)
        (self._undo if undo is None else undo).append(lambda: self.client.delete_entry(table, match))

    def add_job(self, workers: list[Worker], slot_base: int = 0, slot_count: int = 4,
                num_workers: int | None = None, k: int = wire.K) -> Job:
        """Install the job, its workers, its multicast group and one replica per worker.

        ``slot_base`` is a cell; ``k=wire.WIDE_K`` makes a wide job, whose slots take four cells each.
        """
        job = Job(next(_job_ids), workers, slot_base, slot_count, next(_generations), k)
        undo: list = []
        self._undo.append(lambda: self._run_undo(undo))
        self._job_undo[job.job_id] = undo
        self.insert(dp.TABLE_JOBS, {"job_id": job.job_id}, dp.ACTION_SET_JOB, {
            "num_workers": len(workers) if num_workers is None else num_workers,
            "slot_base": slot_base, "slot_count": slot_count,
            "mgid": job.mgid, "generation": job.generation, "width": job.width,
        }, undo)
        for w in workers:
            self.insert(dp.TABLE_WORKERS, {"job_id": job.job_id, "ipv4_src": _ip(w.ip), "udp_src": w.udp_port,
                                           "ingress_port": w.port},
                        dp.ACTION_SET_WORKER, {"rank": w.rank, "worker_mask": w.mask}, undo)
            self.insert(dp.TABLE_REPLICAS, {"mgid": job.mgid, "rid": w.rank + 1}, dp.ACTION_SET_DESTINATION,
                        {"dst_mac": _mac(w.mac), "dst_addr": _ip(w.ip), "dst_port": w.udp_port}, undo)
        self.client.set_multicast_group(job.mgid, [(w.port, w.rank + 1) for w in workers])
        undo.append(lambda: self.client.delete_multicast_group(job.mgid))
        return job

    def delete_job(self, job: Job) -> None:
        """Remove everything add_job installed for ``job`` (as the controller's delete does)."""
        self._run_undo(self._job_undo.pop(job.job_id))

    @staticmethod
    def _run_undo(undo: list) -> None:
        while undo:
            undo.pop()()

    def counter(self, name: str, index: int) -> int:
        """Packets counted so far at ``name[index]``."""
        return self.client.read_counter(name, index)[0]

    def job_counters(self, job: Job) -> dict[str, int]:
        return {short: self.counter(name, job.job_id) for short, name in dp.JOB_COUNTERS.items()}

    def wait_for_counter(self, job: Job, name: str, value: int, timeout: float = PACKET_TIMEOUT) -> None:
        """Poll the job's counter ``name`` until it reaches ``value`` (the switch took the packet)."""
        deadline = time.time() + timeout
        while self.job_counters(job)[name] < value:
            self.assertLess(time.time(), deadline, f"{name} never reached {value}")
            time.sleep(0.02)

    def drops(self) -> dict[dp.DropReason, int]:
        return {reason: self.counter(dp.COUNTER_DROP_REASONS, reason) for reason in dp.DropReason}

    # -- packets -------------------------------------------------------------
    def send(self, port: int, pkt: Packet) -> None:
        tu.send_packet(self, port, pkt)

    def expect(self, port: int, pkt: Packet) -> None:
        tu.verify_packet(self, pkt, port, timeout=PACKET_TIMEOUT)

    def expect_on_ports(self, expected: list[tuple[int, Packet]]) -> None:
        """Every (port, packet) arrives, in any order across and within ports."""
        wanted: dict[int, list[bytes]] = {}
        for port, pkt in expected:
            wanted.setdefault(port, []).append(bytes(pkt))
        deadline = time.time() + PACKET_TIMEOUT * 2
        while any(wanted.values()) and time.time() < deadline:
            result = self.dataplane.poll(timeout=0.2)
            if not isinstance(result, self.dataplane.PollSuccess):
                continue
            frames = wanted.get(result.port, [])
            data = bytes(result.packet)
            self.assertIn(data, frames, f"unexpected packet on port {result.port}: {Ether(data)!r}")
            frames.remove(data)
        missing = {port: [Ether(f).summary() for f in frames] for port, frames in wanted.items() if frames}
        self.assertFalse(missing, f"packets never arrived: {missing}")

    def expect_nothing(self) -> None:
        tu.verify_no_other_packets(self, timeout=NO_PACKET_TIMEOUT)


def _ip(text: str) -> int:
    return int.from_bytes(bytes(int(part) for part in text.split(".")), "big")


def _mac(text: str) -> int:
    return int(text.replace(":", ""), 16)


def contribution(job: Job, worker: Worker, values: list[int], slot: int = 0, pool: int = 0,
                 exponent: int = 0, seq: int = 0, flags: int = 0, round: int = 1, tos: int = 0,
                 **overrides: int) -> Packet:
    """A worker's packet to the aggregator, as its kernel would send it (``round``: the slot's use number;
    ``tos``: the IPv4 TOS byte, whose two low bits are ECN)."""
    header = dict(job_id=job.job_id, slot=slot, pool=pool, rank=worker.rank, exponent=exponent,
                  seq=seq, flags=flags, round=round)
    header.update(overrides)
    return (Ether(src=worker.mac, dst=SWITCH_MAC)
            / IP(src=worker.ip, dst=AGGREGATOR_IP, id=0x1234, flags=0, ttl=64, tos=tos)
            / UDP(sport=worker.udp_port, dport=wire.NETAGG_UDP_PORT)
            / netagg_payload(values, **header))


def result_for(sent: Packet, to: Worker, values: list[int], exponent: int, round_flags: int = 0,
               members: int | None = None, ce: bool = False) -> Packet:
    """The result the switch makes of ``sent`` (the completing or resent packet) for ``to``.

    ``round_flags``: the round's stored flags (``wire.ROUND_FLAGS`` bits ORed over its contributions, and
    ``wire.FLAG_CLOSE`` for a round closed at a deadline), which replace the sent packet's own
    (``wire.STORED_FLAGS``: a close request's CLOSE bit never leaves on its own); its other flags stay, with
    RESULT added. ``members``: what a closed round's result carries there (the bitmap of the contributions in
    its sum); None echoes the sent packet's. ``ce``: the round is congestion-marked (some contribution arrived
    ECN CE), so the result leaves CE; otherwise with the sent packet's TOS.
    """
    hdr = sent[Netagg]
    header = {f.name: getattr(hdr, f.name) for f in wire.HEADER_FIELDS}
    flags = (hdr.flags & ~wire.STORED_FLAGS) | round_flags | wire.FLAG_RESULT
    header.update(flags=flags, exponent=exponent)
    if members is not None:
        header.update(members=members)
    return (Ether(src=SWITCH_MAC, dst=to.mac)
            / IP(src=AGGREGATOR_IP, dst=to.ip, id=sent[IP].id, flags=sent[IP].flags, ttl=64,
                 tos=sent[IP].tos | (wire.ECN_CE if ce else 0))
            / UDP(sport=wire.NETAGG_UDP_PORT, dport=to.udp_port, chksum=0)
            / netagg_payload(values, **header))


def int32(values) -> list[int]:
    """Wrap Python ints to int32 as the switch's modular sums do."""
    return [((int(v) + 2**31) % 2**32) - 2**31 for v in values]


__all__ = [
    "AGGREGATOR_IP", "NO_PACKET_TIMEOUT", "SWITCH_MAC", "Job", "Netagg", "NetaggTest", "NetaggValues",
    "Worker", "contribution", "int32", "make_workers", "result_for",
]
