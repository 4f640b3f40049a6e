"""``make bench-sparse``: a sparse model trained on the emulated cluster, its embedding table aggregated three ways.

* ``ps``: every touched row is pushed to and pulled from the PS (the PS-lite baseline);
* ``libra``: the hot rows (one round of the job's slots) go through the switch as dense
  blocks, the cold rows to the PS; the hot set is chosen from sampled frequencies;
* ``switch``: the whole table goes through the switch every iteration (dense in-network).

Workload: benchmarks/sparse_model.py (Zipf feature ids, an embedding table, an MLP), the
same seeds for every placement; the MLP's gradients go through the switch in every
placement. Each worker (benchmarks/sparse_worker.py) reports the time spent in the
table's pull and push per iteration ("aggregation"), the accuracy over training time and
the rows it pushed hot and cold; the link byte counters of the PS's and the workers'
interfaces are read around each run. Prints a table and the speedups over ``ps``,
writes JSON and a plot under ``results/``. Needs root (namespaces); prints why otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from netagg import dataplane as dp
from netagg.bmv2.cluster import ClusterSpec, EmulatedCluster
from netagg.bmv2.deployment import json_result
from netagg.bmv2.netns import can_create_namespaces

WORKER = [sys.executable, "-m", "benchmarks.sparse_worker"]
PLACEMENTS = ("ps", "libra", "switch")


def link_bytes(cluster: EmulatedCluster, host: str) -> tuple[int, int]:
    """(received, sent) bytes of ``host``'s link so far."""
    counters = []
    for name in ("rx_bytes", "tx_bytes"):
        path = f"/sys/class/net/{cluster.ifname_of(host)}/statistics/{name}"
        out = subprocess.run(cluster.host_command(host, ["cat", path]), capture_output=True, text=True, check=True)
        counters.append(int(out.stdout))
    return counters[0], counters[1]


