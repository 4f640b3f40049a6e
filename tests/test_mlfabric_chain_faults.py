"""A PS chain without an operator: kill -9 of each position of a 3-node chain during training, restart it.

Every node runs as its own process with the default failure timeout (``--peer-timeout 3``); three
workers train in a loop. The test kills the primary, the middle node or the tail (one per test)
with SIGKILL, waits for the chain to repair itself (the workers promote a replica, or the dead
node's predecessor removes it), checks that training goes on, restarts the node on the same
endpoint with the same command — it finds the chain's tail and joins it, with a state transfer —
and finally halts the job and compares every node: the same model bytes, version, record number
and log, every update a worker saw acknowledged in it exactly once, nothing applied twice.
All waits poll with a deadline; no assertion is about how long something took. The recovery
times are printed (``pytest -s``): docs/mlfabric.md quotes them.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from netagg.mlfabric import chainctl
from netagg.mlfabric.worker import FabricClient
from netagg.testing.mlfabric import collect, loopback_configs, start_ps, start_workers, stop, write_configs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORKERS, BOUND = 3, 8
#: Versions applied before the kill, after the repair, and after the rejoin: every stage happens mid-training.
WARMUP, PROGRESS, AFTER_REJOIN = 150, 2 * WORKERS, 60
#: Generous bounds for each wait (a loaded machine); the test fails, with the last state seen, past one.
DEADLINE = 60.0
POSITIONS = {0: "primary", 1: "middle", 2: "tail"}


def _stats(endpoint: tuple[str, int], secret: str, *, log: bool = False, model: bool = False):
    observer = FabricClient([endpoint], 1, 0, observer=True, failover_timeout=5, secret=secret)
    try:
        return observer.stats(log=log, model=model)
    finally:
        observer.close()


class Chain:
    """The job's three PS nodes as processes, and what the test saw of them."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.configs = loopback_configs(WORKERS, update_mode="async", delay_bound=BOUND, replicas=2)
        self.config = self.configs[0]
        self.paths = write_configs(self.configs, tmp_path)
        self.endpoints = [self.config.ps.as_tuple(), *(r.as_tuple() for r in self.config.replicas)]
        self.procs: dict[int, object] = {}
        self.starts = {0: 0, 1: 0, 2: 0}
        #: Every chain status sampled while waiting: at most one primary in each.
        self.samples = 0

    def start(self, position: int):
        self.starts[position] += 1
        log = self.tmp_path / f"node{position}-{self.starts[position]}.log"
        self.procs[position] = start_ps(self.paths[0], log, replica=None if position == 0 else position - 1)
        return self.procs[position]

    def log(self, position: int, start: int) -> str:
        return (self.tmp_path / f"node{position}-{start}.log").read_text(errors="replace")

    def status(self) -> tuple[list[dict], chainctl.ChainView]:
        nodes = chainctl.chain_status(self.config, timeout=2.0)
        primaries = [n["endpoint"] for n in nodes if n["reachable"] and n["role"] == "primary"
                     and not n["superseded"]]
        assert len(primaries) <= 1, f"two primaries at once: {nodes}"  # no split brain, at any sample
        self.samples += 1
        return nodes, chainctl.live_chain({tuple(n["endpoint"]): n for n in nodes})

    def wait(self, condition, what: str):
        """Poll the chain's status until ``condition(nodes, view)`` is truthy; returns it and when it held."""
        deadline = time.monotonic() + DEADLINE
        while True:
            nodes, view = self.status()
            result = condition(nodes, view)
            if result:
                return result, time.monotonic()
            assert time.monotonic() < deadline, f"timed out waiting for {what}; last status: {nodes} {view}"
            time.sleep(0.02)

    def primary_version(self, nodes: list[dict], view: chainctl.ChainView) -> int:
        return next(n["version"] for n in nodes if view.primary is not None and tuple(n["endpoint"]) == view.primary)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            stop(proc)


