"""``make chaos``: the fault scenarios of the restart and chain tests, in a bounded loop with seeded random timing.

(Over 500 lines: one runner for four scenarios, each with its set-up, injection and check.)

``python -m benchmarks.chaos [--seconds 160] [--seed N] [--scenarios switch,both,away,chain] [--injections K]``

Each scenario is set up once, trains, and gets faults injected at random (seeded) times until its share of
``--seconds`` (split evenly between the scenarios; setup and teardown not counted) runs out:

* ``switch``: the software target, the controller (as processes, :class:`netagg.bmv2.deployment.LocalDeployment`)
  and an allreduce job whose workers (:class:`~netagg.hoststack.kv.KVWorker` in threads) allreduce in a loop,
  every result compared with :func:`~netagg.testing.hoststack.expected_allreduce` (bit for bit). Fault:
  ``kill -9`` of the switch, a random time down, the same command on the same P4Runtime address and UDP
  port; the controller re-pushes the pipeline and the job, the workers ride through.
* ``both``: the same setup; ``kill -9`` of the controller and the switch at once, both started again (in a
  random order); afterwards the job list (jobs, leases, slots) must be what it was before.
* ``away``: the same setup, the job's PS running and the workers' ``failover_after`` at 1 s; ``kill -9``
  of the switch for 2-4 s: the job fails over to its PS and returns once the controller has put it back
  on the restarted switch (docs/operations.md, "When the switch stays away").
* ``chain``: a 3-node MLfabric PS chain (:mod:`netagg.testing.mlfabric`) and 3 training worker processes;
  ``kill -9`` of the node at a chain position (each position in turn, in a seeded order), restarted either
  at once or once the chain has repaired itself without it. At the end the job is halted and every node
  compared: every update a worker saw acknowledged is in the log exactly once, the nodes hold the same state.

A recovery is timed from the kill until training is back: every worker has completed an allreduce after
the restart (switch, both), or the chain is whole again, caught up, and has applied new updates (chain).
An injection is made only while enough of the scenario's time is left for its recovery; a recovery not
done within the scenario's time counts as a failure. At the end: one line per injection (time, what,
recovery seconds) and a summary; the exit status is 1 on any wrong sum, timeout, lost or duplicated push,
missing recovery or changed job, 130 on Ctrl-C. Every process started is stopped on every way out
(Ctrl-C and SIGTERM included). Everything runs on loopback: no network namespaces are created. Logs are
left in ``--workdir`` (a temporary directory, removed after a clean run unless ``--keep``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from netagg.bmv2.deployment import ADMIN_TOKEN, LocalDeployment
from netagg.bmv2.targets import start_target
from netagg.hoststack.kv import KVWorker
from netagg.hoststack.transport import TransportTimeout
from netagg.jobconfig import WorkerConfig
from netagg.mlfabric import chainctl
from netagg.mlfabric.worker import FabricClient
from netagg.shutdown import sigterm_as_interrupt
from netagg.testing.hoststack import expected_allreduce
from netagg.testing.mlfabric import collect, loopback_configs, start_ps, start_workers, stop, write_configs

SCENARIOS = ("switch", "both", "away", "chain")
#: Allreduce jobs: workers, slots, values per allreduce.
WORKERS, SLOTS, SIZE = 3, 32, 4096
#: A worker's allreduce fails only after this long without progress: far longer than any outage here.
PROGRESS_TIMEOUT = 30.0
#: Seconds between the recovery of one injection and the next (uniform), and how long the switch stays dead.
GAP = (0.5, 3.0)
DOWN = (0.0, 2.0)
#: ``away``: the workers' failover bound, and how long the switch stays dead (always past the bound).
AWAY_FAILOVER = 1.0
AWAY_DOWN = (2.0, 4.0)
#: How much of a scenario's time must be left to make one more injection (its recovery, generously).
RESERVE = {"switch": 10.0, "both": 15.0, "away": 15.0, "chain": 12.0}
#: Teardown: how long in-flight exchanges may take to finish once a scenario's time is up.
DRAIN = 30.0
#: MLfabric chain: workers, delay bound, and the versions applied before the first fault / after a rejoin.
CHAIN_WORKERS, CHAIN_BOUND, WARMUP, PROGRESS = 3, 8, 20, 6
POSITIONS = ("primary", "middle", "tail")


class Failure(Exception):
    """Something the run must report as a failure (a recovery not within the time bound, a changed job)."""


@dataclass
class Injection:
    scenario: str
    at: float  # seconds since the scenario's training started
    what: str
    recovery: float | None  # None: not recovered within the scenario's time


@dataclass
class Outcome:
    """What one scenario did and lost."""

    name: str
    seconds: float = 0.0
    injections: list[Injection] = field(default_factory=list)
    allreduces: int = 0  # completed by every worker (counted once per round)
    wrong: int = 0
    timeouts: int = 0
    acked: int = 0
    lost: int = 0
    duplicated: int = 0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.wrong or self.timeouts or self.lost or self.duplicated or self.failures
                    or any(i.recovery is None for i in self.injections))


class Clock:
    """A scenario's time: ``elapsed`` since training started, ``left`` until its deadline."""

    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + seconds

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    @property
    def left(self) -> float:
        return self.deadline - time.monotonic()


