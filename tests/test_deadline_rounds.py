"""Deadline rounds end to end (docs/protocol.md, "Closing a round at a deadline"): a member closes a subset
exchange's rounds with the members that arrived, through the software switch on loopback, with seeded faults."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from netagg import wire
from netagg.hoststack import deadline_rounds
from netagg.hoststack.transport import ClosedEarly, SubsetRound, TransportError, TransportTimeout
from netagg.jobconfig import Endpoint
from netagg.localports import free_ports
from netagg.testing.hoststack import run_workers

testing = pytest.importorskip("netagg.testing.softswitch")

N = 3
SIZE = 3_000
SLOTS = 16
BLOCKS = -(-SIZE // wire.K)


def _inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.normal(0, 1, SIZE).astype(np.float32) * (rank + 1) for rank in range(N)]


def _check_partial_sums(inputs, results, members_of_blocks, present) -> None:
    """Each member's blocks: either a result it received, whose sum is the sum of the ranks the result names
    (within quantization; ranks that sent, and the same bits and members on every member that knows the block),
    or none (members 0, values 0): the member left the block's slot (a round there closed without it, or
    the others finished it and the next one while its copy of the result was lost)."""
    for rank in present:
        members = members_of_blocks[rank]
        for block in range(BLOCKS):
            span = slice(block * wire.K, min(SIZE, (block + 1) * wire.K))
            if members[block] == 0:
                assert not results[rank][span].any()
                continue
            ranks = [r for r in range(N) if members[block] >> r & 1]
            assert set(ranks) <= set(present), (block, ranks)
            expected = sum(inputs[r][span].astype(np.float64) for r in ranks)
            np.testing.assert_allclose(results[rank][span], expected, rtol=0,
                                       atol=1e-4 * max(1.0, np.abs(expected).max()))
            for other in present:
                if members_of_blocks[other][block]:
                    assert members_of_blocks[other][block] == members[block]
                    np.testing.assert_array_equal(results[other][span], results[rank][span])


@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_a_member_closes_the_rounds_a_silent_member_holds_up(loss):
    """Rank 2 never sends: rank 0 closes at 0.3 s; ranks 0 and 1 both return the sums of whoever is in each
    block's round, identical bits, each round released once."""
    inputs = _inputs()
    faults = {"drop": loss, "duplicate": loss / 2, "reorder": loss / 2, "seed": 13} if loss else {}
    everyone = wire.members_of(range(N))
    with testing.LoopbackSwitch(**faults) as switch:
        configs = switch.add_job(N, slot_count=SLOTS)
        start = threading.Barrier(2)  # both present members begin together (their workers are built by then)

        def job(worker, rank):
            if rank == 2:
                return None
            subset = SubsetRound(everyone, 0, close_after=0.3) if rank == 0 else SubsetRound(everyone, 0, partial=True)
            start.wait(30)
            began = time.monotonic()
            total = worker.allreduce_subset(inputs[rank], subset)
            return total, worker.transport.last_members.copy(), worker.transport.last_closes, \
                time.monotonic() - began

        out = run_workers(configs, job, rto_initial=0.01)
        counters = switch.counters(configs[0].job_id)
    results = {r: out[r][0] for r in (0, 1)}
    members = {r: out[r][1] for r in (0, 1)}
    _check_partial_sums(inputs, results, members, [0, 1])
    assert out[0][2] > 0 and out[1][2] == 0  # only the closer sent close requests
    assert all(out[r][3] < 3.0 for r in (0, 1))  # no rank waited for the silent one past the deadline's effect
    assert (members[0] & 0b100 == 0).all()  # the silent rank is in no sum
    assert (members[0] == 0b011).mean() > 0.5  # mostly both arrived before their rounds closed
    assert counters["results"] == BLOCKS + SLOTS  # every round (probes included) released exactly once


