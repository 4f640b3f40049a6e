"""What a job create asks for (``JobRequest``), checked in one place, and what the controller grants it.

``JobRequest.validated`` checks a request against the controller's config (tenant, hosts, parameter
servers, the MLfabric and distribution options) and resolves its endpoints; ``admit`` then decides,
from the free slots, how the job (and its distribution job) is admitted: full, partial or fallback.
Neither touches the database or the switch: that is the job service's (``service.py``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from netagg import wire
from netagg.controller.allocator import SlotAllocator, SlotRange, TreeAllocator, TreeSlots
from netagg.controller.config import ControllerConfig
from netagg.controller.errors import ServiceError
from netagg.controller.sizing import ASKED, SlotChoice, choose_slots
from netagg.controller.store import JobRecord, PsEndpoint, WorkerEndpoint
from netagg.jobconfig import SCHEDULES, UPDATE_MODES, ConfigError, check_deadline_ms

MODES = ("allreduce", "ps", "fallback")


def _bad(message: str) -> ServiceError:
    return ServiceError("invalid_argument", message)


@dataclass(frozen=True)
class JobRequest:
    """A job create as asked (the API's ``create`` arguments): endpoints as text, options unchecked.

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
    ``slots``), linked to this one: created, renewed and deleted with it, or not at all.
    ``switch_ps`` (with ``switch_aggregation``): one endpoint per PS node (the primary, then the replicas), on
    that node's host, where it takes part in the job's switch groups: the job's last ranks, so that each
    group's sum reaches the PS from the switch and no worker pushes it (docs/mlfabric.md).

    ``width``: values per packet, 64 or 256 (docs/protocol.md, "Wide packets"); None: the switch target's
    default (``config.default_width``). ``slots`` counts the job's slots of that width: each takes
    ``wire.cells_of(width)`` cells of switch memory; None: the controller chooses them from the links of
    the job's hosts (``sizing.choose_slots``; the job's ``slots_chosen_by`` says how). A distribution job
    has its job's width, and (without ``distribution_slots``) its job's slots.
    """

    name: str
    workers: Sequence[str]
    slots: int | None = None
    mode: str = "allreduce"
    ps: str | None = None
    lease_seconds: float | None = None
    tenant: str | None = None
    update_mode: str = "sync"
    delay_bound: int | None = None
    schedule: str = "fifo"
    replicas: int | None = None
    replica_ps: Sequence[str] | None = None
    switch_aggregation: bool = False
    senders: int = 0
    #: Processes per worker over its share of the job's slots (hoststack/threads.py); mode allreduce.
    threads: int = 1
    distribution: Sequence[str] | None = None
    distribution_ps: Sequence[str] | None = None
    distribution_slots: int | None = None
    switch_ps: Sequence[str] | None = None
    width: int | None = None
    #: Deadline allreduce (docs/hoststack.md), opt-in: milliseconds after which every rank's gradient allreduce
    #: closes its rounds (WorkerConfig.deadline_ms); 0: exact. A plain allreduce job on one switch, threads 1.
    deadline_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("workers", "replica_ps", "distribution", "distribution_ps", "switch_ps"):  # JSON lists: frozen
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    def to_args(self) -> dict[str, Any]:
        """The API's ``create`` arguments: name, workers, slots, and the options that are not the default
        (so an older controller still accepts a plain create)."""
        args: dict[str, Any] = {}
        for one in dataclasses.fields(self):
            value = getattr(self, one.name)
            if one.default is dataclasses.MISSING or value != one.default:
                args[one.name] = list(value) if isinstance(value, tuple) else value
        return args

    def validated(self, config: ControllerConfig, caller_tenant: str | None) -> ValidJob:
        """Check the request for a caller (tenant None: the admin); the endpoints resolved."""
        owner = _owner(config, caller_tenant, self.tenant)
        workers = _parse_workers(config, self.workers)
        ps = _parse_ps(config, self.ps) if self.ps else None
        replicas = self._replica_endpoints(config, ps)
        if self.mode not in MODES:
            raise _bad(f"mode {self.mode!r} is not allreduce, ps or fallback")
        if not isinstance(self.switch_aggregation, bool):
            raise _bad(f"switch aggregation must be true or false, got {self.switch_aggregation!r}")
        senders = self.senders
        if not isinstance(senders, int) or isinstance(senders, bool) or not 0 <= senders < len(workers):
            raise _bad(f"senders must be an integer in 0..{len(workers) - 1}, got {senders!r}")
        if senders and self.mode != "allreduce":
            raise _bad("--senders needs --mode allreduce")
        threads = self.threads
        if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 64:
            raise _bad(f"threads must be an integer in 1..64, got {threads!r}")
        if threads > 1 and (self.mode != "allreduce" or senders or self.switch_aggregation):
            raise _bad("--threads above 1 needs --mode allreduce (not a one-way job, not --switch-aggregation)")
        try:
            check_deadline_ms(self.deadline_ms, "deadline_ms")
        except ConfigError as err:
            raise _bad(str(err)) from None
        if self.deadline_ms and (self.mode not in ("allreduce", "fallback") or threads > 1 or senders
                                 or self.switch_aggregation or config.topology is not None):
            raise _bad("--deadline-ms needs a plain allreduce job on one switch or at its PS (--mode allreduce or "
                       "fallback, --threads 1, not one-way, not --switch-aggregation, no topology: a round with an "
                       "up link cannot be closed)")
        if self.switch_aggregation and (self.schedule != "mlfabric" or self.mode != "allreduce"):
            raise _bad("--switch-aggregation needs --schedule mlfabric and --mode allreduce (the group's sums "
                       "go back to its members)")
        if self.mode in ("ps", "fallback") and ps is None:
            raise _bad(f"mode {self.mode} needs --ps")
        if self.slots is not None and (not isinstance(self.slots, int) or isinstance(self.slots, bool)
                                       or self.slots < 1):
            raise _bad(f"slots must be >= 1, got {self.slots}")
        width = self._width(config)
        if config.topology is not None:
            self._check_for_tree()
        distribution = self._distribution_members(config, workers, ps, replicas)
        switch_members = self._switch_members(config, workers, ps, replicas, distribution)
        lease = config.default_lease_seconds if self.lease_seconds is None else self.lease_seconds
        if lease <= 0:
            raise _bad("lease must be > 0 seconds")
        if self.slots is None:  # the controller's choice, from the links of the job's hosts
            hosts = {w.host for w in [*workers, *switch_members]}
            if self.mode in ("ps", "fallback") and ps is not None:
                hosts.add(ps.host)
            choice = choose_slots([config.hosts[h].link_mbit for h in sorted(hosts)], width, config.target_rtt_ms,
                                  config.min_slots, config.slot_capacity)
        else:
            choice = SlotChoice(self.slots, ASKED)
        return ValidJob(self, owner, workers, ps, replicas, distribution,
                        choice.slots if self.distribution_slots is None else self.distribution_slots, lease,
                        switch_members, width, choice.slots, choice.chosen_by)

    def _width(self, config: ControllerConfig) -> int:
        """The job's width: asked, or the switch target's default."""
        if self.width is None:
            return config.default_width
        if isinstance(self.width, bool) or not isinstance(self.width, int) or self.width not in wire.WIDTH_CODES:
            raise _bad(f"width must be one of {', '.join(map(str, sorted(wire.WIDTH_CODES)))} (values per packet), "
                       f"got {self.width!r}")
        return self.width

    def _check_for_tree(self) -> None:
        """A controller of a tree of switches (docs/hierarchy.md) runs synchronous allreduce jobs, with a PS only
        to fall back to when the switches have no slots; the rest needs one switch."""
        unsupported = [option for option, asked in (
            ("--mode ps", self.mode == "ps"), ("--sync async", self.update_mode != "sync"),
            ("--switch-aggregation", self.switch_aggregation), ("--senders", bool(self.senders)),
            ("--distribution", self.distribution is not None),
            ("--switch-ps", self.switch_ps is not None),
            ("--replicas", bool(self.replicas) or bool(self.replica_ps))) if asked]
        if self.ps is not None and len(self.workers) > wire.MAX_WORKERS:
            unsupported.append(f"--ps with more than {wire.MAX_WORKERS} workers (a PS serves one bitmap word)")
        if unsupported:
            raise _bad(f"{', '.join(unsupported)}: not on a controller of a tree of switches (topology:) yet; "
                       "it runs allreduce jobs, with --ps to fall back to (docs/hierarchy.md)")

    def _switch_members(self, config: ControllerConfig, workers: list[WorkerEndpoint], ps: PsEndpoint | None,
                        replicas: list[PsEndpoint], distribution: list[WorkerEndpoint] | None,
                        ) -> list[WorkerEndpoint]:
        """Check ``switch_ps``; returns the PS nodes' ranks of the job (after the workers'), or []."""
        if self.switch_ps is None:
            return []
        texts = self.switch_ps
        if isinstance(texts, str) or not isinstance(texts, list | tuple) or not all(isinstance(t, str) for t in texts):
            raise _bad(f"switch ps: expected a list of HOST:UDP_PORT, got {texts!r}")
        if not self.switch_aggregation or ps is None:
            raise _bad("--switch-ps needs --switch-aggregation and --ps (the PS takes part in the switch groups)")
        chain = [ps, *replicas]
        if len(texts) != len(chain):
            raise _bad(f"--switch-ps names {len(texts)} endpoint(s) for {len(chain)} PS node(s) (the primary"
                       + (f", then its {len(replicas)} replica(s))" if replicas else ")"))
        if len(workers) + len(chain) > wire.MAX_WORKERS:
            raise _bad(f"the job would have {len(workers) + len(chain)} ranks (workers and PS nodes), more than "
                       f"{wire.MAX_WORKERS}")
        members = []
        for node, (text, owner) in enumerate(zip(texts, chain)):
            members.append(_endpoint_on_host(config, text, f"switch endpoint of PS node {node}",
                                             len(workers) + node, owner.ip))
        taken = [(w.ip, w.udp_port) for w in workers] + [(p.ip, p.udp_port) for p in chain] + \
            [(d.ip, d.udp_port) for d in distribution or []]
        addresses = [(m.ip, m.udp_port) for m in members]
        if len(set(addresses)) != len(addresses) or set(addresses) & set(taken):
            raise _bad("each --switch-ps endpoint must be an address and UDP port of its own (not a worker's, "
                       "a PS's, a distribution endpoint or another PS node's)")
        return members

    def _replica_endpoints(self, config: ControllerConfig, ps: PsEndpoint | None) -> list[PsEndpoint]:
        """Check the MLfabric options; returns the replica endpoints (named, or the first free configured PSs)."""
        update_mode, delay_bound, replicas = self.update_mode, self.delay_bound, self.replicas
        if update_mode not in UPDATE_MODES:
            raise _bad(f"update mode {update_mode!r} is not one of {', '.join(UPDATE_MODES)}")
        if self.schedule not in SCHEDULES:
            raise _bad(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if delay_bound is not None and (not isinstance(delay_bound, int) or isinstance(delay_bound, bool)
                                        or delay_bound < 0):
            raise _bad(f"delay bound must be an integer >= 0, got {delay_bound!r}")
        if delay_bound is not None and update_mode != "async":
            raise _bad("a delay bound needs --sync async")
        if self.schedule != "fifo" and update_mode != "async":
            raise _bad(f"schedule {self.schedule} needs --sync async")
        if update_mode == "async" and ps is None:
            raise _bad("--sync async needs --ps (the parameter server applies the updates)")
        named = [_parse_ps(config, text) for text in (self.replica_ps or [])]
        if replicas is not None and (not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0):
            raise _bad(f"replicas must be an integer >= 0, got {replicas!r}")
        count = len(named) if replicas is None else replicas
        if named and count != len(named):
            raise _bad(f"--replicas {count} but {len(named)} replica endpoint(s) named")
        if count and ps is None:
            raise _bad("replicas need --ps (the primary parameter server)")
        if count and not named:
            for candidate in config.parameter_servers.values():
                endpoint = PsEndpoint(candidate.host, config.hosts[candidate.host].ip, candidate.udp_port)
                if (endpoint.ip, endpoint.udp_port) != (ps.ip, ps.udp_port) and len(named) < count:
                    named.append(endpoint)
            if len(named) < count:
                raise _bad(f"--replicas {count}: only {len(named)} configured parameter server(s) besides the "
                           f"primary; name them with --replica-ps")
        addresses = [(p.ip, p.udp_port) for p in [ps, *named] if p is not None]
        if len(set(addresses)) != len(addresses):
            raise _bad("the primary and its replicas must be distinct endpoints")
        return named

    def _distribution_members(self, config: ControllerConfig, workers: list[WorkerEndpoint],
                              ps: PsEndpoint | None, replicas: list[PsEndpoint]) -> list[WorkerEndpoint] | None:
        """Check the distribution options; returns the distribution job's ranks (the workers' endpoints,
        then the PS chain's), or None without ``distribution``."""
        def names(value: object, what: str) -> list[str]:
            if isinstance(value, str) or not isinstance(value, list | tuple) or \
                    not all(isinstance(v, str) for v in value):
                raise _bad(f"{what}: expected a list of HOST:UDP_PORT, got {value!r}")
            return list(value)

        distribution_ps, distribution_slots = self.distribution_ps, self.distribution_slots
        if self.distribution is None:
            for option, value in (("--distribution-ps", distribution_ps), ("--distribution-slots", distribution_slots)):
                if value is not None:
                    raise _bad(f"{option} needs --distribution (the workers' endpoints for model versions)")
            return None
        receivers = names(self.distribution, "distribution")
        if self.update_mode != "async" or ps is None:
            raise _bad("--distribution needs --sync async and --ps (the PS chain sends the model versions)")
        if self.senders:
            raise _bad("--distribution and --senders do not go together (the distribution job is the one-way job)")
        chain = [ps, *replicas]
        chain_text = "the primary" + (f", then its {len(replicas)} replica(s)" if replicas else "")
        if len(receivers) != len(workers):
            raise _bad(f"--distribution names {len(receivers)} endpoint(s) for {len(workers)} worker(s): "
                       "one per worker, in rank order")
        if distribution_ps is None:
            raise _bad(f"--distribution needs --distribution-ps: one endpoint per PS node ({chain_text}), "
                       "where it sends the versions from")
        sending = names(distribution_ps, "distribution ps")
        if len(sending) != len(chain):
            raise _bad(f"--distribution-ps names {len(sending)} endpoint(s) for {len(chain)} PS node(s) "
                       f"({chain_text})")
        if distribution_slots is not None and (not isinstance(distribution_slots, int)
                                               or isinstance(distribution_slots, bool) or distribution_slots < 1):
            raise _bad(f"distribution slots must be an integer >= 1, got {distribution_slots!r}")
        if len(receivers) + len(sending) > wire.MAX_WORKERS:
            raise _bad(f"the distribution job would have {len(receivers) + len(sending)} ranks (workers and PS "
                       f"nodes), more than {wire.MAX_WORKERS}")
        members: list[WorkerEndpoint] = []
        for index, (text, owner) in enumerate([*zip(receivers, workers), *zip(sending, chain)]):
            node = index - len(receivers)
            what = f"distribution endpoint of worker {index}" if node < 0 else \
                f"distribution endpoint of PS node {node}"
            # the worker receives (the PS sends) the versions itself, from its own host
            members.append(_endpoint_on_host(config, text, what, index, owner.ip))
        addresses = [(m.ip, m.udp_port) for m in members]
        if len(set(addresses)) != len(addresses):
            raise _bad("two distribution endpoints share an address and UDP port")
        taken = {(w.ip, w.udp_port) for w in workers} | {(p.ip, p.udp_port) for p in chain}
        for member in members:
            if (member.ip, member.udp_port) in taken:
                raise _bad(f"distribution endpoint {member.ip}:{member.udp_port} is already one of the job's "
                           "(a worker's or a PS's UDP port)")
        return members


