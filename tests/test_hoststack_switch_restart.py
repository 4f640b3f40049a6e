"""Workers ride through a switch restart: every register zero, the same job re-installed (same generation).

The hard case (docs/protocol.md, "A switch restart"): at the restart some workers ("leaders") have received
a round's result and moved on to the slot's next round, and a "laggard" lost that result. Here the laggard's
results are dropped on purpose (a relay in front of it, :class:`ResultGate`) until the restart, so that the
case provably occurs, in many slots at once. The leaders' shadow resends (the slot's previous packet, see
hoststack/transport.py) let the lost rounds complete again; every allreduce of every worker stays exact and
no transport times out. Without shadow resends the same run deadlocks (checked too).

Two restarts: the in-process software target's state wiped as a restart wipes it (a new pipeline: tables
and registers empty, then the job's entries pushed again), and a real ``kill -9`` of the target process,
started again on the same addresses, with the pipeline and the job's entries pushed again as the
controller does. The recovery time (the job back on the switch -> the first completed allreduce) is
printed (run with ``-s``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from netagg import dataplane as dp
from netagg.bmv2.targets import TargetProcess, start_target
from netagg.controller.config import parse_config
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.controller.store import JobRecord, WorkerEndpoint
from netagg.controller.switch_programmer import SwitchProgrammer
from netagg.hoststack import transport as tr
from netagg.hoststack.transport import TransportTimeout
from netagg.jobconfig import Endpoint, WorkerConfig
from netagg.localports import free_ports
from netagg.softswitch.target import LOOPBACK_PORT_NUMBER
from netagg.testing.hoststack import expected_allreduce, run_workers_with_fault

testing = pytest.importorskip("netagg.testing.softswitch")

N = 3
SLOTS = 32
SIZE = 64_000  # values per allreduce: 1000 blocks, 256 KB per worker
ITERATIONS = 12  # 3 MB per worker, 9 MB in all
#: The restart happens once every worker has finished this many allreduces.
BEFORE_RESTART = 3
LAGGARD = N - 1
#: Results the gate must have dropped (rounds the leaders completed and the laggard lost) before the restart.
DROPPED_BEFORE_RESTART = 8
DEADLINE = 60.0


class ResultGate:
    """A UDP relay between one worker and the switch that drops the switch's datagrams to the worker while
    ``closed`` is set (counting them in ``dropped``)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.address: tuple[str, int] = self.sock.getsockname()
        self.peer: tuple[str, int] | None = None
        self.closed = threading.Event()
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="result-gate", daemon=True)

    def __enter__(self) -> ResultGate:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()

    def drops(self, data: bytes) -> bool:
        """Whether this datagram from the switch is dropped (here: while ``closed`` is set)."""
        return self.closed.is_set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, source = self.sock.recvfrom(4096)
            except OSError:  # a timeout, or ICMP port unreachable while the switch is away
                continue
            if source == self.target:
                if self.drops(data):
                    self.dropped += 1
                elif self.peer is not None:
                    with contextlib.suppress(OSError):
                        self.sock.sendto(data, self.peer)
            else:
                self.peer = source
                with contextlib.suppress(OSError):
                    self.sock.sendto(data, self.target)


def make_inputs(seed: int = 17) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(SIZE) * 10.0 ** rng.integers(-8, 8)).astype(np.float32) for _ in range(N)]
            for _ in range(ITERATIONS)]


def job_record(job_id: int, generation: int, slot_base: int, ports: list[int]) -> JobRecord:
    now = time.time()
    return JobRecord(job_id=job_id, tenant="test", name="restart", mode="allreduce", state="active",
                     slot_base=slot_base, slot_count=SLOTS, slots_wanted=SLOTS, generation=generation,
                     workers=[WorkerEndpoint(r, testing.LOCAL_HOST, "127.0.0.1", p) for r, p in enumerate(ports)],
                     ps=None, lease_seconds=3600, lease_expires=now + 3600, created=now)


