"""The controller's Prometheus endpoint: per-job and per-switch figures, read at scrape time.

:class:`ControllerCollector` reads the switch's counters over P4Runtime (one Read RPC with a
short deadline, so an unreachable switch makes a scrape report ``netagg_switch_up 0``, not
hang), the slot allocator, the job table and the admission decisions the service counted.
The job secret is never exported. See ``docs/operations.md`` for every metric.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from p4.v1 import p4runtime_pb2 as p4rt
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from netagg import dataplane as dp
from netagg.controller.admission import tenant_cells, tenant_limit
from netagg.controller.allocator import FabricAllocator
from netagg.p4info import P4InfoIndex, load_p4info

if TYPE_CHECKING:
    from netagg.controller.service import JobService
    from netagg.controller.switch_watch import SwitchWatch

log = logging.getLogger(__name__)

#: Seconds a scrape waits for the switch before reporting it down.
SWITCH_READ_TIMEOUT = 2.0
#: Admission decisions counted by the service (``netagg_admissions_total{decision}``).
ADMISSION_DECISIONS = ("full", "partial", "fallback", "refused")
JOB_LABELS = ("job_id", "tenant", "name")


def drop_reason_name(index: int) -> str:
    """The DropReason name of a ``drop_reasons`` counter index (lower case), or the number."""
    try:
        return dp.DropReason(index).name.lower()
    except ValueError:
        return str(index)


@dataclass
class SwitchCounters:
    """One read of the switch: per-job counters (absolute) and drops per (stage, reason index)."""

    jobs: dict[int, dict[str, int]] = field(default_factory=dict)
    drops: dict[tuple[str, int], int] = field(default_factory=dict)


def read_switch_counters(stub: object, device_id: int, index: P4InfoIndex, job_ids: Iterable[int],
                         timeout: float) -> SwitchCounters:
    """Every per-job counter of ``job_ids`` and both drop-reason counters, in one Read RPC.

    Raises ``grpc.RpcError`` when the switch does not answer within ``timeout`` seconds.
    """
    names = {index.counter(name).id: short for short, name in dp.JOB_COUNTERS.items()}
    stages = {index.counter(dp.COUNTER_DROP_REASONS).id: "ingress",
              index.counter(dp.COUNTER_EGRESS_DROP_REASONS).id: "egress"}
    entities = [p4rt.Entity(counter_entry=p4rt.CounterEntry(counter_id=cid)) for cid in stages]
    for job_id in job_ids:
        entities += [p4rt.Entity(counter_entry=p4rt.CounterEntry(counter_id=cid, index=p4rt.Index(index=job_id)))
                     for cid in names]
    request = p4rt.ReadRequest(device_id=device_id, entities=entities)
    found = SwitchCounters()
    for response in stub.Read(request, timeout=timeout):  # type: ignore[attr-defined]
        for entity in response.entities:
            entry = entity.counter_entry
            if entry.counter_id in stages:
                found.drops[(stages[entry.counter_id], entry.index.index)] = entry.data.packet_count
            elif entry.counter_id in names:
                found.jobs.setdefault(entry.index.index, {})[names[entry.counter_id]] = entry.data.packet_count
    return found


class ControllerCollector(Collector):
    """Builds every controller metric from current state on each scrape."""

    def __init__(self, service: JobService, lease_expiries: Callable[[], int] = lambda: 0,
                 timeout: float = SWITCH_READ_TIMEOUT, watches: Sequence[SwitchWatch] = ()) -> None:
        self.service = service
        self.timeout = timeout
        #: The daemon's switch watches (restarts, outages), one per switch; none: only this scrape's read says
        #: whether a switch is up.
        self.watches = {w.switch: w for w in watches}
        self.index = P4InfoIndex(load_p4info(service.config.p4info))
        #: How many jobs the daemon reclaimed because their lease ran out.
        self.lease_expiries = lease_expiries

    def _read_switch(self, switch: str, job_ids: list[int]) -> SwitchCounters | None:
        session = self.service.sessions[switch]
        try:
            return read_switch_counters(session.client.stub, session.device_id, self.index, job_ids, self.timeout)
        except Exception as err:  # deadline, connection refused, not connected: the switch is reported down
            log.debug("metrics: switch %s read failed: %s", switch, err)
            return None

    def _slots(self) -> Iterator[object]:
        """The slot gauges, in cells (a narrow slot; a wide one takes 4): of the one switch, or (a ``switch``
        label) of each switch of the topology."""
        allocator = self.service.allocator
        tree = isinstance(allocator, FabricAllocator)
        per_switch = allocator.allocators if tree else {"": allocator}
        families = [GaugeMetricFamily(name, text, labels=["switch"] if tree else [])
                    for name, text in (("netagg_slots_capacity", "Cells (of 64 values) the controller hands out"),
                                       ("netagg_slots_in_use", "Cells held by jobs (a wide slot holds 4)"),
                                       ("netagg_slots_free", "Cells not held by any job"),
                                       ("netagg_slots_largest_free_range", "Largest contiguous free range of "
                                        "cells (the biggest full grant possible now)"))]
        for switch, one in per_switch.items():
            free = one.free_ranges  # one tuple copy: consistent without the service lock
            free_slots = sum(r.count for r in free)
            values = (one.capacity, one.capacity - free_slots, free_slots, max((r.count for r in free), default=0))
            for family, value in zip(families, values):
                family.add_metric([switch] if tree else [], value)
        yield from families

    def _tenants(self, jobs: list) -> Iterator[object]:
        """Per configured tenant: the cells its jobs hold, and its limit (quota or fair share) where it has one."""
        config = self.service.config
        held = GaugeMetricFamily("netagg_tenant_cells", "Switch cells the tenant's jobs hold", labels=["tenant"])
        limit = GaugeMetricFamily("netagg_tenant_limit_cells", "Cells the tenant's jobs may hold together (its "
                                  "max_cells, or its fair share with slots.fair_share)", labels=["tenant"])
        for tenant in sorted(set(config.tenants.values())):
            held.add_metric([tenant], tenant_cells(tenant, jobs))
            if (found := tenant_limit(config, tenant)) is not None:
                limit.add_metric([tenant], found[0])
        yield from (held, limit)

    def _moves(self, jobs: list) -> Iterator[object]:
        """Moves of running jobs' slots (controller/moves.py): each job's fair share, the moves under way, and the
        moves started, committed and given up."""
        moves = self.service.moves
        if not moves.enabled:
            return
        shares = moves.shares()
        share = GaugeMetricFamily("netagg_job_fair_share_cells", "The job's weighted max-min fair share of the "
                                  "switch's cells (what the controller moves it toward)", labels=JOB_LABELS)
        for job in jobs:
            if job.job_id in shares:
                share.add_metric([str(job.job_id), job.tenant, job.name], shares[job.job_id])
        yield share
        yield GaugeMetricFamily("netagg_moves_pending", "Moves of jobs' slots under way",
                                value=len(self.service.store.moves()))
        total = CounterMetricFamily("netagg_moves", "Moves of running jobs' slots since the controller started",
                                    labels=["outcome"])
        for outcome in ("started", "committed", "aborted"):
            total.add_metric([outcome], moves.counts.get(outcome, 0))
        yield total

    def collect(self) -> Iterator[object]:
        started = time.monotonic()
        fabric = self.service.fabric
        jobs = [j for j in self.service.store.all() if j.state != "deleting"]
        counters: dict[str, SwitchCounters | None] = {}
        for switch in self.service.sessions:
            watch = self.watches.get(switch)
            # A switch the watch knows is away is not read (no deadline to wait out on every scrape).
            counters[switch] = self._read_switch(switch, [j.job_id for j in jobs if switch in fabric.switches_of(j)]) \
                if watch is None or watch.up else None

        up = GaugeMetricFamily("netagg_switch_up", "1 if the controller's session with the switch is up and in "
                               "sync with the jobs, and the switch answered this scrape's counter read, else 0",
                               labels=["grpc_address"])
        for switch, session in self.service.sessions.items():
            up.add_metric([session.address], 1.0 if counters[switch] is not None else 0.0)
        yield up
        if self.watches:
            restarts = CounterMetricFamily("netagg_switch_restarts", "Times the switch came back without the "
                                           "pipeline it had (restarted): pipeline and every job re-installed",
                                           labels=["grpc_address"])
            reconnects = CounterMetricFamily("netagg_switch_reconnects", "Times the controller re-established its "
                                             "session with the switch after losing it (restarts included)",
                                             labels=["grpc_address"])
            away = CounterMetricFamily("netagg_switch_unavailable_seconds", "Seconds since the controller started "
                                       "during which the switch was not in sync (unreachable, or reached but not yet "
                                       "re-installed); the ongoing outage included", labels=["grpc_address"])
            for watch in self.watches.values():
                restarts.add_metric([watch.address], watch.restarts)
                reconnects.add_metric([watch.address], watch.reconnects)
                away.add_metric([watch.address], watch.unavailable_seconds)
            yield from (restarts, reconnects, away)

        # Under a topology a job has counters on each switch of its tree: a ``switch`` label tells them apart.
        job_labels = [*JOB_LABELS, "switch"] if fabric.is_tree else list(JOB_LABELS)
        per_job = {short: CounterMetricFamily(f"netagg_job_{short}", help_text, labels=job_labels)
                   for short, help_text in (
                       ("contributions", "Worker packets the switch aggregated for the job"),
                       ("results", "Results the switch multicast for the job (completed slot rounds)"),
                       ("duplicates", "Contributions the switch had already counted (retransmitted packets)"),
                       ("retransmit_results", "Results the switch resent to answer retransmissions"),
                       ("rejects", "Packets of the job the switch rejected (bad slot, pool, rank, ...)"))}
        for job in jobs:
            for switch in fabric.switches_of(job):
                found = counters[switch]
                if found is None:
                    continue
                current = found.jobs.get(job.job_id, {})
                base = job.counter_base.get(switch, {}) if fabric.is_tree else job.counter_base
                labels = [str(job.job_id), job.tenant, job.name, *([switch] if fabric.is_tree else [])]
                for short, family in per_job.items():
                    if short in current:
                        family.add_metric(labels, max(0, current[short] - base.get(short, 0)))
        yield from per_job.values()

        drops = CounterMetricFamily("netagg_switch_drops", "Packets the switch dropped, by pipeline stage and reason",
                                    labels=["stage", "reason", *(["switch"] if fabric.is_tree else [])])
        for switch, found in counters.items():
            if found is None:
                continue
            for (stage, reason), value in sorted(found.drops.items()):
                if reason != dp.DropReason.NONE:
                    drops.add_metric([stage, drop_reason_name(reason), *([switch] if fabric.is_tree else [])], value)
        yield drops

        info = GaugeMetricFamily("netagg_job_info", "1 per job; its mode and state as labels",
                                 labels=[*JOB_LABELS, "mode", "state"])
        slots = GaugeMetricFamily("netagg_job_slots", "Slots the job holds (0 for fallback jobs)", labels=JOB_LABELS)
        wanted = GaugeMetricFamily("netagg_job_slots_wanted", "Slots the job asked for", labels=JOB_LABELS)
        width = GaugeMetricFamily("netagg_job_width", "Values per packet of the job (64 or 256; a slot of it takes "
                                  "width / 64 cells)", labels=JOB_LABELS)
        workers = GaugeMetricFamily("netagg_job_workers", "Workers of the job", labels=JOB_LABELS)
        lease = GaugeMetricFamily("netagg_job_lease_expiry_timestamp_seconds",
                                  "Unix time at which the job's lease runs out", labels=JOB_LABELS)
        for job in jobs:
            labels = [str(job.job_id), job.tenant, job.name]
            info.add_metric([*labels, job.mode, job.state], 1.0)
            slots.add_metric(labels, job.slot_count)
            wanted.add_metric(labels, job.slots_wanted)
            width.add_metric(labels, job.width)
            workers.add_metric(labels, len(job.workers))
            lease.add_metric(labels, job.lease_expires)
        yield from (info, slots, wanted, width, workers, lease)

        count = GaugeMetricFamily("netagg_jobs", "Jobs by mode and state", labels=["mode", "state"])
        by_kind: dict[tuple[str, str], int] = {}
        for job in jobs:
            by_kind[(job.mode, job.state)] = by_kind.get((job.mode, job.state), 0) + 1
        for (mode, state), n in sorted(by_kind.items()):
            count.add_metric([mode, state], n)
        yield count

        yield from self._slots()
        yield from self._tenants(jobs)
        yield from self._moves(jobs)

        admissions = CounterMetricFamily("netagg_admissions", "Job admission decisions since the controller started",
                                         labels=["decision"])
        decided = dict(self.service.admissions)
        for decision in ADMISSION_DECISIONS:
            admissions.add_metric([decision], decided.get(decision, 0))
        yield admissions
        yield CounterMetricFamily("netagg_lease_expiries", "Jobs reclaimed because their lease ran out",
                                  value=self.lease_expiries())
        yield GaugeMetricFamily("netagg_scrape_duration_seconds", "Time this scrape took to collect",
                                value=time.monotonic() - started)
