"""``python -m netagg.hoststack.server``: the PS as a process, workers configured from YAML files."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from netagg.hoststack.kv import KVWorker
from netagg.hoststack.server import KVServer, main
from netagg.jobconfig import ConfigError, Endpoint, WorkerConfig
from netagg.localports import free_ports
from netagg.psproto import PsError
from netagg.testing.hoststack import expected_allreduce, job_configs, run_workers


def read_line(process: subprocess.Popen, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.1)
        if ready:
            return process.stdout.readline()
        if process.poll() is not None:
            break
    raise AssertionError(f"no output from the PS (exit {process.poll()}): {process.stderr.read()}")


def test_server_process_serves_a_fallback_job_and_stops_on_sigterm(tmp_path):
    n = 2
    ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
    configs = job_configs(n, "fallback", ps, ps, slot_count=8, job_id=4)
    paths = []
    for config in configs:
        paths.append(tmp_path / f"rank{config.rank}.yaml")
        config.save(paths[-1])
    process = subprocess.Popen([sys.executable, "-m", "netagg.hoststack.server", "--config", str(paths[0])],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert f"on 127.0.0.1:{ps.port} (udp+tcp)" in read_line(process)
        inputs = [np.full(100, rank + 0.5, np.float32) for rank in range(n)]
        loaded = [WorkerConfig.load(path) for path in paths]
        results = run_workers(loaded, lambda w, rank: w.allreduce(inputs[rank]))
        expected, _ = expected_allreduce(inputs)
        for result in results:
            np.testing.assert_array_equal(result, expected)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        assert "stopped" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_server_main_reports_config_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("job_id: 1\nrank: 0\n")
    assert main(["--config", str(bad)]) == 2
    assert "error:" in capsys.readouterr().err


def test_server_refuses_an_allreduce_job_without_a_ps_but_serves_one_with_a_ps():
    config = job_configs(1, "allreduce", Endpoint("127.0.0.1", 9), None)[0]
    with pytest.raises(ConfigError, match="has no parameter server"):
        KVServer(config)
    # An allreduce job's PS serves its sparse tables (Libra, tests/test_sparse.py); UDP from anyone is foreign.
    with KVServer(job_configs(1, "allreduce", Endpoint("127.0.0.1", 9), Endpoint("127.0.0.1", 0))[0]) as server:
        assert server.switch is None and server.aggregator is None


def test_a_ps_port_taken_for_one_protocol_is_a_clear_error_naming_port_and_protocol(tmp_path, capsys):
    port = free_ports(1, "both")[0]
    ps = Endpoint("127.0.0.1", port)
    config = job_configs(1, "fallback", ps, ps)[0]
    config.save(tmp_path / "ps.yaml")
    for sock_type, protocol in ((socket.SOCK_STREAM, "TCP"), (socket.SOCK_DGRAM, "UDP")):
        with socket.socket(socket.AF_INET, sock_type) as taken:
            taken.bind(("127.0.0.1", port))
            if sock_type == socket.SOCK_STREAM:
                taken.listen()
            with pytest.raises(OSError, match=rf"cannot bind {protocol} 127\.0\.0\.1:{port}\b.*in use"):
                KVServer(config)
            assert main(["--config", str(tmp_path / "ps.yaml")]) == 2
            assert f"cannot bind {protocol} 127.0.0.1:{port}" in capsys.readouterr().err


def test_a_ps_mode_worker_without_its_ps_fails_at_once():
    nobody = Endpoint("127.0.0.1", free_ports(1, "both")[0])
    config = job_configs(1, "ps", Endpoint("127.0.0.1", 9), nobody)[0]
    with pytest.raises(PsError, match="cannot connect to the parameter server"):
        KVWorker(config, ps_timeout=2)


def test_a_fault_inside_a_ps_handler_is_answered_and_the_connection_keeps_serving(monkeypatch):
    # As at the MLfabric servers (netagg/framed_server.py): a fault of the PS's own is answered as an internal
    # error, not a dropped connection (which a worker takes for an unreachable PS, retrying into the same fault).
    from netagg.psproto import PsClient, PsRefused

    def fault(self, frame):
        raise RuntimeError("a bug")

    monkeypatch.setattr(KVServer, "_op_init", fault)
    config = job_configs(1, "allreduce", Endpoint("127.0.0.1", 9), Endpoint("127.0.0.1", 0))[0]
    with KVServer(config) as server:
        client = PsClient(server.address, timeout=5)
        try:
            with pytest.raises(PsRefused, match="internal error: RuntimeError: a bug"):
                client.request({"op": "init", "job_id": config.job_id, "keys": [1], "sizes": [1]},
                               np.ones(1, np.float32))
            hello = {"op": "hello", "job_id": config.job_id, "rank": 0, "host": "127.0.0.1", "port": 9}
            assert client.request(hello)[0]["ok"]  # the same connection serves the next request
        finally:
            client.close()
        assert server.stats.requests == 2 and server.stats.bad_requests == 1
        assert server.workers == {0: ("127.0.0.1", 9)}
