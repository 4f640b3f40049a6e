"""An emulated tree of switches (docs/hierarchy.md): a namespace per switch and per host, veths between them.

``EmulatedTree(workdir, topology)`` builds what a ``controller.topology.Topology`` describes on this
machine: each switch its own software target process in its own namespace (ports named after the
topology's port numbers), each host a namespace on its switch port, each parent link a veth pair
between the two switches' namespaces (optionally shaped: the links between racks are the bottleneck of
real clusters). Everything is torn down on exit, whatever happens.

Who programs the switches: the controller daemon (``programmed=False``: the targets start bare, and
:meth:`EmulatedTree.topology_data` is the topology file to give it, with the targets' P4Runtime
addresses), or the tree itself (the default, for packet-level tests without a controller): each switch
gets its own primary P4Runtime session, the fabric's entries (``topology.fabric_state``) on start and a
job's (``topology.tree_state``) with :meth:`EmulatedTree.install_job`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from pathlib import Path

from netagg import dataplane as dp
from netagg.bmv2.netns import SWITCH_MAC, LinkShape, ns_exec, remove_stale, run, shape_link
from netagg.bmv2.targets import TargetProcess, start_target
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.controller.switch_programmer import DesiredState, read_job_counters, reconcile_state
from netagg.controller.topology import (
    Allocation,
    Topology,
    TreePlan,
    TreeWorker,
    dump_topology,
    fabric_state,
    parse_topology,
    tree_state,
)
from netagg.controller.tree_programmer import install_tree_job, remove_tree_job

#: Each rack switch's port toward the root in :func:`racks_topology`.
UP_PORT = 60


def racks_topology(racks: int, workers_per_rack: int, ps_host: bool = False) -> Topology:
    """``racks`` leaf switches under a root (``racks`` = 1: one switch, no root), with ``workers_per_rack`` hosts
    ``w0, w1, ...`` on each (rack-major: rack 0's first) and, with ``ps_host``, a host ``ps`` on rack 0."""
    switches: dict = {}
    if racks > 1:
        switches["root"] = {"grpc_address": "unix:/unset/root",
                            "aggregator": {"ip": "10.60.0.254", "mac": "02:00:00:60:00:fe"}}
    for i in range(racks):
        switches[f"rack{i}"] = {"grpc_address": f"unix:/unset/rack{i}",
                                "aggregator": {"ip": f"10.6{1 + i}.0.254", "mac": f"02:00:00:6{1 + i}:00:fe"}}
        if racks > 1:
            switches[f"rack{i}"]["parent"] = {"switch": "root", "up_port": UP_PORT, "port": 1 + i}
    hosts = []
    for r in range(racks * workers_per_rack):
        rack = r // workers_per_rack
        hosts.append({"name": f"w{r}", "switch": f"rack{rack}", "port": 1 + r % workers_per_rack,
                      "ip": f"10.6{1 + rack}.0.{1 + r}", "mac": f"02:00:00:6{1 + rack}:00:{1 + r:02x}"})
    if ps_host:
        hosts.append({"name": "ps", "switch": "rack0", "port": workers_per_rack + 1, "ip": "10.61.0.200",
                      "mac": "02:00:00:61:00:c8"})
    return parse_topology({"switches": switches, "hosts": hosts}, f"<{racks} racks of {workers_per_rack}>")


class EmulatedTree:
    """The switches and hosts of ``topology`` in namespaces, the switches running ``target``."""

    def __init__(self, workdir: Path, topology: Topology, prefix: str, target: str = "soft",
                 link_shape: LinkShape | None = None, mtu: int = 1500, host_shape: LinkShape | None = None,
                 programmed: bool = True) -> None:
        """``link_shape``: the links between switches; ``host_shape``: the hosts' links (None: unshaped);
        ``programmed``: the tree programs its switches itself (False: a controller does)."""
        if len(prefix) > 6:
            raise ValueError("prefix must be at most 6 characters (interface names are short)")
        self.workdir = workdir
        self.topology = topology
        self.prefix = prefix
        self.target = target
        self.link_shape = link_shape
        self.host_shape = host_shape
        self.mtu = mtu
        self.programmed = programmed
        self.switches: dict[str, TargetProcess] = {}
        self.clients: dict[str, P4RuntimeClient] = {}
        #: The entries each switch holds: the fabric's plus every installed job's.
        self.state: dict[str, DesiredState] = {}
        self._ports: dict[str, dict[int, str]] = {name: {} for name in topology.switches}

    # -- names ---------------------------------------------------------------
    def namespace_of(self, node: str) -> str:
        """A switch's or host's namespace."""
        return f"{self.prefix}-{node}"

    def port_ifname(self, switch: str, port: int) -> str:
        index = list(self.topology.switches).index(switch)
        return f"{self.prefix}s{index}p{port}"

    def host_ifname(self, host: str) -> str:
        return f"{self.prefix}h{list(self.topology.hosts).index(host)}"

    def host_command(self, host: str, cmd: Sequence[str]) -> list[str]:
        return ns_exec(self.namespace_of(host), cmd)

    # -- lifecycle -----------------------------------------------------------
    def __enter__(self) -> EmulatedTree:
        try:
            self._build()
            self._start_switches()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for client in self.clients.values():
            with contextlib.suppress(Exception):
                client.close()
        self.clients.clear()
        for switch in self.switches.values():
            with contextlib.suppress(Exception):
                switch.stop()
        self.switches.clear()
        remove_stale(self.prefix + "-")

    def _build(self) -> None:
        remove_stale(self.prefix + "-")
        for name in [*self.topology.switches, *self.topology.hosts]:
            ns = self.namespace_of(name)
            run(["ip", "netns", "add", ns])
            run(ns_exec(ns, ["ip", "link", "set", "lo", "up"]))
            run(ns_exec(ns, ["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"]), check=False)
        for switch in self.topology.switches.values():
            if switch.parent is None:
                continue
            assert switch.up_port is not None and switch.parent_port is not None
            parent_side = self.port_ifname(switch.parent, switch.parent_port)
            self._veth(switch.name, switch.up_port, self.namespace_of(switch.parent), parent_side, self.link_shape)
            self._ports[switch.parent][switch.parent_port] = parent_side
        for host in self.topology.hosts.values():
            ns, ifname = self.namespace_of(host.name), self.host_ifname(host.name)
            self._veth(host.switch, host.port, ns, ifname, self.host_shape)
            leaf = self.topology.switches[host.switch]
            run(ns_exec(ns, ["ip", "link", "set", ifname, "address", host.mac]))
            run(ns_exec(ns, ["ip", "addr", "add", f"{host.ip}/32", "dev", ifname]))
            # Everything goes through the leaf: its aggregator address and every other host.
            for ip in [leaf.aggregator_ip, *(h.ip for h in self.topology.hosts.values() if h is not host)]:
                run(ns_exec(ns, ["ip", "route", "add", f"{ip}/32", "dev", ifname]))
                run(ns_exec(ns, ["ip", "neigh", "replace", ip, "lladdr", SWITCH_MAC, "dev", ifname,
                                 "nud", "permanent"]))

    def _veth(self, switch: str, port: int, peer_ns: str, peer_ifname: str, shape: LinkShape | None) -> str:
        """A veth pair from ``switch``'s ``port`` to ``peer_ifname`` in ``peer_ns``, both ends up (and shaped with
        ``shape``: each direction once)."""
        mine = self.port_ifname(switch, port)
        sw_ns = self.namespace_of(switch)
        run(["ip", "link", "add", mine, "type", "veth", "peer", "name", peer_ifname])
        run(["ip", "link", "set", mine, "netns", sw_ns])
        run(["ip", "link", "set", peer_ifname, "netns", peer_ns])
        for ns, ifname in ((sw_ns, mine), (peer_ns, peer_ifname)):
            run(ns_exec(ns, ["ip", "link", "set", ifname, "mtu", str(self.mtu)]))
            run(ns_exec(ns, ["ethtool", "-K", ifname, "tx", "off", "rx", "off", "tso", "off", "gso", "off"]),
                check=False)
            run(ns_exec(ns, ["ip", "link", "set", ifname, "up"]))
            if shape is not None:
                shape_link(ns, ifname, shape, self.mtu)
        self._ports[switch][port] = mine
        return mine

    def _start_switches(self) -> None:
        fabric = fabric_state(self.topology)
        device_config = self._device_config() if self.programmed else b""
        for name in self.topology.switches:
            sock = self.workdir / f"{name}.p4rt.sock"
            self.switches[name] = start_target(self.target, self._ports[name], self.workdir / f"{name}.log",
                                               grpc_address=f"unix:{sock}", namespace=self.namespace_of(name))
            if not self.programmed:
                continue
            client = P4RuntimeClient(self.switches[name].grpc_address, device_id=1, election_id=(0, 1))
            client.connect()
            client.set_pipeline(dp.P4INFO_PATH, device_config)
            self.clients[name] = client
            self.state[name] = fabric[name]
            reconcile_state(client, fabric[name])

    def _device_config(self) -> bytes:
        """What set_pipeline hands the switches: BMv2's compiled program, nothing for the software target."""
        if self.target != "bmv2":
            return b""
        from netagg.bmv2.p4build import compile_program

        return compile_program(self.workdir / "p4c")[0].read_bytes()

    def topology_data(self) -> dict:
        """The topology file for a controller of this tree: the switches at their targets' addresses."""
        return dump_topology(self.topology, {name: target.grpc_address for name, target in self.switches.items()})

    def restart_switch(self, name: str) -> None:
        """Kill one switch's target and start it again, bare (a rebooted switch: no pipeline, no entries)."""
        old = self.switches[name]
        old.stop()
        sock = self.workdir / f"{name}.p4rt.sock"
        sock.unlink(missing_ok=True)
        self.switches[name] = start_target(self.target, self._ports[name], self.workdir / f"{name}.log",
                                           grpc_address=f"unix:{sock}", namespace=self.namespace_of(name))

    # -- jobs ----------------------------------------------------------------
    def install_job(self, plan: TreePlan, allocations: dict[str, Allocation], workers: Iterable[TreeWorker],
                    ) -> dict[str, DesiredState]:
        """Add a job's entries (``tree_state``) to every switch of its tree, root first, all or nothing
        (``tree_programmer``); returns the job's share of each switch (for :meth:`remove_job`)."""
        job = tree_state(self.topology, plan, allocations, list(workers))
        self.state = install_tree_job(self.clients, self.state, job, plan.switches)
        return job

    def remove_job(self, plan: TreePlan, job: dict[str, DesiredState]) -> None:
        """Take a job's entries off every switch of its tree, leaves first."""
        self.state = remove_tree_job(self.clients, self.state, job, plan.switches)

    def counters(self, switch: str, job_id: int) -> dict[str, int]:
        """The job counters of one segment (packets since the switch started)."""
        return read_job_counters(self.clients[switch], job_id)
