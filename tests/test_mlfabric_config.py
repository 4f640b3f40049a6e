"""MLfabric job options: WorkerConfig fields, the SQLite migration, and `netagg job create --sync ...` end to end."""

from __future__ import annotations

import json
import sqlite3
import time

import numpy as np
import pytest
import yaml

from netagg import dataplane as dp
from netagg.controller.cli import EXIT_CODES, main
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.controller.store import JobRecord, JobStore, PsEndpoint, WorkerEndpoint
from netagg.jobconfig import ConfigError, Endpoint, WorkerConfig
from netagg.mlfabric.async_server import FabricServer
from netagg.mlfabric.distribution import ModelCache, ModelSender
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
    assert (old.distribution, old.distribution_of, old.senders) == (None, None, 0)  # no link: a job on its own
    assert old.ps_members == 0  # its workers are every rank
    assert old.secret == ""  # made before secrets: its servers keep accepting requests without one
    with store.transaction() as conn:
        store.insert(conn, JobRecord(
            job_id=2, tenant="alice", name="new", mode="ps", state="active", slot_base=8, slot_count=8,
            slots_wanted=8, generation=store.next_generation(conn),
            workers=[WorkerEndpoint(0, "local", "127.0.0.1", 40001)], ps=PsEndpoint("local", "127.0.0.1", 29001),
            lease_seconds=60, lease_expires=1e12, created=2, update_mode="async", delay_bound=4,
            schedule="mlfabric", replicas=[PsEndpoint("local", "127.0.0.1", 29002)], secret="s3cret-of-job-2",
            distribution=3, ps_members=2))
        store.insert(conn, JobRecord(
            job_id=3, tenant="alice", name="new-distribution", mode="allreduce", state="active", slot_base=16,
            slot_count=8, slots_wanted=8, generation=store.next_generation(conn),
            workers=[WorkerEndpoint(0, "local", "127.0.0.1", 40101), WorkerEndpoint(1, "local", "127.0.0.1", 40201)],
            ps=None, lease_seconds=60, lease_expires=1e12, created=2, senders=1, distribution_of=2))
    store.close()
    reopened = JobStore(path)  # the migration runs again and finds nothing to do
    new = reopened.get(2)
    assert (new.update_mode, new.delay_bound, new.schedule) == ("async", 4, "mlfabric")
    assert new.replicas == [PsEndpoint("local", "127.0.0.1", 29002)]
    assert new.secret == "s3cret-of-job-2"  # survives a restart: configs written before stay valid
    assert "secret" not in new.to_dict() and "s3cret" not in repr(new)
    assert reopened.get(1).update_mode == "sync"
    assert (new.distribution, reopened.get(3).distribution_of, reopened.get(3).senders) == (3, 2, 1)
    assert (new.ps_members, reopened.get(3).ps_members) == (2, 0)
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


def _switch_view(switch, job_id: int) -> tuple[list[int] | None, list[int]]:
    """A job's multicast group (replica ids, sorted; None without one) and the ranks in its workers table."""
    with P4RuntimeClient(switch.grpc_address, device_id=1, election_id=(0, 1), p4info_path=dp.P4INFO_PATH) as reader:
        reader.connect()
        group = reader.read_multicast_groups().get(job_id)
        ranks = [e.params["rank"] for e in reader.read_entries(dp.TABLE_WORKERS) if e.match["job_id"] == job_id]
    return (None if group is None else sorted(rid for _, rid in group)), sorted(ranks)


