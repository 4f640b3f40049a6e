"""Controller configuration: the shipped file loads; each mistake is one clear error naming file and key."""

import copy

import pytest
import yaml

from netagg import dataplane as dp
from netagg.controller.config import load_config, parse_config
from netagg.jobconfig import ConfigError, Endpoint, WorkerConfig

SHIPPED = dp.REPO_ROOT / "configs" / "controller.yaml"


def test_shipped_config_loads():
    config = load_config(SHIPPED)
    assert config.grpc_address == "127.0.0.1:9559"
    assert config.hosts["local"].port == 1
    assert config.parameter_servers["ps0"].udp_port == 29000
    assert set(config.tenants.values()) == {"demo", "alice"}
    assert config.worker_address == Endpoint("127.0.0.1", 0) and config.move_wait_seconds == 10.0


BASE = yaml.safe_load(SHIPPED.read_text())


def _with(path: str, value):
    data = copy.deepcopy(BASE)
    node = data
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    last = keys[-1]
    if value is KeyError:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


@pytest.mark.parametrize(("path", "value", "key", "problem"), [
    ("switch.grpc_adress", "x:1", "switch.grpc_adress", "unknown key"),
    ("switch.grpc_address", "nohostport", "switch.grpc_address", "host:port"),
    ("switch.device_id", "one", "switch.device_id", "expected int"),
    ("switch.aggregator.ip", "300.1.1.1", "switch.aggregator.ip", "not an IPv4"),
    ("switch.aggregator.mac", "02:00", "switch.aggregator.mac", "not a MAC"),
    ("switch.p4info", "missing.txtpb", "switch.p4info", "no such file"),
    ("slots.capacity", 0, "slots.capacity", ">= 1"),
    ("slots.min_per_job", 5000, "slots.min_per_job", "must be in"),
    ("controller.admin_token", "short", "controller.admin_token", "at least 8"),
    ("controller.database", KeyError, "controller.database", "missing"),
    ("tenants.alice.token", "demo-tenant-token", "tenants.alice.token", "already used"),
    ("hosts.0.port", 600, "hosts[0].port", "switch port"),
    ("hosts.0.colour", "red", "hosts[0].colour", "unknown key"),
    ("parameter_servers.0.host", "elsewhere", "parameter_servers[0].host", "unknown host"),
    ("jobs.lease_seconds", -1, "jobs.lease_seconds", "> 0"),
    ("hosts.0.link_mbit", 0, "hosts[0].link_mbit", "> 0"),
    ("hosts.0.link_mbit", "1G", "hosts[0].link_mbit", "expected a number"),
    ("slots.target_rtt_ms", 0, "slots.target_rtt_ms", "> 0"),
    ("slots.target_rtt_ms", "5 ms", "slots.target_rtt_ms", "expected float"),
    ("slots.target_rt_ms", 5, "slots.target_rt_ms", "unknown key"),
    ("controller.worker_address", "127.0.0.1", "controller.worker_address", "host:port"),
    ("controller.worker_address", "127.0.0.1:70000", "controller.worker_address", "host:port"),
    ("controller.worker_address", "ctl.example:28950", "controller.worker_address", "not an IPv4"),
    ("slots.move_wait_seconds", -1, "slots.move_wait_seconds", ">= 0"),
])
def test_each_mistake_names_file_key_and_problem(path, value, key, problem):
    with pytest.raises(ConfigError) as err:
        parse_config(_with(path, value), "configs/test.yaml")
    message = str(err.value)
    assert message.startswith(f"configs/test.yaml: {key}: "), message
    assert problem in message


def test_unreadable_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("switch: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_worker_config_roundtrip_and_errors(tmp_path):
    cfg = WorkerConfig(job_id=3, rank=1, num_workers=4, slot_count=16, mode="ps",
                       aggregator=Endpoint("127.0.0.1", 28900), bind=Endpoint("127.0.0.1", 40001),
                       ps=Endpoint("127.0.0.1", 29000), tenant="alice")
    path = tmp_path / "w.yaml"
    cfg.save(path)
    assert WorkerConfig.load(path) == cfg
    data = yaml.safe_load(path.read_text())
    with pytest.raises(ConfigError, match=r"w.yaml: rank: 4 not in 0..3"):
        WorkerConfig.from_dict({**data, "rank": 4}, "w.yaml")
    with pytest.raises(ConfigError, match="unknown key"):
        WorkerConfig.from_dict({**data, "colour": 1}, "w.yaml")
    with pytest.raises(ConfigError, match="bind: expected"):
        WorkerConfig.from_dict({**data, "bind": "127.0.0.1"}, "w.yaml")
    with pytest.raises(ConfigError, match="needs the parameter server"):
        WorkerConfig.from_dict({**data, "ps": None}, "w.yaml")
