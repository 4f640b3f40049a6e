"""The dynamic emulated cluster (bmv2/dynamics.py): seeded plans, and a plan applied to a running cluster."""

from __future__ import annotations

import os
import re
import time

import pytest

from netagg.bmv2.cluster import ClusterSpec, EmulatedCluster
from netagg.bmv2.dynamics import ClusterDynamics, DynamicsSpec, make_plan
from netagg.bmv2.netns import can_create_namespaces, ns_exec, run

WORKERS = [f"h{i}" for i in range(8)]


def test_a_plan_is_seeded_and_follows_its_spec():
    spec = DynamicsSpec(seed=3, slow_fraction=0.25, slow_factor=0.5, change_every=2.0, change_low=0.3,
                        straggler_fraction=0.125, straggler_ms=40.0, background_mbit=5.0)
    plan = make_plan(spec, WORKERS, "h8", base_rate=40.0, duration=11.0)
    assert plan == make_plan(spec, WORKERS, "h8", base_rate=40.0, duration=11.0)  # repeatable
    assert plan != make_plan(DynamicsSpec(**{**spec.__dict__, "seed": 4}), WORKERS, "h8", 40.0, 11.0)
    assert sorted(plan.rates.values()).count(20.0) == 2 and plan.rates["h8"] == 40.0  # 2 of 8 slow hosts
    assert [at for at, _, _ in plan.changes] == [2.0, 4.0, 6.0, 8.0, 10.0]
    for _, host, rate in plan.changes:
        assert host in WORKERS and 0.3 * plan.rates[host] <= rate <= plan.rates[host]
    assert sorted(plan.compute_delay_ms.values()) == [0.0] * 7 + [40.0]
    assert len(plan.background) == 1 and plan.background[0][1:] == ("h8", 5.0)
    static = make_plan(DynamicsSpec(), WORKERS, "h8", 40.0, 11.0)
    assert set(static.rates.values()) == {40.0} and not static.changes and not static.background
    with pytest.raises(ValueError, match="slow_fraction"):
        DynamicsSpec(slow_fraction=1.5)


def test_a_hosts_rate_at_a_time_follows_the_changes_as_applied():
    spec = DynamicsSpec(seed=3, change_every=2.0)
    plan = make_plan(spec, WORKERS[:2], "h8", base_rate=40.0, duration=4.0)
    dynamics = ClusterDynamics(None, plan)  # type: ignore[arg-type]  # rate_at reads only the plan and the log
    dynamics.started_wall = 1000.0
    (_, host, first), (_, other, second) = plan.changes
    dynamics.applied = [(2.1, host, first), (4.05, other, second)]
    assert dynamics.rate_at(host, 1002.0) == plan.rates[host]  # planned at 2 s, applied at 2.1 s
    assert dynamics.rate_at(host, 1002.2) == first
    assert dynamics.rate_at(other, 1004.1) == second and dynamics.rate_at("h8", 1010.0) == 40.0


def _rate_of(cluster: EmulatedCluster, host: str) -> float:
    """The rate tc shapes ``host``'s interface to, in Mbit/s."""
    target = next(h for h in cluster.topology.hosts if h.name == host)
    shown = run(ns_exec(target.namespace, ["tc", "qdisc", "show", "dev", target.ifname])).stdout
    value, unit = re.search(r"rate (\d+(?:\.\d+)?)([KMG]?)bit", shown).groups()
    return float(value) * {"K": 1e-3, "M": 1.0, "G": 1e3, "": 1e-6}[unit]


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plan_changes_rates_mid_run_and_the_other_tenant_moves_bytes(tmp_path):
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"emulated cluster: {why}")
    spec = ClusterSpec(num_workers=2, target="soft", rate_mbit=20.0, delay_ms=0.2, slots=64)
    cluster = EmulatedCluster(tmp_path, spec, prefix=f"ndy{os.getpid() % 10000}")
    dynamics = DynamicsSpec(seed=1, slow_fraction=0.5, slow_factor=0.5, change_every=0.5, change_low=0.2,
                            background_mbit=4.0)
    with cluster:
        plan = make_plan(dynamics, cluster.worker_hosts, cluster.ps_host, spec.rate_mbit, duration=1.2)
        slow = next(h for h, r in plan.rates.items() if r == 10.0)
        with ClusterDynamics(cluster, plan) as applied:
            assert _rate_of(cluster, slow) == pytest.approx(10.0)
            time.sleep(1.6)
            now = dict(plan.rates)
            now.update({host: rate for _, host, rate in plan.changes})
            for host, rate in now.items():
                assert _rate_of(cluster, host) == pytest.approx(rate, rel=0.01)
        assert [h for _, h, _ in applied.applied] == [h for _, h, _ in plan.changes]
        assert applied.applied[0][0] >= 0.5
        for host in plan.rates:
            assert _rate_of(cluster, host) == pytest.approx(20.0)  # restored
        # Deferred: the planned rates and the other tenant from entry, the changes only from start().
        (at, host, rate), *_ = plan.changes
        with ClusterDynamics(cluster, plan, deferred=True) as later:
            assert _rate_of(cluster, slow) == pytest.approx(10.0)
            time.sleep(at + 0.3)
            assert not later.applied and _rate_of(cluster, host) == pytest.approx(plan.rates[host])
            later.start()
            time.sleep(at + 0.3)
            assert later.applied[0][1:] == (host, rate) and later.applied[0][0] >= at
            assert _rate_of(cluster, host) == pytest.approx(rate, rel=0.01) and later.lead >= at + 0.3
    (flow,) = applied.background_bytes
    # About 4 Mbit/s for about 1.6 s through the switch (0.8 MB); paced, so well below the link's 20.
    assert 0.2e6 < flow["received"] <= flow["sent"] + 1 and flow["sent"] < 2.0e6, flow
