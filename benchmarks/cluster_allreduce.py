"""``make bench``: allreduce time on the emulated cluster — netagg in the switch, netagg through
the PS (fallback, no switch aggregation), and Gloo's ring (when torch is installed) — same links,
same tensors, one run. Each time is also shown as a ratio to its physical bound on those links:

* in-network:  M / (e·B)                 (each worker sends M and receives M, full duplex)
* ring:        2(N-1)/N · M / (e_tcp·B)
* PS:          N · M / (e·B)             (all of it crosses the PS's link)

with M the tensor bytes, B the per-host link rate and e the payload share of each packet on
the wire (all headers, preamble and gaps counted; for netagg, of the job's packet width). Writes a table
to stdout, a CSV and a PNG
plot under ``results/``. Needs root (namespaces); prints why it cannot run otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from netagg import dataplane as dp
from netagg import wire
from netagg.bmv2.cluster import ClusterSpec, EmulatedCluster
from netagg.bmv2.deployment import json_result
from netagg.bmv2.netns import can_create_namespaces

WORKER = [sys.executable, "-m", "benchmarks.allreduce_worker"]
GLOO_PORT = 29500
#: TCP payload share of a 1500-byte-MTU frame: MSS 1448 (timestamps on) of 1500 + 38 bytes on the wire.
E_TCP = 1448 / (1500 + 38)
KINDS = ("netagg", "fallback", "gloo")
#: The same as netagg and fallback but without the transport's congestion control (a fixed window).
FIXED_WINDOW_KINDS = ("netagg-fixed", "fallback-fixed")


@dataclass
class Measurement:
    kind: str
    workers: int
    megabytes: float
    seconds: float
    bound_seconds: float
    ratio_to_bound: float
    identical_on_all_workers: bool
    digest: str
    head: list[float]
    #: The busiest worker's share of a core from its start to the kind's end, and while its timed allreduces
    #: ran (every thread of the process); the switch's over the kind's run.
    worker_cpu_share: float
    switch_cpu_share: float
    retransmissions: int
    #: Packets the workers sent (netagg kinds; 0 for gloo), for retransmissions as a share.
    packets_sent: int = 0
    timed_worker_cpu_share: float = 0.0
    #: Values per packet of the job (netagg and fallback kinds; 0 for gloo).
    width: int = 0
    #: The slots the job got (netagg kinds: the controller's choice unless --slots; 0 for gloo and fallback).
    slots: int = 0
    #: Wall-clock time (time.time()) the first worker began its timed allreduces and the last one ended them.
    timed_window: tuple[float, float] = (0.0, 0.0)


def torch_available() -> bool:
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        return False
    return True


def bound_seconds(kind: str, num_workers: int, tensor_bytes: int, rate_mbit: float, width: int = wire.K) -> float:
    rate = rate_mbit * 1e6 / 8
    e = wire.payload_efficiency(k=width)
    kind = kind.removesuffix("-fixed")
    if kind == "netagg":
        return tensor_bytes / (e * rate)
    if kind == "gloo":
        return 2 * (num_workers - 1) / num_workers * tensor_bytes / (E_TCP * rate)
    return num_workers * tensor_bytes / (e * rate)


def _cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of a process and its children so far (from /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(x) for x in fields[11:15]) / ticks


@dataclass
class RunningKind:
    """The worker processes of one measurement, started and not yet collected."""

    kind: str
    num_workers: int
    size: int
    procs: list[subprocess.Popen]
    job_id: int | None
    ps: subprocess.Popen | None
    started: float
    switch_cpu_before: float
    width: int = 0
    slots: int = 0


def start_kind(cluster: EmulatedCluster, kind: str, num_workers: int, size: int, iterations: int,
               slots: int | None = None, port_offset: int = 0, start_at: float | None = None,
               width: int | None = None) -> RunningKind:
    """Create the job (netagg/fallback kinds) and start one worker process per host; see finish_kind.

    ``slots``: the job's (None: the controller chooses them from the hosts' links, docs/controller.md).
    ``start_at`` (a ``time.time()`` value): the workers wait until then before their first allreduce.
    ``width``: values per packet (None: the controller's default for the switch's target).
    """
    hosts = cluster.worker_hosts[:num_workers]
    job_id = None
    ps = None
    job_width = job_slots = 0
    if kind == "gloo":
        master = f"{cluster.ip_of(hosts[0])}:{GLOO_PORT}"
        # Gloo must bind to the host's link, not to whatever the hostname resolves to.
        commands = [["env", f"GLOO_SOCKET_IFNAME={cluster.ifname_of(host)}", *WORKER, "--gloo", str(rank),
                     str(num_workers), master] for rank, host in enumerate(hosts)]
    else:
        mode = "allreduce" if kind.startswith("netagg") else "fallback"
        created = cluster.create_job(hosts, slots=slots, mode=mode, name=f"bench-{kind}-{port_offset}",
                                     port_offset=port_offset, options=("--width", str(width)) if width else ())
        job_id = created["job"]["job_id"]
        job_width = int(created["job"].get("width", wire.K))
        job_slots = int(created["job"]["slot_count"])
        if created["job"]["mode"] != mode:
            cluster.cli("job", "delete", str(job_id))
            raise RuntimeError(f"asked for {mode}, admitted as {created['job']['mode']}: {created['reason']}")
        if mode == "fallback":
            ps = cluster.start_ps(created["config_paths"][0], cluster.ps_host)
        fixed = ["--fixed-window"] if kind.endswith("-fixed") else []
        commands = [[*WORKER, "--netagg", str(path), *fixed] for path in created["config_paths"]]
    switch_cpu_before = _cpu_seconds(cluster.switch.process.pid)
    started = time.monotonic()
    timing = ["--iterations", str(iterations)] + ([] if start_at is None else ["--start-at", repr(start_at)])
    procs = [subprocess.Popen(cluster.host_command(host, [*cmd, "--size", str(size), *timing]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=dp.REPO_ROOT)
             for host, cmd in zip(hosts, commands)]
    return RunningKind(kind, num_workers, size, procs, job_id, ps, started, switch_cpu_before, job_width, job_slots)


def finish_kind(cluster: EmulatedCluster, run: RunningKind) -> Measurement:
    """Wait for ``run``'s workers, stop its PS, delete its job; the measurement."""
    results = []
    try:
        for rank, proc in enumerate(run.procs):
            results.append(json_result(proc, f"{run.kind} worker {rank}", timeout=1800))
    finally:
        for proc in run.procs:
            if proc.poll() is None:
                proc.kill()
        if run.ps is not None:
            run.ps.terminate()
            run.ps.wait(timeout=10)
            cluster.processes.remove(run.ps)
        if run.job_id is not None:
            cluster.cli("job", "delete", str(run.job_id))
    wall = time.monotonic() - run.started
    seconds = max(r["seconds"] for r in results)
    bound = bound_seconds(run.kind, run.num_workers, run.size * 4, cluster.spec.rate_mbit, run.width or wire.K)
    return Measurement(
        kind=run.kind, workers=run.num_workers, megabytes=run.size * 4 / 1e6, seconds=seconds, bound_seconds=bound,
        ratio_to_bound=seconds / bound, identical_on_all_workers=len({r["digest"] for r in results}) == 1,
        digest=results[0]["digest"], head=results[0]["head"],
        worker_cpu_share=max(r["cpu_seconds"] for r in results) / wall,
        switch_cpu_share=(_cpu_seconds(cluster.switch.process.pid) - run.switch_cpu_before) / wall,
        retransmissions=sum(r.get("retransmissions", 0) for r in results),
        packets_sent=sum(r.get("packets_sent", 0) for r in results),
        timed_worker_cpu_share=max(r.get("timed_cpu_share", 0.0) for r in results), width=run.width,
        slots=run.slots, timed_window=_timed_window(results),
    )


