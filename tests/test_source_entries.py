"""SourceGuard's entries from the controller's config: the aggregator address is the switch's alone, every
host address is bound to its port, and what cannot be bound (shared addresses, loopback) is left out."""

import copy

import yaml

from netagg import dataplane as dp
from netagg.controller.config import parse_config
from netagg.controller.switch_programmer import desired_state, ip_to_int, source_entries

BASE = yaml.safe_load((dp.REPO_ROOT / "configs" / "controller.yaml").read_text())


def _config(aggregator_ip: str, hosts: list[dict]):
    data = copy.deepcopy(BASE)
    data["switch"]["aggregator"]["ip"] = aggregator_ip
    data["hosts"] = hosts
    data["parameter_servers"] = [{"name": "ps0", "host": hosts[-1]["name"], "udp_port": 29000}]
    return parse_config(data, "<test>")


def _host(name: str, ip: str, port: int) -> dict:
    return {"name": name, "ip": ip, "mac": f"02:00:00:00:00:{port:02x}", "port": port}


def _by_address(entries) -> dict[str, tuple[str, dict]]:
    import ipaddress
    return {str(ipaddress.IPv4Address(dict(e.match)["ipv4_src"])): (e.action, dict(e.params)) for e in entries}


def test_cluster_binds_every_host_and_reserves_the_aggregator_address():
    config = _config("10.0.0.254", [_host("w0", "10.0.0.1", 1), _host("w1", "10.0.0.2", 2),
                                    _host("shared-a", "10.0.0.5", 3), _host("shared-b", "10.0.0.5", 4),
                                    _host("ps", "10.0.0.9", 9)])
    entries = _by_address(source_entries(config))
    assert entries == {
        "10.0.0.254": (dp.ACTION_SWITCH_ONLY, {}),
        "10.0.0.1": (dp.ACTION_BIND_TO_PORT, {"port": 1}),
        "10.0.0.2": (dp.ACTION_BIND_TO_PORT, {"port": 2}),
        "10.0.0.9": (dp.ACTION_BIND_TO_PORT, {"port": 9}),  # the PS: nobody else may send as it
    }  # 10.0.0.5 sits behind two ports: it cannot be bound to one
    # The desired state (what reconcile installs) carries them.
    state = desired_state(config, [])
    assert {k for k in state.entries if k[0] == dp.TABLE_SOURCES} == {
        (dp.TABLE_SOURCES, (("ipv4_src", ip_to_int(ip)),)) for ip in entries}


def test_loopback_deployment_has_nothing_to_bind():
    # Every process is 127.0.0.1 behind the one loopback port, the aggregator included.
    config = _config("127.0.0.1", [_host("local", "127.0.0.1", 1)])
    assert source_entries(config) == []
