"""Failover to the PS (hoststack/failover.py): a switch that stays away moves the job to its PS, and back.

The coordinator's rules are checked alone first (votes, the decision, the same route answer for every
worker, the retry backoff, the round-number guard). Then whole jobs on the software target with a real
PS process-in-thread: the switch loses the job (its pipeline replaced, as a restart leaves it, or the
target process killed with SIGKILL) and stays away past ``failover_after``; every allreduce of every
worker must stay exact, the job must run at the PS meanwhile and return to the switch once it is back.
The hard case: a laggard that lost results the other workers received, so that the workers stand in two
different exchanges when they vote, and the leaders must send an exchange they finished again.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from netagg import dataplane as dp
from netagg import wire
from netagg.hoststack.failover import ROUND_GUARD, FailoverClient, FailoverCoordinator
from netagg.hoststack.server import KVServer
from netagg.jobconfig import ConfigError, Endpoint, WorkerConfig
from netagg.localports import free_ports
from netagg.testing.hoststack import expected_allreduce, run_workers, run_workers_with_fault
from tests.test_hoststack_switch_restart import ProcessSwitch, ResultGate, job_record

testing = pytest.importorskip("netagg.testing.softswitch")

N = 3
SLOTS = 32
SIZE = 16_000  # values per allreduce: 250 blocks
FAILOVER_AFTER = 0.4
DEADLINE = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def coordinator(n: int = 3, retry: float = 2.0) -> tuple[FailoverCoordinator, list, Clock]:
    decided: list = []
    clock = Clock()
    return FailoverCoordinator(n, lambda epoch, addresses: decided.append((epoch, addresses)),
                               retry_initial=retry, retry_max=8.0, clock=clock), decided, clock


def address(rank: int) -> tuple[str, int]:
    return ("127.0.0.1", 20000 + rank)


# -- the coordinator alone ----------------------------------------------------------------------------------
def test_a_decision_needs_every_rank_and_starts_at_the_lowest_exchange_voted():
    c, decided, _ = coordinator()
    assert c.vote(0, 0, 8, address(0))["state"] == "pending"
    assert c.vote(0, 0, 8, address(0)) == {"state": "pending", "votes": 1, "of": 3}  # a re-vote counts once
    assert c.vote(2, 0, 8, address(2))["state"] == "pending"
    assert not decided
    assert c.vote(1, 0, 7, address(1)) == {"state": "decided", "epoch": 1, "start": 7}
    assert decided == [(1, {0: address(0), 1: address(1), 2: address(2)})]
    # The others learn the same decision when they vote again with the epoch they knew.
    assert c.vote(0, 0, 8, address(0)) == {"state": "decided", "epoch": 1, "start": 7}
    assert c.withdraw(2, 0) == {"state": "decided", "epoch": 1, "start": 7}
    assert c.degraded and c.decisions == 1


def test_a_withdrawn_vote_does_not_count():
    c, decided, _ = coordinator()
    c.vote(0, 0, 3, address(0))
    c.vote(1, 0, 3, address(1))
    assert c.withdraw(1, 0) == {"state": "withdrawn"}
    assert c.vote(2, 0, 3, address(2))["state"] == "pending"
    assert not decided
    assert c.vote(1, 0, 3, address(1))["state"] == "decided"


@pytest.mark.parametrize("bad", [(-1, 0), (3, 0), (0, -5)])
def test_bad_votes_are_refused(bad):
    c, _, _ = coordinator()
    rank, index = bad
    with pytest.raises(ValueError):
        c.vote(rank, 0, index, address(0))


def test_route_answers_every_worker_alike_and_returns_past_every_exchange_sent_to_the_ps():
    c, _, clock = coordinator(retry=2.0)
    for rank in range(3):
        c.vote(rank, 0, 5, address(rank))
    assert c.route(5, 10) == {"target": "ps"}  # a worker past the restarted exchange asks before the next
    assert c.route(6, 10) == {"target": "ps"}
    clock.now += 2.5  # the retry time: the first question fixes the return index
    assert c.route(5, 10) == {"target": "ps"}  # a slower worker still asking about 5: 5 and 6 were at the PS
    assert c.return_index == 7
    assert c.route(6, 10) == {"target": "ps"}
    assert c.route(7, 10) == {"target": "switch"}
    assert c.route(8, 10) == {"target": "switch"}
    assert c.returns == 1


def test_the_retry_delay_doubles_while_the_first_exchange_back_fails_and_resets_after_a_good_one():
    c, _, clock = coordinator(retry=2.0)

    def fail_at(index: int) -> tuple[float, int]:
        """Every worker votes at ``index``, then runs an exchange at the PS every 0.5 s: how long until one
        goes to the switch, and which."""
        for rank in range(3):
            c.vote(rank, c.epoch, index, address(rank))
        start = clock.now
        index += 1
        while c.route(index, 0)["target"] == "ps":
            assert c.route(index, 0)["target"] == "ps"  # the same answer for every worker
            clock.now += 0.5
            index += 1
        assert c.return_index == index
        return clock.now - start, index

    delays = []
    index = 4
    for _ in range(4):  # each return fails at its first exchange: 2, 4, 8, then capped at retry_max
        delay, index = fail_at(index)
        delays.append(delay)
    assert delays == [2.0, 4.0, 8.0, 8.0]
    assert fail_at(index + 3)[0] == 2.0  # back on the switch for a few exchanges before this failure: fresh


def test_exchanges_a_voter_ran_at_the_ps_without_asking_never_go_back_to_the_switch():
    c, _, clock = coordinator(retry=1.0)
    c.vote(0, 0, 9, address(0))
    c.vote(1, 0, 10, address(1))  # ahead: it runs 9 again and then 10 at the PS, without asking
    c.vote(2, 0, 9, address(2))
    clock.now += 5
    assert c.route(10, 0)["target"] == "ps"  # rank 0 asking before its 10
    assert c.return_index == 11


def test_the_controller_brings_the_job_back_at_once_and_only_a_restarted_switch_past_the_round_guard():
    c, _, clock = coordinator(retry=1000.0)
    for rank in range(3):
        c.vote(rank, 0, 0, address(rank))
    assert c.route(1, 5)["target"] == "ps"
    c.switch_back(fresh=False)
    assert c.route(2, ROUND_GUARD)["target"] == "ps"  # rounds far ahead of a switch that kept its registers
    assert c.route(3, ROUND_GUARD - 1)["target"] == "switch"
    for rank in range(3):  # the switch is still away
        c.vote(rank, c.epoch, 3, address(rank))
    clock.now += 5000
    assert c.route(4, 10 * ROUND_GUARD)["target"] == "ps"  # due, but too far ahead for a switch not restarted
    c.switch_back(fresh=True)
    assert c.route(5, 10 * ROUND_GUARD)["target"] == "switch"


def test_a_worker_whose_ps_is_unreachable_keeps_waiting_for_the_switch():
    port = free_ports(1, "both")[0]  # nothing listens there
    client = FailoverClient(("127.0.0.1", port), 1, 0, after=0.1, wait=0.2)
    assert client.vote(0, ("127.0.0.1", 1)) is None
    assert client.on_ps(0, 0) is True  # never leave the PS without its word


def test_failover_after_is_validated():
    base = dict(job_id=1, rank=0, num_workers=2, slot_count=4, mode="allreduce",
                aggregator=Endpoint("127.0.0.1", 1), bind=Endpoint("127.0.0.1", 2))
    assert WorkerConfig(**base).failover_after == 5.0
    for bad in (-1, True, "5", float("nan"), 1e9):
        with pytest.raises(ConfigError, match="failover_after"):
            WorkerConfig(**base, failover_after=bad)


# -- whole jobs -----------------------------------------------------------------------------------------------
def make_input(i: int, rank: int) -> np.ndarray:
    rng = np.random.default_rng([23, i, rank])
    return (rng.standard_normal(SIZE) * 10.0 ** rng.integers(-6, 6)).astype(np.float32)


def run_job(configs: list[WorkerConfig], iterations: int, fault, after: int = 3,
            timeline: dict[str, float] | None = None) -> tuple[list, list]:
    """Every worker allreduces at least ``iterations`` times; once all finished ``after`` of them, ``fault()``
    runs in a thread. With ``timeline``, the workers go on until each did 3 allreduces after
    ``timeline["back"]`` was set (they agree on when to stop with one more allreduce per iteration). Checks
    every result against the exact sum; returns per rank (finish times, transport stats)."""
    def work(worker, rank, ready):
        out = []
        after_back = 0
        for i in range(2000):
            out.append((worker.allreduce(make_input(i, rank)), time.monotonic()))
            if i == after - 1:
                ready()
            if timeline is None:
                if i + 1 == iterations:
                    break
                continue
            after_back += "back" in timeline
            done = float(i + 1 >= iterations and after_back >= 3)
            if worker.allreduce(np.array([done], np.float32))[0] == N:
                break
        return out, worker.transport.stats

    results = run_workers_with_fault(configs, work, fault, timeout=4 * DEADLINE, rto_initial=0.01,
                                     progress_timeout=DEADLINE / 2)
    done = len(results[0][0])
    assert all(len(out) == done for out, _ in results)
    for i in range(done):
        expected, _ = expected_allreduce([make_input(i, rank) for rank in range(N)], k=configs[0].width)
        for rank in range(N):
            np.testing.assert_array_equal(results[rank][0][i][0], expected, err_msg=f"rank {rank} allreduce {i}")
    return [[t for _, t in out] for out, _ in results], [stats for _, stats in results]


class TailGate(ResultGate):
    """A :class:`ResultGate` that drops, to its worker, the switch's results of data blocks ``drop`` (seq range)."""

    def __init__(self, target: tuple[str, int], drop: range) -> None:
        super().__init__(target)
        self.drop = drop

    def drops(self, data: bytes) -> bool:
        return len(data) >= wire.HEADER_BYTES and \
            wire.HEADER_STRUCT.unpack_from(data, 0)[wire.FIELD_INDEX["seq"]] in self.drop


