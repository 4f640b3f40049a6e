"""Data-parallel training of a small MLP on scikit-learn's bundled digits, gradients through netagg.

Run as one worker of a netagg job::

    python examples/mlp_digits.py --config rank0.yaml --steps 200

Every step each worker computes the mean gradient of its own minibatch, netagg sums
the gradients of all workers in the switch (``KVWorker.allreduce``), and each worker
applies the average — so all workers keep identical parameters. ``--reference`` runs
the same training in one process with float32 gradients (no network) for comparison:
the global minibatch of a step is the union of the workers' minibatches.
Prints one JSON object per step (rank 0 only by default) and a final summary line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass

import numpy as np

HIDDEN = 64
CLASSES = 10
BATCH_PER_WORKER = 32
LEARNING_RATE = 0.1


@dataclass
class Dataset:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits_dataset(seed: int = 0) -> Dataset:
    """The 8x8 digits bundled with scikit-learn (nothing downloaded), standardized, 80/20 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return prepare_digits(digits.data, digits.target, seed)


def prepare_digits(pixels: np.ndarray, labels: np.ndarray, seed: int = 0) -> Dataset:
    """Scale the 0..16 pixels, shuffle with ``seed``, split 80/20 and standardize by the training part."""
    x = pixels.astype(np.float32) / 16.0
    y = labels.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    mean, std = x[:split].mean(0), x[:split].std(0) + 1e-3
    x = (x - mean) / std
    return Dataset(x[:split], y[:split], x[split:], y[split:])


def init_params(seed: int = 0, inputs: int = 64, hidden: int = HIDDEN) -> list[np.ndarray]:
    """He-initialised weights; ``hidden`` units (wider: a larger model, for transfer-bound benchmarks)."""
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((inputs, hidden)) * np.sqrt(2.0 / inputs)).astype(np.float32),
        np.zeros(hidden, np.float32),
        (rng.standard_normal((hidden, CLASSES)) * np.sqrt(1.0 / hidden)).astype(np.float32),
        np.zeros(CLASSES, np.float32),
    ]


def forward(params: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w1, b1, w2, b2 = params
    hidden = np.maximum(x @ w1 + b1, 0.0)
    return hidden, hidden @ w2 + b2


def _probs_and_loss(logits: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Softmax of ``logits`` (in place) and the mean cross-entropy against labels ``y``."""
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits, out=logits)
    probs /= probs.sum(axis=1, keepdims=True)
    return probs, float(-np.log(probs[np.arange(len(y)), y] + 1e-12).mean())


def loss(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Mean softmax cross-entropy over the batch (the forward pass of :func:`loss_and_grads` alone)."""
    return _probs_and_loss(forward(params, x)[1], y)[1]


def loss_and_grads(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, list[np.ndarray]]:
    """Mean softmax cross-entropy over the batch and its gradients (float32)."""
    w2 = params[2]
    hidden, logits = forward(params, x)
    probs, mean = _probs_and_loss(logits, y)
    n = len(x)
    d_logits = probs
    d_logits[np.arange(n), y] -= 1.0
    d_logits /= n
    g_w2 = hidden.T @ d_logits
    g_b2 = d_logits.sum(0)
    d_hidden = (d_logits @ w2.T) * (hidden > 0)
    g_w1 = x.T @ d_hidden
    g_b1 = d_hidden.sum(0)
    return mean, [g.astype(np.float32) for g in (g_w1, g_b1, g_w2, g_b2)]


def accuracy(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float((forward(params, x)[1].argmax(1) == y).mean())


def batch_indices(step: int, rank: int, num_workers: int, train_size: int, seed: int = 0) -> np.ndarray:
    """Worker ``rank``'s minibatch at ``step``: disjoint across workers, reshuffled every epoch."""
    per_step = BATCH_PER_WORKER * num_workers
    steps_per_epoch = train_size // per_step
    epoch, within = divmod(step, steps_per_epoch)
    order = np.random.default_rng(seed + epoch).permutation(train_size)
    start = within * per_step + rank * BATCH_PER_WORKER
    return order[start:start + BATCH_PER_WORKER]


def flatten(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([a.ravel() for a in arrays])


def unflatten(flat: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    out, offset = [], 0
    for a in like:
        out.append(flat[offset:offset + a.size].reshape(a.shape).astype(np.float32))
        offset += a.size
    return out


def train_reference(steps: int, num_workers: int, seed: int = 0) -> dict:
    """One process, float32 gradients of the union of the workers' minibatches."""
    data = load_digits_dataset(seed)
    params = init_params(seed)
    loss = float("nan")
    for step in range(steps):
        idx = np.concatenate([batch_indices(step, r, num_workers, len(data.x_train), seed)
                              for r in range(num_workers)])
        loss, grads = loss_and_grads(params, data.x_train[idx], data.y_train[idx])
        params = [p - LEARNING_RATE * g for p, g in zip(params, grads)]
    return {"loss": loss, "test_loss": loss_and_grads(params, data.x_test, data.y_test)[0],
            "test_accuracy": accuracy(params, data.x_test, data.y_test)}


def transfer_stats(worker) -> dict:
    """Packets and retransmissions of the worker's transport so far."""
    stats = worker.transport.stats
    return {"packets_sent": stats.packets_sent, "retransmissions": stats.retransmissions}


def train_worker(config_path: str, steps: int, seed: int = 0, report_every: int = 1, quiet: bool = False) -> dict:
    """One worker of the job described by ``config_path``; returns its final metrics."""
    from netagg.hoststack.kv import KVWorker
    from netagg.jobconfig import WorkerConfig

    config = WorkerConfig.load(config_path)
    data = load_digits_dataset(seed)
    params = init_params(seed)
    worker = KVWorker(config)
    started = time.perf_counter()
    loss = float("nan")
    try:
        for step in range(steps):
            # The whole job's rank and size (a job over a tree of switches: not its leaf segment's).
            idx = batch_indices(step, config.global_rank, config.total_workers, len(data.x_train), seed)
            loss, grads = loss_and_grads(params, data.x_train[idx], data.y_train[idx])
            total = worker.allreduce(flatten(grads))
            mean = unflatten(total / config.total_workers, params)
            params = [p - LEARNING_RATE * g for p, g in zip(params, mean)]
            if not quiet and step % report_every == 0 and config.global_rank == 0:
                print(json.dumps({"step": step, "loss": round(loss, 4), **transfer_stats(worker)}), flush=True)
        result = {"rank": config.global_rank, "steps": steps, "loss": loss,
                  "test_loss": loss_and_grads(params, data.x_test, data.y_test)[0],
                  "test_accuracy": accuracy(params, data.x_test, data.y_test),
                  "seconds": time.perf_counter() - started,
                  "param_checksum": float(sum(float(np.abs(p).sum()) for p in params)),
                  "param_digest": hashlib.sha256(flatten(params).astype(np.float32).tobytes()).hexdigest(),
                  **transfer_stats(worker)}
    finally:
        worker.close()
    print(json.dumps({"final": result}), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="this worker's YAML (from `netagg job config JOB --rank R`)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", type=int, metavar="NUM_WORKERS",
                        help="run the single-process float32 reference for NUM_WORKERS workers instead")
    parser.add_argument("--report-every", type=int, default=1, help="print progress every N steps (rank 0)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.reference:
        print(json.dumps({"reference": train_reference(args.steps, args.reference, args.seed)}))
        return 0
    if not args.config:
        parser.error("--config is required (or --reference N)")
    train_worker(args.config, args.steps, args.seed, report_every=args.report_every, quiet=args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
