"""PS-lite style worker API over in-network aggregation.

``KVWorker(config)`` gives ``push``/``pull``/``pushpull`` returning a timestamp,
``wait(ts)`` and ``allreduce(array)``. Operations run one after another, in call order,
on one background thread (every worker of a job must issue the same pushes in the same
order: they are collective). Arguments are validated and copied when the call is made,
so the caller may reuse its arrays. NaN and inf are summed as the protocol says (a block
that met one is NaN or inf on every rank, docs/protocol.md "Non-finite values"); a call
whose arguments are refused aborts the collective on every rank (``OutOfStep`` there), and
a failed collective leaves the worker unusable ("Collectives out of step").

What ``pull`` returns depends on the mode:

* ``allreduce`` and ``fallback``: the aggregate (sum over workers) of the last push of
  each key, kept by this worker.
* ``ps``: the parameter server's value after its handle applied this worker's pushes
  (sum store by default, or SGD weights).
"""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from netagg import wire
from netagg.hoststack import blocks as blk
from netagg.hoststack import quantization as qz
from netagg.hoststack.envconfig import config_from_env
from netagg.hoststack.failover import FailoverClient
from netagg.hoststack.metrics import WorkerExporter, port_from_env
from netagg.hoststack.moves import MoveClient, MoveError
from netagg.hoststack.packets import SEQ_MASK
from netagg.hoststack.sparse import SparseTable
from netagg.hoststack.threads import ThreadedTransport
from netagg.hoststack.transport import RTO_FLOOR, SubsetRound, Transport, TransportError
from netagg.jobconfig import ConfigError, WorkerConfig, resolve
from netagg.psproto import PsClient, PsError

__all__ = ["KVWorker", "PsError"]

#: Blocks per REPAIR request.
_REPAIR_BATCH = 4096


