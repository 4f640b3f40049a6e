"""MLfabric's aggregation in the switch: scheduled updates summed in a subset round of their group."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from netagg import wire
from netagg.mlfabric import grants
from netagg.mlfabric.async_server import FabricServer
from netagg.mlfabric.grants import SWITCH_ROUND_MARGIN, switch_round_uses
from netagg.mlfabric.held_pushes import FREE, HELD, TAKEN, HeldPushes
from netagg.mlfabric.protocol import Refused
from netagg.mlfabric.scheduler import Scheduler
from netagg.mlfabric.switch_sum import SwitchSummer
from netagg.mlfabric.training import WorkerReport, _apply_sum, _send, _step
from netagg.mlfabric.worker import FabricClient
from netagg.testing.mlfabric import loopback_configs

testing = pytest.importorskip("netagg.testing.softswitch")

pytestmark = pytest.mark.timeout(120)

SLOTS = 8
SIZE = 2500  # float32 values: 10 kB, 40 blocks


def _configs(switch, num_workers: int, replicas: int = 0) -> list:
    """A job on the switch (mode allreduce: the sums go to its workers) with an async MLfabric PS chain."""
    fabric = loopback_configs(num_workers, update_mode="async", delay_bound=10, schedule="mlfabric",
                              replicas=replicas)
    on_switch = switch.add_job(num_workers, slot_count=SLOTS)
    return [dataclasses.replace(s, ps=f.ps, replicas=f.replicas, update_mode="async", delay_bound=10,
                                schedule="mlfabric", switch_aggregation=True, secret=f.secret)
            for s, f in zip(on_switch, fabric, strict=True)]


def _member_configs(switch, num_workers: int) -> tuple[list, object]:
    """As :func:`_configs`, with the PS as the job's last rank on the switch (``ps_members``): the workers'
    configs and the PS's own (what ``job create --switch-ps`` and ``job config --ps-node 0`` write)."""
    fabric = loopback_configs(num_workers, update_mode="async", delay_bound=10, schedule="mlfabric")
    on_switch = switch.add_job(num_workers + 1, slot_count=SLOTS)
    configs = [dataclasses.replace(s, ps=fabric[0].ps, update_mode="async", delay_bound=10, schedule="mlfabric",
                                   switch_aggregation=True, secret=fabric[0].secret, ps_members=1)
               for s in on_switch]
    return configs[:num_workers], configs[num_workers]


def _init_model(config, initial: np.ndarray | None = None) -> None:
    """The PS's model initialised (zeros of SIZE unless ``initial``), through ``config``'s client."""
    boot = FabricClient.from_config(config)
    boot.hello()
    boot.init(np.zeros(SIZE, np.float32) if initial is None else initial)
    boot.close()


@contextlib.contextmanager
def _ps_member_server(**options) -> Iterator[tuple[list, FabricServer]]:
    """A PS in its switch groups (lr 1, ``options`` for FabricServer) over the loopback switch, with two members'
    configs and its model initialised; stopped (and the switch with it) on exit."""
    with testing.LoopbackSwitch() as switch:
        configs, ps_config = _member_configs(switch, 2)
        server = FabricServer(configs[0], lr=1.0, batch_window=1.0, gate_timeout=0, switch_member=ps_config,
                              rto_initial=0.01, **options).start()
        try:
            _init_model(configs[0])
            yield configs, server
        finally:
            server.stop()


def _start(configs, **summer_options) -> tuple[list, list, list, list]:
    """The model initialised at the PS; per rank: a SwitchSummer, a gradient (10**rank), a report, an outcome."""
    _init_model(configs[0])
    summers = [SwitchSummer(c, rto_initial=0.01, **summer_options) for c in configs]
    grads = [np.full(SIZE, 10.0 ** r, np.float32) for r in range(len(configs))]
    return summers, grads, [WorkerReport(r) for r in range(len(configs))], [None] * len(configs)


