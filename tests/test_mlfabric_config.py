"""MLfabric job options: WorkerConfig fields, the SQLite migration, and `netagg job create --sync ...` end to end."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest
import yaml

from netagg import dataplane as dp
from netagg.controller.cli import EXIT_CODES, main
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.controller.store import JobRecord, JobStore, PsEndpoint, WorkerEndpoint
from netagg.jobconfig import ConfigError, Endpoint, WorkerConfig
from netagg.mlfabric.async_server import FabricServer
from netagg.mlfabric.worker import FabricClient

from conftest import TOKENS, free_udp_port

pytestmark = pytest.mark.timeout(120)

BASE = dict(job_id=3, rank=1, num_workers=4, slot_count=16, mode="ps", aggregator=Endpoint("127.0.0.1", 28900),
            bind=Endpoint("127.0.0.1", 40001), ps=Endpoint("127.0.0.1", 29000))


def test_worker_config_carries_the_mlfabric_options_and_old_yaml_still_loads(tmp_path):
    cfg = WorkerConfig(**BASE, update_mode="async", delay_bound=4, schedule="mlfabric",
                       replicas=(Endpoint("127.0.0.1", 29001), Endpoint("127.0.0.2", 29002)))
    path = tmp_path / "w.yaml"
    cfg.save(path)
    assert WorkerConfig.load(path) == cfg
    data = yaml.safe_load(path.read_text())
    assert data["replicas"] == [{"host": "127.0.0.1", "port": 29001}, {"host": "127.0.0.2", "port": 29002}]
    # A config written before these options existed loads with the defaults: sync, no bound, fifo, no replicas.
    old = {k: v for k, v in data.items() if k not in ("update_mode", "delay_bound", "schedule", "replicas")}
    loaded = WorkerConfig.from_dict(old, "old.yaml")
    assert (loaded.update_mode, loaded.delay_bound, loaded.schedule, loaded.replicas) == ("sync", None, "fifo", ())
    for change, message in [
        ({"update_mode": "eventually"}, "update_mode: 'eventually' is not one of sync, async"),
        ({"update_mode": "sync", "schedule": "fifo"}, "delay_bound: only an async job has a delay bound"),
        ({"delay_bound": -1}, "delay_bound: expected an integer >= 0"),
        ({"delay_bound": None, "update_mode": "sync"}, "schedule: mlfabric needs update_mode async"),
        ({"schedule": "random"}, "schedule: 'random' is not one of fifo, mlfabric"),
        ({"replicas": [{"host": "h"}]}, r"replicas\[0\]: expected \{host: ..., port: ...\}"),
        ({"replicas": "h:1"}, "replicas: expected a list"),
        ({"mode": "allreduce", "ps": None}, "async or replicated job needs the parameter server"),
        ({"switch_aggregation": True}, "switch_aggregation: needs schedule mlfabric and mode allreduce"),
        ({"switch_aggregation": "yes"}, "switch_aggregation: expected true or false"),
        ({"senders": -1}, r"senders: expected an integer in 0\.\."),
        ({"senders": True}, r"senders: expected an integer in 0\.\."),
        ({"senders": 1}, "senders: a one-way job needs mode allreduce"),
    ]:
        with pytest.raises(ConfigError, match=message):
            WorkerConfig.from_dict({**data, **change}, "w.yaml")


OLD_SCHEMA = """
CREATE TABLE jobs (
    job_id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL,
    mode TEXT NOT NULL CHECK (mode IN ('allreduce', 'ps', 'fallback')),
    state TEXT NOT NULL CHECK (state IN ('installing', 'active', 'deleting')),
    slot_base INTEGER NOT NULL, slot_count INTEGER NOT NULL, slots_wanted INTEGER NOT NULL,
    generation INTEGER NOT NULL UNIQUE, workers TEXT NOT NULL, ps TEXT, lease_seconds REAL NOT NULL,
    lease_expires REAL NOT NULL, created REAL NOT NULL, counter_base TEXT NOT NULL DEFAULT '{}',
    note TEXT NOT NULL DEFAULT ''
);
CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT INTO meta (key, value) VALUES ('next_generation', 2);
INSERT INTO jobs VALUES (1, 'alice', 'old', 'ps', 'active', 0, 8, 8, 1,
    '[{"rank": 0, "host": "local", "ip": "127.0.0.1", "udp_port": 40000}]',
    '{"host": "local", "ip": "127.0.0.1", "udp_port": 29001}', 60, 1e12, 1, '{}', '');
