"""``torch.distributed.all_reduce`` and a DDP step through netagg, Gloo (and NCCL where there is CUDA), one machine.

    python -m benchmarks.torch_allreduce [--sizes-mb 4 64] [--ranks 2 4] [--device cpu|cuda]

For each rank count and backend it runs ``torchrun`` on this machine: the ranks time
``all_reduce`` (SUM) of float32 tensors of each size (median of ``--iterations`` after a
warm-up) and one DistributedDataParallel training step of an MLP (median step time). netagg
runs through a local deployment (the controller and the software target in loopback mode,
``bmv2/deployment.py``; the backend creates its job at the controller like any user's).
It prints a table of times and of netagg's time over Gloo's, writes
``results/torch-allreduce-<time>.csv`` and a PNG plot. NCCL only runs with ``--device cuda``
on a machine with CUDA; without CUDA, ``--device cuda`` says so and stops.

``--inner`` is the per-rank program (what torchrun starts); rank 0 writes its JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from netagg import dataplane as dp

RESULTS = dp.REPO_ROOT / "results"
#: The DDP model: an MLP of about 4.2 M parameters (16.8 MB of gradients per step).
DDP_WIDTH = 1024
DDP_LAYERS = 4


def _inner(args: argparse.Namespace) -> int:
    """One rank: time all_reduce per size and a DDP step; rank 0 writes the JSON to ``args.out``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    if args.backend == "netagg":
        import netagg.torch_backend  # noqa: F401 - registers the backend

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out: dict = {"backend": args.backend, "ranks": world, "device": args.device, "allreduce": {}}
    for size_mb in args.sizes_mb:
        tensor = torch.full((int(size_mb * 1e6 / 4),), float(rank + 1), dtype=torch.float32, device=device)
        times = []
        for i in range(args.iterations + 1):
            tensor.fill_(float(rank + 1))
            sync()
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            sync()
            if i:
                times.append(time.perf_counter() - start)
        want = world * (world + 1) / 2
        exact = bool(torch.all(tensor == want).item())
        out["allreduce"][str(size_mb)] = {"seconds": times, "median": statistics.median(times), "exact": exact}
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DDP_LAYERS):
        layers += [nn.Linear(DDP_WIDTH, DDP_WIDTH), nn.ReLU()]
    model = DistributedDataParallel(nn.Sequential(*layers).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(64, DDP_WIDTH, device=device, generator=None)
    steps = []
    for i in range(args.iterations + 1):
        sync()
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        model(data).pow(2).mean().backward()
        optimizer.step()
        sync()
        if i:
            steps.append(time.perf_counter() - start)
    out["ddp_step"] = {"seconds": steps, "median": statistics.median(steps),
                       "parameters": sum(p.numel() for p in model.parameters())}
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


def _run(backend: str, ranks: int, args: argparse.Namespace, env: dict[str, str], workdir: Path) -> dict | str:
    """torchrun with ``ranks`` ranks of this module's ``--inner``; rank 0's JSON, or why it failed."""
    out = workdir / f"{backend}-{ranks}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           "-m", "benchmarks.torch_allreduce", "--inner", "--backend", backend, "--device", args.device,
           "--iterations", str(args.iterations), "--out", str(out), "--sizes-mb", *map(str, args.sizes_mb)]
    process = subprocess.Popen(cmd, cwd=dp.REPO_ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return f"timed out after {args.timeout:.0f} s"
    if process.returncode != 0 or not out.exists():
        return f"failed (exit {process.returncode}): {stderr.strip().splitlines()[-1] if stderr.strip() else ''}"
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4.0, 64.0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--iterations", type=int, default=3, help="timed repetitions after one warm-up")
    parser.add_argument("--backends", nargs="+", default=None, help="default: netagg gloo (+ nccl with cuda)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per torchrun")
    parser.add_argument("--slots", type=int, default=256, help="netagg: the job's slots (NETAGG_SLOTS)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:
        return _inner(args)
    try:
        import torch
    except ImportError:
        print("torch is not installed: pip install torch==2.13.0 (netagg's optional extra 'torch')")
        return 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here")
        return 1
    backends = args.backends or ["netagg", "gloo", *(["nccl"] if args.device == "cuda" else [])]
    from netagg.bmv2.deployment import TENANT_TOKEN, LocalDeployment

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="netagg-torch-bench-") as tmp, \
            LocalDeployment(Path(tmp) / "deployment", capacity=4096) as local:
        env = {"NETAGG_CONFIG": str(local.config_path), "NETAGG_TOKEN": TENANT_TOKEN,
               "NETAGG_WORKER_HOST": "127.0.0.1", "NETAGG_SLOTS": str(args.slots),
               "OMP_NUM_THREADS": "1"}
        for ranks in args.ranks:
            for backend in backends:
                print(f"torchrun: {ranks} ranks, {backend} ...", flush=True)
                result = _run(backend, ranks, args, env, Path(tmp))
                rows.append({"backend": backend, "ranks": ranks, "result": result})
    _report(rows, args)
    return 0


def _report(rows: list[dict], args: argparse.Namespace) -> None:
    cpus = len(os.sched_getaffinity(0))
    print(f"\nall_reduce (SUM, float32, {args.device}) median of {args.iterations}, and one DDP step of a "
          f"{DDP_LAYERS}-layer MLP ({DDP_WIDTH} wide); {cpus} CPUs here")
    sizes = [str(s) for s in args.sizes_mb]
    header = f"{'ranks':>5} {'backend':<8}" + "".join(f"{s + ' MB':>12}" for s in sizes) + f"{'DDP step':>12}" \
        + "".join(f"{s + ' MB / gloo':>16}" for s in sizes) + f"{'step / gloo':>13}  exact"
    print(header)
    table: list[list] = []
    for row in rows:
        result = row["result"]
        if isinstance(result, str):
            print(f"{row['ranks']:>5} {row['backend']:<8} {result}")
            continue
        gloo = next((r["result"] for r in rows if r["ranks"] == row["ranks"] and r["backend"] == "gloo"
                     and isinstance(r["result"], dict)), None)
        times = [result["allreduce"][s]["median"] for s in sizes]
        step = result["ddp_step"]["median"]
        ratios = [t / gloo["allreduce"][s]["median"] if gloo else float("nan") for t, s in zip(times, sizes)]
        step_ratio = step / gloo["ddp_step"]["median"] if gloo else float("nan")
        exact = all(result["allreduce"][s]["exact"] for s in sizes)
        print(f"{row['ranks']:>5} {row['backend']:<8}" + "".join(f"{t:>11.3f}s" for t in times) + f"{step:>11.3f}s"
              + "".join(f"{r:>15.2f}x" for r in ratios) + f"{step_ratio:>12.2f}x  {exact}")
        table.append([row["ranks"], row["backend"], *times, step, *ratios, step_ratio, exact])
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"torch-allreduce-{stamp}.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["ranks", "backend", *(f"allreduce_{s}MB_s" for s in sizes), "ddp_step_s",
                         *(f"allreduce_{s}MB_over_gloo" for s in sizes), "ddp_step_over_gloo", "exact"])
        writer.writerows(table)
    print(f"wrote {path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for backend in sorted({r[1] for r in table}):
        for size_index, size in enumerate(sizes):
            points = [(r[0], r[2 + size_index]) for r in table if r[1] == backend]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{backend}, {size} MB")
    ax.set_xlabel("ranks")
    ax.set_ylabel("all_reduce time (s)")
    ax.set_yscale("log")
    ax.set_title(f"torch.distributed all_reduce, {args.device}, {cpus} CPUs")
    ax.legend()
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
