"""Two tenant jobs sharing the emulated cluster's links: fairness and efficiency, with and without congestion control.

Both jobs put one worker on each of the same ``--workers`` hosts (other UDP ports), so
every host link carries both jobs' packets; each job allreduces the same tensor. For each
kind (``netagg``: the transport's congestion window; ``netagg-fixed``: a fixed window of
the job's slots) the script measures job A alone, then A and B started together, and
prints per allreduce: the times, the bound for two jobs sharing the links (twice one
job's), how close the pair came to it (efficiency = bound / slower job's time), and Jain's
fairness index of the two jobs' goodputs (1 = equal shares, 0.5 = one job got all).
Needs root (namespaces); prints why it cannot run otherwise.

    python -m benchmarks.cluster_tenants --workers 4 --size-mb 1 --rate-mbit 2 --slots 8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cluster_allreduce import FIXED_WINDOW_KINDS, Measurement, finish_kind, run_kind, start_kind
from netagg.bmv2.cluster import ClusterSpec, EmulatedCluster
from netagg.bmv2.netns import can_create_namespaces

#: Port offset of the second job's workers (the first job's use the cluster's base ports).
SECOND_JOB_PORTS = 16
#: Seconds from creating the first job to releasing both jobs' workers (job creation, process start).
START_DELAY = 10.0


def jain_index(rates: list[float]) -> float:
    """Jain's fairness index of ``rates``: (sum x)^2 / (n * sum x^2), in [1/n, 1]."""
    return sum(rates) ** 2 / (len(rates) * sum(x * x for x in rates))


def together(cluster: EmulatedCluster, kind: str, workers: int, size: int, iterations: int,
             slots: int, start_delay: float = START_DELAY) -> tuple[Measurement, Measurement]:
    """Jobs A and B of ``kind`` on the same hosts, their workers released at the same moment; their measurements."""
    start_at = time.time() + start_delay
    first = start_kind(cluster, kind, workers, size, iterations, slots, start_at=start_at)
    try:
        second = start_kind(cluster, kind, workers, size, iterations, slots, port_offset=SECOND_JOB_PORTS,
                            start_at=start_at)
    except BaseException:
        finish_kind(cluster, first)
        raise
    try:
        a = finish_kind(cluster, first)
    finally:
        b = finish_kind(cluster, second)
    return a, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4, help="hosts, each running one worker of each job")
    parser.add_argument("--size-mb", type=float, default=1.0)
    parser.add_argument("--rate-mbit", type=float, help="override configs/cluster.yaml's link rate")
    parser.add_argument("--slots", type=int, default=8, help="slots per job")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", choices=("netagg", *FIXED_WINDOW_KINDS[:1]),
                        default=["netagg", "netagg-fixed"])
    args = parser.parse_args(argv)
    ok, why = can_create_namespaces()
    if not ok:
        print(f"cluster_tenants: the emulated cluster {why}; nothing measured")
        return 2
    overrides = {"num_workers": args.workers}
    if args.rate_mbit:
        overrides["rate_mbit"] = args.rate_mbit
    spec = ClusterSpec.load(**overrides)
    size = int(args.size_mb * 1e6 / 4)
    print(f"emulated cluster: {args.workers} hosts, {spec.target} switch, {spec.rate_mbit} Mbit/s per link; two jobs "
          f"of {args.workers} workers on the same hosts, {args.slots} slots each, {size * 4 / 1e6:.2f} MB; "
          f"machine: {os.cpu_count()} cores", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="netagg-tenants-") as tmp, EmulatedCluster(Path(tmp), spec) as cluster:
        for kind in args.kinds:
            alone = run_kind(cluster, kind, args.workers, size, args.iterations, args.slots)
            a, b = together(cluster, kind, args.workers, size, args.iterations, args.slots)
            shared_bound = 2 * alone.bound_seconds
            rows.append({
                "kind": kind, "alone": alone.seconds, "alone_bound": alone.bound_seconds, "a": a.seconds,
                "b": b.seconds, "shared_bound": shared_bound, "efficiency": shared_bound / max(a.seconds, b.seconds),
                "jain": jain_index([1 / a.seconds, 1 / b.seconds]),
                "retransmissions": a.retransmissions + b.retransmissions,
                "identical": a.identical_on_all_workers and b.identical_on_all_workers and a.digest == b.digest,
            })
            print(rows[-1], flush=True)
    print()
    print(f"{'kind':<13} {'alone s':>8} {'A s':>8} {'B s':>8} {'2-job bound':>11} {'efficiency':>10} "
          f"{'Jain':>6} {'retx':>7} {'correct':>7}")
    for r in rows:
        print(f"{r['kind']:<13} {r['alone']:>8.3f} {r['a']:>8.3f} {r['b']:>8.3f} {r['shared_bound']:>11.3f} "
              f"{r['efficiency']:>10.2f} {r['jain']:>6.3f} {r['retransmissions']:>7} {r['identical']!s:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
