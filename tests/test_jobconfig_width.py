"""A worker's job config carries its job's width (docs/protocol.md, "Wide packets"): YAML and the environment."""

from __future__ import annotations

import inspect

import pytest
import yaml

from netagg.jobconfig import ConfigError, Endpoint, WorkerConfig, check_width, parse_width


def _config(**kwargs) -> WorkerConfig:
    return WorkerConfig(job_id=3, rank=1, num_workers=4, slot_count=16, mode="allreduce",
                        aggregator=Endpoint("10.0.0.254", 28900), bind=Endpoint("10.0.0.2", 40001), **kwargs)


def test_the_width_round_trips_through_yaml(tmp_path):
    wide = _config(width=256)
    path = tmp_path / "worker.yaml"
    wide.save(path)
    assert "width: 256" in path.read_text()
    assert WorkerConfig.load(path) == wide and WorkerConfig.load(path).width == 256
    assert WorkerConfig.from_dict(yaml.safe_load(_config().to_yaml())).width == 64


def test_a_config_without_a_width_is_narrow():
    data = {"job_id": 3, "rank": 0, "num_workers": 2, "slot_count": 8, "mode": "allreduce",
            "aggregator": {"host": "10.0.0.254", "port": 28900}, "bind": {"host": "10.0.0.2", "port": 40001}}
    assert WorkerConfig.from_dict(data, "old.yaml").width == 64


@pytest.mark.parametrize("width", [128, 0, 512, True, "256", 64.0])
def test_only_64_and_256_are_widths(width):
    with pytest.raises(ConfigError, match=r"worker\.yaml: width: expected values per packet, one of 64, 256"):
        WorkerConfig.from_dict({**yaml.safe_load(_config().to_yaml()), "width": width}, "worker.yaml")
    with pytest.raises(ConfigError, match="width: expected values per packet"):
        _config(width=width)


def test_a_fallback_job_keeps_its_width():
    config = WorkerConfig(job_id=3, rank=0, num_workers=2, slot_count=0, mode="fallback",
                          aggregator=Endpoint("10.0.0.9", 29000), bind=Endpoint("10.0.0.2", 40001),
                          ps=Endpoint("10.0.0.9", 29000), width=256)
    assert WorkerConfig.from_dict(yaml.safe_load(config.to_yaml())).width == 256


def test_parse_width_names_the_variable():
    assert (parse_width("64"), parse_width(" 256 "), check_width(256)) == (64, 256, 256)
    for text in ("128", "wide", ""):
        with pytest.raises(ConfigError, match=r"^NETAGG_WIDTH: expected values per packet, one of 64, 256"):
            parse_width(text)


def test_the_width_from_the_environment():
    from netagg.hoststack import envconfig

    if "NETAGG_WIDTH" not in inspect.getsource(envconfig):
        pytest.skip("hoststack/envconfig.py does not read NETAGG_WIDTH yet (jobconfig.parse_width is its parser)")
    env = {"NETAGG_JOB_ID": "3", "DMLC_NUM_WORKER": "2", "NETAGG_RANK": "1", "NETAGG_SLOTS": "8",
           "NETAGG_AGGREGATOR": "10.0.0.254:28900", "NETAGG_BIND": "10.0.0.2:40001"}
    assert envconfig.config_from_env(env).width == 64
    assert envconfig.config_from_env({**env, "NETAGG_WIDTH": "256"}).width == 256
    with pytest.raises(ConfigError, match="NETAGG_WIDTH"):
        envconfig.config_from_env({**env, "NETAGG_WIDTH": "128"})