@pytest.mark.parametrize("late", [0.25, 2.0])
def test_a_late_member_learns_it_missed_and_its_values_are_never_added(late):
    """Rank 2 starts after rank 0 closed rounds (during the exchange, or after it ended): it learns from the closed
    results (the switch's answers to its packets, or the group's copies its socket kept) that it is not in those
    sums, takes the sums it learned, and never waits past its own deadline; no sum ever holds its values."""
    inputs = _inputs()
    everyone = wire.members_of(range(N))
    with testing.LoopbackSwitch() as switch:
        configs = switch.add_job(N, slot_count=SLOTS)

        def job(worker, rank):
            if rank == 2:
                time.sleep(late)
                began = time.monotonic()
                subset = SubsetRound(everyone, 0, partial=True, give_up_after=0.5)
                try:
                    total = worker.allreduce_subset(inputs[rank], subset)
                except TransportTimeout as err:
                    assert "deadline passed" in str(err)
                    return None, None, time.monotonic() - began
                return total, worker.transport.last_members.copy(), time.monotonic() - began
            subset = SubsetRound(everyone, 0, close_after=0.2 if rank == 0 else None, partial=True)
            total = worker.allreduce_subset(inputs[rank], subset)
            return total, worker.transport.last_members.copy()

        out = run_workers(configs, job, rto_initial=0.01)
        counters = switch.counters(configs[0].job_id)
    results = {r: out[r][0] for r in (0, 1)}
    members = {r: out[r][1] for r in (0, 1)}
    if out[2][0] is not None:
        results[2], members[2] = out[2][0], out[2][1]
        assert not (members[2] & 0b100).any()
    _check_partial_sums(inputs, results, members, sorted(results))
    assert not any((members[r] & 0b100).any() for r in (0, 1))  # no sum holds the late rank's values
    assert out[2][2] < 0.5 + 0.5  # never waited past its deadline
    assert counters["results"] == BLOCKS + SLOTS  # every round released once


def test_an_exchange_that_takes_every_contribution_fails_loudly_on_a_closed_round():
    """A member without ``partial`` never returns a partial sum: another rank's close fails its exchange."""
    inputs = _inputs()
    everyone = wire.members_of(range(N))
    with testing.LoopbackSwitch() as switch:
        configs = switch.add_job(N, slot_count=SLOTS)

        def job(worker, rank):
            if rank == 2:
                return None
            if rank == 0:
                return worker.allreduce_subset(inputs[rank], SubsetRound(everyone, 0, close_after=0.2))
            with pytest.raises(ClosedEarly, match="closed at a deadline"):
                worker.allreduce_subset(inputs[rank], SubsetRound(everyone, 0))
            with pytest.raises(TransportError, match="unusable"):
                worker.allreduce_subset(inputs[rank], SubsetRound(everyone, 100))
            return "raised"

        out = run_workers(configs, job, rto_initial=0.01)
    assert out[1] == "raised"


def test_a_deadline_allreduce_does_not_wait_for_a_late_rank_and_carries_its_values_to_the_next_call():
    """Rank 2 reaches the first allreduce 0.5 s late (deadline 0.1 s): ranks 0 and 1 return the sum of their two
    inputs long before it arrives; rank 2 learns the same sums from the group's copies, and its values join the
    next call's sum (error feedback): over both calls every input is summed exactly once, the same on every rank."""
    rng = np.random.default_rng(11)
    first = [rng.normal(0, 1, SIZE).astype(np.float32) for _ in range(N)]
    second = [rng.normal(0, 1, SIZE).astype(np.float32) for _ in range(N)]
    with testing.LoopbackSwitch() as switch:
        configs = switch.add_job(N, slot_count=SLOTS)
        between = threading.Barrier(N)

        def job(worker, rank):
            if rank == 2:
                time.sleep(0.5)
            began = time.monotonic()
            one = worker.allreduce(first[rank], deadline=0.1)
            took = time.monotonic() - began
            between.wait(30)
            two = worker.allreduce(second[rank], deadline=0.1)
            between.wait(30)
            three = worker.allreduce(second[rank])  # a whole-job call after subset rounds: every packet's members 0
            return one, two, took, worker.deadline_carry, three

        out = run_workers(configs, job, rto_initial=0.01)
    for rank in (1, 2):
        np.testing.assert_array_equal(out[rank][0], out[0][0])
        np.testing.assert_array_equal(out[rank][1], out[0][1])
    assert out[0][2] < 0.45 and out[1][2] < 0.45  # did not wait for rank 2
    assert out[2][3] == BLOCKS and out[0][3] == out[1][3] == 0  # rank 2's blocks all carried
    np.testing.assert_allclose(out[0][0], first[0] + first[1], atol=1e-4)
    np.testing.assert_allclose(out[0][1], sum(second) + first[2], atol=1e-4)  # the carry joined the second call
    for rank in range(N):
        np.testing.assert_allclose(out[rank][4], sum(second), atol=1e-4)


