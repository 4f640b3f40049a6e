"""Moves of running jobs' slots toward their fair shares (controller/moves.py, controller/shares.py; issue 40).

The job service over a stand-in switch (``conftest.FakeFabric``) and a real SQLite file, with the workers' requests
made by the test: the switch point is decided only once every rank asked, one past the largest exchange let run on
the old slots; the job switches only when every rank is there; the cells a move needs are reserved and those it
leaves are freed; a restart at any step finds the move where it was; a move that is not followed is given up.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import yaml

from netagg.controller import moves as moves_module
from netagg.controller.admission import JobRequest
from netagg.controller.config import load_config
from netagg.controller.service import Caller, JobService
from netagg.controller.shares import Claim, fair_cells
from netagg.controller.store import JobRecord, JobStore
from netagg.controller.worker_api import REFUSAL, WorkerApi
from netagg.hoststack.moves import MoveClient, MoveError
from netagg.jobconfig import Endpoint, WorkerConfig
from netagg.psproto import PsClient, PsRefused

from conftest import FakeFabric, controller_config

ALICE, BOB = Caller("alice"), Caller("bob")
_PORT = [43000]


def _config_path(tmp_path: Path, capacity: int = 64, move_wait: float = 5.0, **tenants: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = controller_config(tmp_path, "127.0.0.1:1", aggregator_port=28900, capacity=capacity, min_slots=4)
    data = yaml.safe_load(path.read_text())
    data["controller"]["worker_address"] = "127.0.0.1:0"
    data["slots"]["move_wait_seconds"] = move_wait
    for name, limits in tenants.items():
        data["tenants"][name].update(limits)
    path.write_text(yaml.safe_dump(data))
    return path


def _service(path: Path, fabric: FakeFabric | None = None) -> JobService:
    config = load_config(path)
    service = JobService(config, JobStore(config.database), fabric or FakeFabric())  # type: ignore[arg-type]
    service.load()
    service.worker_endpoint = Endpoint("127.0.0.1", 1)
    return service


def _create(service: JobService, caller: Caller, slots: int, workers: int = 2) -> dict:
    _PORT[0] += workers
    return service.create_job(caller, JobRequest(name="j", workers=[f"local:{_PORT[0] + i}" for i in range(workers)],
                                                 slots=slots, width=64))


def _ask(service: JobService, job_id: int, rank: int, exchange: int, ready: bool = False, generation: int | None = None,
         on_ps: bool = False) -> dict:
    job = service.store.get(job_id)
    assert job is not None
    return service.moves.ask(job, rank, job.generation if generation is None else generation, exchange, ready, on_ps)


# -- the shares -----------------------------------------------------------------------
def test_fair_cells_is_weighted_max_min_within_wants_minimums_and_whole_slots() -> None:
    def claim(job_id: int, want: int, weight: float = 1.0, unit: int = 1, held: int = 0, movable: bool = True,
              minimum: int = 4) -> Claim:
        return Claim(job_id, want, unit, minimum, weight, held, movable)

    assert fair_cells(64, [claim(1, 64), claim(2, 64)]) == {1: 32, 2: 32}
    assert fair_cells(64, [claim(1, 64, 3.0), claim(2, 64)]) == {1: 48, 2: 16}
    assert fair_cells(64, [claim(1, 16), claim(2, 64)]) == {1: 16, 2: 48}  # a small claim leaves the rest
    assert fair_cells(64, [claim(1, 64, held=40, movable=False), claim(2, 64)]) == {1: 40, 2: 24}
    shares = fair_cells(64, [claim(1, 64), claim(2, 64), claim(3, 64)])
    assert sorted(shares.values()) == [21, 21, 22] and sum(shares.values()) == 64
    wide = fair_cells(64, [claim(1, 64, unit=4), claim(2, 64, unit=4), claim(3, 64)])
    assert wide[1] % 4 == 0 and wide[2] % 4 == 0 and sum(wide.values()) <= 64 and wide[3] >= 20
    assert fair_cells(8, [claim(1, 64), claim(2, 64), claim(3, 64)]) == {1: 4, 2: 4, 3: 4}  # minimums do not fit


# -- one move, step by step -------------------------------------------------------------
def test_a_shrink_switches_one_past_the_last_exchange_let_run_and_only_when_every_rank_is_there(tmp_path) -> None:
    fabric = FakeFabric()
    service = _service(_config_path(tmp_path), fabric)
    job = service.store.get(_create(service, ALICE, 64)["job"]["job_id"])
    old_generation = job.generation
    move = service.moves.start(job, 32, "test")
    assert move is not None and move.slot_base == job.slot_base and move.generation > old_generation
    assert service.moves.poll(job, 0, old_generation) == {"move": move.generation, "generation": old_generation}
    assert service.moves.start(job, 16, "again") is None  # one move at a time

    assert _ask(service, job.job_id, 0, 7) == {"move": move.generation, "switch_at": None}
    assert _ask(service, job.job_id, 0, 8) == {"move": move.generation, "switch_at": None}  # runs 8 on the old slots
    assert _ask(service, job.job_id, 1, 7) == {"move": move.generation, "switch_at": 9}  # past every answered one
    assert _ask(service, job.job_id, 1, 8) == {"move": move.generation, "switch_at": 9}
    # Rank 0 ran 8 before the decision: it learns the switch point when it asks before 9; none asks past it.
    assert _ask(service, job.job_id, 0, 9) == {"move": move.generation, "switch_at": 9}
    with pytest.raises(ValueError, match="switch point"):
        _ask(service, job.job_id, 0, 10)
    with pytest.raises(ValueError, match="switch point"):
        _ask(service, job.job_id, 0, 8, ready=True)

    assert _ask(service, job.job_id, 0, 9, ready=True) == {"state": "wait"}
    assert service.store.get(job.job_id).slot_count == 64  # nothing changes before every rank is there
    assert fabric.installed[job.job_id].generation == old_generation
    go = _ask(service, job.job_id, 1, 9, ready=True)
    assert go == {"state": "go", "slot_count": 32, "generation": move.generation}
    # Rank 0 asks again with its old generation: the same go.
    assert _ask(service, job.job_id, 0, 9, ready=True, generation=old_generation) == go
    moved = service.store.get(job.job_id)
    assert (moved.slot_base, moved.slot_count, moved.generation) == (job.slot_base, 32, move.generation)
    assert fabric.installed[job.job_id].generation == move.generation
    assert service.store.move(job.job_id) is None
    assert service.allocator.free_cells == 32
    assert service.moves.counts == {"started": 1, "committed": 1}
    with pytest.raises(ValueError, match="generation"):  # a stale config is not followed anywhere else
        _ask(service, job.job_id, 0, 10, generation=old_generation)


def test_a_grow_moves_elsewhere_when_the_cells_after_it_are_taken_and_frees_the_old_range(tmp_path) -> None:
    service = _service(_config_path(tmp_path))
    a = service.store.get(_create(service, ALICE, 16)["job"]["job_id"])
    b = service.store.get(_create(service, BOB, 16)["job"]["job_id"])
    assert (a.slot_base, b.slot_base) == (0, 16)
    move = service.moves.start(a, 32, "test")
    assert move is not None and move.slot_base == 32  # cells 16.. are b's: a moves to a free range
    assert service.allocator.free_cells == 0  # both ranges held while it moves
    for rank in (0, 1):
        _ask(service, a.job_id, rank, 0)
    for rank in (0, 1):
        answer = _ask(service, a.job_id, rank, 1, ready=True)
    assert answer["state"] == "go" and answer["slot_count"] == 32
    assert service.allocator.free_cells == 16 and service.allocator.free_ranges[0].base == 0
    # b (16..31) cannot grow: the cells after it are a's, and no free range holds more than it has.
    assert service.moves.start(b, 32, "test") is None and service.allocator.free_cells == 16


def test_a_restart_finds_a_move_at_every_step(tmp_path) -> None:
    path = _config_path(tmp_path)
    service = _service(path)
    a = service.store.get(_create(service, ALICE, 16)["job"]["job_id"])
    move = service.moves.start(a, 48, "test")  # grows in place: cells 16..47 reserved
    assert move is not None and move.slot_base == 0 and service.allocator.free_cells == 16
    _ask(service, a.job_id, 0, 3)
    service.store.close()

    service = _service(path)  # the controller restarted: the reservation is back, the asks were forgotten
    assert service.allocator.free_cells == 16
    assert _ask(service, a.job_id, 1, 3) == {"move": move.generation, "switch_at": None}
    assert _ask(service, a.job_id, 0, 4) == {"move": move.generation, "switch_at": 5}
    service.store.close()

    service = _service(path)  # restarted after the decision: the switch point stands
    assert service.store.move(a.job_id).switch_at == 5
    assert _ask(service, a.job_id, 1, 4) == {"move": move.generation, "switch_at": 5}
    assert _ask(service, a.job_id, 0, 5, ready=True) == {"state": "wait"}
    service.store.close()

    fabric = FakeFabric()
    service = _service(path, fabric)  # restarted with rank 0 at the switch point: it asks again
    assert _ask(service, a.job_id, 1, 5, ready=True) == {"state": "wait"}
    go = _ask(service, a.job_id, 0, 5, ready=True)
    assert go == {"state": "go", "slot_count": 48, "generation": move.generation}
    assert fabric.installed[a.job_id].slot_count == 48 and service.allocator.free_cells == 16
    service.store.close()

    fabric = FakeFabric()
    service = _service(path, fabric)  # restarted after the commit: the late rank's go writes the switch again
    assert _ask(service, a.job_id, 1, 5, ready=True, generation=a.generation) == go
    assert fabric.installed[a.job_id].generation == move.generation


def test_a_move_nobody_follows_is_given_up_and_the_job_pinned(tmp_path, monkeypatch) -> None:
    service = _service(_config_path(tmp_path))
    a = service.store.get(_create(service, ALICE, 16)["job"]["job_id"])
    move = service.moves.start(a, 48, "test")
    assert move is not None and service.allocator.free_cells == 16
    service.moves.expire(time.time() + moves_module.DECIDE_SECONDS + 1)
    assert service.store.move(a.job_id) is None and service.allocator.free_cells == 48
    assert service.moves.counts["aborted"] == 1 and a.job_id in service.moves.pinned
    assert service.moves.start(a, 48, "again") is None  # not moved again
    assert _ask(service, a.job_id, 0, 0) == {"move": None, "state": "aborted"}  # a late worker stays


def test_a_worker_on_its_ps_gives_the_move_up_at_the_switch_point(tmp_path) -> None:
    service = _service(_config_path(tmp_path))
    a = service.store.get(_create(service, ALICE, 64)["job"]["job_id"])
    move = service.moves.start(a, 32, "test")
    assert move is not None
    for rank in (0, 1):
        _ask(service, a.job_id, rank, 0)
    assert _ask(service, a.job_id, 0, 1, ready=True) == {"state": "wait"}
    assert _ask(service, a.job_id, 1, 1, ready=True, on_ps=True)["state"] == "aborted"
    assert _ask(service, a.job_id, 0, 1, ready=True)["state"] == "aborted"  # the waiting rank stays too
    assert service.store.get(a.job_id).slot_count == 64 and service.allocator.free_cells == 0


def test_deleting_a_moving_job_frees_both_ranges(tmp_path) -> None:
    service = _service(_config_path(tmp_path))
    a = service.store.get(_create(service, ALICE, 16)["job"]["job_id"])
    assert service.moves.start(a, 48, "test") is not None
    service.delete_job(ALICE, a.job_id)
    assert service.allocator.free_cells == 64 and service.store.moves() == []


# -- fair shares ---------------------------------------------------------------------
def _follow(service: JobService, job_id: int, stop: threading.Event, workers: int = 2) -> threading.Thread:
    """Stand-in workers of ``job_id``: each rank runs an exchange every 10 ms and asks before it, as
    hoststack/moves.py does, switching when told."""
    def run() -> None:
        index, generation = 0, service.store.get(job_id).generation
        while not stop.is_set():
            job = service.store.get(job_id)
            if job is None:
                return
            if service.moves.poll(job, 0, generation)["move"] is not None:
                answers = [service.moves.ask(job, r, generation, index, False, False) for r in range(workers)]
                switch_at = answers[-1]["switch_at"]
                if switch_at is not None and index + 1 == switch_at:
                    for r in range(workers):
                        answer = service.moves.ask(job, r, generation, switch_at, True, False)
                    assert answer["state"] == "go"
                    generation = answer["generation"]
            index += 1
            time.sleep(0.01)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_newcomer_gets_its_fair_share_from_a_job_that_holds_the_switch_and_it_grows_back(tmp_path) -> None:
    service = _service(_config_path(tmp_path))
    first = _create(service, ALICE, 64)
    assert first["admission"] == "full"
    stop = threading.Event()
    follower = _follow(service, first["job"]["job_id"], stop)
    try:
        second = _create(service, BOB, 64)  # waits while alice's job shrinks to its share
        assert second["admission"] == "partial" and second["job"]["slot_count"] == 32
        assert "fair share" in second["reason"]
        assert service.store.get(first["job"]["job_id"]).slot_count == 32
        assert service.show_job(ALICE, first["job"]["job_id"])["fair_share_cells"] == 32
        service.delete_job(BOB, second["job"]["job_id"])
        assert service.moves.rebalance()  # alice's job grows back into the freed cells
        deadline = time.monotonic() + 5
        while service.store.get(first["job"]["job_id"]).slot_count != 64 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert service.store.get(first["job"]["job_id"]).slot_count == 64
    finally:
        stop.set()
        follower.join(5)


def test_a_newcomer_whose_running_jobs_do_not_follow_gets_what_is_free_after_the_wait(tmp_path) -> None:
    service = _service(_config_path(tmp_path, move_wait=0.3))
    _create(service, ALICE, 48)
    second = _create(service, BOB, 64)  # alice's workers never ask: the shrink is not decided in the wait
    assert second["admission"] == "partial" and second["job"]["slot_count"] == 16


# -- the workers' endpoint ------------------------------------------------------------
def test_the_worker_endpoint_refuses_strangers_alike_and_answers_the_jobs_workers(tmp_path) -> None:

    service = _service(_config_path(tmp_path))
    a = service.store.get(_create(service, ALICE, 32)["job"]["job_id"])
    b = service.store.get(_create(service, BOB, 4)["job"]["job_id"])
    api = WorkerApi(service, Endpoint("127.0.0.1", 0)).start()
    try:
        def request(header: dict, secret: str) -> dict:
            client = PsClient(api.address, timeout=5, secret=secret)
            try:
                return client.request(header)[0]
            finally:
                client.close()

        poll = {"op": "poll", "job_id": a.job_id, "rank": 0, "generation": a.generation}
        assert request(poll, a.secret)["move"] is None
        for header, secret in ((poll, b.secret), (poll, ""), ({**poll, "job_id": 999}, a.secret),
                               ({**poll, "job_id": "1"}, a.secret)):
            with pytest.raises(PsRefused, match=REFUSAL):  # another job's secret, none, no such job: alike
                request(header, secret)
        assert api.counts["refused"] == 4
        move = service.moves.start(a, 16, "test")
        assert request(poll, a.secret)["move"] == move.generation
        ask = {"op": "move", "job_id": a.job_id, "rank": 0, "generation": a.generation, "exchange": 3,
               "ready": False, "on_ps": False}
        for bad in ({"rank": 2}, {"exchange": -1}, {"ready": "yes"}, {"rank": True}, {"op": "commit"}):
            with pytest.raises(PsRefused):
                request({**ask, **bad}, a.secret)
        assert request(ask, a.secret)["switch_at"] is None
        assert service.store.move(a.job_id).answered == 3  # the bad requests changed nothing
    finally:
        api.stop()


def _served_job(tmp_path: Path) -> tuple[JobService, JobRecord, WorkerApi, WorkerConfig]:
    """Alice's job of 64 slots, the worker endpoint serving it, and rank 0's config as a worker reads it."""
    service = _service(_config_path(tmp_path))
    job = service.store.get(_create(service, ALICE, 64)["job"]["job_id"])
    api = WorkerApi(service, Endpoint("127.0.0.1", 0)).start()
    service.worker_endpoint = Endpoint(*api.address)
    config = WorkerConfig.from_dict(yaml.safe_load(service.worker_config(ALICE, job.job_id, 0).to_yaml()))
    return service, job, api, config


def test_a_worker_that_loses_the_controller_with_a_move_pending_fails_loudly(tmp_path) -> None:

    service, a, api, config = _served_job(tmp_path)
    assert config.controller == service.worker_endpoint and config.generation == a.generation
    client = MoveClient(config, poll_seconds=0.02, barrier_seconds=0.5)
    try:
        assert client.before_exchange(0) is None  # nothing pending: no request at all
        service.moves.start(a, 32, "test")
        deadline = time.monotonic() + 5
        while client._pending is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.before_exchange(1) is None  # rank 1 has not asked: run 1 on the old slots
        api.stop()  # the controller goes away with the move pending
        started = time.monotonic()
        with pytest.raises(MoveError, match="no answer from the controller"):
            client.before_exchange(2)
        assert 0.4 < time.monotonic() - started < 5
    finally:
        client.close()


def test_free_cells_in_pieces_come_together_by_sliding_a_job_into_a_hole(tmp_path) -> None:
    fabric = FakeFabric()
    service = _service(_config_path(tmp_path), fabric)
    ids = [_create(service, caller, 16)["job"]["job_id"] for caller in (ALICE, BOB, ALICE, BOB)]
    service.delete_job(ALICE, ids[0])
    service.delete_job(ALICE, ids[2])  # free: 0..15 and 32..47, 32 cells in two pieces
    assert service.allocator.largest_free() == 16
    jobs = {j.job_id: j for j in service.store.all()}
    move = service.moves._compact(jobs, 32)
    assert move is not None and move.job_id == ids[1] and (move.slot_base, move.slot_count) == (0, 16)
    assert service.allocator.free_cells == 16  # the hole it slides into is reserved; its own cells still held
    for rank in (0, 1):
        _ask(service, ids[1], rank, 0)
    for rank in (0, 1):
        answer = _ask(service, ids[1], rank, 1, ready=True)
    assert answer == {"state": "go", "slot_count": 16, "generation": move.generation}
    assert fabric.installed[ids[1]].slot_base == 0
    assert service.allocator.largest_free() == 32 and service.allocator.free_ranges[0].base == 16
    assert service.moves._compact({j.job_id: j for j in service.store.all()}, 32) is None  # nothing to do


def test_a_worker_restarted_with_a_config_from_before_a_move_refuses_to_run(tmp_path) -> None:

    service, a, api, stale = _served_job(tmp_path)
    move = service.moves.start(a, 32, "test")
    for rank in (0, 1):
        _ask(service, a.job_id, rank, 0)
    for rank in (0, 1):
        _ask(service, a.job_id, rank, 1, ready=True)
    assert service.store.get(a.job_id).generation == move.generation
    client = MoveClient(stale, poll_seconds=0.02)
    try:
        deadline = time.monotonic() + 5
        while client._stale is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(MoveError, match="fresh config"):
            client.before_exchange(0)
    finally:
        client.close()
        api.stop()


def test_the_metrics_give_each_jobs_fair_share_and_the_moves(tmp_path) -> None:
    from netagg.controller.metrics import ControllerCollector

    service = _service(_config_path(tmp_path))
    a = service.store.get(_create(service, ALICE, 64)["job"]["job_id"])
    move = service.moves.start(a, 32, "test")
    assert move is not None

    def families() -> dict:
        return {f.name: f for f in ControllerCollector(service)._moves(service.store.all())}

    found = families()
    assert [s.value for s in found["netagg_job_fair_share_cells"].samples] == [64]
    assert found["netagg_moves_pending"].samples[0].value == 1
    for rank in (0, 1):
        _ask(service, a.job_id, rank, 0)
    for rank in (0, 1):
        _ask(service, a.job_id, rank, 1, ready=True)
    found = families()
    assert found["netagg_moves_pending"].samples[0].value == 0
    outcomes = {s.labels["outcome"]: s.value for s in found["netagg_moves"].samples if s.name.endswith("_total")}
    assert outcomes == {"started": 1, "committed": 1, "aborted": 0}
    shown = service.show_job(ALICE, a.job_id)
    assert shown["last_move"] == "64 -> 32 slots (test)" and shown["movable"] == "yes" and shown["moving"] is None


def test_one_host_cannot_take_every_connection_of_the_worker_endpoint(tmp_path, monkeypatch) -> None:
    from netagg.controller import worker_api
    from netagg.psproto import PsUnreachable

    monkeypatch.setattr(worker_api, "PER_HOST_CONNECTIONS", 2)
    service = _service(_config_path(tmp_path))
    a = service.store.get(_create(service, ALICE, 16)["job"]["job_id"])
    api = WorkerApi(service, Endpoint("127.0.0.1", 0)).start()
    poll = {"op": "poll", "job_id": a.job_id, "rank": 0, "generation": a.generation}
    clients = [PsClient(api.address, timeout=5, secret=a.secret) for _ in range(3)]
    try:
        assert [c.request(poll)[0]["move"] for c in clients[:2]] == [None, None]
        with pytest.raises(PsUnreachable):
            clients[2].request(poll)  # closed at once: the host holds its two
        assert api.counts["connections_refused"] == 1
        clients[0].close()
        deadline = time.monotonic() + 5
        while True:  # the server notices the close within its poll interval
            again = PsClient(api.address, timeout=5, secret=a.secret)
            try:
                assert again.request(poll)[0]["move"] is None
                break
            except PsUnreachable:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            finally:
                again.close()
    finally:
        for client in clients:
            client.close()
        api.stop()


def test_a_job_whose_workers_learned_of_a_move_but_ran_no_exchange_is_not_pinned(tmp_path) -> None:
    service = _service(_config_path(tmp_path))
    a = service.store.get(_create(service, ALICE, 64)["job"]["job_id"])
    assert service.moves.start(a, 32, "test") is not None
    service.moves.poll(a, 0, a.generation)  # a rank learned of it, but its next exchange is far off
    service.moves.expire(time.time() + moves_module.DECIDE_SECONDS + 1)
    assert service.store.move(a.job_id) is None and a.job_id not in service.moves.pinned
    assert service.moves.start(a, 32, "again") is not None  # tried again later


def test_a_rank_late_at_a_switch_point_gets_its_go_after_the_next_move_started(tmp_path) -> None:
    service = _service(_config_path(tmp_path))
    a = service.store.get(_create(service, ALICE, 64)["job"]["job_id"])
    first = service.moves.start(a, 32, "test")
    for rank in (0, 1):
        _ask(service, a.job_id, rank, 0)
    assert _ask(service, a.job_id, 0, 1, ready=True) == {"state": "wait"}
    assert _ask(service, a.job_id, 1, 1, ready=True)["state"] == "go"  # committed
    second = service.moves.start(service.store.get(a.job_id), 48, "next")
    assert second is not None
    late = _ask(service, a.job_id, 0, 1, ready=True, generation=a.generation)  # rank 0 asks again, old generation
    assert late == {"state": "go", "slot_count": 32, "generation": first.generation}
    with pytest.raises(ValueError, match="generation"):  # an older config than that one is not answered go
        _ask(service, a.job_id, 0, 1, ready=True, generation=a.generation - 1)


def test_a_rank_at_the_switch_point_of_a_move_given_up_meanwhile_stays_even_with_a_next_move(tmp_path) -> None:
    service = _service(_config_path(tmp_path))
    a = service.store.get(_create(service, ALICE, 64)["job"]["job_id"])
    first = service.moves.start(a, 32, "test")
    for rank in (0, 1):
        service.moves.poll(a, rank, a.generation)
    assert _ask(service, a.job_id, 0, 4) == {"move": first.generation, "switch_at": None}
    assert _ask(service, a.job_id, 1, 4)["switch_at"] == 5
    # Every rank learned of it: a slow exchange does not give it up at DECIDE_SECONDS ...
    service.moves.expire(time.time() + moves_module.DECIDE_SECONDS + 1)
    assert service.store.move(a.job_id) is not None
    service.moves.expire(time.time() + moves_module.SWITCH_SECONDS + 1)  # ... but a rank that never comes does
    second = service.moves.start(service.store.get(a.job_id), 16, "next")
    assert second is not None
    job = service.store.get(a.job_id)
    answer = service.moves.ask(job, 0, a.generation, 5, True, False, first.generation)
    assert answer == {"move": None, "state": "aborted"}  # stays on the old slots; learns the next move by polling
    assert service.store.get(a.job_id).slot_count == 64


def test_a_view_never_pairs_the_old_slot_count_with_no_move_pending(tmp_path, monkeypatch) -> None:
    """``job show`` and ``job list`` read a job's row and its move at one moment: a move that commits meanwhile (the
    last rank reaching the switch point) waits for the view, which tells the old range with its move pending."""
    service = _service(_config_path(tmp_path))
    job_id = _create(service, ALICE, 64)["job"]["job_id"]
    old_generation = service.store.get(job_id).generation
    move = service.moves.start(service.store.get(job_id), 32, "test")
    assert move is not None
    assert _ask(service, job_id, 0, 7)["switch_at"] is None and _ask(service, job_id, 1, 7)["switch_at"] == 8
    assert _ask(service, job_id, 0, 8, ready=True) == {"state": "wait"}
    describe, last_ranks = service.moves.describe, []

    def committing_meanwhile(job: JobRecord) -> dict:
        last_ranks.append(threading.Thread(target=_ask, args=(service, job_id, 1, 8, True, old_generation),
                                           daemon=True))
        last_ranks[-1].start()
        last_ranks[-1].join(0.3)
        return describe(job)

    monkeypatch.setattr(service.moves, "describe", committing_meanwhile)
    for view in (lambda: service.show_job(ALICE, job_id), lambda: service.list_jobs(ALICE)[0]):
        shown = view()
        assert (shown["slot_count"], shown["moving"] is None) in {(64, False), (32, True)}, shown
        last_ranks[-1].join(5)
    assert service.store.get(job_id).slot_count == 32  # the commit went on after the view
