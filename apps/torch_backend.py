"""A ``torch.distributed`` backend named ``netagg``: floating-point sums go through the switch.

Importing this module registers the backend; then any training script works unchanged::

    import netagg.torch_backend  # noqa: F401  (registers the "netagg" backend)
    torch.distributed.init_process_group("netagg")

``all_reduce`` with ``SUM`` or ``AVG`` on one float32/float16/bfloat16 tensor is summed by
netagg (:meth:`KVWorker.allreduce`; AVG divides by the world size). Every other collective
and op (broadcast, all_gather, reduce_scatter, barrier, MAX, integer tensors, ...) runs on an
internal Gloo backend over the same store. CUDA tensors are copied through host memory.

Job lifecycle: every rank binds a UDP port and publishes ``ip:port`` in the torch store;
rank 0 asks the controller for a job over these addresses and hands each rank its worker
config (secret included) through the store. Rank 0 renews the job's lease while the group
lives and deletes the job on ``destroy_process_group`` (or at interpreter exit); if the
processes die, the lease runs out and the controller reclaims the job.

Environment (the ``netagg`` CLI's variables where they exist):

=======================  ====================================================================
``NETAGG_TOKEN``         tenant token (required)
``NETAGG_SOCKET``        controller API socket; default: ``api_socket`` of ``NETAGG_CONFIG``
``NETAGG_CONFIG``        controller YAML (default ``configs/controller.yaml``)
``NETAGG_SLOTS``         aggregation slots to ask for (default: the controller sizes them to the links)
``NETAGG_PS``            parameter server for fallback mode (a configured name or HOST:PORT)
``NETAGG_LEASE``         lease in seconds, renewed by rank 0 every third of it (default 30)
``NETAGG_WORKER_HOST``   this rank's IPv4 address toward the switch (default: the address that
                         routes to ``MASTER_ADDR``, else 127.0.0.1)
``NETAGG_JOB_NAME``      the job's name at the controller (default ``torch``)
``NETAGG_THREADS``       the job's processes per rank, each over its share of the slots (rank 0 asks the
                         controller; default 1; docs/hoststack.md, "A worker over several cores")
=======================  ====================================================================
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import logging
import os
import socket
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

from netagg import dataplane as dp
from netagg.hoststack.kv import KVWorker
from netagg.jobconfig import WorkerConfig

__all__ = ["BACKEND", "NetaggProcessGroup", "job_info"]

log = logging.getLogger(__name__)

BACKEND = "netagg"
#: Dtypes summed through the switch (as float32 on the wire).
NETAGG_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DEFAULT_CONFIG = dp.REPO_ROOT / "configs" / "controller.yaml"  # as the `netagg` CLI
#: How long rank 0 waits at shutdown for the other ranks to finish before it deletes the job.
_SHUTDOWN_WAIT = timedelta(seconds=30)


class NetaggBackendError(RuntimeError):
    """The backend cannot start (controller unreachable, refused, or misconfigured)."""


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    try:
        return int(text) if text else default
    except ValueError:
        raise NetaggBackendError(f"{name}: expected an integer, got {text!r}") from None


def _api_client() -> Any:
    """The controller's API client, found as the ``netagg`` CLI finds it (NETAGG_SOCKET/CONFIG/TOKEN)."""
    from netagg.controller.api import ApiClient
    from netagg.controller.config import load_config

    token = os.environ.get("NETAGG_TOKEN")
    if not token:
        raise NetaggBackendError("netagg backend: no tenant token (set NETAGG_TOKEN)")
    socket_path = os.environ.get("NETAGG_SOCKET") or \
        load_config(Path(os.environ.get("NETAGG_CONFIG", _DEFAULT_CONFIG))).api_socket
    return ApiClient(socket_path, token)


def _worker_ip() -> str:
    """This rank's IPv4 address toward the switch (see the module docstring)."""
    configured = os.environ.get("NETAGG_WORKER_HOST", "").strip()
    if configured:
        return configured
    master = os.environ.get("MASTER_ADDR", "").strip()
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))  # no packet is sent: this only picks the route
            return probe.getsockname()[0]
    return "127.0.0.1"


def _bind_port(host: str) -> socket.socket:
    """A UDP socket on a free port of ``host``, held and then handed to the worker (never closed and rebound)."""
    try:
        ipaddress.IPv4Address(host)
        bind_host = host
    except ValueError:  # a configured host name: the controller's config carries its address
        bind_host = "0.0.0.0"
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((bind_host, 0))
    return sock


class _DoneWork(dist.Work):
    """A Work whose result is (or will be) a list of tensors, backed by a torch future."""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._future.wait()  # raises the collective's error, if any
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list[torch.Tensor]:
        return self._future.wait()


