"""The emulated cluster: one allreduce of each kind, two tenants at once, identical results, nothing left."""

from __future__ import annotations

import os

import numpy as np
import pytest

from benchmarks.allreduce_worker import tensor_for
from benchmarks.cluster_allreduce import run_kind, torch_available
from benchmarks.cluster_tenants import together
from netagg.bmv2.cluster import ClusterSpec, EmulatedCluster
from netagg.bmv2.netns import can_create_namespaces, list_namespaces

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(300)]


def test_each_kind_of_allreduce_on_the_emulated_cluster(tmp_path):
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"emulated cluster: {why}")
    spec = ClusterSpec(num_workers=2, target="soft", rate_mbit=20.0, delay_ms=0.2, slots=64)
    size = 10_000
    prefix = f"ntc{os.getpid() % 10000}"
    cluster = EmulatedCluster(tmp_path, spec, prefix=prefix)
    with cluster:
        netagg = run_kind(cluster, "netagg", 2, size, iterations=1)
        fallback = run_kind(cluster, "fallback", 2, size, iterations=1)
        gloo = run_kind(cluster, "gloo", 2, size, iterations=1) if torch_available() else None
        # Two tenant jobs on the same hosts at once (other ports, the same links and switch).
        # 8 wide slots each (the software target's default width): 32 of the 64 cells apiece.
        tenant_a, tenant_b = together(cluster, "netagg", 2, size, iterations=1, slots=8, start_delay=4.0)
        pids = [p.pid for p in cluster.processes] + [cluster.switch.process.pid]
        namespaces = [ns for ns in list_namespaces() if ns.startswith(prefix + "-")]
        assert len(namespaces) == 4  # switch + 2 workers + PS host
    assert netagg.identical_on_all_workers and fallback.identical_on_all_workers
    # The PS aggregates exactly as the switch does: bit-identical sums.
    assert netagg.digest == fallback.digest
    # Sharing hosts, links and switch changed nobody's sums.
    assert tenant_a.identical_on_all_workers and tenant_b.identical_on_all_workers
    assert tenant_a.digest == tenant_b.digest == netagg.digest
    assert netagg.seconds > 0 and netagg.bound_seconds > 0
    if gloo is not None:
        assert gloo.identical_on_all_workers
    expected = tensor_for(0, size).astype(np.float64)[:4] + tensor_for(1, size).astype(np.float64)[:4]
    np.testing.assert_allclose(netagg.head, expected, rtol=1e-3, atol=1e-3)
    if gloo is not None:
        np.testing.assert_allclose(gloo.head, expected, rtol=1e-5)
    # Torn down: no namespace, veth or process left.
    assert not [ns for ns in list_namespaces() if ns.startswith(prefix + "-")]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
