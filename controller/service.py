"""The controller's job service: job lifecycle (create, delete, renew, leases) and the switch's comings and goings.

A create is: the request checked and admitted (``admission.py``: slots, full/partial/fallback),
the rows written, the switch programmed, the jobs activated.

All mutations run under one lock; each writes the database before it touches
the switch, so :meth:`JobService.recover` can finish any interrupted step after
a crash (see ``store.py`` for the row states).

The switch can go away and come back (``switch_watch.py``): from the moment it is
lost until :meth:`JobService.resync` has put everything back (under the same lock),
requests that need it (create, delete, show) are refused with ``switch_unavailable``
and change nothing; the service never queues them.

The switches are the fabric's (``fabric.py``): one, or a tree of them under a topology, where a
job has a segment (its slots) on each switch of its tree, all written in its row, and a switch
that is away holds up only the requests of jobs whose tree it is in.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace

from p4.config.v1 import p4info_pb2

from netagg import dataplane as dp
from netagg import jobsecret
from netagg.controller import worker_configs
from netagg.controller.admission import (
    Admission,
    JobRequest,
    TenantCap,
    ValidJob,
    admit,
    tenant_cap,
    tenant_cells,
    tenant_limit,
)
from netagg.controller.allocator import (
    AllocationError,
    FabricAllocator,
    SlotAllocator,
    SlotRange,
    TreeAllocator,
    TreeSlots,
)
from netagg.controller.config import ControllerConfig
from netagg.controller.errors import P4RuntimeError, ServiceError
from netagg.controller.fabric import Fabric, SwitchSession
from netagg.controller.moves import Moves, newcomer_weight
from netagg.controller.sizing import ASKED
from netagg.controller.store import JobRecord, JobStore
from netagg.controller.switch_programmer import ReconcileReport
from netagg.controller.topology import TreeWorker, plan_tree
from netagg.jobconfig import ConfigError, Endpoint, WorkerConfig
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


@dataclass(frozen=True)
class Caller:
    """Who is asking: a tenant, or the admin (tenant None)."""

    tenant: str | None

    @property
    def is_admin(self) -> bool:
        return self.tenant is None


class JobService:
    """Job lifecycle on the controller's switches: one, or a tree of them (``fabric.py``)."""

    def __init__(self, config: ControllerConfig, store: JobStore, fabric: Fabric | None = None) -> None:
        self.config = config
        self.store = store
        self.fabric = fabric if fabric is not None else Fabric(config)
        self.allocator: SlotAllocator | FabricAllocator = (
            FabricAllocator({name: config.slot_capacity for name in self.fabric.sessions}) if self.fabric.is_tree
            else SlotAllocator(config.slot_capacity))
        self.max_jobs = 0
        #: Admission decisions since start (full, partial, fallback, refused), for the metrics endpoint.
        self.admissions: Counter[str] = Counter()
        self._lock = threading.RLock()
        self._program: tuple[p4info_pb2.P4Info, bytes] | None = None
        self._loaded = False
        #: Jobs whose pending delete or activation failed and was logged (``finish_pending``).
        self._pending_warned: set[int] = set()
        #: The cookie this controller pushes its pipeline with (from the program: the same across restarts).
        self.pipeline_cookie = 0
        #: Moves of running jobs' slots toward their fair shares (moves.py), and the endpoint the workers follow
        #: them at (the worker API's bound address; None: not serving one).
        self.moves = Moves(self)
        self.worker_endpoint: Endpoint | None = None

    @property
    def lock(self) -> threading.RLock:
        """The lock every change of the database, the allocator and the switches is made under."""
        return self._lock

    @property
    def sessions(self) -> dict[str, SwitchSession]:
        return self.fabric.sessions

    def session(self, switch: str | None) -> SwitchSession:
        return self.sessions[switch] if switch is not None else next(iter(self.sessions.values()))

    # -- start-up and the switches' comings and goings --------------------------
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
        for session in self.sessions.values():  # entries are named through our P4Info, whoever pushed the pipeline
            if session.client.index is None:
                session.client.index = index

    def load(self) -> None:
        """Check the program and rebuild the slot allocator from the database (once; no switch)."""
        self.check_program()
        with self._lock:
            if self._loaded:
                return
            for job in self.store.all():
                if not job.uses_switch:
                    continue
                if isinstance(self.allocator, FabricAllocator):
                    try:
                        self.fabric.check_job(job)
                        self.allocator.reserve(_cell_ranges(job))
                    except (ConfigError, AllocationError) as err:
                        raise ServiceError("invalid_argument", f"{self.config.source}: {err}") from None
                else:
                    self.allocator.reserve(SlotRange(job.slot_base, job.cell_count))
            if not isinstance(self.allocator, FabricAllocator):
                self.moves.reserve_all()
            self._loaded = True

    def connect_switch(self, timeout: float | None = None, switch: str | None = None) -> str:
        """Become primary and make sure the switch runs our pipeline (pushing it only if not).

        ``timeout``: how long to wait for the switch to accept the connection (default: the client's).
        """
        self.check_program()
        self.session(switch).client.connect(timeout)
        return self.ensure_pipeline(switch)[0]

    def expected_cookie(self, switch: str | None = None) -> int | None:
        """The cookie of the pipeline found or pushed at the switch's last sync (None before the first)."""
        return self.session(switch).expected_cookie

    def ensure_pipeline(self, switch: str | None = None) -> tuple[str, bool]:
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
        session = self.session(switch)
        client = session.client
        before = session.expected_cookie
        cookie = client.get_pipeline_cookie()
        lost = before is not None and cookie != before
        if cookie is not None and cookie == self.pipeline_cookie:
            session.expected_cookie = cookie
            return "kept the pipeline already on the switch", lost
        current = client.get_pipeline_p4info() if cookie is not None else None
        if current is not None and not p4info_differences(expected, current):
            session.expected_cookie = cookie
            return "kept the pipeline already on the switch", lost
        client.set_pipeline(expected, device_config, cookie=self.pipeline_cookie)
        session.expected_cookie = self.pipeline_cookie
        return ("pushed the pipeline" if current is None else "replaced a different pipeline"), lost

    def recover(self, switch: str | None = None) -> ReconcileReport:
        """Rebuild the allocator from the database, finish interrupted steps, reconcile the switch.

        Needs a connected client (``connect_switch``); marks the switch available."""
        self.load()
        session = self.session(switch)
        with self._lock:
            report, _ = self._sync_jobs(session.name, reset_counters=False)
            session.unavailable_since = None
            self._finish_pending()
            return report

    def resync(self, switch: str | None = None) -> SwitchSync:
        """After (re)connecting: our pipeline on the switch, then every job as the database has it.

        Runs under the service lock, so no request interleaves: interrupted deletes are finished,
        the switch is reconciled both ways (what a restarted switch lost is re-installed, strays are
        removed), jobs caught ``installing`` are activated; if the switch had lost its state, the
        jobs' counter baselines are read again (its counters restarted from 0). Then the switch is
        available to requests again. Raises P4RuntimeError/ServiceError when the switch fails it
        (it stays unavailable; the caller retries). Under a topology, a job on several switches is
        activated (or its delete finished) once every one of them is in sync.
        """
        self.load()
        session = self.session(switch)
        with self._lock:
            pipeline, lost = self.ensure_pipeline(session.name)
            report, jobs = self._sync_jobs(session.name, reset_counters=lost)
            session.unavailable_since = None
            self._finish_pending()
            return SwitchSync(pipeline, lost, report, jobs)

    def _sync_jobs(self, switch: str, reset_counters: bool) -> tuple[ReconcileReport, int]:
        jobs = self.store.all()
        live = [j for j in jobs if j.state != "deleting"]
        # The switch is made to hold exactly the live jobs' share: a job being deleted is taken off here.
        report = self.fabric.reconcile(switch, live)
        on_switch = [j for j in live if switch in self.fabric.switches_of(j)]
        if reset_counters:
            for job in on_switch:
                self._set_counter_base(job, [switch])
        return report, len(on_switch)

    def finish_pending(self) -> None:
        """What the daemon retries every second: deletes and activations left by a failure of a switch that did
        not end its session (a refused write), once all of the job's switches are in sync again."""
        with self._lock:
            self._finish_pending(retry=True)

    def _finish_pending(self, retry: bool = False) -> None:
        """Finish what waits for switches now in sync: deletes (their rows and slots), activations."""
        for job in self.store.all():
            if not all(self.sessions[s].available for s in self.fabric.switches_of(job)):
                continue
            try:
                if job.state == "deleting":
                    self._finish_delete(job)
                elif job.state == "installing":
                    self._activate(job)
                self._pending_warned.discard(job.job_id)
            except (ServiceError, P4RuntimeError, OSError) as err:  # another of its switches: retried
                if not (self.fabric.is_tree or retry):
                    raise
                # Said once per job (retried every second): the operator sees it, the log is not flooded.
                (log.debug if job.job_id in self._pending_warned else log.warning)(
                    "job %d stays %s (retried every second): %s", job.job_id, job.state, err)
                self._pending_warned.add(job.job_id)

    def reconnect_switch(self, timeout: float, switch: str | None = None) -> None:
        """A fresh P4Runtime session (channel, StreamChannel, arbitration); P4RuntimeError unless primary.

        Under the service lock: no request is using the client while its channel is replaced."""
        session = self.session(switch)
        client = session.client
        with self._lock:
            client.reconnect(timeout)
        if not client.is_primary:
            primary = client.primary_election_id
            raise P4RuntimeError("PERMISSION_DENIED", f"not primary on {session.address}: another "
                                 f"controller is (election id {primary[1] if primary else '?'}; ours is "
                                 f"{self.config.election_id})")

    @property
    def switch_available(self) -> bool:
        """Whether every switch is connected and in sync (False from a loss until the next resync)."""
        return all(s.available for s in self.sessions.values())

    def mark_switch_unavailable(self, reason: str, switch: str | None = None) -> bool:
        """The switch is gone (or lost its state): refuse requests that need it until ``resync``; True if it
        was up."""
        session = self.session(switch)
        was_up = session.available
        if was_up:
            session.unavailable_reason = reason
            session.unavailable_since = time.monotonic()
        return was_up

    def _require_switch(self, what: str, switches: list[str] | None = None) -> None:
        """Refuse (``switch_unavailable``) unless ``switches`` (default: all) are connected and in sync."""
        for name in self.sessions if switches is None else switches:
            session = self.sessions[name]
            since = session.unavailable_since
            if since is None:
                continue
            which = f"switch {name} at {session.address}" if self.fabric.is_tree else f"switch at {session.address}"
            raise ServiceError("switch_unavailable", (
                f"cannot {what}: the {which} is unavailable ({session.unavailable_reason}; for "
                f"{time.monotonic() - since:.1f} s); the controller is reconnecting and re-installs every job "
                "when it is back: retry then (nothing was changed)"))

    # -- requests ----------------------------------------------------------
    def create_job(self, caller: Caller, request: JobRequest) -> dict:
        """Admit a job (best effort) and program the switch; returns the job and how it was admitted.

        With a distribution job (``JobRequest.distribution``) the answer also has a ``distribution``
        entry: that job and how it was admitted (both are created, or neither).
        """
        job = request.validated(self.config, caller.tenant)
        switches = self._tree_of(job)
        share = self._make_room(job) if switches is None else None
        with self._lock:
            self._require_switch("create a job", switches)
            job_id = self._free_job_id()
            dist_id = None if job.distribution is None else self._free_job_id(exclude={job_id})
            allocator = self.allocator if switches is None else TreeAllocator(self.allocator, switches)
            try:
                cap = tenant_cap(self.config, job.owner, self.store.all(), 1 if job.distribution is None else 2)
                if share is not None and (cap is None or share.cells < cap.cells):
                    cap = share
                admitted = admit(job, allocator, self.config.min_slots, cap)
            except ServiceError:
                self.admissions["refused"] += 1
                raise
            created = self._write_new_jobs(job, admitted, job_id, dist_id)
            for one in created:
                try:
                    self.fabric.install(one, self._others(one))
                except (P4RuntimeError, OSError) as err:
                    for undo in created:  # both or neither
                        self._abort_create(undo)
                    which = "a switch of its tree" if self.fabric.is_tree else "switch"
                    raise ServiceError("switch_error", f"{which} refused job {one.job_id}: {err}"
                                       + (" (no switch of its tree holds it)" if self.fabric.is_tree else "")
                                       ) from None
            activated = [self._activate(one) for one in created]
            answers = []
            for one, grant in zip(activated, admitted.grants):
                self.admissions[grant.admission] += 1
                answers.append({"job": self._view(one), "admission": grant.admission, "reason": grant.reason})
            return {**answers[0], **({"distribution": answers[1]} if len(answers) > 1 else {})}

    def _make_room(self, job: ValidJob) -> TenantCap | None:
        """Where running jobs move (moves.py): the new job's fair share, after the running jobs above theirs were
        asked to shrink toward it (waiting up to ``slots.move_wait_seconds``); None: no cap from it."""
        if not self.moves.enabled or job.request.mode != "allreduce" or job.distribution is not None:
            return None
        with self._lock:  # a create its tenant's quota refuses moves nobody
            tenant_cap(self.config, job.owner, self.store.all())
        want = job.slots * job.cells
        share = self.moves.make_room(want, job.cells, newcomer_weight(self, job.owner), self.config.move_wait_seconds)
        return TenantCap(share, f"its fair share of the switch ({share} cells)") if share < want else None

    def _tree_of(self, job: ValidJob) -> list[str] | None:
        """Under a topology, the switches of the job's tree, root first (None: one switch)."""
        if self.config.topology is None:
            return None
        try:
            return plan_tree(self.config.topology, [TreeWorker(w.rank, w.host, w.udp_port) for w in job.workers]
                             ).switches
        except ConfigError as err:
            raise ServiceError("invalid_argument", str(err)) from None

    def _write_new_jobs(self, job: ValidJob, admitted: Admission, job_id: int, dist_id: int | None,
                        ) -> list[JobRecord]:
        """The new job's row (and its distribution job's), state installing, in one transaction."""
        request, now = job.request, time.time()
        slots = admitted.job.slots
        try:
            with self.store.transaction() as conn:
                # The PS nodes take part in the switch groups only where the job has its switch aggregation.
                members = job.switch_members if admitted.switch_aggregation else []
                # Cells: the range's first cell is the job's slot base; it holds slot_count slots of its width.
                rows = [JobRecord(
                    job_id=job_id, tenant=job.owner, name=request.name, mode=admitted.mode, state="installing",
                    slot_base=slots.base if slots else 0, slot_count=admitted.job.slot_count,
                    slots_wanted=job.slots, slots_chosen_by=job.slots_chosen_by,
                    generation=self.store.next_generation(conn),
                    workers=[*job.workers, *members], ps_members=len(members),
                    ps=job.ps, lease_seconds=job.lease, lease_expires=now + job.lease, created=now,
                    note=admitted.job.note, update_mode=request.update_mode, delay_bound=request.delay_bound,
                    schedule=request.schedule, replicas=job.replicas, secret=jobsecret.new_secret(),
                    switch_aggregation=admitted.switch_aggregation, senders=request.senders, distribution=dist_id,
                    threads=request.threads if admitted.mode == "allreduce" else 1,
                    # In the switch or, admitted in fallback mode, at the PS (docs/hoststack.md).
                    deadline_ms=float(request.deadline_ms) if admitted.mode in ("allreduce", "fallback") else 0.0,
                    segments={switch: (r.base, r.count // job.cells) for switch, r in slots.ranges}
                    if isinstance(slots, TreeSlots) else {},
                    width=job.width,
                )]
                self.store.insert(conn, rows[0])
                if job.distribution is not None:
                    assert dist_id is not None and admitted.distribution is not None
                    dist_slots = admitted.distribution.slots
                    assert dist_slots is not None
                    rows.append(JobRecord(
                        job_id=dist_id, tenant=job.owner, name=f"{request.name}-distribution", mode="allreduce",
                        state="installing", slot_base=dist_slots.base, slot_count=admitted.distribution.slot_count,
                        slots_wanted=job.distribution_slots, generation=self.store.next_generation(conn),
                        # Its own --distribution-slots, or its job's slots (asked, or chosen for the job).
                        slots_chosen_by=ASKED if request.distribution_slots is not None
                        or job.slots_chosen_by == ASKED else f"its job's: {job.slots_chosen_by}",
                        workers=job.distribution, ps=None, lease_seconds=job.lease, lease_expires=now + job.lease,
                        created=now, note=admitted.distribution.note, secret=jobsecret.new_secret(),
                        senders=1 + len(job.replicas), distribution_of=job_id, width=job.width,
                    ))
                    self.store.insert(conn, rows[1])
        except BaseException:
            admitted.release(self.allocator)
            raise
        return rows

    def delete_job(self, caller: Caller, job_id: int, reason: str = "deleted") -> dict:
        """Delete a job (with its distribution job, if it has one); a distribution job goes only with its job."""
        with self._lock:
            job = self._owned(caller, job_id)
            self._require_switch(f"delete job {job_id}", self._switches_with(job))
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
        with self._lock:  # a view of one moment: no move commits between a job's row and its move's
            return [self._view(j) for j in self.store.all() if caller.is_admin or j.tenant == caller.tenant]

    def show_job(self, caller: Caller, job_id: int) -> dict:
        with self._lock:  # as list_jobs: never the old slot count beside "no move pending"
            job = self._owned(caller, job_id)
            view = self._view(job)
        if job.uses_switch:
            switches = self.fabric.switches_of(job)
            self._require_switch(f"read the counters of job {job_id}", switches)
            try:
                current = {s: self.fabric.read_counters(s, job.job_id) for s in switches}
            except P4RuntimeError as err:
                raise ServiceError("switch_error", f"cannot read counters of job {job_id}: {err}") from None
            if not self.fabric.is_tree:
                base = job.counter_base
                view["counters"] = {k: v - base.get(k, 0) for k, v in current[switches[0]].items()}
            else:  # per switch of its tree, and their sum
                view["switch_counters"] = {s: {k: v - job.counter_base.get(s, {}).get(k, 0) for k, v in c.items()}
                                           for s, c in current.items()}
                view["counters"] = {k: sum(c[k] for c in view["switch_counters"].values())
                                    for k in dp.JOB_COUNTERS}
        return view

    def _switches_with(self, job: JobRecord) -> list[str] | None:
        """The switches a delete of ``job`` needs: under a topology those of its tree (a fallback job's none);
        None, every switch, without one (the one switch, as for any request)."""
        return self.fabric.switches_of(job) if self.fabric.is_tree else None

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
        """Rank ``rank``'s config of the job, or its distribution job's, or a PS node's (``worker_configs.py``)."""
        job = self._owned(caller, job_id)
        config = worker_configs.requested(self.config, self.fabric, job, self._distribution_job(job),
                                          self._served_job(job), rank, distribution, ps_node)
        if self.worker_endpoint is not None and config.job_id == job.job_id and self.moves.why_not(job) is None:
            config = replace(config, controller=self.worker_endpoint)  # its workers follow the job's moves
        elif self.worker_endpoint is not None and distribution and rank is not None and not self.fabric.is_tree:
            config = replace(config, controller=self.worker_endpoint)  # a receiver may leave and join its group
        return config

    def set_receiving(self, job_id: int, rank: int, receiving: bool) -> dict:
        """A distribution job's receiver ``rank`` leaves its multicast group (``receiving`` false: the switch copies
        it no version) or joins it again; kept in the store, so a restarted controller keeps it. Asked by the
        receiver itself through the worker endpoint (docs/mlfabric.md)."""
        with self._lock:
            job = self.store.get(job_id)
            if job is None or not job.senders or job.distribution_of is None:
                raise ValueError(f"job {job_id} is no distribution job: only its receivers leave and join")
            if self.fabric.is_tree:
                raise ValueError("receivers do not leave a distribution job under a tree of switches")
            receivers = len(job.workers) - job.senders
            if not 0 <= rank < receivers:
                raise ValueError(f"rank {rank} is no receiver of job {job_id} (0..{receivers - 1})")
            left = set(job.left_receivers)
            left = left - {rank} if receiving else left | {rank}
            applied = True
            if sorted(left) != sorted(job.left_receivers):
                self.store.set_left_receivers(job_id, sorted(left))
                job = self.store.get(job_id)
                assert job is not None
                try:
                    self.fabric.install(job, self._others(job))
                except (P4RuntimeError, OSError) as err:  # the store has it: the next reconcile puts it there
                    log.warning("job %d: receiver %d %s; the switch is not reachable now: %s", job_id, rank,
                                "joins" if receiving else "leaves", err)
                    applied = False
                log.info("job %d: receiver %d %s its multicast group (left now: %s)", job_id, rank,
                         "joined" if receiving else "left", sorted(left))
            return {"receiving": rank not in left, "left": sorted(left), "applied": applied}

    def reap_expired(self, now: float | None = None) -> list[int]:
        """Delete every job whose lease ran out; returns their ids.

        A distribution job goes with its job (their leases are renewed together). Nothing is reaped while
        the switch is unavailable: those jobs go once it is back (deleting needs the switch). Under a
        topology, a job waits only for the switches of its tree."""
        reaped = []
        for job in self.store.expired(time.time() if now is None else now):
            if self.store.get(job.job_id) is None:
                continue  # went with its job a moment ago
            if not all(self.sessions[s].available for s in self._switches_with(job) or self.sessions):
                continue
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
        switches = self.fabric.switches_of(job)
        missing = [s for s in switches if s not in job.counter_base] if self.fabric.is_tree else \
            (switches if not job.counter_base else [])
        if missing:
            self._set_counter_base(job, missing)
        self.store.set_state(job.job_id, "active")
        return self.store.get(job.job_id)

    def _set_counter_base(self, job: JobRecord, switches: list[str]) -> None:
        """Read the job's counters on ``switches`` as its baseline (they count from the switch's start)."""
        if not switches:
            return
        if self.fabric.is_tree:
            base = {**job.counter_base, **{s: self.fabric.read_counters(s, job.job_id) for s in switches}}
        else:
            base = self.fabric.read_counters(switches[0], job.job_id)
        self.store.set_counter_base(job.job_id, base)
        job.counter_base = base

    def _release_slots(self, job: JobRecord) -> None:
        if not job.uses_switch:
            return
        if isinstance(self.allocator, FabricAllocator):
            self.allocator.release(_cell_ranges(job))
        else:
            self.allocator.release(SlotRange(job.slot_base, job.cell_count))

    def _others(self, job: JobRecord) -> list[JobRecord]:
        return [j for j in self.store.all() if j.job_id != job.job_id]

    def _abort_create(self, job: JobRecord) -> None:
        try:
            self.fabric.remove(job, self._others(job))
        except (P4RuntimeError, OSError) as err:
            log.warning("cleanup after failed create of job %d: %s", job.job_id, err)
        self.moves.forget(job)
        self.store.remove(job.job_id)
        self._release_slots(job)

    def _finish_delete(self, job: JobRecord) -> None:
        """Remove the job from its switches, then the database, then free its slots."""
        try:
            self.fabric.remove(job, self._others(job))
        except (P4RuntimeError, OSError) as err:
            raise ServiceError("switch_error", f"cannot remove job {job.job_id} from the switch "
                               f"(it stays marked deleting and is retried when the switch is back and on restart): "
                               f"{err}") from None
        self.moves.forget(job)
        self.store.remove(job.job_id)
        self._release_slots(job)

    def _free_job_id(self, exclude: set[int] | frozenset[int] = frozenset()) -> int:
        used = {j.job_id for j in self.store.all()} | exclude
        for job_id in range(FIRST_JOB_ID, self.max_jobs or 1024):
            if job_id not in used:
                return job_id
        raise ServiceError("capacity_exhausted", f"all {len(used)} job ids are in use")

    def _owned(self, caller: Caller, job_id: int) -> JobRecord:
        job = self.store.get(job_id)
        # Another tenant's job is reported exactly like a missing one: no probing.
        if job is None or not (caller.is_admin or job.tenant == caller.tenant):
            raise ServiceError("not_found", f"no job {job_id}")
        return job

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
        # The cells it holds (a narrow job's slots): slot_base .. slot_base + slot_count * cells - 1.
        view["slots"] = f"{job.slot_base}..{job.slot_base + job.cell_count - 1}" if job.slot_count else "-"
        view["cells"] = job.cell_count
        # What its tenant's jobs hold together, and the tenant's limit (quota or fair share; None: none).
        limit = tenant_limit(self.config, job.tenant)
        view["tenant_cells"] = tenant_cells(job.tenant, self.store.all())
        view["tenant_limit_cells"] = None if limit is None else limit[0]
        view["tenant_limit"] = None if limit is None else limit[1]
        if self.moves.enabled and job.uses_switch:
            view.update(self.moves.describe(job))
        return view


def _cell_ranges(job: JobRecord) -> dict[str, SlotRange]:
    """A tree job's cells on each switch of its tree (its segments count its slots)."""
    return {switch: SlotRange(base, count * job.cells) for switch, (base, count) in job.segments.items()}
