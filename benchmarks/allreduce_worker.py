"""One worker of an allreduce measurement, run on an emulated-cluster host.

``--netagg CONFIG``: netagg (in-network or fallback, as the config says), via KVWorker.
``--gloo RANK WORLD MASTER``: torch.distributed's Gloo ring allreduce (torch optional).
Every rank reduces the same deterministic tensor (seeded by its rank) ``--iterations``
times after one warm-up and prints one JSON line: seconds per allreduce (median),
a digest of the result, and the result's first values.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from netagg.hoststack.transport import TransportStats
    from netagg.jobconfig import WorkerConfig


def tensor_for(rank: int, size: int) -> np.ndarray:
    """The input of ``rank``: reproducible, mixed signs and magnitudes."""
    rng = np.random.default_rng(1000 + rank)
    return (rng.standard_normal(size) * 10.0 ** rng.uniform(-3, 1, size)).astype(np.float32)


#: Wall-clock time (time.time()) when the timed allreduces began and ended: for benchmarks that set them against
#: something else on the machine (benchmarks.tcp_share).
WINDOW: list[float] = []


def time_allreduce(config: WorkerConfig, data: np.ndarray, iterations: int, congestion_control: bool = True,
                   ) -> tuple[list[float], np.ndarray, TransportStats, float]:
    """One warm-up allreduce (its result is returned), then ``iterations`` timed ones; the transport's stats, and
    the share of a core this process used while the timed ones ran (every thread)."""
    from netagg.hoststack.kv import KVWorker

    with KVWorker(config, progress_timeout=60.0, congestion_control=congestion_control) as worker:
        result = worker.allreduce(data)
        times = []
        cpu = _cpu()
        WINDOW[:] = [time.time()]
        for _ in range(iterations):
            start = time.perf_counter()
            worker.allreduce(data)
            times.append(time.perf_counter() - start)
        WINDOW.append(time.time())
        share = (_cpu() - cpu) / sum(times) if times else 0.0
    return times, result, worker.transport.stats, share


def _cpu() -> float:
    """CPU seconds of this process so far (every thread, user and system)."""
    now = os.times()
    return now.user + now.system


def _netagg(config_path: str, size: int, iterations: int,
            congestion_control: bool = True) -> tuple[list[float], np.ndarray, dict]:
    from netagg.jobconfig import WorkerConfig

    config = WorkerConfig.load(config_path)
    times, result, stats, share = time_allreduce(config, tensor_for(config.global_rank, size), iterations,
                                                 congestion_control)
    extra = {"packets_sent": stats.packets_sent, "retransmissions": stats.retransmissions,
             "window_decreases": stats.window_decreases, "smallest_window": stats.smallest_window,
             "stalled_timeouts": stats.stalled_timeouts, "spurious_timeouts": stats.spurious_timeouts,
             "window_undos": stats.window_undos, "peer_timeouts": stats.peer_timeouts, "timed_cpu_share": share}
    return times, result, extra


def _gloo(rank: int, world: int, master: str, size: int, iterations: int) -> tuple[list[float], np.ndarray, dict]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    host, port = master.rsplit(":", 1)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        data = torch.from_numpy(tensor_for(rank, size))
        result = data.clone()
        dist.all_reduce(result)
        times = []
        busy = 0.0
        WINDOW[:] = [time.time()]
        for _ in range(iterations):
            work = data.clone()
            dist.barrier()
            start, cpu = time.perf_counter(), _cpu()
            dist.all_reduce(work)
            times.append(time.perf_counter() - start)
            busy += _cpu() - cpu
        WINDOW.append(time.time())
    finally:
        dist.destroy_process_group()
    return times, result.numpy(), {"timed_cpu_share": busy / sum(times) if times else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--netagg", metavar="CONFIG")
    group.add_argument("--gloo", nargs=3, metavar=("RANK", "WORLD", "MASTER"))
    parser.add_argument("--size", type=int, required=True, help="float32 values per tensor")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--start-at", type=float, metavar="UNIX_TIME",
                        help="wait until this time before the first allreduce (jobs measured together start together)")
    parser.add_argument("--fixed-window", action="store_true",
                        help="netagg without congestion control (the window is always the job's slots)")
    args = parser.parse_args(argv)
    if args.start_at is not None:
        time.sleep(max(0.0, args.start_at - time.time()))
    cpu_start = os.times()
    if args.netagg:
        times, result, extra = _netagg(args.netagg, args.size, args.iterations,
                                      congestion_control=not args.fixed_window)
    else:
        rank, world, master = int(args.gloo[0]), int(args.gloo[1]), args.gloo[2]
        times, result, extra = _gloo(rank, world, master, args.size, args.iterations)
    cpu = os.times()
    busy = (cpu.user - cpu_start.user) + (cpu.system - cpu_start.system)
    print(json.dumps({
        "seconds": statistics.median(times) if times else float("nan"),
        "all_seconds": times,
        "cpu_seconds": busy,
        "digest": hashlib.sha256(np.ascontiguousarray(result, np.float32).tobytes()).hexdigest(),
        "head": [float(x) for x in result[:4]],
        "timed_window": WINDOW,
        **extra,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