def wait_for(condition, what: str, timeout: float = DEADLINE) -> float:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return time.monotonic()


def report(capsys, what: str, times: list[list[float]], stats: list, timeline: dict[str, float]) -> None:
    away = timeline["away"]
    first_after = min(t for ts in times for t in ts if t > timeline["decided"])
    with capsys.disabled():
        print(f"\n[{what}] switch away -> decision {timeline['decided'] - away:.2f} s -> first allreduce at the "
              f"PS {first_after - timeline['decided']:.3f} s; switch back after {timeline['back'] - away:.2f} s; "
              f"failovers {[s.failovers for s in stats]}, returns {[s.failover_returns for s in stats]}, "
              f"replayed {[s.replayed_exchanges for s in stats]}")


@pytest.mark.parametrize("mode", ["allreduce", "ps"])
def test_a_switch_that_stays_away_moves_the_job_to_the_ps_and_back_with_exact_sums(capsys, mode):
    with testing.LoopbackSwitch() as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = [dataclasses.replace(c, failover_after=FAILOVER_AFTER)
                   for c in switch.add_job(N, slot_count=SLOTS, mode=mode, ps=ps)]
        job = switch.jobs[configs[0].job_id]
        with KVServer(configs[0], failover_retry=30.0) as server:
            timeline: dict[str, float] = {}

            def fault() -> None:
                # A restart's aftermath: a new pipeline, no tables; the job's packets are dropped.
                timeline["away"] = time.monotonic()
                switch.client.set_pipeline(dp.P4INFO_PATH, b"")
                timeline["decided"] = wait_for(lambda: server.failover.decisions >= 1, "a failover decision")
                time.sleep(0.5)  # the job runs at the PS meanwhile
                switch.programmer.install_job(job)  # what the controller does once the switch is back ...
                server.failover.switch_back(fresh=True)  # ... and it tells the PS
                timeline["back"] = time.monotonic()

            times, stats = run_job(configs, 10, fault, timeline=timeline)
            assert server.failover.decisions == 1 and server.failover.returns == 1
            assert server.stats.failover_contributions > 0
        for s in stats:
            assert s.failovers == 1 and s.failover_returns == 1, s
        # Exchanges after the return went through the switch again.
        assert switch.counters(job.job_id)["results"] > 0
        assert max(ts[-1] for ts in times) > timeline["back"]
        report(capsys, f"{mode}: pipeline wiped", times, stats, timeline)