class NetaggProcessGroup(dist.ProcessGroup):
    """The ``netagg`` process group: allreduce SUM/AVG of floats through netagg, the rest through Gloo."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._store = store
        self._timeout = timeout
        self._gloo = ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, timeout)
        # Collectives this class does not override reach the Gloo backend through ProcessGroup.
        for device in ("cpu", "cuda"):
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self.worker: KVWorker | None = None
        self._client: Any = None  # rank 0: the controller's API client while the job lives
        #: What rank 0 got from the controller: job_id, mode, admission, reason, message.
        self.info: dict[str, Any] = {}
        #: Allreduces that went through netagg.
        self.netagg_allreduces = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="netagg-pg")
        #: CUDA device -> the stream the sums are copied back on (``_reduce_cuda``).
        self._side_streams: dict[torch.device, Any] = {}
        self._closed = False
        self._stop_renewing = threading.Event()
        self._start_job()
        ref = weakref.ref(self)
        self._atexit = lambda: (pg := ref()) is not None and pg.shutdown()
        atexit.register(self._atexit)

    # -- job lifecycle -------------------------------------------------------------
    def _start_job(self) -> None:
        rank, size = self.rank(), self.size()
        ip = _worker_ip()
        held = _bind_port(ip)
        try:
            self._store.set(f"netagg/addr/{rank}", f"{ip}:{held.getsockname()[1]}")
            if rank == 0:
                self._create_job(size)
            plan = json.loads(self._store.get("netagg/plan").decode())
            if "error" in plan:
                raise NetaggBackendError(f"netagg backend (rank 0 could not start the job): {plan['error']}")
            self.info = plan
            text = self._store.get(f"netagg/config/{rank}").decode() if plan["mode"] != "gloo" else ""
            if text:  # the worker takes the socket it reported: its port was never free for another one
                self.worker = KVWorker(WorkerConfig.from_dict(yaml.safe_load(text), f"netagg job {plan['job_id']}"),
                                       sock=held)
        finally:
            if self.worker is None:
                held.close()
        if rank == 0 and plan.get("message"):
            log.warning("%s", plan["message"])

    def _create_job(self, size: int) -> None:
        """Rank 0: ask the controller for the job; publish the plan and every rank's config."""
        plan: dict[str, Any]
        try:
            from netagg.controller.api import ApiError

            client = _api_client()
            workers = [self._store.get(f"netagg/addr/{r}").decode() for r in range(size)]
            ps = os.environ.get("NETAGG_PS", "").strip() or None
            asked = {"slots": _env_int("NETAGG_SLOTS", 0)} if os.environ.get("NETAGG_SLOTS", "").strip() else {}
            lease = float(_env_int("NETAGG_LEASE", 30))
            try:
                created = client.call("create", name=os.environ.get("NETAGG_JOB_NAME", "torch"), workers=workers,
                                      mode="allreduce", ps=ps, lease_seconds=lease,
                                      threads=_env_int("NETAGG_THREADS", 1), **asked)
            except ApiError as err:
                if err.code != "capacity_exhausted":
                    raise
                plan = {"mode": "gloo", "job_id": None, "admission": "none", "reason": str(err),
                        "message": f"netagg: the switch has no free slots and no parameter server is configured "
                                   f"(NETAGG_PS): allreduce is delegated to Gloo ({err})"}
            else:
                job = created["job"]
                plan = {"mode": job["mode"], "job_id": job["job_id"], "admission": created["admission"],
                        "reason": created["reason"], "slots": job["slot_count"], "message": ""}
                if created["admission"] == "partial":
                    plan["message"] = (f"netagg: job {job['job_id']} got {job['slot_count']} of "
                                       f"{job.get('slots_wanted', '?')} slots ({created['reason']})")
                elif created["admission"] == "fallback":
                    plan["message"] = f"netagg: job {job['job_id']} runs in fallback mode ({created['reason']})"
                for r in range(size):
                    self._store.set(f"netagg/config/{r}", client.call("config", job_id=job["job_id"], rank=r))
                self._client = client
                threading.Thread(target=self._renew, args=(client, job["job_id"], lease), daemon=True,
                                 name="netagg-lease").start()
        except Exception as err:
            self._store.set("netagg/plan", json.dumps({"error": str(err)}))
            raise
        self._store.set("netagg/plan", json.dumps(plan))

    def _renew(self, client: Any, job_id: int, lease: float) -> None:
        while not self._stop_renewing.wait(lease / 3):
            try:
                client.call("renew", job_id=job_id)
            except Exception as err:  # the next renewal may succeed; the lease covers a few misses
                log.warning("netagg: cannot renew the lease of job %d: %s", job_id, err)

    def shutdown(self) -> None:
        """Close the worker; rank 0 waits for the others (bounded) and deletes the job. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        self._executor.shutdown(wait=True)
        if self.worker is not None:
            self.worker.close()
        job_id = self.info.get("job_id")
        if job_id is not None:
            with contextlib.suppress(Exception):
                self._store.set(f"netagg/done/{self.rank()}", "1")
            if self.rank() == 0:
                self._stop_renewing.set()
                with contextlib.suppress(Exception):
                    self._store.wait([f"netagg/done/{r}" for r in range(self.size())], _SHUTDOWN_WAIT)
                try:
                    self._client.call("delete", job_id=job_id)
                except Exception as err:  # the lease reclaims it
                    log.warning("netagg: cannot delete job %s (its lease will expire): %s", job_id, err)
        with contextlib.suppress(Exception):
            self._gloo.shutdown()

    # -- collectives -----------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor] | torch.Tensor, opts: Any = None) -> dist.Work:
        """SUM/AVG of one float tensor through netagg; anything else through Gloo."""
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None:
            opts = dist.AllreduceOptions()
        op = opts.reduceOp
        is_avg = op == dist.ReduceOp.AVG
        if not (is_avg or op == dist.ReduceOp.SUM) or len(tensors) != 1 or tensors[0].is_sparse \
                or tensors[0].dtype not in NETAGG_DTYPES:
            return self._gloo.allreduce(tensors, opts)
        if self.worker is None:
            return self._gloo_sum(tensors, is_avg)
        tensor = tensors[0]
        if tensor.is_cuda:
            return self._allreduce_cuda(tensor, is_avg)
        future: torch.futures.Future = torch.futures.Future()
        values = tensor.detach().to(device="cpu", dtype=torch.float32, copy=True).numpy()
        self._executor.submit(self._reduce, tensor, values, is_avg, future)
        return _DoneWork(future)

    def _allreduce_cuda(self, tensor: torch.Tensor, is_avg: bool) -> dist.Work:
        """A CUDA tensor without blocking the caller: the copy to pinned host memory is queued on the caller's
        stream, the background thread runs the exchange once that copy is done, and copies the sum back on a
        side stream. The future is a CUDA-aware ``torch.futures.Future``: it records that stream's work, and
        whoever waits on it (``Work.wait``, DDP's callbacks) has its current stream wait for the copy."""
        device = tensor.device
        host = torch.empty(tensor.shape, dtype=torch.float32, pin_memory=True)
        with torch.no_grad():
            host.copy_(tensor.detach().to(torch.float32), non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(device))
        future: torch.futures.Future = torch.futures.Future(devices=[device])
        self._executor.submit(self._reduce_cuda, tensor, host, copied, is_avg, future)
        return _DoneWork(future)

    def _reduce_cuda(self, tensor: torch.Tensor, host: torch.Tensor, copied: Any, is_avg: bool,
                     future: torch.futures.Future) -> None:
        try:
            assert self.worker is not None
            copied.synchronize()  # the values are in host memory
            total = np.asarray(self.worker.allreduce(host.numpy()), dtype=np.float32)
            if is_avg:
                total /= self.size()
            host.copy_(torch.from_numpy(total).reshape(host.shape))  # pinned again: the copy back is async
            stream = self._side_streams.get(device := tensor.device)
            if stream is None:
                stream = self._side_streams[device] = torch.cuda.Stream(device)
            with torch.cuda.stream(stream), torch.no_grad():
                tensor.copy_(host, non_blocking=True)
                self.netagg_allreduces += 1
                future.set_result([tensor])  # records an event on the side stream for the waiters
        except BaseException as err:
            future.set_exception(err)

    def _reduce(self, tensor: torch.Tensor, values: np.ndarray, is_avg: bool, future: torch.futures.Future) -> None:
        try:
            assert self.worker is not None
            total = np.asarray(self.worker.allreduce(values), dtype=np.float32)
            if is_avg:
                total /= self.size()
            with torch.no_grad():
                tensor.copy_(torch.from_numpy(total).reshape(tensor.shape))
            self.netagg_allreduces += 1
            future.set_result([tensor])
        except BaseException as err:
            future.set_exception(err)

    def _gloo_sum(self, tensors: list[torch.Tensor], is_avg: bool) -> dist.Work:
        """Without a switch job: Gloo's SUM (Gloo has no AVG, so divide here)."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        work = self._gloo.allreduce(tensors, options)
        if not is_avg:
            return work
        work.wait()
        with torch.no_grad():
            tensors[0].div_(self.size())
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(tensors)
        return _DoneWork(future)


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> NetaggProcessGroup:
    return NetaggProcessGroup(store, rank, size, timeout)


def job_info(group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """The netagg job behind ``group`` (default: the world): job_id, mode, admission, netagg_allreduces."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, NetaggProcessGroup):
        return {"mode": "not netagg", "job_id": None}
    return {**{k: v for k, v in pg.info.items() if k != "message"}, "netagg_allreduces": pg.netagg_allreduces}


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
