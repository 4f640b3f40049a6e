"""``make bench-tree``: allreduce across racks on an emulated tree of switches (docs/hierarchy.md).

A job of 2W workers in two racks (W per rack), each rack's leaf switch linked to a root, against:

* the same job through **one switch** (the 2W hosts on one switch, the same host links);
* **Gloo's ring** across the racks, through the same tree (torch installed; the leaves and the root
  forward its TCP);

on the same host links (``--rate-mbit``), with the links between the racks and the root as the
bottleneck they are in real clusters (``--uplink-mbit``). Each time is shown against its bound on
those links, and the bytes on a rack's up-link per allreduce against their bound:

* netagg (tree or one switch): M / (e·min(B_host, B_up))   (one stream up and one down per rack)
* ring across two racks:     2(N-1)/N · M / (e_tcp·min(B_host, B_up))
* up-link bytes per allreduce, each direction: ceil(M / 256) frames of 322 bytes (e's frames)

with M the tensor bytes and N = 2W. Needs root (namespaces); prints why it cannot run otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.cluster_allreduce import E_TCP, torch_available
from netagg import dataplane as dp
from netagg import wire
from netagg.bmv2.netns import LinkShape, can_create_namespaces, ns_exec
from netagg.bmv2.tree import UP_PORT, EmulatedTree, racks_topology
from netagg.controller.topology import Allocation, TreeWorker, plan_tree, worker_config

WORKER = [sys.executable, "-m", "benchmarks.allreduce_worker"]
GLOO_PORT = 29500


@dataclass
class Row:
    kind: str
    seconds: float
    bound_seconds: float
    identical: bool
    uplink_mb_up: float = float("nan")
    uplink_mb_down: float = float("nan")
    uplink_bound_mb: float = float("nan")


def _uplink_bytes(tree: EmulatedTree) -> tuple[int, int]:
    """(sent, received) bytes on rack0's up port so far."""
    ns, ifname = tree.namespace_of("rack0"), tree.port_ifname("rack0", UP_PORT)
    out = []
    for what in ("tx_bytes", "rx_bytes"):
        result = subprocess.run(ns_exec(ns, ["cat", f"/sys/class/net/{ifname}/statistics/{what}"]),
                                capture_output=True, text=True, check=True)
        out.append(int(result.stdout))
    return out[0], out[1]