def wait_until(condition: Callable[[], Any], deadline: float, interval: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something true (that value), or None at ``deadline``."""
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """A Ctrl-C (or SIGTERM) inside the block takes effect at its end, so that a process started in it is
    recorded for the clean-up first. (Python-level handlers: the children's signal mask is untouched.)"""
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum)) for signum in held}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if caught:
            raise KeyboardInterrupt(f"signal {caught[0]}")


def say(text: str) -> None:
    print(text, flush=True)


# --------------------------------------------------------------------------- allreduce traffic


def round_inputs(seed: int, index: int) -> list[np.ndarray]:
    """Every rank's input to allreduce ``index``: magnitudes from 1e-8 to 1e7, different in each round."""
    rng = np.random.default_rng([seed, index])
    return [(rng.standard_normal(SIZE) * 10.0 ** rng.integers(-8, 8)).astype(np.float32) for _ in range(WORKERS)]


class AllreduceTraffic:
    """One KVWorker thread per rank allreducing in lockstep until :meth:`finish`; every result checked.

    A barrier before each round decides, once for all ranks, whether there is another round (so a stop
    never leaves one rank waiting for the others) and draws the round's inputs and expected result.
    """

    def __init__(self, configs: Sequence[WorkerConfig], seed: int) -> None:
        self.configs = list(configs)
        self.seed = seed
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.rounds = 0  # rounds started
        self.completed = [0] * len(configs)
        self.last_done = [0.0] * len(configs)  # monotonic time of each rank's last completed allreduce
        self.transport_stats: list[Any] = [None] * len(configs)
        self.wrong: list[str] = []
        self.timeouts: list[str] = []
        self.errors: list[str] = []
        self._go = True
        self._inputs: list[np.ndarray] = []
        self._expected: np.ndarray | None = None
        self._barrier = threading.Barrier(len(configs), action=self._next_round, timeout=2 * PROGRESS_TIMEOUT)
        self._threads = [threading.Thread(target=self._work, args=(rank,), name=f"chaos-worker{rank}", daemon=True)
                         for rank in range(len(configs))]

    def _next_round(self) -> None:
        self._go = not self.stop.is_set()
        if self._go:
            self._inputs = round_inputs(self.seed, self.rounds)
            self._expected = expected_allreduce(self._inputs, k=self.configs[0].width)[0]
            self.rounds += 1

    def _work(self, rank: int) -> None:
        try:
            with KVWorker(self.configs[rank], progress_timeout=PROGRESS_TIMEOUT) as worker:
                self.transport_stats[rank] = worker.transport.stats
                while True:
                    self._barrier.wait()
                    if not self._go:
                        return
                    index, expected = self.rounds - 1, self._expected
                    result = worker.allreduce(self._inputs[rank])
                    with self.lock:
                        self.completed[rank] += 1
                        self.last_done[rank] = time.monotonic()
                        if not np.array_equal(result, expected):
                            bad = int(np.count_nonzero(result != expected))
                            self.wrong.append(f"rank {rank} allreduce {index}: {bad} of {SIZE} values differ")
        except TransportTimeout as err:
            with self.lock:
                self.timeouts.append(f"rank {rank}: {err}")
            self._barrier.abort()
        except threading.BrokenBarrierError:
            pass  # another rank failed (counted there)
        except Exception as err:
            with self.lock:
                self.errors.append(f"rank {rank}: {type(err).__name__}: {err}")
            self._barrier.abort()

    def start(self, deadline: float) -> bool:
        """Start the workers; True once every rank has completed an allreduce (before ``deadline``)."""
        for thread in self._threads:
            thread.start()
        return bool(wait_until(lambda: min(self.completed) > 0 or self.failed, deadline)) and not self.failed

    @property
    def failed(self) -> bool:
        """A worker stopped on an error or a timeout (training is over)."""
        return bool(self.timeouts or self.errors)

    @property
    def problems(self) -> list[str]:
        return self.timeouts + self.errors

    def done_after(self, moment: float) -> bool:
        """Whether every rank completed an allreduce after ``moment`` (monotonic)."""
        with self.lock:
            return min(self.last_done) > moment

    def finish(self, timeout: float) -> int:
        """Stop after the rounds in flight; returns how many workers were still stuck after ``timeout``."""
        self.stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return sum(thread.is_alive() for thread in self._threads)


