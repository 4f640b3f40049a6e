"""Three tenants' jobs arriving apart on a switch too small for all three at full size (issue 40): job completion
times with fair shares that move, against first-come allocation and against all-PS, on the emulated cluster.

Each job has ``--workers`` hosts of its own (the jobs share switch memory, not links) and a PS of its own on the
PS host; its slots are sized by the controller from the links (no ``--slots``), and it runs ``--allreduces``
allreduces of ``--size-mb``. Job ``i`` is created ``i * --apart`` seconds after the first. Policies, each on a fresh
cluster:

* ``fair``: the controller moves running jobs toward their weighted max-min shares (``controller.worker_address``):
  a newcomer's create waits while the running jobs shrink; when a job ends the others grow back.
* ``first-come``: what a controller without moves does: a job keeps what it was admitted with, and a job that finds
  no room falls back to its PS.
* ``all-ps``: every job aggregates at its PS (``--mode fallback``).

A job's completion time runs from its create to its last worker's exit. Prints each job's admission, slots, moves
and completion time per policy, the mean, and the ratios of the means. Needs root (namespaces).

    python -m benchmarks.cluster_shares --workers 2 --rate-mbit 100 --capacity 256
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from netagg.bmv2.cluster import ClusterSpec, EmulatedCluster
from netagg.bmv2.netns import can_create_namespaces

POLICIES = ("fair", "first-come", "all-ps")
TENANTS = {"t0": "tenant-zero-token", "t1": "tenant-one-token", "t2": "tenant-two-token"}


@dataclass
class JobRun:
    """One job of one policy: how it was admitted and how long it took."""

    tenant: str
    job_id: int = 0
    admission: str = ""
    slots: int = 0
    wanted: int = 0
    mode: str = ""
    created: float = 0.0
    admitted_after: float = 0.0
    finished: float = 0.0
    digests: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.finished - self.created


def run_job(cluster: EmulatedCluster, run: JobRun, index: int, policy: str, hosts: list[str], size: int,
            allreduces: int) -> None:
    """Create the job (timed from here), start its PS if it falls back, run its workers to their end, delete it."""
    run.created = time.monotonic()
    created = cluster.create_job(hosts, None, mode="fallback" if policy == "all-ps" else "allreduce",
                                 name=f"{run.tenant}-job", ps=f"ps{index}", token=TENANTS[run.tenant])
    run.admitted_after = time.monotonic() - run.created
    job = created["job"]
    run.job_id, run.admission, run.slots, run.wanted, run.mode = (job["job_id"], created["admission"],
                                                                  job["slot_count"], job["slots_wanted"], job["mode"])
    paths = created["config_paths"]
    if run.mode == "fallback":
        cluster.start_ps(paths[0], cluster.ps_host, name=f"ps{index}")
    workers = [cluster.spawn(f"job{run.job_id}-rank{rank}", cluster.host_command(host, [
        sys.executable, "-m", "benchmarks.allreduce_worker", "--netagg", str(path), "--size", str(size),
        "--iterations", str(allreduces)]), stdout=subprocess.PIPE)
        for rank, (host, path) in enumerate(zip(hosts, paths, strict=True))]
    for rank, worker in enumerate(workers):
        out, _ = worker.communicate(timeout=1800)
        if worker.returncode != 0:
            log = cluster.log_tail(f"job{run.job_id}-rank{rank}")
            run.errors.append(f"rank {rank} exited {worker.returncode}: {log}")
            continue
        run.digests.add(json.loads(out.strip().splitlines()[-1])["digest"])
    run.finished = time.monotonic()
    cluster.cli("job", "delete", str(run.job_id), token=TENANTS[run.tenant])  # as a launcher does: cells back


def run_policy(spec: ClusterSpec, policy: str, workers: int, size: int, allreduces: int, apart: float,
               ) -> tuple[list[JobRun], list[str]]:
    """The three jobs under ``policy`` on a fresh cluster; their runs and the controller's move lines."""
    with tempfile.TemporaryDirectory(prefix=f"netagg-shares-{policy}-") as tmp:
        cluster = EmulatedCluster(Path(tmp), spec)
        cluster.tenants = dict(TENANTS)
        cluster.parameter_servers = len(TENANTS)
        if policy != "fair":
            cluster.worker_address = None  # no endpoint for the workers: the controller moves no job
        with cluster:
            hosts = cluster.worker_hosts
            runs = [JobRun(tenant) for tenant in TENANTS]
            threads = []
            start = time.monotonic()
            for i, run in enumerate(runs):
                time.sleep(max(0.0, start + i * apart - time.monotonic()))
                thread = threading.Thread(target=_guarded, args=(run_job, cluster, run, i, policy,
                                                                 hosts[i * workers:(i + 1) * workers], size,
                                                                 allreduces, run), daemon=True)
                thread.start()
                threads.append(thread)
            for thread in threads:
                thread.join()
            log = (Path(tmp) / "controller.log").read_text(errors="replace").splitlines()
    moves = [line.split(" INFO ", 1)[-1] for line in log if re.search(r"moving its slots|switched to|given up", line)]
    return runs, moves


