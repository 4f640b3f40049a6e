"""Sparse push/pull (Libra): hot rows of a large table summed in the switch, the rest at the PS.

``table = worker.sparse_table(table=0, num_rows=10**8, width=16)`` gives PS-lite style
``push(keys, rows)`` and ``pull(keys=None)`` for an embedding-like table: ``keys`` are
sorted, unique row ids, ``rows`` their ``(len(keys), width)`` values touched this
iteration. Every worker pushes every table once per iteration (possibly no rows), in
the same order as its other collective calls; ``pull`` returns the aggregate (sum over
workers) of the last push: the asked rows (zeros for rows nobody pushed), or with no
keys every hot row and every cold row some worker pushed, as ``(keys, rows)``.

Placements:

* ``libra``: the rows of the current hot set travel as dense blocks through the switch
  (zeros where this worker did not touch a row); the others go to the job's PS as
  key/value data. The hot set has ``capacity`` rows: ``hot_rounds`` rounds of the job's
  slots, ``slot_count * K * hot_rounds // width``. The workers sample their key
  frequencies (:class:`~netagg.hoststack.hotset.FrequencySampler`) and report them every
  ``report_every`` iterations; the PS chooses the hot set, which changes only between
  two iterations, on every worker at once (see :mod:`~netagg.hoststack.sparse_store`).
  A row is hot only if about ``min_touches`` workers touch it per iteration (default: the
  break-even ``4w / (4w + 8)`` of a dense row against a key/value row on the PS's link,
  which all workers share), so a large slot budget is not filled with rarely used rows.
* ``ps``: every row goes to the PS (the PS-lite baseline).
* ``switch``: the whole table goes through the switch densely every iteration (no PS;
  sensible only for a table that is small next to the data the job moves anyway).

Updates: with ``update="sum"`` (the default) a pull returns aggregates as above. With
``update="sgd"`` the table holds weights (PS-lite's usual embedding table): the PS owns
the cold rows and applies ``w -= lr / N * aggregate``, every worker keeps a replica of the
hot rows and applies the same step to the switch's sums, and ``pull(keys)`` returns the
current weights of ``keys`` (hot rows locally, the others from the PS). When the hot set
changes the weights move with the rows (see :mod:`~netagg.hoststack.sparse_store`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from netagg import wire
from netagg.hoststack import quantization as qz
from netagg.hoststack.hotset import COUNT_DTYPE, KEY_DTYPE, FrequencySampler, HotSet
from netagg.hoststack.sparse_store import (
    PLACEMENTS,
    ROW_DTYPE,
    TableSpec,
    check_rows,
    initial_rows,
    pack_arrays,
    unpack_arrays,
)

if TYPE_CHECKING:
    from netagg.hoststack.kv import KVWorker

__all__ = ["PLACEMENTS", "HotSetMismatch", "SparseTable"]


class HotSetMismatch(ValueError):
    """The workers' dense hot rows of one iteration were laid out by different hot sets."""