@dataclass(frozen=True)
class ValidJob:
    """A checked request: its owner, its endpoints resolved, its lease and distribution slots settled."""

    request: JobRequest
    owner: str
    workers: list[WorkerEndpoint]
    ps: PsEndpoint | None
    replicas: list[PsEndpoint]
    #: The distribution job's ranks (the workers' endpoints, then the PS chain's); None: no distribution job.
    distribution: list[WorkerEndpoint] | None
    distribution_slots: int
    lease: float
    #: The PS chain's ranks in the job's switch groups (``switch_ps``), after the workers'; [] without.
    switch_members: list[WorkerEndpoint] = dataclasses.field(default_factory=list)
    #: Values per packet, the request's or the target's default (its distribution job's too).
    width: int = wire.K
    #: The job's slots: the request's, or the controller's choice (``sizing.choose_slots``) when it names none;
    #: and how they were chosen (``asked``, ``link R Mbit/s x T ms`` or ``default ...``).
    slots: int = 0
    slots_chosen_by: str = ASKED

    @property
    def cells(self) -> int:
        """Cells of switch memory per slot."""
        return wire.cells_of(self.width)


@dataclass(frozen=True)
class Grant:
    """The cells one job gets (None: none, fallback mode), how it was admitted (full, partial, fallback), and
    its slots' size in cells (``slot_count`` of them fit)."""

    slots: SlotRange | TreeSlots | None
    admission: str
    reason: str
    cells: int = 1

    @property
    def note(self) -> str:
        return f"{self.admission}: {self.reason}"

    @property
    def slot_count(self) -> int:
        """The job's own slots in its range (0 in fallback mode)."""
        return self.slots.count // self.cells if self.slots else 0


