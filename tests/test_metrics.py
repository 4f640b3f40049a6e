"""Prometheus endpoints: the controller's (scraped during and after a real job through the software
target), a worker's transport exporter, the metrics config key, and `netagg top --once`."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from netagg.bmv2.targets import TargetProcess
from netagg.controller.cli import main
from netagg.controller.config import parse_config
from netagg.hoststack import metrics as worker_metrics
from netagg.hoststack.kv import KVWorker
from netagg.jobconfig import ConfigError, WorkerConfig
from netagg.localports import free_ports
from netagg.testing.hoststack import run_workers

from conftest import TOKENS, ControllerProcess, config_for, controller_config, free_udp_port, start_controller

pytestmark = pytest.mark.timeout(120)

N = 3
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample of http://127.0.0.1:PORT/metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def job_value(samples: Samples, name: str, job_id: int) -> float | None:
    return next((v for (n, labels), v in samples.items() if n == name and ("job_id", str(job_id)) in labels), None)


def cli(capsys, controller: ControllerProcess, *args: str) -> str:
    code = main(["--config", str(controller.config), "--token", TOKENS["alice"], *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.fixture
def metrics_controller(tmp_path: Path, soft_switch: TargetProcess) -> Iterator[tuple[ControllerProcess, int]]:
    """A controller on the software target with its metrics endpoint on a free TCP port."""
    path = config_for(tmp_path, soft_switch)
    port = free_ports(1, kind="tcp")[0]
    config = yaml.safe_load(path.read_text())
    config["controller"]["metrics_address"] = f"127.0.0.1:{port}"
    path.write_text(yaml.safe_dump(config))
    ctl = start_controller(path, tmp_path / "controller.log")
    yield ctl, port
    ctl.stop()


def test_controller_and_worker_metrics_during_a_real_job(capsys, metrics_controller, soft_switch):
    controller, port = metrics_controller
    ports = [free_udp_port() for _ in range(N)]
    created = json.loads(cli(capsys, controller, "--json", "job", "create", "--name", "bert", "--slots", "8",
                             "--workers", ",".join(f"local:{p}" for p in ports)))
    job_id = created["job"]["job_id"]
    width = created["job"]["width"]  # the software target's default: wide
    assert width == 256
    blocks, cells = -(-1000 // width), 8 * width // 64  # per allreduce of 1000 values; the job's switch memory
    configs = [WorkerConfig.from_dict(yaml.safe_load(cli(capsys, controller, "job", "config", str(job_id),
                                                         "--rank", str(r)))) for r in range(N)]
    during: list[Samples] = []
    arrived = threading.Barrier(N)

    def work(worker: KVWorker, rank: int) -> tuple[Samples, dict[str, float]]:
        values = np.arange(1000, dtype=np.float32) * (rank + 1)
        np.testing.assert_allclose(worker.allreduce(values), np.arange(1000) * sum(range(1, N + 1)), rtol=1e-3)
        arrived.wait(30)
        if rank == 0:  # mid-job: the first allreduce is done, more follow
            during.append(scrape(port))
        arrived.wait(30)
        for _ in range(3):
            worker.allreduce(values)
        address = worker.metrics_address
        assert address is not None
        samples = scrape(address[1])
        stats = worker.transport.stats
        return samples, {"retransmissions": stats.retransmissions, "packets_sent": stats.packets_sent,
                         "shadow_resends": stats.shadow_resends,
                         "results_accepted": stats.results_accepted, "blocks": stats.blocks,
                         "window": worker.transport.window, "smallest_window": stats.smallest_window}

    results = run_workers(configs, work, timeout=60, metrics_port=0)

    # The worker exporters report exactly the transports' counters.
    for rank, (samples, stats) in enumerate(results):
        labels = (("job_id", str(job_id)), ("rank", str(rank)), ("tenant", "alice"))
        assert samples[("netagg_worker_retransmissions_total", labels)] == stats["retransmissions"]
        assert samples[("netagg_worker_shadow_resends_total", labels)] == stats["shadow_resends"]
        assert samples[("netagg_worker_packets_sent_total", labels)] == stats["packets_sent"]
        assert samples[("netagg_worker_results_accepted_total", labels)] == stats["results_accepted"]
        assert samples[("netagg_worker_goodput_bytes_total", labels)] == stats["blocks"] * width * 4
        assert samples[("netagg_worker_window", labels)] == stats["window"]
        assert samples[("netagg_worker_smallest_window", labels)] == stats["smallest_window"]
        assert stats["packets_sent"] > 0 and stats["blocks"] == 4 * blocks  # 4 allreduces of 1000 values

    # Mid-job scrape: the job is there with some of its traffic counted.
    assert during and during[0][("netagg_switch_up", (("grpc_address", soft_switch.grpc_address),))] == 1
    assert job_value(during[0], "netagg_job_contributions_total", job_id) > 0

    # After the job: the per-job counters are what the switch counted (as `job show` reads them).
    after = scrape(port)
    shown = json.loads(cli(capsys, controller, "--json", "job", "show", str(job_id)))["counters"]
    for short in ("contributions", "results", "duplicates", "retransmit_results", "rejects"):
        assert job_value(after, f"netagg_job_{short}_total", job_id) == shown[short], short
    assert shown["contributions"] >= N * 4 * blocks and shown["results"] >= 4 * blocks
    assert job_value(after, "netagg_job_contributions_total", job_id) >= job_value(
        during[0], "netagg_job_contributions_total", job_id)
    job_labels = (("job_id", str(job_id)), ("name", "bert"), ("tenant", "alice"))
    assert after[("netagg_job_slots", job_labels)] == 8 and after[("netagg_job_width", job_labels)] == width
    assert after[("netagg_job_workers", job_labels)] == N
    assert after[("netagg_slots_in_use", ())] == cells
    assert after[("netagg_slots_free", ())] == after[("netagg_slots_capacity", ())] - cells
    assert after[("netagg_jobs", (("mode", "allreduce"), ("state", "active")))] == 1
    assert after[("netagg_admissions_total", (("decision", "full"),))] == 1
    assert after[("netagg_admissions_total", (("decision", "refused"),))] == 0
    secret = configs[0].secret
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as response:
        assert secret and secret not in response.read().decode()

    # `netagg top --once` shows the job with the counters the controller reads.
    screen = cli(capsys, controller, "top", "--once")
    line = next(row for row in screen.splitlines() if row.split()[:2] == [str(job_id), "alice"])
    assert "bert" in line and str(shown["contributions"]) in line.split()
    assert "switch drops:" in screen and "unreachable" not in screen
    assert f"tenants: alice {cells} cells" in screen.splitlines()  # no quota configured for alice

    # With the switch gone a scrape still answers: switch down, the job table still there.
    soft_switch.stop()
    down = scrape(port)
    assert down[("netagg_switch_up", (("grpc_address", soft_switch.grpc_address),))] == 0
    assert down[("netagg_job_slots", job_labels)] == 8
    assert job_value(down, "netagg_job_contributions_total", job_id) is None
    assert "switch unreachable" in cli(capsys, controller, "top", "--once")


def test_refused_and_fallback_admissions_are_counted(capsys, metrics_controller):
    controller, port = metrics_controller  # capacity 64, min_per_job 4
    # 16 wide slots (the software target's default width, 4 cells each) take the whole capacity.
    cli(capsys, controller, "job", "create", "--slots", "16", "--workers", f"local:{free_udp_port()}")
    cli(capsys, controller, "job", "create", "--slots", "8", "--ps", "ps0", "--lease", "1",
        "--workers", f"local:{free_udp_port()}")
    code = main(["--config", str(controller.config), "--token", TOKENS["alice"], "job", "create", "--slots", "8",
                 "--workers", f"local:{free_udp_port()}"])
    assert code != 0
    capsys.readouterr()
    samples = scrape(port)
    decisions = {dict(labels)["decision"]: v for (name, labels), v in samples.items()
                 if name == "netagg_admissions_total"}
    assert decisions == {"full": 1, "partial": 0, "fallback": 1, "refused": 1}
    assert samples[("netagg_slots_largest_free_range", ())] == 0
    deadline = time.monotonic() + 20  # the fallback job's 1 s lease runs out; the daemon reclaims it
    while samples[("netagg_lease_expiries_total", ())] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        samples = scrape(port)
    assert samples[("netagg_lease_expiries_total", ())] == 1
    assert ("netagg_jobs", (("mode", "fallback"), ("state", "active"))) not in samples
    assert samples[("netagg_jobs", (("mode", "allreduce"), ("state", "active")))] == 1


def test_metrics_address_is_validated(tmp_path):
    config = yaml.safe_load(controller_config(tmp_path, "127.0.0.1:1", 28900).read_text())
    for bad in ("9464", "127.0.0.1:http", "127.0.0.1:70000", 9464):
        config["controller"]["metrics_address"] = bad
        with pytest.raises(ConfigError, match=r"x\.yaml: controller\.metrics_address: "):
            parse_config(config, "x.yaml")
    config["controller"]["metrics_address"] = "0.0.0.0:9464"
    assert parse_config(config, "x.yaml").metrics_address == "0.0.0.0:9464"
    del config["controller"]["metrics_address"]
    assert parse_config(config, "x.yaml").metrics_address is None


def test_worker_metrics_port_from_environment(monkeypatch):
    monkeypatch.delenv(worker_metrics.ENV_PORT, raising=False)
    assert worker_metrics.port_from_env() is None
    monkeypatch.setenv(worker_metrics.ENV_PORT, "9100")
    assert worker_metrics.port_from_env() == 9100
    monkeypatch.setenv(worker_metrics.ENV_PORT, "nine")
    with pytest.raises(ValueError, match="NETAGG_METRICS_PORT"):
        worker_metrics.port_from_env()


def test_metrics_port_in_use_is_a_clear_start_up_error(tmp_path, soft_switch):
    path = config_for(tmp_path, soft_switch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = yaml.safe_load(path.read_text())
        config["controller"]["metrics_address"] = f"127.0.0.1:{taken.getsockname()[1]}"
        path.write_text(yaml.safe_dump(config))
        with pytest.raises(RuntimeError, match=r"exited 2:[\s\S]*controller\.metrics_address: cannot listen"):
            start_controller(path, tmp_path / "controller.log")


def test_top_shows_what_each_tenant_holds_against_its_limit():
    from netagg.controller.cli import _render_top

    def job(job_id: int, tenant: str, cells: int, limit: int | None, kind: str | None) -> dict:
        return {"job_id": job_id, "tenant": tenant, "name": f"j{job_id}", "mode": "allreduce", "slot_count": 8,
                "workers": [{}], "counters": {}, "tenant_cells": cells, "tenant_limit_cells": limit,
                "tenant_limit": kind}

    screen = _render_top([job(1, "bob", 8, None, None), job(2, "alice", 40, 64, "fair share"),
                          job(3, "alice", 40, 64, "fair share")], {}, None, {})
    assert "tenants: alice 40 of 64 cells (fair share), bob 8 cells" in screen.splitlines()
    # A job listed without its view (the switch away: no show) says nothing of its tenant.
    assert "tenants:" not in _render_top([{"job_id": 4, "tenant": "carol", "name": "x", "mode": "allreduce",
                                           "slot_count": 8, "workers": []}], {}, None, None)