def test_an_mlfabric_job_with_distribution_creates_and_owns_its_distribution_job(capsys, soft_controller,
                                                                                  soft_switch):
    worker_ports = [free_udp_port() for _ in range(3)]
    receive_ports = [free_udp_port() for _ in range(3)]
    replica_port, *send_ports = (free_udp_port() for _ in range(3))
    code, out, err = _cli(capsys, soft_controller, "job", "create", "--name", "fab", "--slots", "4",
                          "--workers", ",".join(f"local:{p}" for p in worker_ports), "--mode", "ps", "--ps", "ps0",
                          "--sync", "async", "--replica-ps", f"local:{replica_port}",
                          "--distribution", ",".join(f"local:{p}" for p in receive_ports),
                          "--distribution-ps", ",".join(f"local:{p}" for p in send_ports),
                          "--distribution-slots", "8")
    assert code == 0, err
    created = json.loads(out)
    job, dist = created["job"], created["distribution"]["job"]
    assert created["distribution"]["admission"] == "full"
    assert (job["distribution"], job["distribution_of"]) == (dist["job_id"], None)
    assert (dist["distribution_of"], dist["distribution"]) == (job["job_id"], None)
    assert (dist["name"], dist["mode"], dist["senders"], dist["slot_count"]) == ("fab-distribution", "allreduce", 2, 8)
    assert [w["udp_port"] for w in dist["workers"]] == [*receive_ports, *send_ports]  # workers, then the PS chain
    assert "secret" not in dist
    # The workers only receive (the group), the primary and its replica only send (the workers table).
    assert _switch_view(soft_switch, dist["job_id"]) == ([1, 2, 3], [3, 4])

    configs = {}
    for option in (["--rank", "0"], ["--rank", "2"], ["--ps-node", "0"], ["--ps-node", "1"]):
        code, out, err = _cli(capsys, soft_controller, "job", "config", str(job["job_id"]), "--distribution", *option)
        assert code == 0, (option, err)
        configs[" ".join(option)] = WorkerConfig.from_dict(yaml.safe_load(out))
    for key, rank, port in (("--rank 0", 0, receive_ports[0]), ("--rank 2", 2, receive_ports[2]),
                            ("--ps-node 0", 3, send_ports[0]), ("--ps-node 1", 4, send_ports[1])):
        config = configs[key]
        assert (config.job_id, config.rank, config.num_workers, config.senders) == (dist["job_id"], rank, 5, 2), key
        assert (config.mode, config.slot_count, config.bind, config.ps) == ("allreduce", 8,
                                                                          Endpoint("127.0.0.1", port), None), key
    # What the controller wrote is all the PS and its workers need: a version sent once reaches the receivers.
    model = np.arange(1000, dtype=np.float32) - 500.5
    caches = [ModelCache(configs[key], model.size) for key in ("--rank 0", "--rank 2")]
    sender = ModelSender(configs["--ps-node 0"], rate=20e6)
    try:
        sender.publish(1, model)
        for cache in caches:
            got = cache.newest(0, wait=3.0, repair=sender.blocks)
            assert got is not None and got[0] == 1 and got[1].tobytes() == model.tobytes()
    finally:
        sender.close()
        for cache in caches:
            cache.close()
    # A rank of the job's own config is untouched by the distribution job.
    code, out, _ = _cli(capsys, soft_controller, "job", "config", str(job["job_id"]), "--rank", "2")
    assert code == 0 and WorkerConfig.from_dict(yaml.safe_load(out)).bind == Endpoint("127.0.0.1", worker_ports[2])
    for option, status, message in (
            (["--distribution", "--ps-node", "2"], "not_found", "has PS nodes 0..1"),
            (["--distribution", "--rank", "3"], "not_found", "has no worker rank 3 (ranks 0..2"),
            (["--distribution", "--rank", "0", "--ps-node", "0"], "invalid_argument", "one of --rank"),
            (["--distribution"], "invalid_argument", "one of --rank"),
            (["--ps-node", "0"], "invalid_argument", "PS nodes are no ranks of it (create it with --switch-ps)"),
            ([], "invalid_argument", "needs --rank")):
        code, _, err = _cli(capsys, soft_controller, "job", "config", str(job["job_id"]), *option)
        assert code == EXIT_CODES[status] and message in err, (option, err)
    code, _, err = _cli(capsys, soft_controller, "job", "config", str(dist["job_id"]), "--distribution", "--rank", "0")
    assert code == EXIT_CODES["not_found"] and f"the distribution job of job {job['job_id']}" in err

    # Shown with its link; owned by its job: not deleted on its own, renewed with it.
    assert main(["--config", str(soft_controller.config), "--token", TOKENS["alice"], "job", "show",
                 str(job["job_id"])]) == 0
    assert f"distribution job {dist['job_id']} " in capsys.readouterr().out
    assert main(["--config", str(soft_controller.config), "--token", TOKENS["alice"], "job", "list"]) == 0
    assert f"distribution job of job {job['job_id']}" in capsys.readouterr().out
    code, _, err = _cli(capsys, soft_controller, "job", "delete", str(dist["job_id"]))
    assert code == EXIT_CODES["invalid_argument"] and f"delete job {job['job_id']}" in err
    code, out, err = _cli(capsys, soft_controller, "job", "renew", str(dist["job_id"]))
    assert code == 0 and json.loads(out)["renewed"] == [job["job_id"], dist["job_id"]], err

    code, out, err = _cli(capsys, soft_controller, "job", "delete", str(job["job_id"]))
    assert code == 0, err
    deleted = json.loads(out)
    assert deleted["distribution"] == {"job_id": dist["job_id"], "released_slots": 8}
    code, out, _ = _cli(capsys, soft_controller, "job", "list")
    assert code == 0 and json.loads(out) == []
    assert _switch_view(soft_switch, dist["job_id"]) == (None, [])
    # Both jobs' cells are free again: the whole capacity (64 cells: 16 wide slots, the software target's
    # default width) goes to one job.
    code, out, err = _cli(capsys, soft_controller, "job", "create", "--workers", f"local:{free_udp_port()}",
                          "--slots", "16")
    assert code == 0 and json.loads(out)["admission"] == "full", err


