"""Allreduce goodput of 4 workers through the software target on loopback, in one run.

Starts the software target (loopback UDP) as a process, installs one job over
P4Runtime, runs 4 worker processes (``benchmarks.allreduce_worker``) that each
allreduce the same-size tensor, and prints per-worker goodput (tensor MB/s) next to
what the switch's measured packet rate allows (contributions/s x 256 B / workers).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.switch_throughput import _install_job, measure_loopback
from netagg import dataplane as dp
from netagg import wire
from netagg.bmv2.targets import start_target
from netagg.controller.store import WorkerEndpoint
from netagg.jobconfig import Endpoint, WorkerConfig
from netagg.localports import free_ports

WORKERS = 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=4.0)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args(argv)
    size = int(args.megabytes * 1e6 / 4)
    with tempfile.TemporaryDirectory(prefix="netagg-goodput-") as tmp:
        workdir = Path(tmp)
        switch_rate = measure_loopback(20, workdir)
        ports = free_ports(WORKERS + 1)
        switch = start_target("soft", {}, workdir / "switch.log", loopback=f"127.0.0.1:{ports[-1]}")
        try:
            hosts = [{"name": "local", "ip": "127.0.0.1", "mac": "02:00:00:00:bb:01", "port": 1}]
            workers = [WorkerEndpoint(r, "local", "127.0.0.1", ports[r]) for r in range(WORKERS)]
            client, job_id = _install_job(switch.grpc_address, b"", hosts, workers, ports[-1], slots=args.slots)
            try:
                paths = []
                for r in range(WORKERS):
                    path = workdir / f"rank{r}.yaml"
                    WorkerConfig(job_id=job_id, rank=r, num_workers=WORKERS, slot_count=args.slots, mode="allreduce",
                                 aggregator=Endpoint("127.0.0.1", ports[-1]),
                                 bind=Endpoint("127.0.0.1", ports[r])).save(path)
                    paths.append(path)
                procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.allreduce_worker", "--netagg", str(p),
                                           "--size", str(size), "--iterations", str(args.iterations)],
                                          stdout=subprocess.PIPE, text=True, cwd=dp.REPO_ROOT) for p in paths]
                results = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in procs]
            finally:
                client.close()
        finally:
            switch.stop()
    seconds = max(r["seconds"] for r in results)
    goodput = args.megabytes / seconds
    switch_pps = switch_rate["contributions"] / switch_rate["seconds"]
    ceiling = switch_pps * wire.PAYLOAD_BYTES / WORKERS / 1e6
    print(f"{WORKERS} workers, {args.megabytes} MB tensors, {args.slots} slots, software target on loopback")
    print(f"  allreduce: {seconds:.3f} s  ->  goodput {goodput:.2f} MB/s per worker "
          f"(identical results: {len({r['digest'] for r in results}) == 1})")
    print(f"  switch alone: {switch_pps:,.0f} contributions/s  ->  ceiling {ceiling:.2f} MB/s per worker")
    print(f"  goodput / ceiling: {goodput / ceiling:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
