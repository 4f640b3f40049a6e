"""Allreduce goodput of the host stack, in one run.

``python -m benchmarks.hoststack_allreduce one-worker`` (issue 10, item 4's host-stack
figure): one worker of a 1-worker job, at each packet width (``--widths``, 64 and 256 values),
allreduces a float32 tensor (``KVWorker.allreduce``)
through (a) the native ``--netagg`` reflector of ``benchmarks/limit_probe.py``, a zero-cost
1-worker aggregator (with ``--gro``: it answers each segmented send with one, as the switch
does; and per datagram), and (b) the software switch (``LoopbackSwitch``, in this process; the
worker then runs as its own process, ``benchmarks.allreduce_worker``). It prints goodput
(tensor MB/s), the same per core the worker used while timed (its CPU share), data packets/s
and their ratio to the probe's client round trips/s with narrow datagrams, one per message and
with UDP GSO/GRO (``udp_round_trips``, measured before and after in the same run), the cores
one worker needs per width to fill 10 and 100 Gbit/s, then where one allreduce's time goes per
packet (a cProfile of the exchange, which inflates the Python share, and the codec steps around
it timed alone).

``python -m benchmarks.hoststack_allreduce [switch]``: 4 worker processes through the
software target as a separate process, goodput per worker next to what the switch's
measured packet rate allows (contributions/s x 256 B / workers).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.allreduce_worker import tensor_for, time_allreduce
from netagg import dataplane as dp
from netagg import wire
from netagg.hoststack import blocks as blk
from netagg.hoststack import quantization as qz
from netagg.jobconfig import Endpoint, WorkerConfig
from netagg.localports import free_ports
from netagg.testing.hoststack import expected_allreduce

WORKERS = 4


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, np.float32).tobytes()).hexdigest()


def _probe(windows: list[int], seconds: float, gso: bool = False) -> dict[int, float]:
    from benchmarks.limit_probe import udp_round_trips

    return {w: udp_round_trips(wire.NETAGG_BYTES, w, seconds, gso=gso)["round_trips_per_s"] for w in windows}


def _time_in_process(config: WorkerConfig, data: np.ndarray, iterations: int) -> tuple[list[float], str, dict]:
    times, result, stats, share = time_allreduce(config, data, iterations)
    return times, _digest(result), {"retransmissions": stats.retransmissions, "smallest_window": stats.smallest_window,
                                    "cpu_share": share}


def _time_in_worker_process(config: WorkerConfig, size: int, iterations: int, workdir: Path) -> tuple[list[float],
                                                                                                  str, dict]:
    path = workdir / f"worker-{config.job_id}.yaml"
    config.save(path)
    out = subprocess.run([sys.executable, "-m", "benchmarks.allreduce_worker", "--netagg", str(path), "--size",
                          str(size), "--iterations", str(iterations)], capture_output=True, text=True,
                         cwd=dp.REPO_ROOT, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["all_seconds"], result["digest"], {"retransmissions": result["retransmissions"],
                                                     "smallest_window": result["smallest_window"],
                                                     "cpu_share": result.get("timed_cpu_share", 0.0)}


_SEND = {"send_prepared", "send", "_send_plain", "<method 'send' of '_socket.socket' objects>",
         "<method 'sendto' of '_socket.socket' objects>"}
_RECV = {"recv", "<method 'recvfrom_into' of '_socket.socket' objects>"}
_POLL = {"<method 'poll' of 'select.poll' objects>"}
_KERNELS = {"accept_results", "fill_packets", "sample_all",
            "split", "segment_sizes", "plan_uniform", "_split_reference", "_segment_sizes_reference",
            "_plan_uniform_reference"}


def time_split(config: WorkerConfig, data: np.ndarray) -> dict[str, float]:
    """Seconds of one allreduce's steps: the codec around the exchange timed alone, the exchange profiled."""
    from netagg.hoststack.transport import Transport

    with Transport(config, progress_timeout=60.0) as transport:
        split: dict[str, float] = {}
        start = time.perf_counter()
        layout, blocks = blk.pack([0], [data], config.width)
        exponents = qz.block_exponents(blocks)
        split["codec: pack + block exponents"] = time.perf_counter() - start
        transport.exchange(blocks, exponents)  # warm-up
        start = time.perf_counter()
        transport.exchange(blocks, exponents)
        split["(exchange without the profiler)"] = time.perf_counter() - start
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        sums, global_exp, _ = transport.exchange(blocks, exponents)
        profile.disable()
        exchange = time.perf_counter() - start
        start = time.perf_counter()
        blk.unpack(layout, qz.dequantize(sums, global_exp, 1))
        decode = time.perf_counter() - start
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]

    def total(names: set[str], column: int) -> float:
        return sum(row[column] for (_, _, name), row in stats.items() if name in names)

    send, recv, poll = total(_SEND, 2), total(_RECV, 2), total(_POLL, 2)
    kernels = total(_KERNELS, 3)
    split["exchange: sendmmsg, UDP GSO (send)"] = send
    split["exchange: recvmmsg, UDP GRO (receive)"] = recv
    split["exchange: waiting in poll"] = poll
    split["exchange: batch kernels (build+quantize, check+copy, RTO, GSO plan, GRO split)"] = kernels
    split["exchange: transport Python"] = exchange - send - recv - poll - kernels
    split["codec: dequantize + unpack"] = decode
    return split