def test_a_laggard_that_lost_results_makes_the_leaders_send_a_finished_exchange_again(capsys):
    """Leaders finish exchange E, the laggard lost some of E's results; then the switch goes away for good. The
    decision starts at E: the leaders run E again at the PS (its result is the same), and every sum is exact."""
    with testing.LoopbackSwitch() as switch:
        aggregator = switch.aggregator
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        blocks = SIZE // wire.K
        # The laggard loses the results of the last 8 blocks of exchange 3 (seq = block counter).
        with TailGate((aggregator.host, aggregator.port), range(4 * blocks - 8, 4 * blocks)) as gate:
            laggard = N - 1
            # The laggard reaches the switch through the gate; the switch knows it by the gate's address.
            configs = switch.add_job(N, slot_count=SLOTS, mode="allreduce", ps=ps,
                                     bind_ports=[*free_ports(N - 1), gate.address[1]])
            configs = [dataclasses.replace(c, failover_after=FAILOVER_AFTER) for c in configs]
            configs[laggard] = dataclasses.replace(configs[laggard], aggregator=Endpoint(*gate.address),
                                                   bind=Endpoint("127.0.0.1", free_ports(1)[0]))
            with KVServer(configs[0], failover_retry=1000.0) as server:
                timeline: dict[str, float] = {}

                def fault() -> None:
                    wait_for(lambda: gate.dropped >= 8, "results dropped to the laggard")
                    timeline["away"] = time.monotonic()
                    switch.client.set_pipeline(dp.P4INFO_PATH, b"")  # and it does not come back
                    timeline["decided"] = wait_for(lambda: server.failover.decisions >= 1, "a failover decision")
                    timeline["back"] = timeline["decided"]

                times, stats = run_job(configs, 10, fault)
            leaders = stats[:laggard]
            assert all(s.failovers == 1 for s in stats), stats
            assert all(s.replayed_exchanges == 1 for s in leaders), leaders
            assert stats[laggard].replayed_exchanges == 0
            report(capsys, "laggard + switch gone", times, stats, timeline)


