"""A tree of switches (docs/hierarchy.md): the topology file, a job's tree, and what each switch must hold.

``configs/topology.yaml`` names the switches (P4Runtime address, device id, aggregator address and
MAC), each non-root switch's link to its parent (its up port, and the parent's port facing it) and
the hosts (switch, port, address, MAC; optionally ``link_mbit``, the rate of the host's link, which
sizes a job's slots when its create names none: ``sizing.py``). :func:`load_topology` validates it.
:func:`plan_tree` turns a job's workers into one segment per switch of the job's tree: the switches
its workers hang off and their ancestors up to the lowest one they share (a job inside one rack is
one segment, as today).
:func:`tree_state` turns a plan and each segment's allocation (job id, slots, generation) into the
entries and multicast group every switch of the tree must hold; :func:`fabric_state` gives the entries
every switch holds whatever the jobs (routes across the tree, source bindings).

A segment's members are its workers and its child switches, in that order (workers by job rank,
switches by name), ranked 0 .. n-1 there; n is at most ``wire.MAX_WORKERS``. To its parent a switch is
a worker at its aggregator address and the tree port (``wire.NETAGG_TREE_UDP_PORT``) on the parent's
port facing it; its up link points at the parent's segment, its down link maps the parent's results
back to its own (protocol.md, "A tree of switches").
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netagg import dataplane as dp
from netagg import wire
from netagg.controller.config import link_mbit
from netagg.controller.switch_programmer import DesiredState, Entry, ip_to_int, mac_to_int
from netagg.jobconfig import ConfigError, Endpoint, WorkerConfig, read_yaml

_MAC = re.compile(r"^([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}$")
_ADDRESS = re.compile(r"^([\w.\-\[\]:]+:\d+|unix:/\S+)$")
_SWITCH_KEYS = {"grpc_address", "device_id", "aggregator", "parent"}
_PARENT_KEYS = {"switch", "up_port", "port"}
_HOST_KEYS = {"name", "switch", "port", "ip", "mac", "link_mbit"}


@dataclass(frozen=True)
class TopoSwitch:
    """One switch of the fabric; ``parent`` is None at the root."""

    name: str
    grpc_address: str
    device_id: int
    aggregator_ip: str
    aggregator_mac: str
    parent: str | None = None
    #: This switch's port toward its parent, and the parent's port toward it.
    up_port: int | None = None
    parent_port: int | None = None


@dataclass(frozen=True)
class TopoHost:
    """An end host on a switch port."""

    name: str
    switch: str
    port: int
    ip: str
    mac: str
    #: The rate of the host's link to its switch port, in Mbit/s; None: unknown (controller/config.py, HostConfig).
    link_mbit: float | None = None


@dataclass
class Topology:
    """Switches (a tree: every non-root switch names its parent) and hosts."""

    source: str
    switches: dict[str, TopoSwitch]
    hosts: dict[str, TopoHost]

    def path_to_root(self, switch: str) -> list[str]:
        """``switch``, its parent, ..., the root."""
        path = [switch]
        while (parent := self.switches[path[-1]].parent) is not None:
            path.append(parent)
        return path

    def host_by_ip(self, ip: str) -> TopoHost | None:
        return next((h for h in self.hosts.values() if h.ip == ip), None)


@dataclass(frozen=True)
class Member:
    """A member of a segment: a worker of the job (``rank``, ``host``) or a child switch (``switch``)."""

    local_rank: int
    rank: int | None = None
    host: str | None = None
    switch: str | None = None


@dataclass
class Segment:
    """The job's share of one switch: its members, and the parent segment's switch (None at the root)."""

    switch: str
    members: list[Member]
    parent: str | None


@dataclass
class TreePlan:
    """A job's tree: one segment per switch, the root's first."""

    root: str
    segments: dict[str, Segment] = field(default_factory=dict)

    @property
    def switches(self) -> list[str]:
        return list(self.segments)

    def leaf_of(self, rank: int) -> tuple[str, int]:
        """The switch whose segment has the job's worker ``rank``, and the worker's rank in that segment."""
        for name, segment in self.segments.items():
            for m in segment.members:
                if m.rank == rank:
                    return name, m.local_rank
        raise KeyError(f"no worker of rank {rank} in the tree")

    def rank_at_parent(self, switch: str) -> int:
        """The local rank of ``switch``'s segment in its parent's."""
        parent = self.segments[switch].parent
        assert parent is not None
        return next(m.local_rank for m in self.segments[parent].members if m.switch == switch)


@dataclass(frozen=True)
class Allocation:
    """One segment's share of its switch: job id, slots (the same count on every switch of a tree), owner tag,
    and the job's width (the same at every level). ``slot_base`` is the segment's first cell on its switch,
    ``slot_count`` its slots, each ``wire.cells_of(width)`` cells."""

    job_id: int
    slot_base: int
    slot_count: int
    generation: int
    width: int = wire.K


@dataclass(frozen=True)
class TreeWorker:
    """A worker of the job: its rank in the whole job, host and UDP port."""

    rank: int
    host: str
    udp_port: int


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file (``configs/topology.yaml``)."""
    return parse_topology(read_yaml(path), str(path))