def one_worker(args: argparse.Namespace) -> int:
    from benchmarks.limit_probe import netagg_reflector

    size = int(args.megabytes * 1e6 / 4)
    data = tensor_for(0, size)
    want = {k: _digest(expected_allreduce([data], k=k)[0]) for k in args.widths}
    widest = max(args.widths)
    packets = -(-size // widest)
    windows = sorted({64, *args.slots})
    before = _probe(windows, args.probe_seconds)
    before_gso = _probe(windows, args.probe_seconds, gso=True)
    rows: list[tuple[str, int, int, list[float], bool, dict]] = []
    thread_rows: list[tuple[int, list[float], bool, dict]] = []

    def config(host: str, port: int, slots: int, k: int, threads: int = 1) -> WorkerConfig:
        return WorkerConfig(job_id=1, rank=0, num_workers=1, slot_count=slots, mode="allreduce",
                            aggregator=Endpoint(host, port), bind=Endpoint("127.0.0.1", 0), width=k, threads=threads)

    with tempfile.TemporaryDirectory(prefix="netagg-goodput-") as tmp:
        with netagg_reflector(gro=True) as (host, port):
            for k in args.widths:
                for slots in args.slots:
                    times, digest, extra = _time_in_process(config(host, port, slots, k), data, args.iterations)
                    rows.append(("native reflector, GSO/GRO", k, slots, times, digest == want[k], extra))
            thread_slots = max(args.slots)
            for threads in args.threads:  # the thread scan (hoststack/threads.py): same slots, T threads
                times, digest, extra = _time_in_process(config(host, port, thread_slots, widest, threads), data,
                                                        args.iterations)
                thread_rows.append((threads, times, digest == want[widest], extra))
            split = time_split(config(host, port, args.slots[0], widest), data)
        with netagg_reflector() as (host, port):
            for k in args.widths:
                for slots in args.slots:
                    times, digest, extra = _time_in_process(config(host, port, slots, k), data, args.iterations)
                    rows.append(("native reflector, per datagram", k, slots, times, digest == want[k], extra))
        if not args.no_switch:
            for k in args.widths:
                rows += _through_software_switch(args.slots, size, args.iterations, want[k], Path(tmp), k)
    after = _probe(windows, args.probe_seconds)
    after_gso = _probe(windows, args.probe_seconds, gso=True)
    probe = {w: (before[w] + after[w]) / 2 for w in windows}
    probe_gso = {w: (before_gso[w] + after_gso[w]) / 2 for w in windows}
    print(f"1 worker, {args.megabytes} MB float32 tensor (" + ", ".join(
        f"{-(-size // k)} data packets of {wire.netagg_bytes(k)} bytes" for k in args.widths)
        + f"), median of {args.iterations} allreduces after a warm-up")
    for window in windows:
        print(f"  probe (native UDP client, {wire.NETAGG_BYTES}-byte datagrams, window {window}): per datagram "
              f"{probe[window]:,.0f} round trips/s (before {before[window]:,.0f}, after {after[window]:,.0f}); "
              f"GSO/GRO {probe_gso[window]:,.0f} (before {before_gso[window]:,.0f}, after {after_gso[window]:,.0f})")
    print(f"  {'aggregator':<32}{'k':>4}{'slots':>6}{'MB/s':>8}{'cpu':>6}{'MB/s/core':>10}{'packets/s':>11}"
          f"{'/probe64':>10}{'/gso-probe(slots)':>19}{'exact':>7}{'resent':>8}")
    per_core: dict[int, float] = {}
    for name, k, slots, times, exact, extra in rows:
        if not times:
            print(f"  {name:<32}{k:>4}{slots:>6}  unavailable: {extra.get('error', '?')}")
            continue
        seconds = statistics.median(times)
        pps = -(-size // k) / seconds
        share = extra.get("cpu_share", 0.0)
        core = args.megabytes / seconds / share if share else 0.0
        if name.startswith("native reflector, GSO"):
            per_core[k] = max(per_core.get(k, 0.0), core)
        print(f"  {name:<32}{k:>4}{slots:>6}{args.megabytes / seconds:>8.1f}{share:>6.0%}{core:>10.1f}{pps:>11,.0f}"
              f"{pps / probe[64]:>10.2f}{pps / probe_gso[slots]:>19.2f}{exact!s:>7}{extra['retransmissions']:>8}")
    for k, mb_per_core in sorted(per_core.items()):  # cores one worker needs to fill a link of that rate
        if mb_per_core:
            need = {gbit: gbit * 1e9 / 8 * wire.payload_efficiency(k=k) / (mb_per_core * 1e6) for gbit in (10, 100)}
            print(f"  width {k}: {mb_per_core:.1f} MB/s of gradients per core -> cores per worker to fill "
                  f"10 Gbit/s: {need[10]:.1f}, 100 Gbit/s: {need[100]:.1f}")
    if thread_rows:
        one = None
        cpus = len(os.sched_getaffinity(0))
        print(f"  threads per worker (native reflector with GSO/GRO, {thread_slots} slots, {cpus} CPUs here, "
              "the reflector on the same machine):")
        print(f"  {'threads':>9}{'packets/s':>12}{'vs 1 thread':>13}{'vs linear':>11}{'/gso-probe':>12}{'exact':>7}"
              f"{'resent':>8}")
        for threads, times, exact, extra in thread_rows:
            pps = packets / statistics.median(times)
            one = one or (pps if threads == 1 else None)
            vs_one = f"{pps / one:.2f}x" if one else "-"
            vs_linear = f"{pps / (one * threads):.2f}" if one else "-"
            print(f"  {threads:>9}{pps:>12,.0f}{vs_one:>13}{vs_linear:>11}{pps / probe_gso[thread_slots]:>12.2f}"
                  f"{exact!s:>7}{extra['retransmissions']:>8}")
    print(f"  where one allreduce's time goes (native reflector with GSO/GRO, {args.slots[0]} slots; "
          "µs per data packet; the exchange under cProfile):")
    unprofiled = split.pop("(exchange without the profiler)")
    for step, seconds in split.items():
        print(f"    {step:<58}{seconds / packets * 1e6:>7.2f}")
    print(f"    {'total':<58}{sum(split.values()) / packets * 1e6:>7.2f}")
    print(f"    {'(the exchange alone without the profiler)':<58}{unprofiled / packets * 1e6:>7.2f}")
    return 0


def _through_software_switch(slot_list: list[int], size: int, iterations: int, want: str,
                             workdir: Path, k: int) -> list[tuple[str, int, int, list[float], bool, dict]]:
    rows = []
    try:
        from netagg.testing.softswitch import LoopbackSwitch

        with LoopbackSwitch() as switch:
            engine = type(switch.target.switch).__name__
            for slots in slot_list:
                config = switch.add_job(1, slot_count=slots, width=k)[0]
                times, digest, extra = _time_in_worker_process(config, size, iterations, workdir)
                rows.append((f"software switch ({engine})", k, slots, times, digest == want, extra))
    except Exception as err:  # the software switch is optional here; report why it did not run
        rows.append(("software switch", k, slot_list[0], [], False, {"error": f"{type(err).__name__}: {err}"}))
    return rows


def four_workers(args: argparse.Namespace) -> int:
    from benchmarks.switch_throughput import _install_job, measure_loopback
    from netagg.bmv2.targets import start_target
    from netagg.controller.store import WorkerEndpoint

    size = int(args.megabytes * 1e6 / 4)
    slots = args.slots[0]
    with tempfile.TemporaryDirectory(prefix="netagg-goodput-") as tmp:
        workdir = Path(tmp)
        switch_pps = measure_loopback(5.0, None, workdir, gso=True)["contributions_per_s"]  # driven as workers send
        ports = free_ports(WORKERS + 1)
        switch = start_target("soft", {}, workdir / "switch.log", loopback=f"127.0.0.1:{ports[-1]}")
        try:
            hosts = [{"name": "local", "ip": "127.0.0.1", "mac": "02:00:00:00:bb:01", "port": 1}]
            workers = [WorkerEndpoint(r, "local", "127.0.0.1", ports[r]) for r in range(WORKERS)]
            client, job_id = _install_job(switch.grpc_address, b"", hosts, workers, ports[-1], slots=slots)
            try:
                paths = []
                for r in range(WORKERS):
                    path = workdir / f"rank{r}.yaml"
                    WorkerConfig(job_id=job_id, rank=r, num_workers=WORKERS, slot_count=slots, mode="allreduce",
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
    ceiling = switch_pps * wire.PAYLOAD_BYTES / WORKERS / 1e6
    print(f"{WORKERS} workers, {args.megabytes} MB tensors, {slots} slots, software target on loopback")
    print(f"  allreduce: {seconds:.3f} s  ->  goodput {goodput:.2f} MB/s per worker "
          f"(identical results: {len({r['digest'] for r in results}) == 1})")
    print(f"  switch alone (native driver, GSO/GRO): {switch_pps:,.0f} contributions/s  ->  ceiling {ceiling:.2f} MB/s "
          "per worker")
    print(f"  goodput / ceiling: {goodput / ceiling:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="?", choices=["switch", "one-worker"], default="switch")
    parser.add_argument("--megabytes", type=float, default=4.0)
    parser.add_argument("--slots", type=int, nargs="+", default=None,
                        help="the job's slots (window); one-worker: several sizes (default 64 256), switch: 32")
    parser.add_argument("--iterations", type=int, default=None, help="default: one-worker 5, switch 3")
    parser.add_argument("--probe-seconds", type=float, default=2.0)
    parser.add_argument("--no-switch", action="store_true", help="one-worker: skip the software switch")
    parser.add_argument("--widths", type=int, nargs="+", choices=sorted(wire.WIDTH_CODES),
                        default=sorted(wire.WIDTH_CODES), help="one-worker: the packet widths to measure")
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2],
                        help="one-worker: the thread scan, threads per worker (each needs 64 of the largest --slots)")
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = one_worker if args.which == "one-worker" else four_workers
    if args.slots is None:
        args.slots = [64, 256] if args.which == "one-worker" else [32]
    if args.iterations is None:
        args.iterations = 5 if args.which == "one-worker" else 3
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