@dataclass(frozen=True)
class Admission:
    """What a job is granted: its mode (fallback when it got no slots), its slots, its distribution job's."""

    mode: str
    switch_aggregation: bool
    job: Grant
    distribution: Grant | None

    @property
    def grants(self) -> tuple[Grant, ...]:
        """The job's grant, then its distribution job's (if it has one)."""
        return (self.job,) if self.distribution is None else (self.job, self.distribution)

    def release(self, allocator: SlotAllocator | TreeAllocator) -> None:
        """Give the slots back (the create did not go through)."""
        for grant in self.grants:
            if grant.slots:
                allocator.release(grant.slots)


@dataclass(frozen=True)
class TenantCap:
    """The most cells a tenant's new job may take (its quota and fair share less what its jobs hold), and why."""

    cells: int
    why: str


def tenant_cap(config: ControllerConfig, tenant: str, jobs: list[JobRecord], new_jobs: int = 1) -> TenantCap | None:
    """What ``tenant`` may still take for ``new_jobs`` more jobs, given the ``jobs`` that exist (None: no limit).

    Raises ServiceError ``quota_exceeded`` when the tenant already runs its ``max_jobs``."""
    limits = config.tenant_limits.get(tenant)
    mine = [j for j in jobs if j.tenant == tenant]
    if limits is not None and limits.max_jobs is not None and len(mine) + new_jobs > limits.max_jobs:
        raise ServiceError("quota_exceeded", (
            f"tenant {tenant!r} has {len(mine)} job(s) and may have {limits.max_jobs} (tenants.{tenant}.max_jobs); "
            "delete one first"))
    found = tenant_limit(config, tenant)
    if found is None:
        return None
    limit, kind = found
    held = tenant_cells(tenant, jobs)
    return TenantCap(max(0, limit - held), f"tenant {tenant!r}'s {kind} of {limit} cells, {held} held by its jobs")


