"""An in-process software switch in loopback mode with jobs installed over real P4Runtime.

For tests and benchmarks of the host stack: ``with LoopbackSwitch() as switch:
configs = switch.add_job(4, slot_count=32)`` gives one ``WorkerConfig`` per rank.
Entries are computed by the controller's own ``switch_programmer`` (one source of
truth for what a job needs) and written through ``P4RuntimeClient``.
"""

from __future__ import annotations

import itertools
import time

from netagg import dataplane as dp
from netagg import wire
from netagg.controller.config import parse_config
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.controller.store import JobRecord, PsEndpoint, WorkerEndpoint
from netagg.controller.switch_programmer import SwitchProgrammer, read_job_counters
from netagg.dataplane import DropReason
from netagg.jobconfig import Endpoint, WorkerConfig
from netagg.localports import free_ports
from netagg.softswitch.target import LOOPBACK_PORT_NUMBER, Faults, SoftwareTarget

LOCAL_HOST = "local"


class LoopbackSwitch:
    """The software target on 127.0.0.1 (ephemeral ports), with a primary P4Runtime session."""

    def __init__(self, drop: float = 0.0, duplicate: float = 0.0, reorder: float = 0.0, seed: int = 1,
                 capacity: int = 4096, burst: float = 0.0, burst_length: int = 64, shards: int | None = 1) -> None:
        """``shards``: pipeline shards (None: the target's default, what the machine can spare)."""
        self.target = SoftwareTarget("127.0.0.1:0", loopback=("127.0.0.1", 0),
                                     faults=Faults(drop, duplicate, reorder, seed, burst, burst_length), shards=shards)
        self.capacity = capacity
        self.client: P4RuntimeClient | None = None
        self._next_slot = 0
        self._job_ids = itertools.count(1)
        self._generations = itertools.count(int(time.time()) & 0xFFFFFF)
        self.jobs: dict[int, JobRecord] = {}

    @property
    def aggregator(self) -> Endpoint:
        assert self.target.loopback is not None
        host, port = self.target.loopback.address
        return Endpoint(host, port)

    def start(self) -> LoopbackSwitch:
        self.target.start()
        self.client = P4RuntimeClient(self.target.grpc_address, device_id=1, election_id=(0, 1))
        self.client.connect()
        self.client.set_pipeline(dp.P4INFO_PATH, b"")
        config = parse_config({
            "switch": {"grpc_address": self.target.grpc_address,
                       "aggregator": {"ip": "127.0.0.1", "udp_port": self.aggregator.port}},
            "slots": {"capacity": self.capacity},
            "controller": {"database": "unused.db", "api_socket": "unused.sock", "admin_token": "unused-token"},
            "hosts": [{"name": LOCAL_HOST, "ip": "127.0.0.1", "mac": "02:00:00:00:bb:01",
                       "port": LOOPBACK_PORT_NUMBER}],
        }, "<LoopbackSwitch>")
        self.programmer = SwitchProgrammer(self.client, config)
        return self

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        self.target.stop()

    def __enter__(self) -> LoopbackSwitch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_job(self, num_workers: int, slot_count: int, mode: str = "allreduce", ps: Endpoint | None = None,
                bind_ports: list[int] | None = None, senders: int = 0, width: int = wire.K) -> list[WorkerConfig]:
        """Install a job (unless fallback) and return every rank's configuration (``senders``: a one-way
        job, whose last ranks only send and the others only receive; ``width``: values per packet)."""
        cells = slot_count * wire.cells_of(width)
        if mode != "fallback" and self._next_slot + cells > self.capacity:
            raise ValueError(f"only {self.capacity - self._next_slot} cells left")
        ports = bind_ports or free_ports(num_workers)
        job = JobRecord(
            job_id=next(self._job_ids), tenant="test", name="test", mode=mode, state="active",
            slot_base=self._next_slot if mode != "fallback" else 0,
            slot_count=slot_count, slots_wanted=slot_count, generation=next(self._generations),
            workers=[WorkerEndpoint(r, LOCAL_HOST, "127.0.0.1", p) for r, p in enumerate(ports)],
            ps=PsEndpoint(LOCAL_HOST, ps.host, ps.port) if ps else None,
            lease_seconds=3600, lease_expires=time.time() + 3600, created=time.time(), senders=senders, width=width,
        )
        if mode != "fallback":
            self._next_slot += cells
            self.programmer.install_job(job)
        self.jobs[job.job_id] = job
        aggregator = ps if mode == "fallback" else self.aggregator
        assert aggregator is not None, "fallback mode needs a PS endpoint"
        return [WorkerConfig(job_id=job.job_id, rank=w.rank, num_workers=num_workers, slot_count=slot_count,
                             mode=mode, aggregator=aggregator, bind=Endpoint(w.ip, w.udp_port), ps=ps,
                             senders=senders, width=width)
                for w in job.workers]

    def remove_job(self, job_id: int) -> None:
        job = self.jobs.pop(job_id)
        if job.mode != "fallback":
            self.programmer.remove_job(job)

    def counters(self, job_id: int) -> dict[str, int]:
        return read_job_counters(self.programmer.client, job_id)

    def drop_reasons(self) -> dict[str, int]:
        """Packets counted per ``drop_reasons`` index so far, by ``DropReason`` name (those counted only)."""
        counted = self.programmer.client.read_counters(dp.COUNTER_DROP_REASONS)
        return {DropReason(index).name: packets for index, (packets, _) in counted.items()
                if packets and index in DropReason._value2member_map_}

    @property
    def fault_stats(self) -> dict[str, int]:
        """Packets dropped/duplicated/reordered (and bursts started) so far, in and out."""
        rx, tx = self.target.switch.rx_faults, self.target.switch.tx_faults
        totals = {"dropped": 0, "duplicated": 0, "reordered": 0, "bursts": 0}
        for injector in (rx, tx):
            if injector is not None:
                for key in totals:
                    totals[key] += getattr(injector.stats, key)
        return totals