def _timed_window(results: list[dict]) -> tuple[float, float]:
    windows = [r["timed_window"] for r in results if len(r.get("timed_window", ())) == 2]
    return (min(w[0] for w in windows), max(w[1] for w in windows)) if windows else (0.0, 0.0)


def run_kind(cluster: EmulatedCluster, kind: str, num_workers: int, size: int, iterations: int,
             slots: int | None = None, width: int | None = None) -> Measurement:
    """One allreduce measurement of ``kind`` on the first ``num_workers`` hosts."""
    return finish_kind(cluster, start_kind(cluster, kind, num_workers, size, iterations, slots, width=width))


@contextlib.contextmanager
def cpu_hog(processes: int) -> Iterator[None]:
    """``processes`` busy loops at normal priority for the duration of the block (a machine that is not idle)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _table(rows: list[Measurement]) -> str:
    lines = [f"{'kind':<14} {'N':>2} {'k':>3} {'slots':>5} {'MB':>7} {'seconds':>9} {'bound':>8} {'x bound':>8} "
             f"{'identical':>9} {'worker cpu':>10} {'timed':>6} {'switch cpu':>10} {'retx':>6} {'retx %':>6}"]
    for m in rows:
        lines.append(f"{m.kind:<14} {m.workers:>2} {m.width or '-':>3} {m.slots or '-':>5} {m.megabytes:>7.2f} "
                     f"{m.seconds:>9.3f} "
                     f"{m.bound_seconds:>8.3f} "
                     f"{m.ratio_to_bound:>8.2f} {m.identical_on_all_workers!s:>9} {m.worker_cpu_share:>10.0%} "
                     f"{m.timed_worker_cpu_share:>6.0%} "
                     f"{m.switch_cpu_share:>10.0%} {m.retransmissions:>6} "
                     f"{(f'{m.retransmissions / m.packets_sent:.1%}' if m.packets_sent else '-'):>6}")
    return "\n".join(lines)


def _speedups(rows: list[Measurement]) -> list[str]:
    out = []
    by_key = {(m.kind, m.workers, m.megabytes): m for m in rows}
    for (kind, n, mb), m in sorted(by_key.items()):
        if kind != "netagg":
            continue
        e = wire.payload_efficiency(k=m.width or wire.K)
        for other, ideal in (("gloo", 2 * (n - 1) / n * e / E_TCP), ("fallback", float(n))):
            o = by_key.get((other, n, mb))
            if o:
                speedup = o.seconds / m.seconds
                out.append(f"N={n} {mb:.2f} MB: speedup over {other} {speedup:.2f}x, "
                           f"{speedup / ideal:.2f} of its maximum {ideal:.2f}x")
        for kind_name in FIXED_WINDOW_KINDS:
            fixed, controlled = by_key.get((kind_name, n, mb)), by_key.get((kind_name.removesuffix("-fixed"), n, mb))
            if fixed and controlled:
                out.append(f"N={n} {mb:.2f} MB: congestion control speeds {controlled.kind} up "
                           f"{fixed.seconds / controlled.seconds:.2f}x over its fixed window")
    return out


def _plot(rows: list[Measurement], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for kind in KINDS + FIXED_WINDOW_KINDS:
        for n in sorted({m.workers for m in rows}):
            pts = sorted((m.megabytes, m.seconds, m.ratio_to_bound) for m in rows if m.kind == kind and m.workers == n)
            if pts:
                axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{kind} N={n}")
                axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=f"{kind} N={n}")
    axes[0].set(xscale="log", yscale="log", xlabel="tensor MB", ylabel="allreduce seconds", title="time")
    axes[1].set(xscale="log", xlabel="tensor MB", ylabel="time / physical bound", title="ratio to bound")
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[0.25, 1.0, 4.0])
    parser.add_argument("--kinds", nargs="+", choices=KINDS + FIXED_WINDOW_KINDS, default=list(KINDS),
                        help="what to measure; the -fixed kinds run without congestion control")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--slots", type=int,
                        help="slots per job = packets in flight per worker (default: the controller chooses them "
                             "from the links' rate and slots.target_rtt_ms; each job's count is printed)")
    parser.add_argument("--width", type=int, choices=sorted(wire.WIDTH_CODES),
                        help="values per packet of the jobs (default: the controller's for the switch's target)")
    parser.add_argument("--rate-mbit", type=float, help="override configs/cluster.yaml's link rate")
    parser.add_argument("--target", choices=("soft", "bmv2"), help="override configs/cluster.yaml's target")
    parser.add_argument("--out", type=Path, default=dp.REPO_ROOT / "results")
    parser.add_argument("--cpu-hog", type=int, default=0, metavar="K",
                        help="run K processes that spin on the CPU beside the cluster (a busy machine)")
    args = parser.parse_args(argv)
    ok, why = can_create_namespaces()
    if not ok:
        print(f"make bench: the emulated cluster {why}; nothing measured")
        return 2
    kinds = [k for k in args.kinds if k != "gloo" or torch_available()]
    if "gloo" in args.kinds and "gloo" not in kinds:
        print("gloo: skipped (torch is not installed: pip install torch==2.13.0)")
    spec = ClusterSpec.load(num_workers=max(args.workers), rate_mbit=args.rate_mbit, target=args.target)
    from tqdm import tqdm

    jobs = [(n, mb, kind) for n in args.workers for mb in args.sizes_mb for kind in kinds]
    rows: list[Measurement] = []
    print(f"emulated cluster: {spec.num_workers} worker hosts + 1 PS host, {spec.target} switch, "
          f"{spec.rate_mbit} Mbit/s and {spec.delay_ms} ms per link, MTU {spec.mtu}; machine: {os.cpu_count()} cores")
    print(f"slots per job: {args.slots} (--slots)" if args.slots else
          "slots per job: the controller's choice for the links (column slots; docs/controller.md)")
    if args.cpu_hog:
        print(f"CPU hog: {args.cpu_hog} spinning process(es) beside the cluster")
    with tempfile.TemporaryDirectory(prefix="netagg-bench-") as tmp, EmulatedCluster(Path(tmp), spec) as cluster, \
            cpu_hog(args.cpu_hog):
        for n, mb, kind in tqdm(jobs, desc="allreduce", unit="run"):
            size = max(1, int(mb * 1e6 / 4))
            rows.append(run_kind(cluster, kind, n, size, args.iterations, args.slots, args.width))
    print(_table(rows))
    for line in _speedups(rows):
        print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    csv_path, png_path = args.out / f"bench-{stamp}.csv", args.out / f"bench-{stamp}.png"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(m) for m in rows)
    _plot(rows, png_path)
    print(f"wrote {csv_path} and {png_path}")
    return 0 if all(m.identical_on_all_workers and math.isfinite(m.seconds) for m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
