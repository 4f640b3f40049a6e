"""What the switch must hold for the jobs in the database, and making it so over P4Runtime.

:func:`desired_state` turns jobs and hosts into table entries and multicast
groups; :class:`SwitchProgrammer` installs or removes one job's share, and
:meth:`SwitchProgrammer.reconcile` compares the switch with the desired state
both ways (re-installs what the switch lost, removes what no job owns).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

from netagg import dataplane as dp
from netagg import wire
from netagg.controller.config import ControllerConfig
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.controller.store import JobRecord

#: Tables the controller owns completely (anything else found there is removed). A controller of one switch
#: writes no up or down links (a tree of switches: controller/topology.py), so any it finds are strays.
MANAGED_TABLES = (dp.TABLE_JOBS, dp.TABLE_WORKERS, dp.TABLE_REPLICAS, dp.TABLE_ROUTES, dp.TABLE_SOURCES,
                  dp.TABLE_UP_LINKS, dp.TABLE_DOWN_LINKS)


@dataclass(frozen=True)
class Entry:
    """A table entry in comparable form: match and params as sorted (name, value) tuples."""

    table: str
    match: tuple[tuple[str, object], ...]
    action: str
    params: tuple[tuple[str, int], ...]

    @property
    def key(self) -> tuple[str, tuple[tuple[str, object], ...]]:
        return (self.table, self.match)

    @classmethod
    def make(cls, table: str, match: dict, action: str, params: dict) -> Entry:
        return cls(table, tuple(sorted(match.items())), action, tuple(sorted(params.items())))


@dataclass
class DesiredState:
    """Entries and multicast groups (group id -> sorted replicas)."""

    entries: dict[tuple, Entry] = field(default_factory=dict)
    groups: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)

    def add(self, entry: Entry) -> None:
        self.entries[entry.key] = entry


def ip_to_int(text: str) -> int:
    return int(ipaddress.IPv4Address(text))


def mac_to_int(text: str) -> int:
    return int(text.replace(":", ""), 16)


def job_state(config: ControllerConfig, job: JobRecord) -> DesiredState:
    """The entries and group one job needs (nothing for fallback jobs: they bypass the switch)."""
    state = DesiredState()
    if not job.uses_switch:
        return state
    # slot_base: the job's first cell; slot_count: its own slots; width: their width code (each slot spans
    # wire.cells_of(width) cells; docs/protocol.md, "Wide packets").
    state.add(Entry.make(dp.TABLE_JOBS, {"job_id": job.job_id}, dp.ACTION_SET_JOB, {
        "num_workers": len(job.workers), "slot_base": job.slot_base, "slot_count": job.slot_count,
        "mgid": job.job_id, "generation": job.generation, "width": wire.width_code(job.width),
    }))
    # A one-way job (senders > 0): only its last ranks send, the others only receive.
    for w in job.workers[len(job.workers) - job.senders if job.senders else 0:]:
        # keyed by the host's switch port too: no contributing under another host's address
        state.add(Entry.make(dp.TABLE_WORKERS,
                             {"job_id": job.job_id, "ipv4_src": ip_to_int(w.ip), "udp_src": w.udp_port,
                              "ingress_port": config.hosts[w.host].port},
                             dp.ACTION_SET_WORKER, {"rank": w.rank, "worker_mask": 1 << w.rank}))
    if job.mode == "allreduce":  # every worker but the send-only last ranks
        receivers = [(w.rank + 1, w.host, w.ip, w.udp_port) for w in job.workers[:len(job.workers) - job.senders]]
    else:
        assert job.ps is not None
        receivers = [(1, job.ps.host, job.ps.ip, job.ps.udp_port)]
    replicas = []
    for rid, host_name, ip, udp_port in receivers:
        host = config.hosts[host_name]
        if not (job.senders and rid - 1 in job.left_receivers):  # one that left gets no copies; its entry stays
            replicas.append((host.port, rid))
        state.add(Entry.make(dp.TABLE_REPLICAS, {"mgid": job.job_id, "rid": rid}, dp.ACTION_SET_DESTINATION,
                             {"dst_mac": mac_to_int(host.mac), "dst_addr": ip_to_int(ip), "dst_port": udp_port}))
    state.groups[job.job_id] = tuple(sorted(replicas))
    return state


def source_entries(config: ControllerConfig) -> list[Entry]:
    """SourceGuard's entries: the aggregator address is the switch's alone; every host's address is bound
    to its switch port (so nobody poses as a PS, whose results workers accept in ps and fallback modes).

    An address shared by hosts on different ports, or the aggregator address when a host has it too (the
    loopback deployment, where every process is 127.0.0.1 behind one port), cannot be bound and is skipped.
    """
    ports_of: dict[str, set[int]] = {}
    for host in config.hosts.values():
        ports_of.setdefault(host.ip, set()).add(host.port)
    entries = []
    if config.aggregator_ip not in ports_of:
        entries.append(Entry.make(dp.TABLE_SOURCES, {"ipv4_src": ip_to_int(config.aggregator_ip)},
                                  dp.ACTION_SWITCH_ONLY, {}))
    for ip, ports in sorted(ports_of.items()):
        if len(ports) == 1 and ip != config.aggregator_ip:
            entries.append(Entry.make(dp.TABLE_SOURCES, {"ipv4_src": ip_to_int(ip)}, dp.ACTION_BIND_TO_PORT,
                                      {"port": next(iter(ports))}))
    return entries


def desired_state(config: ControllerConfig, jobs: Iterable[JobRecord]) -> DesiredState:
    """Routes and source bindings for every configured host plus the entries of every job not being deleted."""
    state = DesiredState()
    for host in config.hosts.values():
        state.add(Entry.make(dp.TABLE_ROUTES, {"ipv4_dst": (ip_to_int(host.ip), 32)}, dp.ACTION_FORWARD,
                             {"port": host.port, "dst_mac": mac_to_int(host.mac)}))
    for entry in source_entries(config):
        state.add(entry)
    for job in jobs:
        if job.state == "deleting":
            continue
        one = job_state(config, job)
        state.entries.update(one.entries)
        state.groups.update(one.groups)
    return state


@dataclass
class ReconcileReport:
    """What reconcile changed on the switch."""

    inserted: int = 0
    modified: int = 0
    deleted: int = 0
    groups_set: int = 0
    groups_deleted: int = 0

    @property
    def changed(self) -> bool:
        return any((self.inserted, self.modified, self.deleted, self.groups_set, self.groups_deleted))


def reconcile_state(client: P4RuntimeClient, desired: DesiredState,
                    tables: Iterable[str] = MANAGED_TABLES) -> ReconcileReport:
    """Make the switch hold exactly ``desired`` in ``tables`` and its multicast groups (both ways)."""
    actual = actual_entries(client, set(tables))
    report = ReconcileReport()
    for key, entry in actual.items():
        if key not in desired.entries:
            client.delete_entry(entry.table, dict(entry.match))
            report.deleted += 1
    for key, entry in desired.entries.items():
        current = actual.get(key)
        if current != entry:
            _put(client, entry, current)
            if current is None:
                report.inserted += 1
            else:
                report.modified += 1
    groups = {gid: tuple(sorted(r)) for gid, r in client.read_multicast_groups().items()}
    for gid in groups.keys() - desired.groups.keys():
        client.delete_multicast_group(gid)
        report.groups_deleted += 1
    for gid, replicas in desired.groups.items():
        if groups.get(gid) != replicas:
            client.set_multicast_group(gid, list(replicas))
            report.groups_set += 1
    return report


def _put(client: P4RuntimeClient, entry: Entry, current: Entry | None) -> None:
    if current == entry:
        return
    write = client.insert_entry if current is None else client.modify_entry
    write(entry.table, dict(entry.match), entry.action, dict(entry.params))


def actual_entries(client: P4RuntimeClient, tables: set[str]) -> dict[tuple, Entry]:
    """What the switch holds in ``tables``, as comparable entries."""
    found: dict[tuple, Entry] = {}
    for table in sorted(tables):
        for view in client.read_entries(table):
            entry = Entry.make(view.table, dict(view.match), view.action, dict(view.params))
            found[entry.key] = entry
    return found


def read_job_counters(client: P4RuntimeClient, job_id: int) -> dict[str, int]:
    """Packets counted per job counter on one switch (absolute; the daemon subtracts the job's baseline)."""
    return {short: client.read_counter(name, job_id)[0] for short, name in dp.JOB_COUNTERS.items()}


class SwitchProgrammer:
    """Installs and removes jobs' entries through one P4Runtime client."""

    def __init__(self, client: P4RuntimeClient, config: ControllerConfig) -> None:
        self.client = client
        self.config = config

    def install_job(self, job: JobRecord) -> None:
        """Insert (or overwrite) everything the job needs; the group last, the job entry first."""
        state = job_state(self.config, job)
        entries = list(state.entries.values())
        existing = self._actual_entries(tables={e.table for e in entries})
        for entry in entries:
            self._put(entry, existing.get(entry.key))
        for gid, replicas in state.groups.items():
            self.client.set_multicast_group(gid, list(replicas))

    def remove_job(self, job: JobRecord) -> None:
        """Delete the job's entries and group; entries already gone are fine."""
        state = job_state(self.config, job)
        existing = self._actual_entries(tables={e.table for e in state.entries.values()})
        for entry in state.entries.values():
            if entry.key in existing:
                self.client.delete_entry(entry.table, dict(entry.match))
        groups = self.client.read_multicast_groups()
        for gid in state.groups:
            if gid in groups:
                self.client.delete_multicast_group(gid)

    def reconcile(self, jobs: Iterable[JobRecord]) -> ReconcileReport:
        """Make the switch hold exactly the desired state of ``jobs`` (both ways)."""
        return reconcile_state(self.client, desired_state(self.config, jobs))

    def _put(self, entry: Entry, current: Entry | None) -> None:
        _put(self.client, entry, current)

    def _actual_entries(self, tables: set[str]) -> dict[tuple, Entry]:
        return actual_entries(self.client, tables)