@pytest.mark.parametrize("at_once", [False, True], ids=["restart-after-repair", "restart-at-once"])
@pytest.mark.parametrize("victim", [0, 1, 2], ids=[POSITIONS[p] for p in (0, 1, 2)])
def test_kill_minus_nine_of_a_chain_node_and_its_restart_lose_and_repeat_nothing(tmp_path, victim, at_once):
    """``at_once``: the node is restarted right after the kill, before its predecessor's failure timeout:
    the predecessor reconnects to it and brings it up to date in its old place, and the node it forwarded
    to (left without upstream) rejoins as the tail. Otherwise it is restarted once the chain was repaired
    without it, and rejoins as the tail itself."""
    chain = Chain(tmp_path)
    for position in (2, 1, 0):  # successors first, as an operator would start them
        chain.start(position)
    secret, dead = chain.config.secret, chain.endpoints[victim]
    workers = []
    try:
        view, _ = chain.wait(lambda nodes, view: view if len(view.order) == 3 and view.tail else None,
                             "the chain to form")
        assert view.order == chain.endpoints
        workers = start_workers(chain.paths, [["--steps", "100000", "--compute-delay", "0.02",
                                               "--max-seconds", "200", "--failover-timeout", "60"]] * WORKERS)
        (killed_at, _), _ = chain.wait(
            lambda nodes, view: (v, view) if (v := chain.primary_version(nodes, view)) >= WARMUP else None,
            "training to warm up")
        # The kill: a real crash, no goodbye to anyone.
        chain.procs[victim].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        chain.procs[victim].wait(timeout=10)

        t_repaired = t_progress = None
        if not at_once:
            # The chain repairs itself: a replica is promoted (the workers drive it), or the dead node's
            # predecessor removes it — bypassing a dead middle node to the tail, or becoming the tail.
            live = [e for e in chain.endpoints if e != dead]
            _, t_repaired = chain.wait(lambda nodes, view: view.order == live and view.tail is not None,
                                       "the chain to drop the dead node")
            nodes, view = chain.status()
            by_endpoint = {tuple(n["endpoint"]): n for n in nodes}
            if victim == 0:
                assert view.primary == chain.endpoints[1]
            else:  # a dead middle node is bypassed, a dead tail cut off
                predecessor = by_endpoint[chain.endpoints[victim - 1]]
                assert predecessor["successors_lost"] == 1
            _, t_progress = chain.wait(lambda nodes, view: chain.primary_version(nodes, view) >= killed_at + PROGRESS
                                       and view.tail is not None, "training to go on")

        # The same command on the same endpoint: the node finds the chain's tail and joins it.
        t_restart = time.monotonic()
        chain.start(victim)
        t_listening = time.monotonic()
        rejoined_at, t_rejoined = chain.wait(
            lambda nodes, view: chain.primary_version(nodes, view) if dead in view.order and len(view.order) == 3
            and view.tail is not None and all(n["caught_up"] for n in nodes) else None,
            "the restarted node to rejoin and catch up")
        # Training goes on through the re-formed chain (its tail acknowledges every record).
        chain.wait(lambda nodes, view: chain.primary_version(nodes, view) >= rejoined_at + AFTER_REJOIN
                   and len(view.order) == 3, "training to go on through the re-formed chain")
        halt = FabricClient(chain.endpoints, 1, 0, observer=True, failover_timeout=30, secret=secret)
        halt.halt()
        halt.close()
        reports = collect(workers, timeout=120)
        workers = []
        final = {}
        deadline = time.monotonic() + DEADLINE
        while True:  # the halt record is acknowledged down the chain: every node has everything
            final = {e: _stats(e, secret, log=True, model=True) for e in chain.endpoints}
            if len({st["seq"] for st, _ in final.values()}) == 1:
                break
            assert time.monotonic() < deadline, {e: st["seq"] for e, (st, _) in final.items()}
            time.sleep(0.05)
        _, view = chain.status()
    finally:
        for proc in workers:
            stop(proc)
        chain.stop_all()

    # Training went on: every worker trained until the halt, through the failure, without an error.
    for report in reports:
        assert report["halted"] and report["errors"] == 0, report["error_messages"]
        assert report["failovers"] >= (1 if victim == 0 else 0)
    # The restarted node is a replica again, brought up to date by one state transfer.
    restarted = final[dead][0]
    assert restarted["role"] == "replica" and restarted["caught_up"] and restarted["halted"]
    assert restarted["stats"]["snapshots_installed"] == 1
    survivors = [e for e in chain.endpoints if e != dead]
    if victim == 0 or not at_once:
        # It joined the chain's tail by itself: the re-formed chain ends at it.
        assert view.order == [*survivors, dead] and view.tail == dead
        assert restarted["stats"]["rejoins"] == 1 and "joined the chain as the successor" in chain.log(victim, 2)
        assert "the chain is running" in chain.log(victim, 2)
    else:
        # Restarted before its predecessor's timeout: the predecessor reconnected to it in its old place; the
        # node after it (if any), left without upstream, rejoined as the tail.
        assert view.order == chain.endpoints and restarted["stats"]["rejoins"] == 0
        if victim == 1:
            assert final[chain.endpoints[2]][0]["stats"]["rejoins"] == 1
    # Every node holds the same state: model bytes, version, record number, log and counters.
    (first, first_model), *others = final.values()
    logged = [entry["update_id"] for entry in first["log"]]
    for stats, model in others:
        assert model is not None and first_model is not None and model.tobytes() == first_model.tobytes()
        assert (stats["version"], stats["seq"], stats["stats"]["applied"]) == (
            first["version"], first["seq"], first["stats"]["applied"])
        assert [entry["update_id"] for entry in stats["log"]] == logged
    # Nothing acknowledged is lost, nothing is applied twice: the log has each update id once, one per
    # version, and every update a worker saw acknowledged — before the kill, during the repair, after
    # the restart — is in it.
    acked = [update_id for report in reports for update_id in report["acked"]]
    assert len(acked) == len(set(acked))
    assert len(logged) == len(set(logged)) == first["version"] == first["stats"]["applied"] < first["log_size"]
    assert set(acked) <= set(logged)
    assert first["max_delay"] <= BOUND and killed_at < first["version"]
    repair = "restarted at once" if at_once else (
        f"chain repaired after {t_repaired - t_kill:.2f} s, training past +{PROGRESS} versions after "
        f"{t_progress - t_kill:.2f} s")
    print(f"\n[chain faults] kill -9 of the {POSITIONS[victim]} at version {killed_at}: {repair}; restarted node "
          f"listening after {t_listening - t_restart:.2f} s, the chain whole and caught up "
          f"{t_rejoined - t_restart:.2f} s after its start ({t_rejoined - t_kill:.2f} s after the kill: "
          f"{' -> '.join(str(e[1]) for e in view.order)}); final version {first['version']}, {len(acked)} "
          f"pushes acknowledged, {sum(r['failovers'] for r in reports)} worker failovers, "
          f"{chain.samples} chain samples with at most one primary")