def parse_topology(data: Any, source: str) -> Topology:
    """Validate an already-parsed topology mapping; every problem is one ConfigError naming the key."""

    def fail(key: str, problem: str) -> ConfigError:
        return ConfigError(f"{source}: {key}: {problem}")

    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    unknown = sorted(set(data) - {"switches", "hosts"})
    if unknown:
        raise fail(unknown[0], "unknown key (allowed: hosts, switches)")
    raw_switches = data.get("switches")
    if not isinstance(raw_switches, dict) or not raw_switches:
        raise fail("switches", "expected a mapping of switch names to switches")
    switches: dict[str, TopoSwitch] = {}
    for name, spec in raw_switches.items():
        where = f"switches.{name}"
        _check_mapping(spec, where, _SWITCH_KEYS, fail)
        address = _string(spec, "grpc_address", where, fail)
        if not _ADDRESS.match(address):
            raise fail(f"{where}.grpc_address", f"{address!r} is not host:port or unix:/path")
        device_id = spec.get("device_id", 1)
        if not isinstance(device_id, int) or isinstance(device_id, bool) or device_id < 0:
            raise fail(f"{where}.device_id", f"expected a device id >= 0, got {device_id!r}")
        aggregator = spec.get("aggregator")
        if not isinstance(aggregator, dict) or set(aggregator) - {"ip", "mac"}:
            raise fail(f"{where}.aggregator", "expected {ip: <IPv4 address>, mac: <MAC address>}")
        ip = _ipv4(_string(aggregator, "ip", f"{where}.aggregator", fail), f"{where}.aggregator.ip", fail)
        mac = _mac(_string(aggregator, "mac", f"{where}.aggregator", fail), f"{where}.aggregator.mac", fail)
        parent = up_port = parent_port = None
        if spec.get("parent") is not None:
            link = spec["parent"]
            if not isinstance(link, dict) or set(link) != _PARENT_KEYS:
                raise fail(f"{where}.parent", "expected {switch: <name>, up_port: <this switch's port>, "
                                              "port: <the parent's port facing this switch>}")
            parent = _string(link, "switch", f"{where}.parent", fail)
            up_port = _port(link["up_port"], f"{where}.parent.up_port", fail)
            parent_port = _port(link["port"], f"{where}.parent.port", fail)
        switches[str(name)] = TopoSwitch(str(name), address, device_id, ip, mac, parent, up_port, parent_port)
    _check_tree(switches, fail)

    hosts: dict[str, TopoHost] = {}
    items = data.get("hosts") or []
    if not isinstance(items, list):
        raise fail("hosts", "expected a list")
    for i, item in enumerate(items):
        where = f"hosts[{i}]"
        _check_mapping(item, where, _HOST_KEYS, fail)
        name = _string(item, "name", where, fail)
        if name in hosts:
            raise fail(f"{where}.name", f"duplicate host {name!r}")
        switch = _string(item, "switch", where, fail)
        if switch not in switches:
            raise fail(f"{where}.switch", f"unknown switch {switch!r}")
        hosts[name] = TopoHost(name, switch, _port(item.get("port"), f"{where}.port", fail),
                               _ipv4(_string(item, "ip", where, fail), f"{where}.ip", fail),
                               _mac(_string(item, "mac", where, fail), f"{where}.mac", fail),
                               link_mbit(item.get("link_mbit"), f"{source}: {where}.link_mbit"))
    _check_ports_and_addresses(switches, hosts, fail)
    return Topology(source, switches, hosts)


