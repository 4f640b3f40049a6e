"""The controller's job service: admission, slot allocation, switch programming, leases.

All mutations run under one lock; each writes the database before it touches
the switch, so :meth:`JobService.recover` can finish any interrupted step after
a crash (see ``store.py`` for the row states).

The switch can go away and come back (``switch_watch.py``): from the moment it is
lost until :meth:`JobService.resync` has put everything back (under the same lock),
requests that need it (create, delete, show) are refused with ``switch_unavailable``
and change nothing; the service never queues them.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from p4.config.v1 import p4info_pb2

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


def pipeline_cookie(p4info: p4info_pb2.P4Info, device_config: bytes) -> int:
    """The cookie the controller pushes its pipeline with: 64 bits of a hash of the program (never 0)."""
    digest = hashlib.sha256(p4info.SerializeToString(deterministic=True) + b"\0" + device_config).digest()
    return int.from_bytes(digest[:8], "big") or 1


@dataclass(frozen=True)
class SwitchSync:
    """What one resync found and did: the pipeline, whether the switch had lost its state, the reconcile."""

    pipeline: str
    lost_state: bool
    report: ReconcileReport
    jobs: int


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
        self._program: tuple[p4info_pb2.P4Info, bytes] | None = None
        self._loaded = False
        #: The cookie this controller pushes its pipeline with (from the program: the same across restarts).
        self.pipeline_cookie = 0
        #: The cookie of the pipeline found or pushed at the last sync (None before the first).
        self.expected_cookie: int | None = None
        #: monotonic time since when the switch is unavailable to requests (None: connected and in sync).
        self._unavailable_since: float | None = time.monotonic()
        self._unavailable_reason = "not connected yet"

    # -- start-up and the switch's comings and goings --------------------------
    def check_program(self) -> None:
        """Read the program (P4Info, BMv2 JSON) and check the slot capacity against it (once; no switch)."""
        if self._program is not None:
            return
        expected = load_p4info(self.config.p4info)
        index = P4InfoIndex(expected)
        registers = {r.name: r.size for r in index.registers}
        capacity = registers.get("NetaggIngress.slot_owner.slot_owner", 0)
        if self.config.slot_capacity > capacity:
            raise ServiceError("invalid_argument", f"{self.config.source}: slots.capacity: "
                               f"{self.config.slot_capacity} exceeds the program's {capacity} slots")
        self.max_jobs = index.counter("NetaggIngress.job_results").size
        device_config = b""
        if self.config.bmv2_json is not None:
            try:
                device_config = self.config.bmv2_json.read_bytes()
            except OSError as err:
                raise ServiceError("invalid_argument", f"{self.config.source}: switch.bmv2_json: "
                                   f"cannot read {self.config.bmv2_json}: {err.strerror}") from None
        self._program = (expected, device_config)
        self.pipeline_cookie = pipeline_cookie(expected, device_config)
        if self.client.index is None:  # entries are named through our P4Info, whoever pushed the pipeline
            self.client.index = index

    def load(self) -> None:
        """Check the program and rebuild the slot allocator from the database (once; no switch)."""
        self.check_program()
        with self._lock:
            if self._loaded:
                return
            for job in self.store.all():
                if job.uses_switch:
                    self.allocator.reserve(SlotRange(job.slot_base, job.slot_count))
            self._loaded = True

    def connect_switch(self, timeout: float | None = None) -> str:
        """Become primary and make sure the switch runs our pipeline (pushing it only if not).

        ``timeout``: how long to wait for the switch to accept the connection (default: the client's).
        """
        self.check_program()
        self.client.connect(timeout)
        return self.ensure_pipeline()[0]

    def ensure_pipeline(self) -> tuple[str, bool]:
        """Make sure the switch runs our pipeline; returns (what was done, whether the switch lost it).

        One COOKIE_ONLY read when the switch holds the pipeline this controller pushed. Otherwise the
        P4Info is compared: the same program (pushed by someone else, or preloaded) is kept and its
        cookie remembered; no pipeline or another program gets ours, with our cookie. *Lost* means the
        switch no longer held the pipeline seen at the previous call: it restarted (or someone replaced
        the pipeline), so its tables and counters started from nothing.
        """
        self.check_program()
        assert self._program is not None
        expected, device_config = self._program
        before = self.expected_cookie
        cookie = self.client.get_pipeline_cookie()
        lost = before is not None and cookie != before
        if cookie is not None and cookie == self.pipeline_cookie:
            self.expected_cookie = cookie
            return "kept the pipeline already on the switch", lost
        current = self.client.get_pipeline_p4info() if cookie is not None else None
        if current is not None and not p4info_differences(expected, current):
            self.expected_cookie = cookie
            return "kept the pipeline already on the switch", lost
        self.client.set_pipeline(expected, device_config, cookie=self.pipeline_cookie)
        self.expected_cookie = self.pipeline_cookie
        return ("pushed the pipeline" if current is None else "replaced a different pipeline"), lost

    def recover(self) -> ReconcileReport:
        """Rebuild the allocator from the database, finish interrupted steps, reconcile the switch.

        Needs a connected client (``connect_switch``); marks the switch available."""
        self.load()
        with self._lock:
            report, _ = self._sync_jobs(reset_counters=False)
            self._unavailable_since = None
            return report

    def resync(self) -> SwitchSync:
        """After (re)connecting: our pipeline on the switch, then every job as the database has it.

        Runs under the service lock, so no request interleaves: interrupted deletes are finished,
        the switch is reconciled both ways (what a restarted switch lost is re-installed, strays are
        removed), jobs caught ``installing`` are activated; if the switch had lost its state, the
        jobs' counter baselines are read again (its counters restarted from 0). Then the switch is
        available to requests again. Raises P4RuntimeError/ServiceError when the switch fails it
        (it stays unavailable; the caller retries).
        """
        self.load()
        with self._lock:
            pipeline, lost = self.ensure_pipeline()
            report, jobs = self._sync_jobs(reset_counters=lost)
            self._unavailable_since = None
            return SwitchSync(pipeline, lost, report, jobs)

    def _sync_jobs(self, reset_counters: bool) -> tuple[ReconcileReport, int]:
        jobs = self.store.all()
        for job in [j for j in jobs if j.state == "deleting"]:
            self._finish_delete(job)
        live = [j for j in jobs if j.state != "deleting"]
        report = self.programmer.reconcile(live)
        for job in live:
            if reset_counters and job.uses_switch:
                self.store.set_counter_base(job.job_id, self.programmer.read_job_counters(job.job_id))
            if job.state == "installing":
                self._activate(job)
        return report, sum(1 for j in live if j.uses_switch)

    def reconnect_switch(self, timeout: float) -> None:
        """A fresh P4Runtime session (channel, StreamChannel, arbitration); P4RuntimeError unless primary.

        Under the service lock: no request is using the client while its channel is replaced."""
        with self._lock:
            self.client.reconnect(timeout)
        if not self.client.is_primary:
            primary = self.client.primary_election_id
            raise P4RuntimeError("PERMISSION_DENIED", f"not primary on {self.config.grpc_address}: another "
                                 f"controller is (election id {primary[1] if primary else '?'}; ours is "
                                 f"{self.config.election_id})")

    @property
    def switch_available(self) -> bool:
        """Whether the switch is connected and in sync (False from a loss until the next resync)."""
        return self._unavailable_since is None

    def mark_switch_unavailable(self, reason: str) -> bool:
        """The switch is gone (or lost its state): refuse switch requests until ``resync``; True if it was up."""
        was_up = self._unavailable_since is None
        if was_up:
            self._unavailable_reason = reason
            self._unavailable_since = time.monotonic()
        return was_up

    def _require_switch(self, what: str) -> None:
        since = self._unavailable_since
        if since is None:
            return
        raise ServiceError("switch_unavailable", (
            f"cannot {what}: the switch at {self.config.grpc_address} is unavailable "
            f"({self._unavailable_reason}; for {time.monotonic() - since:.1f} s); the controller is "
            "reconnecting and re-installs every job when it is back: retry then (nothing was changed)"))

    # -- requests ----------------------------------------------------------
    def create_job(self, caller: Caller, name: str, workers: Sequence[str], slots: int, mode: str = "allreduce",
                   ps: str | None = None, lease_seconds: float | None = None,
                   tenant: str | None = None, update_mode: str = "sync", delay_bound: int | None = None,
                   schedule: str = "fifo", replicas: int | None = None,
                   replica_ps: Sequence[str] | None = None, switch_aggregation: bool = False,
                   senders: int = 0, distribution: Sequence[str] | None = None,
                   distribution_ps: Sequence[str] | None = None, distribution_slots: int | None = None) -> dict:
        """Admit a job (best effort) and program the switch; returns the job and how it was admitted.

        ``update_mode``, ``delay_bound``, ``schedule``, ``replicas``/``replica_ps`` are the MLfabric
        options (docs/mlfabric.md); they are stored with the job and written into its worker configs.
        ``switch_aggregation`` (mode allreduce, schedule mlfabric) sums the scheduler's groups in the
        job's slots; a job admitted in fallback mode (no slots) goes without it (said in its note).
        ``senders``: a one-way job (mode allreduce): the last that many workers only send (left out of
        the job's multicast group), the others only receive (left out of the workers table): a PS
        distributing the model through the switch (docs/mlfabric.md).
        ``distribution`` (an async job with a PS): one endpoint per worker, in rank order, where it receives
        model versions, and ``distribution_ps`` one per PS node (the primary, then the replicas), where it
        sends them from: the controller also creates the job's *distribution job*, a one-way job of those
        endpoints (the PS nodes its last ranks, its senders) with ``distribution_slots`` slots (default
        ``slots``), linked to this one: created, renewed and deleted with it, or not at all. The answer
        then has a ``distribution`` entry: that job and how it was admitted.
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
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ServiceError("invalid_argument", f"slots must be >= 1, got {slots}")
        dist_members = self._distribution_members(endpoints, ps_endpoint, replica_endpoints, update_mode, senders,
                                                  distribution, distribution_ps, distribution_slots)
        dist_slots = slots if distribution_slots is None else distribution_slots
        lease = self.config.default_lease_seconds if lease_seconds is None else lease_seconds
        if lease <= 0:
            raise ServiceError("invalid_argument", "lease must be > 0 seconds")
        with self._lock:
            self._require_switch("create a job")
            job_id = self._free_job_id()
            dist_id = None if dist_members is None else self._free_job_id(exclude={job_id})
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
            dist_taken, dist_admission, dist_reason = None, "full", f"{dist_slots} slots as asked"
            if dist_members is not None:
                # The versions go through the switch or not at all: no fallback, and without slots no job either.
                dist_taken = self.allocator.allocate(dist_slots, min(self.config.min_slots, dist_slots))
                if dist_taken is None:
                    if taken:
                        self.allocator.release(taken)
                    self.admissions["refused"] += 1
                    raise ServiceError("capacity_exhausted", (
                        f"no range of {min(self.config.min_slots, dist_slots)}+ free slots for the distribution "
                        f"job (largest free: {self.allocator.largest_free()}); neither job was created"))
                if dist_taken.count < dist_slots:
                    dist_admission = "partial"
                    dist_reason = (f"{dist_taken.count} of {dist_slots} slots (largest free range); fewer packets "
                                   "in flight")
            now = time.time()
            created: list[tuple[JobRecord, SlotRange | None]] = []
            try:
                with self.store.transaction() as conn:
                    job = JobRecord(
                        job_id=job_id, tenant=owner, name=name, mode=mode, state="installing",
                        slot_base=taken.base if taken else 0, slot_count=taken.count if taken else 0,
                        slots_wanted=slots, generation=self.store.next_generation(conn), workers=endpoints,
                        ps=ps_endpoint, lease_seconds=lease, lease_expires=now + lease, created=now,
                        note=f"{admission}: {reason}", update_mode=update_mode, delay_bound=delay_bound,
                        schedule=schedule, replicas=replica_endpoints, secret=jobsecret.new_secret(),
                        switch_aggregation=switch_aggregation, senders=senders, distribution=dist_id,
                    )
                    self.store.insert(conn, job)
                    created.append((job, taken))
                    if dist_members is not None:
                        assert dist_id is not None and dist_taken is not None
                        dist = JobRecord(
                            job_id=dist_id, tenant=owner, name=f"{name}-distribution", mode="allreduce",
                            state="installing", slot_base=dist_taken.base, slot_count=dist_taken.count,
                            slots_wanted=dist_slots, generation=self.store.next_generation(conn),
                            workers=dist_members, ps=None, lease_seconds=lease, lease_expires=now + lease,
                            created=now, note=f"{dist_admission}: {dist_reason}", secret=jobsecret.new_secret(),
                            senders=1 + len(replica_endpoints), distribution_of=job_id,
                        )
                        self.store.insert(conn, dist)
                        created.append((dist, dist_taken))
            except BaseException:
                for one in (taken, dist_taken):
                    if one:
                        self.allocator.release(one)
                raise
            for one, _ in created:
                try:
                    self.programmer.install_job(one)
                except P4RuntimeError as err:
                    for undo, its_slots in created:  # both or neither
                        self._abort_create(undo, its_slots)
                    raise ServiceError("switch_error", f"switch refused job {one.job_id}: {err}") from None
            activated = [self._activate(one) for one, _ in created]
            self.admissions[admission] += 1
            result = {"job": self._view(activated[0]), "admission": admission, "reason": reason}
            if len(activated) > 1:
                self.admissions[dist_admission] += 1
                result["distribution"] = {"job": self._view(activated[1]), "admission": dist_admission,
                                          "reason": dist_reason}
            return result

    def delete_job(self, caller: Caller, job_id: int, reason: str = "deleted") -> dict:
        """Delete a job (with its distribution job, if it has one); a distribution job goes only with its job."""
        with self._lock:
            job = self._owned(caller, job_id)
            self._require_switch(f"delete job {job_id}")
            served = self._served_job(job)
            if served is not None:
                raise ServiceError("invalid_argument", f"job {job_id} is the distribution job of job "
                                   f"{served.job_id}: delete job {served.job_id} (that deletes both)")
            dist = self._distribution_job(job)
            self.store.set_state(job.job_id, "deleting", *([dist.job_id] if dist else []))
            result: dict = {"job_id": job.job_id, "released_slots": job.slot_count, "reason": reason}
            if dist is not None:  # both are marked deleting: a crash in between, and recover finishes both
                self._finish_delete(dist)
                result["distribution"] = {"job_id": dist.job_id, "released_slots": dist.slot_count}
            self._finish_delete(job)
            log.info("job %d (%s) %s%s", job.job_id, job.tenant, reason,
                     f", with its distribution job {dist.job_id}" if dist else "")
            return result

    def list_jobs(self, caller: Caller) -> list[dict]:
        return [self._view(j) for j in self.store.all() if caller.is_admin or j.tenant == caller.tenant]

    def show_job(self, caller: Caller, job_id: int) -> dict:
        job = self._owned(caller, job_id)
        view = self._view(job)
        if job.uses_switch:
            self._require_switch(f"read the counters of job {job_id}")
            try:
                current = self.programmer.read_job_counters(job.job_id)
            except P4RuntimeError as err:
                raise ServiceError("switch_error", f"cannot read counters of job {job_id}: {err}") from None
            view["counters"] = {k: v - job.counter_base.get(k, 0) for k, v in current.items()}
        return view

    def renew_job(self, caller: Caller, job_id: int) -> dict:
        """Extend a job's lease; a job and its distribution job are renewed together (either id will do)."""
        with self._lock:
            job = self._owned(caller, job_id)
            main = self._served_job(job) or job
            dist = self._distribution_job(main)
            now = time.time()
            renewed = [main.job_id, *([dist.job_id] if dist else [])]
            expires = {one: self.store.renew(one, now) for one in renewed}
            return {"job_id": job.job_id, "lease_expires": expires[job.job_id], "renewed": renewed}

    def worker_config(self, caller: Caller, job_id: int, rank: int | None, distribution: bool = False,
                      ps_node: int | None = None) -> WorkerConfig:
        """Rank ``rank``'s config of the job; with ``distribution``, of its distribution job: a worker's
        (``rank``, the same rank as in the job) or a PS node's (``ps_node``: 0 the primary, then the
        replicas in order; the distribution job's rank ``workers + ps_node``)."""
        def bad(message: str) -> ServiceError:
            return ServiceError("invalid_argument", message)

        if not isinstance(distribution, bool):
            raise bad(f"distribution must be true or false, got {distribution!r}")
        for what, value in (("rank", rank), ("ps node", ps_node)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise bad(f"{what} must be an integer, got {value!r}")
        job = self._owned(caller, job_id)
        if not distribution:
            if ps_node is not None:
                raise bad("--ps-node needs --distribution (the PS nodes are ranks of the distribution job)")
            if rank is None:
                raise bad("a worker config needs --rank")
            return self._config_of(job, rank)
        dist = self._distribution_job(job)
        if dist is None:
            served = self._served_job(job)
            raise ServiceError("not_found", f"job {job_id} has no distribution job" + (
                f" (it is the distribution job of job {served.job_id}: ask for its ranks directly, or "
                f"`job config {served.job_id} --distribution`)" if served else
                " (create the job with --distribution)"))
        if (rank is None) == (ps_node is None):
            raise bad("--distribution needs one of --rank (a worker) or --ps-node (a PS node)")
        nodes = dist.senders
        receivers = len(dist.workers) - nodes
        if ps_node is not None:
            if not 0 <= ps_node < nodes:
                raise ServiceError("not_found", f"job {job_id} has PS nodes 0..{nodes - 1} (0: the primary, "
                                   f"then the replicas), got {ps_node}")
            return self._config_of(dist, receivers + ps_node)
        if not 0 <= rank < receivers:
            raise ServiceError("not_found", f"job {job_id} has no worker rank {rank} (ranks 0..{receivers - 1}; "
                               "the PS nodes' configs: --ps-node)")
        return self._config_of(dist, rank)

    def _config_of(self, job: JobRecord, rank: int) -> WorkerConfig:
        worker = next((w for w in job.workers if w.rank == rank), None)
        if worker is None:
            raise ServiceError("not_found", f"job {job.job_id} has no rank {rank} "
                               f"(ranks 0..{len(job.workers) - 1})")
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
        """Delete every job whose lease ran out; returns their ids.

        A distribution job goes with its job (their leases are renewed together). Nothing is reaped while
        the switch is unavailable: those jobs go once it is back (deleting needs the switch)."""
        if not self.switch_available:
            return []
        reaped = []
        for job in self.store.expired(time.time() if now is None else now):
            if self.store.get(job.job_id) is None:
                continue  # went with its job a moment ago
            served = self._served_job(job)
            if served is not None:  # goes with its job (renewed with it, so expiring with it)
                continue
            try:
                deleted = self.delete_job(Caller(None), job.job_id, reason="lease expired")
                reaped.append(job.job_id)
                if "distribution" in deleted:
                    reaped.append(deleted["distribution"]["job_id"])
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

    def _free_job_id(self, exclude: set[int] | frozenset[int] = frozenset()) -> int:
        used = {j.job_id for j in self.store.all()} | exclude
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

    def _distribution_members(self, workers: list[WorkerEndpoint], ps: PsEndpoint | None,
                              replicas: list[PsEndpoint], update_mode: str, senders: int,
                              distribution: Sequence[str] | None, distribution_ps: Sequence[str] | None,
                              distribution_slots: int | None) -> list[WorkerEndpoint] | None:
        """Check the distribution options; returns the distribution job's ranks (the workers' endpoints,
        then the PS chain's), or None without ``distribution``."""
        def bad(message: str) -> ServiceError:
            return ServiceError("invalid_argument", message)

        def names(value: object, what: str) -> list[str]:
            if isinstance(value, str) or not isinstance(value, list | tuple) or \
                    not all(isinstance(v, str) for v in value):
                raise bad(f"{what}: expected a list of HOST:UDP_PORT, got {value!r}")
            return list(value)

        if distribution is None:
            for option, value in (("--distribution-ps", distribution_ps), ("--distribution-slots", distribution_slots)):
                if value is not None:
                    raise bad(f"{option} needs --distribution (the workers' endpoints for model versions)")
            return None
        receivers = names(distribution, "distribution")
        if update_mode != "async" or ps is None:
            raise bad("--distribution needs --sync async and --ps (the PS chain sends the model versions)")
        if senders:
            raise bad("--distribution and --senders do not go together (the distribution job is the one-way job)")
        chain = [ps, *replicas]
        chain_text = "the primary" + (f", then its {len(replicas)} replica(s)" if replicas else "")
        if len(receivers) != len(workers):
            raise bad(f"--distribution names {len(receivers)} endpoint(s) for {len(workers)} worker(s): "
                      "one per worker, in rank order")
        if distribution_ps is None:
            raise bad(f"--distribution needs --distribution-ps: one endpoint per PS node ({chain_text}), "
                      "where it sends the versions from")
        sending = names(distribution_ps, "distribution ps")
        if len(sending) != len(chain):
            raise bad(f"--distribution-ps names {len(sending)} endpoint(s) for {len(chain)} PS node(s) "
                      f"({chain_text})")
        if distribution_slots is not None and (not isinstance(distribution_slots, int)
                                               or isinstance(distribution_slots, bool) or distribution_slots < 1):
            raise bad(f"distribution slots must be an integer >= 1, got {distribution_slots!r}")
        if len(receivers) + len(sending) > wire.MAX_WORKERS:
            raise bad(f"the distribution job would have {len(receivers) + len(sending)} ranks (workers and PS "
                      f"nodes), more than {wire.MAX_WORKERS}")
        members: list[WorkerEndpoint] = []
        for index, (text, owner) in enumerate([*zip(receivers, workers), *zip(sending, chain)]):
            node = index - len(receivers)
            what = f"distribution endpoint of worker {index}" if node < 0 else \
                f"distribution endpoint of PS node {node}"
            host, ip, port = self._endpoint(text, what)
            if ip != owner.ip:  # the worker receives (the PS sends) the versions itself, from its own host
                raise bad(f"{what} ({ip}:{port}) is not on its host ({owner.ip})")
            members.append(WorkerEndpoint(index, host, ip, port))
        addresses = [(m.ip, m.udp_port) for m in members]
        if len(set(addresses)) != len(addresses):
            raise bad("two distribution endpoints share an address and UDP port")
        taken = {(w.ip, w.udp_port) for w in workers} | {(p.ip, p.udp_port) for p in chain}
        for member in members:
            if (member.ip, member.udp_port) in taken:
                raise bad(f"distribution endpoint {member.ip}:{member.udp_port} is already one of the job's "
                          "(a worker's or a PS's UDP port)")
        return members

    def _distribution_job(self, job: JobRecord) -> JobRecord | None:
        """The job's distribution job (only if it links back: ids are reused once a job is gone)."""
        if job.distribution is None:
            return None
        dist = self.store.get(job.distribution)
        return dist if dist is not None and dist.distribution_of == job.job_id else None

    def _served_job(self, job: JobRecord) -> JobRecord | None:
        """The job whose distribution job this one is (only if it links back)."""
        if job.distribution_of is None:
            return None
        served = self.store.get(job.distribution_of)
        return served if served is not None and served.distribution == job.job_id else None

    def _view(self, job: JobRecord) -> dict:
        view = job.to_dict()
        view.pop("counter_base")
        view["slots"] = f"{job.slot_base}..{job.slot_base + job.slot_count - 1}" if job.slot_count else "-"
        return view
