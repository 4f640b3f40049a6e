"""DistributedDataParallel under ``torchrun`` with the ``netagg`` process-group backend.

    export NETAGG_TOKEN=demo-tenant-token NETAGG_CONFIG=configs/controller.yaml
    torchrun --standalone --nproc_per_node 2 examples/torchrun_ddp.py --steps 30

The script is an ordinary DDP script: ``import netagg.torch_backend`` registers the
backend, and ``init_process_group("netagg")`` makes DDP's gradient allreduce go through the
switch (``--backend gloo`` runs the same training on Gloo, for comparison). Each rank prints
one JSON line (loss, parameter checksum, the netagg job it used); ``--save DIR`` also writes
every rank's final parameters to ``DIR/rank<R>.pt`` and its JSON line to ``DIR/rank<R>.json``.

``--amp`` trains with mixed precision: autocast (bfloat16) and ``torch.amp.GradScaler`` with a scale
that grows every step until the gradients overflow. A rank whose gradients overflow puts inf/NaN into
DDP's allreduce, every rank sees it in the sum (docs/protocol.md, "Non-finite values"), and every rank's
scaler skips that step and halves the scale: the JSON line lists the skipped steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import netagg.torch_backend  # registers the "netagg" backend

BATCH = 32


def other_collectives(rank: int, world: int, device: torch.device) -> dict[str, float]:
    """Collectives besides DDP's: half-precision SUM/AVG (through netagg), the rest (delegated to Gloo)."""
    half = torch.full((100,), float(rank + 1), dtype=torch.float16, device=device)
    dist.all_reduce(half, op=dist.ReduceOp.AVG)
    brain = torch.full((100,), float(rank + 1), dtype=torch.bfloat16, device=device)
    dist.all_reduce(brain)
    biggest = torch.tensor([float(rank)])
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
    count = torch.tensor([rank + 1])
    dist.all_reduce(count)
    root = torch.tensor([float(rank + 10)])
    dist.broadcast(root, src=0)
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    dist.barrier()
    return {"fp16_avg": half.float().mean().item(), "bf16_sum": brain.float().mean().item(),
            "max": biggest.item(), "int_sum": count.item(), "broadcast": root.item(),
            "all_gather": [g.item() for g in gathered]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("netagg", "gloo"), default="netagg")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save", type=Path, help="directory for each rank's final parameters")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model trains")
    parser.add_argument("--amp", action="store_true", help="autocast (bfloat16) and a GradScaler that overflows")
    args = parser.parse_args(argv)

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device)
    torch.manual_seed(0)  # the same data and initial model on every rank and backend
    inputs = torch.randn(2048, 32)
    labels = (inputs @ torch.randn(32, 4)).argmax(1)
    inputs, labels = inputs.to(device), labels.to(device)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(device))
    # --amp: the loss is taken 2**16 times larger (and the learning rate 2**16 times smaller: the same steps) so
    # that the gradients overflow float32 once the scale passes about 2**110; rank 0's 8 times more, so that its
    # gradients overflow alone: the other ranks learn of it from the allreduce only.
    boost = 2.0 ** 16 if args.amp else 1.0
    weight = 8.0 if args.amp and rank == 0 else 1.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 / boost, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    loss = torch.tensor(float("nan"))
    # A scale that doubles every step: from about step 10 on, a rank's gradients overflow every few steps.
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 100, growth_interval=1, enabled=args.amp)
    skipped = []
    for step in range(args.steps):
        batch = torch.randperm(len(inputs), generator=generator)[:BATCH * world]
        mine = batch[rank * BATCH:(rank + 1) * BATCH].to(device)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = nn.functional.cross_entropy(model(inputs[mine]), labels[mine])
        scaler.scale(loss * (boost * weight)).backward()
        scale = scaler.get_scale() if args.amp else 1.0
        scaler.step(optimizer)
        scaler.update()
        if args.amp and scaler.get_scale() < scale:  # the scaler found inf/NaN in the (allreduced) gradients
            skipped.append(step)
    params = {name: p.detach().cpu().clone() for name, p in model.module.named_parameters()}
    result = {"rank": rank, "world": world, "backend": dist.get_backend(), "loss": loss.item(), "skipped": skipped,
              "collectives": other_collectives(rank, world, device),
              "param_checksum": float(sum(p.double().abs().sum() for p in params.values())),
              "netagg": netagg.torch_backend.job_info() if args.backend == "netagg" else None}
    dist.destroy_process_group()
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
        torch.save(params, args.save / f"rank{rank}.pt")
        (args.save / f"rank{rank}.json").write_text(json.dumps(result))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