class SparseTable:
    """One sparse table of a worker (see the module docstring); made by ``KVWorker.sparse_table``."""

    def __init__(self, worker: KVWorker, table: int, num_rows: int, width: int, *, placement: str = "libra",
                 hot_rounds: int = 1, capacity: int | None = None, report_every: int = 10, decay: float = 0.8,
                 sample_rate: float = 0.5, min_gain: float = 0.05, min_touches: float | None = None,
                 update: str = "sum", lr: float = 0.0, init_scale: float = 0.01, seed: int = 0) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
        if hot_rounds < 1:
            raise ValueError(f"hot_rounds must be >= 1, got {hot_rounds}")
        config = worker.config
        if capacity is None:
            capacity = {"ps": 0, "switch": num_rows}.get(placement, config.slot_count * wire.K * hot_rounds // width)
        capacity = min(capacity, num_rows)
        if min_touches is None:  # break-even: a worker's dense row (4w bytes) vs a key/value row (4w + 8 bytes)
            min_touches = 4 * width / (4 * width + 8)
        self.spec = TableSpec(table, num_rows, width, placement, capacity, report_every, min_gain, update, lr,
                              init_scale if update == "sgd" else 0.0, seed, min_touches)
        self._sgd = update == "sgd"
        self._step = np.float32(lr / config.num_workers)
        self.worker = worker
        self.rank = config.rank
        #: The next iteration this worker pushes; the hot set it holds and from which iteration on.
        self.iteration = 0
        self.hot = HotSet(0, 0, np.arange(num_rows, dtype=KEY_DTYPE)) if placement == "switch" else HotSet.empty()
        #: sgd: this worker's replica of the hot rows' weights (aligned with ``hot.keys``), and the rows that
        #: left the hot set with their weights until rank 0 handed them over to the PS.
        self.hot_weights = initial_rows(self.hot.keys, width, self.spec.init_scale, seed) if self._sgd \
            else np.empty((0, width), ROW_DTYPE)
        self._leaving: tuple[np.ndarray, np.ndarray] | None = None
        self._hot_known_for = 0
        self._sampler = FrequencySampler(decay, sample_rate, max(4 * capacity, 1024), seed=seed * 7919 + self.rank)
        #: The last push: its iteration, the hot set it used and the dense aggregate of its hot rows.
        self._last: tuple[int, np.ndarray, np.ndarray] | None = None
        self.stats: dict[str, float] = {"hot_rows": 0, "cold_rows": 0, "pulled_rows": 0, "syncs": 0, "hot_changes": 0,
                                        "ps_push_seconds": 0.0, "ps_pull_seconds": 0.0, "switch_seconds": 0.0}
        self._ps = worker.ps_connection() if placement != "switch" else None
        if self._ps is not None:
            worker.call(self._request, {"op": "sparse_open", **self.spec.fields()})

    # -- API -------------------------------------------------------------------
    def push(self, keys: Any, rows: Any) -> int:
        """Aggregate this iteration's ``rows`` of ``keys`` (sorted, unique) with the job; returns a timestamp."""
        keys = np.ascontiguousarray(keys, dtype=KEY_DTYPE)
        rows = np.array(rows, dtype=ROW_DTYPE, copy=True).reshape(keys.size, -1) if np.size(rows) or keys.size \
            else np.empty((0, self.spec.width), ROW_DTYPE)
        check_rows(keys, rows, self.spec.num_rows, self.spec.width)
        return self.worker.submit(self._push, keys, rows)

    def pull(self, keys: Any = None) -> int:
        """The last push's aggregate (sum) or the weights after it (sgd) of ``keys``; sum: ``(keys, rows)`` of all."""
        if keys is None and self._sgd:
            raise ValueError("a pull of weights names its rows")
        if keys is not None:
            keys = np.ascontiguousarray(keys, dtype=KEY_DTYPE)
            check_rows(keys, np.empty((keys.size, 0), ROW_DTYPE), self.spec.num_rows, 0)
        return self.worker.submit(self._pull, keys)

    def pushpull(self, keys: Any, rows: Any, pull_keys: Any = None) -> Any:
        """push, then pull (``pull_keys``, or every aggregated row); returns the pull's value."""
        self.worker.wait(self.push(keys, rows))
        return self.worker.wait(self.pull(pull_keys))

    @property
    def hot_coverage(self) -> tuple[int, int]:
        """(hot, cold) rows this worker pushed so far."""
        return self.stats["hot_rows"], self.stats["cold_rows"]

    # -- engine thread -----------------------------------------------------------
    def _request(self, header: dict[str, Any], blob: bytes = b"") -> tuple[dict[str, Any], bytearray]:
        assert self._ps is not None
        header = {"job_id": self.worker.config.job_id, "table": self.spec.table, **header}
        timeout = self.worker.ps_timeout
        return self._ps.request({**header, "timeout": timeout}, blob, timeout=timeout + 5)

    def _learn(self, response: dict[str, Any], blob: memoryview) -> None:
        """Take the hot set a sync or pull response announces (its keys come only when the version is new)."""
        hot_count, arriving = int(response["hot_count"]), int(response["arriving"])
        if hot_count < 0:
            if len(blob):
                raise ValueError(f"{len(blob)} unexpected bytes after the response")
            return
        keys, new_keys, new_rows = unpack_arrays(blob, (KEY_DTYPE, hot_count, 0), (KEY_DTYPE, arriving, 0),
                                                 (ROW_DTYPE, arriving, self.spec.width))
        if self._sgd:
            weights = np.empty((keys.size, self.spec.width), ROW_DTYPE)
            kept = np.isin(keys, self.hot.keys, assume_unique=True)
            weights[kept] = self.hot_weights[np.searchsorted(self.hot.keys, keys[kept])]
            if not np.array_equal(keys[~kept], new_keys):
                raise ValueError(f"the PS sent weights of {new_keys.size} arriving rows, expected {(~kept).sum()}")
            weights[~kept] = new_rows
            gone = ~np.isin(self.hot.keys, keys, assume_unique=True)
            self._leaving = (self.hot.keys[gone], self.hot_weights[gone])
            self.hot_weights = weights
        self.hot = HotSet(int(response["hot_version"]), int(response["hot_effective"]), keys)
        self.stats["hot_changes"] += 1

    def _push(self, keys: np.ndarray, rows: np.ndarray) -> None:
        t = self.iteration
        if self._ps is not None and self._hot_known_for < t:  # the previous iteration was not pulled
            response, blob = self._request({"op": "sparse_sync", "iteration": t, "version": self.hot.version})
            self._learn(response, memoryview(blob))
            self._hot_known_for = t
            self.stats["syncs"] += 1
        hot_keys = self.hot.keys
        where = np.searchsorted(hot_keys, keys)
        is_hot = where < hot_keys.size
        is_hot[is_hot] = hot_keys[where[is_hot]] == keys[is_hot]
        if self.spec.placement == "libra":
            self._sampler.observe(keys)
        if self._ps is not None:
            cold = ~is_hot
            header = {"op": "sparse_push", "rank": self.rank, "iteration": t, "version": self.hot.version,
                      "count": int(cold.sum())}
            arrays = [keys[cold], rows[cold]]
            if self.spec.placement == "libra" and (t + 1) % self.spec.report_every == 0:
                report_keys, report_counts = self._sampler.report(2 * self.spec.capacity)
                header["report_count"] = int(report_keys.size)
                arrays += [report_keys, report_counts.astype(COUNT_DTYPE)]
            if self._leaving is not None and t == self.hot.effective:
                if self.rank == 0:  # everyone holds the same weights; one copy is enough
                    header["handover_count"] = int(self._leaving[0].size)
                    arrays += list(self._leaving)
                self._leaving = None
            # The PS's answer is read after the switch exchange: both transfers overlap. A worker on another
            # hot set than the others cannot corrupt the switch's sums meanwhile: the exchange checks that
            # every worker used the same version (its last block) and discards the sums otherwise.
            started = time.perf_counter()
            self._ps.begin({"job_id": self.worker.config.job_id, "table": self.spec.table, **header},
                           pack_arrays(*arrays))
            self.stats["ps_push_seconds"] += time.perf_counter() - started
        try:
            aggregate = np.empty((0, self.spec.width), ROW_DTYPE)
            if hot_keys.size:
                dense = np.zeros(hot_keys.size * self.spec.width, np.float32)
                dense.reshape(hot_keys.size, self.spec.width)[where[is_hot]] = rows[is_hot]
                started = time.perf_counter()
                aggregate = self._exchange(dense, t).reshape(hot_keys.size, self.spec.width)
                self.stats["switch_seconds"] += time.perf_counter() - started
        finally:
            if self._ps is not None:
                started = time.perf_counter()
                self._ps.finish()
                self.stats["ps_push_seconds"] += time.perf_counter() - started
        if self._sgd and hot_keys.size:
            self.hot_weights -= self._step * aggregate
        self._last = (t, hot_keys, aggregate)
        self.iteration = t + 1
        self.stats["hot_rows"] += int(is_hot.sum())
        self.stats["cold_rows"] += int(keys.size - is_hot.sum())

    def _exchange(self, dense: np.ndarray, iteration: int) -> np.ndarray:
        """The switch's sum of every worker's dense hot rows (float32, flat); HotSetMismatch if versions differ.

        A last block carries ``v + 1`` and ``(v + 1)**2`` for this worker's version ``v`` (mod 4096): small
        integers, summed exactly. All versions are equal exactly when ``N * sum((v+1)**2) == sum(v+1)**2``.
        """
        n = self.worker.num_workers
        blocks = np.zeros((-(-dense.size // wire.K) + 1, wire.K), np.float32)
        blocks.reshape(-1)[:dense.size] = dense
        tag = float(self.hot.version % 4096 + 1)
        blocks[-1, :2] = (tag, tag * tag)
        sums, global_exp = self.worker.transport.exchange(blocks, qz.block_exponents(blocks))
        values = qz.dequantize(sums, global_exp, n)
        total, squares = float(values[-1, 0]), float(values[-1, 1])
        if total != n * tag or n * squares != total * total:
            raise HotSetMismatch(f"sparse table {self.spec.table}, iteration {iteration}: the workers used "
                                 f"different hot sets (this worker: version {self.hot.version}); the switch's "
                                 f"sums were discarded")
        return values.reshape(-1)[:dense.size]

    def _pull(self, keys: np.ndarray | None) -> Any:
        if self._sgd:  # weights exist before the first push: iteration -1 is the initial state
            t, hot_keys, hot_rows = self.iteration - 1, self.hot.keys, self.hot_weights
        elif self._last is None:
            raise KeyError(f"sparse table {self.spec.table}: nothing was pushed yet")
        else:
            t, hot_keys, hot_rows = self._last
        if self._sgd:  # the replica, and the rows that left it until rank 0 hands them over: the PS's are stale
            hot_keys, hot_rows = self.hot.keys, self.hot_weights
            if self._leaving is not None:
                hot_keys = np.concatenate([hot_keys, self._leaving[0]])
                order = np.argsort(hot_keys)
                hot_keys, hot_rows = hot_keys[order], np.concatenate([hot_rows, self._leaving[1]])[order]
        cold_keys, cold_rows, response, rest = np.empty(0, KEY_DTYPE), np.empty((0, self.spec.width), ROW_DTYPE), \
            None, memoryview(b"")
        if self._ps is not None:
            asked = keys if keys is None else keys[~np.isin(keys, hot_keys, assume_unique=True)]
            header = {"op": "sparse_pull", "iteration": t, "version": self.hot.version,
                      "count": -1 if asked is None else int(asked.size)}
            started = time.perf_counter()
            response, blob = self._request(header, b"" if asked is None else pack_arrays(asked))
            self.stats["ps_pull_seconds"] += time.perf_counter() - started
            count, width = int(response["count"]), self.spec.width
            split = count * (KEY_DTYPE.itemsize + 4 * width)
            cold_keys, cold_rows = unpack_arrays(memoryview(blob)[:split], (KEY_DTYPE, count, 0),
                                                 (ROW_DTYPE, count, width))
            rest = memoryview(blob)[split:]
        if keys is None:
            all_keys = np.concatenate([hot_keys, cold_keys])
            order = np.argsort(all_keys, kind="stable")
            result: Any = (all_keys[order], np.concatenate([hot_rows, cold_rows])[order])
        else:
            result = np.zeros((keys.size, self.spec.width), ROW_DTYPE)
            where = np.searchsorted(hot_keys, keys)
            is_hot = where < hot_keys.size
            is_hot[is_hot] = hot_keys[where[is_hot]] == keys[is_hot]
            result[is_hot] = hot_rows[where[is_hot]]
            if cold_keys.size:
                result[~is_hot] = cold_rows
        self.stats["pulled_rows"] += len(result[0]) if keys is None else keys.size
        if response is not None:
            self._learn(response, rest)
            self._hot_known_for = t + 1
        return result
