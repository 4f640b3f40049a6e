"""The emulated cluster: N worker hosts and a PS host in network namespaces around one switch, or
(:class:`EmulatedTreeCluster`) racks of worker hosts under leaf switches and a root.

Each host hangs off its own switch port by a veth pair shaped with ``tc`` (rate,
delay) from ``configs/cluster.yaml``; the switch — BMv2 or the software target on raw
sockets — runs in its own namespace and is reached over a unix-socket P4Runtime
address; the controller runs in the root namespace. Everything is torn down when the
context exits, whatever happens (errors, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from netagg import dataplane as dp
from netagg import wire
from netagg.bmv2.deployment import Deployment
from netagg.bmv2.netns import LinkShape, Topology, ns_exec
from netagg.bmv2.p4build import compile_program
from netagg.bmv2.targets import SOFT_TARGETS, start_target
from netagg.jobconfig import ConfigError, read_yaml

CLUSTER_CONFIG = dp.REPO_ROOT / "configs" / "cluster.yaml"
PS_PORT = 29000
WORKER_PORT_BASE = 41000


@dataclass(frozen=True)
class ClusterSpec:
    """Shape of the emulated cluster."""

    num_workers: int = 4
    target: str = "soft"
    rate_mbit: float | None = 20.0
    delay_ms: float = 0.5
    queue_packets: int = 1000
    mtu: int = 1500
    slots: int = 1024
    #: TCP congestion control in the hosts (None: the machine's default; see configs/cluster.yaml).
    tcp_congestion: str | None = None
    #: The controller's ``slots.target_rtt_ms`` (None: its default): the round trip the slots of a job created
    #: without ``--slots`` cover on the hosts' links (``rate_mbit``, written as each host's ``link_mbit``).
    target_rtt_ms: float | None = None

    @classmethod
    def load(cls, path: Path = CLUSTER_CONFIG, **overrides: object) -> ClusterSpec:
        """Read ``configs/cluster.yaml``; keyword overrides win (None = keep the file's value)."""
        data = read_yaml(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        data.update({k: v for k, v in overrides.items() if v is not None})
        spec = cls(**data)
        if not 1 <= spec.num_workers <= wire.MAX_WORKERS:
            raise ConfigError(f"{path}: num_workers: {spec.num_workers} not in 1..{wire.MAX_WORKERS}")
        if spec.target not in ("soft", "bmv2"):
            raise ConfigError(f"{path}: target: {spec.target!r} is not soft or bmv2")
        return spec


class EmulatedCluster(Deployment):
    """Hosts ``h0 .. h{N-1}`` are workers, ``h{N}`` runs the parameter server."""

    def __init__(self, workdir: Path, spec: ClusterSpec, prefix: str | None = None) -> None:
        super().__init__(workdir)
        self.spec = spec
        self.prefix = prefix or f"nc{os.getpid() % 100000}"
        self.topology = Topology(self.prefix, spec.num_workers + 1, mtu=spec.mtu,
                                 shape=LinkShape(spec.rate_mbit, spec.delay_ms, spec.queue_packets),
                                 tcp_congestion=spec.tcp_congestion,
                                 switch_segmentation=spec.target in SOFT_TARGETS, management=True)
        # The hosts reach the controller over the management network: their workers follow moves of their slots.
        self.worker_address = f"{self.topology.controller_ip}:0"

    @property
    def worker_hosts(self) -> list[str]:
        return [h.name for h in self.topology.hosts[:-1]]

    @property
    def ps_host(self) -> str:
        return self.topology.hosts[-1].name

    def _start(self) -> None:
        self.topology.build()
        bmv2_json = compile_program(self.workdir / "p4c")[0] if self.spec.target == "bmv2" else None
        self.switch = start_target(self.spec.target, self.topology.switch_interfaces(), self.workdir / "switch.log",
                                   grpc_address=f"unix:{self.workdir}/p4runtime.sock",
                                   namespace=self.topology.switch_namespace,
                                   udp_segmentation=self.topology.switch_segmentation)
        # Each host's link rate (the tc shaping of its link): the controller sizes the slots of a job created
        # without --slots to it (docs/controller.md).
        rate = {} if self.spec.rate_mbit is None else {"link_mbit": self.spec.rate_mbit}
        hosts = [{"name": h.name, "ip": h.ip, "mac": h.mac, "port": h.switch_port, **rate}
                 for h in self.topology.hosts]
        self.start_controller(self.controller_config(
            self.switch.grpc_address, self.topology.aggregator_ip, wire.NETAGG_UDP_PORT, hosts, self.ps_host,
            PS_PORT, self.spec.slots, bmv2_json, target_rtt_ms=self.spec.target_rtt_ms))

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.topology.destroy()

    def namespace_of(self, host: str) -> str:
        return next(h.namespace for h in self.topology.hosts if h.name == host)

    def ifname_of(self, host: str) -> str:
        return next(h.ifname for h in self.topology.hosts if h.name == host)

    def ip_of(self, host: str) -> str:
        return next(h.ip for h in self.topology.hosts if h.name == host)

    def host_command(self, host: str, cmd: Sequence[str]) -> list[str]:
        return ns_exec(self.namespace_of(host), cmd)

    def worker_ports(self, hosts: Sequence[str], offset: int = 0) -> list[int]:
        return [WORKER_PORT_BASE + offset + i for i in range(len(hosts))]


class EmulatedTreeCluster(Deployment):
    """Racks of worker hosts, each rack's leaf switch linked to a root (``bmv2/tree.py``: a software target, or
    BMv2, per switch in its own namespace, shaped links), and one controller daemon driving every switch through
    its topology. Hosts ``w0 ..`` rack by rack; ``ps`` on rack 0 (the PS a job falls back to when no slots)."""

    def __init__(self, workdir: Path, racks: int = 2, workers_per_rack: int = 2, target: str = "soft",
                 uplink: LinkShape | None = None, host_links: LinkShape | None = None, prefix: str | None = None,
                 slots: int = 1024) -> None:
        from netagg.bmv2.tree import EmulatedTree, racks_topology

        super().__init__(workdir)
        self.slots = slots
        self.host_links = host_links
        self.tree = EmulatedTree(workdir, racks_topology(racks, workers_per_rack, ps_host=True),
                                 prefix or f"nt{os.getpid() % 10000}", target=target, link_shape=uplink,
                                 host_shape=host_links, programmed=False)

    @property
    def worker_hosts(self) -> list[str]:
        return [name for name in self.tree.topology.hosts if name != "ps"]

    @property
    def ps_host(self) -> str:
        return "ps"

    def describe(self) -> str:
        switches = self.tree.topology.switches
        return (f"{len(switches)} switches ({', '.join(switches)}), {self.tree.target} targets, each in its "
                f"namespace; one controller over the topology")

    def _start(self) -> None:
        self.tree.__enter__()
        topology = self.workdir / "topology.yaml"
        data = self.tree.topology_data()
        if self.host_links is not None and self.host_links.rate_mbit is not None:  # the hosts' shaped links
            for host in data["hosts"]:
                host["link_mbit"] = self.host_links.rate_mbit
        topology.write_text(yaml.safe_dump(data, sort_keys=False))
        bmv2_json = compile_program(self.workdir / "p4c")[0] if self.tree.target == "bmv2" else None
        self.start_controller(self.topology_controller_config(topology, self.ps_host, PS_PORT, self.slots, bmv2_json))

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.tree.stop()

    def host_command(self, host: str, cmd: Sequence[str]) -> list[str]:
        return self.tree.host_command(host, cmd)

    def worker_ports(self, hosts: Sequence[str], offset: int = 0) -> list[int]:
        return [WORKER_PORT_BASE + offset + i for i in range(len(hosts))]