# --------------------------------------------------------------------------- switch and controller


def controller_process(deployment: LocalDeployment) -> subprocess.Popen:
    """The deployment's (latest) controller process."""
    return next(p for p in reversed(deployment.processes) if "controller" in p.args and "run" in p.args)


def kill9(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)


def job_list(deployment: LocalDeployment) -> list[dict]:
    return json.loads(deployment.cli("--json", "job", "list", token=ADMIN_TOKEN))


class SwitchChaos:
    """The ``switch`` and ``both`` scenarios on one LocalDeployment with one allreduce job."""

    def __init__(self, deployment: LocalDeployment, traffic: AllreduceTraffic, outcome: Outcome,
                 rng: random.Random, workdir: Path) -> None:
        self.deployment = deployment
        self.traffic = traffic
        self.outcome = outcome
        self.rng = rng
        self.workdir = workdir
        self.switch_starts = 1
        self.controller_starts = 1

    def restart_switch(self) -> None:
        old = self.deployment.switch
        assert old is not None and old.loopback_address is not None
        self.switch_starts += 1
        host, port = old.loopback_address
        with signals_deferred():
            self.deployment.switch = start_target(old.kind, {}, self.workdir / f"softswitch-{self.switch_starts}.log",
                                                  grpc_address=old.grpc_address, loopback=f"{host}:{port}")

    def restart_controller(self) -> None:
        config = yaml.safe_load(self.deployment.config_path.read_text())
        Path(config["controller"]["api_socket"]).unlink(missing_ok=True)  # the killed one left its socket
        self.controller_starts += 1
        self.deployment.start_controller(config)

    def inject(self, clock: Clock, both: bool) -> Injection:
        switch = self.deployment.switch
        assert switch is not None
        at, killed = clock.elapsed, time.monotonic()
        if both:
            kill9(controller_process(self.deployment))
        kill9(switch.process)
        if both:
            order = self.rng.choice(["switch first", "controller first"])
            if order == "switch first":
                self.restart_switch()
                self.restart_controller()
            else:
                self.restart_controller()
                self.restart_switch()
            what = f"kill -9 controller + switch, restarted {order}"
        else:
            down = self.rng.uniform(*(AWAY_DOWN if self.outcome.name == "away" else DOWN))
            time.sleep(down)
            self.restart_switch()
            what = f"kill -9 switch, down {down:.2f} s, restarted on the same addresses"
        up = time.monotonic()
        what += f" (up at +{up - killed:.2f} s)"
        recovered = wait_until(lambda: self.traffic.done_after(up) or self.traffic.failed, clock.deadline)
        recovery = time.monotonic() - killed if recovered and not self.traffic.failed else None
        return Injection(self.outcome.name, at, what, recovery)