def tenant_limit(config: ControllerConfig, tenant: str) -> tuple[int, str] | None:
    """The cells ``tenant``'s jobs may hold together (the smaller of its ``max_cells`` and, with
    ``slots.fair_share``, its weighted share) and which one it is (``quota`` or ``fair share``); None: no
    limit."""
    limits = config.tenant_limits.get(tenant)
    caps = []
    if limits is not None and limits.max_cells is not None:
        caps.append((limits.max_cells, "quota"))
    if config.fair_share and len(config.tenant_limits) > 1:
        caps.append((config.tenant_share(tenant), "fair share"))
    return min(caps) if caps else None


def tenant_cells(tenant: str, jobs: list[JobRecord]) -> int:
    """The switch cells ``tenant``'s jobs hold."""
    return sum(j.cell_count for j in jobs if j.tenant == tenant and j.uses_switch)


def admit(job: ValidJob, allocator: SlotAllocator | TreeAllocator, min_slots: int,
          cap: TenantCap | None = None) -> Admission:
    """Take the job's cells (and its distribution job's) from the allocator: best effort.

    A job of ``slots`` slots (``job.slots``: asked, or chosen by the controller) of width k needs
    ``slots * cells_of(k)`` contiguous cells. Fewer slots than that (a whole number of them, at least
    ``min_slots``: a minimum in the job's slots) is a partial admission;
    none at all is fallback mode through the PS, or, without a PS, a refusal (ServiceError
    capacity_exhausted). A distribution job (of the same width) goes through the switch or not at all:
    without cells for it, neither job is created. ``cap``: the tenant's quota and fair share (:func:`tenant_cap`):
    the job gets at most that many cells (its distribution job's count too); a job it leaves no room for falls
    back to its PS, or is refused (``quota_exceeded``).
    """
    request = job.request
    slots, mode, switch_aggregation = job.slots, request.mode, request.switch_aggregation
    cells = job.cells
    taken: SlotRange | TreeSlots | None = None
    allowed = slots if cap is None else min(slots, cap.cells // cells)
    if mode == "fallback":
        grant = Grant(None, "full", "fallback mode asked for", cells)
    else:
        if allowed < min(min_slots, slots):  # the tenant's quota or share leaves no room
            need = _need(min(min_slots, slots), job.width)
            if job.ps is None:
                raise ServiceError("quota_exceeded", f"{cap.why}: no room for {need}, and no --ps to fall back to")
            taken = None
            why = f"{cap.why}: no room for {need}"
        else:
            taken = allocator.allocate(allowed * cells, min(min_slots, allowed) * cells, unit=cells)
            why = (f"no range of {_need(min(min_slots, slots), job.width)} (largest free: "
                   f"{_free(allocator, job.width)})")
        if taken is None:
            if job.ps is None:
                raise ServiceError("capacity_exhausted", f"{why} and no --ps to fall back to")
            mode = "fallback"
            reason = f"{why}; workers aggregate through the PS"
            if switch_aggregation:
                switch_aggregation = False
                reason += "; no switch aggregation without slots"
            grant = Grant(None, "fallback", reason, cells)
        else:
            capped = cap is not None and taken.count // cells == allowed < slots  # the cap, not the free range
            grant = _slots_grant(taken, slots, cells, job.slots_chosen_by, cap.why if capped else None)
    distribution = None
    if job.distribution is not None:
        want = job.distribution_slots
        if cap is not None:
            left = cap.cells - (taken.count if taken else 0)
            if left // cells < min(min_slots, want):
                if taken:
                    allocator.release(taken)
                raise ServiceError("quota_exceeded", (
                    f"{cap.why}: no room for the distribution job's {_need(min(min_slots, want), job.width)}; "
                    "neither job was created"))
            want = min(want, left // cells)
        dist_taken = allocator.allocate(want * cells, min(min_slots, want) * cells, unit=cells)
        if dist_taken is None:
            if taken:
                allocator.release(taken)
            raise ServiceError("capacity_exhausted", (
                f"no range of {_need(min(min_slots, want), job.width)} for the distribution "
                f"job (largest free: {_free(allocator, job.width)}); neither job was created"))
        distribution = _slots_grant(dist_taken, want, cells)
    return Admission(mode, switch_aggregation, grant, distribution)


def _need(slots: int, width: int) -> str:
    """``slots`` free slots of ``width``, said in slots and (for a wide job) cells."""
    cells = wire.cells_of(width)
    return f"{slots}+ free slots" if cells == 1 else f"{slots}+ free slots of width {width} ({slots * cells}+ cells)"


def _free(allocator: SlotAllocator | TreeAllocator, width: int) -> str:
    largest = allocator.largest_free()
    cells = wire.cells_of(width)
    return str(largest) if cells == 1 else f"{largest} cells, {largest // cells} slots of width {width}"


def _slots_grant(taken: SlotRange | TreeSlots, wanted: int, cells: int, chosen_by: str = ASKED,
                 capped_by: str | None = None) -> Grant:
    got = taken.count // cells
    if got < wanted:
        detail = (capped_by or "largest free range") + ("; chosen by the controller" if chosen_by != ASKED else "")
        return Grant(taken, "partial", f"{got} of {wanted} slots ({detail}); fewer packets in flight", cells)
    return Grant(taken, "full", f"{wanted} slots " + ("as asked" if chosen_by == ASKED else
                                                        "as chosen by the controller"), cells)


# -- checking names against the config ---------------------------------------------
def _owner(config: ControllerConfig, caller_tenant: str | None, tenant: str | None) -> str:
    if caller_tenant is None:  # the admin
        if not tenant:
            raise _bad("the admin must name the tenant (--tenant)")
        if tenant not in config.tenants.values():
            raise _bad(f"unknown tenant {tenant!r}")
        return tenant
    if tenant and tenant != caller_tenant:
        raise ServiceError("permission_denied", f"tenant {caller_tenant!r} cannot create jobs for {tenant!r}")
    return caller_tenant


def _resolve_host(config: ControllerConfig, text: str, what: str) -> tuple[str, str]:
    """A configured host name or IPv4 address -> (host name, ip)."""
    if text in config.hosts:
        return text, config.hosts[text].ip
    try:
        ip = str(ipaddress.IPv4Address(text))
    except ValueError:
        raise _bad(f"{what}: unknown host {text!r}") from None
    host = config.host_by_ip(ip)
    if host is None:
        raise _bad(f"{what}: {ip} is not a configured host")
    return host.name, ip


def _endpoint(config: ControllerConfig, text: str, what: str) -> tuple[str, str, int]:
    host_text, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _bad(f"{what}: expected HOST:UDP_PORT, got {text!r}")
    host, ip = _resolve_host(config, host_text, what)
    return host, ip, int(port_text)


def _endpoint_on_host(config: ControllerConfig, text: str, what: str, rank: int, owner_ip: str) -> WorkerEndpoint:
    """Rank ``rank``'s endpoint ``text``, which must be on its owner's host (``owner_ip``)."""
    host, ip, port = _endpoint(config, text, what)
    if ip != owner_ip:
        raise _bad(f"{what} ({ip}:{port}) is not on its host ({owner_ip})")
    return WorkerEndpoint(rank, host, ip, port)


def _parse_workers(config: ControllerConfig, workers: Sequence[str]) -> list[WorkerEndpoint]:
    # Over a tree of switches a job may outgrow one bitmap word: the tree's segments each hold 32 members.
    most = wire.MAX_WORKERS if config.topology is None else wire.MAX_JOB_WORKERS
    if isinstance(workers, str) or not isinstance(workers, list | tuple) or not 1 <= len(workers) <= most:
        raise _bad(f"a job has 1..{most} workers, got {len(workers) if isinstance(workers, list | tuple) else 0}")
    endpoints = []
    for rank, text in enumerate(workers):
        host, ip, port = _endpoint(config, text, f"worker {rank}")
        endpoints.append(WorkerEndpoint(rank, host, ip, port))
    if len({(w.ip, w.udp_port) for w in endpoints}) != len(endpoints):
        raise _bad("two workers share an address and UDP port")
    return endpoints


def _parse_ps(config: ControllerConfig, text: str) -> PsEndpoint:
    if text in config.parameter_servers:
        ps = config.parameter_servers[text]
        return PsEndpoint(ps.host, config.hosts[ps.host].ip, ps.udp_port)
    host, ip, port = _endpoint(config, text, "ps")
    return PsEndpoint(host, ip, port)