def collect_results(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
    """Each allreduce worker's last line (its JSON result); RuntimeError with its stderr if one failed."""
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"a worker failed (exit {proc.returncode}): {err[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def run_netagg(tree: EmulatedTree, workdir: Path, size: int, iterations: int, slots: int) -> list[dict]:
    """The job over every host of ``tree`` (a tree job, or a flat one on a single switch)."""
    topo = tree.topology
    workers = [TreeWorker(r, f"w{r}", 41000 + r) for r in range(len(topo.hosts))]
    plan = plan_tree(topo, workers)
    allocations = {name: Allocation(5 + i, 0, slots, 4000 + i) for i, name in enumerate(plan.segments)}
    tree.install_job(plan, allocations, workers)
    procs = []
    for w in workers:
        config = worker_config(topo, plan, allocations, w, len(workers))
        path = workdir / f"{tree.prefix}-w{w.rank}.yaml"
        config.save(path)
        procs.append(subprocess.Popen(tree.host_command(w.host, [*WORKER, "--netagg", str(path), "--size", str(size),
                                                                 "--iterations", str(iterations)]),
                                      cwd=dp.REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return collect_results(procs, 600)


def run_gloo(tree: EmulatedTree, size: int, iterations: int) -> list[dict]:
    topo = tree.topology
    master = f"{topo.hosts['w0'].ip}:{GLOO_PORT}"
    procs = [subprocess.Popen(tree.host_command(f"w{r}", [
        "env", f"GLOO_SOCKET_IFNAME={tree.host_ifname(f'w{r}')}", *WORKER, "--gloo", str(r), str(len(topo.hosts)),
        master, "--size", str(size), "--iterations", str(iterations)]),
                              cwd=dp.REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(len(topo.hosts))]
    return collect_results(procs, 600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers-per-rack", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=40.0, help="every host's link")
    parser.add_argument("--uplink-mbit", type=float, default=40.0, help="each rack's link to the root")
    parser.add_argument("--megabytes", type=float, default=4.0, help="tensor size")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--slots", type=int, default=256)
    args = parser.parse_args(argv)
    ok, why = can_create_namespaces()
    if not ok:
        print(f"tree_allreduce: the emulated tree {why}; nothing measured")
        return 2
    size = int(args.megabytes * 1e6 / 4)
    tensor_bytes = 4 * size
    n = 2 * args.workers_per_rack
    bottleneck = min(args.rate_mbit, args.uplink_mbit) * 1e6 / 8
    e = wire.payload_efficiency()
    frames = -(-size // wire.K)
    uplink_bound = frames * wire.FRAME_BYTES / 1e6
    print(f"emulated tree: 2 racks x {args.workers_per_rack} workers, hosts at {args.rate_mbit} Mbit/s, up-links at "
          f"{args.uplink_mbit} Mbit/s; {args.megabytes} MB tensors, {args.iterations} timed allreduces (median); "
          f"machine: {os.cpu_count()} cores", flush=True)
    rows: list[Row] = []
    prefix = f"bt{os.getpid() % 1000}"
    with tempfile.TemporaryDirectory(prefix="netagg-tree-") as tmp:
        work = Path(tmp)
        up = LinkShape(args.uplink_mbit, 0.0, 1000)
        hosts = LinkShape(args.rate_mbit, 0.0, 1000)
        two_racks = racks_topology(2, args.workers_per_rack)
        with EmulatedTree(work, two_racks, prefix, link_shape=up, host_shape=hosts) as tree:
            before = _uplink_bytes(tree)
            results = run_netagg(tree, work, size, args.iterations, args.slots)
            after = _uplink_bytes(tree)
            per = args.iterations + 1  # the warm-up allreduce crosses the link too
            rows.append(Row("netagg tree", max(r["seconds"] for r in results), tensor_bytes / (e * bottleneck),
                            len({r["digest"] for r in results}) == 1, (after[0] - before[0]) / per / 1e6,
                            (after[1] - before[1]) / per / 1e6, uplink_bound))
            if torch_available():
                before = _uplink_bytes(tree)
                results = run_gloo(tree, size, args.iterations)
                after = _uplink_bytes(tree)
                rows.append(Row("gloo ring", max(r["seconds"] for r in results),
                                2 * (n - 1) / n * tensor_bytes / (E_TCP * bottleneck),
                                len({r["digest"] for r in results}) == 1, (after[0] - before[0]) / per / 1e6,
                                (after[1] - before[1]) / per / 1e6, uplink_bound))
            else:
                print("gloo ring: torch is not installed (pip install torch); not measured", flush=True)
        with EmulatedTree(work, racks_topology(1, n), prefix, host_shape=hosts) as flat:
            results = run_netagg(flat, work, size, args.iterations, args.slots)
            rows.append(Row("netagg one switch", max(r["seconds"] for r in results),
                            tensor_bytes / (e * args.rate_mbit * 1e6 / 8), len({r["digest"] for r in results}) == 1))
    print(f"\n{'kind':<18} {'s/allreduce':>11} {'bound s':>8} {'x bound':>7} {'identical':>9} "
          f"{'up-link MB up':>13} {'down':>6} {'bound MB':>8}")
    for r in rows:
        print(f"{r.kind:<18} {r.seconds:>11.3f} {r.bound_seconds:>8.3f} {r.seconds / r.bound_seconds:>7.2f} "
              f"{'yes' if r.identical else 'NO':>9} {r.uplink_mb_up:>13.2f} {r.uplink_mb_down:>6.2f} "
              f"{r.uplink_bound_mb:>8.2f}")
    by = {r.kind: r for r in rows}
    tree_row = by["netagg tree"]
    print(f"\ntree / one switch: {tree_row.seconds / by['netagg one switch'].seconds:.2f}x the time")
    if "gloo ring" in by:
        print(f"gloo ring / tree: {by['gloo ring'].seconds / tree_row.seconds:.2f}x (speedup of the tree)")
    print(f"tree up-link bytes per allreduce / bound: up {tree_row.uplink_mb_up / uplink_bound:.2f}, "
          f"down {tree_row.uplink_mb_down / uplink_bound:.2f}")
    return 0 if all(r.identical for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