def tally(traffic: AllreduceTraffic, outcome: Outcome, clock: Clock | None, stuck: int) -> None:
    outcome.seconds = min(clock.elapsed, clock.deadline - clock.start) if clock else 0.0
    outcome.allreduces = min(traffic.completed)
    outcome.wrong = len(traffic.wrong)
    outcome.timeouts = len(traffic.timeouts) + stuck
    outcome.failures += traffic.wrong[:5] + traffic.timeouts[:5] + traffic.errors[:5]
    if stuck:
        outcome.failures.append(f"{stuck} workers still inside an allreduce {DRAIN:.0f} s after the end")


def run_switch_scenario(name: str, seconds: float, rng: random.Random, seed: int, workdir: Path,
                        max_injections: int | None, outcome: Outcome) -> None:
    """``switch`` or ``both``: set up, train, inject until the time is up, drain, check."""
    started = time.monotonic()
    with LocalDeployment(workdir) as deployment:
        created = deployment.create_job(deployment.worker_hosts[:WORKERS], SLOTS, name=f"chaos-{name}")
        configs = [WorkerConfig.load(path) for path in created["config_paths"]]
        if name == "away":  # the job's PS, where its exchanges go while the switch is away
            deployment.start_ps(created["config_paths"][0], deployment.ps_host)
            configs = [dataclasses.replace(config, failover_after=AWAY_FAILOVER) for config in configs]
        jobs_before = job_list(deployment)
        traffic = AllreduceTraffic(configs, seed)
        chaos = SwitchChaos(deployment, traffic, outcome, rng, workdir)
        clock: Clock | None = None
        try:
            if not traffic.start(time.monotonic() + 60):
                raise Failure(f"training did not start: {traffic.problems or 'no allreduce within 60 s'}")
            say(f"[{name}] set up in {time.monotonic() - started:.1f} s: {deployment.describe()}, controller, job "
                f"{created['job']['job_id']} ({WORKERS} workers, {SLOTS} slots, {SIZE} values per allreduce); "
                f"training for {seconds:.0f} s")
            clock = Clock(seconds)
            while max_injections is None or len(outcome.injections) < max_injections:
                gap = rng.uniform(*GAP)
                if clock.left < gap + RESERVE[name] or traffic.failed:
                    break
                time.sleep(gap)
                injection = chaos.inject(clock, both=name == "both")
                outcome.injections.append(injection)
                say(format_injection(injection))
                if injection.recovery is None:
                    break
                if name == "both" and (jobs := job_list(deployment)) != jobs_before:
                    outcome.failures.append(f"the job list changed across the restart: {jobs_before} -> {jobs}")
            # Train on until the scenario's time is up (also after the last injection allowed by --injections).
            wait_until(lambda: traffic.failed, clock.deadline, interval=0.2)
        except BaseException:
            # Ctrl-C or a broken setup: no drain (the deployment stops everything); report what was done.
            traffic.finish(1.0)
            tally(traffic, outcome, clock, stuck=0)
            raise
        tally(traffic, outcome, clock, stuck=traffic.finish(DRAIN))
        if (jobs := job_list(deployment)) != jobs_before:
            outcome.failures.append(f"the job list changed: {jobs_before} -> {jobs}")
        else:
            outcome.notes.append("job list (jobs, leases, slots) the same as before the first fault")
        log = (workdir / "controller.log").read_text(errors="replace")
        if name == "away":
            stats = [s for s in traffic.transport_stats if s is not None]
            outcome.notes.append(f"failovers to the PS per worker {[s.failovers for s in stats]}, returns to the "
                                 f"switch {[s.failover_returns for s in stats]}")
            if any(s.failovers < len(outcome.injections) for s in stats):
                outcome.failures.append("a switch away past the failover bound did not move the job to its PS")
        outcome.notes.append(f"switch started {chaos.switch_starts}x, controller {chaos.controller_starts}x; "
                             f"controller log: {log.count(' lost: ')}x 'switch ... lost', "
                             f"{log.count('pushed the pipeline') - 1}x pipeline and job pushed again")


