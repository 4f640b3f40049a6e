# Over 500 lines: the UDP loop, the push rounds and their TCP ops share one lock and state; sparse ops: sparse_ops.py.
"""The parameter server (PS) of one job: ``python -m netagg.hoststack.server --config ps.yaml``.

It listens on the job's ``ps`` endpoint: UDP for netagg packets, TCP (same port number)
for the control protocol of :mod:`~netagg.psproto` (served by :mod:`netagg.framed_server`).

* ``fallback`` mode: the workers send their contributions here instead of to the
  switch; :class:`~netagg.hoststack.aggregator.SoftAggregator` aggregates them with the
  switch's exact semantics and every result goes back as a RESULT | PS_FORWARDED packet.
* ``ps`` mode: the switch aggregates and sends each result to the PS. The PS reflects
  every result to the workers registered by HELLO (their window's clock), keeps the sums
  of data blocks, and when a worker COMMITs a push (layout and global exponents) it
  decodes the aggregate, asks for blocks it missed (REPAIR) and applies the handle per
  key. PULL returns the stored values once a given push is applied.
* ``allreduce`` mode needs no PS, except for sparse tables and failover.
* **Failover** (allreduce and ps modes, :mod:`~netagg.hoststack.failover`): when every worker voted
  that the switch is away, the PS aggregates the job's exchanges with a fresh software aggregator
  (as in fallback mode; in ps mode it also keeps the results' sums as if the switch had sent them)
  until the workers return to the switch.

In every mode the PS also serves *sparse tables* (Libra, :mod:`~netagg.hoststack.sparse_store`,
:mod:`~netagg.hoststack.sparse_ops`): the workers push the cold rows of each iteration over TCP and pull
their aggregate.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from netagg import layout, wire
from netagg.framed_server import Frame, FramedServer, Handler, Reply, dispatch, listen
from netagg.hoststack import quantization as qz
from netagg.hoststack.aggregator import Outcome, SoftAggregator
from netagg.hoststack.blocks import blocks_for
from netagg.hoststack.envconfig import config_from_env
from netagg.hoststack.failover import RETRY_INITIAL, FailoverCoordinator
from netagg.hoststack.packets import PROBE_SEQ_BIT, SEQ_MASK, slot_count_of, udp_socket
from netagg.hoststack.sparse_ops import SparseTables
from netagg.hoststack.sparse_store import TableState
from netagg.jobconfig import ConfigError, Endpoint, WorkerConfig, endpoint_arg, resolve
from netagg.shutdown import stop_event

log = logging.getLogger(__name__)

#: ``handle(store, key, aggregate, num_workers)``: apply one key's aggregate (float32, flat) to the store.
Handle = Callable[[dict[int, np.ndarray], int, np.ndarray, int], None]
_POLL_SECONDS = 0.1
_HALF_SEQ_SPACE = 1 << 30

_FIELD = wire.FIELD_INDEX


def sum_store(store: dict[int, np.ndarray], key: int, aggregate: np.ndarray, num_workers: int) -> None:
    """The default handle: keep the latest aggregate (the sum over workers) per key."""
    store[key] = aggregate.copy()


@dataclass
class SGD:
    """Plain SGD on the stored weights: ``w -= lr * aggregate / num_workers`` (w starts at 0 unless INIT)."""

    lr: float

    def __call__(self, store: dict[int, np.ndarray], key: int, aggregate: np.ndarray, num_workers: int) -> None:
        weights = store.get(key)
        if weights is None or weights.shape != aggregate.shape:
            weights = np.zeros_like(aggregate)
        weights -= np.float32(self.lr / num_workers) * aggregate
        store[key] = weights


@dataclass
class ServerStats:
    """What the PS saw."""

    datagrams: int = 0
    malformed: int = 0
    foreign: int = 0
    switch_results: int = 0
    forwarded: int = 0
    rounds_applied: int = 0
    repaired_blocks: int = 0
    requests: int = 0
    bad_requests: int = 0
    #: Requests without the job's secret (refused before anything else; also in bad_requests).
    bad_secret: int = 0
    #: Failover (allreduce/ps modes): workers' datagrams handled here while the job's switch was away.
    failover_contributions: int = 0


@dataclass
class _Push:
    """One push (all workers' same call) as the PS assembles it in ps mode."""

    round_id: int
    seq_start: int
    keys: list[int]
    sizes: list[int]
    num_blocks: int
    sums: np.ndarray
    have: np.ndarray
    missing: int
    exponents: np.ndarray | None = None
    #: The results' round flags per block (non-finite blocks: docs/protocol.md), from the first commit.
    flags: np.ndarray | None = None
    applied: bool = False

    @property
    def complete(self) -> bool:
        return self.missing == 0 and self.exponents is not None

    def offset(self, seq: int) -> int:
        return (seq - self.seq_start) & SEQ_MASK

    def put(self, block: int, payload: bytes | bytearray | memoryview) -> bool:
        if self.have[block]:
            return False
        row = self.sums.view(np.uint8).reshape(self.num_blocks, -1)[block]
        row[:] = np.frombuffer(payload, np.uint8, row.size)
        self.have[block] = True
        self.missing -= 1
        return True

    def missing_seqs(self) -> list[int]:
        return [(self.seq_start + int(b)) & SEQ_MASK for b in np.flatnonzero(~self.have)]


class KVServer:
    """The PS of one job (see the module docstring). Use as a context manager or start()/stop()."""

    def __init__(
        self,
        config: WorkerConfig,
        handle: Handle | None = None,
        *,
        bind: Endpoint | None = None,
        commit_grace: float = 0.05,
        pull_timeout: float = 30.0,
        pending_limit: int = 1 << 21,
        failover_retry: float = RETRY_INITIAL,
    ) -> None:
        if config.ps is None and bind is None:
            raise ConfigError(f"mode: a {config.mode} job without a ps endpoint has no parameter server")
        self.config = config
        self.mode = config.mode
        self.num_workers = config.num_workers
        self.handle: Handle = handle or sum_store
        self.commit_grace = commit_grace
        self.pull_timeout = pull_timeout
        self.pending_limit = pending_limit
        endpoint = bind or config.ps
        assert endpoint is not None  # WorkerConfig guarantees it in ps/fallback mode
        self.udp, self.tcp = _bind_pair(resolve(endpoint))
        self.address: tuple[str, int] = self.udp.getsockname()
        # Fallback mode: with a job secret, only addresses registered by a HELLO carrying it may
        # contribute (like the switch's worker table); without one, the first address to use a
        # rank is learnt as that rank's.
        self.aggregator = (
            SoftAggregator(config.job_id, config.num_workers, slot_count_of(config),
                           workers={} if config.secret else None, width=config.width)
            if self.mode == "fallback" else None
        )
        self.switch = resolve(config.aggregator) if self.mode == "ps" else None
        #: Failover (allreduce and ps modes): the votes and, once decided, this aggregator takes the job's
        #: contributions (a fresh one per decision).
        self.failover = FailoverCoordinator(config.num_workers, self._start_failover, retry_initial=failover_retry) \
            if self.mode in ("allreduce", "ps") else None
        self.failover_aggregator: SoftAggregator | None = None
        self.workers: dict[int, tuple[str, int]] = {}
        self.store: dict[int, np.ndarray] = {}
        self.stats = ServerStats()
        self._rounds: dict[int, _Push] = {}
        #: Sparse tables (Libra) and, by id, their cold rows per iteration and hot sets.
        self.sparse = SparseTables(config.num_workers, pull_timeout)
        self.tables: dict[int, TableState] = self.sparse.tables
        self._handlers: dict[str, Handler] = {
            "hello": self._op_hello, "commit": self._op_commit, "repair": self._op_repair, "pull": self._op_pull,
            "init": self._op_init, **self.sparse.handlers(), "failover_vote": self._op_failover_vote,
            "failover_withdraw": self._op_failover_withdraw, "failover_route": self._op_failover_route,
            "switch_back": self._op_switch_back}
        self._next_apply = 0
        self._pending: dict[int, bytes] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._tcp = FramedServer(self.tcp, lambda: (self._handle, None), name="netagg-ps-conn", stop=self._stop,
                                 frame_timeout=pull_timeout, on_malformed=self._count_bad_request,
                                 on_error=self._count_bad_request)

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> KVServer:
        thread = threading.Thread(target=self._udp_loop, name="netagg-ps-udp", daemon=True)
        thread.start()
        self._threads.append(thread)
        self._tcp.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()
        self._tcp.stop()
        self.udp.close()

    def __enter__(self) -> KVServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Serve until stop() is called (or SIGINT/SIGTERM when run as a program)."""
        if not self._threads:
            self.start()
        while not self._stop.wait(0.5):
            pass

    @property
    def applied_rounds(self) -> int:
        """How many pushes (ps mode) have been applied to the store."""
        return self._next_apply

    # -- UDP -----------------------------------------------------------------
    def _udp_loop(self) -> None:
        poller = select.poll()
        poller.register(self.udp.fileno(), select.POLLIN)
        buf = bytearray(2048)
        view = memoryview(buf)
        while not self._stop.is_set():
            if not poller.poll(_POLL_SECONDS * 1000):
                continue
            for _ in range(256):
                try:
                    size, source = self.udp.recvfrom_into(buf)
                except BlockingIOError:
                    break
                except OSError:
                    continue
                self.stats.datagrams += 1
                try:
                    if self.aggregator is not None:
                        self._on_contribution(self.aggregator, view[:size], source)
                    elif self.failover_aggregator is not None and source != self.switch:
                        self._on_failover_contribution(view[:size], source)
                    else:
                        self._on_switch_result(view[:size], source)
                except Exception:  # never let one datagram stop the loop
                    self.stats.malformed += 1
                    log.exception("PS: datagram from %s:%d failed", *source)

    def _send(self, packet: bytes | bytearray, address: tuple[str, int]) -> None:
        with contextlib.suppress(OSError):  # lost: the worker retransmits
            self.udp.sendto(packet, address)

    def _on_contribution(self, aggregator: SoftAggregator, data: memoryview, source: tuple[str, int]) -> Outcome | None:
        """A worker's packet to ``aggregator`` (fallback's, or the failover's); its result, if any, sent as the
        switch would."""
        outcome = aggregator.handle(data, source)
        if outcome is not None:
            for address in aggregator.group() if outcome.to_group else [source]:
                self._send(outcome.packet, address)
        return outcome

    def _on_failover_contribution(self, data: memoryview, source: tuple[str, int]) -> None:
        assert self.failover_aggregator is not None
        self.stats.failover_contributions += 1
        outcome = self._on_contribution(self.failover_aggregator, data, source)
        if outcome is not None and self.mode == "ps" and outcome.to_group:  # the sums, as if from the switch
            seq = wire.HEADER_STRUCT.unpack_from(outcome.packet, 0)[_FIELD["seq"]]
            if not seq & PROBE_SEQ_BIT:
                self._store_block(seq, outcome.packet[wire.HEADER_BYTES:])

    def _start_failover(self, epoch: int, addresses: dict[int, tuple[str, int]]) -> None:
        """A failover decision (FailoverCoordinator.on_decide): a fresh aggregator that knows the voters."""
        self.failover_aggregator = SoftAggregator(self.config.job_id, self.num_workers, slot_count_of(self.config),
                                                  workers={address: rank for rank, address in addresses.items()},
                                                  width=self.config.width)
        log.warning("PS job %d: failover epoch %d: aggregating the job's exchanges here", self.config.job_id, epoch)

    def _on_switch_result(self, data: memoryview, source: tuple[str, int]) -> None:
        if source != self.switch:
            self.stats.foreign += 1
            return
        if len(data) != wire.netagg_bytes(self.config.width):
            self.stats.malformed += 1
            return
        fields = wire.HEADER_STRUCT.unpack_from(data, 0)
        version, flags, job, seq = (fields[_FIELD[name]] for name in ("version", "flags", "job_id", "seq"))
        if version != wire.VERSION or not flags & wire.FLAG_RESULT or job != self.config.job_id:
            self.stats.malformed += 1
            return
        self.stats.switch_results += 1
        packet = bytearray(data)
        packet[layout.FLAGS_AT] |= wire.FLAG_PS_FORWARDED
        for address in list(self.workers.values()):
            self._send(packet, address)
            self.stats.forwarded += 1
        if not seq & PROBE_SEQ_BIT:
            self._store_block(seq, packet[wire.HEADER_BYTES:])

    def _store_block(self, seq: int, payload: bytes | bytearray) -> None:
        with self._cond:
            for round_ in self._rounds.values():
                if not round_.applied and (block := round_.offset(seq)) < round_.num_blocks:
                    if round_.put(block, payload):
                        self._apply_ready()
                    return
            self._pending[seq] = bytes(payload)
            if len(self._pending) > self.pending_limit:
                del self._pending[next(iter(self._pending))]

    # -- rounds (ps mode) ----------------------------------------------------
    def _apply_ready(self) -> None:
        """Apply complete rounds in order (holding the lock)."""
        while (round_ := self._rounds.get(self._next_apply)) is not None and round_.complete:
            values = qz.dequantize(round_.sums, round_.exponents, self.num_workers, flags=round_.flags).reshape(-1)
            first, k = 0, self.config.width
            for key, size in zip(round_.keys, round_.sizes, strict=True):
                self.handle(self.store, key, values[first * k:first * k + size].copy(), self.num_workers)
                first += blocks_for(size, k)
            round_.applied = True
            round_.sums = round_.sums[:0]
            del self._rounds[self._next_apply]
            self._next_apply += 1
            self.stats.rounds_applied += 1
            self._cond.notify_all()

    def _open_round(self, round_id: int, seq_start: int, keys: list[int], sizes: list[int]) -> _Push:
        k = self.config.width
        nb = sum(blocks_for(size, k) for size in sizes)
        round_ = _Push(round_id, seq_start, keys, sizes, nb, np.zeros((nb, k), qz.WIRE_DTYPE),
                            np.zeros(nb, bool), nb)
        for block in range(nb):
            payload = self._pending.pop((seq_start + block) & SEQ_MASK, None)
            if payload is not None:
                round_.put(block, payload)
        stale = [s for s in self._pending if 0 < (seq_start - s) & SEQ_MASK < _HALF_SEQ_SPACE]
        for seq in stale:
            del self._pending[seq]
        self._rounds[round_id] = round_
        return round_

    # -- TCP -----------------------------------------------------------------
    def _handle(self, frame: Frame) -> Reply:
        self.stats.requests += 1
        return dispatch(frame, self._handlers, job_id=self.config.job_id, secret=self.config.secret,
                        on_bad_secret=self._count_bad_secret, server="this PS")

    def _count_bad_request(self, message: str) -> None:
        self.stats.bad_requests += 1

    def _count_bad_secret(self) -> None:
        self.stats.bad_secret += 1

    def _op_hello(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        rank = int(header["rank"])
        if not 0 <= rank < self.num_workers:
            raise ValueError(f"rank {rank} not in 0..{self.num_workers - 1}")
        address = resolve(Endpoint(str(header["host"]), int(header["port"])))
        with self._cond:
            if self.aggregator is not None:
                self.aggregator.register(rank, address)
            self.workers[rank] = address
        return {"ok": True, "mode": self.mode, "num_workers": self.num_workers,
                "slot_count": slot_count_of(self.config)}, b""

    def _coordinator(self) -> FailoverCoordinator:
        if self.failover is None:
            raise ValueError(f"a {self.mode} job has no failover (its PS aggregates every exchange already)")
        return self.failover

    def _op_failover_vote(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        address = resolve(Endpoint(str(header["host"]), int(header["port"])))
        return {"ok": True, **self._coordinator().vote(int(header["rank"]), int(header["epoch"]),
                                                       int(header["index"]), address)}, b""

    def _op_failover_withdraw(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        return {"ok": True, **self._coordinator().withdraw(int(header["rank"]), int(header["epoch"]))}, b""

    def _op_failover_route(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        return {"ok": True, **self._coordinator().route(int(header["index"]), int(header["rounds_away"]))}, b""

    def _op_switch_back(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        self._coordinator().switch_back(bool(header.get("fresh", False)))
        return {"ok": True}, b""

    def _op_commit(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header, blob = frame.header, frame.blob
        round_id, seq_start = int(header["round"]), int(header["seq_start"]) & SEQ_MASK
        keys, sizes = [int(k) for k in header["keys"]], [int(s) for s in header["sizes"]]
        nb = sum(blocks_for(size, self.config.width) for size in sizes)
        if len(keys) != len(sizes) or len(blob) != 2 * nb:
            raise ValueError(f"commit of round {round_id}: {len(keys)} keys, {len(sizes)} sizes, "
                             f"{len(blob)} bytes of exponents and flags for {nb} blocks")
        exponents = np.frombuffer(blob, np.int8, nb).copy()
        flags = np.frombuffer(blob, np.uint8, nb, nb).copy()
        with self._cond:
            if round_id < self._next_apply:
                return {"ok": True, "missing": []}, b""
            round_ = self._rounds.get(round_id)
            if round_ is None:
                round_ = self._open_round(round_id, seq_start, keys, sizes)
            elif (round_.seq_start, round_.keys, round_.sizes) != (seq_start, keys, sizes):
                raise ValueError(f"round {round_id}: this worker's push differs from another worker's "
                                 f"(keys/sizes/seq); all workers must push the same keys in the same order")
            if round_.exponents is None:
                round_.exponents, round_.flags = exponents, flags
            self._apply_ready()
            deadline = time.monotonic() + self.commit_grace
            while round_.missing and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            return {"ok": True, "missing": round_.missing_seqs()}, b""

    def _op_repair(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header, blob = frame.header, frame.blob
        round_id, seqs = int(header["round"]), [int(s) for s in header["seqs"]]
        payload = 4 * self.config.width
        if len(blob) != len(seqs) * payload:
            raise ValueError(f"repair: {len(blob)} bytes for {len(seqs)} blocks")
        with self._cond:
            round_ = self._rounds.get(round_id)
            if round_ is None:
                return {"ok": True, "missing": []}, b""  # applied already
            for i, seq in enumerate(seqs):
                block = round_.offset(seq)
                if block >= round_.num_blocks:
                    raise ValueError(f"repair: seq {seq} is not part of round {round_id}")
                if round_.put(block, blob[i * payload:(i + 1) * payload]):
                    self.stats.repaired_blocks += 1
            missing = round_.missing_seqs()
            self._apply_ready()
        return {"ok": True, "missing": missing}, b""

    def _op_pull(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        keys, after = [int(k) for k in header["keys"]], int(header.get("after_round", -1))
        timeout = min(float(header.get("timeout", self.pull_timeout)), self.pull_timeout)
        with self._cond:
            if not self._cond.wait_for(lambda: self._next_apply > after, timeout):
                raise ValueError(f"push round {after} not applied within {timeout:.1f} s "
                                 f"({self._next_apply} applied)")
            unknown = [k for k in keys if k not in self.store]
            if unknown:
                raise KeyError(f"no value stored for key(s) {unknown}")
            values = [self.store[k] for k in keys]
            data = b"".join(np.ascontiguousarray(v, np.float32).tobytes() for v in values)
        return {"ok": True, "sizes": [int(v.size) for v in values]}, data

    def _op_init(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header, blob = frame.header, frame.blob
        keys, sizes = [int(k) for k in header["keys"]], [int(s) for s in header["sizes"]]
        values = np.frombuffer(blob, np.float32)
        if len(keys) != len(sizes) or values.size != sum(sizes):
            raise ValueError(f"init: {len(keys)} keys, sizes {sizes}, {values.size} values")
        with self._cond:
            start = 0
            for key, size in zip(keys, sizes, strict=True):
                self.store[key] = values[start:start + size].copy()
                start += size
        return {"ok": True}, b""


def _bind_pair(address: tuple[str, int], attempts: int = 20) -> tuple[socket.socket, socket.socket]:
    """A UDP and a listening TCP socket on the same port; port 0 picks one free for both.

    A named port is tried once: OSError (errno kept) naming the port and the protocol that failed.
    """
    host, port = address
    for attempt in range(attempts):
        try:
            udp = udp_socket(address)
        except OSError as err:
            raise OSError(err.errno, f"the PS cannot bind UDP {host}:{port}: {err.strerror}") from err
        try:
            return udp, listen(udp.getsockname())
        except OSError as err:
            bound = udp.getsockname()[1]
            udp.close()
            # An ephemeral UDP port may be some TCP connection's local port: try another one.
            if port == 0 and err.errno == errno.EADDRINUSE and attempt < attempts - 1:
                continue
            tried = f" (UDP port 0 gave {bound}; {attempt + 1} tries)" if port == 0 else ""
            raise OSError(err.errno, f"the PS cannot bind TCP {host}:{bound}, the port of its UDP socket"
                                     f"{tried}: {err.strerror}") from err
    raise AssertionError("unreachable")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run the PS of one job until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m netagg.hoststack.server", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="the job's YAML config (any rank's); default: DMLC_*/NETAGG_* env")
    parser.add_argument("--bind", type=endpoint_arg, help="HOST:PORT to listen on instead of the config's ps")
    parser.add_argument("--handle", choices=("sum", "sgd"), default="sum", help="what a push does (default sum)")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate of --handle sgd")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = WorkerConfig.load(args.config) if args.config else config_from_env(role="server")
        server = KVServer(config, SGD(args.lr) if args.handle == "sgd" else sum_store, bind=args.bind)
    except (ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    stop = stop_event()
    with server:
        print(f"netagg PS: job {config.job_id} ({config.mode}, {config.num_workers} workers) on "
              f"{server.address[0]}:{server.address[1]} (udp+tcp)", flush=True)
        while not stop.wait(0.5):
            pass
    print(f"netagg PS: stopped; {server.stats}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
