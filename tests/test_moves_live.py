"""Moves on a running job, end to end (issue 40): a controller process with its worker endpoint, the software
target, and real workers allreducing over loopback UDP while the controller shrinks their job for a newcomer and
grows it back when the newcomer leaves; every sum exact on every worker, before, during and after the moves.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from netagg.bmv2.targets import TargetProcess, start_target
from netagg.controller.api import ApiClient
from netagg.hoststack.kv import KVWorker
from netagg.jobconfig import WorkerConfig
from netagg.localports import free_ports
from netagg.testing.hoststack import expected_allreduce

from conftest import TOKENS, ControllerProcess, config_for, free_udp_port, start_controller

SIZE = 12_000  # 188 blocks of 64: several rounds per slot at 32 slots
DEADLINE = 60.0


def _configs(client: ApiClient, job_id: int, workers: int) -> list[WorkerConfig]:
    return [WorkerConfig.from_dict(yaml.safe_load(client.call("config", job_id=job_id, rank=rank)))
            for rank in range(workers)]


class Job:
    """Two worker threads allreducing until either asks to stop: each call's last value is the stop vote, so both
    ranks see the same sum and stop after the same call."""

    def __init__(self, configs: list[WorkerConfig], seed: int, calls: int | None = None) -> None:
        self.configs, self.seed, self.calls = configs, seed, calls
        self.stop = threading.Event()
        self.done = [0, 0]
        self.wrong: list[str] = []
        self.errors: list[BaseException] = []
        self.moves = [0, 0]
        self.slots = [0, 0]
        self.threads = [threading.Thread(target=self._run, args=(rank,), daemon=True) for rank in range(2)]
        for thread in self.threads:
            thread.start()

    def inputs(self, call: int, rank: int, stopping: bool) -> np.ndarray:
        values = np.random.default_rng((self.seed, call, rank)).standard_normal(SIZE).astype(np.float32)
        values[-1] = 1.0 if stopping else 0.0
        return values

    def _run(self, rank: int) -> None:
        try:
            with KVWorker(self.configs[rank], progress_timeout=DEADLINE) as worker:
                call = 0
                while True:
                    stopping = self.stop.is_set() or (self.calls is not None and call + 1 >= self.calls)
                    mine = self.inputs(call, rank, stopping)
                    got = worker.allreduce(mine)
                    others = [self.inputs(call, r, False) for r in range(2)]
                    expected, _ = expected_allreduce([mine if r == rank else others[r] for r in range(2)])
                    if got[-1] == 0 and not np.array_equal(got[:-1], expected[:-1]):
                        self.wrong.append(f"rank {rank} call {call}")
                    call += 1
                    self.done[rank] = call
                    if got[-1] > 0:
                        break
                    time.sleep(0.005)
                self.moves[rank] = worker.moves
                self.slots[rank] = worker.transport.slot_count
        except BaseException as err:  # reported by join()
            self.errors.append(err)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(DEADLINE)
        assert not any(t.is_alive() for t in self.threads), "a worker hangs"
        assert not self.errors, self.errors
        assert not self.wrong, f"sums differing from the exact ones: {self.wrong}"
        assert self.done[0] == self.done[1]


def _wait_for(what: str, condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("kind", ["soft", "soft-sharded"])
def test_a_running_job_shrinks_for_a_newcomer_and_grows_back_with_every_sum_exact(tmp_path: Path, kind: str) -> None:
    switch = start_target(kind, {}, tmp_path / "switch.log", loopback=f"127.0.0.1:{free_udp_port()}")
    try:
        _shrink_and_grow_back(tmp_path, switch)
    finally:
        switch.stop()


def _controller_with_moves(tmp_path: Path, switch: TargetProcess) -> tuple[Path, dict, ControllerProcess]:
    """A controller of 64 cells on ``switch`` with its worker endpoint: its config's path and data, the process."""
    path = config_for(tmp_path, switch, capacity=64)
    data = yaml.safe_load(path.read_text())
    data["controller"]["worker_address"] = "127.0.0.1:0"
    path.write_text(yaml.safe_dump(data))
    return path, data, start_controller(path, tmp_path / "controller.log")


def _first_job(alice: ApiClient, ports: list[int]) -> int:
    """Alice's job of 64 slots on two workers, admitted in full; its id."""
    first = alice.call("create", name="a", workers=[f"local:{p}" for p in ports[:2]], slots=64, width=64)
    assert first["admission"] == "full"
    return first["job"]["job_id"]


