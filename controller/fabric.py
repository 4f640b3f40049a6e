"""The switches a controller drives: one (``switch:``) or every switch of a tree (``topology:``).

Each switch has a :class:`SwitchSession`: its P4Runtime client, the cookie of the pipeline found or pushed
at its last sync, and since when it is unavailable to requests. :class:`Fabric` says what each switch
must hold for the jobs of the database and installs or removes one job's share:

* one switch: ``switch_programmer`` as always (a job's entries and group; the hosts' routes and bindings);
* a tree (docs/hierarchy.md): a job's tree is ``topology.plan_tree`` of its workers, its share of each
  switch ``topology.tree_state`` with the same job id and generation everywhere and the slots of its
  ``segments``; every switch also holds ``topology.fabric_state`` (routes across the tree, source
  bindings). A job is installed on all of its switches or none (``tree_programmer``: root first, the
  others put back when one refuses) and removed leaves first.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from netagg.controller.config import ControllerConfig
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.controller.store import JobRecord
from netagg.controller.switch_programmer import (
    DesiredState,
    ReconcileReport,
    SwitchProgrammer,
    desired_state,
    read_job_counters,
    reconcile_state,
)
from netagg.controller.topology import (
    Allocation,
    TreePlan,
    TreeWorker,
    fabric_state,
    plan_tree,
    tree_state,
)
from netagg.controller.tree_programmer import install_tree_job, remove_tree_job
from netagg.jobconfig import ConfigError

#: The name of the one switch of a controller without a topology.
ONE_SWITCH = "switch"


@dataclass
class SwitchSession:
    """One switch: its address, its P4Runtime client, and where the controller stands with it."""

    name: str
    address: str
    device_id: int
    client: P4RuntimeClient
    #: The cookie of the pipeline found or pushed at the last sync (None before the first).
    expected_cookie: int | None = None
    #: monotonic time since when the switch is unavailable to requests (None: connected and in sync).
    unavailable_since: float | None = field(default_factory=time.monotonic)
    unavailable_reason: str = "not connected yet"

    @property
    def available(self) -> bool:
        return self.unavailable_since is None


def tree_workers(job: JobRecord) -> list[TreeWorker]:
    return [TreeWorker(w.rank, w.host, w.udp_port) for w in job.workers]


class Fabric:
    """The controller's switches and what each must hold."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.topology = config.topology
        election = (0, config.election_id)
        if self.topology is None:
            self.sessions = {ONE_SWITCH: SwitchSession(ONE_SWITCH, config.grpc_address, config.device_id,
                                                       P4RuntimeClient(config.grpc_address, device_id=config.device_id,
                                                                       election_id=election))}
        else:  # the root first
            order = sorted(self.topology.switches, key=lambda s: (len(self.topology.path_to_root(s)), s))
            self.sessions = {name: SwitchSession(name, sw.grpc_address, sw.device_id,
                                                 P4RuntimeClient(sw.grpc_address, device_id=sw.device_id,
                                                                 election_id=election))
                             for name in order for sw in [self.topology.switches[name]]}
        self._programmer = SwitchProgrammer(self.sessions[ONE_SWITCH].client, config) \
            if self.topology is None else None

    @property
    def is_tree(self) -> bool:
        return self.topology is not None

    def close(self) -> None:
        for session in self.sessions.values():
            session.client.close()

    # -- a job's switches --------------------------------------------------------
    def plan(self, job: JobRecord) -> TreePlan:
        """The job's tree (under a topology)."""
        assert self.topology is not None
        return plan_tree(self.topology, tree_workers(job))

    def switches_of(self, job: JobRecord) -> list[str]:
        """The switches the job is on, root first (none for a fallback job)."""
        if not job.uses_switch:
            return []
        if not self.is_tree:
            return [ONE_SWITCH]
        order = list(self.sessions)  # the root first, then by depth
        return sorted(job.segments, key=order.index)

    def check_job(self, job: JobRecord) -> None:
        """Raise ConfigError when a stored tree job's segments are not the tree its workers have in the topology
        (the topology file changed under it)."""
        if not self.is_tree or not job.uses_switch:
            return
        plan = self.plan(job)
        if set(plan.segments) != set(job.segments):
            raise ConfigError(f"job {job.job_id}'s switches {sorted(job.segments)} are not its tree in "
                              f"{self.config.topology.source if self.topology else ''} ({plan.switches}): "
                              "the topology changed under it; restore the file, or delete the job first")

    def allocations(self, job: JobRecord) -> dict[str, Allocation]:
        return {switch: Allocation(job.job_id, base, count, job.generation, job.width)
                for switch, (base, count) in job.segments.items()}

    def job_share(self, job: JobRecord) -> dict[str, DesiredState]:
        """What each of the job's switches holds for it (under a topology)."""
        if not job.uses_switch:
            return {}
        return tree_state(self.topology, self.plan(job), self.allocations(job), tree_workers(job))

    # -- what each switch holds ----------------------------------------------------
    def desired(self, switches: Iterable[str], jobs: Iterable[JobRecord]) -> dict[str, DesiredState]:
        """Everything each of ``switches`` must hold for ``jobs`` (those being deleted left out); each job's
        tree computed once."""
        live = [j for j in jobs if j.state != "deleting"]
        if self.topology is None:
            state = desired_state(self.config, live)
            return {switch: state for switch in switches}
        fabric = fabric_state(self.topology)
        states = {switch: fabric[switch] for switch in switches}
        for job in live:
            here = [s for s in self.switches_of(job) if s in states]
            if not here:
                continue
            share = self.job_share(job)
            for switch in here:
                states[switch].entries.update(share[switch].entries)
                states[switch].groups.update(share[switch].groups)
        return states

    def reconcile(self, switch: str, jobs: Iterable[JobRecord]) -> ReconcileReport:
        """Make ``switch`` hold exactly what ``jobs`` need (both ways)."""
        if self._programmer is not None:
            return self._programmer.reconcile(jobs)
        return reconcile_state(self.sessions[switch].client, self.desired([switch], jobs)[switch])

    def install(self, job: JobRecord, others: list[JobRecord]) -> None:
        """Put the job on its switches, all or nothing (``others``: the other jobs, what the switches keep)."""
        if self._programmer is not None:
            self._programmer.install_job(job)
            return
        order = self.switches_of(job)
        install_tree_job(self.clients(order), self.desired(order, others), self.job_share(job), order)

    def remove(self, job: JobRecord, others: list[JobRecord]) -> None:
        """Take the job off its switches (leaves first); entries already gone are fine."""
        if self._programmer is not None:
            self._programmer.remove_job(job)
            return
        order = self.switches_of(job)
        remove_tree_job(self.clients(order), self.desired(order, [*others, job]), self.job_share(job), order)

    def clients(self, switches: Iterable[str]) -> dict[str, P4RuntimeClient]:
        return {s: self.sessions[s].client for s in switches}

    def read_counters(self, switch: str, job_id: int) -> dict[str, int]:
        """The job's packet counters on ``switch`` (absolute; the service subtracts the baseline)."""
        return read_job_counters(self.sessions[switch].client, job_id)
