"""Steps to a target loss for each MLfabric update rule at a few learning rates: no network, no processes.

``python -m benchmarks.mlfabric_lr_sweep [--hidden 4096] [--target-loss 0.2]`` trains
examples/mlp_digits.py's MLP in one process, the way each kind of the convergence benchmark
updates the model, so that every kind can be run at a learning rate that suits it:

* ``sync``: each round the mean of the workers' gradients (``--workers``, 4), ``w -= lr * mean``;
* ``async``: one gradient at a time, computed on the model ``delay`` updates old,
  ``w -= lr * g`` (the workers taking turns, delay workers - 1: what plain async sees on the cluster);
* ``gang``: each round the sum of k gradients of the same model, ``w -= lr * sum``.

Prints, per rule and learning rate, the updates (rounds or gradients) and the gradients it
took to reach the target loss over the whole training set (``-`` if not within the cap).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks.mlfabric_worker import load_digits_fast, model_loss
from examples.mlp_digits import batch_indices, flatten, init_params, loss_and_grads, unflatten


class Trainer:
    """The model, the data and a worker's minibatch gradient, as in benchmarks/mlfabric_worker.py."""

    def __init__(self, hidden: int, seed: int = 0, workers: int = 4) -> None:
        self.workers = workers
        self.data = load_digits_fast(seed)
        self.like = init_params(seed, hidden=hidden)
        self.initial = flatten(self.like)
        self.seed = seed

    def grad(self, w: np.ndarray, step: int, rank: int) -> np.ndarray:
        idx = batch_indices(step, rank, self.workers, len(self.data.x_train), self.seed)
        _, grads = loss_and_grads(unflatten(w, self.like), self.data.x_train[idx], self.data.y_train[idx])
        return flatten(grads)

    def loss(self, w: np.ndarray) -> float:
        return model_loss(w, self.data, self.like)[0]


def rounds(trainer: Trainer, k: int, lr: float, mean: bool, target: float, cap: int) -> int | None:
    """Rounds of ``k`` gradients of one model (their mean or sum applied) until the loss is <= target."""
    w = trainer.initial.copy()
    for r in range(cap):
        total = np.sum([trainer.grad(w, r, i) for i in range(k)], axis=0)
        w -= np.float32(lr) * (total / k if mean else total)
        if trainer.loss(w) <= target:
            return r + 1
    return None


def stale(trainer: Trainer, lr: float, delay: int, target: float, cap: int) -> int | None:
    """Single gradients computed ``delay`` updates back, workers in turn, until the loss is <= target."""
    history = [trainer.initial.copy()]
    for t in range(cap):
        w = history[-1] - np.float32(lr) * trainer.grad(history[max(0, len(history) - 1 - delay)],
                                                        t // trainer.workers, t % trainer.workers)
        history = [*history[-delay:], w]
        if trainer.loss(w) <= target:
            return t + 1
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--target-loss", type=float, default=0.2)
    parser.add_argument("--cap", type=int, default=150, help="updates at most per run")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.00625, 0.0125, 0.025, 0.05, 0.1],
                        help="steps per gradient to try (sync: times the workers, on the mean)")
    parser.add_argument("--gang", type=int, nargs="+", default=[2, 3], help="group sizes of the gang rule")
    args = parser.parse_args(argv)
    w = args.workers
    trainer = Trainer(args.hidden, workers=w)
    print(f"MLP hidden {args.hidden}, {w} workers, target loss {args.target_loss}")
    print(f"{'rule':<22} {'lr':>7} {'updates':>7} {'gradients':>9}")
    runs = [(f"sync (mean of {w})", lr * w, lambda lr: rounds(trainer, w, lr, True, args.target_loss, args.cap), w)
            for lr in args.lrs]
    runs += [(f"async (delay {w - 1})", lr, lambda lr: stale(trainer, lr, w - 1, args.target_loss, args.cap), 1)
             for lr in args.lrs]
    runs += [(f"gang (sum of {k})", lr, lambda lr, k=k: rounds(trainer, k, lr, False, args.target_loss, args.cap), k)
             for k in args.gang for lr in args.lrs]
    for rule, lr, run, per_update in runs:
        updates = run(lr)
        shown = "-" if updates is None else str(updates)
        gradients = "-" if updates is None else str(updates * per_update)
        print(f"{rule:<22} {lr:>7} {shown:>7} {gradients:>9}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