def test_distribution_goes_with_its_job_or_not_at_all(capsys, soft_controller):
    # No slots left for the distribution job: the job is not created either, and its slots are free again.
    code, _, err = _cli(capsys, soft_controller, "job", "create", "--workers", f"local:{free_udp_port()}",
                        "--slots", "16", "--mode", "ps", "--ps", "ps0", "--sync", "async",
                        "--distribution", f"local:{free_udp_port()}", "--distribution-ps", f"local:{free_udp_port()}")
    assert code == EXIT_CODES["capacity_exhausted"] and "for the distribution job" in err, err
    code, out, _ = _cli(capsys, soft_controller, "job", "list")
    assert code == 0 and json.loads(out) == []
    # Its lease covers both: a lapsed lease takes the pair.
    code, out, err = _cli(capsys, soft_controller, "job", "create", "--workers", f"local:{free_udp_port()}",
                          "--slots", "4", "--mode", "ps", "--ps", "ps0", "--sync", "async", "--lease", "1",
                          "--distribution", f"local:{free_udp_port()}", "--distribution-ps", f"local:{free_udp_port()}")
    assert code == 0, err
    assert json.loads(out)["distribution"]["job"]["lease_seconds"] == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        code, out, _ = _cli(capsys, soft_controller, "job", "list")
        if json.loads(out) == []:
            break
        time.sleep(0.2)
    assert json.loads(out) == []
    code, out, err = _cli(capsys, soft_controller, "job", "create", "--workers", f"local:{free_udp_port()}",
                          "--slots", "16")  # the whole capacity again (64 cells)
    assert code == 0 and json.loads(out)["admission"] == "full", err


def test_bad_distribution_options_are_refused_with_a_clear_message(capsys, soft_controller):
    worker, other, port = (f"local:{free_udp_port()}" for _ in range(3))
    async_job = ["--mode", "ps", "--ps", "ps0", "--sync", "async"]
    for args, message in [
        (["--mode", "ps", "--ps", "ps0", "--distribution", other, "--distribution-ps", port],
         "--distribution needs --sync async and --ps"),
        (["--distribution", other, "--distribution-ps", port], "--distribution needs --sync async and --ps"),
        ([*async_job, "--distribution", f"{other},{port}", "--distribution-ps", port],
         "--distribution names 2 endpoint(s) for 1 worker(s)"),
        ([*async_job, "--distribution", other], "--distribution needs --distribution-ps: one endpoint per PS node"),
        ([*async_job, "--replica-ps", f"local:{free_udp_port()}", "--distribution", other, "--distribution-ps", port],
         "--distribution-ps names 1 endpoint(s) for 2 PS node(s) (the primary, then its 1 replica(s))"),
        ([*async_job, "--distribution", other, "--distribution-ps", other],
         "two distribution endpoints share an address and UDP port"),
        ([*async_job, "--distribution", other, "--distribution-ps", "local:29001"],
         "distribution endpoint 127.0.0.1:29001 is already one of the job's"),
        ([*async_job, "--distribution", worker, "--distribution-ps", port], "is already one of the job's"),
        ([*async_job, "--distribution", "nowhere:5", "--distribution-ps", port],
         "distribution endpoint of worker 0: unknown host 'nowhere'"),
        ([*async_job, "--distribution", other, "--distribution-ps", "local"],
         "distribution endpoint of PS node 0: expected HOST:UDP_PORT"),
        ([*async_job, "--distribution", other, "--distribution-ps", port, "--distribution-slots", "0"],
         "distribution slots must be an integer >= 1"),
        ([*async_job, "--distribution-ps", port], "--distribution-ps needs --distribution"),
        ([*async_job, "--distribution-slots", "4"], "--distribution-slots needs --distribution"),
    ]:
        code, _, err = _cli(capsys, soft_controller, "job", "create", "--workers", worker, "--slots", "4", *args)
        assert code == EXIT_CODES["invalid_argument"], (args, err)
        assert message in err, (args, err)
        assert "Traceback" not in err
    code, out, _ = _cli(capsys, soft_controller, "job", "list")
    assert code == 0 and json.loads(out) == []  # nothing was created