def run(cluster: EmulatedCluster, placement: str, args: argparse.Namespace, repeat: int) -> dict:
    hosts = cluster.worker_hosts[:args.workers]
    created = cluster.create_job(hosts, slots=args.slots, mode="allreduce", name=f"sparse-{placement}-{repeat}")
    job_id = created["job"]["job_id"]
    if created["job"]["mode"] != "allreduce":
        cluster.cli("job", "delete", str(job_id))
        raise RuntimeError(f"job admitted as {created['job']['mode']}: {created['reason']}")
    ps = cluster.start_ps(created["config_paths"][0], cluster.ps_host) if placement != "switch" else None
    options = ["--placement", placement, "--iterations", str(args.iterations), "--alpha", str(args.alpha),
               "--rows", str(args.rows), "--width", str(args.width), "--target-accuracy", str(args.target_accuracy),
               "--hot-rounds", str(args.hot_rounds), "--batch", str(args.batch), "--rto-min", str(args.rto_min),
               "--report-every", str(args.report_every), "--drift-at", str(args.drift_at)]
    before = {h: link_bytes(cluster, h) for h in [*hosts, cluster.ps_host]}
    started = time.monotonic()
    procs = [subprocess.Popen(cluster.host_command(host, [*WORKER, "--config", str(path), *options]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=dp.REPO_ROOT)
             for host, path in zip(hosts, created["config_paths"])]
    try:
        reports = [json_result(proc, f"{placement} worker {rank}", timeout=args.max_seconds)
                   for rank, proc in enumerate(procs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        if ps is not None:
            ps.terminate()
            ps.wait(timeout=10)
            cluster.processes.remove(ps)
        cluster.cli("job", "delete", str(job_id))
    wall = time.monotonic() - started
    after = {h: link_bytes(cluster, h) for h in before}
    iterations = reports[0]["iterations"]
    ps_rx, ps_tx = (a - b for a, b in zip(after[cluster.ps_host], before[cluster.ps_host]))
    worker_bytes = [sum(after[h]) - sum(before[h]) for h in hosts]
    return {
        "placement": placement, "repeat": repeat, "iterations": iterations, "wall_seconds": round(wall, 2),
        "seconds_to_target": reports[0]["seconds_to_target"],
        "iterations_to_target": reports[0]["iterations_to_target"],
        "final_accuracy": reports[0]["curve"][-1][2], "curve": reports[0]["curve"],
        "aggregation_ms": round(float(np.mean([r["aggregation_ms"] for r in reports])), 3),
        "aggregation_ms_median": round(float(np.mean([r["aggregation_ms_median"] for r in reports])), 3),
        "dense_ms": round(float(np.mean([r["dense_ms"] for r in reports])), 3),
        **{k: round(float(np.mean([r[k] for r in reports])), 3)
           for k in ("ps_push_seconds_ms", "ps_pull_seconds_ms", "switch_seconds_ms")},
        "ps_link_kb_per_iteration": round((ps_rx + ps_tx) / iterations / 1e3, 2),
        "worker_link_kb_per_iteration": round(float(np.mean(worker_bytes)) / iterations / 1e3, 2),
        "table_slots": 0 if placement == "ps" else args.slots,
        "hot_capacity_rows": reports[0]["hot_capacity"], "hot_set_rows": reports[0]["hot_set_rows"],
        "hot_versions": reports[0]["hot_versions"],
        "hot_share": round(sum(r["hot_rows"] for r in reports)
                           / max(1, sum(r["hot_rows"] + r["cold_rows"] for r in reports)), 3),
        "retransmissions": sum(r["retransmissions"] for r in reports),
    }


def _table(rows: list[dict]) -> str:
    lines = [f"{'placement':<9} {'rep':>3} {'iters':>5} {'agg ms':>7} {'dense ms':>8} {'s to acc':>8} "
             f"{'acc':>6} {'PS KB/it':>8} {'wkr KB/it':>9} {'slots':>5} {'hot rows':>11} {'hot share':>9} "
             f"{'versions':>8}"]
    for r in rows:
        reached = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.2f}"
        lines.append(f"{r['placement']:<9} {r['repeat']:>3} {r['iterations']:>5} {r['aggregation_ms']:>7.2f} "
                     f"{r['dense_ms']:>8.2f} {reached:>8} {r['final_accuracy']:>6.3f} "
                     f"{r['ps_link_kb_per_iteration']:>8.1f} {r['worker_link_kb_per_iteration']:>9.1f} "
                     f"{r['table_slots']:>5} {r['hot_set_rows']:>5}/{r['hot_capacity_rows']:<5} {r['hot_share']:>9.3f} "
                     f"{r['hot_versions']:>8}")
    return "\n".join(lines)


def _speedups(rows: list[dict]) -> list[str]:
    out = []
    base = [r for r in rows if r["placement"] == "ps"]
    for placement in ("libra", "switch"):
        mine = [r for r in rows if r["placement"] == placement]
        if not base or not mine:
            continue
        ratios = [b["aggregation_ms"] / m["aggregation_ms"] for b, m in zip(base, mine)]
        line = (f"{placement}: aggregation {np.mean(ratios):.2f}x faster than all-PS "
                f"(runs: {', '.join(f'{x:.2f}' for x in ratios)})")
        times = [(b["seconds_to_target"], m["seconds_to_target"]) for b, m in zip(base, mine)]
        if all(b is not None and m is not None for b, m in times):
            line += f"; time to the target accuracy {np.mean([b / m for b, m in times]):.2f}x"
        if all(m["ps_link_kb_per_iteration"] > 0 for m in mine):
            ps_bytes = np.mean([b["ps_link_kb_per_iteration"] / m["ps_link_kb_per_iteration"]
                                for b, m in zip(base, mine)])
            line += f"; PS link bytes per iteration / {ps_bytes:.2f}"
        else:
            line += "; no PS traffic"
        gaps = [max(abs(a[2] - b[2]) for a, b in zip(m["curve"], p["curve"]) if a[1] == b[1])
                for p, m in zip(base, mine)]
        line += f"; accuracy curve within {max(gaps):.4f} of all-PS's"
        out.append(line)
    return out


def _plot(rows: list[dict], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"ps": "tab:red", "libra": "tab:green", "switch": "tab:blue"}
    for r in rows:
        curve = np.array(r["curve"])
        label = r["placement"] if r["repeat"] == 0 else None
        axes[0].plot(curve[:, 0], curve[:, 2], marker=".", color=colors[r["placement"]], label=label, alpha=0.8)
    axes[0].axhline(target, color="grey", linewidth=0.8, linestyle="--")
    axes[0].set(xlabel="training seconds", ylabel="test accuracy", title="accuracy over time", xscale="log")
    axes[0].legend()
    for i, placement in enumerate(PLACEMENTS):
        values = [r["aggregation_ms"] for r in rows if r["placement"] == placement]
        if values:
            axes[1].bar(i, np.mean(values), yerr=np.std(values) if len(values) > 1 else None,
                        color=colors[placement])
    axes[1].set_xticks(range(len(PLACEMENTS)), PLACEMENTS)
    axes[1].set(ylabel="ms per iteration", title="embedding aggregation time", yscale="log")
    for r in rows:
        if r["placement"] == "libra":
            curve = np.array(r["curve"])
            axes[2].plot(curve[:, 1], curve[:, 3], marker=".", color=colors["libra"], alpha=0.8)
    axes[2].set(xlabel="iteration", ylabel="share of pushed rows that were hot", title="libra: hot-set coverage",
                ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--placements", nargs="+", choices=PLACEMENTS, default=list(PLACEMENTS))
    parser.add_argument("--rows", type=int, default=20_000, help="embedding table rows (default 20,000)")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=1.5, help="Zipf exponent of the feature ids (default 1.5)")
    parser.add_argument("--batch", type=int, default=1024, help="examples per worker and iteration")
    parser.add_argument("--slots", type=int, default=32, help="the job's slots (default 32)")
    parser.add_argument("--hot-rounds", type=int, default=16,
                        help="libra: the hot set holds at most this many rounds of the slots (default 16: 1024 rows)")
    parser.add_argument("--iterations", type=int, default=300, help="at most, per run")
    parser.add_argument("--target-accuracy", type=float, default=0.77)
    parser.add_argument("--report-every", type=int, default=5, help="libra: iterations between frequency reports")
    parser.add_argument("--drift-at", type=int, default=-1, help="shift the Zipf ranking from this iteration on")
    parser.add_argument("--rto-min", type=float, default=0.01, help="the workers' smallest retransmission timeout")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--rate-mbit", type=float, default=10.0,
                        help="every host's link (default 10: the links, not this machine's two cores, dominate)")
    parser.add_argument("--out", type=Path, default=dp.REPO_ROOT / "results")
    args = parser.parse_args(argv)
    ok, why = can_create_namespaces()
    if not ok:
        print(f"make bench-sparse: the emulated cluster {why}; nothing measured")
        return 2
    spec = ClusterSpec.load(num_workers=args.workers, rate_mbit=args.rate_mbit, target="soft")
    print(f"emulated cluster: {args.workers} workers + PS host, soft switch, {spec.rate_mbit} Mbit/s and "
          f"{spec.delay_ms} ms per link; table {args.rows:,} x {args.width}, Zipf {args.alpha}, {args.slots} slots; "
          f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="netagg-sparse-") as tmp, EmulatedCluster(Path(tmp), spec) as cluster:
        for repeat in range(args.repeats):
            for placement in args.placements:
                row = run(cluster, placement, args, repeat)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
    print()
    print(_table(rows))
    for line in _speedups(rows):
        print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path, png_path = args.out / f"bench-sparse-{stamp}.json", args.out / f"bench-sparse-{stamp}.png"
    json_path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    _plot(rows, png_path, args.target_accuracy)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
