"""The controller over real P4Runtime against the software target, driven through its CLI."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest
import yaml

from netagg import dataplane as dp
from netagg import wire
from netagg.controller.cli import EXIT_CODES, main
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.jobconfig import WorkerConfig

from conftest import ADMIN_TOKEN, TOKENS, config_for, controller_config, free_udp_port, start_controller

pytestmark = pytest.mark.timeout(120)


def run_cli(capsys, controller, token: str | None, *args: str) -> tuple[int, str, str]:
    argv = ["--config", str(controller.config), "--json"]
    if token:
        argv += ["--token", token]
    code = main([*argv, *args])
    out, err = capsys.readouterr()
    return code, out, err


def create(capsys, controller, token, workers, slots, *extra) -> dict:
    """A job create; narrow unless ``extra`` names a width (the tests below count narrow slots, one cell each)."""
    width = () if "--width" in extra else ("--width", "64")
    code, out, err = run_cli(capsys, controller, token, "job", "create", "--workers",
                             ",".join(f"local:{p}" for p in workers), "--slots", str(slots), *width, *extra)
    assert code == 0, err
    return json.loads(out)


def worker_configs(capsys, controller, token, job_id, count) -> list[WorkerConfig]:
    configs = []
    for rank in range(count):
        code, out, err = run_cli(capsys, controller, token, "job", "config", str(job_id), "--rank", str(rank))
        assert code == 0, err
        configs.append(WorkerConfig.from_dict(__import__("yaml").safe_load(out)))
    return configs


def one_round(configs: list[WorkerConfig], slot: int, pool: int, values: list[np.ndarray]) -> list[np.ndarray]:
    """Every worker sends one packet for (slot, pool); returns what each receives."""
    socks = []
    try:
        for cfg in configs:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(cfg.bind.as_tuple())
            s.settimeout(3)
            socks.append(s)
        for cfg, s, v in zip(configs, socks, values):  # packets of the job's width
            header = wire.Header(job_id=cfg.job_id, slot=slot, pool=pool, rank=cfg.rank, seq=slot,
                                 width=wire.width_code(cfg.width))
            s.sendto(wire.pack(header, v), cfg.aggregator.as_tuple())
        results = []
        for s in socks:
            header, got = wire.unpack(s.recv(4096))
            assert header.is_result and header.slot == slot and header.pool == pool
            results.append(got)
        return results
    finally:
        for s in socks:
            s.close()


def switch_entries(grpc_address: str) -> dict[str, int]:
    """Entry counts per managed table, read by a second (backup) P4Runtime client."""
    with P4RuntimeClient(grpc_address, device_id=1, election_id=(0, 1), p4info_path=dp.P4INFO_PATH) as reader:
        reader.connect()
        counts = {t: len(reader.read_entries(t)) for t in (dp.TABLE_JOBS, dp.TABLE_WORKERS, dp.TABLE_REPLICAS)}
        counts["groups"] = len(reader.read_multicast_groups())
        return counts


def test_create_show_delete_with_live_counters(capsys, soft_controller, soft_switch):
    controller = soft_controller
    ports = [free_udp_port() for _ in range(3)]
    created = create(capsys, controller, TOKENS["alice"], ports, 8, "--name", "resnet")
    job = created["job"]
    assert created["admission"] == "full"
    assert (job["slot_count"], job["mode"], job["tenant"]) == (8, "allreduce", "alice")
    configs = worker_configs(capsys, controller, TOKENS["alice"], job["job_id"], 3)
    assert [c.bind.port for c in configs] == ports
    values = [np.full(wire.K, r + 1, np.int32) for r in range(3)]
    for result in one_round(configs, slot=7, pool=0, values=values):
        np.testing.assert_array_equal(result, np.full(wire.K, 6, np.int32))
    code, out, _ = run_cli(capsys, controller, TOKENS["alice"], "job", "show", str(job["job_id"]))
    assert code == 0
    shown = json.loads(out)
    assert shown["counters"]["contributions"] == 3
    assert shown["counters"]["results"] == 1
    assert switch_entries(soft_switch.grpc_address) == {dp.TABLE_JOBS: 1, dp.TABLE_WORKERS: 3,
                                                        dp.TABLE_REPLICAS: 3, "groups": 1}
    code, out, _ = run_cli(capsys, controller, TOKENS["alice"], "job", "delete", str(job["job_id"]))
    assert code == 0 and json.loads(out)["released_slots"] == 8
    assert switch_entries(soft_switch.grpc_address) == {dp.TABLE_JOBS: 0, dp.TABLE_WORKERS: 0,
                                                        dp.TABLE_REPLICAS: 0, "groups": 0}
    code, _, err = run_cli(capsys, controller, TOKENS["alice"], "job", "show", str(job["job_id"]))
    assert code == EXIT_CODES["not_found"] and "no job" in err


def test_a_wide_job_on_the_switch(capsys, soft_controller, soft_switch):
    """A job of width 256 (the software target's default): its set_job entry on the switch carries the width code
    and its first cell, its workers' configs the width, and a round of wide packets sums all 256 values."""
    controller = soft_controller
    narrow = create(capsys, controller, TOKENS["alice"], [free_udp_port()], 3)["job"]
    made = create(capsys, controller, TOKENS["alice"], [free_udp_port() for _ in range(2)], 8, "--width", "256")
    job = made["job"]
    assert (made["admission"], job["width"], job["slot_base"], job["slot_count"], job["cells"]) == (
        "full", 256, 3, 8, 32)
    # The default (no --width) on the software target is wide too.
    code, out, err = run_cli(capsys, controller, TOKENS["alice"], "job", "create", "--workers",
                             f"local:{free_udp_port()}", "--slots", "2")
    assert code == 0, err
    default = json.loads(out)["job"]
    assert (default["width"], default["slot_base"], default["cells"]) == (256, 3 + 32, 8)
    with P4RuntimeClient(soft_switch.grpc_address, device_id=1, election_id=(0, 1), p4info_path=dp.P4INFO_PATH) as r:
        r.connect()
        entries = {e.match["job_id"]: e.params for e in r.read_entries(dp.TABLE_JOBS)}
    assert (entries[job["job_id"]]["slot_base"], entries[job["job_id"]]["slot_count"],
            entries[job["job_id"]]["width"]) == (3, 8, wire.width_code(256))
    assert entries[narrow["job_id"]]["width"] == wire.width_code(64)
    configs = worker_configs(capsys, controller, TOKENS["alice"], job["job_id"], 2)
    assert [c.width for c in configs] == [256, 256] and configs[0].slot_count == 8
    values = [np.arange(wire.WIDE_K, dtype=np.int32) * (r + 1) for r in range(2)]
    for result in one_round(configs, slot=7, pool=0, values=values):
        np.testing.assert_array_equal(result, np.arange(wire.WIDE_K, dtype=np.int32) * 3)
    code, out, _ = run_cli(capsys, controller, TOKENS["alice"], "job", "show", str(job["job_id"]))
    assert code == 0 and json.loads(out)["counters"]["results"] == 1
    code = main(["--config", str(controller.config), "--token", TOKENS["alice"], "job", "show", str(job["job_id"])])
    out = capsys.readouterr().out
    assert code == 0 and "cells 3..34 (8 of 8 slots wanted, 4 cells each), width 256" in out, out


def test_best_effort_admission(capsys, controller):
    # capacity 64, min_per_job 4
    first = create(capsys, controller, TOKENS["alice"], [free_udp_port()], 60)
    assert first["admission"] == "full"
    partial = create(capsys, controller, TOKENS["alice"], [free_udp_port()], 16)
    assert partial["admission"] == "partial" and partial["job"]["slot_count"] == 4
    fallback = create(capsys, controller, TOKENS["alice"], [free_udp_port()], 16, "--ps", "ps0")
    assert fallback["admission"] == "fallback" and fallback["job"]["mode"] == "fallback"
    assert "free slots" in fallback["reason"]
    code, _, err = run_cli(capsys, controller, TOKENS["alice"], "job", "create", "--workers",
                           f"local:{free_udp_port()}", "--slots", "4")
    assert code == EXIT_CODES["capacity_exhausted"] and "no --ps" in err
    fb_config = worker_configs(capsys, controller, TOKENS["alice"], fallback["job"]["job_id"], 1)[0]
    assert fb_config.mode == "fallback" and fb_config.aggregator.port == 29001


def test_reused_slots_give_correct_sums(capsys, soft_controller):
    controller = soft_controller
    ports = [free_udp_port() for _ in range(2)]
    old = create(capsys, controller, TOKENS["alice"], ports, 4)["job"]
    old_configs = worker_configs(capsys, controller, TOKENS["alice"], old["job_id"], 2)
    # Only rank 0 contributes (an unfinished round), then the job is deleted.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(old_configs[0].bind.as_tuple())
        header = wire.Header(job_id=old["job_id"], slot=0, pool=0, rank=0, seq=0)
        s.sendto(wire.pack(header, np.full(wire.K, 1000, np.int32)), old_configs[0].aggregator.as_tuple())
        time.sleep(0.3)
    assert run_cli(capsys, controller, TOKENS["alice"], "job", "delete", str(old["job_id"]))[0] == 0
    new = create(capsys, controller, TOKENS["bob"], ports, 4)["job"]
    assert new["slot_base"] == old["slot_base"] and new["generation"] != old["generation"]
    configs = worker_configs(capsys, controller, TOKENS["bob"], new["job_id"], 2)
    for result in one_round(configs, slot=0, pool=0, values=[np.full(wire.K, 5, np.int32)] * 2):
        np.testing.assert_array_equal(result, np.full(wire.K, 10, np.int32))


def test_tenant_isolation(capsys, controller):
    alice_job = create(capsys, controller, TOKENS["alice"], [free_udp_port()], 4)["job"]["job_id"]
    bob_job = create(capsys, controller, TOKENS["bob"], [free_udp_port()], 4)["job"]["job_id"]
    for action in ("show", "delete", "renew"):
        code, _, err = run_cli(capsys, controller, TOKENS["bob"], "job", action, str(alice_job))
        assert code == EXIT_CODES["not_found"], (action, err)
    code, _, _ = run_cli(capsys, controller, TOKENS["bob"], "job", "config", str(alice_job), "--rank", "0")
    assert code == EXIT_CODES["not_found"]
    code, out, _ = run_cli(capsys, controller, TOKENS["bob"], "job", "list")
    assert [j["job_id"] for j in json.loads(out)] == [bob_job]
    code, out, _ = run_cli(capsys, controller, ADMIN_TOKEN, "job", "list")
    assert sorted(j["job_id"] for j in json.loads(out)) == sorted([alice_job, bob_job])
    code, _, err = run_cli(capsys, controller, "not-a-token", "job", "list")
    assert code == EXIT_CODES["permission_denied"] and "token" in err
    code, _, err = run_cli(capsys, controller, TOKENS["bob"], "job", "create", "--workers",
                           f"local:{free_udp_port()}", "--slots", "1", "--tenant", "alice")
    assert code == EXIT_CODES["permission_denied"]
    assert run_cli(capsys, controller, TOKENS["alice"], "job", "show", str(alice_job))[0] == 0


def test_each_job_gets_its_own_secret_in_its_worker_configs_and_nowhere_else(capsys, controller, tmp_path):
    created = [create(capsys, controller, TOKENS["alice"], [free_udp_port(), free_udp_port()], 2)
               for _ in range(2)]
    secrets = []
    for response in created:
        job_id = response["job"]["job_id"]
        configs = worker_configs(capsys, controller, TOKENS["alice"], job_id, 2)
        assert configs[0].secret and configs[0].secret == configs[1].secret  # one per job, every rank has it
        secrets.append(configs[0].secret)
        shown = run_cli(capsys, controller, TOKENS["alice"], "job", "show", str(job_id))[1]
        listed = run_cli(capsys, controller, TOKENS["alice"], "job", "list")[1]
        for text in (json.dumps(response), shown, listed, repr(configs[0])):
            assert configs[0].secret not in text
    assert secrets[0] != secrets[1]
    # Written to a file, the config is readable by its owner only.
    path = tmp_path / "rank0.yaml"
    path.write_text("old contents")
    path.chmod(0o644)
    job_id = created[0]["job"]["job_id"]
    assert run_cli(capsys, controller, TOKENS["alice"], "job", "config", str(job_id), "--rank", "0", "-o",
                   str(path))[0] == 0
    assert path.stat().st_mode & 0o777 == 0o600
    assert WorkerConfig.load(path).secret == secrets[0]


def test_bad_requests_give_clear_errors(capsys, controller):
    port = free_udp_port()
    cases = [
        (["--workers", "nowhere:1", "--slots", "4"], "unknown host"),
        (["--workers", "local:notaport", "--slots", "4"], "HOST:UDP_PORT"),
        ([f"--workers=local:{port},local:{port}", "--slots", "4"], "share"),
        (["--workers", f"local:{port}", "--slots", "0"], "slots"),
        (["--workers", f"local:{port}", "--slots", "4", "--mode", "ps"], "--ps"),
    ]
    for args, message in cases:
        code, _, err = run_cli(capsys, controller, TOKENS["alice"], "job", "create", *args)
        assert code == EXIT_CODES["invalid_argument"], (args, err)
        assert message in err and "Traceback" not in err


def test_unreachable_controller_and_switch(capsys, tmp_path):
    config = controller_config(tmp_path, f"127.0.0.1:{free_udp_port()}", 28900)
    code = main(["--config", str(config), "--token", TOKENS["alice"], "job", "list"])
    assert code == EXIT_CODES["unreachable"]
    assert "no controller listening" in capsys.readouterr().err
    # By default the daemon waits for its switch (tests/test_controller_switch_restart.py); told not to, it
    # gives up at once.
    data = yaml.safe_load(config.read_text())
    data["switch"]["startup_wait_seconds"] = 0
    config.write_text(yaml.safe_dump(data))
    code = main(["--config", str(config), "controller", "run"])
    err = capsys.readouterr().err
    assert code == EXIT_CODES["switch_error"] and "Traceback" not in err


@pytest.mark.slow
def test_lease_expiry_reclaims_job(capsys, tmp_path, any_switch):
    soft_switch = any_switch
    config = config_for(tmp_path, any_switch)
    ctl = start_controller(config, tmp_path / "controller.log")
    try:
        job = create(capsys, ctl, TOKENS["alice"], [free_udp_port()], 4, "--lease", "1")["job"]
        renewed_until = time.time() + 1
        assert run_cli(capsys, ctl, TOKENS["alice"], "job", "renew", str(job["job_id"]))[0] == 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            code, _, _ = run_cli(capsys, ctl, TOKENS["alice"], "job", "show", str(job["job_id"]))
            if code == EXIT_CODES["not_found"]:
                break
            time.sleep(0.2)
        assert code == EXIT_CODES["not_found"]
        assert time.time() >= renewed_until
        assert switch_entries(soft_switch.grpc_address)[dp.TABLE_JOBS] == 0
    finally:
        ctl.stop()