# --------------------------------------------------------------------------- MLfabric chain


class ChainJob:
    """A 3-node PS chain (processes) of an async MLfabric job, and its training workers (processes)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.configs = loopback_configs(CHAIN_WORKERS, update_mode="async", delay_bound=CHAIN_BOUND, replicas=2)
        self.config = self.configs[0]
        self.paths = write_configs(self.configs, workdir)
        #: The configured endpoints; index i is started with ``--replica i-1`` (0: the configured primary).
        self.endpoints = [self.config.ps.as_tuple(), *(r.as_tuple() for r in self.config.replicas)]
        self.nodes: dict[int, subprocess.Popen] = {}
        self.starts = dict.fromkeys(range(len(self.endpoints)), 0)
        self.workers: list[subprocess.Popen] = []
        self.split_brain: list[str] = []

    def start_node(self, index: int) -> None:
        self.starts[index] += 1
        log = self.workdir / f"node{index}-{self.starts[index]}.log"
        with signals_deferred():
            self.nodes[index] = start_ps(self.paths[0], log, replica=None if index == 0 else index - 1)

    def status(self) -> tuple[list[dict], chainctl.ChainView]:
        nodes = chainctl.chain_status(self.config, timeout=2.0)
        primaries = [n["endpoint"] for n in nodes if n["reachable"] and n["role"] == "primary"
                     and not n["superseded"]]
        if len(primaries) > 1:
            self.split_brain.append(f"two primaries at once: {primaries}")
        return nodes, chainctl.live_chain({tuple(n["endpoint"]): n for n in nodes})

    def version(self) -> int:
        """The primary's version (-1 without one)."""
        nodes, view = self.status()
        return next((n["version"] for n in nodes if view.primary and tuple(n["endpoint"]) == view.primary), -1)

    def whole(self) -> bool:
        nodes, view = self.status()
        return len(view.order) == len(self.endpoints) and view.tail is not None and all(
            n["reachable"] and n["caught_up"] for n in nodes)

    def final_stats(self) -> dict | None:
        """Every node's stats, log and model once they all hold the same record number (else None)."""
        try:
            final = {e: node_stats(e, self.config.secret) for e in self.endpoints}
        except Exception:  # a node not answering (yet): poll again
            return None
        return final if len({stats["seq"] for stats, _ in final.values()}) == 1 else None

    def stop_all(self) -> None:
        for proc in [*self.workers, *self.nodes.values()]:
            stop(proc)


def node_stats(endpoint: tuple[str, int], secret: str) -> dict:
    observer = FabricClient([endpoint], 1, 0, observer=True, failover_timeout=5, secret=secret)
    try:
        return observer.stats(log=True, model=True)
    finally:
        observer.close()