@pytest.mark.slow
def test_kill_9_of_the_switch_process_for_longer_than_the_bound_fails_over_and_returns(capsys, tmp_path):
    switch = ProcessSwitch(tmp_path)
    try:
        switch.start()
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        aggregator = Endpoint("127.0.0.1", switch.udp_port)
        job = job_record(1, 991, 0, free_ports(N))
        switch.program(job)
        configs = [WorkerConfig(job_id=1, rank=w.rank, num_workers=N, slot_count=SLOTS, mode="allreduce",
                                aggregator=aggregator, bind=Endpoint(w.ip, w.udp_port), ps=ps,
                                failover_after=FAILOVER_AFTER) for w in job.workers]
        with KVServer(configs[0], failover_retry=30.0) as server:
            timeline: dict[str, float] = {}

            def fault() -> None:
                assert switch.target is not None
                timeline["away"] = time.monotonic()
                switch.kill9()
                timeline["decided"] = wait_for(lambda: server.failover.decisions >= 1, "a failover decision")
                switch.start(switch.target.grpc_address)
                switch.program(job)
                server.failover.switch_back(fresh=True)
                timeline["back"] = time.monotonic()

            times, stats = run_job(configs, 10, fault, timeline=timeline)
            assert server.failover.returns == 1
        assert all(s.failovers == 1 and s.failover_returns == 1 for s in stats), stats
        report(capsys, "kill -9 of the switch process", times, stats, timeline)
    finally:
        switch.stop()


@pytest.mark.slow
def test_with_the_controller_a_killed_switch_sends_the_job_to_its_ps_and_the_resync_brings_it_back(capsys, tmp_path):
    """The whole chain: controller daemon, switch process, PS; kill -9 of the switch for longer than the bound.
    The workers fail over by themselves; the controller's resync tells the PS, and the job returns."""
    import yaml

    from tests.test_controller_switch_restart import cli, config_with_metrics, kill9, restart_switch, start_switch

    from conftest import start_controller

    switches = [start_switch(tmp_path, "switch1")]
    config, _ = config_with_metrics(tmp_path, switches[0])
    ctl = start_controller(config, tmp_path / "controller.log")
    try:
        code, out, err = cli(capsys, ctl, "--json", "job", "create", "--slots", str(SLOTS), "--ps", "ps0",
                             "--workers", ",".join(f"local:{p}" for p in free_ports(N)))
        assert code == 0, err
        job_id = yaml.safe_load(out)["job"]["job_id"]
        configs = []
        for rank in range(N):
            code, out, err = cli(capsys, ctl, "job", "config", str(job_id), "--rank", str(rank))
            assert code == 0, err
            configs.append(dataclasses.replace(WorkerConfig.from_dict(yaml.safe_load(out)),
                                               failover_after=FAILOVER_AFTER))
        with KVServer(configs[0], failover_retry=1000.0) as server:  # only the controller's word brings it back
            timeline: dict[str, float] = {}

            def fault() -> None:
                timeline["away"] = time.monotonic()
                kill9(switches[0])
                timeline["decided"] = wait_for(lambda: server.failover.decisions >= 1, "a failover decision")
                switches.append(restart_switch(tmp_path, switches[0], "switch2"))
                timeline["restarted"] = time.monotonic()
                timeline["back"] = wait_for(lambda: server.failover.returns >= 1, "the return to the switch")

            times, stats = run_job(configs, 10, fault, timeline=timeline)
        assert all(s.failovers == 1 and s.failover_returns == 1 for s in stats), stats
        report(capsys, "controller + kill -9", times, stats, timeline)
        with capsys.disabled():
            back = timeline["back"] - timeline["restarted"]
            print(f"  switch process restarted -> job back on the switch {back:.2f} s")
    finally:
        ctl.stop()
        for switch in switches:
            switch.stop()


