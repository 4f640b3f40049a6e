"""One MLfabric training worker (or the monitor) on examples/mlp_digits.py's MLP, as a process.

Worker: ``python -m benchmarks.mlfabric_worker --config rank.yaml --steps 200 [--compute-delay 0.2]``
trains with :func:`netagg.mlfabric.training.run_worker` (the job's config says sync/async,
schedule and replicas) and prints one JSON line: its :class:`WorkerReport`.

Monitor: ``python -m benchmarks.mlfabric_worker --monitor --config rank0.yaml --target-loss 0.3``
reads the PS's version every ``--interval`` seconds and, when it changed, the model (``stats`` with the
model; it never trains), prints ``{"t", "version", "loss", "accuracy"}`` lines — ``t`` counted from the
moment every worker had joined — and halts the job once the training loss reaches the
target (or after ``--max-seconds``). Last line: ``{"final": ...}`` with the time to target.
Run from the repository root (it imports ``examples.mlp_digits``).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from examples.mlp_digits import (
    Dataset,
    accuracy,
    batch_indices,
    flatten,
    init_params,
    load_digits_dataset,
    loss_and_grads,
    prepare_digits,
    unflatten,
)
from examples.mlp_digits import loss as training_loss
from netagg.jobconfig import WorkerConfig
from netagg.mlfabric.aggregation import AggregationService
from netagg.mlfabric.switch_sum import SwitchSummer
from netagg.mlfabric.training import run_worker
from netagg.mlfabric.worker import FabricClient


def load_digits_fast(seed: int = 0) -> Dataset:
    """``examples.mlp_digits.load_digits_dataset`` without importing scikit-learn (seconds per process).

    Reads the same file scikit-learn's ``load_digits`` reads (``sklearn/datasets/data/digits.csv.gz``)
    and prepares it the same way; falls back to the example's loader if the file is not there.
    """
    spec = importlib.util.find_spec("sklearn")
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / "datasets" / "data" / "digits.csv.gz" if locations else None
    if path is None or not path.exists():
        return load_digits_dataset(seed)
    with gzip.open(path, "rt") as f:
        raw = np.loadtxt(f, delimiter=",")
    return prepare_digits(raw[:, :-1], raw[:, -1], seed)


def model_loss(flat: np.ndarray, data, like: list[np.ndarray]) -> tuple[float, float]:
    """(training loss over the whole training set, test accuracy) of a flat model."""
    params = unflatten(flat, like)
    return training_loss(params, data.x_train, data.y_train), accuracy(params, data.x_test, data.y_test)


def train(args: argparse.Namespace) -> int:
    config = WorkerConfig.load(args.config)
    data = load_digits_fast(args.seed)
    like = init_params(args.seed, hidden=args.hidden)

    def grad_fn(flat: np.ndarray, step: int) -> tuple[float, np.ndarray]:
        idx = batch_indices(step, config.rank, config.training_workers, len(data.x_train), args.seed)
        loss, grads = loss_and_grads(unflatten(flat, like), data.x_train[idx], data.y_train[idx])
        return loss, flatten(grads)

    aggregation = None
    agg_address = None
    if config.schedule == "mlfabric":
        aggregation = AggregationService(lambda: FabricClient.from_config(config), config.job_id,
                                         (config.bind.host, 0), secret=config.secret).start()
        agg_address = (config.bind.host, aggregation.address[1])
    client = FabricClient.from_config(config, agg=agg_address, failover_timeout=args.failover_timeout)
    switch = SwitchSummer(config) if config.switch_aggregation else None
    distribution = WorkerConfig.load(args.model_config) if args.model_config else None
    try:
        report = run_worker(client, grad_fn, flatten(like), steps=args.steps, schedule=config.schedule,
                            compute_delay=args.compute_delay, max_seconds=args.max_seconds, switch=switch,
                            distribution=distribution, local_wait=args.local_wait)
        result = asdict(report)
        if args.final_accuracy:
            _, model = client.stats(model=True)
            assert model is not None
            result["final_loss"], result["final_accuracy"] = model_loss(model, data, like)
        if aggregation is not None:
            result["aggregator"] = asdict(aggregation.stats)
    finally:
        client.close()
        if aggregation is not None:
            aggregation.stop()
        if switch is not None:
            switch.close()
    print(json.dumps(result), flush=True)
    return 0


def monitor(args: argparse.Namespace) -> int:
    config = WorkerConfig.load(args.config)
    data = load_digits_fast(args.seed)
    like = init_params(args.seed, hidden=args.hidden)
    client = FabricClient.from_config(config, failover_timeout=args.failover_timeout, observer=True)
    reached = None
    t = 0.0
    last: dict = {}
    evaluated = None
    try:
        while True:
            # The model is fetched and evaluated only when its version changed: the monitor shares the cluster's
            # cores with what it measures (every 0.1 s, the whole model and a pass over the training set took
            # most of a core of the 2-core machine).
            stats, _ = client.stats()
            started = stats.get("started_at")
            model = None
            if started is not None and stats.get("version") != evaluated:
                stats, model = client.stats(model=True)
            if started is not None:
                t = time.monotonic() - started
            if model is not None:
                evaluated = stats.get("version")
                loss, acc = model_loss(model, data, like)
                last = {"t": round(t, 3), "version": stats["version"], "loss": round(loss, 4),
                        "accuracy": round(acc, 4)}
                print(json.dumps(last), flush=True)
                if reached is None and loss <= args.target_loss:
                    reached = t
                    break
            if t > args.max_seconds:
                break
            time.sleep(args.interval)
        client.halt()
        stats, _ = client.stats()
    finally:
        client.close()
    print(json.dumps({"final": {"time_to_target": reached, "target_loss": args.target_loss, **last,
                                "stats": stats["stats"], "max_delay": stats["max_delay"],
                                "scheduler": stats.get("scheduler"),
                                "distribution": stats.get("distribution"),
                                "switch_member": stats.get("switch_member")}}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP (wider: a larger model)")
    parser.add_argument("--model-config", help="this worker's rank in the job's distribution job: start steps "
                        "from model versions the PS sends through the switch")
    parser.add_argument("--local-wait", type=float, default=0.05, help="with --model-config: how long a step waits "
                        "for a version through the switch before it pulls (about one model's transfer time)")
    parser.add_argument("--failover-timeout", type=float, default=30.0)
    parser.add_argument("--monitor", action="store_true", help="watch the loss and halt the job at the target")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compute-delay", type=float, default=0.0, help="extra seconds per step (a slow worker)")
    parser.add_argument("--max-seconds", type=float, default=None)
    parser.add_argument("--final-accuracy", action="store_true", help="report the PS model's accuracy at the end")
    parser.add_argument("--target-loss", type=float, default=0.3)
    parser.add_argument("--interval", type=float, default=0.25)
    args = parser.parse_args(argv)
    if args.monitor:
        if args.max_seconds is None:
            args.max_seconds = 120.0
        return monitor(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