def run_chain_scenario(seconds: float, rng: random.Random, workdir: Path, max_injections: int | None,
                       outcome: Outcome) -> None:
    started = time.monotonic()
    chain = ChainJob(workdir)
    clock: Clock | None = None
    try:
        for index in (2, 1, 0):  # successors first, as an operator would start them
            chain.start_node(index)
        if not wait_until(chain.whole, time.monotonic() + 60):
            raise Failure("the chain did not form within 60 s")
        # The workers train until halted (their own bound only matters if this process is killed -9).
        with signals_deferred():
            chain.workers = start_workers(chain.paths, [[
                "--steps", "1000000", "--compute-delay", "0.02", "--failover-timeout", "60",
                "--max-seconds", str(seconds + 300)]] * CHAIN_WORKERS)
        if not wait_until(lambda: chain.version() >= WARMUP, time.monotonic() + 120):
            raise Failure(f"training did not reach version {WARMUP} within 120 s")
        say(f"[chain] set up in {time.monotonic() - started:.1f} s: 3-node PS chain "
            f"{' -> '.join(str(e[1]) for e in chain.endpoints)}, {CHAIN_WORKERS} async workers; training for "
            f"{seconds:.0f} s")
        positions: list[int] = []
        clock = Clock(seconds)
        while max_injections is None or len(outcome.injections) < max_injections:
            gap = rng.uniform(*GAP)
            if clock.left < gap + RESERVE["chain"]:
                break
            time.sleep(gap)
            if not positions:  # each position once, in a seeded order, then again
                positions = rng.sample(range(len(POSITIONS)), len(POSITIONS))
            position, at_once = positions.pop(), rng.random() < 0.5
            _, view = chain.status()
            victim = chain.endpoints.index(view.order[position])
            at, killed, killed_at = clock.elapsed, time.monotonic(), chain.version()
            kill9(chain.nodes[victim])
            recovered: Any = True
            if not at_once:  # the chain repairs itself without the node first
                live = [e for e in view.order if e != chain.endpoints[victim]]
                recovered = wait_until(lambda live=live: (v := chain.status()[1]).order == live and v.tail,
                                       clock.deadline)
            if recovered:
                chain.start_node(victim)  # the same command: it finds the chain's tail and joins it
                target = killed_at + PROGRESS
                recovered = wait_until(lambda target=target: chain.whole() and chain.version() >= target,
                                       clock.deadline)
            injection = Injection("chain", at, f"kill -9 PS {POSITIONS[position]} :{chain.endpoints[victim][1]} "
                                  f"(version {killed_at}), restarted {'at once' if at_once else 'after repair'}",
                                  time.monotonic() - killed if recovered else None)
            outcome.injections.append(injection)
            say(format_injection(injection))
            if not recovered:
                break
        wait_until(lambda: False, clock.deadline, interval=0.2)  # train on until the time is up
        # The end: halt the job, wait until every node has every record, compare them.
        halt = FabricClient(chain.endpoints, 1, 0, observer=True, failover_timeout=30, secret=chain.config.secret)
        try:
            halt.halt()
        finally:
            halt.close()
        reports = collect(chain.workers, timeout=DRAIN + 60)
        chain.workers = []
        final = wait_until(chain.final_stats, time.monotonic() + DRAIN)
        if final is None:
            raise Failure(f"the chain's nodes did not reach the same record within {DRAIN:.0f} s of the halt")
    finally:
        outcome.seconds = min(clock.elapsed, clock.deadline - clock.start) if clock else 0.0
        chain.stop_all()
    check_chain(chain, reports, final, outcome)


def check_chain(chain: ChainJob, reports: list[dict], final: dict, outcome: Outcome) -> None:
    """Nothing acknowledged lost, nothing applied twice, every node the same."""
    acked = [update_id for report in reports for update_id in report["acked"]]
    (first, first_model), *others = final.values()
    endpoints = list(final)
    logged = [entry["update_id"] for entry in first["log"]]
    outcome.acked = len(acked)
    outcome.lost = len(set(acked) - set(logged))
    outcome.duplicated = (len(acked) - len(set(acked))) + (len(logged) - len(set(logged)))
    outcome.failures += chain.split_brain[:3]
    for report in reports:
        if report["errors"] or not report["halted"]:
            outcome.failures.append(f"worker {report['rank']}: halted {report['halted']}, errors "
                                    f"{report['error_messages'][:3]}")
    if len(logged) != first["version"] or first["version"] != first["stats"]["applied"]:
        outcome.failures.append(f"log {len(logged)} records, version {first['version']}, "
                                f"applied {first['stats']['applied']}")
    for endpoint, (stats, model) in zip(endpoints[1:], others):
        same = (stats["version"], stats["seq"], [e["update_id"] for e in stats["log"]]) == (
            first["version"], first["seq"], logged)
        if not same or model is None or first_model is None or model.tobytes() != first_model.tobytes():
            outcome.failures.append(f"node :{endpoint[1]} differs from node :{endpoints[0][1]}")
    if first["log_size"] <= len(logged):
        outcome.notes.append(f"the log ({first['log_size']} entries) may have wrapped: counts are of its window")
    outcome.notes.append(f"final version {first['version']}, {len(logged)} updates logged, "
                         f"{sum(r['failovers'] for r in reports)} worker failovers; "
                         + ("every node the same (version, log, model bytes), never two primaries"
                            if not outcome.failures else "see the failures"))


