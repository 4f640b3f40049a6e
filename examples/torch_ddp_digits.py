"""PyTorch DistributedDataParallel on scikit-learn's digits, gradients summed by netagg via a comm hook.

    python examples/torch_ddp_digits.py --config rank0.yaml --master 127.0.0.1:29600 --steps 50

Every rank runs this with its own config (``netagg job config JOB --rank R``); the
``--master`` address is only for torch's process group (DDP's initial broadcast).
``--hook none`` uses DDP's own Gloo allreduce instead, for comparison.
Prints one JSON line with the final loss, test accuracy and a parameter checksum.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from netagg.hoststack.ddp_hook import NetaggHookState, netagg_allreduce_hook
from netagg.hoststack.kv import KVWorker
from netagg.jobconfig import WorkerConfig

BATCH = 32


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--master", required=True, help="HOST:PORT for torch.distributed's rendezvous")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--hook", choices=("netagg", "none"), default="netagg")
    args = parser.parse_args(argv)
    from sklearn.datasets import load_digits

    config = WorkerConfig.load(args.config)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=config.rank,
                            world_size=config.num_workers, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    train, test = slice(0, 1400), slice(1400, None)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    worker = None
    if args.hook == "netagg":
        worker = KVWorker(config)
        state = NetaggHookState(worker)
        model.register_comm_hook(state, netagg_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    loss = torch.tensor(float("nan"))
    for _ in range(args.steps):
        batch = rng.choice(1400, size=BATCH * config.num_workers, replace=False)
        mine = torch.as_tensor(batch[config.rank * BATCH:(config.rank + 1) * BATCH])
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x[train][mine]), y[train][mine])
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item()
        checksum = float(sum(p.abs().sum().item() for p in model.parameters()))
    result = {"rank": config.rank, "loss": float(loss), "test_accuracy": accuracy, "param_checksum": checksum,
              "buckets_through_netagg": state.buckets if worker else 0}
    if worker is not None:
        worker.close()
    dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