def dump_topology(topology: Topology, addresses: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The topology as a mapping :func:`parse_topology` reads back (a topology file's content); ``addresses``:
    switches' P4Runtime addresses to put instead of theirs (an emulated tree's, once its targets run)."""
    addresses = addresses or {}
    switches: dict[str, Any] = {}
    for s in topology.switches.values():
        switches[s.name] = {"grpc_address": addresses.get(s.name, s.grpc_address), "device_id": s.device_id,
                            "aggregator": {"ip": s.aggregator_ip, "mac": s.aggregator_mac}}
        if s.parent is not None:
            switches[s.name]["parent"] = {"switch": s.parent, "up_port": s.up_port, "port": s.parent_port}
    hosts = [{"name": h.name, "switch": h.switch, "port": h.port, "ip": h.ip, "mac": h.mac,
              **({"link_mbit": h.link_mbit} if h.link_mbit is not None else {})} for h in topology.hosts.values()]
    return {"switches": switches, "hosts": hosts}


def _check_mapping(node: Any, where: str, allowed: set[str], fail) -> None:
    if not isinstance(node, dict):
        raise fail(where, "expected a mapping")
    for key in node:
        if key not in allowed:
            raise fail(f"{where}.{key}", f"unknown key (allowed: {', '.join(sorted(allowed))})")


def _string(node: Mapping, key: str, where: str, fail) -> str:
    value = node.get(key)
    if not isinstance(value, str) or not value:
        raise fail(f"{where}.{key}", f"expected a string, got {value!r}")
    return value


def _port(value: Any, where: str, fail) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < dp.DROP_PORT:
        raise fail(where, f"expected a switch port in 0..{dp.DROP_PORT - 1}, got {value!r}")
    return value


def _ipv4(value: str, where: str, fail) -> str:
    try:
        return str(ipaddress.IPv4Address(value))
    except ValueError:
        raise fail(where, f"{value!r} is not an IPv4 address") from None


def _mac(value: str, where: str, fail) -> str:
    if not _MAC.match(value):
        raise fail(where, f"{value!r} is not a MAC address like 02:00:00:00:00:01")
    return value.lower()


def _check_tree(switches: dict[str, TopoSwitch], fail) -> None:
    """Parents exist, one root, no cycles."""
    for switch in switches.values():
        if switch.parent is not None and switch.parent not in switches:
            raise fail(f"switches.{switch.name}.parent.switch", f"unknown switch {switch.parent!r}")
    for switch in switches.values():
        seen = {switch.name}
        node = switch
        while node.parent is not None:
            if node.parent in seen:
                raise fail(f"switches.{switch.name}.parent", f"the parents form a cycle through {node.parent!r}")
            seen.add(node.parent)
            node = switches[node.parent]
    roots = [s.name for s in switches.values() if s.parent is None]
    if len(roots) != 1:
        raise fail("switches", f"expected exactly one root (a switch without a parent), found {roots}")


def _check_ports_and_addresses(switches: dict[str, TopoSwitch], hosts: dict[str, TopoHost], fail) -> None:
    """No switch port used twice (hosts, up link, children's links); no P4Runtime address (and device id), MAC or
    IPv4 address used twice."""
    used: dict[tuple[str, int], str] = {}

    def take(switch: str, port: int, what: str) -> None:
        other = used.setdefault((switch, port), what)
        if other != what:
            raise fail(what, f"port {port} of switch {switch!r} is already {other}")

    for s in switches.values():
        if s.parent is not None:
            assert s.up_port is not None and s.parent_port is not None
            take(s.name, s.up_port, f"switches.{s.name}.parent.up_port")
            take(s.parent, s.parent_port, f"switches.{s.name}.parent.port")
    for h in hosts.values():
        take(h.switch, h.port, f"host {h.name!r}")
    sessions: dict[tuple[str, int], str] = {}
    for s in switches.values():  # one controller session per switch: two names for one switch would fight
        other = sessions.setdefault((s.grpc_address, s.device_id), s.name)
        if other != s.name:
            raise fail(f"switches.{s.name}.grpc_address", f"{s.grpc_address} (device {s.device_id}) is already "
                                                          f"switch {other!r}'s")
    macs: dict[str, str] = {}
    for what, mac in [*((f"switches.{s.name}.aggregator.mac", s.aggregator_mac) for s in switches.values()),
                      *((f"host {h.name!r}", h.mac) for h in hosts.values())]:
        other = macs.setdefault(mac, what)
        if other != what:
            raise fail(what, f"MAC {mac} is already {other}'s")
    addresses: dict[str, str] = {}
    for what, ip in [*((f"switches.{s.name}.aggregator.ip", s.aggregator_ip) for s in switches.values()),
                     *((f"host {h.name!r}", h.ip) for h in hosts.values())]:
        other = addresses.setdefault(ip, what)
        if other != what:
            raise fail(what, f"address {ip} is already {other}'s")


def plan_tree(topology: Topology, workers: Sequence[TreeWorker]) -> TreePlan:
    """The segments of a job whose workers are ``workers``: one per switch from their switches up to the lowest
    switch they share. Raises ConfigError for an unknown host, a rank used twice, or a segment of more than
    ``wire.MAX_WORKERS`` members (the tree then needs another level)."""
    if not workers:
        raise ConfigError(f"{topology.source}: a job needs at least one worker")
    ranks = [w.rank for w in workers]
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"{topology.source}: a worker rank is used twice: {sorted(ranks)}")
    for w in workers:
        if w.host not in topology.hosts:
            raise ConfigError(f"{topology.source}: unknown host {w.host!r}")
    paths = {topology.hosts[w.host].switch: topology.path_to_root(topology.hosts[w.host].switch) for w in workers}
    common = set.intersection(*(set(p) for p in paths.values()))
    root = next(s for s in next(iter(paths.values())) if s in common)  # the lowest shared switch
    in_tree: list[str] = []
    for path in paths.values():
        for switch in path[:path.index(root) + 1]:
            if switch not in in_tree:
                in_tree.append(switch)
    plan = TreePlan(root)
    for switch in sorted(in_tree, key=lambda s: (len(topology.path_to_root(s)), s)):  # the root first
        local = sorted((w for w in workers if topology.hosts[w.host].switch == switch), key=lambda w: w.rank)
        children = sorted(s for s in in_tree if topology.switches[s].parent == switch)
        members = [Member(i, rank=w.rank, host=w.host) for i, w in enumerate(local)]
        members += [Member(len(members) + i, switch=c) for i, c in enumerate(children)]
        if len(members) > wire.MAX_WORKERS:
            raise ConfigError(f"{topology.source}: switch {switch!r} would have {len(members)} members of the job "
                              f"(at most {wire.MAX_WORKERS}: one bitmap word); add a level to the tree")
        plan.segments[switch] = Segment(switch, members, None if switch == root else topology.switches[switch].parent)
    return plan


def tree_state(topology: Topology, plan: TreePlan, allocations: Mapping[str, Allocation],
               workers: Iterable[TreeWorker]) -> dict[str, DesiredState]:
    """What each switch of ``plan`` must hold for the job: its segment's job entry, members and their replicas,
    multicast group, and (below the root) its up and down links."""
    missing = [s for s in plan.segments if s not in allocations]
    if missing:
        raise ValueError(f"no allocation on {missing}")
    counts = {a.slot_count for s, a in allocations.items() if s in plan.segments}
    if len(counts) != 1:
        raise ValueError(f"a tree's segments need the same slot count on every switch, got {sorted(counts)}")
    widths = {a.width for s, a in allocations.items() if s in plan.segments}
    if len(widths) != 1:
        raise ValueError(f"a tree's segments need the same width on every switch, got {sorted(widths)}")
    by_rank = {w.rank: w for w in workers}
    states: dict[str, DesiredState] = {}
    for name, segment in plan.segments.items():
        switch, alloc = topology.switches[name], allocations[name]
        state = DesiredState()
        state.add(Entry.make(dp.TABLE_JOBS, {"job_id": alloc.job_id}, dp.ACTION_SET_JOB, {
            "num_workers": len(segment.members), "slot_base": alloc.slot_base, "slot_count": alloc.slot_count,
            "mgid": alloc.job_id, "generation": alloc.generation, "width": wire.width_code(alloc.width)}))
        replicas = []
        for m in segment.members:
            if m.switch is not None:  # a child switch: at its aggregator address and the tree port
                child = topology.switches[m.switch]
                assert child.parent_port is not None
                port, ip, mac, udp = child.parent_port, child.aggregator_ip, child.aggregator_mac, \
                    wire.NETAGG_TREE_UDP_PORT
            else:
                assert m.rank is not None and m.host is not None
                host = topology.hosts[m.host]
                port, ip, mac, udp = host.port, host.ip, host.mac, by_rank[m.rank].udp_port
            state.add(Entry.make(dp.TABLE_WORKERS, {"job_id": alloc.job_id, "ipv4_src": ip_to_int(ip),
                                                    "udp_src": udp, "ingress_port": port},
                                 dp.ACTION_SET_WORKER, {"rank": m.local_rank, "worker_mask": 1 << m.local_rank}))
            state.add(Entry.make(dp.TABLE_REPLICAS, {"mgid": alloc.job_id, "rid": m.local_rank + 1},
                                 dp.ACTION_SET_DESTINATION,
                                 {"dst_mac": mac_to_int(mac), "dst_addr": ip_to_int(ip), "dst_port": udp}))
            replicas.append((port, m.local_rank + 1))
        state.groups[alloc.job_id] = tuple(sorted(replicas))
        if segment.parent is not None:
            parent, parent_alloc = topology.switches[segment.parent], allocations[segment.parent]
            assert switch.up_port is not None
            state.add(Entry.make(dp.TABLE_UP_LINKS, {"job_id": alloc.job_id}, dp.ACTION_SET_UP_LINK, {
                "port": switch.up_port, "parent_job": parent_alloc.job_id, "parent_rank": plan.rank_at_parent(name),
                "parent_mac": mac_to_int(parent.aggregator_mac), "parent_addr": ip_to_int(parent.aggregator_ip)}))
            state.add(Entry.make(dp.TABLE_DOWN_LINKS, {"ingress_port": switch.up_port,
                                                       "ipv4_src": ip_to_int(parent.aggregator_ip),
                                                       "job_id": parent_alloc.job_id},
                                 dp.ACTION_SET_DOWN_LINK, {"job": alloc.job_id}))
        states[name] = state
    return states


def worker_config(topology: Topology, plan: TreePlan, allocations: Mapping[str, Allocation], worker: TreeWorker,
                  job_workers: int, **options: Any) -> WorkerConfig:
    """``worker``'s config for a job over ``plan``: its leaf segment's job id, rank and size (what the switch
    checks) and aggregator address, and over several switches the whole job's size and its rank in it
    (``job_workers``/``job_rank``: what it quantizes for). No PS, so no failover; ``options``: more fields."""
    leaf, rank = plan.leaf_of(worker.rank)
    tree = {"job_workers": job_workers, "job_rank": worker.rank} if len(plan.segments) > 1 else {}
    return WorkerConfig(job_id=allocations[leaf].job_id, rank=rank, num_workers=len(plan.segments[leaf].members),
                        slot_count=allocations[leaf].slot_count, mode="allreduce", width=allocations[leaf].width,
                        aggregator=Endpoint(topology.switches[leaf].aggregator_ip, wire.NETAGG_UDP_PORT),
                        bind=Endpoint(topology.hosts[worker.host].ip, worker.udp_port),
                        **{"failover_after": 0, **tree, **options})


def fabric_state(topology: Topology) -> dict[str, DesiredState]:
    """The entries every switch holds whatever the jobs: a route to every host (its own port, or the link
    toward the subtree that holds it, or the up link), and source bindings (its own aggregator address is
    the switch's alone; its hosts' addresses, its children's and its parent's aggregator addresses are
    bound to the ports they are behind)."""
    states: dict[str, DesiredState] = {}
    for name, switch in topology.switches.items():
        state = DesiredState()
        for host in topology.hosts.values():
            port, mac = _toward(topology, name, host.switch), host.mac
            if port is None:
                port = host.port
            else:  # through another switch: the next switch's aggregator MAC
                mac = _next_hop_mac(topology, name, host.switch)
            state.add(Entry.make(dp.TABLE_ROUTES, {"ipv4_dst": (ip_to_int(host.ip), 32)}, dp.ACTION_FORWARD,
                                 {"port": port, "dst_mac": mac_to_int(mac)}))
            bound = host.port if host.switch == name else _toward(topology, name, host.switch)
            state.add(Entry.make(dp.TABLE_SOURCES, {"ipv4_src": ip_to_int(host.ip)}, dp.ACTION_BIND_TO_PORT,
                                 {"port": bound}))
        state.add(Entry.make(dp.TABLE_SOURCES, {"ipv4_src": ip_to_int(switch.aggregator_ip)},
                             dp.ACTION_SWITCH_ONLY, {}))
        for other in topology.switches.values():
            if other.name == name:
                continue
            state.add(Entry.make(dp.TABLE_SOURCES, {"ipv4_src": ip_to_int(other.aggregator_ip)},
                                 dp.ACTION_BIND_TO_PORT, {"port": _toward(topology, name, other.name)}))
        states[name] = state
    return states


def _toward(topology: Topology, here: str, target: str) -> int | None:
    """The port of switch ``here`` toward switch ``target`` (None: it is ``here``)."""
    if target == here:
        return None
    path = topology.path_to_root(target)
    if here in path:  # below: the port facing the child on the way down
        child = topology.switches[path[path.index(here) - 1]]
        return child.parent_port
    return topology.switches[here].up_port


def _next_hop_mac(topology: Topology, here: str, target: str) -> str:
    path = topology.path_to_root(target)
    if here in path:
        return topology.switches[path[path.index(here) - 1]].aggregator_mac
    parent = topology.switches[here].parent
    assert parent is not None
    return topology.switches[parent].aggregator_mac
