"""Helpers for tests and examples: a local fallback-mode job, workers in threads, a lossy UDP relay.

``with fallback_job(4) as (server, configs): run_workers(configs, lambda w, rank: w.allreduce(x))``
runs a whole job on loopback without the switch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import select
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from netagg import udpgso, wire
from netagg.faults import FaultInjector
from netagg.hoststack import blocks as blk
from netagg.hoststack import quantization as qz
from netagg.hoststack.kv import KVWorker
from netagg.hoststack.server import Handle, KVServer
from netagg.jobconfig import Endpoint, WorkerConfig
from netagg.localports import free_ports

LOCALHOST = "127.0.0.1"


def block_scaled_inputs(n: int, size: int, seed: int, decades: int = 20) -> list[np.ndarray]:
    """Per rank, ``size`` float32 normal values, each 64-value block at its own scale in
    10^-decades..10^decades (so blocks have very different exponents); seeded."""
    rng = np.random.default_rng(seed)
    scales = 10.0 ** rng.integers(-decades, decades, max(1, -(-size // wire.K))).repeat(wire.K)[:size]
    return [(rng.standard_normal(size) * scales).astype(np.float32) for _ in range(n)]


def expected_allreduce(inputs: Sequence[Any], k: int = wire.K) -> tuple[Any, np.ndarray]:
    """What every worker must get for ``inputs`` (one array per rank) in a job of width ``k``, computed without a
    network.

    Returns (the result with the inputs' shape and dtype, the per-value quantization bound
    ``n * 2**(G - P)`` as a float64 array of the same shape).
    """
    n = len(inputs)
    packed = [blk.pack([0], [value], k) for value in inputs]
    layout = packed[0][0]
    inspected = [qz.inspect(b) for _, b in packed]
    global_exp = np.max([exponents for exponents, _ in inspected], axis=0).astype(np.int8)
    flags = np.zeros(layout.num_blocks, np.uint8)  # a block's non-finite flags, ORed as the switch does
    total = np.zeros((layout.num_blocks, k), np.int32)
    for (_, blocks), (_, block_flags) in zip(packed, inspected, strict=True):
        if block_flags is not None:
            flags |= block_flags
        total += qz.quantize(qz.finite_blocks(blocks, block_flags), global_exp, n)  # int32 wraps like the switch
    result = blk.unpack(layout, qz.dequantize(total, global_exp, n, flags=flags))[0]
    bound = np.repeat(qz.error_bound(global_exp, n), k)[:layout.segments[0].size]
    return result, bound.reshape(layout.segments[0].shape)


def job_configs(num_workers: int, mode: str, aggregator: Endpoint, ps: Endpoint | None, slot_count: int = 32,
                job_id: int = 1, width: int = wire.K) -> list[WorkerConfig]:
    """One config per rank, each worker bound to its own free loopback port."""
    return [WorkerConfig(job_id=job_id, rank=rank, num_workers=num_workers, slot_count=slot_count, mode=mode,
                         aggregator=aggregator, bind=Endpoint(LOCALHOST, port), ps=ps, width=width)
            for rank, port in enumerate(free_ports(num_workers))]


@contextlib.contextmanager
def fallback_job(num_workers: int, slot_count: int = 32, job_id: int = 1, handle: Handle | None = None,
                 secret: str = "", width: int = wire.K) -> Iterator[tuple[KVServer, list[WorkerConfig]]]:
    """A running fallback-mode PS on loopback and the configs of its workers (with the job's ``secret``)."""
    placeholder = WorkerConfig(job_id=job_id, rank=0, num_workers=num_workers, slot_count=slot_count,
                               mode="fallback", aggregator=Endpoint(LOCALHOST, 9), bind=Endpoint(LOCALHOST, 0),
                               ps=Endpoint(LOCALHOST, 0), secret=secret, width=width)
    with KVServer(placeholder, handle) as server:
        ps = Endpoint(*server.address)
        # Port 0: each worker binds a free port itself (the PS learns the addresses), so no race
        # with other processes between choosing a port and binding it.
        yield server, [dataclasses.replace(placeholder, rank=rank, aggregator=ps, ps=ps)
                       for rank in range(num_workers)]


def run_workers(configs: Sequence[WorkerConfig], fn: Callable[[KVWorker, int], Any], timeout: float = 120.0,
                **worker_options: Any) -> list[Any]:
    """Run ``fn(worker, rank)`` for every config in its own thread; results by rank, or the first error."""
    results: list[Any] = [None] * len(configs)
    errors: list[BaseException | None] = [None] * len(configs)

    def run(rank: int) -> None:
        try:
            with KVWorker(configs[rank], **worker_options) as worker:
                results[rank] = fn(worker, rank)
        except BaseException as err:
            errors[rank] = err

    threads = [threading.Thread(target=run, args=(r,), name=f"worker{r}", daemon=True) for r in range(len(configs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"{thread.name} still running after {timeout} s")
    for error in errors:
        if error is not None:
            raise error
    return results


def run_workers_with_fault(configs: Sequence[WorkerConfig], fn: Callable[[KVWorker, int, Callable[[], None]], Any],
                           fault: Callable[[], None], timeout: float = 120.0, **worker_options: Any) -> list[Any]:
    """:func:`run_workers` with ``fn(worker, rank, ready)``: once every worker called ``ready()``, ``fault()`` runs in
    a thread of its own (while they go on). A worker that fails releases the others' ``ready``; an error of the fault
    is raised after the workers finished (theirs first)."""
    barrier = threading.Barrier(len(configs) + 1, timeout=timeout)
    errors: list[BaseException] = []

    def work(worker: KVWorker, rank: int) -> Any:
        try:
            return fn(worker, rank, barrier.wait)
        except BaseException:
            barrier.abort()
            raise

    def control() -> None:
        try:
            barrier.wait()
            fault()
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=control, name="fault", daemon=True)
    thread.start()
    try:
        results = run_workers(configs, work, timeout=timeout, **worker_options)
    finally:
        thread.join(timeout)
    if errors:
        raise errors[0]
    return results


class LossyRelay:
    """UDP relays between workers and one target (PS or switch), dropping/duplicating/reordering.

    ``relay.endpoint(i)`` is the address worker ``i`` should use as its target; the target
    sees each worker as a distinct relay port. Faults are seeded (``FaultInjector``), one
    injector per direction; held-back packets are released after 2 ms without traffic.
    ``mark``: the share of datagrams toward the workers relayed ECN CE-marked (a congested queue that
    marks instead of dropping), counted in ``marked``; the others go ECT(0).
    """

    def __init__(self, target: tuple[str, int], count: int, drop: float = 0.0, duplicate: float = 0.0,
                 reorder: float = 0.0, seed: int = 1, mark: float = 0.0) -> None:
        self.target = target
        self.socks = []
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind((LOCALHOST, 0))
            sock.setblocking(False)
            self.socks.append(sock)
        self.peers: list[tuple[str, int] | None] = [None] * count
        self.up: FaultInjector = FaultInjector(drop, duplicate, reorder, seed)
        self.down: FaultInjector = FaultInjector(drop, duplicate, reorder, seed + 1)
        self.mark = mark
        self.marked = 0
        self._mark_rng = random.Random(seed + 2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lossy-relay", daemon=True)

    def endpoint(self, index: int) -> Endpoint:
        return Endpoint(*self.socks[index].getsockname())

    def __enter__(self) -> LossyRelay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.socks:
            sock.close()

    def _deliver(self, items: list[tuple[socket.socket, bytes, tuple[str, int]]]) -> None:
        for sock, data, dest in items:
            with contextlib.suppress(OSError):
                if self.mark and dest != self.target:
                    ce = self._mark_rng.random() < self.mark
                    self.marked += ce
                    sock.setsockopt(udpgso.SOL_IP, udpgso.IP_TOS, wire.ECN_CE if ce else wire.ECN_ECT0)
                sock.sendto(data, dest)

    def _run(self) -> None:
        by_fd = {sock.fileno(): i for i, sock in enumerate(self.socks)}
        poller = select.poll()
        for sock in self.socks:
            poller.register(sock.fileno(), select.POLLIN)
        while not self._stop.is_set():
            events = poller.poll(2)
            if not events:
                self._deliver(self.up.flush() + self.down.flush())
                continue
            for fd, _ in events:
                index = by_fd[fd]
                sock = self.socks[index]
                while True:
                    try:
                        data, source = sock.recvfrom(4096)
                    except OSError:
                        break
                    if source == self.target:
                        peer = self.peers[index]
                        if peer is not None:
                            self._deliver(self.down.filter((sock, data, peer)))
                    else:
                        self.peers[index] = source
                        self._deliver(self.up.filter((sock, data, self.target)))


def through_relay(configs: Sequence[WorkerConfig], relay: LossyRelay) -> list[WorkerConfig]:
    """Configs whose target (the PS in fallback mode, else the aggregator) is their relay port."""
    out = []
    for i, config in enumerate(configs):
        endpoint = relay.endpoint(i)
        if config.mode == "fallback":
            out.append(dataclasses.replace(config, ps=endpoint, aggregator=endpoint))
        else:
            out.append(dataclasses.replace(config, aggregator=endpoint))
    return out
