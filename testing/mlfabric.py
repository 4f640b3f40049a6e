"""Helpers for tests and benchmarks: MLfabric jobs on loopback, PS and worker processes.

``configs = loopback_configs(4, update_mode="async", delay_bound=4)`` gives one config
per rank (PS and replicas on free loopback TCP ports, a fresh job secret unless
``secret=""``); :func:`write_configs` saves them as YAML; :func:`start_ps` runs a PS node
as a process and waits until it listens; :func:`start_workers` runs the MLP workers of
``benchmarks/mlfabric_worker.py``; :func:`collect` gathers their JSON reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from netagg import dataplane as dp
from netagg import jobsecret
from netagg.jobconfig import Endpoint, WorkerConfig
from netagg.localports import free_ports

LOCALHOST = "127.0.0.1"
WORKER_COMMAND = (sys.executable, "-m", "benchmarks.mlfabric_worker")
PS_COMMAND = (sys.executable, "-m", "netagg.mlfabric.async_server")


def loopback_configs(num_workers: int, *, update_mode: str = "async", delay_bound: int | None = None,
                     schedule: str = "fifo", replicas: int = 0, job_id: int = 1,
                     secret: str | None = None) -> list[WorkerConfig]:
    """One config per rank of a ps-mode job whose PS chain listens on loopback.

    The job gets ``secret``, by default a fresh one (as the controller gives every job); "" for none.
    """
    secret = jobsecret.new_secret() if secret is None else secret
    ports = free_ports(1 + replicas + num_workers, "both")  # PS nodes listen on TCP; workers may bind either
    ps, chain, binds = Endpoint(LOCALHOST, ports[0]), ports[1:1 + replicas], ports[1 + replicas:]
    return [WorkerConfig(job_id=job_id, rank=rank, num_workers=num_workers, slot_count=1, mode="ps",
                         aggregator=Endpoint(LOCALHOST, 9), bind=Endpoint(LOCALHOST, binds[rank]), ps=ps,
                         update_mode=update_mode, delay_bound=delay_bound, schedule=schedule,
                         replicas=tuple(Endpoint(LOCALHOST, p) for p in chain), secret=secret)
            for rank in range(num_workers)]


def write_configs(configs: Sequence[WorkerConfig], directory: Path) -> list[Path]:
    """Save each config as ``job<J>-rank<R>.yaml`` in ``directory`` (secret included); returns the paths."""
    paths = []
    for config in configs:
        path = directory / f"job{config.job_id}-rank{config.rank}.yaml"
        config.save(path)
        paths.append(path)
    return paths


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def start_ps(config_path: Path, log_path: Path, *, replica: int | None = None, lr: float = 0.1,
             extra: Sequence[str] = (), prefix: Sequence[str] = (), timeout: float = 30.0) -> subprocess.Popen:
    """A PS node (the primary, or replica ``replica``) as a process; returns once it listens."""
    cmd = [*prefix, *PS_COMMAND, "--config", str(config_path), "--lr", str(lr), *extra]
    if replica is not None:
        cmd += ["--replica", str(replica)]
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=dp.REPO_ROOT)
    log.close()
    deadline = time.monotonic() + timeout
    while "mlfabric PS:" not in log_path.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            raise RuntimeError(f"the PS did not start:\n{log_path.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)
    return process


def start_workers(config_paths: Sequence[Path], args_by_rank: Sequence[Sequence[str]],
                  prefixes: Sequence[Sequence[str]] | None = None) -> list[subprocess.Popen]:
    """One MLP worker process per config, with its extra arguments (and a command prefix, e.g. ip netns)."""
    procs = []
    for i, (path, args) in enumerate(zip(config_paths, args_by_rank, strict=True)):
        prefix = list(prefixes[i]) if prefixes else []
        procs.append(subprocess.Popen([*prefix, *WORKER_COMMAND, "--config", str(path), *args],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                      cwd=dp.REPO_ROOT))
    return procs


def collect(procs: Sequence[subprocess.Popen], timeout: float = 120.0) -> list[dict[str, Any]]:
    """Each process's last JSON line (raises with its stderr if it failed); kills stragglers at the deadline."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for i, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate(timeout=10)
                raise RuntimeError(f"process {i} did not finish in {timeout} s:\n{err[-3000:]}") from None
            if proc.returncode != 0:
                raise RuntimeError(f"process {i} exited {proc.returncode}:\n{err[-3000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            stop(proc)
    return results


def stop(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """Terminate a process we started (kill it if it does not stop)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