def test_the_workers_find_a_node_that_rejoined_once_it_is_the_last_one_left(tmp_path):
    """The primary dies and comes back as the tail; then both other nodes die at once. The workers, never
    restarted, wrap around their endpoint list to the restarted node, which takes over with everything."""
    chain = Chain(tmp_path)
    for position in (2, 1, 0):
        chain.start(position)
    secret, first = chain.config.secret, chain.endpoints[0]
    workers = []
    try:
        chain.wait(lambda nodes, view: len(view.order) == 3 and view.tail, "the chain to form")
        workers = start_workers(chain.paths, [["--steps", "100000", "--compute-delay", "0.02",
                                               "--max-seconds", "200", "--failover-timeout", "60"]] * WORKERS)
        (killed_at, _), _ = chain.wait(
            lambda nodes, view: (v, view) if (v := chain.primary_version(nodes, view)) >= WARMUP else None,
            "training to warm up")
        chain.procs[0].send_signal(signal.SIGKILL)
        chain.procs[0].wait(timeout=10)
        chain.wait(lambda nodes, view: view.primary == chain.endpoints[1], "the first replica's promotion")
        chain.start(0)
        rejoined_at, _ = chain.wait(lambda nodes, view: chain.primary_version(nodes, view)
                                    if view.tail == first and len(view.order) == 3 else None,
                                    "the old primary to rejoin as the tail")
        chain.wait(lambda nodes, view: chain.primary_version(nodes, view) >= rejoined_at + PROGRESS,
                   "training through the re-formed chain")
        for position in (1, 2):  # both at once: the restarted node is all that is left
            chain.procs[position].send_signal(signal.SIGKILL)
        for position in (1, 2):
            chain.procs[position].wait(timeout=10)
        t_kill = time.monotonic()
        (second_kill, _), t_promoted = chain.wait(
            lambda nodes, view: (chain.primary_version(nodes, view), view) if view.primary == first else None,
            "the restarted node's promotion")
        chain.wait(lambda nodes, view: chain.primary_version(nodes, view) >= second_kill + PROGRESS,
                   "training on the last node")
        halt = FabricClient(chain.endpoints, 1, 0, observer=True, failover_timeout=30, secret=secret)
        halt.halt()
        halt.close()
        reports = collect(workers, timeout=120)
        workers = []
        stats, _ = _stats(first, secret, log=True)
    finally:
        for proc in workers:
            stop(proc)
        chain.stop_all()
    for report in reports:
        assert report["halted"] and report["errors"] == 0 and report["failovers"] >= 2, report["error_messages"]
    assert stats["role"] == "primary" and stats["stats"]["snapshots_installed"] == 1
    assert stats["stats"]["rejoins"] == 1 and stats["version"] > second_kill > killed_at
    logged = [entry["update_id"] for entry in stats["log"]]
    acked = [update_id for report in reports for update_id in report["acked"]]
    assert len(logged) == len(set(logged)) == stats["version"] == stats["stats"]["applied"]
    assert set(acked) <= set(logged)
    print(f"\n[chain faults] both other nodes killed: the restarted node promoted after {t_promoted - t_kill:.2f} s; "
          f"final version {stats['version']}, {len(acked)} pushes acknowledged")
