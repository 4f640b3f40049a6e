"""The controller's YAML configuration, validated on load.

Every problem is reported as one :class:`ConfigError` naming the file, the key
(as a dotted path) and what is wrong with it.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from netagg import dataplane as dp
from netagg import wire
from netagg.jobconfig import ConfigError, Endpoint, read_yaml

if TYPE_CHECKING:
    from netagg.controller.topology import Topology

_MAC = re.compile(r"^([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}$")

#: The width (values per packet) of a job whose create names none, per switch target (``switch.target``):
#: the software target (each engine) and BMv2 sum a wide packet's 256 values in one pass; Tofino's twin takes one
#: recirculation per chunk, about twice the recirculated bytes per value (docs/tofino.md, "Wide packets"), so its
#: jobs are narrow unless asked otherwise. The one table of defaults.
DEFAULT_WIDTHS: dict[str, int] = {
    "soft": wire.WIDE_K,
    "soft-ref": wire.WIDE_K,
    "soft-sharded": wire.WIDE_K,
    "bmv2": wire.WIDE_K,
    "tofino": wire.K,
}
#: The switch targets a controller may drive.
TARGETS = tuple(DEFAULT_WIDTHS)


def default_width(target: str) -> int:
    """The width of a job on ``target`` whose create names none (:data:`DEFAULT_WIDTHS`)."""
    try:
        return DEFAULT_WIDTHS[target]
    except KeyError:
        raise ValueError(f"unknown switch target {target!r} (one of {', '.join(TARGETS)})") from None


@dataclass(frozen=True)
class HostConfig:
    """An end host attached to a switch port."""

    name: str
    ip: str
    mac: str
    port: int
    #: The rate of the host's link to its switch port, in Mbit/s (``link_mbit``); None: unknown. The
    #: controller sizes a job's slots to its hosts' slowest link when the create names none (``sizing.py``).
    link_mbit: float | None = None


@dataclass(frozen=True)
class PsConfig:
    """A parameter server endpoint jobs may use."""

    name: str
    host: str
    udp_port: int


@dataclass(frozen=True)
class ControllerConfig:
    """Everything the controller daemon reads from its YAML file."""

    source: str
    grpc_address: str
    device_id: int
    election_id: int
    p4info: Path
    bmv2_json: Path | None
    aggregator_ip: str
    aggregator_mac: str
    aggregator_port: int
    slot_capacity: int
    min_slots: int
    default_lease_seconds: float
    database: Path
    api_socket: Path
    admin_token: str
    tenants: dict[str, str]  # token -> tenant
    hosts: dict[str, HostConfig] = field(default_factory=dict)
    parameter_servers: dict[str, PsConfig] = field(default_factory=dict)
    #: ``host:port`` of the Prometheus endpoint (docs/operations.md); None: no endpoint.
    metrics_address: str | None = None
    #: How long ``controller run`` waits for an unreachable switch at start before it gives up (exit 6);
    #: None: forever (it serves the API meanwhile and connects when the switch appears).
    startup_wait_seconds: float | None = None
    #: A tree of switches (``topology:``, docs/hierarchy.md): the controller drives every switch of it, and
    #: its hosts are the hosts; None: one switch (``switch:``). With a topology, ``grpc_address``,
    #: ``device_id`` and the aggregator fields are the root switch's.
    topology: Topology | None = None
    #: The switch target (``switch.target``, :data:`TARGETS`): it decides the default job width. Left out:
    #: ``bmv2`` with ``switch.bmv2_json``, else ``soft``. Under a topology, every switch's.
    target: str = "soft"
    #: ``slots.target_rtt_ms``: the round trip a job's window must cover when the controller chooses its slots
    #: (the path's round trip plus queueing and a busy host's scheduling delays; ``sizing.py``).
    target_rtt_ms: float = 7.5
    #: Per tenant (by name): its quotas and weight (``tenants.<name>``: max_jobs, max_cells, weight).
    tenant_limits: dict[str, TenantLimits] = field(default_factory=dict)
    #: ``slots.fair_share``: no tenant's jobs hold more than its weighted share of the switch's cells.
    fair_share: bool = False
    #: ``controller.worker_address`` (host:port): the endpoint the jobs' workers reach the controller at to follow
    #: moves of their slots (controller/moves.py); its port 0: any free one. None: no job's slots ever move.
    worker_address: Endpoint | None = None
    #: ``slots.move_wait_seconds``: how long a new job's create waits for running jobs to shrink to make room.
    move_wait_seconds: float = 10.0

    def tenant_share(self, tenant: str) -> int:
        """The cells ``tenant``'s jobs may hold together under ``fair_share``: the capacity split among the
        configured tenants by weight (rounded down)."""
        weights = {name: limits.weight for name, limits in self.tenant_limits.items()}
        total = sum(weights.values())
        return int(self.slot_capacity * weights.get(tenant, 1.0) / total) if total > 0 else self.slot_capacity

    @property
    def default_width(self) -> int:
        """The width of a job whose create names none: the target's (:func:`default_width`)."""
        return default_width(self.target)

    def host_by_ip(self, ip: str) -> HostConfig | None:
        return next((h for h in self.hosts.values() if h.ip == ip), None)