def _guarded(fn, *args) -> None:
    run: JobRun = args[-1]
    try:
        fn(*args[:-1])
    except Exception as err:  # reported in the table
        run.errors.append(f"{type(err).__name__}: {err}")
        run.finished = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="workers per job (each on a host of its own)")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of each link (needs netem)")
    parser.add_argument("--target-rtt-ms", type=float, default=None,
                        help="the controller's slots.target_rtt_ms (default: its own default)")
    parser.add_argument("--capacity", type=int, default=256, help="the switch's cells (slots.capacity)")
    parser.add_argument("--size-mb", type=float, default=2.0)
    parser.add_argument("--allreduces", type=int, default=120, help="allreduces per job")
    parser.add_argument("--apart", type=float, default=10.0, help="seconds between two jobs' arrivals")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    args = parser.parse_args(argv)
    ok, why = can_create_namespaces()
    if not ok:
        print(f"cluster_shares: the emulated cluster {why}; nothing measured")
        return 2
    spec = ClusterSpec.load(num_workers=len(TENANTS) * args.workers, rate_mbit=args.rate_mbit,
                            delay_ms=args.delay_ms, slots=args.capacity, target_rtt_ms=args.target_rtt_ms)
    size = int(args.size_mb * 1e6 / 4)
    print(f"emulated cluster: {spec.num_workers} worker hosts ({args.workers} per job) and a PS host, {spec.target} "
          f"switch of {args.capacity} cells, {spec.rate_mbit} Mbit/s and {spec.delay_ms} ms per link; 3 tenants' jobs "
          f"{args.apart:g} s apart, {args.allreduces} allreduces of {size * 4 / 1e6:.2f} MB each; machine: "
          f"{os.cpu_count()} cores", flush=True)
    means = {}
    for policy in args.policies:
        runs, moves = run_policy(spec, policy, args.workers, size, args.allreduces, args.apart)
        print(f"\n{policy}:")
        print(f"  {'tenant':<7} {'job':>4} {'mode':<9} {'admission':<9} {'slots':>11} {'create s':>8} {'JCT s':>8} "
              f"{'correct':>7}")
        for run in runs:
            correct = not run.errors and len(run.digests) == 1
            print(f"  {run.tenant:<7} {run.job_id:>4} {run.mode:<9} {run.admission:<9} "
                  f"{f'{run.slots}/{run.wanted}':>11} {run.admitted_after:>8.2f} {run.seconds:>8.2f} {correct!s:>7}")
            for error in run.errors:
                print(f"    error: {error}")
        for line in moves:
            print(f"  controller: {line}")
        if all(not r.errors for r in runs):
            means[policy] = statistics.mean(r.seconds for r in runs)
            print(f"  mean JCT {means[policy]:.2f} s, longest {max(r.seconds for r in runs):.2f} s")
    if "fair" in means:
        for other in ("first-come", "all-ps"):
            if other in means:
                print(f"mean JCT, {other} / fair: {means[other] / means['fair']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
