"""A dynamic emulated cluster: link rates that change during a run, slow hosts, stragglers, another tenant.

MLfabric's gains come from regimes a static cluster does not have. :class:`DynamicsSpec`
describes them; :func:`make_plan` turns a spec into a concrete, seeded :class:`Plan` for a
cluster's hosts (the same seed gives the same plan); :class:`ClusterDynamics` applies a
plan to a running :class:`~netagg.bmv2.cluster.EmulatedCluster`:

* **heterogeneous hosts:** ``slow_fraction`` of the worker hosts get ``slow_factor`` of the
  base rate, for the whole run, on both directions of their link;
* **rate changes:** every ``change_every`` seconds one worker host (seeded choice) gets a
  rate of ``change_low`` .. 1 times its own rate (tc, while the run goes on);
* **compute stragglers:** ``straggler_fraction`` of the workers are given
  ``straggler_ms`` of extra compute per step (the plan names them; the workers apply it);
* **another tenant:** a paced TCP flow of ``background_mbit`` from a worker host to the PS
  host through the switch, sharing their links (:mod:`netagg.bmv2.background`).
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from netagg.bmv2.deployment import json_result
from netagg.bmv2.netns import LinkShape, shape_link

if TYPE_CHECKING:
    from netagg.bmv2.cluster import EmulatedCluster

BACKGROUND_PORT = 45999


@dataclass(frozen=True)
class DynamicsSpec:
    """What changes (see the module docstring); all zero: a static cluster."""

    seed: int = 0
    slow_fraction: float = 0.0
    slow_factor: float = 0.25
    change_every: float = 0.0
    change_low: float = 0.25
    straggler_fraction: float = 0.0
    straggler_ms: float = 0.0
    background_mbit: float = 0.0

    def __post_init__(self) -> None:
        for name in ("slow_fraction", "straggler_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in 0..1, got {getattr(self, name)}")
        if not 0.0 < self.slow_factor <= 1.0 or not 0.0 < self.change_low <= 1.0:
            raise ValueError("slow_factor and change_low must be in (0, 1]")
        if min(self.change_every, self.straggler_ms, self.background_mbit) < 0:
            raise ValueError("change_every, straggler_ms and background_mbit must be >= 0")


@dataclass(frozen=True)
class Plan:
    """A spec made concrete for one cluster: every rate, every change, every straggler, every flow."""

    base_rate: float
    #: Rate of every host's link at the start (Mbit/s).
    rates: dict[str, float]
    #: (seconds after the start, host, new rate), in time order.
    changes: tuple[tuple[float, str, float], ...]
    #: Extra compute per step (ms) of each worker host (0 for most).
    compute_delay_ms: dict[str, float]
    #: (sending host, receiving host, Mbit/s) of the other tenant's flows.
    background: tuple[tuple[str, str, float], ...] = field(default=())


def make_plan(spec: DynamicsSpec, workers: list[str], ps_host: str, base_rate: float, duration: float) -> Plan:
    """The seeded plan of ``spec`` for these hosts over ``duration`` seconds (pure: no side effects)."""
    rng = np.random.default_rng(spec.seed)
    n = len(workers)
    slow = set(rng.choice(workers, size=round(spec.slow_fraction * n), replace=False).tolist()) if n else set()
    rates = {h: base_rate * (spec.slow_factor if h in slow else 1.0) for h in workers}
    rates[ps_host] = base_rate
    changes = []
    if spec.change_every > 0 and n:
        for k in range(1, math.floor(duration / spec.change_every) + 1):
            host = str(rng.choice(workers))
            factor = float(rng.uniform(spec.change_low, 1.0))
            changes.append((round(k * spec.change_every, 6), host, round(rates[host] * factor, 3)))
    stragglers = set(rng.choice(workers, size=round(spec.straggler_fraction * n), replace=False).tolist()) \
        if n else set()
    delays = {h: spec.straggler_ms if h in stragglers else 0.0 for h in workers}
    background = ((str(rng.choice(workers)), ps_host, spec.background_mbit),) if spec.background_mbit > 0 else ()
    return Plan(base_rate, rates, tuple(changes), delays, background)


class ClusterDynamics:
    """Applies a :class:`Plan` to a running cluster: ``with ClusterDynamics(cluster, plan): run()``.

    On entry every link gets its planned rate and the other tenant's flows start; a thread
    applies the rate changes at their times; on exit the flows stop (their byte counts are
    in ``background_bytes``) and every link is back at the base rate. ``applied`` lists
    (seconds after the changes' clock started, host, rate) as done.

    ``deferred``: the changes' clock starts at :meth:`start`, not at entry (a run whose training begins only once its
    job, PS and workers are up: every kind of run then meets the same changes at the same time of its training).
    """

    def __init__(self, cluster: EmulatedCluster, plan: Plan, *, deferred: bool = False) -> None:
        self.cluster = cluster
        self.plan = plan
        self.deferred = deferred
        self.applied: list[tuple[float, str, float]] = []
        self.background_bytes: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._flows: list[tuple[subprocess.Popen, subprocess.Popen]] = []
        self._started = 0.0
        #: time.time() when the changes' clock started (entry, or :meth:`start`): what other processes' wall-clock
        #: times are compared with (:meth:`rate_at`).
        self.started_wall = 0.0
        #: Seconds from entry to the changes' clock start (0 unless ``deferred``).
        self.lead = 0.0
        self._entered = 0.0

    def rate_at(self, host: str, wall_time: float) -> float:
        """``host``'s link rate (Mbit/s) at ``wall_time`` (time.time()), as applied: its planned start rate, then
        each change from when it was applied."""
        rate = self.plan.rates[host]
        for at, changed, new in self.applied:
            if changed == host and self.started_wall + at <= wall_time:
                rate = new
        return rate

    def set_rate(self, host: str, rate: float) -> None:
        """Shape both directions of ``host``'s link to ``rate`` Mbit/s (delay and queue as configured)."""
        spec = self.cluster.spec
        shape = LinkShape(rate, spec.delay_ms, spec.queue_packets)
        target = next(h for h in self.cluster.topology.hosts if h.name == host)
        shape_link(target.namespace, target.ifname, shape, spec.mtu)
        shape_link(self.cluster.topology.switch_namespace, target.switch_ifname, shape, spec.mtu)

    def __enter__(self) -> ClusterDynamics:
        self._entered = time.monotonic()
        for host, rate in self.plan.rates.items():
            if rate != self.cluster.spec.rate_mbit:
                self.set_rate(host, rate)
        try:
            for i, (source, sink, mbit) in enumerate(self.plan.background):
                self._flows.append(self._start_flow(source, sink, mbit, BACKGROUND_PORT - i))
        except BaseException:
            self.__exit__()
            raise
        if not self.deferred:
            self.start()
        return self

    def start(self) -> None:
        """Start the changes' clock (at entry unless ``deferred``); once only."""
        if self._thread is not None:
            return
        self._started, self.started_wall = time.monotonic(), time.time()
        self.lead = self._started - self._entered
        self._thread = threading.Thread(target=self._run, name="cluster-dynamics", daemon=True)
        self._thread.start()

    def _start_flow(self, source: str, sink: str, mbit: float, port: int) -> tuple[subprocess.Popen, subprocess.Popen]:
        module = [sys.executable, "-m", "netagg.bmv2.background"]
        receiver = subprocess.Popen(self.cluster.host_command(sink, [*module, "sink", str(port)]),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if receiver.stdout is None or "listening" not in receiver.stdout.readline():
            receiver.kill()
            raise RuntimeError(f"background sink on {sink} did not start: {receiver.stderr.read()[-500:]}")
        sender = subprocess.Popen(self.cluster.host_command(source, [
            *module, "send", self.cluster.ip_of(sink), str(port), str(mbit)]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return sender, receiver

    def _run(self) -> None:
        for at, host, rate in self.plan.changes:
            if self._stop.wait(max(0.0, self._started + at - time.monotonic())):
                return
            self.set_rate(host, rate)
            self.applied.append((round(time.monotonic() - self._started, 3), host, rate))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for sender, receiver in self._flows:
            for proc in (sender, receiver):
                if proc.poll() is None:
                    proc.terminate()
            results = []
            for name, proc in (("background sender", sender), ("background sink", receiver)):
                try:
                    results.append(json_result(proc, name, timeout=10))
                except Exception:  # a flow that failed reports nothing; the run goes on
                    proc.kill()
                    results.append({})
            self.background_bytes.append({"sent": results[0].get("bytes", 0), "received": results[1].get("bytes", 0)})
        self._flows.clear()
        for host in self.plan.rates:
            self.set_rate(host, self.cluster.spec.rate_mbit)