_SCHEMA: dict[str, set[str]] = {
    "": {"switch", "slots", "jobs", "controller", "tenants", "hosts", "parameter_servers", "topology"},
    "switch": {"grpc_address", "device_id", "election_id", "p4info", "bmv2_json", "aggregator",
               "startup_wait_seconds", "target"},
    "switch.aggregator": {"ip", "mac", "udp_port"},
    "slots": {"capacity", "min_per_job", "target_rtt_ms", "fair_share", "move_wait_seconds"},
    "jobs": {"lease_seconds"},
    "controller": {"database", "api_socket", "admin_token", "metrics_address", "worker_address"},
    "hosts.*": {"name", "ip", "mac", "port", "link_mbit"},
    "parameter_servers.*": {"name", "host", "udp_port"},
}


class _Reader:
    """Typed access to a nested mapping with errors that name file and key."""

    def __init__(self, source: str, data: Any) -> None:
        self.source = source
        self.data = data

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: {key}: {problem}")

    def section(self, key: str, required: bool = True) -> dict:
        value = self._get(key)
        if value is None:
            if required:
                raise self.fail(key, "missing section")
            return {}
        if not isinstance(value, dict):
            raise self.fail(key, f"expected a mapping, got {type(value).__name__}")
        return value

    def _get(self, key: str) -> Any:
        node = self.data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def value(self, key: str, kind: type | tuple[type, ...], default: Any = ..., node: dict | None = None,
              name: str | None = None) -> Any:
        container = node if node is not None else None
        raw = container.get(key.rsplit(".", 1)[-1]) if container is not None else self._get(key)
        shown = name or key
        if raw is None:
            if default is ...:
                raise self.fail(shown, "missing")
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(raw, bool) and bool not in kinds:
            raise self.fail(shown, f"expected {kinds[0].__name__}, got {raw!r}")
        if float in kinds and isinstance(raw, int):
            raw = float(raw)
        if not isinstance(raw, kinds):
            raise self.fail(shown, f"expected {kinds[0].__name__}, got {raw!r}")
        return raw


def _check_keys(reader: _Reader) -> None:
    data = reader.data
    if not isinstance(data, dict):
        raise ConfigError(f"{reader.source}: expected a mapping at the top level")
    for path, allowed in _SCHEMA.items():
        if path.endswith(".*"):
            items = data.get(path[:-2]) or []
            if not isinstance(items, list):
                raise reader.fail(path[:-2], "expected a list")
            for i, item in enumerate(items):
                if not isinstance(item, dict):
                    raise reader.fail(f"{path[:-2]}[{i}]", "expected a mapping")
                for key in item:
                    if key not in allowed:
                        allowed_text = ", ".join(sorted(allowed))
                        raise reader.fail(f"{path[:-2]}[{i}].{key}", f"unknown key (allowed: {allowed_text})")
            continue
        node = reader._get(path) if path else data
        if isinstance(node, dict):
            for key in node:
                if key not in allowed and path != "tenants":
                    where = f"{path}.{key}" if path else key
                    raise reader.fail(where, f"unknown key (allowed: {', '.join(sorted(allowed))})")


