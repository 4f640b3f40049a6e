"""A worker over several cores: the job's slots split into T shares, each with its own socket, one per process.

``WorkerConfig.threads = T`` (``NETAGG_THREADS``; a job setting: every worker of the job uses
the same T) splits each worker's slots into T contiguous ranges of whole 64-slot blocks
(:func:`thread_shares`), each run by its own :class:`~netagg.hoststack.transport.Transport`:
share 0 in the worker's process, the others each in a process of its own (spawned; the
exchange's blocks and sums travel through shared memory). Processes, not threads: a share's
exchange loop runs about a microsecond of Python per packet, so threads of one process wait
for each other's GIL (measured: 2 threads in one process moved half the packets of one). Their
T UDP sockets are one ``SO_REUSEPORT`` group on the worker's address (the switch sees one
worker), whose BPF program steers each result to the share that owns its slot
(:func:`netagg.steering.udp_range_program`); the switch cuts its segmented results at 64-slot
blocks, so a coalesced receive never mixes two shares' slots. An exchange's blocks are cut into
T contiguous parts in proportion to the shares' slots. Every block is summed exactly, whichever
slot carries it, so the result is bit-identical to T = 1.

Not with failover to the PS (the workers' votes name one exchange per worker), ps mode,
one-way jobs or subset rounds: ``WorkerConfig`` refuses T > 1 there, and
:class:`ThreadedTransport` turns failover off. A share's process that dies fails the exchange
(``TransportError``), as a timeout would.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import socket
from dataclasses import fields
from typing import Any

import numpy as np

from netagg import steering, wire
from netagg.hoststack import quantization as qz
from netagg.hoststack.packets import SOCKET_BUFFER_BYTES, slot_count_of
from netagg.hoststack.transport import Transport, TransportError, TransportStats
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


def _share_main(conn: Any, config: WorkerConfig, share: tuple[int, int], address: tuple[str, int],
                options: dict[str, Any]) -> None:
    """A share's process: join the worker's socket group, then run exchanges the parent sends until "stop"."""
    from multiprocessing import shared_memory

    (sock,) = steering.udp_group(*address, 1, SOCKET_BUFFER_BYTES, SOCKET_BUFFER_BYTES, reuse=True)  # joins it
    transport = Transport(config, sock=sock, slot_range=share, connect=False, **options)
    conn.send(("ready", None))
    shm = None
    try:
        while True:
            message = conn.recv()
            if message[0] == "stop":
                return
            _, name, count = message
            if shm is None or shm.name != name:  # the parent grew it: a new segment
                if shm is not None:
                    shm.close()
                shm = shared_memory.SharedMemory(name=name)
            conn.send(_exchange_in(transport, shm, count))
    except (EOFError, KeyboardInterrupt):
        return
    finally:
        if shm is not None:
            shm.close()
        transport.close()


def _exchange_in(transport: Transport, shm: Any, count: int) -> tuple[str, str | None, dict]:
    """One exchange of ``count`` blocks from and into ``shm`` (the views end with the call, so ``shm`` can be
    closed); returns the answer for the parent."""
    blocks, exponents, sums, global_exp, flags, result_flags = _views(shm, count, transport.k)
    try:
        out_sums, out_exp, out_flags = transport.exchange(blocks, exponents.copy(), flags=flags.copy(),
                                                          tag=transport_tag(shm, count, transport.k))
    except Exception as err:  # the parent raises it for this exchange
        return "error", f"{type(err).__name__}: {err}", vars(transport.stats).copy()
    sums[:] = out_sums
    global_exp[:] = out_exp
    result_flags[:] = out_flags
    return "done", None, vars(transport.stats).copy()


def _tag_offset(count: int, k: int) -> int:
    """Where the tag lies after the views of an exchange of ``count`` blocks of ``k`` values."""
    return count * (8 * k + 4)


def _shm_bytes(count: int, k: int) -> int:
    """Shared bytes of an exchange of ``count`` blocks of ``k`` values: inputs (float32 + exponent + flags),
    outputs (int32 + exponent + round flags), and the collective's tag (8 bytes)."""
    return _tag_offset(count, k) + 8


def transport_tag(shm: Any, count: int, k: int) -> int:
    """The collective's tag (``Transport.exchange``'s), after the views of an exchange of ``count`` blocks."""
    return int(np.ndarray(1, np.int64, buffer=shm.buf, offset=_tag_offset(count, k))[0])


def _views(shm: Any, count: int, k: int) -> tuple[np.ndarray, ...]:
    """The blocks, exponents, sums, global exponents, flags and result flags of an exchange of ``count`` blocks of
    ``k`` values in ``shm``."""
    buf = shm.buf
    payload = 4 * k
    blocks = np.ndarray((count, k), np.float32, buffer=buf, offset=0)
    sums = np.ndarray((count, k), qz.WIRE_DTYPE, buffer=buf, offset=count * payload)
    exponents = np.ndarray(count, np.int8, buffer=buf, offset=2 * count * payload)
    global_exp = np.ndarray(count, np.int8, buffer=buf, offset=2 * count * payload + count)
    flags = np.ndarray(count, np.uint8, buffer=buf, offset=2 * count * payload + 2 * count)
    result_flags = np.ndarray(count, np.uint8, buffer=buf, offset=2 * count * payload + 3 * count)
    return blocks, exponents, sums, global_exp, flags, result_flags


