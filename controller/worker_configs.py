"""What each rank of a job runs with: its ``WorkerConfig``, rendered from the job's record and the controller's
configuration (``netagg job config``; the service checks the caller owns the job)."""

from __future__ import annotations

from netagg.controller.config import ControllerConfig
from netagg.controller.errors import ServiceError
from netagg.controller.fabric import Fabric
from netagg.controller.store import JobRecord
from netagg.controller.topology import TreeWorker
from netagg.controller.topology import worker_config as tree_worker_config
from netagg.jobconfig import Endpoint, WorkerConfig


def requested(config: ControllerConfig, fabric: Fabric, job: JobRecord, dist: JobRecord | None,
              served: JobRecord | None, rank: int | None, distribution: bool = False,
              ps_node: int | None = None) -> WorkerConfig:
    """Rank ``rank``'s config of the job; with ``distribution``, of its distribution job: a worker's
    (``rank``, the same rank as in the job) or a PS node's (``ps_node``: 0 the primary, then the
    replicas in order; the distribution job's rank ``workers + ps_node``). ``ps_node`` alone: that PS
    node's rank in the job's own switch groups (a job created with ``switch_ps``)."""
    def bad(message: str) -> ServiceError:
        return ServiceError("invalid_argument", message)

    if not isinstance(distribution, bool):
        raise bad(f"distribution must be true or false, got {distribution!r}")
    for what, value in (("rank", rank), ("ps node", ps_node)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise bad(f"{what} must be an integer, got {value!r}")
    if not distribution:
        if ps_node is not None:
            if rank is not None:
                raise bad("one of --rank (a worker) or --ps-node (a PS node)")
            if not job.ps_members:
                raise bad(f"job {job.job_id}'s PS nodes are no ranks of it (create it with --switch-ps); "
                          "their ranks in its distribution job: --distribution --ps-node")
            if not 0 <= ps_node < job.ps_members:
                raise ServiceError("not_found", f"job {job.job_id} has PS nodes 0..{job.ps_members - 1} (0: the "
                                   f"primary, then the replicas), got {ps_node}")
            return config_of(config, fabric, job, len(job.workers) - job.ps_members + ps_node)
        if rank is None:
            raise bad("a worker config needs --rank")
        return config_of(config, fabric, job, rank)
    if dist is None:
        raise ServiceError("not_found", f"job {job.job_id} has no distribution job" + (
            f" (it is the distribution job of job {served.job_id}: ask for its ranks directly, or "
            f"`job config {served.job_id} --distribution`)" if served else
            " (create the job with --distribution)"))
    if (rank is None) == (ps_node is None):
        raise bad("--distribution needs one of --rank (a worker) or --ps-node (a PS node)")
    nodes = dist.senders
    receivers = len(dist.workers) - nodes
    if ps_node is not None:
        if not 0 <= ps_node < nodes:
            raise ServiceError("not_found", f"job {job.job_id} has PS nodes 0..{nodes - 1} (0: the primary, "
                               f"then the replicas), got {ps_node}")
        return config_of(config, fabric, dist, receivers + ps_node)
    if not 0 <= rank < receivers:
        raise ServiceError("not_found", f"job {job.job_id} has no worker rank {rank} (ranks 0..{receivers - 1}; "
                           "the PS nodes' configs: --ps-node)")
    return config_of(config, fabric, dist, rank)


def config_of(config: ControllerConfig, fabric: Fabric, job: JobRecord, rank: int) -> WorkerConfig:
    """Rank ``rank``'s config of ``job``: under a topology its leaf's segment, else the one switch's (or, in
    fallback mode, the PS's) endpoint and the job's slots."""
    worker = next((w for w in job.workers if w.rank == rank), None)
    if worker is None:
        raise ServiceError("not_found", f"job {job.job_id} has no rank {rank} "
                           f"(ranks 0..{len(job.workers) - 1})")
    if config.topology is not None and job.uses_switch:  # its leaf's segment; no PS to fail over to
        return tree_worker_config(config.topology, fabric.plan(job), fabric.allocations(job),
                                  TreeWorker(worker.rank, worker.host, worker.udp_port), len(job.workers),
                                  tenant=job.tenant, secret=job.secret, threads=job.threads)
    ps = Endpoint(job.ps.ip, job.ps.udp_port) if job.ps else None
    aggregator = ps if job.mode == "fallback" else Endpoint(config.aggregator_ip,
                                                              config.aggregator_port)
    return WorkerConfig(job_id=job.job_id, rank=rank, num_workers=len(job.workers),
                        slot_count=job.slot_count, mode=job.mode, aggregator=aggregator,
                        bind=Endpoint(worker.ip, worker.udp_port), ps=ps, tenant=job.tenant,
                        update_mode=job.update_mode, delay_bound=job.delay_bound, schedule=job.schedule,
                        replicas=tuple(Endpoint(r.ip, r.udp_port) for r in job.replicas), secret=job.secret,
                        switch_aggregation=job.switch_aggregation, senders=job.senders, threads=job.threads,
                        ps_members=job.ps_members, width=job.width, deadline_ms=job.deadline_ms,
                        generation=job.generation)