def _host_port(reader: _Reader, key: str, text: str, host_pattern: str) -> tuple[str, int]:
    """``text`` as HOST:PORT, its host matching ``host_pattern`` and its port in 0..65535."""
    host, sep, port = text.rpartition(":")
    if not (sep and re.match(host_pattern, host) and port.isdigit() and int(port) < 65536):
        raise reader.fail(key, f"{text!r} is not host:port (port 0..65535)")
    return host, int(port)


def _ip(reader: _Reader, key: str, value: str) -> str:
    try:
        return str(ipaddress.IPv4Address(value))
    except ValueError:
        raise reader.fail(key, f"{value!r} is not an IPv4 address") from None


def _mac(reader: _Reader, key: str, value: str) -> str:
    if not _MAC.match(value):
        raise reader.fail(key, f"{value!r} is not a MAC address like 02:00:00:00:00:01")
    return value.lower()


def _relative(base: Path, value: str) -> Path:
    path = Path(value)
    return path if path.is_absolute() else (base / path)


def load_config(path: str | Path) -> ControllerConfig:
    """Read and validate a controller configuration file."""
    return parse_config(read_yaml(path), str(path), base=dp.REPO_ROOT)


def parse_config(data: Any, source: str, base: Path = dp.REPO_ROOT) -> ControllerConfig:
    """Validate an already-parsed configuration mapping; relative paths resolve against ``base``."""
    r = _Reader(source, data)
    _check_keys(r)
    r.section("switch")
    topology = _topology(r, base)
    if topology is None:
        grpc_address = r.value("switch.grpc_address", str)
        if not (re.match(r"^[\w.\-\[\]:]+:\d+$", grpc_address) or re.match(r"^unix:/\S+$", grpc_address)):
            raise r.fail("switch.grpc_address", f"{grpc_address!r} is not host:port or unix:/path")
        device_id = r.value("switch.device_id", int, 1)
    else:
        root = next(s for s in topology.switches.values() if s.parent is None)
        grpc_address, device_id = root.grpc_address, root.device_id
    election_id = r.value("switch.election_id", int, 1)
    if election_id < 1:
        raise r.fail("switch.election_id", "must be >= 1")
    p4info = _relative(base, r.value("switch.p4info", str, str(dp.P4INFO_PATH)))
    if not p4info.is_file():
        raise r.fail("switch.p4info", f"no such file {p4info}")
    bmv2_json_value = r.value("switch.bmv2_json", str, None)
    bmv2_json = _relative(base, bmv2_json_value) if bmv2_json_value else None
    target = r.value("switch.target", str, "bmv2" if bmv2_json is not None else "soft")
    if target not in DEFAULT_WIDTHS:
        raise r.fail("switch.target", f"{target!r} is not one of {', '.join(TARGETS)}")
    startup_wait = r.value("switch.startup_wait_seconds", float, None)
    if startup_wait is not None and startup_wait < 0:
        raise r.fail("switch.startup_wait_seconds", "must be >= 0 (or left out: wait forever)")
    if topology is None:
        r.section("switch.aggregator")
        aggregator_ip = _ip(r, "switch.aggregator.ip", r.value("switch.aggregator.ip", str))
        aggregator_mac = _mac(r, "switch.aggregator.mac",
                              r.value("switch.aggregator.mac", str, "02:00:00:00:00:fe"))
        aggregator_port = r.value("switch.aggregator.udp_port", int, wire.NETAGG_UDP_PORT)
        if not 0 < aggregator_port < 65536:
            raise r.fail("switch.aggregator.udp_port", f"{aggregator_port} is not a UDP port")
    else:
        aggregator_ip, aggregator_mac, aggregator_port = root.aggregator_ip, root.aggregator_mac, wire.NETAGG_UDP_PORT

    r.section("slots", required=False)
    capacity = r.value("slots.capacity", int, 4096)
    min_slots = r.value("slots.min_per_job", int, 1)
    if capacity < 1:
        raise r.fail("slots.capacity", "must be >= 1")
    if not 1 <= min_slots <= capacity:
        raise r.fail("slots.min_per_job", f"must be in 1..{capacity}")
    target_rtt_ms = r.value("slots.target_rtt_ms", float, 7.5)
    if not (math.isfinite(target_rtt_ms) and target_rtt_ms > 0):
        raise r.fail("slots.target_rtt_ms", f"must be a number of milliseconds > 0, got {target_rtt_ms!r}")
    lease = r.value("jobs.lease_seconds", float, 600.0)
    if lease <= 0:
        raise r.fail("jobs.lease_seconds", "must be > 0")

    r.section("controller")
    database = _relative(base, r.value("controller.database", str))
    api_socket = _relative(base, r.value("controller.api_socket", str))
    admin_token = r.value("controller.admin_token", str)
    if len(admin_token) < 8:
        raise r.fail("controller.admin_token", "must be at least 8 characters")
    metrics_address = r.value("controller.metrics_address", str, None)
    if metrics_address is not None:
        _host_port(r, "controller.metrics_address", metrics_address, r"^[\w.\-\[\]:]*$")
    worker_text = r.value("controller.worker_address", str, None)
    worker_address = None
    if worker_text is not None:
        host, port = _host_port(r, "controller.worker_address", worker_text, r".")
        worker_address = Endpoint(_ip(r, "controller.worker_address", host), port)
    move_wait = r.value("slots.move_wait_seconds", float, 10.0)
    if not (math.isfinite(move_wait) and move_wait >= 0):
        raise r.fail("slots.move_wait_seconds", f"must be seconds >= 0, got {move_wait!r}")

    tenants: dict[str, str] = {}
    limits: dict[str, TenantLimits] = {}
    for tenant, spec in r.section("tenants", required=False).items():
        if not isinstance(spec, dict) or "token" not in spec or not set(spec) <= _TENANT_KEYS \
                or not isinstance(spec["token"], str):
            raise r.fail(f"tenants.{tenant}", "expected {token: <string>} and optionally max_jobs, max_cells, weight")
        token = spec["token"]
        if len(token) < 8:
            raise r.fail(f"tenants.{tenant}.token", "must be at least 8 characters")
        if token in tenants or token == admin_token:
            raise r.fail(f"tenants.{tenant}.token", "is already used by another tenant or the admin")
        tenants[token] = str(tenant)
        limits[str(tenant)] = _tenant_limits(r, str(tenant), spec)
    fair_share = r.value("slots.fair_share", bool, False)

    hosts: dict[str, HostConfig] = {}
    if topology is not None:
        hosts = {h.name: HostConfig(h.name, h.ip, h.mac, h.port, h.link_mbit) for h in topology.hosts.values()}
    for i, item in enumerate(data.get("hosts") or []):
        where = f"hosts[{i}]"
        name = r.value("name", str, node=item, name=f"{where}.name")
        if name in hosts:
            raise r.fail(f"{where}.name", f"duplicate host {name!r}")
        port = r.value("port", int, node=item, name=f"{where}.port")
        if not 0 <= port < dp.DROP_PORT:
            raise r.fail(f"{where}.port", f"switch port {port} not in 0..{dp.DROP_PORT - 1}")
        hosts[name] = HostConfig(
            name=name,
            ip=_ip(r, f"{where}.ip", r.value("ip", str, node=item, name=f"{where}.ip")),
            mac=_mac(r, f"{where}.mac", r.value("mac", str, node=item, name=f"{where}.mac")),
            port=port,
            link_mbit=link_mbit(item.get("link_mbit"), f"{r.source}: {where}.link_mbit"),
        )
    servers: dict[str, PsConfig] = {}
    for i, item in enumerate(data.get("parameter_servers") or []):
        where = f"parameter_servers[{i}]"
        name = r.value("name", str, node=item, name=f"{where}.name")
        host = r.value("host", str, node=item, name=f"{where}.host")
        if host not in hosts:
            raise r.fail(f"{where}.host", f"unknown host {host!r} (define it under hosts)")
        udp_port = r.value("udp_port", int, node=item, name=f"{where}.udp_port")
        if not 0 < udp_port < 65536:
            raise r.fail(f"{where}.udp_port", f"{udp_port} is not a UDP port")
        servers[name] = PsConfig(name, host, udp_port)
    return ControllerConfig(
        source=source, grpc_address=grpc_address, device_id=device_id, election_id=election_id,
        p4info=p4info, bmv2_json=bmv2_json, aggregator_ip=aggregator_ip, aggregator_mac=aggregator_mac,
        aggregator_port=aggregator_port, slot_capacity=capacity, min_slots=min_slots,
        default_lease_seconds=lease, database=database, api_socket=api_socket, admin_token=admin_token,
        tenants=tenants, hosts=hosts, parameter_servers=servers, metrics_address=metrics_address,
        startup_wait_seconds=startup_wait, topology=topology, target=target, target_rtt_ms=target_rtt_ms,
        tenant_limits=limits, fair_share=fair_share, worker_address=worker_address, move_wait_seconds=move_wait,
    )