class _Share:
    """One share of the slots in a process of its own (its Python does not wait for the others' GIL)."""

    def __init__(self, index: int, config: WorkerConfig, share: tuple[int, int], address: tuple[str, int],
                 options: dict[str, Any], timeout: float) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self.index = index
        self.k = config.width
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_share_main, args=(child, config, share, address, options),
                                   name=f"netagg-share{index}", daemon=True)
        self.process.start()
        child.close()
        self.stats: dict[str, Any] = {}
        self._shm: Any = None
        self._count = -1
        self._pending = False
        if not self.conn.poll(timeout):
            self.close()
            raise TransportError(f"thread {index}'s process did not start within {timeout:.0f} s")
        self._receive()

    def _receive(self) -> tuple[str, Any]:
        try:
            kind, detail, *stats = self.conn.recv()
        except (EOFError, OSError):
            raise TransportError(f"thread {self.index}'s process died (exit code {self.process.exitcode})") from None
        if stats:
            self.stats = stats[0]
        return kind, detail

    def start(self, blocks: np.ndarray, exponents: np.ndarray, flags: np.ndarray, tag: int) -> None:
        from multiprocessing import shared_memory

        count = blocks.shape[0]
        if self._shm is None or self._shm.size < _shm_bytes(count, self.k):
            if self._shm is not None:
                self._shm.close()
                self._shm.unlink()
            self._shm = shared_memory.SharedMemory(create=True, size=max(_shm_bytes(count, self.k), 4096))
        view_blocks, view_exp, _, _, view_flags, _ = _views(self._shm, count, self.k)
        view_blocks[:] = blocks
        view_exp[:] = exponents
        view_flags[:] = flags
        np.ndarray(1, np.int64, buffer=self._shm.buf, offset=_tag_offset(count, self.k))[0] = tag
        self._count = count
        self.conn.send(("exchange", self._shm.name, count))
        self._pending = True

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self._pending = False
        kind, detail = self._receive()
        if kind != "done":
            raise TransportError(f"thread {self.index}: {detail}")
        _, _, sums, global_exp, _, result_flags = _views(self._shm, self._count, self.k)
        return sums.copy(), global_exp.copy(), result_flags.copy()

    def close(self) -> None:
        try:
            if self._pending:
                self._receive()
            self.conn.send(("stop",))
        except (OSError, TransportError):
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None


class ThreadedTransport:
    """T shares of one worker's slots as one transport (the parts of :class:`Transport` that ``KVWorker``
    uses): share 0 in this process, the others each in a process of its own (module docstring)."""

    def __init__(self, config: WorkerConfig, sock: socket.socket | None = None, **options: Any) -> None:
        if config.threads < 2:
            raise ValueError("a threaded transport has at least 2 threads")
        self.config = config
        self.k = config.width
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
        (first,) = steering.udp_group(host, port, 1, SOCKET_BUFFER_BYTES, SOCKET_BUFFER_BYTES, reuse=True)
        self._others: list[_Share] = []
        try:
            steering.attach_reuseport(first, program)
            self.transport = Transport(config, sock=first, slot_range=self.shares[0], connect=False, **options)
            address = self.transport.address
            timeout = max(60.0, options.get("progress_timeout", 10.0))
            for index, share in enumerate(self.shares[1:], 1):  # one at a time: the group's order is the shares'
                self._others.append(_Share(index, config, share, address, options, timeout))
        except BaseException:
            for other in self._others:
                other.close()
            first.close()
            raise
        self.address = address

    @property
    def threads(self) -> int:
        return len(self.shares)

    @property
    def window(self) -> float:
        """This process's share's congestion window times the shares (packets outstanding, about)."""
        return self.transport.window * len(self.shares)

    @property
    def slot_count(self) -> int:
        return slot_count_of(self.config)

    @property
    def next_seq(self) -> int:
        return self.transport.next_seq

    @property
    def stats(self) -> TransportStats:
        """Every share's counters added up (exchanges: the worker's; the smallest window of any share)."""
        total = TransportStats()
        rows = [vars(self.transport.stats), *(other.stats for other in self._others if other.stats)]
        for f in fields(TransportStats):
            values = [row[f.name] for row in rows]
            merged = min(values) if f.name == "smallest_window" else values[0] if f.name == "exchanges" else sum(values)
            setattr(total, f.name, merged)
        return total

    def exchange(self, blocks: np.ndarray, exponents: np.ndarray | None = None, *, flags: np.ndarray | None = None,
                 tag: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`Transport.exchange` over the shares: part i of ``blocks`` through share i's slots."""
        exponents, flags = qz.inspected(blocks, exponents, flags)
        parts = split_blocks(blocks.shape[0], self.shares)
        for other, (a, b) in zip(self._others, parts[1:], strict=True):
            other.start(blocks[a:b], exponents[a:b], flags[a:b], tag)
        a, b = parts[0]
        results: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        errors: list[BaseException] = []
        try:
            results.append(self.transport.exchange(blocks[a:b], exponents[a:b], flags=flags[a:b], tag=tag))
        except BaseException as err:  # collect the others' answers before raising
            errors.append(err)
        for other in self._others:
            try:
                results.append(other.finish())
            except BaseException as err:
                errors.append(err)
        if errors:
            raise errors[0]
        return tuple(np.concatenate([r[i] for r in results]) for i in range(3))

    def abort(self, reason: str) -> None:
        """:meth:`Transport.abort` (share 0 holds the job's slot 0, where every collective starts)."""
        self.transport.abort(reason)

    def exchange_subset(self, *_args: Any, **_kwargs: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise ValueError("subset rounds run on one thread per worker (threads=1)")

    def close(self) -> None:
        for other in self._others:
            other.close()
        self.transport.close()