# --------------------------------------------------------------------------- report and main


def format_injection(injection: Injection) -> str:
    recovery = "NOT RECOVERED in time" if injection.recovery is None else f"recovered in {injection.recovery:5.2f} s"
    return f"  [{injection.scenario:<6}] t={injection.at:6.2f} s  {injection.what:<78} {recovery}"


def summary(outcomes: list[Outcome]) -> list[str]:
    lines = ["", "injections (t: seconds into the scenario's training):"]
    lines += [format_injection(i) for o in outcomes for i in o.injections] or ["  none"]
    lines.append("summary:")
    for o in outcomes:
        recoveries = [i.recovery for i in o.injections if i.recovery is not None]
        worst = f", slowest recovery {max(recoveries):.2f} s" if recoveries else ""
        count = len(o.injections)
        head = f"  {o.name:<6} {count} injection{'' if count == 1 else 's'} in {o.seconds:.0f} s{worst}: "
        if o.name == "chain":
            lines.append(f"{head}pushes acknowledged {o.acked}, lost {o.lost}, duplicated {o.duplicated}")
        else:
            lines.append(f"{head}allreduces done {o.allreduces} (x{WORKERS} workers), wrong sums {o.wrong}, "
                         f"timeouts {o.timeouts}")
        lines += [f"         {note}" for note in o.notes if note]
        lines += [f"         FAILED: {failure}" for failure in o.failures]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=160.0,
                        help="training time in all, split evenly between the scenarios (setup/teardown extra)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the timing and choices (default: random)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {','.join(SCENARIOS)}")
    parser.add_argument("--injections", type=int, default=None, help="at most this many per scenario")
    parser.add_argument("--workdir", type=Path, default=None, help="logs and configs (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the workdir after a clean run")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not names or any(n not in SCENARIOS for n in names) or len(set(names)) != len(names):
        parser.error(f"--scenarios: a comma-separated list of {', '.join(SCENARIOS)}")
    if args.seconds <= 0:
        parser.error("--seconds: must be > 0")
    if args.injections is not None and args.injections < 0:
        parser.error("--injections: must be >= 0")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="netagg-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    share = args.seconds / len(names)
    say(f"chaos: seed {seed}, {args.seconds:.0f} s of training over {', '.join(names)} ({share:.0f} s each), "
        f"logs in {workdir}")
    outcomes: list[Outcome] = []
    interrupted = False
    with sigterm_as_interrupt():
        for name in names:
            outcome = Outcome(name)
            outcomes.append(outcome)
            rng = random.Random(f"{seed}-{name}")
            (workdir / name).mkdir(exist_ok=True)
            try:
                if name == "chain":
                    run_chain_scenario(share, rng, workdir / name, args.injections, outcome)
                else:
                    run_switch_scenario(name, share, rng, seed, workdir / name, args.injections, outcome)
            except KeyboardInterrupt:
                outcome.failures.append("interrupted")
                interrupted = True
                break
            except Exception as err:  # a scenario that could not run: say why, go on with the next
                outcome.failures.append(f"{type(err).__name__}: {err}")
    for line in summary(outcomes):
        say(line)
    ok = all(o.ok for o in outcomes) and not interrupted
    say("result: " + ("OK, nothing lost" if ok else "INTERRUPTED" if interrupted else "FAILED")
        + f" (seed {seed})")
    if ok and args.workdir is None and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not ok:
        say(f"logs: {workdir}")
    return 130 if interrupted else 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