class KVWorker:
    """One worker of a job (see the module docstring)."""

    def __init__(
        self,
        config: WorkerConfig | None = None,
        *,
        progress_timeout: float = 10.0,
        ps_timeout: float = 30.0,
        rto_initial: float = 0.05,
        rto_min: float = RTO_FLOOR,
        rto_max: float = 1.0,
        max_backoff: int = 2,
        congestion_control: bool = True,
        metrics_port: int | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        """``metrics_port`` (or ``NETAGG_METRICS_PORT``): serve the transport's counters to Prometheus
        on that port (0: any free one; see ``metrics_address``); default: no exporter. ``sock``: a UDP
        socket already bound to the config's port (see :class:`Transport`)."""
        self.config = config if config is not None else config_from_env()
        self.mode = self.config.mode
        #: The job's workers (over a tree of switches the whole job's, not this worker's leaf segment's).
        self.num_workers = self.config.total_workers
        config = self.config
        #: Failover to the job's PS when the switch stays away (hoststack/failover.py); it waits for the
        #: other workers' votes as long as an exchange waits for a result.
        self._failover = FailoverClient(resolve(config.ps), config.job_id, config.rank, config.failover_after,
                                        progress_timeout, config.secret) \
            if config.ps is not None and config.mode in ("allreduce", "ps") and config.failover_after > 0 \
            and config.threads == 1 else None
        options = dict(progress_timeout=progress_timeout, rto_initial=rto_initial, rto_min=rto_min, rto_max=rto_max,
                       max_backoff=max_backoff, congestion_control=congestion_control)
        if config.threads > 1:  # the job's slots over several threads (hoststack/threads.py): no failover
            self.transport: Transport | ThreadedTransport = ThreadedTransport(self.config, sock=sock, **options)
        else:
            self.transport = Transport(self.config, sock=sock, failover=self._failover, **options)
        self.ps_timeout = ps_timeout
        #: The controller's moves of the job's slots (hoststack/moves.py): followed where the config names the
        #: controller and the job's slots are one range on one switch, on one thread.
        self._moves = MoveClient(config) if config.controller is not None and isinstance(self.transport, Transport) \
            and config.mode == "allreduce" and config.total_workers == config.num_workers else None
        self._ps: PsClient | None = None
        self._exporter: WorkerExporter | None = None
        #: ps mode: the PS keeps the values (pull asks it); otherwise this worker keeps the aggregates.
        self._ps_store = self.mode == "ps"
        # Register this worker's UDP address with the job's PS: in ps mode for its results; in fallback
        # mode when the job has a secret, as the only address the PS accepts this rank's packets from.
        if self.mode == "ps" or (self.mode == "fallback" and self.config.secret):
            try:
                host, port = self.transport.address
                self.ps_connection().request({"op": "hello", "job_id": self.config.job_id,
                                              "rank": self.config.rank, "host": host, "port": port})
            except BaseException:
                self.transport.close()
                if self._ps is not None:
                    self._ps.close()
                raise
        try:
            port = metrics_port if metrics_port is not None else port_from_env()
            if port is not None:
                self._exporter = WorkerExporter(self.transport, port)
        except BaseException:
            self.transport.close()
            if self._ps is not None:
                self._ps.close()
            raise
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"netagg-kv{self.config.rank}")
        #: Deadline allreduces (:meth:`allreduce`): per (tag, shape, dtype), this worker's values that missed their
        #: rounds, added to the next call's input; and how many blocks were carried so far.
        self._carry: dict[tuple, np.ndarray] = {}
        self.deadline_carry = 0
        self._futures: dict[int, Future] = {}
        self._ts = itertools.count()
        self._lock = threading.Lock()
        self._store: dict[int, tuple[np.ndarray, tuple[int, ...]]] = {}
        self._pushes = 0  # ps mode: pushes committed (the PS applies them in this order)

    # -- PS-lite API -----------------------------------------------------------
    def push(self, keys: Sequence[int] | int, values: Sequence[Any] | Any) -> int:
        """Aggregate ``values`` for ``keys`` with the job; returns a timestamp for :meth:`wait`."""
        layout, blocks, exponents, flags = self._pack(keys, values)
        return self._submit(self._push, layout, blocks, exponents, flags, False)

    def pull(self, keys: Sequence[int] | int, out: Sequence[np.ndarray] | None = None) -> int:
        """Fetch the values of ``keys``; ``wait(ts)`` returns them (also written into ``out`` if given)."""
        keys = [blk.check_key(k) for k in ([keys] if isinstance(keys, int | np.integer) else keys)]
        if out is not None and len(out) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(out)} output arrays")
        return self._submit(self._pull, keys, out)

    def pushpull(self, keys: Sequence[int] | int, values: Sequence[Any] | Any,
                 out: Sequence[np.ndarray] | None = None) -> int:
        """push then pull the same keys; ``wait(ts)`` returns the pulled values."""
        layout, blocks, exponents, flags = self._pack(keys, values)
        if out is not None and len(out) != len(layout.keys):
            self._refuse(ValueError(f"{len(layout.keys)} keys but {len(out)} output arrays"))
        return self._submit(self._pushpull, layout, blocks, exponents, flags, out)

    def wait(self, ts: int, timeout: float | None = None) -> Any:
        """Block until operation ``ts`` finished; returns its result (pull values or None), raises its error."""
        with self._lock:
            future = self._futures.pop(ts, None)
        if future is None:
            raise KeyError(f"unknown or already waited-for timestamp {ts}")
        return future.result(timeout)

    def allreduce(self, array: Any, *, tag: int = 0, deadline: float | None = None) -> Any:
        """The sum of ``array`` over all workers, with its shape and dtype (nothing is stored).

        ``tag``: a number naming this collective beside its order and size (``wire.exchange_id``): ranks whose
        calls differ in it raise ``OutOfStep`` rather than sum (docs/protocol.md, "Collectives out of step").

        ``deadline`` (seconds; every rank passes the same): the collective does not wait for a late worker more
        than that: its rounds close with the contributions that arrived, and every rank returns the same sums.
        The values of this worker that missed their round are kept and added to its next ``deadline`` call's
        input with the same ``tag`` and shape (error feedback): nothing is lost, it arrives a step later
        (:attr:`deadline_carry`). Raises ``TransportError`` if this worker could not learn some block's sum.
        A job that opted in (``deadline_ms``) passes :attr:`job_deadline` where its gradients are summed (the DDP
        hook does, per bucket); never for values that must be exact (a loss, a count, a flag)."""
        if deadline is None:
            layout, blocks, exponents, flags = self._pack([0], [array])
            future = self._executor.submit(self._aggregate, blocks, exponents, flags, tag)
            return blk.unpack(layout, future.result())[0]
        if not deadline > 0:
            raise ValueError(f"deadline: expected seconds > 0, got {deadline!r}")
        if not isinstance(self.transport, Transport):
            raise ValueError("a deadline allreduce needs the job's slots on one thread (threads: 1)")
        if self.config.mode not in ("allreduce", "fallback"):
            raise ValueError(f"a deadline allreduce needs the switch or the PS's aggregator (mode allreduce or "
                             f"fallback, not {self.config.mode})")
        if self.config.mode == "fallback" and not self.config.secret:
            raise ValueError("a deadline allreduce through the PS needs the job's secret: with it every rank registers "
                             "its address at start, so the PS sends each closed round's result to the whole job (a "
                             "late rank learns the sums it missed from them); without it the PS learns addresses "
                             "only from contributions")
        values = np.asarray(array)
        key = (tag, values.shape, values.dtype.str)
        carry = self._carry.pop(key, None)
        if carry is not None:
            values = values + carry
        layout, blocks, exponents, flags = self._pack([0], [values])
        future = self._executor.submit(self._aggregate_deadline, blocks, exponents, flags, tag, deadline)
        total, missed = future.result()
        if missed.any():  # this worker's values of those blocks are in no sum: they join the next call
            mask = np.repeat(missed, layout.width)[:values.size].reshape(values.shape)
            self._carry[key] = np.where(mask, values, 0).astype(values.dtype)
            self.deadline_carry += int(missed.sum())
        return blk.unpack(layout, total)[0]

    @property
    def job_deadline(self) -> float | None:
        """The job's deadline for its gradient allreduces in seconds (its config's ``deadline_ms``), None if the
        job did not opt in."""
        return self.config.deadline_ms / 1000.0 if self.config.deadline_ms else None

    def allreduce_subset(self, array: Any, subset: SubsetRound) -> Any:
        """The sum of ``array`` over ``subset.members`` only (a subset round; every member calls it alike).

        After the first one, this worker's whole-job :meth:`allreduce`/push are refused (see
        :meth:`Transport.exchange_subset`)."""
        layout, blocks, exponents, flags = self._pack([0], [array])
        future = self._executor.submit(self._aggregate_subset, blocks, exponents, flags, subset)
        return blk.unpack(layout, future.result())[0]

    def init(self, keys: Sequence[int] | int, values: Sequence[Any] | Any) -> int:
        """Set initial values: at the PS in ps mode (e.g. SGD weights), locally otherwise."""
        keys, values = _listify(keys, values)
        layout, blocks = blk.pack(keys, values, self.config.width)
        flat, k = blocks.reshape(-1), layout.width
        arrays = [flat[s.first_block * k:s.first_block * k + s.size].copy() for s in layout.segments]
        return self._submit(self._init, layout.keys, arrays, [s.shape for s in layout.segments])

    def sparse_table(self, table: int, num_rows: int, width: int, **options: Any) -> SparseTable:
        """A sparse (Libra) table of this job: see :mod:`netagg.hoststack.sparse` for the options."""
        return SparseTable(self, table, num_rows, width, **options)

    def submit(self, fn: Any, *args: Any) -> int:
        """Run ``fn(*args)`` on the engine thread after every earlier call; returns a timestamp for :meth:`wait`."""
        return self._submit(fn, *args)

    def call(self, fn: Any, *args: Any) -> Any:
        """``submit`` and wait: ``fn(*args)``'s result, in call order with the other operations."""
        return self.wait(self._submit(fn, *args))

    def ps_connection(self) -> PsClient:
        """The connection to the job's PS, opened at the first use; ConfigError without a PS."""
        if self._ps is None:
            if self.config.ps is None:
                raise ConfigError(f"job {self.config.job_id} has no parameter server (create it with --ps)")
            self._ps = PsClient(resolve(self.config.ps), timeout=self.ps_timeout, secret=self.config.secret)
        return self._ps

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) of the Prometheus exporter, or None without one."""
        return self._exporter.address if self._exporter is not None else None

    def close(self) -> None:
        """Finish queued operations, then release the sockets (and stop the exporter)."""
        self._executor.shutdown(wait=True)
        if self._moves is not None:
            self._moves.close()
        if self._exporter is not None:
            self._exporter.stop()
        self.transport.close()
        if self._failover is not None:
            self._failover.close()
        if self._ps is not None:
            self._ps.close()

    def __enter__(self) -> KVWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- caller thread ---------------------------------------------------------
    def _pack(self, keys: Sequence[int] | int, values: Sequence[Any] | Any
              ) -> tuple[blk.Layout, np.ndarray, np.ndarray, np.ndarray | None]:
        """A collective's blocks, exponents and non-finite flags; an input refused here aborts the collective on
        every rank (:meth:`_refuse`)."""
        try:
            keys, values = _listify(keys, values)
            layout, blocks = blk.pack(keys, values, self.config.width)
            exponents, flags = qz.inspect(blocks)
        except Exception as err:
            self._refuse(err)
        return layout, blocks, exponents, flags

    def _refuse(self, err: Exception) -> None:
        """Raise ``err`` for a collective this worker cannot take part in, after queueing the abort that makes
        the job's other ranks raise too (``Transport.abort``, in call order with the earlier operations)."""
        self._executor.submit(self.transport.abort, f"{type(err).__name__}: {err}")
        raise err

    # -- engine thread -------------------------------------------------------
    def _submit(self, fn: Any, *args: Any) -> int:
        ts = next(self._ts)
        future = self._executor.submit(fn, *args)
        with self._lock:
            self._futures[ts] = future
        return ts

    def follow_moves(self) -> None:
        """Before a whole-job exchange: switch to the job's new slots where the controller moved them here."""
        if self._moves is None:
            return
        transport = self.transport
        assert isinstance(transport, Transport)
        try:
            moved = self._moves.before_exchange(transport.exchange_index, transport.on_ps)
        except MoveError as err:  # the others must not wait for this rank: they raise OutOfStep
            transport.abort(str(err))
            raise TransportError(str(err)) from None
        if moved is not None:
            transport.resize(moved)
            self.config = moved

    @property
    def moves(self) -> int:
        """Moves of the job's slots this worker followed (its transport took the new slots)."""
        return self.transport.stats.moves

    def _aggregate(self, blocks: np.ndarray, exponents: np.ndarray, flags: np.ndarray | None,
                   tag: int = 0) -> np.ndarray:
        self.follow_moves()
        sums, global_exp, result_flags = self.transport.exchange(blocks, exponents, flags=flags, tag=tag)
        return qz.dequantize(sums, global_exp, self.num_workers, flags=result_flags)

    def _aggregate_deadline(self, blocks: np.ndarray, exponents: np.ndarray, flags: np.ndarray | None, tag: int,
                            deadline: float) -> tuple[np.ndarray, np.ndarray]:
        """A deadline allreduce: the sums, and per block whether this worker's values are in none of them."""
        self.follow_moves()
        t = self.transport
        sums, global_exp, result_flags = t.exchange(blocks, exponents, flags=flags, tag=tag, deadline=deadline)
        members = t.last_members.astype(np.int64)
        closed = (result_flags & wire.FLAG_CLOSE) != 0
        unknown = closed & (members == 0)
        if unknown.any():  # no rank returns a sum of something else: this one fails, and its abort fails the others
            reason = (f"job {self.config.job_id} rank {self.config.rank}: the sums of {int(unknown.sum())} of "
                      f"{blocks.shape[0]} blocks could not be learned (their rounds were closed and superseded while "
                      "this worker's copy of the result was lost): no sum is returned")
            t.abort(reason)
            raise TransportError(reason)
        # A whole-job round's result names no members (everyone is in); a closed round's, and those of the subset
        # rounds that follow it in its slot, name who is.
        missed = (members != 0) & ((members >> self.config.rank) & 1 == 0)
        return qz.dequantize(sums, global_exp, self.num_workers, flags=result_flags), missed

    def _aggregate_subset(self, blocks: np.ndarray, exponents: np.ndarray, flags: np.ndarray | None,
                          subset: SubsetRound) -> np.ndarray:
        sums, global_exp, result_flags = self.transport.exchange_subset(blocks, subset, exponents, flags=flags)
        return qz.dequantize(sums, global_exp, self.num_workers, flags=result_flags)

    def _push(self, layout: blk.Layout, blocks: np.ndarray, exponents: np.ndarray, flags: np.ndarray | None,
              keep: bool) -> list | None:
        self.follow_moves()
        seq_start = self.transport.next_seq
        sums, global_exp, result_flags = self.transport.exchange(blocks, exponents, flags=flags)
        aggregate = qz.dequantize(sums, global_exp, self.num_workers, flags=result_flags).reshape(-1)
        for segment in layout.segments:
            start = segment.first_block * layout.width
            self._store[segment.key] = (aggregate[start:start + segment.size], segment.shape)
        if self._ps_store:
            self._commit(layout, seq_start, sums, global_exp, result_flags)
        return blk.unpack(layout, aggregate) if keep else None

    def _commit(self, layout: blk.Layout, seq_start: int, sums: np.ndarray, global_exp: np.ndarray,
                result_flags: np.ndarray) -> None:
        """Tell the PS the push's layout, exponents and round flags; send it any block it missed."""
        assert self._ps is not None
        round_id = self._pushes
        self._pushes += 1
        base = {"job_id": self.config.job_id, "round": round_id}
        response, _ = self._ps.request({**base, "op": "commit", "seq_start": seq_start, "keys": layout.keys,
                                        "sizes": layout.sizes},
                                       global_exp.astype(np.int8).tobytes() + result_flags.astype(np.uint8).tobytes())
        missing = response["missing"]
        while missing:
            batch = missing[:_REPAIR_BATCH]
            blocks = np.array([(s - seq_start) & SEQ_MASK for s in batch], dtype=np.intp)
            response, _ = self._ps.request({**base, "op": "repair", "seqs": batch},
                                           np.ascontiguousarray(sums[blocks]).tobytes())
            missing = response["missing"]

    def _pull(self, keys: list[int], out: Sequence[np.ndarray] | None) -> list[np.ndarray]:
        if self._ps_store:
            assert self._ps is not None
            response, data = self._ps.request({"op": "pull", "job_id": self.config.job_id, "keys": keys,
                                               "after_round": self._pushes - 1, "timeout": self.ps_timeout},
                                              timeout=self.ps_timeout + 5)
            flat = np.frombuffer(data, np.float32)
            values, start = [], 0
            for key, size in zip(keys, response["sizes"], strict=True):
                shape = self._store[key][1] if key in self._store and np.prod(self._store[key][1]) == size \
                    else (size,)
                values.append(flat[start:start + size].copy().reshape(shape))
                start += size
        else:
            missing = [k for k in keys if k not in self._store]
            if missing:
                raise KeyError(f"key(s) {missing} were never pushed or initialized by this worker")
            values = [self._store[k][0].copy().reshape(self._store[k][1]) for k in keys]
        if out is None:
            return values
        for target, value in zip(out, values, strict=True):
            np.copyto(target, value.reshape(np.shape(target)), casting="same_kind")
        return list(out)

    def _pushpull(self, layout: blk.Layout, blocks: np.ndarray, exponents: np.ndarray, flags: np.ndarray | None,
                  out: Sequence[np.ndarray] | None) -> list:
        if not self._ps_store:
            values = self._push(layout, blocks, exponents, flags, keep=True)
            assert values is not None
            if out is None:
                return values
            for target, value in zip(out, values, strict=True):
                np.copyto(target, np.asarray(value).reshape(np.shape(target)), casting="same_kind")
            return list(out)
        self._push(layout, blocks, exponents, flags, keep=False)
        return self._pull(layout.keys, out)

    def _init(self, keys: list[int], arrays: list[np.ndarray], shapes: list[tuple[int, ...]]) -> None:
        if self._ps_store:
            assert self._ps is not None
            self._ps.request({"op": "init", "job_id": self.config.job_id, "keys": keys,
                              "sizes": [a.size for a in arrays]}, b"".join(a.tobytes() for a in arrays))
        for key, array, shape in zip(keys, arrays, shapes, strict=True):
            self._store[key] = (array, shape)


def _listify(keys: Sequence[int] | int, values: Sequence[Any] | Any) -> tuple[list[int], list[Any]]:
    if isinstance(keys, int | np.integer):
        return [int(keys)], [values]
    return list(keys), list(values)