def worker_configs(job: JobRecord, aggregator: Endpoint, gate: ResultGate) -> list[WorkerConfig]:
    """One config per rank; the laggard binds a port of its own and reaches the switch through ``gate``
    (the switch knows it by the gate's address)."""
    configs = [WorkerConfig(job_id=job.job_id, rank=w.rank, num_workers=N, slot_count=SLOTS, mode="allreduce",
                            aggregator=aggregator, bind=Endpoint(w.ip, w.udp_port)) for w in job.workers]
    configs[LAGGARD] = dataclasses.replace(configs[LAGGARD], aggregator=Endpoint(*gate.address),
                                           bind=Endpoint("127.0.0.1", free_ports(1)[0]))
    return configs


def ride_through(configs: list[WorkerConfig], gate: ResultGate, restart: Callable[[], float],
                 progress_timeout: float = DEADLINE) -> tuple[list, float]:
    """Every worker allreduces ITERATIONS times; after BEFORE_RESTART of them the gate drops the laggard's results
    until DROPPED_BEFORE_RESTART were dropped, then ``restart()`` (returns when the job is back on the switch)
    and the gate opens. Returns per rank [(result, finished at)] and transport stats, and the restart time."""
    inputs = make_inputs()
    restarted: list[float] = []

    def work(worker, rank, ready):
        out = []
        for i in range(ITERATIONS):
            out.append((worker.allreduce(inputs[i][rank]), time.monotonic()))
            if i == BEFORE_RESTART - 1:
                ready()
        return out, worker.transport.stats

    def restart_with_gate_closed() -> None:
        gate.closed.set()
        try:
            deadline = time.monotonic() + DEADLINE
            while gate.dropped < DROPPED_BEFORE_RESTART:
                assert time.monotonic() < deadline, "the gate dropped no results"
                time.sleep(0.005)
            restarted.append(restart())
        finally:
            gate.closed.clear()

    results = run_workers_with_fault(configs, work, restart_with_gate_closed, timeout=4 * DEADLINE, rto_initial=0.01,
                                     progress_timeout=progress_timeout)
    assert restarted, "the switch was not restarted"
    for i in range(ITERATIONS):
        expected, _ = expected_allreduce(inputs[i])
        for rank in range(N):
            np.testing.assert_array_equal(results[rank][0][i][0], expected, err_msg=f"rank {rank} allreduce {i}")
    return results, restarted[0]


def check_and_report(capsys, what: str, results: list, restarted: float, gate: ResultGate,
                     extra: str = "") -> None:
    stats = [s for _, s in results]
    finished = [[t for _, t in out] for out, _ in results]
    after = [min(t for t in times if t > restarted) for times in finished]
    # The laggard's lost rounds were completed by the leaders' copies of them.
    assert sum(s.shadow_resends for s in stats[:LAGGARD]) > 0, stats
    with capsys.disabled():
        print(f"\n[{what}] {gate.dropped} results dropped to rank {LAGGARD} before the restart; {extra}"
              f"job back -> first allreduce done {min(after) - restarted:.3f} s, every worker's first "
              f"{max(after) - restarted:.3f} s; all {ITERATIONS} done {max(f[-1] for f in finished) - restarted:.2f} s "
              f"after; shadow resends {[s.shadow_resends for s in stats]}, retransmissions "
              f"{[s.retransmissions for s in stats]}, stale results {[s.stale_results for s in stats]}")


@pytest.mark.slow
def test_workers_ride_through_a_wiped_switch_with_a_laggard_that_lost_results(capsys):
    with testing.LoopbackSwitch() as switch:
        aggregator = switch.aggregator
        with ResultGate((aggregator.host, aggregator.port)) as gate:
            ports = free_ports(N - 1)
            job = job_record(1, 4242, 0, [*ports, gate.address[1]])
            switch.programmer.install_job(job)
            configs = worker_configs(job, aggregator, gate)

            def restart() -> float:
                # What a restart leaves: a new pipeline (every table and register empty) ... then the
                # controller pushes the job's entries again (same generation).
                switch.client.set_pipeline(dp.P4INFO_PATH, b"")
                time.sleep(0.05)
                switch.programmer.install_job(job)
                return time.monotonic()

            results, restarted = ride_through(configs, gate, restart)
            check_and_report(capsys, "wiped in-process switch", results, restarted, gate)