def _run_group(configs, server, grads, ranks, summers, reports, outcomes, skip=()):
    """Ranks ask at once (bandwidths injected: 100 kB/s each, 0.1 s per update); ``skip`` are granted but
    never take part (a member that died after its grant)."""
    for rank in ranks:
        server.grants.observe(rank, 100_000, 1.0)
    clients = {r: FabricClient.from_config(configs[r], failover_timeout=20) for r in ranks}
    for client in clients.values():  # all registered first: the batch closes once all of them asked
        client.hello()

    def send(rank: int) -> None:
        client = clients[rank]
        version = client.pull()[0]
        if rank in skip:
            client.request(f"{rank}:{reports[rank].steps}", version, grads[rank].nbytes, 1.0)
            return
        outcomes[rank] = _send(client, reports[rank], "mlfabric", f"{rank}:{reports[rank].steps}", version,
                               grads[rank], summers[rank])
        reports[rank].steps += 1

    threads = [threading.Thread(target=send, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in clients.values():
        c.close()


@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_queued_updates_are_summed_in_the_switch_and_applied_as_one(loss):
    faults = {"drop": loss, "duplicate": loss / 2, "reorder": loss / 2, "seed": 4} if loss else {}
    with testing.LoopbackSwitch(**faults) as switch:
        configs = _configs(switch, 3)
        server = FabricServer(configs[0], lr=1.0, batch_window=1.0, gate_timeout=0).start()
        summers: list = []
        try:
            summers, grads, reports, outcomes = _start(configs)
            _run_group(configs, server, grads, range(3), summers, reports, outcomes)
            scheduler = server.grants.stats
            assert scheduler.batches == 1 and scheduler.groups == 1
            assert scheduler.sent == 1 and scheduler.aggregated == 2
            assert all(o is not None and o["outcome"] == "applied" for o in outcomes)
            # Equal transfer times: the largest norm (rank 2) goes first, direct; ranks 0 and 1, queued behind
            # it, are summed in the switch (both at once, each on its own link) and rank 0 (lowest rank of
            # the equally fast) pushes the sum.
            assert [r.switch_aggregated for r in reports] == [1, 1, 0]
            assert [r.switch_led for r in reports] == [1, 0, 0]
            assert sum(r.switch_fallbacks for r in reports) == 0
            assert server.version == 3 and server.stats.applies == 2 and server.stats.aggregated_applies == 1
            np.testing.assert_allclose(server.model, -(grads[0] + grads[1] + grads[2]), rtol=1e-6)
            seqs = {e.update_id: e.seq for e in server.log}
            assert seqs["0:0"] == seqs["1:0"] != seqs["2:0"]
            blocks = -(-SIZE // wire.K)
            counters = switch.counters(configs[0].job_id)
            assert counters["results"] == blocks + SLOTS  # every subset round completed exactly once
            assert counters["rejects"] == 0
        finally:
            server.stop()
            for s in summers:
                s.close()


@pytest.mark.parametrize("patience, give_up_floor", [(1.0, None), (60.0, 0.5)])
def test_a_member_that_never_takes_part_makes_the_others_send_their_own(monkeypatch, patience, give_up_floor):
    """Rank 1 is granted but never sends: rank 0's subset round never completes and it pushes its own update,
    applied once. Its exchange ends at the progress timeout (1 s), or, with that far off (60 s), at the grant's
    ``give_up`` (its floor, 0.5 s here: planned transfers of a few ms)."""
    if give_up_floor is not None:
        monkeypatch.setattr(grants, "SWITCH_GIVE_UP_FLOOR", give_up_floor)
    with testing.LoopbackSwitch() as switch:
        configs = _configs(switch, 3)
        server = FabricServer(configs[0], lr=1.0, batch_window=1.0, gate_timeout=0).start()
        summers: list = []
        try:
            summers, grads, reports, outcomes = _start(configs, progress_timeout=patience)
            began = time.monotonic()
            _run_group(configs, server, grads, range(3), summers, reports, outcomes, skip={1})
            assert time.monotonic() - began < 20  # never the 60 s progress timeout
            assert server.grants.stats.groups == 1
            assert reports[0].switch_fallbacks == 1 and reports[0].switch_aggregated == 0
            assert outcomes[0]["outcome"] == "applied" and outcomes[2]["outcome"] == "applied"
            assert server.version == 2
            np.testing.assert_allclose(server.model, -(grads[0] + grads[2]), rtol=1e-6)
        finally:
            server.stop()
            for s in summers:
                s.close()


def test_a_member_pushing_its_own_update_tells_the_others_at_once_that_the_groups_sum_will_not_come():
    """Ranks 0 and 1 are granted a switch group; rank 0 (the leader) gives up and pushes its own update: rank 1,
    waiting for the group's outcome, hears at once that there is none (before: after its 20 s timeout), and its
    own push is applied; nothing twice."""
    with testing.LoopbackSwitch() as switch:
        configs = _configs(switch, 3)
        server = FabricServer(configs[0], lr=1.0, batch_window=1.0, gate_timeout=0).start()
        clients = {}
        try:
            _, grads, _, _ = _start(configs)
            for rank in range(3):
                server.grants.observe(rank, 100_000, 1.0)
            clients = {r: FabricClient.from_config(c, failover_timeout=20) for r, c in enumerate(configs)}
            for client in clients.values():
                client.hello()
            decisions: dict[int, dict] = {}

            def ask(rank: int) -> None:
                version = clients[rank].pull()[0]
                decisions[rank] = clients[rank].request(f"{rank}:0", version, grads[rank].nbytes,
                                                        float(np.linalg.norm(grads[rank])))

            threads = [threading.Thread(target=ask, args=(r,)) for r in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert "switch" in decisions[0] and "switch" in decisions[1]
            assert decisions[2]["action"] == "send"
            clients[2].push("2:0", 0, grads[2])
            asked = time.monotonic()
            answer: dict = {}
            waiting = threading.Thread(target=lambda: answer.update(clients[1].call(
                "outcome", {"update_id": "1:0", "timeout": 20.0}, timeout=30.0)[0]))
            waiting.start()
            time.sleep(0.3)
            assert clients[0].push("0:0", 0, grads[0])["outcome"] == "applied"  # the leader gave up
            waiting.join(30)
            assert answer["known"] is False and "pushed its own" in answer["reason"]
            assert time.monotonic() - asked < 5
            assert clients[1].push("1:0", 0, grads[1])["outcome"] == "applied"
            assert server.version == 3
            np.testing.assert_allclose(server.model, -(grads[0] + grads[1] + grads[2]), rtol=1e-6)
        finally:
            server.stop()
            for c in clients.values():
                c.close()


def test_after_a_failover_the_new_primary_starts_its_subset_rounds_past_the_old_ones():
    with testing.LoopbackSwitch() as switch:
        configs = _configs(switch, 3, replicas=1)
        replica = FabricServer(configs[0], replica=0, lr=1.0, batch_window=1.0, gate_timeout=0).start()
        primary = FabricServer(configs[0], lr=1.0, batch_window=1.0, gate_timeout=0).start()
        summers: list = []
        try:
            summers, grads, reports, outcomes = _start(configs)
            _run_group(configs, primary, grads, range(3), summers, reports, outcomes)
            assert primary.grants.stats.groups == 1 and reports[0].switch_led == 1
            used = SWITCH_ROUND_MARGIN + switch_round_uses(SIZE * 4, SLOTS)
            assert primary.grants.switch_next == used
            assert replica.switch_floor == used  # replicated with the aggregate
            primary.stop()  # the primary dies; the workers fail over to the replica
            _run_group(configs, replica, grads, range(3), summers, reports, outcomes)
            assert replica.role == "primary" and replica.grants.stats.groups == 1
            assert all(o["outcome"] == "applied" for o in outcomes)
            assert [r.switch_aggregated for r in reports] == [2, 2, 0]
            assert sum(r.switch_fallbacks for r in reports) == 0  # its subset rounds were new to the switch
            assert replica.grants.switch_next == used + SWITCH_ROUND_MARGIN + switch_round_uses(SIZE * 4, SLOTS)
            assert replica.version == 6
            np.testing.assert_allclose(replica.model, -2 * (grads[0] + grads[1] + grads[2]), rtol=1e-6)
        finally:
            primary.stop()
            replica.stop()
            for s in summers:
                s.close()


def test_gang_members_compute_the_next_model_from_the_sum_bit_for_bit():
    with testing.LoopbackSwitch() as switch:
        configs = _configs(switch, 3)
        server = FabricServer(configs[0], lr=0.37, batch_window=5.0, gate_timeout=0, gang=True).start()
        rng = np.random.default_rng(7)
        initial = rng.standard_normal(SIZE).astype(np.float32)
        grads = [rng.standard_normal(SIZE).astype(np.float32) for _ in range(3)]
        summers = [SwitchSummer(c, rto_initial=0.01) for c in configs]
        clients = [FabricClient.from_config(c, failover_timeout=20) for c in configs]
        reports = [WorkerReport(r) for r in range(3)]
        ahead: list[dict] = [{} for _ in range(3)]
        try:
            clients[0].hello()
            clients[0].init(initial)
            for client in clients[1:]:
                client.hello()

            def step(rank: int) -> None:
                version, params, _ = clients[rank].pull()
                _step(clients[rank], reports[rank], lambda p, s: (0.0, grads[rank]), "mlfabric", summers[rank], 0.0,
                      None, 0, version, params, None, ahead[rank])

            threads = [threading.Thread(target=step, args=(r,)) for r in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            # One batch, one group of all three (equally fast): no direct send, one version of three gradients.
            assert server.grants.stats.groups == 1 and server.grants.stats.sent == 0
            assert server.version == 3 and server.stats.applies == 1
            assert [r.switch_aggregated for r in reports] == [1, 1, 1] and sum(r.switch_led for r in reports) == 1
            for rank in range(3):  # every member holds the PS's version 3 without receiving it
                version, model = ahead[rank]["ahead"]
                assert version == 3
                assert np.array_equal(model.view(np.uint32), server.model.view(np.uint32))
            np.testing.assert_allclose(server.model, initial - np.float32(0.37) * sum(grads), rtol=1e-4, atol=1e-4)
        finally:
            server.stop()
            for s in summers:
                s.close()
            for c in clients:
                c.close()


def test_a_member_computes_the_next_model_only_when_its_group_was_applied_right_on_top_of_its_version():
    params = np.arange(4, dtype=np.float32)
    total = np.ones(4, np.float32)
    applied = {"outcome": "applied", "version": 7, "lr": 0.5}
    version, model = _apply_sum(applied, 2, 5, params, total)
    assert version == 7 and np.array_equal(model, params - np.float32(0.5))
    assert _apply_sum({**applied, "version": 8}, 2, 5, params, total) is None  # another update came between
    assert _apply_sum({**applied, "outcome": "dropped"}, 2, 5, params, total) is None
    assert _apply_sum({"outcome": "applied", "version": 7}, 2, 5, params, total) is None  # no step: a sync PS


@pytest.mark.parametrize("loss", [0.0, 0.05, 0.25])
def test_the_ps_as_a_member_receives_the_groups_sum_from_the_switch_and_applies_it_once(loss):
    faults = {"drop": loss, "duplicate": loss / 2, "reorder": loss / 2, "seed": 9} if loss else {}
    # At 25 % loss each way a copy of a result is lost in 44 % of round trips, and a member whose answer was lost
    # holds up the others' next rounds (its window is full): on a loaded 2-core host (the whole suite in one CI
    # job) a member can go 5 s (the default progress timeout) without a result, and the group falls back to pushes
    # (tested below). This test is about the sum applied once: the exchanges get time to ride the loss out.
    patience = 30.0
    with testing.LoopbackSwitch(**faults) as switch:
        configs, ps_config = _member_configs(switch, 3)
        server = FabricServer(configs[0], lr=1.0, batch_window=1.0, gate_timeout=0, switch_member=ps_config,
                              switch_deadline=0, rto_initial=0.01, progress_timeout=patience).start()
        summers: list = []
        try:
            summers, grads, reports, outcomes = _start(configs, progress_timeout=patience)
            # Each transport is there before the group (a member loading its kernels at its first group held the
            # PS up), and the PS's has no congestion window (its timeouts measure the members' lateness).
            assert all(s._worker is not None for s in summers)
            member_transport = server.switch_member._summer._worker.transport
            assert not member_transport.congestion_control and member_transport.window == SLOTS
            assert summers[0]._worker.transport.congestion_control
            _run_group(configs, server, grads, range(3), summers, reports, outcomes)
            assert server.grants.stats.groups == 1 and server.grants.stats.sent == 1
            assert all(o is not None and o["outcome"] == "applied" for o in outcomes)
            # Ranks 0 and 1 are summed in the switch with the PS (rank 3): nobody pushes their sum.
            assert [r.switch_aggregated for r in reports] == [1, 1, 0]
            assert sum(r.switch_led for r in reports) == 0 and sum(r.switch_fallbacks for r in reports) == 0
            assert server.stats.pushes == 1  # rank 2's own, sent direct
            assert (server.stats.switch_sums, server.stats.switch_sum_failures) == (1, 0)
            assert server.version == 3 and server.stats.applies == 2 and server.stats.aggregated_applies == 1
            np.testing.assert_allclose(server.model, -(grads[0] + grads[1] + grads[2]), rtol=1e-6)
            seqs = {e.update_id: e.seq for e in server.log}
            assert seqs["0:0"] == seqs["1:0"] != seqs["2:0"]
            blocks = -(-SIZE // wire.K)
            member = server.switch_member.stats
            assert member.groups == 1 and member.bytes_in >= blocks * wire.NETAGG_BYTES
            # Its exchange kept for benchmarks: when it began, how long it took, whose group it was.
            [(began, took, ranks)] = member.exchanges
            assert ranks == [0, 1] and 0 < took <= member.seconds + 1e-3 and abs(time.time() - began) < patience + 60
            counters = switch.counters(configs[0].job_id)
            assert counters["results"] == blocks + SLOTS  # every subset round completed exactly once
            assert counters["rejects"] == 0
            if loss >= 0.25:  # copies of the sum were lost, the PS's among them: answered from the switch's copy
                assert counters["retransmit_results"] > 0
                assert server.switch_member._summer._worker.transport.stats.retransmissions > 0
        finally:
            server.stop()
            for s in summers:
                s.close()


def test_when_the_ps_cannot_take_part_the_members_push_their_own_and_each_is_applied_once():
    with testing.LoopbackSwitch() as switch:
        configs, ps_config = _member_configs(switch, 3)
        server = FabricServer(configs[0], lr=1.0, batch_window=1.0, gate_timeout=0, switch_member=ps_config,
                              switch_deadline=0, rto_initial=0.01, progress_timeout=1.0).start()
        summers: list = []
        try:
            summers, grads, reports, outcomes = _start(configs, progress_timeout=1.0)
            # Rank 1 was granted but never takes part: no round of the group completes, the PS's exchange fails.
            _run_group(configs, server, grads, range(3), summers, reports, outcomes, skip={1})
            deadline = time.monotonic() + 10  # the PS's exchange gives up on its own clock (a busy machine: later)
            while server.stats.switch_sum_failures == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.stats.switch_sum_failures == 1 and server.stats.switch_sums == 0
            assert reports[0].switch_fallbacks == 1
            assert outcomes[0]["outcome"] == "applied" and outcomes[2]["outcome"] == "applied"
            assert server.version == 2
            np.testing.assert_allclose(server.model, -(grads[0] + grads[2]), rtol=1e-6)
            # The failed group no longer holds the job's slots: the next group may use them (rounds past its own).
            assert server.grants.stats.groups == 1
            assert all(server.grants.switch_grant(g) is None for g in list(server.grants._groups))
        finally:
            server.stop()
            for s in summers:
                s.close()


def test_a_member_whose_own_exchange_failed_after_the_ps_got_the_sum_is_not_applied_twice():
    with _ps_member_server(switch_deadline=0) as (configs, server):
        grads = [np.full(SIZE, 10.0 ** r, np.float32) for r in range(2)]
        parts = [[f"{r}:0", r, 0] for r in range(2)]
        grant = {"members": wire.members_of([0, 1, 2]), "round": 5, "leader": 0, "parts": parts, "ps": 2}
        server.switch_member.submit(grant, SIZE)  # as the grant service does when it plans the group
        sums = [None, None]

        def member(rank: int) -> None:
            summer = SwitchSummer(configs[rank], rto_initial=0.01)
            try:
                sums[rank] = summer.sum(grads[rank], grant["members"], grant["round"])
            finally:
                summer.close()

        threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        client = FabricClient.from_config(configs[1])
        outcome = client.call("outcome", {"update_id": "1:0", "timeout": 20.0}, timeout=30.0)[0]
        assert outcome["known"] and outcome["outcome"] == "applied" and outcome["version"] == 2
        # Rank 1 pushes its own anyway (say it lost the last results): the PS knows the id, nothing changes.
        again = client.push("1:0", 0, grads[1])
        assert again["duplicate"] and again["outcome"] == "applied" and not outcome["halted"]
        # Nobody pushes such a group's sum: its members learn of a halt from their outcome.
        client.halt()
        outcome = client.call("outcome", {"update_id": "1:0", "timeout": 1.0}, timeout=30.0)[0]
        client.close()
        assert outcome["known"] and outcome["halted"]
        assert server.version == 2 and server.stats.applied == 2 and server.stats.switch_sums == 1
        np.testing.assert_allclose(server.model, -(grads[0] + grads[1]), rtol=1e-6)
        assert all(np.array_equal(s, sums[0]) for s in sums)  # every member holds the same sum


def test_a_group_closes_at_its_deadline_without_a_late_member_and_every_update_is_applied_once():
    """Rank 1 starts its part 2 s late: the PS closes the group's rounds at the deadline (0.5 s), applies rank 0's
    update from the switch's sum, and rank 1, in none of its blocks, learns so and pushes its own: each gradient is
    in the model once, and the group did not wait for the late one."""
    with testing.LoopbackSwitch() as switch:
        configs, ps_config = _member_configs(switch, 3)
        # 5 x the planned 0.1 s: rank 0's 40 blocks are all in before it, also on a loaded host (at the 0.2 s
        # floor, 1 run in 6 beside two busy processes found rank 0 in only some blocks: a partial part).
        server = FabricServer(configs[0], lr=1.0, batch_window=1.0, gate_timeout=0, switch_member=ps_config,
                              switch_deadline=5.0, rto_initial=0.01).start()
        summers: list = []
        try:
            summers, grads, reports, outcomes = _start(configs)
            late_sum = summers[1].sum

            def late(*args, **kwargs):
                time.sleep(2.0)
                return late_sum(*args, **kwargs)

            summers[1].sum = late
            _run_group(configs, server, grads, range(3), summers, reports, outcomes)
            assert all(o is not None and o["outcome"] == "applied" for o in outcomes)
            assert server.stats.switch_left_out == 1 and server.stats.switch_partial == 0
            assert reports[1].switch_fallbacks == 1 and reports[0].switch_fallbacks == 0
            assert server.version == 3 and server.stats.applied == 3
            np.testing.assert_allclose(server.model, -(grads[0] + grads[1] + grads[2]), rtol=1e-6)
            member = server.switch_member.stats
            assert member.groups == 1 and member.closes > 0 and member.closed_groups == 1
            assert member.seconds < 1.5  # closed at the deadline, not after the late member
            counters = switch.counters(configs[0].job_id)
            assert counters["results"] == -(-SIZE // wire.K) + SLOTS  # each round released once
        finally:
            server.stop()
            for s in summers:
                s.close()


def test_a_closed_group_rates_only_its_slowest_member_and_the_others_at_least_their_pace():
    """Rank 1 got a fifth of its values in by the deadline, rank 0 nine tenths (a slot's next round waited for
    rank 1, so rank 0's count is a floor of its rate, not its rate): rank 1's rate is sampled, rank 0's raised to
    that floor where it was lower and kept where it was higher. Before, rank 0 was sampled at rank 1's pace.
    Rank 1's rate, which fell, is the sample at once; one that rises is averaged in as a push's would be."""
    with _ps_member_server() as (_, server):
        grads = [np.full(SIZE, 10.0 ** r, np.float32) for r in range(2)]
        blocks = np.arange(SIZE) // wire.K
        missing = {0: blocks >= blocks[-1] * 9 // 10, 1: blocks >= blocks[-1] // 5}
        arrived = {r: int((~m).sum()) for r, m in missing.items()}
        assert arrived[0] > 1.25 * arrived[1]
        server.grants.observe(0, 1_000, 1.0)  # 1 kB/s: below what the group showed
        server.grants.observe(1, 400_000, 1.0)
        total = np.where(missing[0], 0, grads[0]) + np.where(missing[1], 0, grads[1])
        grant = {"members": wire.members_of([0, 1, 2]), "round": 5, "leader": 0, "ps": 2,
                 "parts": [["0:0", 0, 0], ["1:0", 1, 0]], "deadline": 0.25}
        server._apply_switch_sum(grant, total.astype(np.float32), missing)
        rates = server.grants.bandwidth.snapshot()
        assert rates[0] == pytest.approx(4 * arrived[0] / 0.25)  # raised to the floor, not averaged with it
        assert rates[1] == pytest.approx(4 * arrived[1] / 0.25)  # fell: at once, not a third of the way
        server.grants.observe(0, 10_000_000, 1.0)  # 10 MB/s: above the floor, kept
        grant = {**grant, "round": 9, "parts": [["0:1", 0, 2], ["1:1", 1, 2]]}
        server._apply_switch_sum(grant, total.astype(np.float32), missing)
        rates = server.grants.bandwidth.snapshot()
        assert rates[0] == pytest.approx(0.7 * 4 * arrived[0] / 0.25 + 0.3 * 10_000_000)
        server.grants.observe(1, 1_000, 1.0)  # 1 kB/s, below the next sample: it rises by the usual third
        before = server.grants.bandwidth.get(1)
        server._apply_switch_sum({**grant, "round": 13, "parts": [["0:2", 0, 4], ["1:2", 1, 4]]},
                                 total.astype(np.float32), missing)
        assert server.grants.bandwidth.get(1) == pytest.approx(0.7 * before + 0.3 * 4 * arrived[1] / 0.25)


def test_a_part_the_closed_sum_holds_in_part_is_completed_from_its_members_push_once():
    """The PS's bookkeeping of a group closed at its deadline: rank 1's update is in the first half of the sum's
    values only; its member's push adds exactly the other half (an update of its own), and a second push changes
    nothing."""
    with _ps_member_server() as (configs, server):
        grads = [np.full(SIZE, 10.0 ** r, np.float32) for r in range(2)]
        rest = np.arange(SIZE) >= SIZE // 2
        total = grads[0] + np.where(rest, 0, grads[1]).astype(np.float32)
        grant = {"members": wire.members_of([0, 1, 2]), "round": 5, "leader": 0, "ps": 2,
                 "parts": [["0:0", 0, 0], ["1:0", 1, 0]], "deadline": 0.25}
        server.grants.observe(0, 400_000, 1.0)
        server.grants.observe(1, 400_000, 1.0)
        server._apply_switch_sum(grant, total, {1: rest})
        assert server.version == 2 and server.stats.switch_partial == 1
        # What the closed group measured: rank 1 got half its values (5 kB) in by the 0.25 s deadline, 20 kB/s,
        # below the scheduler's rate, which it replaces (a fall is taken at once); rank 0, in every block, none.
        rates = server.grants.bandwidth.snapshot()
        assert server.stats.switch_rate_samples == 1
        assert rates[0] == 400_000
        assert rates[1] == pytest.approx(4 * int((~rest).sum()) / 0.25)
        client = FabricClient.from_config(configs[1])
        outcome = client.call("outcome", {"update_id": "1:0", "timeout": 5.0}, timeout=30.0)[0]
        assert outcome["known"] and outcome["rest"] == int(rest.sum())
        pushed = client.push("1:0", 0, grads[1])
        again = client.push("1:0", 0, grads[1])
        client.close()
        assert pushed["outcome"] == "applied" and pushed["remainder"] == int(rest.sum())
        assert again["duplicate"]
        assert server.version == 3 and server.stats.remainders_applied == 1
        np.testing.assert_allclose(server.model, -(grads[0] + grads[1]), rtol=1e-6)


def test_a_group_whose_sum_the_ps_applied_frees_the_switch_while_a_member_left_out_still_pushes():
    """Rank 1 is in no block of the closed group's sum: it pushes its update to the PS, which may take a slow link
    seconds. The switch's part is over once the PS applied the sum, so the next group is not held for that push."""
    with _ps_member_server() as (_, server):
        grant = {"members": wire.members_of([0, 1, 2]), "round": 5, "leader": 0, "ps": 2, "group": 7,
                 "parts": [["0:0", 0, 0], ["1:0", 1, 0]], "deadline": 0.25}
        grants = server.grants
        with grants._cond:  # as _plan leaves a group it granted
            grants._switch_grants[7] = grant
            for update_id, rank in (("0:0", 0), ("1:0", 1)):
                grants._in_flight[update_id] = (1, rank, grants.clock() + 60.0)
        assert grants.switch_group_in_flight()
        server._apply_switch_sum(grant, np.ones(SIZE, np.float32), {1: np.ones(SIZE, bool)})
        assert server.version == 1 and server.stats.switch_left_out == 1
        assert "1:0" in grants._in_flight  # its own push is still to come ...
        assert not grants.switch_group_in_flight()  # ... and the switch is free meanwhile


class _SummedSwitch(SwitchSummer):
    """A member's switch path that returns ``total`` as the sum, with ``blocks`` as each block's members."""

    def __init__(self, blocks, total):
        self.config = dataclasses.replace(loopback_configs(1)[0], width=wire.K)
        self._blocks, self._total = np.array(blocks, np.uint32), total

    last_members = property(lambda self: self._blocks)
    transport = None

    def sum(self, *args, **kwargs):
        return self._total


def test_a_member_missing_some_blocks_of_a_closed_groups_sum_does_not_compute_the_next_model_from_it():
    """A deadline group the PS applied whole, but this member left a slot (its copy of a result lost): its own
    sum lacks those blocks, so it must not compute the PS's next model from it (it would differ there)."""
    from netagg.mlfabric.training import _switch_aggregate

    members = 0b1011  # ranks 0, 1, 3 (the PS)
    total = np.ones(4 * wire.K, np.float32)

    switch = _SummedSwitch([members, members, 0, members], total)  # block 2: no sum here
    class Client:
        rank = 0

        def call(self, op, header, timeout):
            return {"known": True, "outcome": "applied", "version": 7, "lr": 0.5}, b""

    grant = {"members": members, "round": 1, "leader": 1, "parts": [["0:0", 0, 5], ["1:0", 1, 5]], "ps": 3,
             "deadline": 0.5}
    report = WorkerReport(0)
    outcome = _switch_aggregate(Client(), report, switch, grant, "0:0", 5, total)
    assert outcome["outcome"] == "applied" and "_sum" not in outcome
    switch = _SummedSwitch([members] * 4, total)  # every block whole: the model may be computed here
    outcome = _switch_aggregate(Client(), report, switch, grant, "0:0", 5, total)
    assert outcome["_parts"] == 2 and outcome["_sum"] is total


def _half_closed_group(configs, seed: int, count: int) -> tuple:
    """The PS's model initialised at random; ``count`` random gradients; a group of ranks 0 and 1 (the PS rank 2)
    closed with rank 1 in the first half of the values only: (initial, grads, rest mask, the sum, the grant)."""
    rng = np.random.default_rng(seed)
    initial = rng.standard_normal(SIZE).astype(np.float32)
    _init_model(configs[0], initial)
    grads = [rng.standard_normal(SIZE).astype(np.float32) for _ in range(count)]
    rest = np.arange(SIZE) >= SIZE // 2
    total = grads[0] + np.where(rest, 0, grads[1]).astype(np.float32)
    grant = {"members": wire.members_of([0, 1, 2]), "round": 5, "leader": 0, "ps": 2,
             "parts": [["0:0", 0, 0], ["1:0", 1, 0]], "deadline": 0.25}
    return initial, grads, rest, total, grant


def test_a_member_sends_only_the_rest_its_closed_group_lacked_and_computes_the_ps_model_after_it():
    """Rank 1's update is in half of a closed group's blocks: it pushes only the other half's values (``rest``), the
    PS completes the update from them once, and rank 1 computes the PS's model after the rest bit for bit from the
    group's sum and its own update. Pushes of a rest that is not waiting, or of the wrong size, are refused."""
    with testing.LoopbackSwitch() as switch:
        configs, ps_config = _member_configs(switch, 2)
        server = FabricServer(configs[0], lr=0.37, batch_window=1.0, gate_timeout=0, switch_member=ps_config,
                              rto_initial=0.01).start()
        try:
            initial, grads, rest, total, grant = _half_closed_group(configs, 3, 2)
            client = FabricClient.from_config(configs[1])
            with pytest.raises(Refused, match="no rest of a switch group waits"):
                client.push("1:0", 0, grads[1][rest], rest=True)
            server._apply_switch_sum(grant, total, {1: rest})
            with pytest.raises(Refused, match="push the whole update"):
                client.push("1:0", 0, grads[1][rest][1:], rest=True)
            pushed = client.push("1:0", 0, grads[1][rest], rest=True)
            again = client.push("1:0", 0, grads[1][rest], rest=True)
            client.close()
            assert pushed["outcome"] == "applied" and pushed["remainder"] == int(rest.sum()) and again["duplicate"]
            assert server.version == 3 and server.stats.remainders_applied == 1 and server.stats.applied == 3
            np.testing.assert_allclose(server.model, initial - np.float32(0.37) * (grads[0] + grads[1]), rtol=1e-5,
                                       atol=1e-5)
            version, model = _apply_sum(pushed, 2, 0, initial, total, (rest, grads[1]))
            assert version == 3 and np.array_equal(model.view(np.uint32), server.model.view(np.uint32))
        finally:
            server.stop()


def test_a_member_left_out_of_some_blocks_pushes_only_its_rest_and_computes_the_model_after_it():
    """The worker's side: the PS is in every block's result, this member (rank 0) in half of them. It holds the
    sum the PS applied, so it sends only the values the sum lacked and computes the model after its rest; where its
    count disagrees with the PS's, or the PS refuses the rest, it pushes the whole update and computes nothing."""
    from netagg.mlfabric.training import _switch_aggregate

    ps, me, other = 3, 0, 1
    total = np.arange(4 * wire.K, dtype=np.float32)
    grad = np.full(4 * wire.K, 2.0, np.float32)
    with_me, without = (1 << me) | (1 << other) | (1 << ps), (1 << other) | (1 << ps)
    pushes: list[tuple] = []

    def switch(blocks) -> _SummedSwitch:
        return _SummedSwitch(blocks, total)

    class Client:
        rank = me

        def __init__(self, rest, refuse=False):
            self.rest, self.refuse = rest, refuse

        def call(self, op, header, timeout):
            return {"known": True, "outcome": "applied", "version": 7, "lr": 0.5, "rest": self.rest}, b""

        def push(self, update_id, version, values, rest=False, **kwargs):
            pushes.append((values.size, rest))
            if rest and self.refuse:
                raise Refused("no rest of a switch group waits for it: push the whole update")
            return {"outcome": "applied", "version": 8, "lr": 0.5, "remainder": values.size}

    grant = {"members": with_me, "round": 1, "leader": other, "parts": [["0:0", me, 5], ["1:0", other, 5]],
             "ps": ps, "deadline": 0.5}
    blocks = [with_me, without, with_me, without]
    mask = np.repeat(np.array([False, True, False, True]), wire.K)
    report = WorkerReport(me)
    outcome = _switch_aggregate(Client(2 * wire.K), report, switch(blocks), grant, "0:0", 5, grad)
    assert pushes == [(2 * wire.K, True)] and report.switch_rest_values == 2 * wire.K
    assert outcome["_sum"] is total and np.array_equal(outcome["_rest"], mask)
    version, model = _apply_sum(outcome, outcome["_parts"], 5, np.zeros_like(grad), total, (mask, grad))
    lr = np.float32(0.5)
    expected = np.zeros_like(grad)
    expected += (-lr * total).astype(np.float32)
    expected += np.where(mask, (-lr * grad).astype(np.float32), np.float32(0))
    assert version == 8 and np.array_equal(model.view(np.uint32), expected.view(np.uint32))
    # The group was not applied right on top of this member's version (a part left out: one version less), and
    # another update came before the rest: the rest's push has the version number, not the model.
    class LeftOut(Client):
        def call(self, op, header, timeout):
            return {"known": True, "outcome": "applied", "version": 6, "lr": 0.5, "rest": self.rest}, b""

    pushes.clear()
    outcome = _switch_aggregate(LeftOut(2 * wire.K), report, switch(blocks), grant, "0:0", 5, grad)
    assert pushes == [(2 * wire.K, True)] and "_sum" not in outcome and "_rest" not in outcome
    # The PS counts other values (it holds another block's result): the whole update, no model.
    pushes.clear()
    outcome = _switch_aggregate(Client(wire.K), report, switch(blocks), grant, "0:0", 5, grad)
    assert pushes == [(grad.size, False)] and "_sum" not in outcome
    # The PS refuses the rest: the whole update.
    pushes.clear()
    outcome = _switch_aggregate(Client(2 * wire.K, refuse=True), report, switch(blocks), grant, "0:0", 5, grad)
    assert pushes == [(2 * wire.K, True), (grad.size, False)] and "_rest" not in outcome
    # A block without the PS's result (this member's copy lost): it cannot tell which values the PS holds.
    pushes.clear()
    outcome = _switch_aggregate(Client(2 * wire.K), report, switch([with_me, without, 0, without]), grant, "0:0",
                                5, grad)
    assert pushes == [(grad.size, False)] and "_sum" not in outcome


def test_the_model_after_a_rest_is_computed_only_when_the_rest_came_right_after_the_group():
    params, total, grad = np.arange(4, dtype=np.float32), np.ones(4, np.float32), np.full(4, 3.0, np.float32)
    mask = np.array([True, False, True, False])
    pushed = {"outcome": "applied", "version": 8, "lr": 0.5}
    version, model = _apply_sum(pushed, 2, 5, params, total, (mask, grad))
    assert version == 8 and np.array_equal(model, params - np.float32(0.5) - np.where(mask, np.float32(1.5), 0))
    assert _apply_sum({**pushed, "version": 9}, 2, 5, params, total, (mask, grad)) is None  # another came between
    assert _apply_sum({**pushed, "version": 7}, 2, 5, params, total, (mask, grad)) is None


def test_a_member_folds_the_rest_its_closed_group_lacked_into_its_next_update_once():
    """Rank 1's update is in half of a closed group's blocks. It carries the other half into its next update
    (``fold``, error feedback) instead of pushing it: no version of its own comes between the group and the next
    update, nothing is applied twice, and the model after that update holds every value of both updates once. A
    fold of another size, of a rest that does not wait, or on a PS that applies rests from pushes only, is refused."""
    with testing.LoopbackSwitch() as switch:
        configs, ps_config = _member_configs(switch, 2)
        for fold in (True, False):
            server = FabricServer(configs[0], lr=0.37, batch_window=1.0, gate_timeout=0, switch_member=ps_config,
                                  rto_initial=0.01, fold_rests=fold).start()
            try:
                initial, grads, rest, total, grant = _half_closed_group(configs, 5, 3)
                client = FabricClient.from_config(configs[1])
                with pytest.raises(Refused, match="no rest of a switch group waits" if fold else "pushes only"):
                    client.fold("1:0", int(rest.sum()))
                server._apply_switch_sum(grant, total, {1: rest})
                outcome = client.call("outcome", {"update_id": "1:0", "timeout": 1.0})[0]
                assert outcome["rest"] == int(rest.sum()) and outcome["fold"] is fold
                if not fold:
                    with pytest.raises(Refused, match="pushes only"):
                        client.fold("1:0", int(rest.sum()))
                    client.close()
                    continue
                with pytest.raises(Refused, match="not 1"):
                    client.fold("1:0", 1)
                assert client.fold("1:0", int(rest.sum()))["folded"] == int(rest.sum())
                with pytest.raises(Refused, match="no rest of a switch group waits"):
                    client.fold("1:0", int(rest.sum()))
                # A push of the rest now is the group's outcome again: nothing is applied twice.
                assert client.push("1:0", 0, grads[1][rest], rest=True)["duplicate"]
                assert server.version == 2 and server.stats.remainders_folded == 1
                assert server.stats.remainders_applied == 0
                carried = grads[2] + np.where(rest, grads[1], np.float32(0))
                assert client.push("1:1", 2, carried)["outcome"] == "applied"
                client.close()
                assert server.version == 3 and server.stats.applied == 3
                np.testing.assert_allclose(server.model, initial - np.float32(0.37) * (grads[0] + grads[1] + grads[2]),
                                           rtol=1e-5, atol=1e-5)
            finally:
                server.stop()


def test_a_member_folds_its_rest_when_the_ps_allows_and_adds_it_to_its_next_update():
    """The worker's side: the outcome says ``fold``, so the member tells the PS and computes the group's model (the
    rest has no version of its own); its next update is its gradient plus the rest. Values so carried that are
    dropped with that update are counted."""
    from netagg.mlfabric.training import _step, _switch_aggregate

    ps, me, other = 3, 0, 1
    total = np.arange(4 * wire.K, dtype=np.float32)
    grad = np.full(4 * wire.K, 2.0, np.float32)
    with_me, without = (1 << me) | (1 << other) | (1 << ps), (1 << other) | (1 << ps)
    calls: list[tuple] = []

    switch = _SummedSwitch([with_me, without, with_me, without], total)

    class Client:
        rank = me

        def __init__(self, refuse=False, outcome="applied"):
            self.refuse, self.outcome = refuse, outcome

        def call(self, op, header, timeout):
            return {"known": True, "outcome": "applied", "version": 7, "lr": 0.5, "rest": 2 * wire.K,
                    "fold": True}, b""

        def fold(self, update_id, count):
            calls.append(("fold", update_id, count))
            if self.refuse:
                raise Refused("fold: no rest of a switch group waits for 0:0")
            return {"ok": True, "folded": count}

        def push(self, update_id, version, values, rest=False, **kwargs):
            calls.append(("push", update_id, values.copy(), rest))
            return {"outcome": self.outcome, "version": version + 1, "lr": 0.5}

    grant = {"members": with_me, "round": 1, "leader": other, "parts": [["0:0", me, 5], ["1:0", other, 5]],
             "ps": ps, "deadline": 0.5}
    mask = np.repeat(np.array([False, True, False, True]), wire.K)
    report = WorkerReport(me)
    outcome = _switch_aggregate(Client(), report, switch, grant, "0:0", 5, grad)
    assert calls == [("fold", "0:0", 2 * wire.K)] and report.switch_folded == 1
    assert report.folded_values == 2 * wire.K and report.switch_rest_values == 0
    assert np.array_equal(outcome["_carry"], mask) and outcome["_sum"] is total and "_rest" not in outcome
    version, model = _apply_sum(outcome, outcome["_parts"], 5, np.zeros_like(grad), total)
    assert version == 7 and np.array_equal(model, (-np.float32(0.5) * total).astype(np.float32))
    # Refused (the PS expects no such rest): it pushes the rest as before.
    calls.clear()
    outcome = _switch_aggregate(Client(refuse=True), report, switch, grant, "0:0", 5, grad)
    assert [c[0] for c in calls] == ["fold", "push"] and calls[1][3] and "_carry" not in outcome
    # The next step: its gradient plus the carried values, in one update; dropped with it, they are counted.
    step_grad = np.full(4 * wire.K, 0.25, np.float32)
    carry = np.where(mask, grad, np.float32(0))
    for result, dropped in (("applied", 0), ("dropped", 2 * wire.K)):
        calls.clear()
        report = WorkerReport(me)
        out = {"carry": (carry, 2 * wire.K)}
        assert _step(Client(outcome=result), report, lambda p, s: (0.0, step_grad), "fifo", None, 0.0, None, 1, 7,
                     np.zeros_like(grad), None, out)
        assert calls[0][0] == "push" and np.array_equal(calls[0][2], step_grad + carry)
        assert "carry" not in out and report.folded_values_dropped == dropped


def test_held_pushes_go_to_one_group_or_back_to_their_pusher_never_both():
    held = HeldPushes()
    a, b = held.hold(("2:0", 2, 4), np.ones(4, np.float32)), held.hold(("3:0", 3, 1), np.full(4, 2.0, np.float32))
    assert a is not None and b is not None and held.hold(("2:0", 2, 4), np.ones(4, np.float32)) is None
    assert held.hold(("2:1", 2, 4), np.ones(4, np.float32)) is None  # one per rank: memory stays bounded
    # A group takes what fits (here: the delay bound), and sums their gradients as the PS's contribution.
    assert held.take(lambda part: part[2] >= 3, group=7) == [("2:0", 2, 4)] and (a.state, a.group) == (TAKEN, 7)
    assert held.take(lambda part: True, group=8) == [("3:0", 3, 1)]  # taken once only
    assert np.array_equal(held.contribution(["2:0", "3:0"], 4), np.full(4, 3.0, np.float32))
    assert held.contribution([], 4) is None
    # Taken: its pusher cannot take it back; its group applies it, or fails and frees it.
    assert not held.release(a) and a.state == TAKEN
    held.done(["2:0"])
    held.free(["3:0"])
    assert b.state == FREE and len(held) == 0
    c = held.hold(("1:0", 1, 4), np.ones(4, np.float32))
    assert c is not None and c.state == HELD and held.release(c) and c.state == FREE
    assert held.take(lambda part: True, group=9) == []


@pytest.mark.parametrize("group_comes", [True, False])
def test_a_single_push_waits_for_the_next_switch_group_and_joins_its_sum(group_comes):
    """Gang rounds with the PS in the groups: rank 2's own push is held; the next group of ranks 0 and 1 takes it as
    a part, the PS's contribution to the sum is rank 2's gradient, and the members compute the model after all three
    from the sum, bit for bit the PS's. Without a group within max_defer the push is applied alone."""
    with testing.LoopbackSwitch() as switch:
        configs, ps_config = _member_configs(switch, 3)
        server = FabricServer(configs[0], lr=0.37, batch_window=0.3, gate_timeout=0, switch_member=ps_config,
                              gang=True, scheduler=Scheduler(10, max_defer=3.0 if group_comes else 0.3,
                                                            default_bandwidth=1e5),
                              rto_initial=0.01).start()
        summers: list = []
        try:
            rng = np.random.default_rng(11)
            initial = rng.standard_normal(SIZE).astype(np.float32)
            _init_model(configs[0], initial)
            summers = [SwitchSummer(c, rto_initial=0.01) for c in configs[:2]]
            reports, outcomes = [WorkerReport(r) for r in range(2)], [None, None]
            grads = [rng.standard_normal(SIZE).astype(np.float32) for _ in range(3)]
            pushed: list = []
            pusher = FabricClient.from_config(configs[2])
            pusher.hello()
            thread = threading.Thread(target=lambda: pushed.append(pusher.push("2:0", 0, grads[2])))
            thread.start()
            deadline = time.monotonic() + 5
            while server.stats.held_pushes == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.stats.held_pushes == 1
            if not group_comes:
                thread.join(10)
                assert pushed[0]["outcome"] == "applied" and pushed[0]["version"] == 1
                assert server.stats.held_alone == 1 and server.stats.held_in_groups == 0
                np.testing.assert_allclose(server.model, initial - np.float32(0.37) * grads[2], rtol=1e-6)
                return
            _run_group(configs, server, grads, range(2), summers, reports, outcomes)
            thread.join(10)
            pusher.close()
            assert server.stats.held_in_groups == 1 and server.stats.held_alone == 0
            assert pushed[0]["outcome"] == "applied" and pushed[0]["version"] == 3
            assert server.version == 3 and server.stats.switch_sums == 1 and server.stats.applied == 3
            np.testing.assert_allclose(server.model, initial - np.float32(0.37) * (grads[0] + grads[1] + grads[2]),
                                       rtol=1e-4, atol=1e-5)
            for rank in range(2):
                outcome = outcomes[rank]
                assert outcome["outcome"] == "applied" and outcome["_parts"] == 3
                version, model = _apply_sum(outcome, outcome["_parts"], 0, initial, outcome["_sum"])
                assert version == 3 and np.array_equal(model.view(np.uint32), server.model.view(np.uint32))
        finally:
            server.stop()
            for s in summers:
                s.close()


def test_a_group_whose_held_push_exceeds_the_bound_by_its_apply_is_refused_whole():
    """A held push whose delay grew past the bound between the group's plan and its apply: the sum is not applied
    (its members push their own, the held push is decided alone), rather than dropped whole with the members'."""
    with testing.LoopbackSwitch() as switch:
        configs, ps_config = _member_configs(switch, 3)
        configs = [dataclasses.replace(c, delay_bound=2) for c in configs]
        server = FabricServer(configs[0], lr=1.0, batch_window=1.0, gate_timeout=0, gang=True,
                              switch_member=dataclasses.replace(ps_config, delay_bound=2), rto_initial=0.01).start()
        try:
            client = FabricClient.from_config(configs[0])
            client.hello()
            client.init(np.zeros(SIZE, np.float32))
            server.hold_pushes = False  # the versions before the group, applied at once
            for step in range(3):
                assert client.push(f"0:{step}", step, np.ones(SIZE, np.float32))["outcome"] == "applied"
            client.close()
            grant = {"members": wire.members_of([0, 1, 3]), "round": 5, "leader": 0, "ps": 3,
                     "parts": [["0:3", 0, 3], ["1:0", 1, 3], ["2:0", 2, 0]], "held": ["2:0"]}
            with pytest.raises(ValueError, match="exceeds the delay bound"):
                server._apply_switch_sum(grant, np.ones(SIZE, np.float32), {})
            assert server.version == 3 and server.stats.switch_sums == 0 and server.stats.dropped == 0
        finally:
            server.stop()