def test_ps_mode_pushes_applied_at_the_ps_during_a_failover_are_applied_once_and_exactly(capsys):
    """ps mode: the PS applies every push (sum store: the latest aggregate) whether its blocks came from the
    switch or from its own failover aggregator; every pull sees exactly its push's sum."""
    with testing.LoopbackSwitch() as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = [dataclasses.replace(c, failover_after=FAILOVER_AFTER)
                   for c in switch.add_job(N, slot_count=SLOTS, mode="ps", ps=ps)]
        pushes = 8
        with KVServer(configs[0], failover_retry=1000.0) as server:
            away = threading.Event()

            def job(worker, rank):
                pulled = []
                for i in range(pushes):
                    if i == 3 and rank == 0:
                        switch.client.set_pipeline(dp.P4INFO_PATH, b"")  # gone for good
                        away.set()
                    worker.wait(worker.push(7, make_input(i, rank)))
                    pulled.append(worker.wait(worker.pull(7))[0])
                return pulled, worker.transport.stats

            results = run_workers(configs, job, timeout=4 * DEADLINE, rto_initial=0.01, progress_timeout=DEADLINE / 2)
            assert away.is_set() and server.failover.decisions == 1
            assert server.applied_rounds == pushes
        for i in range(pushes):
            expected, _ = expected_allreduce([make_input(i, rank) for rank in range(N)], k=configs[0].width)
            for rank in range(N):  # the sum store keeps each push's aggregate
                np.testing.assert_array_equal(results[rank][0][i], expected, err_msg=f"rank {rank} pull {i}")
        assert all(s.failovers == 1 for _, s in results)


def test_a_deadline_job_whose_switch_goes_away_fails_loudly_on_every_rank():
    """Deadline allreduces (docs/hoststack.md): a round closed on the switch without a rank cannot be closed again
    alike at the PS, so a failover decision during a deadline exchange, or one that would replay a finished
    deadline exchange, fails the job on every rank instead of moving it: each rank raises, every call that
    returned before returned the same exact sums on every rank, and no rank returned a sum after the switch went
    away."""
    from netagg.hoststack.transport import OutOfStep, TransportError, TransportTimeout

    with testing.LoopbackSwitch() as switch:
        ps = Endpoint("127.0.0.1", free_ports(1, "both")[0])
        configs = [dataclasses.replace(c, failover_after=FAILOVER_AFTER)
                   for c in switch.add_job(N, slot_count=SLOTS, mode="allreduce", ps=ps)]
        with KVServer(configs[0], failover_retry=1000.0) as server:
            away: list[float] = []

            def work(worker, rank, ready):
                out = []
                try:
                    for i in range(2000):
                        out.append((worker.allreduce(make_input(i, rank), deadline=10.0), time.monotonic()))
                        if i == 2:
                            ready()
                except (TransportError, TransportTimeout, OutOfStep) as err:
                    return out, err
                return out, None

            def fault() -> None:
                away.append(time.monotonic())
                switch.client.set_pipeline(dp.P4INFO_PATH, b"")  # and it does not come back
                wait_for(lambda: server.failover.decisions >= 1, "a failover decision")

            results = run_workers_with_fault(configs, work, fault, timeout=4 * DEADLINE, rto_initial=0.01,
                                             progress_timeout=DEADLINE / 2)
    assert server.failover.decisions == 1
    for rank, (_, err) in enumerate(results):
        assert err is not None, f"rank {rank} returned from every call"
    assert any("went away during deadline exchange" in str(err) for _, err in results)
    done = min(len(out) for out, _ in results)
    assert done >= 3
    for i in range(max(len(out) for out, _ in results)):
        expected, _ = expected_allreduce([make_input(i, rank) for rank in range(N)], k=configs[0].width)
        for rank, (out, _) in enumerate(results):
            if i < len(out):  # nobody was late: every returned sum is exact, the same on every rank
                np.testing.assert_array_equal(out[i][0], expected, err_msg=f"rank {rank} allreduce {i}")
                assert out[i][1] < away[0] + 0.5, f"rank {rank} returned allreduce {i} after the switch went away"