@pytest.mark.slow
def test_without_shadow_resends_the_laggard_deadlocks(monkeypatch):
    """The control experiment: the same run with the shadow resends off never completes the lost rounds."""
    monkeypatch.setattr(tr.Exchange, "_resend_answered", lambda self, slots: None)
    with testing.LoopbackSwitch() as switch:
        aggregator = switch.aggregator
        with ResultGate((aggregator.host, aggregator.port)) as gate:
            job = job_record(1, 4243, 0, [*free_ports(N - 1), gate.address[1]])
            switch.programmer.install_job(job)
            configs = worker_configs(job, aggregator, gate)

            def restart() -> float:
                switch.client.set_pipeline(dp.P4INFO_PATH, b"")
                switch.programmer.install_job(job)
                return time.monotonic()

            with pytest.raises(TransportTimeout):
                ride_through(configs, gate, restart, progress_timeout=3.0)


class ProcessSwitch:
    """The software target as a process in loopback mode, programmed as the controller does."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.udp_port = free_ports(1, "both")[0]
        self.target: TargetProcess | None = None
        self.client: P4RuntimeClient | None = None
        self.programmer: SwitchProgrammer | None = None
        self.starts = 0

    def start(self, grpc_address: str | None = None) -> None:
        self.starts += 1
        self.target = start_target("soft", {}, self.tmp_path / f"switch{self.starts}.log", grpc_address=grpc_address,
                                   loopback=f"127.0.0.1:{self.udp_port}")

    def program(self, job: JobRecord) -> None:
        """What the controller does for a new (or restarted) switch: the pipeline, then the job's entries."""
        assert self.target is not None
        if self.client is not None:
            self.client.close()
        self.client = P4RuntimeClient(self.target.grpc_address, device_id=1, election_id=(0, 1))
        self.client.connect()
        self.client.set_pipeline(dp.P4INFO_PATH, b"")
        config = parse_config({
            "switch": {"grpc_address": self.target.grpc_address,
                       "aggregator": {"ip": "127.0.0.1", "udp_port": self.udp_port}},
            "slots": {"capacity": 4096},
            "controller": {"database": "unused.db", "api_socket": "unused.sock", "admin_token": "unused-token"},
            "hosts": [{"name": testing.LOCAL_HOST, "ip": "127.0.0.1", "mac": "02:00:00:00:bb:01",
                       "port": LOOPBACK_PORT_NUMBER}],
        }, "<ProcessSwitch>")
        self.programmer = SwitchProgrammer(self.client, config)
        self.programmer.install_job(job)

    def kill9(self) -> None:
        assert self.target is not None
        self.target.process.kill()
        self.target.process.wait(timeout=10)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.target is not None:
            self.target.stop()


@pytest.mark.slow
def test_workers_ride_through_a_kill_9_of_the_switch_process(capsys, tmp_path):
    switch = ProcessSwitch(tmp_path)
    try:
        switch.start()
        aggregator = Endpoint("127.0.0.1", switch.udp_port)
        with ResultGate((aggregator.host, aggregator.port)) as gate:
            job = job_record(1, 777, 0, [*free_ports(N - 1), gate.address[1]])
            switch.program(job)
            configs = worker_configs(job, aggregator, gate)
            timeline: dict[str, float] = {}

            def restart() -> float:
                assert switch.target is not None
                timeline["kill"] = time.monotonic()
                switch.kill9()
                switch.start(switch.target.grpc_address)
                timeline["up"] = time.monotonic()
                switch.program(job)
                return time.monotonic()

            results, restarted = ride_through(configs, gate, restart)
            check_and_report(capsys, "kill -9 of the switch process", results, restarted, gate,
                             f"kill -> process up {timeline['up'] - timeline['kill']:.2f} s -> job back "
                             f"{restarted - timeline['up']:.2f} s -> ")
    finally:
        switch.stop()
