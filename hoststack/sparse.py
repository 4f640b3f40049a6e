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
  slots, ``slot_count * k * hot_rounds // width`` (k: the job's packet width). The workers sample their key
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

from netagg.hoststack import quantization as qz
from netagg.hoststack.hotset import COUNT_DTYPE, KEY_DTYPE, FrequencySampler, HotSet
from netagg.hoststack.sparse_store import (
    PLACEMENTS,
    ROW_DTYPE,
    TableSpec,
    check_keys,
    check_rows,
    initial_rows,
    pack_arrays,
    positions,
    unpack_arrays,
)
from netagg.psproto import PsRefused

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
            capacity = {"ps": 0, "switch": num_rows}.get(placement,
                                                         config.slot_count * config.width * hot_rounds // width)
        capacity = min(capacity, num_rows)
        if min_touches is None:  # break-even: a worker's dense row (4w bytes) vs a key/value row (4w + 8 bytes)
            min_touches = 4 * width / (4 * width + 8)
        self.spec = TableSpec(table, num_rows, width, placement, capacity, report_every, min_gain, update, lr,
                              init_scale if update == "sgd" else 0.0, seed, min_touches)
        self._sgd = update == "sgd"
        self._step_size = np.float32(lr / config.num_workers)
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
        return self.worker.submit(self._push, *self._checked(keys, rows))

    def _checked(self, keys: Any, rows: Any) -> tuple[np.ndarray, np.ndarray]:
        keys = np.ascontiguousarray(keys, dtype=KEY_DTYPE)
        rows = np.array(rows, dtype=ROW_DTYPE, copy=True).reshape(keys.size, -1) if np.size(rows) or keys.size \
            else np.empty((0, self.spec.width), ROW_DTYPE)
        check_rows(keys, rows, self.spec.num_rows, self.spec.width)
        return keys, rows

    def pull(self, keys: Any = None) -> int:
        """The last push's aggregate (sum) or the weights after it (sgd) of ``keys``; sum: ``(keys, rows)`` of all."""
        if keys is None and self._sgd:
            raise ValueError("a pull of weights names its rows")
        if keys is not None:
            keys = np.ascontiguousarray(keys, dtype=KEY_DTYPE)
            check_keys(keys, self.spec.num_rows)
        return self.worker.submit(self._pull, keys)

    def pushpull(self, keys: Any, rows: Any, pull_keys: Any = None) -> int:
        """push, then pull ``pull_keys`` (sum: or every aggregated row), overlapped; ``wait`` gives the pull's value.

        With sgd, ``pull_keys`` are typically the next batch's rows: their weights after this push.
        """
        keys, rows = self._checked(keys, rows)
        if pull_keys is None and self._sgd:
            raise ValueError("a pull of weights names its rows")
        if pull_keys is not None:
            pull_keys = np.ascontiguousarray(pull_keys, dtype=KEY_DTYPE)
            check_keys(pull_keys, self.spec.num_rows)
        return self.worker.submit(self._step, keys, rows, True, pull_keys)

    # -- engine thread -----------------------------------------------------------
    def _request(self, header: dict[str, Any], blob: bytes = b"", clock: str | None = None
                 ) -> tuple[dict[str, Any], bytearray]:
        """One request to the PS and its successful answer (time counted in ``stats[clock]``)."""
        self._begin((header, blob), clock)
        return self._finish(1, clock)[0]

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
            where, kept = positions(self.hot.keys, keys)
            weights[kept] = self.hot_weights[where[kept]]
            if not np.array_equal(keys[~kept], new_keys):
                raise ValueError(f"the PS sent weights of {new_keys.size} arriving rows, expected {(~kept).sum()}")
            weights[~kept] = new_rows
            gone = ~np.isin(self.hot.keys, keys, assume_unique=True)
            self._leaving = (self.hot.keys[gone], self.hot_weights[gone])
            self.hot_weights = weights
        self.hot = HotSet(int(response["hot_version"]), int(response["hot_effective"]), keys)
        self.stats["hot_changes"] += 1

    def _push(self, keys: np.ndarray, rows: np.ndarray) -> None:
        self._step(keys, rows, False, None)

    def _step(self, keys: np.ndarray, rows: np.ndarray, pull: bool, pull_keys: np.ndarray | None) -> Any:
        """Push one iteration and, with ``pull``, pull after it: the PS requests travel while the switch sums.

        Both PS requests are sent first (the PS answers them in order on this connection; the pull waits
        until every worker pushed), then the hot rows go through the switch, then the answers are read.
        A worker on another hot set than the others cannot corrupt the switch's sums meanwhile: the
        exchange checks that every worker used the same version (its last block) and discards them otherwise.
        """
        t = self.iteration
        if self._ps is not None and self._hot_known_for < t:  # the previous iteration was not pulled
            response, blob = self._request({"op": "sparse_sync", "iteration": t, "version": self.hot.version})
            self._learn(response, memoryview(blob))
            self._hot_known_for = t
            self.stats["syncs"] += 1
        hot_keys = self.hot.keys
        where, is_hot = positions(hot_keys, keys)
        if self.spec.placement == "libra":
            self._sampler.observe(keys)
        pending = 0
        if self._ps is not None:
            self._begin(self._push_request(t, keys, rows, ~is_hot), "ps_push_seconds")
            pending += 1
            if pull:
                local = self._local()[0] if self._sgd else hot_keys
                self._begin(self._pull_request(t, pull_keys, local), "ps_pull_seconds")
                pending += 1
        answers: list[tuple[dict[str, Any], bytearray]] = []
        try:
            aggregate = np.empty((0, self.spec.width), ROW_DTYPE)
            if hot_keys.size:
                dense = np.zeros(hot_keys.size * self.spec.width, np.float32)
                dense.reshape(hot_keys.size, self.spec.width)[where[is_hot]] = rows[is_hot]
                started = time.perf_counter()
                aggregate = self._exchange(dense, t).reshape(hot_keys.size, self.spec.width)
                self.stats["switch_seconds"] += time.perf_counter() - started
        finally:
            answers = self._finish(pending, "ps_pull_seconds" if pull else "ps_push_seconds") if pending else []
        if self._sgd and hot_keys.size:
            self.hot_weights -= self._step_size * aggregate
        self._last = (t, hot_keys, aggregate)
        self.iteration = t + 1
        self.stats["hot_rows"] += int(is_hot.sum())
        self.stats["cold_rows"] += int(keys.size - is_hot.sum())
        if not pull:
            return None
        return self._pulled(t, pull_keys, answers[1] if self._ps is not None else None)

    def _push_request(self, t: int, keys: np.ndarray, rows: np.ndarray, cold: np.ndarray
                      ) -> tuple[dict[str, Any], bytes]:
        header: dict[str, Any] = {"op": "sparse_push", "rank": self.rank, "iteration": t,
                                  "version": self.hot.version, "count": int(cold.sum())}
        arrays = [keys[cold], rows[cold]]
        if self.spec.placement == "libra" and (t + 1) % self.spec.report_every == 0:
            report_keys, report_counts = self._sampler.report(2 * self.spec.capacity)
            header["report_count"] = int(report_keys.size)
            arrays += [report_keys, report_counts.astype(COUNT_DTYPE)]
        if self._leaving is not None and t == self.hot.effective:
            if self.rank == 0:  # everyone holds the same weights; one copy is enough
                header["handover_count"] = int(self._leaving[0].size)
                arrays += list(self._leaving)
            self._leaving = None  # from this push on, the PS holds them (the pull of this iteration waits for it)
        return header, pack_arrays(*arrays)

    def _local(self) -> tuple[np.ndarray, np.ndarray]:
        """sgd: the rows this worker serves itself: the replica, and the rows that left it until handed over."""
        keys, rows = self.hot.keys, self.hot_weights
        if self._leaving is not None:
            keys = np.concatenate([keys, self._leaving[0]])
            order = np.argsort(keys)
            keys, rows = keys[order], np.concatenate([rows, self._leaving[1]])[order]
        return keys, rows

    def _pull_request(self, t: int, keys: np.ndarray | None, local: np.ndarray) -> tuple[dict[str, Any], bytes]:
        """Ask the PS for the rows of ``keys`` that are not in ``local`` (those this worker holds)."""
        asked = keys if keys is None else keys[~np.isin(keys, local, assume_unique=True)]
        header = {"op": "sparse_pull", "iteration": t, "version": self.hot.version,
                  "count": -1 if asked is None else int(asked.size)}
        return header, b"" if asked is None else pack_arrays(asked)

    def _begin(self, request: tuple[dict[str, Any], bytes], clock: str | None) -> None:
        assert self._ps is not None
        started = time.perf_counter()
        timeout = self.worker.ps_timeout
        self._ps.begin({"job_id": self.worker.config.job_id, "table": self.spec.table, **request[0],
                        "timeout": timeout}, request[1], timeout=timeout + 5)
        if clock is not None:
            self.stats[clock] += time.perf_counter() - started

    def _finish(self, pending: int, clock: str | None) -> list[tuple[dict[str, Any], bytearray]]:
        """Read ``pending`` answers in order; a refusal drops the connection if answers are still due.

        The requests after a refused one would wait for an iteration that cannot complete (a pull after
        a refused push waits for every worker's push), so the connection is closed instead.
        """
        assert self._ps is not None
        answers = []
        started = time.perf_counter()
        try:
            for _ in range(pending):
                answers.append(self._ps.finish())
        except PsRefused:
            if len(answers) + 1 < pending:
                self._ps.abort()
            raise
        finally:
            if clock is not None:
                self.stats[clock] += time.perf_counter() - started
        return answers

    def _exchange(self, dense: np.ndarray, iteration: int) -> np.ndarray:
        """The switch's sum of every worker's dense hot rows (float32, flat); HotSetMismatch if versions differ.

        A last block carries ``v + 1`` and ``(v + 1)**2`` for this worker's version ``v`` (mod 4096): small
        integers, summed exactly. All versions are equal exactly when ``N * sum((v+1)**2) == sum(v+1)**2``.
        """
        n = self.worker.num_workers
        k = self.worker.config.width
        blocks = np.zeros((-(-dense.size // k) + 1, k), np.float32)
        blocks.reshape(-1)[:dense.size] = dense
        tag = float(self.hot.version % 4096 + 1)
        blocks[-1, :2] = (tag, tag * tag)
        exponents, flags = qz.inspect(blocks)
        self.worker.follow_moves()  # a whole-job exchange like any other: where the job's slots moved, here too
        sums, global_exp, result_flags = self.worker.transport.exchange(blocks, exponents, flags=flags)
        values = qz.dequantize(sums, global_exp, n, flags=result_flags)
        total, squares = float(values[-1, 0]), float(values[-1, 1])
        if total != n * tag or n * squares != total * total:
            raise HotSetMismatch(f"sparse table {self.spec.table}, iteration {iteration}: the workers used "
                                 f"different hot sets (this worker: version {self.hot.version}); the switch's "
                                 f"sums were discarded")
        return values.reshape(-1)[:dense.size]

    def _pull(self, keys: np.ndarray | None) -> Any:
        if not self._sgd and self._last is None:
            raise KeyError(f"sparse table {self.spec.table}: nothing was pushed yet")
        # sgd: weights exist before the first push (iteration -1 is the initial state).
        t = self.iteration - 1
        answer = None
        if self._ps is not None:
            local = self._local()[0] if self._sgd else self._last[1]  # type: ignore[index]
            answer = self._request(*self._pull_request(t, keys, local), clock="ps_pull_seconds")
        return self._pulled(t, keys, answer)

    def _pulled(self, t: int, keys: np.ndarray | None, answer: tuple[dict[str, Any], bytearray] | None) -> Any:
        """The pull's value from the rows this worker holds and the PS's answer; then learn the next hot set."""
        if self._sgd:
            local_keys, local_rows = self._local()
        else:
            assert self._last is not None
            _, local_keys, local_rows = self._last
        cold_keys, cold_rows, rest = np.empty(0, KEY_DTYPE), np.empty((0, self.spec.width), ROW_DTYPE), None
        if answer is not None:
            response, blob = answer
            count, width = int(response["count"]), self.spec.width
            split = count * (KEY_DTYPE.itemsize + 4 * width)
            cold_keys, cold_rows = unpack_arrays(memoryview(blob)[:split], (KEY_DTYPE, count, 0),
                                                 (ROW_DTYPE, count, width))
            rest = memoryview(blob)[split:]
        if keys is None:
            all_keys = np.concatenate([local_keys, cold_keys])
            order = np.argsort(all_keys, kind="stable")
            result: Any = (all_keys[order], np.concatenate([local_rows, cold_rows])[order])
        else:
            result = np.zeros((keys.size, self.spec.width), ROW_DTYPE)
            where, is_local = positions(local_keys, keys)
            result[is_local] = local_rows[where[is_local]]
            if cold_keys.size:
                result[~is_local] = cold_rows
        self.stats["pulled_rows"] += len(result[0]) if keys is None else keys.size
        if answer is not None:
            self._learn(answer[0], rest)
            self._hot_known_for = t + 1
        return result

