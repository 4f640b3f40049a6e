"""One worker of ``make bench-sparse``: trains benchmarks/sparse_model.py's click model through a sparse table.

``python -m benchmarks.sparse_worker --config rank.yaml --placement libra`` runs until the
test accuracy (rank 0 measures it every ``--eval-every`` iterations and tells the others
through a one-value allreduce) reaches ``--target-accuracy`` or ``--iterations`` ran out;
prints one JSON line: the time spent in aggregation per iteration, the accuracy curve
over training time, the hot/cold rows pushed and the hot-set versions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from benchmarks.sparse_model import ClickData, ClickModel, accuracy
from netagg.hoststack.kv import KVWorker
from netagg.jobconfig import WorkerConfig

TEST_STREAM = 1 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--placement", choices=("ps", "libra", "switch"), required=True)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--fields", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=1.5)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--lr-embedding", type=float, default=20.0)
    parser.add_argument("--lr-dense", type=float, default=0.5)
    parser.add_argument("--hot-rounds", type=int, default=2)
    parser.add_argument("--report-every", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--test-size", type=int, default=4000)
    parser.add_argument("--target-accuracy", type=float, default=0.77)
    parser.add_argument("--rto-min", type=float, default=0.01, help="the transport's smallest timeout (s)")
    parser.add_argument("--drift-at", type=int, default=-1, help="shift the Zipf ranking from this iteration on")
    args = parser.parse_args(argv)
    config = WorkerConfig.load(args.config)
    rank, n = config.rank, config.num_workers
    data = ClickData(args.rows, args.fields, args.alpha, seed=0)
    model = ClickModel(args.fields, args.width, seed=1)
    test_ids, test_labels = data.batch(TEST_STREAM, 0, args.test_size)
    test_keys, test_inverse = np.unique(test_ids, return_inverse=True)
    curve, comm, dense_comm = [], [], []
    train_seconds, reached, pushed_before = 0.0, None, (0, 0)
    with KVWorker(config, progress_timeout=30.0, rto_min=args.rto_min) as kv:
        table = kv.sparse_table(0, args.rows, args.width, placement=args.placement, update="sgd",
                                lr=args.lr_embedding, init_scale=0.05, seed=3, hot_rounds=args.hot_rounds,
                                report_every=args.report_every)
        kv.allreduce(np.zeros(1, np.float32))  # everyone is up: start the clocks together
        def batch(it: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            shift = args.rows // 3 if 0 <= args.drift_at <= it else 0
            ids, labels = data.batch(rank, it, args.batch, shift)
            keys, inverse = np.unique(ids, return_inverse=True)
            return keys, inverse.reshape(ids.shape), labels, ids

        keys, inverse, labels, _ = batch(0)
        rows = kv.wait(table.pull(keys))
        for it in range(args.iterations):
            start = time.perf_counter()
            _, grad_rows, grad_dense = model.gradients(rows, inverse, labels)
            computed = time.perf_counter()
            next_keys, next_inverse, next_labels, _ = batch(it + 1)
            # Push this batch's gradients and pull the next batch's weights, overlapped (PS-lite's ZPush/ZPull).
            rows = kv.wait(table.pushpull(keys, grad_rows, next_keys))
            pushed = time.perf_counter()
            model.step_dense(kv.allreduce(grad_dense) / n, args.lr_dense)
            done = time.perf_counter()
            keys, inverse, labels = next_keys, next_inverse, next_labels
            comm.append(pushed - computed)
            dense_comm.append(done - pushed)
            train_seconds += done - start
            if (it + 1) % args.eval_every == 0 or it + 1 == args.iterations:
                test_rows = kv.wait(table.pull(test_keys))
                score = accuracy(model, test_rows, test_inverse.reshape(test_ids.shape), test_labels) \
                    if rank == 0 else 0.0
                score = float(kv.allreduce(np.array([score], np.float32))[0])  # rank 0's, to everyone
                hot, cold = table.stats["hot_rows"] - pushed_before[0], table.stats["cold_rows"] - pushed_before[1]
                pushed_before = (table.stats["hot_rows"], table.stats["cold_rows"])
                # (training seconds, iterations, accuracy, share of this worker's rows pushed hot since the last)
                curve.append((round(train_seconds, 4), it + 1, round(score, 4), round(hot / max(1, hot + cold), 3)))
                if reached is None and score >= args.target_accuracy:
                    reached = (train_seconds, it + 1)
                    break
    print(json.dumps({
        "rank": rank, "placement": args.placement, "iterations": len(comm),
        "seconds_to_target": None if reached is None else round(reached[0], 4),
        "iterations_to_target": None if reached is None else reached[1],
        "train_seconds": round(train_seconds, 4), "curve": curve,
        "aggregation_ms": round(1e3 * float(np.mean(comm)), 3),
        "aggregation_ms_median": round(1e3 * float(np.median(comm)), 3),
        "dense_ms": round(1e3 * float(np.mean(dense_comm)), 3),
        "hot_rows": table.stats["hot_rows"], "cold_rows": table.stats["cold_rows"],
        "hot_versions": table.hot.version, "hot_capacity": table.spec.capacity,
        "hot_set_rows": int(table.hot.keys.size),
        "retransmissions": kv.transport.stats.retransmissions,
        **{f"{k}_ms": round(1e3 * table.stats[k] / max(1, len(comm)), 3)
           for k in ("ps_push_seconds", "ps_pull_seconds", "switch_seconds")},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