"""


def test_an_old_database_gains_the_new_columns_and_keeps_its_jobs(tmp_path):
    path = tmp_path / "ctl.db"
    with sqlite3.connect(path) as conn:
        conn.executescript(OLD_SCHEMA)
    store = JobStore(path)
    old = store.get(1)
    assert old is not None and old.name == "old"
    assert (old.update_mode, old.delay_bound, old.schedule, old.replicas) == ("sync", None, "fifo", [])
    assert old.switch_aggregation is False
    assert old.secret == ""  # made before secrets: its servers keep accepting requests without one
    with store.transaction() as conn:
        store.insert(conn, JobRecord(
            job_id=2, tenant="alice", name="new", mode="ps", state="active", slot_base=8, slot_count=8,
            slots_wanted=8, generation=store.next_generation(conn),
            workers=[WorkerEndpoint(0, "local", "127.0.0.1", 40001)], ps=PsEndpoint("local", "127.0.0.1", 29001),
            lease_seconds=60, lease_expires=1e12, created=2, update_mode="async", delay_bound=4,
            schedule="mlfabric", replicas=[PsEndpoint("local", "127.0.0.1", 29002)], secret="s3cret-of-job-2"))
    store.close()
    reopened = JobStore(path)  # the migration runs again and finds nothing to do
    new = reopened.get(2)
    assert (new.update_mode, new.delay_bound, new.schedule) == ("async", 4, "mlfabric")
    assert new.replicas == [PsEndpoint("local", "127.0.0.1", 29002)]
    assert new.secret == "s3cret-of-job-2"  # survives a restart: configs written before stay valid
    assert "secret" not in new.to_dict() and "s3cret" not in repr(new)
    assert reopened.get(1).update_mode == "sync"
    reopened.close()


def _cli(capsys, controller, *args: str) -> tuple[int, str, str]:
    code = main(["--config", str(controller.config), "--json", "--token", TOKENS["alice"], *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_job_create_stores_the_options_and_the_worker_config_runs_a_replicated_async_ps(capsys, soft_controller):
    ports = [free_udp_port() for _ in range(2)]
    replica_port = free_udp_port()
    workers = ",".join(f"local:{p}" for p in ports)
    code, out, err = _cli(capsys, soft_controller, "job", "create", "--workers", workers, "--slots", "4",
                          "--mode", "ps", "--ps", "ps0", "--sync", "async", "--delay-bound", "4",
                          "--replicas", "1", "--replica-ps", f"local:{replica_port}")
    assert code == 0, err
    job = json.loads(out)["job"]
    assert (job["update_mode"], job["delay_bound"], job["schedule"]) == ("async", 4, "fifo")
    assert [(r["ip"], r["udp_port"]) for r in job["replicas"]] == [("127.0.0.1", replica_port)]
    configs = []
    for rank in range(2):
        code, out, err = _cli(capsys, soft_controller, "job", "config", str(job["job_id"]), "--rank", str(rank))
        assert code == 0, err
        configs.append(WorkerConfig.from_dict(yaml.safe_load(out)))
    assert configs[1].update_mode == "async" and configs[1].delay_bound == 4
    assert configs[1].replicas == (Endpoint("127.0.0.1", replica_port),)
    # What the controller wrote is all a PS chain and its workers need.
    with FabricServer(configs[0], replica=0, gate_timeout=0) as replica, \
            FabricServer(configs[0], gate_timeout=0) as primary:
        client = FabricClient.from_config(configs[1])
        client.hello()
        client.init(np.zeros(3, np.float32))
        assert client.push("1:0", 0, np.ones(3, np.float32))["outcome"] == "applied"
        assert replica.version == primary.version == 1 and primary.delay_bound == 4
        client.close()
    code, out, _ = _cli(capsys, soft_controller, "job", "show", str(job["job_id"]))
    assert code == 0 and json.loads(out)["update_mode"] == "async"
    # The text view names the options too.
    assert main(["--config", str(soft_controller.config), "--token", TOKENS["alice"], "job", "list"]) == 0
    assert "updates async schedule=fifo delay_bound=4 replicas 127.0.0.1:" in capsys.readouterr().out


BAD_OPTIONS = [
    (["--delay-bound", "4"], "a delay bound needs --sync async"),
    (["--sync", "async"], "--sync async needs --ps"),
    (["--schedule", "mlfabric"], "schedule mlfabric needs --sync async"),
    (["--ps", "ps0", "--replicas", "1"], "only 0 configured parameter server(s) besides the primary"),
    (["--ps", "ps0", "--replicas", "2", "--replica-ps", "local:29100"], "--replicas 2 but 1 replica endpoint"),
    (["--ps", "ps0", "--replica-ps", "local:29001"], "must be distinct endpoints"),
    (["--ps", "ps0", "--sync", "async", "--delay-bound", "-2"], "delay bound must be an integer >= 0"),
    (["--ps", "ps0", "--sync", "async", "--switch-aggregation"], "--switch-aggregation needs --schedule mlfabric"),
]


def test_bad_mlfabric_options_are_refused_with_a_clear_message(capsys, soft_controller):
    for args, message in BAD_OPTIONS:
        code, _, err = _cli(capsys, soft_controller, "job", "create", "--workers", f"local:{free_udp_port()}",
                            "--slots", "4", "--mode", "allreduce", *args)
        assert code == EXIT_CODES["invalid_argument"], (args, err)
        assert message in err, (args, err)
    code, out, _ = _cli(capsys, soft_controller, "job", "list")
    assert code == 0 and json.loads(out) == []  # nothing was created


def test_a_switch_aggregation_job_writes_configs_for_subset_rounds(capsys, soft_controller):
    workers = ",".join(f"local:{free_udp_port()}" for _ in range(3))
    code, out, err = _cli(capsys, soft_controller, "job", "create", "--workers", workers, "--slots", "8",
                          "--mode", "allreduce", "--ps", "ps0", "--sync", "async", "--schedule", "mlfabric",
                          "--switch-aggregation")
    assert code == 0, err
    job = json.loads(out)["job"]
    assert job["switch_aggregation"] is True and "secret" not in job
    code, out, err = _cli(capsys, soft_controller, "job", "config", str(job["job_id"]), "--rank", "2")
    assert code == 0, err
    config = WorkerConfig.from_dict(yaml.safe_load(out))
    assert (config.switch_aggregation, config.mode, config.schedule, config.slot_count) == (True, "allreduce",
                                                                                          "mlfabric", 8)
    assert main(["--config", str(soft_controller.config), "--token", TOKENS["alice"], "job", "show",
                 str(job["job_id"])]) == 0
    assert "switch-aggregation" in capsys.readouterr().out


def test_a_one_way_job_lets_its_senders_send_and_its_receivers_receive(capsys, soft_controller, soft_switch):
    workers = ",".join(f"local:{free_udp_port()}" for _ in range(4))
    code, out, err = _cli(capsys, soft_controller, "job", "create", "--workers", workers, "--slots", "4",
                          "--mode", "allreduce", "--senders", "1")
    assert code == 0, err
    job = json.loads(out)["job"]
    assert job["senders"] == 1
    with P4RuntimeClient(soft_switch.grpc_address, device_id=1, election_id=(0, 1),
                         p4info_path=dp.P4INFO_PATH) as reader:
        reader.connect()
        group = reader.read_multicast_groups()[job["job_id"]]
        workers_of_job = [e for e in reader.read_entries(dp.TABLE_WORKERS) if e.match["job_id"] == job["job_id"]]
    assert sorted(rid for _, rid in group) == [1, 2, 3]  # ranks 0..2 receive; rank 3 only sends
    assert [e.params["rank"] for e in workers_of_job] == [3]  # and only rank 3 may send
    code, out, err = _cli(capsys, soft_controller, "job", "config", str(job["job_id"]), "--rank", "0")
    assert code == 0, err
    assert WorkerConfig.from_dict(yaml.safe_load(out)).senders == 1  # a receiver knows which ranks send
    for args, message in ((["--senders", "4"], "senders must be an integer in 0..3"),
                          (["--senders", "1", "--mode", "ps", "--ps", "ps0"], "--senders needs --mode allreduce")):
        code, _, err = _cli(capsys, soft_controller, "job", "create", "--workers", workers, "--slots", "4",
                            *(["--mode", "allreduce"] if "--mode" not in args else []), *args)
        assert code == EXIT_CODES["invalid_argument"] and message in err, err
