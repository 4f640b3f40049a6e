"""WorkerConfig from DMLC_*/NETAGG_* environment variables."""

from __future__ import annotations

import pytest

from netagg.hoststack.envconfig import config_from_env
from netagg.jobconfig import ConfigError, Endpoint

WORKER = {
    "DMLC_ROLE": "worker",
    "DMLC_NUM_WORKER": "4",
    "NETAGG_JOB_ID": "12",
    "NETAGG_RANK": "2",
    "NETAGG_SLOTS": "64",
    "NETAGG_AGGREGATOR": "10.0.0.1:28900",
    "NETAGG_BIND": "10.0.0.7:40002",
}


def test_allreduce_worker():
    config = config_from_env(WORKER)
    assert (config.job_id, config.rank, config.num_workers, config.slot_count) == (12, 2, 4, 64)
    assert config.mode == "allreduce" and config.ps is None
    assert config.aggregator == Endpoint("10.0.0.1", 28900) and config.bind == Endpoint("10.0.0.7", 40002)
    assert config.secret == ""  # no secret given: the PS check is off
    assert config_from_env({**WORKER, "NETAGG_JOB_SECRET": "s3cr3t"}).secret == "s3cr3t"
    with pytest.raises(ConfigError, match="NETAGG_JOB_SECRET"):
        config_from_env({**WORKER, "NETAGG_JOB_SECRET": "two words"})


def test_fallback_worker_defaults_the_aggregator_to_the_ps_and_needs_no_slots():
    env = {**WORKER, "NETAGG_MODE": "fallback", "DMLC_PS_ROOT_URI": "10.0.0.9", "DMLC_PS_ROOT_PORT": "29001"}
    del env["NETAGG_AGGREGATOR"], env["NETAGG_SLOTS"]
    config = config_from_env(env)
    assert config.ps == Endpoint("10.0.0.9", 29001) == config.aggregator
    assert config.slot_count == 0


def test_server_role_defaults_rank_and_bind():
    env = {"DMLC_ROLE": "server", "DMLC_NUM_WORKER": "2", "NETAGG_JOB_ID": "3", "NETAGG_MODE": "ps",
           "NETAGG_SLOTS": "8", "NETAGG_AGGREGATOR": "127.0.0.1:28900", "DMLC_PS_ROOT_URI": "127.0.0.1",
           "DMLC_PS_ROOT_PORT": "29001"}
    config = config_from_env(env)
    assert config.rank == 0 and config.bind == config.ps == Endpoint("127.0.0.1", 29001)


@pytest.mark.parametrize(("change", "message"), [
    ({"NETAGG_JOB_ID": None}, "NETAGG_JOB_ID: not set"),
    ({"NETAGG_RANK": "two"}, "NETAGG_RANK: expected an integer"),
    ({"NETAGG_RANK": "4"}, "NETAGG_RANK: 4 not in 0..3"),
    ({"DMLC_NUM_WORKER": "40"}, "DMLC_NUM_WORKER: 40 not in 1..32"),
    ({"NETAGG_SLOTS": None}, "NETAGG_SLOTS: not set"),
    ({"NETAGG_BIND": "10.0.0.7"}, "NETAGG_BIND: expected host:port"),
    ({"NETAGG_BIND": None}, "NETAGG_BIND: not set"),
    ({"NETAGG_AGGREGATOR": "h:0"}, "NETAGG_AGGREGATOR: expected host:port"),
    ({"NETAGG_AGGREGATOR": None}, "NETAGG_AGGREGATOR: not set"),
    ({"NETAGG_MODE": "ring"}, "NETAGG_MODE: 'ring' is not one of"),
    ({"NETAGG_MODE": "ps"}, "DMLC_PS_ROOT_URI: not set"),
    ({"DMLC_ROLE": "scheduler"}, "DMLC_ROLE: 'scheduler'"),
    ({"DMLC_PS_ROOT_URI": "10.0.0.9"}, "DMLC_PS_ROOT_PORT: not set"),
    ({"DMLC_PS_ROOT_URI": "10.0.0.9", "DMLC_PS_ROOT_PORT": "70000"}, "DMLC_PS_ROOT_PORT: 70000"),
])
def test_errors_name_the_variable(change, message):
    env = dict(WORKER)
    for key, value in change.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    with pytest.raises(ConfigError, match=message):
        config_from_env(env)
