"""A job over two racks on an emulated tree of switches: three software targets in their own namespaces,
each programmed over its own P4Runtime session with the entries ``controller.topology`` computes, and four
workers (two per rack) running the host stack's allreduce through their leaf switches.

Every worker must get the same result, bit for bit what the job's four contributions give when summed at
one place (``hoststack.testing.expected_allreduce``: the quantized sum of all four, dequantized), and each
switch must have summed each round once.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.allreduce_worker import tensor_for
from benchmarks.tree_allreduce import collect_results
from netagg import dataplane as dp
from netagg import wire
from netagg.bmv2.cluster import EmulatedTreeCluster
from netagg.bmv2.netns import LinkShape, can_create_namespaces, list_namespaces
from netagg.bmv2.tree import EmulatedTree, racks_topology
from netagg.controller.topology import Allocation, TreeWorker, plan_tree, worker_config
from netagg.jobconfig import WorkerConfig
from netagg.testing.hoststack import expected_allreduce

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(300)]

SIZE = 20_000
#: Two racks of two hosts (w0, w1 on rack0; w2, w3 on rack1) under a root.
TOPOLOGY = racks_topology(2, 2)


def exact_digest(workers: int, k: int = wire.K) -> str:
    """The digest every worker's result must have: the job's contributions summed at one place (packets of ``k``
    values, the job's width)."""
    expected, _ = expected_allreduce([tensor_for(r, SIZE) for r in range(workers)], k=k)
    return hashlib.sha256(np.ascontiguousarray(expected, np.float32).tobytes()).hexdigest()


def allreduce_on(cluster: EmulatedTreeCluster, slots: int, *options: str) -> tuple[dict, list[dict]]:
    """A job of every worker host of ``cluster``, made by its controller (``options``: more job create flags):
    what ``create_job`` gives (the job, its workers' config files), and each worker's result of two allreduces
    run with those configs."""
    created = cluster.create_job(cluster.worker_hosts, slots, options=options, ps=None)
    procs = [subprocess.Popen(cluster.host_command(host, [
        sys.executable, "-m", "benchmarks.allreduce_worker", "--netagg", str(path), "--size", str(SIZE),
        "--iterations", "2"]), cwd=dp.REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for host, path in zip(cluster.worker_hosts, created["config_paths"])]
    return created, collect_results(procs, 240)


def test_a_job_over_two_racks_gets_the_exact_sum_through_a_tree_of_three_switches(tmp_path):
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"emulated tree: {why}")
    topo = TOPOLOGY
    workers = [TreeWorker(r, f"w{r}", 41000 + r) for r in range(4)]
    plan = plan_tree(topo, workers)
    assert plan.root == "root" and set(plan.segments) == {"root", "rack0", "rack1"}
    allocations = {"root": Allocation(7, 32, 64, 3001), "rack0": Allocation(3, 0, 64, 3002),
                   "rack1": Allocation(9, 64, 64, 3003)}
    prefix = f"tt{os.getpid() % 10000}"
    # The links between the racks and the root at 200 Mbit/s: shaped, as the bottleneck they are.
    with EmulatedTree(tmp_path, topo, prefix, link_shape=LinkShape(200.0, 0.0, 1000)) as tree:
        tree.install_job(plan, allocations, workers)
        procs = []
        for w in workers:
            config = worker_config(topo, plan, allocations, w, len(workers))
            assert (config.num_workers, config.job_workers, config.job_rank) == (2, 4, w.rank)
            path = tmp_path / f"w{w.rank}.yaml"
            config.save(path)
            procs.append(subprocess.Popen(tree.host_command(w.host, [
                sys.executable, "-m", "benchmarks.allreduce_worker", "--netagg", str(path), "--size", str(SIZE),
                "--iterations", "2"]), cwd=dp.REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results = collect_results(procs, 180)
        counters = {name: tree.counters(name, allocations[name].job_id) for name in plan.segments}
        namespaces = [ns for ns in list_namespaces() if ns.startswith(prefix + "-")]
        assert len(namespaces) == 7  # three switches, four hosts
    assert [r["digest"] for r in results] == [exact_digest(4)] * 4  # bit-identical, on every worker
    # Every round completed once at every level: the root's results are each leaf's (a leaf counts a round
    # when the root's result comes down), and a leaf's partial went up once per round, resends aside.
    results_at = {name: seen["results"] for name, seen in counters.items()}
    assert len(set(results_at.values())) == 1 and results_at["root"] >= 3 * SIZE // wire.K, results_at
    assert counters["root"]["contributions"] == 2 * counters["root"]["results"]
    assert not [ns for ns in list_namespaces() if ns.startswith(prefix + "-")]


def test_the_demo_model_trains_bit_identically_over_two_racks_and_through_one_switch(tmp_path):
    """The demo (``apps/demo.py``: 4 workers train examples/mlp_digits.py) over two racks of an emulated tree,
    the job made by one controller daemon over the three switches (``--racks 2``), and on the embedded default
    (one switch): every worker ends with the same parameters, bit for bit, in both, and the model learned."""
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"emulated tree: {why}")
    pytest.importorskip("sklearn")
    from netagg.apps.demo import run_demo

    over_tree = run_demo(tmp_path / "tree", num_workers=4, steps=40, quiet=True, racks=2)
    through_one = run_demo(tmp_path / "one", num_workers=4, steps=40, quiet=True)
    assert set(over_tree.job["segments"]) == {"root", "rack0", "rack1"} and not through_one.job["segments"]
    digests = {r["param_digest"] for r in over_tree.workers + through_one.workers}
    assert len(digests) == 1, [(r["rank"], r["param_digest"][:12]) for r in over_tree.workers + through_one.workers]
    assert over_tree.accuracy == through_one.accuracy > 0.8
    # Each switch summed two members a round (a rack's two workers, the root's two racks), each round once:
    # the root's results are each rack's (a rack counts a round when the root's result comes down).
    per_switch = over_tree.switch_counters
    assert len({c["results"] for c in per_switch.values()}) == 1, per_switch
    assert all(c["contributions"] == 2 * c["results"] > 0 for c in per_switch.values()), per_switch


@pytest.mark.bmv2
def test_the_demo_over_two_racks_of_bmv2_switches_matches_the_software_targets(tmp_path):
    """The same two-rack demo with BMv2 (``simple_switch_grpc`` running the compiled v1model program) as every
    switch of the tree: the controller pushes the program to all three, and the workers end with the parameters
    the software targets' tree gives, bit for bit."""
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"emulated tree: {why}")
    from netagg.bmv2.targets import bmv2_missing

    if (missing := bmv2_missing()) is not None:
        pytest.skip(missing)
    pytest.importorskip("sklearn")
    from netagg.apps.demo import run_demo

    on_bmv2 = run_demo(tmp_path / "bmv2", num_workers=4, steps=15, quiet=True, racks=2, target="bmv2")
    on_soft = run_demo(tmp_path / "soft", num_workers=4, steps=15, quiet=True, racks=2)
    assert set(on_bmv2.job["segments"]) == {"root", "rack0", "rack1"}
    digests = {r["param_digest"] for r in on_bmv2.workers + on_soft.workers}
    assert len(digests) == 1, [(r["rank"], r["param_digest"][:12]) for r in on_bmv2.workers + on_soft.workers]
    per_switch = on_bmv2.switch_counters
    assert all(c["contributions"] == 2 * c["results"] > 0 for c in per_switch.values()), per_switch


def test_a_job_is_on_all_of_its_switches_or_on_none(tmp_path):
    """A switch of the tree that cannot take its share: the others are put back as they were (root first, so
    the leaves' partials never meet a missing parent segment); then the job installs and is removed cleanly."""
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"emulated tree: {why}")
    from netagg.controller.errors import P4RuntimeError
    from netagg.controller.switch_programmer import MANAGED_TABLES, actual_entries

    topo = TOPOLOGY
    workers = [TreeWorker(r, f"w{r}", 41000 + r) for r in range(4)]
    plan = plan_tree(topo, workers)
    allocations = {"root": Allocation(7, 0, 8, 1), "rack0": Allocation(3, 0, 8, 2), "rack1": Allocation(9, 0, 8, 3)}
    assert plan.switches == ["root", "rack0", "rack1"]

    def held(tree: EmulatedTree, name: str) -> tuple:
        client = tree.clients[name]
        return actual_entries(client, set(MANAGED_TABLES)), client.read_multicast_groups()

    with EmulatedTree(tmp_path, topo, f"tr{os.getpid() % 10000}") as tree:
        fabric = {name: held(tree, name) for name in ("root", "rack0")}
        assert not fabric["root"][1]  # no job yet: no group
        tree.switches["rack1"].stop()  # the last switch of the tree is gone
        with pytest.raises(P4RuntimeError):
            tree.install_job(plan, allocations, workers)
        for name in ("root", "rack0"):
            assert held(tree, name) == fabric[name], name  # put back: no entry, no group of the job
        # A tree whose switches all answer takes it, and gives it back.
        small = plan_tree(topo, workers[:2])  # rack0 alone: one segment
        job = tree.install_job(small, {"rack0": allocations["rack0"]}, workers[:2])
        assert held(tree, "rack0") != fabric["rack0"]
        tree.remove_job(small, job)
        assert held(tree, "rack0") == fabric["rack0"]


