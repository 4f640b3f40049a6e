"""A PyTorch DistributedDataParallel communication hook that sums gradient buckets through netagg.

No patching of torch: DDP calls the hook for every gradient bucket instead of its own
allreduce; the hook hands the bucket to a :class:`~netagg.hoststack.kv.KVWorker`, whose
switch (or PS in fallback mode) returns the sum over all workers, and divides by the
world size as DDP's default hook does::

    worker = KVWorker(WorkerConfig.load("rank0.yaml"))
    model = DistributedDataParallel(net)              # a (gloo) process group must exist
    model.register_comm_hook(NetaggHookState(worker), netagg_allreduce_hook)

DDP still uses its process group for what is not gradient traffic (the initial
parameter broadcast), so ``torch.distributed.init_process_group`` is called as usual.

A job created with ``--deadline-ms`` sums its buckets as deadline allreduces (docs/hoststack.md,
"Deadline allreduce"): a step does not wait for a late worker more than the deadline, and the late
worker's gradient values join the same bucket's sum in the next step (each bucket is its own collective,
tagged by its index).

torch is an optional dependency (``pip install torch==2.13.0``).
"""

from dataclasses import dataclass

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
import numpy as np
import torch
import torch.distributed as dist

from netagg.hoststack.kv import KVWorker


@dataclass
class NetaggHookState:
    """What the hook needs: the job's KVWorker; ``buckets`` counts the buckets it reduced."""

    worker: KVWorker
    buckets: int = 0


def netagg_allreduce_hook(state: NetaggHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the job's workers through netagg (sum in the network, then / N)."""
    buffer = bucket.buffer()
    gradients = buffer.detach().to(torch.float32).cpu().numpy()
    total = state.worker.allreduce(np.ascontiguousarray(gradients), tag=bucket.index(),
                                   deadline=state.worker.job_deadline)
    averaged = torch.from_numpy(np.asarray(total, dtype=np.float32) / state.worker.num_workers)
    state.buckets += 1
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(averaged.to(dtype=buffer.dtype, device=buffer.device).reshape(buffer.shape))
    return future
