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
* ``ps``: every row goes to the PS (the PS-lite baseline).
* ``switch``: the whole table goes through the switch densely every iteration (no PS;
  sensible only for a table that is small next to the data the job moves anyway).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from netagg import wire
from netagg.hoststack import quantization as qz
from netagg.hoststack.hotset import COUNT_DTYPE, KEY_DTYPE, FrequencySampler, HotSet
from netagg.hoststack.sparse_store import PLACEMENTS, ROW_DTYPE, TableSpec, check_rows, pack_arrays, unpack_arrays

if TYPE_CHECKING:
    from netagg.hoststack.kv import KVWorker

__all__ = ["PLACEMENTS", "SparseTable"]


class SparseTable:
    """One sparse table of a worker (see the module docstring); made by ``KVWorker.sparse_table``."""

    def __init__(self, worker: KVWorker, table: int, num_rows: int, width: int, *, placement: str = "libra",
                 hot_rounds: int = 1, capacity: int | None = None, report_every: int = 10, decay: float = 0.8,
                 sample_rate: float = 0.5, min_gain: float = 0.05, seed: int = 0) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
        if hot_rounds < 1:
            raise ValueError(f"hot_rounds must be >= 1, got {hot_rounds}")
        config = worker.config
        if capacity is None:
            capacity = {"ps": 0, "switch": num_rows}.get(placement, config.slot_count * wire.K * hot_rounds // width)
        capacity = min(capacity, num_rows)
        self.spec = TableSpec(table, num_rows, width, placement, capacity, report_every, min_gain)
        self.worker = worker
        self.rank = config.rank
        #: The next iteration this worker pushes; the hot set it holds and from which iteration on.
        self.iteration = 0
        self.hot = HotSet(0, 0, np.arange(num_rows, dtype=KEY_DTYPE)) if placement == "switch" else HotSet.empty()
        self._hot_known_for = 0
        self._sampler = FrequencySampler(decay, sample_rate, max(4 * capacity, 1024), seed=seed * 7919 + self.rank)
        #: The last push: its iteration, the hot set it used and the dense aggregate of its hot rows.
        self._last: tuple[int, np.ndarray, np.ndarray] | None = None
        self.stats = {"hot_rows": 0, "cold_rows": 0, "pulled_rows": 0, "syncs": 0, "hot_changes": 0}
        self._ps = worker.ps_connection() if placement != "switch" else None
        if self._ps is not None:
            worker.call(self._request, {"op": "sparse_open", **_spec_fields(self.spec)})

    # -- API -------------------------------------------------------------------
    def push(self, keys: Any, rows: Any) -> int:
        """Aggregate this iteration's ``rows`` of ``keys`` (sorted, unique) with the job; returns a timestamp."""
        keys = np.ascontiguousarray(keys, dtype=KEY_DTYPE)
        rows = np.array(rows, dtype=ROW_DTYPE, copy=True).reshape(keys.size, -1) if np.size(rows) or keys.size \
            else np.empty((0, self.spec.width), ROW_DTYPE)
        check_rows(keys, rows, self.spec.num_rows, self.spec.width)
        return self.worker.submit(self._push, keys, rows)

    def pull(self, keys: Any = None) -> int:
        """The aggregate of the last push: ``wait`` gives the rows of ``keys``, or ``(keys, rows)`` of all."""
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

    def _learn(self, response: dict[str, Any], hot_keys: np.ndarray) -> None:
        """Take the hot set a sync or pull response names (its keys come only when the version is new)."""
        if int(response["hot_count"]) >= 0 and int(response["hot_version"]) != self.hot.version:
            self.hot = HotSet(int(response["hot_version"]), int(response["hot_effective"]), hot_keys)
            self.stats["hot_changes"] += 1

    def _push(self, keys: np.ndarray, rows: np.ndarray) -> None:
        t = self.iteration
        if self._ps is not None and self._hot_known_for < t:  # the previous iteration was not pulled
            response, blob = self._request({"op": "sparse_sync", "iteration": t, "version": self.hot.version})
            self._learn(response, unpack_arrays(blob, (KEY_DTYPE, max(int(response["hot_count"]), 0), 0))[0])
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
            self._request(header, pack_arrays(*arrays))
        aggregate = np.empty((0, self.spec.width), ROW_DTYPE)
        if hot_keys.size:
            dense = np.zeros(hot_keys.size * self.spec.width, np.float32)
            dense.reshape(hot_keys.size, self.spec.width)[where[is_hot]] = rows[is_hot]
            aggregate = self._exchange(dense).reshape(hot_keys.size, self.spec.width)
        self._last = (t, hot_keys, aggregate)
        self.iteration = t + 1
        self.stats["hot_rows"] += int(is_hot.sum())
        self.stats["cold_rows"] += int(keys.size - is_hot.sum())

    def _exchange(self, dense: np.ndarray) -> np.ndarray:
        """The switch's sum of every worker's dense hot rows (float32, flat)."""
        blocks = np.zeros((-(-dense.size // wire.K), wire.K), np.float32)
        blocks.reshape(-1)[:dense.size] = dense
        sums, global_exp = self.worker.transport.exchange(blocks, qz.block_exponents(blocks))
        return qz.dequantize(sums, global_exp, self.worker.num_workers).reshape(-1)[:dense.size]

    def _pull(self, keys: np.ndarray | None) -> Any:
        if self._last is None:
            raise KeyError(f"sparse table {self.spec.table}: nothing was pushed yet")
        t, hot_keys, hot_rows = self._last
        cold_keys, cold_rows = np.empty(0, KEY_DTYPE), np.empty((0, self.spec.width), ROW_DTYPE)
        if self._ps is not None:
            asked = keys if keys is None else keys[~np.isin(keys, hot_keys, assume_unique=True)]
            header = {"op": "sparse_pull", "iteration": t, "version": self.hot.version,
                      "count": -1 if asked is None else int(asked.size)}
            response, blob = self._request(header, b"" if asked is None else pack_arrays(asked))
            count, hot_count = int(response["count"]), max(int(response["hot_count"]), 0)
            cold_keys, cold_rows, next_hot = unpack_arrays(
                blob, (KEY_DTYPE, count, 0), (ROW_DTYPE, count, self.spec.width), (KEY_DTYPE, hot_count, 0))
            self._learn(response, next_hot)
            self._hot_known_for = t + 1
        if keys is None:
            all_keys = np.concatenate([hot_keys, cold_keys])
            order = np.argsort(all_keys, kind="stable")
            result = all_keys[order], np.concatenate([hot_rows, cold_rows])[order]
            self.stats["pulled_rows"] += all_keys.size
            return result
        out = np.zeros((keys.size, self.spec.width), ROW_DTYPE)
        where = np.searchsorted(hot_keys, keys)
        is_hot = where < hot_keys.size
        is_hot[is_hot] = hot_keys[where[is_hot]] == keys[is_hot]
        out[is_hot] = hot_rows[where[is_hot]]
        if cold_keys.size:
            out[~is_hot] = cold_rows
        self.stats["pulled_rows"] += keys.size
        return out


def _spec_fields(spec: TableSpec) -> dict[str, Any]:
    return {"num_rows": spec.num_rows, "width": spec.width, "placement": spec.placement, "capacity": spec.capacity,
            "report_every": spec.report_every, "min_gain": spec.min_gain}