#: A relay in its own process (its sends are not interleaved with the worker's reads by the GIL) between one worker
#: and the switch, for the switch's results of one slot's first four rounds. "together": it holds them, and once the
#: fourth is there hands the worker the first, third and fourth back to back (the second is lost). "lost": it passes
#: the first and loses every later one. It prints "done" when it has.
_RELAY = r"""
import socket, sys
import numpy as np
from netagg.hoststack.packets import headers
switch, slot, mode = ("127.0.0.1", int(sys.argv[1])), int(sys.argv[2]), sys.argv[3]
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("127.0.0.1", 0))
sock.settimeout(60)
print(sock.getsockname()[1], flush=True)
peer, held, done = None, {}, False
while True:
    try:
        data, source = sock.recvfrom(4096)
    except OSError:
        break
    if source != switch:
        peer = source
        sock.sendto(data, switch)
        continue
    hdr = headers(np.frombuffer(data, np.uint8)[None])[0]
    rnd = int(hdr["round"])
    if peer is None:
        continue
    if int(hdr["slot"]) != slot or rnd > 4 or (mode == "lost" and rnd == 1):
        sock.sendto(data, peer)
    elif done:
        continue
    elif mode == "lost" and rnd == 4:
        done = True
        print("done", flush=True)
    elif mode == "together":
        held.setdefault(rnd, data)
        if all(r in held for r in (1, 3, 4)):
            for r in (1, 3, 4):
                sock.sendto(held[r], peer)
            done = True
            print("done", flush=True)
"""


@pytest.mark.parametrize("copies", ["together", "lost"])
def test_a_member_whose_round_the_others_left_behind_leaves_the_slot(copies, monkeypatch):
    """Rank 1 gets a slot's first round (closed with it, rank 2 silent), rank 0 goes on alone from the slot's third
    round at the latest (its second closed without rank 1, or completed with it while rank 1's copy of the result was
    lost), and the switch no longer holds rank 1's round. ``together``: rank 1 gets the first round's result and, in
    the same batch, the third's and fourth's, which it keeps; when it sends its second round it finds them. ``lost``:
    every copy after the first is lost, and the switch does not answer its resends; the job is silent towards it.
    Either way it leaves the slot (no sum for the slot's blocks), at once or after the silence limit, instead of
    resending until its progress timeout."""
    if copies == "together":  # it must leave on what it kept, not on the job's silence
        monkeypatch.setattr(deadline_rounds, "LISTEN_FLOOR", 30.0)
    inputs = _inputs()
    everyone = wire.members_of(range(N))
    with testing.LoopbackSwitch() as switch:
        relay = subprocess.Popen([sys.executable, "-c", _RELAY, str(switch.aggregator.port), "0", copies],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            relay_port = int(relay.stdout.readline())
            ports = free_ports(3)
            configs = switch.add_job(N, slot_count=SLOTS, bind_ports=[ports[0], relay_port, ports[2]])
            assert switch.jobs[configs[0].job_id].slot_base == 0
            configs[1] = dataclasses.replace(configs[1], aggregator=Endpoint("127.0.0.1", relay_port),
                                             bind=Endpoint("127.0.0.1", ports[1]))
            start = threading.Barrier(2)

            def job(worker, rank):
                if rank == 2:
                    return None
                subset = SubsetRound(everyone, 0, close_after=0.3) if rank == 0 else \
                    SubsetRound(everyone, 0, partial=True)
                start.wait(30)
                began = time.monotonic()
                total = worker.allreduce_subset(inputs[rank], subset)
                return total, worker.transport.last_members.copy(), time.monotonic() - began, \
                    worker.transport.stats.superseded_slots

            out = run_workers(configs, job, rto_initial=0.01, progress_timeout=5.0)
        finally:
            relay.kill()
            done, errors = relay.communicate(timeout=10)
    assert "done" in done, errors  # the case occurred
    results = {r: out[r][0] for r in (0, 1)}
    members = {r: out[r][1] for r in (0, 1)}
    _check_partial_sums(inputs, results, members, [0, 1])
    slot0 = np.arange(0, BLOCKS, SLOTS)
    assert (members[0][slot0[1:]] == 0b001).all()  # rank 0 went on alone in slot 0 from its third round
    assert (members[1][slot0] == 0).all() and out[1][3] == 1  # rank 1 left that slot, with no sum there
    assert out[1][2] < 3.0  # and did not wait for its progress timeout