_TENANT_KEYS = {"token", "max_jobs", "max_cells", "weight"}


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's quotas (None: no limit) and its weight in the fair share (``slots.fair_share``)."""

    max_jobs: int | None = None
    #: Switch memory cells its jobs may hold together (a narrow slot is one cell, a wide one four).
    max_cells: int | None = None
    weight: float = 1.0


def _tenant_limits(r: _Reader, tenant: str, spec: dict) -> TenantLimits:
    where = f"tenants.{tenant}"
    max_jobs = r.value("max_jobs", int, None, node=spec, name=f"{where}.max_jobs")
    if max_jobs is not None and max_jobs < 1:
        raise r.fail(f"{where}.max_jobs", f"must be >= 1, got {max_jobs}")
    max_cells = r.value("max_cells", int, None, node=spec, name=f"{where}.max_cells")
    if max_cells is not None and max_cells < 1:
        raise r.fail(f"{where}.max_cells", f"must be >= 1, got {max_cells}")
    weight = r.value("weight", float, 1.0, node=spec, name=f"{where}.weight")
    if not (math.isfinite(weight) and weight > 0):
        raise r.fail(f"{where}.weight", f"must be a number > 0, got {weight!r}")
    return TenantLimits(max_jobs, max_cells, weight)


def link_mbit(value: Any, where: str) -> float | None:
    """A host's ``link_mbit`` checked: a positive, finite number of Mbit/s (None: left out). ``where`` names
    the file and key in the ConfigError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: expected a number of Mbit/s, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{where}: must be a number of Mbit/s > 0, got {value!r}")
    return float(value)


def _topology(r: _Reader, base: Path) -> Topology | None:
    """The ``topology:`` file, validated; with it, the switches and hosts are the topology's, so ``switch:``
    keeps only what is the same for every switch (program, election id, start-up wait)."""
    value = r.value("topology", str, None)
    if value is None:
        return None
    from netagg.controller.topology import load_topology  # the topology module needs this one's types

    for key in ("grpc_address", "device_id", "aggregator"):
        if r._get(f"switch.{key}") is not None:
            raise r.fail(f"switch.{key}", "not with a topology (each switch's is in the topology file)")
    if r.data.get("hosts"):
        raise r.fail("hosts", "not with a topology (the hosts are the topology file's)")
    path = _relative(base, value)
    if not path.is_file():
        raise r.fail("topology", f"no such file {path}")
    try:
        return load_topology(path)
    except ConfigError as err:
        raise r.fail("topology", str(err)) from None