def test_a_threaded_job_over_two_racks_made_by_the_controller_gets_the_exact_sum(tmp_path):
    """``--threads 2`` over a tree: each worker's two processes, each over its share of the slots, through two
    racks and the root; the job, its slots on every switch and the workers' configs are the daemon's."""
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"emulated tree: {why}")
    with EmulatedTreeCluster(tmp_path, racks=2, workers_per_rack=1, prefix=f"th{os.getpid() % 10000}") as cluster:
        created, results = allreduce_on(cluster, 128, "--threads", "2")
        job = created["job"]
        assert job["threads"] == 2 and {c for _, c in job["segments"].values()} == {128}
        assert [WorkerConfig.load(path).threads for path in created["config_paths"]] == [2, 2]
    assert [r["digest"] for r in results] == [exact_digest(2, job["width"])] * 2


def test_a_job_of_40_workers_through_three_switch_processes_made_by_the_controller(tmp_path):
    """More than one bitmap word of workers end to end: 20 hosts in each of two racks, each switch its own
    process, the job made by the daemon; every worker gets the exact sum, each leaf counts its 20 workers'
    packets a round and the root its two racks'."""
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"emulated tree: {why}")
    workers = 40
    with EmulatedTreeCluster(tmp_path, racks=2, workers_per_rack=20, prefix=f"tb{os.getpid() % 10000}") as cluster:
        created, results = allreduce_on(cluster, 64)
        per_switch = json.loads(cluster.cli("--json", "job", "show", str(created["job"]["job_id"])))["switch_counters"]
    assert [r["digest"] for r in results] == [exact_digest(workers, created["job"]["width"])] * workers
    rounds = per_switch["root"]["results"]
    assert rounds > 0 and all(c["results"] == rounds for c in per_switch.values()), per_switch
    assert per_switch["rack0"]["contributions"] == per_switch["rack1"]["contributions"] == 20 * rounds
    assert per_switch["root"]["contributions"] == 2 * rounds