def test_a_job_with_switch_ps_gives_its_ps_a_rank_in_every_switch_group(capsys, soft_controller, soft_switch):
    workers = [free_udp_port() for _ in range(3)]
    ps_port = free_udp_port()
    code, out, err = _cli(capsys, soft_controller, "job", "create", "--workers",
                          ",".join(f"local:{p}" for p in workers), "--slots", "8", "--mode", "allreduce",
                          "--ps", "ps0", "--sync", "async", "--schedule", "mlfabric", "--switch-aggregation",
                          "--switch-ps", f"local:{ps_port}")
    assert code == 0, err
    job = json.loads(out)["job"]
    assert job["ps_members"] == 1 and [w["udp_port"] for w in job["workers"]] == [*workers, ps_port]
    # The PS's rank (3) is in the job's group (it receives every sum) and in its workers table (it sends).
    assert _switch_view(soft_switch, job["job_id"]) == ([1, 2, 3, 4], [0, 1, 2, 3])
    configs = {}
    for option in (["--rank", "1"], ["--ps-node", "0"]):
        code, out, err = _cli(capsys, soft_controller, "job", "config", str(job["job_id"]), *option)
        assert code == 0, err
        configs[option[0]] = WorkerConfig.from_dict(yaml.safe_load(out))
    worker, ps = configs["--rank"], configs["--ps-node"]
    assert (worker.rank, worker.num_workers, worker.ps_members, worker.training_workers) == (1, 4, 1, 3)
    assert (ps.rank, ps.bind, ps.ps_members, ps.switch_aggregation) == (3, Endpoint("127.0.0.1", ps_port), 1, True)
    # The PS started with them counts three workers, and takes part in the switch groups as rank 3.
    server = FabricServer(worker, switch_member=ps, gate_timeout=0)
    try:
        assert server.num_workers == 3 and server.switch_member is not None and server.switch_member.rank == 3
        assert server.grants is not None and server.grants.ps_member == 3
    finally:
        server.stop()
    with pytest.raises(ConfigError, match="is not a PS node's rank"):
        FabricServer(worker, switch_member=worker, gate_timeout=0)
    assert main(["--config", str(soft_controller.config), "--token", TOKENS["alice"], "job", "show",
                 str(job["job_id"])]) == 0
    assert "its last 1 rank(s) the PS chain" in capsys.readouterr().out
    for option, status, message in ((["--ps-node", "1"], "not_found", "has PS nodes 0..0"),
                                    (["--ps-node", "0", "--rank", "0"], "invalid_argument", "one of --rank")):
        code, _, err = _cli(capsys, soft_controller, "job", "config", str(job["job_id"]), *option)
        assert code == EXIT_CODES[status] and message in err, (option, err)


def test_bad_switch_ps_options_are_refused_with_a_clear_message(capsys, soft_controller):
    worker, port = (f"local:{free_udp_port()}" for _ in range(2))
    fabric = ["--mode", "allreduce", "--ps", "ps0", "--sync", "async", "--schedule", "mlfabric"]
    for args, message in [
        ([*fabric, "--switch-ps", port], "--switch-ps needs --switch-aggregation and --ps"),
        ([*fabric, "--switch-aggregation", "--switch-ps", f"{port},local:{free_udp_port()}"],
         "--switch-ps names 2 endpoint(s) for 1 PS node(s)"),
        ([*fabric, "--switch-aggregation", "--switch-ps", worker], "must be an address and UDP port of its own"),
        ([*fabric, "--switch-aggregation", "--switch-ps", "local:29001"], "must be an address and UDP port of its own"),
        ([*fabric, "--switch-aggregation", "--switch-ps", "nowhere:5"], "switch endpoint of PS node 0: unknown host"),
        ([*fabric, "--switch-aggregation", "--switch-ps", "local"], "expected HOST:UDP_PORT"),
    ]:
        code, _, err = _cli(capsys, soft_controller, "job", "create", "--workers", worker, "--slots", "4", *args)
        assert code == EXIT_CODES["invalid_argument"], (args, err)
        assert message in err, (args, err)
        assert "Traceback" not in err
    code, out, _ = _cli(capsys, soft_controller, "job", "list")
    assert code == 0 and json.loads(out) == []
    with pytest.raises(ConfigError, match="ps_members: the PS is a member of the job's switch groups only"):
        WorkerConfig(**{**BASE, "ps_members": 1})
    with pytest.raises(ConfigError, match=r"ps_members: expected an integer in 0\.\.3"):
        WorkerConfig(**{**BASE, "ps_members": 4})
