"""A worker over several cores: the job's slots split into T ranges, each with its own socket and thread.

``WorkerConfig.threads = T`` (``NETAGG_THREADS``; a job setting: every worker of the job uses
the same T) gives each worker T :class:`~netagg.hoststack.transport.Transport` objects over
contiguous ranges of whole 64-slot blocks of the job's slots (:func:`thread_shares`). Their T
UDP sockets are one ``SO_REUSEPORT`` group on the worker's address (the switch sees one
worker), whose BPF program steers each result to the thread that owns its slot
(:func:`netagg.steering.udp_range_program`); the switch cuts its segmented results at 64-slot
blocks, so a coalesced receive never mixes two threads' slots. An exchange's blocks are cut
into T contiguous parts in proportion to the threads' slots, and each thread runs its part as
its own exchange (the compiled steps and the system calls run without the GIL). Every block is
summed exactly, whichever slot carries it, so the result is bit-identical to T = 1.

Not with failover to the PS (the workers' votes name one exchange per worker), ps mode,
one-way jobs or subset rounds: ``WorkerConfig`` refuses T > 1 there, and
:class:`ThreadedTransport` turns failover off.
"""

from __future__ import annotations

import itertools
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import Any

import numpy as np

from netagg import steering, wire
from netagg.hoststack import quantization as qz
from netagg.hoststack.packets import SOCKET_BUFFER_BYTES, slot_count_of
from netagg.hoststack.transport import Transport, TransportStats
from netagg.jobconfig import WorkerConfig, resolve

log = logging.getLogger(__name__)


def thread_shares(slot_count: int, threads: int) -> list[tuple[int, int]]:
    """(first slot, slots) of each thread: contiguous whole 64-slot blocks, as even as they go; fewer threads
    than asked when the job has fewer blocks."""
    blocks = -(-slot_count // wire.SEGMENT_BLOCK_SLOTS)
    threads = max(1, min(threads, blocks))
    shares: list[tuple[int, int]] = []
    first = 0
    for i in range(threads):
        count = (blocks // threads + (1 if i < blocks % threads else 0)) * wire.SEGMENT_BLOCK_SLOTS
        shares.append((first, min(count, slot_count - first)))
        first += count
    return shares


def split_blocks(num_blocks: int, shares: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Contiguous [start, end) parts of ``num_blocks`` in proportion to each share's slots."""
    total = sum(count for _, count in shares)
    bounds = [0]
    acc = 0
    for _, count in shares:
        acc += count
        bounds.append(num_blocks * acc // total)
    return list(itertools.pairwise(bounds))


class ThreadedTransport:
    """T transports of one worker as one (the parts of :class:`Transport` that ``KVWorker`` uses)."""

    def __init__(self, config: WorkerConfig, sock: socket.socket | None = None, **options: Any) -> None:
        if config.threads < 2:
            raise ValueError("a threaded transport has at least 2 threads")
        self.config = config
        self.shares = thread_shares(slot_count_of(config), config.threads)
        if len(self.shares) < config.threads:
            log.info("job %d: %d slots make %d blocks of 64: %d threads, not %d", config.job_id,
                     slot_count_of(config), len(self.shares), len(self.shares), config.threads)
        if options.pop("failover", None) is not None:
            log.info("job %d: failover to the PS is off with several threads per worker", config.job_id)
        host, port = resolve(config.bind)
        if sock is not None:  # the caller held the port: the group binds it again once that socket is gone
            port = sock.getsockname()[1]
            sock.close()
        program = steering.udp_range_program([first for first, _ in self.shares])
        socks = steering.udp_group(host, port, len(self.shares), SOCKET_BUFFER_BYTES, SOCKET_BUFFER_BYTES, program)
        self.transports: list[Transport] = []
        try:
            for share, member in zip(self.shares, socks, strict=True):
                self.transports.append(Transport(config, sock=member, slot_range=share, connect=False, **options))
        except BaseException:
            for t in self.transports:
                t.close()
            for member in socks[len(self.transports):]:
                member.close()
            raise
        self.address = self.transports[0].address
        self._pool = ThreadPoolExecutor(len(self.transports) - 1, thread_name_prefix=f"netagg-t{config.rank}")

    @property
    def threads(self) -> int:
        return len(self.transports)

    @property
    def window(self) -> float:
        """The threads' congestion windows added up (packets outstanding at most)."""
        return sum(t.window for t in self.transports)

    @property
    def slot_count(self) -> int:
        return sum(t.slot_count for t in self.transports)

    @property
    def next_seq(self) -> int:
        return self.transports[0].next_seq

    @property
    def stats(self) -> TransportStats:
        """Every thread's counters added up (exchanges: the worker's; the smallest window of any thread)."""
        total = TransportStats()
        for f in fields(TransportStats):
            values = [getattr(t.stats, f.name) for t in self.transports]
            merged = min(values) if f.name == "smallest_window" else values[0] if f.name == "exchanges" else sum(values)
            setattr(total, f.name, merged)
        return total

    def exchange(self, blocks: np.ndarray, exponents: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`Transport.exchange` over the threads: part i of ``blocks`` through thread i's slots."""
        if exponents is None:
            exponents = qz.block_exponents(blocks)
        parts = split_blocks(blocks.shape[0], self.shares)
        futures = [self._pool.submit(t.exchange, blocks[a:b], exponents[a:b])
                   for t, (a, b) in zip(self.transports[1:], parts[1:], strict=True)]
        first = self.transports[0].exchange(blocks[parts[0][0]:parts[0][1]], exponents[parts[0][0]:parts[0][1]])
        results = [first, *(f.result() for f in futures)]
        return np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results])

    def exchange_subset(self, *_args: Any, **_kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
        raise ValueError("subset rounds run on one thread per worker (threads=1)")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for t in self.transports:
            t.close()
