"""The controller's job service: admission, slot allocation, switch programming, leases.

All mutations run under one lock; each writes the database before it touches
the switch, so :meth:`JobService.recover` can finish any interrupted step after
a crash (see ``store.py`` for the row states).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from netagg import jobsecret, wire
from netagg.controller.allocator import SlotAllocator, SlotRange
from netagg.controller.config import ControllerConfig
from netagg.controller.p4runtime_client import P4RuntimeClient, P4RuntimeError
from netagg.controller.store import JobRecord, JobStore, PsEndpoint, WorkerEndpoint
from netagg.controller.switch_programmer import ReconcileReport, SwitchProgrammer
from netagg.jobconfig import SCHEDULES, UPDATE_MODES, Endpoint, WorkerConfig
from netagg.p4info import P4InfoIndex, load_p4info, p4info_differences

log = logging.getLogger(__name__)

#: Job ids index the per-job counters (size MAX_JOBS in the P4 program).
FIRST_JOB_ID = 1


class ServiceError(Exception):
    """A request the service refuses; ``code`` picks the CLI's exit status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Caller:
    """Who is asking: a tenant, or the admin (tenant None)."""

    tenant: str | None

    @property
    def is_admin(self) -> bool:
        return self.tenant is None


class JobService:
    """Job lifecycle on one switch."""

    def __init__(self, config: ControllerConfig, store: JobStore, client: P4RuntimeClient) -> None:
        self.config = config
        self.store = store
        self.client = client
        self.programmer = SwitchProgrammer(client, config)
        self.allocator = SlotAllocator(config.slot_capacity)
        self.max_jobs = 0
        #: Admission decisions since start (full, partial, fallback, refused), for the metrics endpoint.
        self.admissions: Counter[str] = Counter()
        self._lock = threading.RLock()

    # -- start-up ------------------------------------------------------------
    def connect_switch(self) -> str:
        """Become primary and make sure the switch runs our pipeline (pushing it only if not)."""
        self.client.connect()
        expected = load_p4info(self.config.p4info)
        index = P4InfoIndex(expected)
        registers = {r.name: r.size for r in index.registers}
        capacity = registers.get("NetaggIngress.slot_owner.slot_owner", 0)
        if self.config.slot_capacity > capacity:
            raise ServiceError("invalid_argument", f"{self.config.source}: slots.capacity: "
                               f"{self.config.slot_capacity} exceeds the program's {capacity} slots")
        self.max_jobs = index.counter("NetaggIngress.job_results").size
        current = self.client.get_pipeline_p4info()
        if current is not None and not p4info_differences(expected, current):
            return "kept the pipeline already on the switch"
        device_config = b""
        if self.config.bmv2_json is not None:
            try:
                device_config = self.config.bmv2_json.read_bytes()
            except OSError as err:
                raise ServiceError("invalid_argument", f"{self.config.source}: switch.bmv2_json: "
                                   f"cannot read {self.config.bmv2_json}: {err.strerror}") from None
        self.client.set_pipeline(self.config.p4info, device_config)
        return "pushed the pipeline" if current is None else "replaced a different pipeline"

    def recover(self) -> ReconcileReport:
        """Rebuild the allocator from the database, finish interrupted steps, reconcile the switch."""
        with self._lock:
            jobs = self.store.all()
            for job in jobs:
                if job.uses_switch:
                    self.allocator.reserve(SlotRange(job.slot_base, job.slot_count))
            for job in [j for j in jobs if j.state == "deleting"]:
                self._finish_delete(job)
            live = [j for j in jobs if j.state != "deleting"]
            report = self.programmer.reconcile(live)
            for job in live:
                if job.state == "installing":
                    self._activate(job)
            return report

    # -- requests ----------------------------------------------------------
    def create_job(self, caller: Caller, name: str, workers: Sequence[str], slots: int, mode: str = "allreduce",
                   ps: str | None = None, lease_seconds: float | None = None,
                   tenant: str | None = None, update_mode: str = "sync", delay_bound: int | None = None,
                   schedule: str = "fifo", replicas: int | None = None,
                   replica_ps: Sequence[str] | None = None, switch_aggregation: bool = False,
                   senders: int = 0) -> dict:
        """Admit a job (best effort) and program the switch; returns the job and how it was admitted.

        ``update_mode``, ``delay_bound``, ``schedule``, ``replicas``/``replica_ps`` are the MLfabric
        options (docs/mlfabric.md); they are stored with the job and written into its worker configs.
        ``switch_aggregation`` (mode allreduce, schedule mlfabric) sums the scheduler's groups in the
        job's slots; a job admitted in fallback mode (no slots) goes without it (said in its note).
        ``senders``: a one-way job (mode allreduce): the last that many workers only send (left out of
        the job's multicast group), the others only receive (left out of the workers table): a PS
        distributing the model through the switch (docs/mlfabric.md).
        """
        owner = self._owner_for(caller, tenant)
        endpoints = self._parse_workers(workers)
        ps_endpoint = self._parse_ps(ps) if ps else None
        replica_endpoints = self._mlfabric_options(ps_endpoint, update_mode, delay_bound, schedule, replicas,
                                                   replica_ps)
        if mode not in ("allreduce", "ps", "fallback"):
            raise ServiceError("invalid_argument", f"mode {mode!r} is not allreduce, ps or fallback")
        if not isinstance(switch_aggregation, bool):
            raise ServiceError("invalid_argument", f"switch aggregation must be true or false, got "
                               f"{switch_aggregation!r}")
        if not isinstance(senders, int) or isinstance(senders, bool) or not 0 <= senders < len(endpoints):
            raise ServiceError("invalid_argument", f"senders must be an integer in 0..{len(endpoints) - 1}, "
                               f"got {senders!r}")
        if senders and mode != "allreduce":
            raise ServiceError("invalid_argument", "--senders needs --mode allreduce")
        if switch_aggregation and (schedule != "mlfabric" or mode != "allreduce"):
            raise ServiceError("invalid_argument", "--switch-aggregation needs --schedule mlfabric and --mode "
                               "allreduce (the group's sums go back to its members)")
        if mode in ("ps", "fallback") and ps_endpoint is None:
            raise ServiceError("invalid_argument", f"mode {mode} needs --ps")
        if slots < 1:
            raise ServiceError("invalid_argument", f"slots must be >= 1, got {slots}")
        lease = self.config.default_lease_seconds if lease_seconds is None else lease_seconds
        if lease <= 0:
            raise ServiceError("invalid_argument", "lease must be > 0 seconds")
        with self._lock:
            job_id = self._free_job_id()
            admission, reason = "full", f"{slots} slots as asked"
            taken: SlotRange | None = None
            if mode != "fallback":
                taken = self.allocator.allocate(slots, min(self.config.min_slots, slots))
                if taken is None:
                    if ps_endpoint is None:
                        self.admissions["refused"] += 1
                        raise ServiceError("capacity_exhausted", (
                            f"no range of {min(self.config.min_slots, slots)}+ free slots "
                            f"(largest free: {self.allocator.largest_free()}) and no --ps to fall back to"))
                    mode, admission = "fallback", "fallback"
                    reason = (f"no range of {min(self.config.min_slots, slots)}+ free slots "
                              f"(largest free: {self.allocator.largest_free()}); workers aggregate through the PS")
                    if switch_aggregation:
                        switch_aggregation = False
                        reason += "; no switch aggregation without slots"
                elif taken.count < slots:
                    admission = "partial"
                    reason = f"{taken.count} of {slots} slots (largest free range); fewer packets in flight"
            else:
                reason = "fallback mode asked for"
            now = time.time()
            try:
                with self.store.transaction() as conn:
                    job = JobRecord(
                        job_id=job_id, tenant=owner, name=name, mode=mode, state="installing",
                        slot_base=taken.base if taken else 0, slot_count=taken.count if taken else 0,
                        slots_wanted=slots, generation=self.store.next_generation(conn), workers=endpoints,
                        ps=ps_endpoint, lease_seconds=lease, lease_expires=now + lease, created=now,
                        note=f"{admission}: {reason}", update_mode=update_mode, delay_bound=delay_bound,
                        schedule=schedule, replicas=replica_endpoints, secret=jobsecret.new_secret(),
                        switch_aggregation=switch_aggregation, senders=senders,
                    )
                    self.store.insert(conn, job)
            except BaseException:
                if taken:
                    self.allocator.release(taken)
                raise
            try:
                self.programmer.install_job(job)
            except P4RuntimeError as err:
                self._abort_create(job, taken)
                raise ServiceError("switch_error", f"switch refused job {job_id}: {err}") from None
            job = self._activate(job)
            self.admissions[admission] += 1
            return {"job": self._view(job), "admission": admission, "reason": reason}

    def delete_job(self, caller: Caller, job_id: int, reason: str = "deleted") -> dict:
        with self._lock:
            job = self._owned(caller, job_id)
            self.store.set_state(job.job_id, "deleting")
            self._finish_delete(job)
            log.info("job %d (%s) %s", job.job_id, job.tenant, reason)
            return {"job_id": job.job_id, "released_slots": job.slot_count, "reason": reason}

    def list_jobs(self, caller: Caller) -> list[dict]:
        return [self._view(j) for j in self.store.all() if caller.is_admin or j.tenant == caller.tenant]

    def show_job(self, caller: Caller, job_id: int) -> dict:
        job = self._owned(caller, job_id)
        view = self._view(job)
        if job.uses_switch:
            try:
                current = self.programmer.read_job_counters(job.job_id)
            except P4RuntimeError as err:
                raise ServiceError("switch_error", f"cannot read counters of job {job_id}: {err}") from None
            view["counters"] = {k: v - job.counter_base.get(k, 0) for k, v in current.items()}
        return view

    def renew_job(self, caller: Caller, job_id: int) -> dict:
        with self._lock:
            job = self._owned(caller, job_id)
            return {"job_id": job.job_id, "lease_expires": self.store.renew(job.job_id)}

    def worker_config(self, caller: Caller, job_id: int, rank: int) -> WorkerConfig:
        job = self._owned(caller, job_id)
        worker = next((w for w in job.workers if w.rank == rank), None)
        if worker is None:
            raise ServiceError("not_found", f"job {job_id} has no rank {rank} (ranks 0..{len(job.workers) - 1})")
        ps = Endpoint(job.ps.ip, job.ps.udp_port) if job.ps else None
        aggregator = ps if job.mode == "fallback" else Endpoint(self.config.aggregator_ip,
                                                                  self.config.aggregator_port)
        return WorkerConfig(job_id=job.job_id, rank=rank, num_workers=len(job.workers),
                            slot_count=job.slot_count, mode=job.mode, aggregator=aggregator,
                            bind=Endpoint(worker.ip, worker.udp_port), ps=ps, tenant=job.tenant,
                            update_mode=job.update_mode, delay_bound=job.delay_bound, schedule=job.schedule,
                            replicas=tuple(Endpoint(r.ip, r.udp_port) for r in job.replicas), secret=job.secret,
                            switch_aggregation=job.switch_aggregation, senders=job.senders)

    def reap_expired(self, now: float | None = None) -> list[int]:
        """Delete every job whose lease ran out; returns their ids."""
        reaped = []
        for job in self.store.expired(time.time() if now is None else now):
            try:
                self.delete_job(Caller(None), job.job_id, reason="lease expired")
                reaped.append(job.job_id)
            except (ServiceError, P4RuntimeError) as err:
                log.warning("could not reclaim job %d: %s", job.job_id, err)
        return reaped

    # -- internals -----------------------------------------------------------
    def _activate(self, job: JobRecord) -> JobRecord:
        base = {}
        if job.uses_switch and not job.counter_base:
            base = self.programmer.read_job_counters(job.job_id)
            self.store.set_counter_base(job.job_id, base)
        self.store.set_state(job.job_id, "active")
        return self.store.get(job.job_id)

    def _abort_create(self, job: JobRecord, taken: SlotRange | None) -> None:
        try:
            self.programmer.remove_job(job)
        except P4RuntimeError as err:
            log.warning("cleanup after failed create of job %d: %s", job.job_id, err)
        self.store.remove(job.job_id)
        if taken:
            self.allocator.release(taken)

    def _finish_delete(self, job: JobRecord) -> None:
        """Remove the job from the switch, then the database, then free its slots."""
        try:
            self.programmer.remove_job(job)
        except P4RuntimeError as err:
            raise ServiceError("switch_error", f"cannot remove job {job.job_id} from the switch "
                               f"(it stays marked deleting and is retried on restart): {err}") from None
        self.store.remove(job.job_id)
        if job.uses_switch:
            self.allocator.release(SlotRange(job.slot_base, job.slot_count))

    def _free_job_id(self) -> int:
        used = {j.job_id for j in self.store.all()}
        for job_id in range(FIRST_JOB_ID, self.max_jobs or 1024):
            if job_id not in used:
                return job_id
        raise ServiceError("capacity_exhausted", f"all {len(used)} job ids are in use")

    def _owner_for(self, caller: Caller, tenant: str | None) -> str:
        if caller.is_admin:
            if not tenant:
                raise ServiceError("invalid_argument", "the admin must name the tenant (--tenant)")
            if tenant not in self.config.tenants.values():
                raise ServiceError("invalid_argument", f"unknown tenant {tenant!r}")
            return tenant
        if tenant and tenant != caller.tenant:
            raise ServiceError("permission_denied", f"tenant {caller.tenant!r} cannot create jobs for {tenant!r}")
        return caller.tenant

    def _owned(self, caller: Caller, job_id: int) -> JobRecord:
        job = self.store.get(job_id)
        # Another tenant's job is reported exactly like a missing one: no probing.
        if job is None or not (caller.is_admin or job.tenant == caller.tenant):
            raise ServiceError("not_found", f"no job {job_id}")
        return job

    def _resolve_host(self, text: str, what: str) -> tuple[str, str]:
        """A configured host name or IPv4 address -> (host name, ip)."""
        if text in self.config.hosts:
            return text, self.config.hosts[text].ip
        try:
            ip = str(ipaddress.IPv4Address(text))
        except ValueError:
            raise ServiceError("invalid_argument", f"{what}: unknown host {text!r}") from None
        host = self.config.host_by_ip(ip)
        if host is None:
            raise ServiceError("invalid_argument", f"{what}: {ip} is not a configured host")
        return host.name, ip

    def _endpoint(self, text: str, what: str) -> tuple[str, str, int]:
        host_text, sep, port_text = text.rpartition(":")
        if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ServiceError("invalid_argument", f"{what}: expected HOST:UDP_PORT, got {text!r}")
        host, ip = self._resolve_host(host_text, what)
        return host, ip, int(port_text)

    def _parse_workers(self, workers: Sequence[str]) -> list[WorkerEndpoint]:
        if not 1 <= len(workers) <= wire.MAX_WORKERS:
            raise ServiceError("invalid_argument", f"a job has 1..{wire.MAX_WORKERS} workers, got {len(workers)}")
        endpoints = []
        for rank, text in enumerate(workers):
            host, ip, port = self._endpoint(text, f"worker {rank}")
            endpoints.append(WorkerEndpoint(rank, host, ip, port))
        if len({(w.ip, w.udp_port) for w in endpoints}) != len(endpoints):
            raise ServiceError("invalid_argument", "two workers share an address and UDP port")
        return endpoints

    def _parse_ps(self, text: str) -> PsEndpoint:
        if text in self.config.parameter_servers:
            ps = self.config.parameter_servers[text]
            return PsEndpoint(ps.host, self.config.hosts[ps.host].ip, ps.udp_port)
        host, ip, port = self._endpoint(text, "ps")
        return PsEndpoint(host, ip, port)

    def _mlfabric_options(self, ps: PsEndpoint | None, update_mode: str, delay_bound: int | None, schedule: str,
                          replicas: int | None, replica_ps: Sequence[str] | None) -> list[PsEndpoint]:
        """Check the MLfabric options; returns the replica endpoints (named, or the first free configured PSs)."""
        def bad(message: str) -> ServiceError:
            return ServiceError("invalid_argument", message)

        if update_mode not in UPDATE_MODES:
            raise bad(f"update mode {update_mode!r} is not one of {', '.join(UPDATE_MODES)}")
        if schedule not in SCHEDULES:
            raise bad(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
        if delay_bound is not None and (not isinstance(delay_bound, int) or isinstance(delay_bound, bool)
                                        or delay_bound < 0):
            raise bad(f"delay bound must be an integer >= 0, got {delay_bound!r}")
        if delay_bound is not None and update_mode != "async":
            raise bad("a delay bound needs --sync async")
        if schedule != "fifo" and update_mode != "async":
            raise bad(f"schedule {schedule} needs --sync async")
        if update_mode == "async" and ps is None:
            raise bad("--sync async needs --ps (the parameter server applies the updates)")
        named = [self._parse_ps(text) for text in (replica_ps or [])]
        if replicas is not None and (not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0):
            raise bad(f"replicas must be an integer >= 0, got {replicas!r}")
        count = len(named) if replicas is None else replicas
        if named and count != len(named):
            raise bad(f"--replicas {count} but {len(named)} replica endpoint(s) named")
        if count and ps is None:
            raise bad("replicas need --ps (the primary parameter server)")
        if count and not named:
            for candidate in self.config.parameter_servers.values():
                endpoint = PsEndpoint(candidate.host, self.config.hosts[candidate.host].ip, candidate.udp_port)
                if (endpoint.ip, endpoint.udp_port) != (ps.ip, ps.udp_port) and len(named) < count:
                    named.append(endpoint)
            if len(named) < count:
                raise bad(f"--replicas {count}: only {len(named)} configured parameter server(s) besides the "
                          f"primary; name them with --replica-ps")
        addresses = [(p.ip, p.udp_port) for p in [ps, *named] if p is not None]
        if len(set(addresses)) != len(addresses):
            raise bad("the primary and its replicas must be distinct endpoints")
        return named

    def _view(self, job: JobRecord) -> dict:
        view = job.to_dict()
        view.pop("counter_base")
        view["slots"] = f"{job.slot_base}..{job.slot_base + job.slot_count - 1}" if job.slot_count else "-"
        return view
