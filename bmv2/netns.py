"""Network namespaces and veth links for the PTF rig and the emulated cluster.

Everything created here is named with a caller-chosen prefix and removed by
:meth:`Topology.destroy` (also on errors and Ctrl-C when used as a context
manager); :func:`remove_stale` clears what a killed run left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: MAC every host uses for its neighbours (the switch answers for all of them).
SWITCH_MAC = "02:00:00:00:00:fe"


#: setns(2)'s namespace type for a network namespace.
CLONE_NEWNET = 0x40000000


class NetnsError(RuntimeError):
    """A namespace, link or tc command failed."""


@contextlib.contextmanager
def in_namespace(name: str) -> Iterator[None]:
    """The calling thread in network namespace ``name`` (sockets made here stay in it), then back."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
        yield
    finally:
        if libc.setns(own, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back into the thread's own network namespace")
        os.close(own)
        os.close(target)


def can_create_namespaces() -> tuple[bool, str]:
    """Whether this process can build a topology, and if not, why."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces and veth links)"
    if shutil.which("ip") is None:
        return False, "needs iproute2's `ip` command"
    return True, ""


def run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a command, raising NetnsError with its stderr when it fails."""
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
    return result


def ns_exec(namespace: str | None, args: Sequence[str]) -> list[str]:
    """``args`` run inside ``namespace`` (or as they are for the root namespace)."""
    return ["ip", "netns", "exec", namespace, *args] if namespace else list(args)


def list_namespaces() -> list[str]:
    out = run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale(prefix: str) -> list[str]:
    """Delete every namespace whose name starts with ``prefix``; returns their names."""
    removed = [name for name in list_namespaces() if name.startswith(prefix)]
    for name in removed:
        run(["ip", "netns", "del", name], check=False)
    return removed


@dataclass
class Host:
    """One end host: its namespace, interface, addresses and the switch port it hangs off."""

    name: str
    namespace: str
    ifname: str
    ip: str
    mac: str
    switch_port: int
    switch_ifname: str


@dataclass
class LinkShape:
    """tc shaping of a host's link (both directions): rate, delay, queue."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    queue_packets: int = 1000


@dataclass
class Topology:
    """N hosts in their own namespaces, each linked by a veth pair to the switch namespace.

    ``with Topology(prefix, n) as topo:`` builds it and always tears it down.
    Hosts are 10.<subnet>.0.<i+1>/24 with static ARP entries that point every
    other address (and the aggregator address ``.254``) at :data:`SWITCH_MAC`.
    """

    prefix: str
    num_hosts: int
    subnet: int = 77
    mtu: int = 1500
    shape: LinkShape = field(default_factory=LinkShape)
    #: TCP congestion control of the hosts' connections (None: the kernel's default, whatever the machine has).
    tcp_congestion: str | None = None
    #: The switch-side interfaces carry segmentation-offload sends whole (tx-udp-segmentation, with the
    #: checksum offload it needs), as a NIC hands its host's receive offload one buffer: for a software switch
    #: that sends with --udp-segmentation (softswitch/raw_segmentation.py). Frames the switch sends plainly
    #: are untouched; the hosts' interfaces keep every offload off (they send real frames).
    switch_segmentation: bool = False
    #: A management network: each host also reaches the root namespace (where the controller runs) over a veth
    #: of its own, unshaped, at :attr:`controller_ip` (as a cluster's hosts reach its control plane off the data
    #: path). The data links are untouched.
    management: bool = False
    hosts: list[Host] = field(default_factory=list)

    @property
    def controller_ip(self) -> str:
        """The root namespace's address on the management network (on its loopback, routed to from every host)."""
        return f"10.{self.subnet + 100}.255.1"

    @property
    def switch_namespace(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def aggregator_ip(self) -> str:
        return f"10.{self.subnet}.0.254"

    def switch_interfaces(self) -> dict[int, str]:
        return {host.switch_port: host.switch_ifname for host in self.hosts}

    def build(self) -> Topology:
        if len(self.prefix) > 8:
            raise ValueError("prefix must be at most 8 characters (interface names are short)")
        remove_stale(self.prefix + "-")
        self._add_namespace(self.switch_namespace)
        for i in range(self.num_hosts):
            self.hosts.append(self._add_host(i))
        for host in self.hosts:
            self._static_arp(host)
            if self.shape.rate_mbit or self.shape.delay_ms:
                self._shape(host)
        if self.management:
            run(["ip", "addr", "replace", f"{self.controller_ip}/32", "dev", "lo"])
            for i, host in enumerate(self.hosts):
                self._add_management(i, host)
        return self

    def destroy(self) -> None:
        """Remove every namespace (their veths go with them) and the management address."""
        remove_stale(self.prefix + "-")
        if self.management:
            run(["ip", "addr", "del", f"{self.controller_ip}/32", "dev", "lo"], check=False)
        self.hosts.clear()

    def _add_management(self, i: int, host: Host) -> None:
        """Host ``i``'s management link: 10.<subnet+100>.<i>.2/30 in the host, .1 in the root namespace."""
        root_if, host_if = f"{self.prefix}m{i}", f"{self.prefix}n{i}"
        net = f"10.{self.subnet + 100}.{i}"
        run(["ip", "link", "del", root_if], check=False)  # a stale one from a run that died
        run(["ip", "link", "add", root_if, "type", "veth", "peer", "name", host_if])
        run(["ip", "link", "set", host_if, "netns", host.namespace])
        run(["ip", "addr", "add", f"{net}.1/30", "dev", root_if])
        run(["ip", "link", "set", root_if, "up"])
        run(ns_exec(host.namespace, ["ip", "addr", "add", f"{net}.2/30", "dev", host_if]))
        run(ns_exec(host.namespace, ["ip", "link", "set", host_if, "up"]))
        run(ns_exec(host.namespace, ["ip", "route", "add", f"{self.controller_ip}/32", "via", f"{net}.1",
                                     "dev", host_if]))

    def __enter__(self) -> Topology:
        try:
            return self.build()
        except BaseException:
            self.destroy()
            raise

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def set_tcp_congestion(self, algorithm: str) -> None:
        """Switch every host's TCP congestion control; connections opened (or accepted) from now on use it."""
        for host in self.hosts:
            set_congestion_control(host.namespace, f"10.{self.subnet}.0.0/24", host.ifname, host.ip, algorithm)
        self.tcp_congestion = algorithm

    def _add_namespace(self, name: str) -> None:
        run(["ip", "netns", "add", name])
        run(ns_exec(name, ["ip", "link", "set", "lo", "up"]))
        run(ns_exec(name, ["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"]), check=False)

    def _add_host(self, i: int) -> Host:
        namespace = f"{self.prefix}-h{i}"
        self._add_namespace(namespace)
        switch_if, host_if = f"{self.prefix}s{i}", f"{self.prefix}h{i}"
        run(["ip", "link", "add", switch_if, "type", "veth", "peer", "name", host_if])
        run(["ip", "link", "set", switch_if, "netns", self.switch_namespace])
        run(["ip", "link", "set", host_if, "netns", namespace])
        mac = f"02:00:00:{self.subnet:02x}:00:{i + 1:02x}"
        ip = f"10.{self.subnet}.0.{i + 1}"
        sw = self.switch_namespace
        for ns, ifname in ((sw, switch_if), (namespace, host_if)):
            run(ns_exec(ns, ["ip", "link", "set", ifname, "mtu", str(self.mtu)]))
            # Offloads would hand the switch oversized or checksum-less frames.
            run(ns_exec(ns, ["ethtool", "-K", ifname, "tx", "off", "rx", "off", "tso", "off", "gso", "off"]),
                check=False)
        if self.switch_segmentation:
            run(ns_exec(sw, ["ethtool", "-K", switch_if, "tx", "on", "gso", "on", "tx-udp-segmentation", "on"]),
                check=False)
        run(ns_exec(namespace, ["ip", "link", "set", host_if, "address", mac]))
        run(ns_exec(namespace, ["ip", "addr", "add", f"{ip}/24", "dev", host_if]))
        run(ns_exec(sw, ["ip", "link", "set", switch_if, "up"]))
        run(ns_exec(namespace, ["ip", "link", "set", host_if, "up"]))
        if self.tcp_congestion:
            set_congestion_control(namespace, f"10.{self.subnet}.0.0/24", host_if, ip, self.tcp_congestion)
        return Host(f"h{i}", namespace, host_if, ip, mac, switch_port=i + 1, switch_ifname=switch_if)

    def _static_arp(self, host: Host) -> None:
        for ip in [other.ip for other in self.hosts if other is not host] + [self.aggregator_ip]:
            run(ns_exec(host.namespace, ["ip", "neigh", "replace", ip, "lladdr", SWITCH_MAC,
                                         "dev", host.ifname, "nud", "permanent"]))

    def _shape(self, host: Host) -> None:
        """Shape both ends of the host's link, so each direction is shaped once."""
        for ns, ifname in ((host.namespace, host.ifname), (self.switch_namespace, host.switch_ifname)):
            shape_link(ns, ifname, self.shape, self.mtu)


def set_congestion_control(namespace: str, prefix: str, ifname: str, src: str, algorithm: str) -> None:
    """Make TCP over the host's subnet route use ``algorithm`` (``congctl`` on the route: a namespace may not set a
    default outside ``net.ipv4.tcp_allowed_congestion_control``, a route may). Both ends of a connection between
    two hosts follow it: the client's SYN and the server's accepted socket take it from their route."""
    available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
    if available.exists() and algorithm not in available.read_text().split():
        if shutil.which("modprobe"):
            run(["modprobe", f"tcp_{algorithm}"], check=False)
        if algorithm not in available.read_text().split():
            raise NetnsError(f"TCP congestion control {algorithm!r} is not available in this kernel "
                             f"(it has: {available.read_text().strip()})")
    run(ns_exec(namespace, ["ip", "route", "replace", prefix, "dev", ifname, "proto", "kernel", "scope", "link",
                            "src", src, "congctl", algorithm]))


#: The largest segment the stack hands a qdisc (the default gso_max_size; a veth keeps it).
GSO_MAX_BYTES = 65536


def shape_link(namespace: str, ifname: str, shape: LinkShape, mtu: int) -> str:
    """netem (rate + delay) where the kernel has it, else tbf (rate only); returns the qdisc used."""
    netem = ["netem", "limit", str(shape.queue_packets)]
    if shape.delay_ms:
        netem += ["delay", f"{shape.delay_ms}ms"]
    if shape.rate_mbit:
        netem += ["rate", f"{shape.rate_mbit}mbit"]
    result = run(ns_exec(namespace, ["tc", "qdisc", "replace", "dev", ifname, "root", *netem]), check=False)
    if result.returncode == 0:
        return "netem"
    if "unknown" not in result.stderr or not shape.rate_mbit:
        raise NetnsError(f"tc netem on {ifname}: {result.stderr.strip()}")
    # No sch_netem in this kernel: a token bucket gives the rate; the delay is not emulated. The bucket holds
    # the largest packet the stack can queue: TCP and UDP hand the qdisc segments of up to 64 kB (software
    # GSO runs after it, whatever the device's offloads), and a queued packet larger than the bucket is never
    # sent. A slower rate's smaller bucket would strand the queue's head until the rate rose again.
    rate_bytes = shape.rate_mbit * 1e6 / 8
    burst = max(GSO_MAX_BYTES + mtu + 14, int(rate_bytes / 250) + mtu)
    limit = shape.queue_packets * (mtu + 14)
    run(ns_exec(namespace, ["tc", "qdisc", "replace", "dev", ifname, "root", "tbf", "rate",
                            f"{shape.rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]))
    return "tbf"


@dataclass
class VethRig:
    """One namespace holding N veth pairs: switch side ``<prefix>s<i>``, test side ``<prefix>p<i>``.

    This is the PTF rig: the switch attaches to the ``s`` ends as ports 1..N and
    PTF sends and sniffs on the ``p`` ends, all inside one namespace.
    """

    prefix: str
    num_ports: int
    mtu: int = 9000

    @property
    def namespace(self) -> str:
        return f"{self.prefix}-ptf"

    def switch_interfaces(self) -> dict[int, str]:
        return {i: f"{self.prefix}s{i}" for i in range(1, self.num_ports + 1)}

    def test_interfaces(self) -> dict[int, str]:
        return {i: f"{self.prefix}p{i}" for i in range(1, self.num_ports + 1)}

    def build(self) -> VethRig:
        if len(self.prefix) > 10:
            raise ValueError("prefix must be at most 10 characters (interface names are short)")
        remove_stale(self.namespace)
        ns = self.namespace
        run(["ip", "netns", "add", ns])
        run(ns_exec(ns, ["ip", "link", "set", "lo", "up"]))
        run(ns_exec(ns, ["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"]), check=False)
        run(ns_exec(ns, ["sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"]), check=False)
        for i in range(1, self.num_ports + 1):
            sw, test = f"{self.prefix}s{i}", f"{self.prefix}p{i}"
            run(ns_exec(ns, ["ip", "link", "add", sw, "type", "veth", "peer", "name", test]))
            for ifname in (sw, test):
                run(ns_exec(ns, ["ip", "link", "set", ifname, "mtu", str(self.mtu)]))
                run(ns_exec(ns, ["ethtool", "-K", ifname, "tx", "off", "rx", "off", "tso", "off", "gso", "off"]),
                    check=False)
                run(ns_exec(ns, ["ip", "link", "set", ifname, "up"]))
        return self

    def destroy(self) -> None:
        remove_stale(self.namespace)

    def __enter__(self) -> VethRig:
        try:
            return self.build()
        except BaseException:
            self.destroy()
            raise

    def __exit__(self, *exc: object) -> None:
        self.destroy()
