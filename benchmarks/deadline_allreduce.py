"""Deadline allreduce against exact sync, with one late worker: time per step and convergence.

    python -m benchmarks.deadline_allreduce [--workers 4] [--steps 90] [--late-ms 100] [--deadline-ms 20]

``examples/mlp_digits.py``'s MLP trained data-parallel by ``--workers`` threads through the software switch on
loopback (``netagg.testing.softswitch``): every step each worker computes its minibatch's gradient and the job
sums them with ``KVWorker.allreduce``. The last worker is ``--late-ms`` late on every third step. Two runs, same
data and seed: **exact** (every step waits for every worker) and **deadline** (``allreduce(deadline=...)``: a
step's rounds close ``--deadline-ms`` after a worker began them, and the late worker's gradient joins the next
step's sum). With torch installed, a third run, **gloo**: the same training with one process per worker summing
through ``torch.distributed``'s Gloo allreduce over loopback TCP (it waits for the late worker like exact sync).
Prints per run the mean time per step of the on-time workers and of the late one, the training loss and test
accuracy after the last step, and whether every worker ended with the same parameters; then the ratios measured in
this run. The machine's cores are shared by the workers, the switch and the host stacks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np

from examples import mlp_digits as mlp
from netagg.localports import free_ports
from netagg.testing.hoststack import run_workers


def _steps(rank: int, n: int, steps: int, late_every: int, late_s: float,
           allreduce: Callable[[np.ndarray], np.ndarray]) -> dict:
    """One worker's training: ``steps`` of the MLP, its gradients summed by ``allreduce``; the last rank is
    ``late_s`` late on every ``late_every``-th step."""
    data = mlp.load_digits_dataset(0)
    params = mlp.init_params(0)
    times, losses = [], []
    for step in range(steps):
        began = time.perf_counter()
        idx = mlp.batch_indices(step, rank, n, len(data.x_train), 0)
        loss, grads = mlp.loss_and_grads(params, data.x_train[idx], data.y_train[idx])
        if rank == n - 1 and step % late_every == 0:
            time.sleep(late_s)
        total = allreduce(mlp.flatten(grads))
        mean = mlp.unflatten(total / n, params)
        params = [p - mlp.LEARNING_RATE * g for p, g in zip(params, mean, strict=True)]
        times.append(time.perf_counter() - began)
        losses.append(loss)
    flat = mlp.flatten(params).astype(np.float32)
    return {"rank": rank, "step_s": statistics.mean(times[1:]), "loss": statistics.mean(losses[-5:]),
            "test_loss": mlp.loss_and_grads(params, data.x_test, data.y_test)[0],
            "test_accuracy": mlp.accuracy(params, data.x_test, data.y_test),
            "digest": hashlib.sha256(flat.tobytes()).hexdigest()[:16]}


def _train(configs, steps: int, late_every: int, late_s: float, deadline: float | None) -> list[dict]:
    start = threading.Barrier(len(configs))

    def worker_job(worker, rank: int) -> dict:
        start.wait(60)
        row = _steps(rank, len(configs), steps, late_every, late_s,
                     lambda flat: worker.allreduce(flat, deadline=deadline))
        return {**row, "carried_blocks": worker.deadline_carry,
                "retransmissions": worker.transport.stats.retransmissions}

    return run_workers(configs, worker_job, timeout=600.0, progress_timeout=30.0)


def _gloo_worker(rank: int, n: int, port: int, steps: int, late_every: int, late_s: float, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    try:
        def allreduce(flat: np.ndarray) -> np.ndarray:
            tensor = torch.from_numpy(np.ascontiguousarray(flat, np.float32))
            dist.all_reduce(tensor)
            return tensor.numpy()

        dist.barrier()
        out.put(_steps(rank, n, steps, late_every, late_s, allreduce))
    finally:
        dist.destroy_process_group()


def _train_gloo(n: int, steps: int, late_every: int, late_s: float) -> list[dict] | None:
    """The same training with one process per worker and Gloo's allreduce; None without torch."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = free_ports(1, "tcp")[0]
    procs = [context.Process(target=_gloo_worker, args=(r, n, port, steps, late_every, late_s, out)) for r in range(n)]
    for proc in procs:
        proc.start()
    rows = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join(60)
    return sorted(rows, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--late-ms", type=float, default=100.0)
    parser.add_argument("--late-every", type=int, nargs="+", default=[3, 10],
                        help="the late worker is late on every n-th step (one pair of runs per n)")
    parser.add_argument("--deadline-ms", type=float, default=20.0)
    parser.add_argument("--slots", type=int, default=64)
    args = parser.parse_args(argv)
    from netagg.testing import softswitch as testing

    for every in args.late_every:
        summary = {}
        for name, deadline in (("exact", None), ("deadline", args.deadline_ms / 1000), ("gloo", None)):
            if name == "gloo":
                rows = _train_gloo(args.workers, args.steps, every, args.late_ms / 1000)
                if rows is None:
                    print(json.dumps({"run": "gloo", "skipped": "torch is not installed"}), flush=True)
                    continue
            else:
                with testing.LoopbackSwitch() as switch:
                    configs = switch.add_job(args.workers, slot_count=args.slots)
                    rows = _train(configs, args.steps, every, args.late_ms / 1000, deadline)
            on_time = statistics.mean(r["step_s"] for r in rows[:-1])
            same = len({r["digest"] for r in rows}) == 1
            summary[name] = {"late_every": every, "step_s_on_time": round(on_time, 4),
                             "step_s_late_worker": round(rows[-1]["step_s"], 4),
                             "train_loss_last5": round(rows[0]["loss"], 4), "test_loss": round(rows[0]["test_loss"], 4),
                             "test_accuracy": round(rows[0]["test_accuracy"], 4), "same_params_everywhere": same,
                             "blocks_carried_by_late_worker": rows[-1].get("carried_blocks", 0),
                             "retransmissions": sum(r.get("retransmissions", 0) for r in rows)}
            print(json.dumps({"run": name, **summary[name]}), flush=True)
        exact, late = summary["exact"], summary["deadline"]
        print(f"late on every {every}th step: time per step (on-time workers) exact / deadline = "
              f"{exact['step_s_on_time'] / late['step_s_on_time']:.2f}x; after {args.steps} steps training loss "
              f"{exact['train_loss_last5']} (exact) vs {late['train_loss_last5']} (deadline), test accuracy "
              f"{exact['test_accuracy']} vs {late['test_accuracy']}", flush=True)
        if "gloo" in summary:
            gloo = summary["gloo"]
            print(f"late on every {every}th step: time per step (on-time workers) gloo / deadline = "
                  f"{gloo['step_s_on_time'] / late['step_s_on_time']:.2f}x, gloo / exact = "
                  f"{gloo['step_s_on_time'] / exact['step_s_on_time']:.2f}x; gloo's training loss "
                  f"{gloo['train_loss_last5']}, test accuracy {gloo['test_accuracy']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