def _shrink_and_grow_back(tmp_path: Path, switch: TargetProcess) -> None:
    _, _, ctl = _controller_with_moves(tmp_path, switch)
    try:
        alice, bob = ApiClient(ctl.socket, TOKENS["alice"]), ApiClient(ctl.socket, TOKENS["bob"])
        ports = free_ports(4)
        a_id = _first_job(alice, ports)
        a_configs = _configs(alice, a_id, 2)
        assert a_configs[0].controller is not None
        assert a_configs[0].generation == alice.call("show", job_id=a_id)["generation"]
        a = Job(a_configs, seed=1)
        _wait_for("job a's first calls", lambda: min(a.done) >= 5)

        second = bob.call("create", name="b", workers=[f"local:{p}" for p in ports[2:]], slots=64, width=64)
        assert second["admission"] == "partial" and second["job"]["slot_count"] == 32, second
        assert alice.call("show", job_id=a_id)["slot_count"] == 32
        b = Job(_configs(bob, second["job"]["job_id"], 2), seed=2, calls=30)
        b.join()
        bob.call("delete", job_id=second["job"]["job_id"])
        _wait_for("job a to grow back", lambda: alice.call("show", job_id=a_id)["slot_count"] == 64)
        done_then = min(a.done)
        _wait_for("job a's calls on its grown slots", lambda: min(a.done) >= done_then + 5)
        a.stop.set()
        a.join()
        assert a.moves == [2, 2] and a.slots == [64, 64]
        shown = alice.call("show", job_id=a_id)
        assert shown["last_move"].startswith("32 -> 64 slots") and shown["moving"] is None
    finally:
        ctl.stop()


def test_a_controller_killed_mid_move_comes_back_to_a_consistent_job_and_switch(tmp_path: Path,
                                                                               soft_switch: TargetProcess) -> None:
    """The controller dies (SIGKILL) as soon as it has written a shrink for a newcomer; restarted, it finds the move,
    the running job's workers (which keep asking meanwhile) finish it or it is given up, and the job grows back to
    its share: every sum exact, and the switch's entry the database's."""
    path, data, ctl = _controller_with_moves(tmp_path, soft_switch)
    try:
        alice, bob = ApiClient(ctl.socket, TOKENS["alice"]), ApiClient(ctl.socket, TOKENS["bob"])
        ports = free_ports(4)
        a_id = _first_job(alice, ports)
        a = Job(_configs(alice, a_id, 2), seed=3)
        _wait_for("job a's first calls", lambda: min(a.done) >= 5)
        creating = threading.Thread(target=lambda: _ignore_errors(lambda: bob.call(
            "create", name="b", workers=[f"local:{p}" for p in ports[2:]], slots=64, width=64)), daemon=True)
        creating.start()
        database = data["controller"]["database"]
        _wait_for("the move's row", lambda: _moves_in(database) > 0)
        ctl.kill()
        creating.join(10)
        time.sleep(0.5)  # the workers ask a controller that is not there
        ctl = start_controller(path, tmp_path / "controller-2.log")
        alice = ApiClient(ctl.socket, TOKENS["alice"])
        assert [j["job_id"] for j in ApiClient(ctl.socket, TOKENS["bob"]).call("list")] == []  # b was never made
        _wait_for("job a back at its share with no move pending", lambda: _settled(alice, a_id, 64), timeout=90)
        done_then = min(a.done)
        _wait_for("job a's calls after it settled", lambda: min(a.done) >= done_then + 5)
        a.stop.set()
        a.join()
        assert a.slots == [64, 64]
        shown = alice.call("show", job_id=a_id)
        assert shown["counters"]["results"] > 0  # the switch holds the job's entry of its current generation
        endpoints = [re.findall(r"worker endpoint on (\S+)", (tmp_path / log).read_text())
                     for log in ("controller.log", "controller-2.log")]
        assert endpoints[0] and endpoints[0] == endpoints[1]  # port 0 configured: the same port after the restart
    finally:
        ctl.stop()


def _ignore_errors(call) -> None:
    with contextlib.suppress(Exception):  # the controller is killed under it
        call()


def _moves_in(database: str) -> int:
    import sqlite3

    with sqlite3.connect(database, timeout=5) as conn:
        try:
            return conn.execute("SELECT COUNT(*) FROM moves").fetchone()[0]
        except sqlite3.OperationalError:
            return 0


def _settled(client: ApiClient, job_id: int, slots: int) -> bool:
    shown = client.call("show", job_id=job_id)
    return shown["slot_count"] == slots and shown["moving"] is None
