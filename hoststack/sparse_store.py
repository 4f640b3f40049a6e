"""The PS side of sparse tables (Libra): cold rows aggregated per iteration, hot set decisions.

Every worker of a job pushes each table once per iteration, in order: the rows it
touched that are *not* in the iteration's hot set (those go through the switch), with
the hot-set version it used. An iteration is complete when all workers pushed it; its
aggregate is then the sum of the pushed rows per key (summed in rank order, so every
reader gets the same floats), and a pull of it answers at once. At completion of
iteration ``t`` the PS may choose a new hot set from the workers' frequency reports; it
takes effect at ``t + 1``. Every worker learns it from its pull of ``t`` (or a sync
before pushing ``t + 1``), so the switch-over is atomic between two iterations: a push
made with any other version, or that sends a hot row to the PS, is refused (ValueError,
which the server returns as the request's error), never summed.

The aggregates of the last ``keep`` complete iterations are kept; older ones are dropped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from netagg.hoststack.hotset import MAX_ROWS, HotSet, choose_hot_set, merge_reports

#: Placements of a table: every row at the PS, the hot set in the switch (Libra), or every row in the switch.
PLACEMENTS = ("ps", "libra", "switch")
ROW_DTYPE = np.dtype("<f4")


class StaleHotSet(ValueError):
    """A push used another hot-set version than the one in effect for its iteration."""


@dataclass(frozen=True)
class TableSpec:
    """What every worker of a job must agree on for one table."""

    table: int
    num_rows: int
    width: int
    placement: str
    capacity: int
    report_every: int
    min_gain: float

    def __post_init__(self) -> None:
        if not 0 <= self.table < 1 << 31:
            raise ValueError(f"table id {self.table} not in 0..2**31-1")
        if not 1 <= self.num_rows <= MAX_ROWS:
            raise ValueError(f"num_rows {self.num_rows} not in 1..2**40")
        if not 1 <= self.width <= 1 << 16:
            raise ValueError(f"width {self.width} not in 1..65536")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement {self.placement!r} is not one of {', '.join(PLACEMENTS)}")
        if not 0 <= self.capacity <= self.num_rows:
            raise ValueError(f"capacity {self.capacity} not in 0..num_rows")
        if self.report_every < 1 or not 0.0 <= self.min_gain <= 10.0:
            raise ValueError(f"report_every {self.report_every} must be >= 1, min_gain {self.min_gain} in 0..10")

    @classmethod
    def from_header(cls, header: dict) -> TableSpec:
        return cls(int(header["table"]), int(header["num_rows"]), int(header["width"]), str(header["placement"]),
                   int(header["capacity"]), int(header["report_every"]), float(header["min_gain"]))


def check_rows(keys: np.ndarray, rows: np.ndarray, num_rows: int, width: int) -> None:
    """ValueError unless ``keys`` are sorted, unique, in 0..num_rows-1 and ``rows`` is (len(keys), width) finite."""
    if keys.ndim != 1:
        raise ValueError(f"keys must be one-dimensional, got shape {keys.shape}")
    if rows.shape != (keys.size, width):
        raise ValueError(f"rows must have shape ({keys.size}, {width}), got {rows.shape}")
    if keys.size:
        if int(keys[0]) < 0 or int(keys[-1]) >= num_rows:
            raise ValueError(f"keys must be in 0..{num_rows - 1}, got {int(keys.min())}..{int(keys.max())}")
        if keys.size > 1 and not bool(np.all(keys[1:] > keys[:-1])):
            raise ValueError("keys must be sorted and unique")
        if not bool(np.isfinite(rows).all()):
            raise ValueError("rows contain NaN or Inf; nothing was sent")


@dataclass
class _Iteration:
    pushes: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    keys: np.ndarray | None = None
    rows: np.ndarray | None = None


@dataclass
class TableStats:
    """Per table: iterations completed, rows pushed and returned, hot-set versions made, refusals."""

    iterations: int = 0
    rows_in: int = 0
    rows_out: int = 0
    hot_versions: int = 0
    refused: int = 0


class TableState:
    """One table's state at the PS (thread-safe; pulls wait on a condition)."""

    def __init__(self, spec: TableSpec, num_workers: int, keep: int = 2) -> None:
        self.spec = spec
        self.num_workers = num_workers
        self.keep = keep
        self.stats = TableStats()
        self._cond = threading.Condition()
        self._next = [0] * num_workers
        self._iterations: dict[int, _Iteration] = {}
        self._completed = -1
        self._schedule: list[HotSet] = [HotSet.empty()]
        self._reports: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    # -- hot sets ------------------------------------------------------------
    def hot_set_at(self, iteration: int) -> HotSet:
        """The hot set in effect for ``iteration`` (decided, at the latest, when iteration - 1 completed)."""
        return next(h for h in reversed(self._schedule) if h.effective <= iteration)

    @property
    def hot_set(self) -> HotSet:
        return self._schedule[-1]

    # -- operations ----------------------------------------------------------
    def push(self, rank: int, iteration: int, version: int, keys: np.ndarray, rows: np.ndarray,
             report: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Record ``rank``'s cold rows of ``iteration``; refuses out-of-order, stale or hot-row pushes."""
        check_rows(keys, rows, self.spec.num_rows, self.spec.width)
        with self._cond:
            try:
                self._check_push(rank, iteration, version, keys)
            except ValueError:
                self.stats.refused += 1
                raise
            entry = self._iterations.setdefault(iteration, _Iteration())
            entry.pushes[rank] = (keys, rows)
            self._next[rank] = iteration + 1
            self.stats.rows_in += keys.size
            if report is not None:
                self._reports[rank] = report
            if len(entry.pushes) == self.num_workers:
                self._complete(iteration, entry)

    def _check_push(self, rank: int, iteration: int, version: int, keys: np.ndarray) -> None:
        if not 0 <= rank < self.num_workers:
            raise ValueError(f"rank {rank} not in 0..{self.num_workers - 1}")
        if iteration != self._next[rank]:
            raise ValueError(f"table {self.spec.table}: rank {rank} pushed iteration {iteration}, "
                             f"expected {self._next[rank]} (one push per iteration, in order)")
        if iteration != self._completed + 1:  # its hot set is decided when the previous iteration completes
            raise ValueError(f"table {self.spec.table}: rank {rank} pushed iteration {iteration} before iteration "
                             f"{iteration - 1} completed; pull (or sync) it first")
        hot = self.hot_set_at(iteration)
        if version != hot.version:
            raise StaleHotSet(f"table {self.spec.table}: stale hot set: rank {rank} pushed iteration {iteration} "
                              f"with hot-set version {version}, but version {hot.version} is in effect from "
                              f"iteration {hot.effective}; pull (or sync) the previous iteration first")
        if hot.keys.size and keys.size:
            both = np.intersect1d(keys, hot.keys, assume_unique=True)
            if both.size:
                raise ValueError(f"table {self.spec.table}: rank {rank} pushed hot row(s) "
                                 f"{both[:5].tolist()} to the PS in iteration {iteration} (hot-set version "
                                 f"{hot.version}); hot rows go through the switch")

    def _complete(self, iteration: int, entry: _Iteration) -> None:
        parts = [entry.pushes[r] for r in range(self.num_workers)]
        keys = np.concatenate([k for k, _ in parts])
        rows = np.concatenate([r for _, r in parts]) if keys.size else np.empty((0, self.spec.width), ROW_DTYPE)
        entry.keys, inverse = np.unique(keys, return_inverse=True)
        entry.rows = np.zeros((entry.keys.size, self.spec.width), ROW_DTYPE)
        np.add.at(entry.rows, inverse, rows)  # one row at a time, in rank order: every reader gets the same floats
        entry.pushes.clear()
        self._completed = iteration
        self.stats.iterations += 1
        self._decide(iteration)
        for old in [t for t in self._iterations if t <= iteration - self.keep]:
            del self._iterations[old]
        self._cond.notify_all()

    def _decide(self, iteration: int) -> None:
        spec = self.spec
        if spec.placement != "libra" or (iteration + 1) % spec.report_every or not self._reports:
            return
        keys, counts = merge_reports(list(self._reports.values()))
        current = self.hot_set.keys
        chosen = choose_hot_set(keys, counts, spec.capacity, current, spec.min_gain)
        if chosen is not None:
            self._schedule.append(HotSet(self.hot_set.version + 1, iteration + 1, chosen))
            del self._schedule[:-2]  # the previous set stays for pushes of iterations before the change
            self.stats.hot_versions += 1

    def wait_complete(self, iteration: int, timeout: float) -> None:
        """Block until ``iteration`` is complete; ValueError on timeout or when it was dropped already."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._completed >= iteration, timeout):
                waiting = [r for r in range(self.num_workers) if self._next[r] <= iteration]
                raise ValueError(f"table {self.spec.table}: iteration {iteration} not complete within "
                                 f"{timeout:.1f} s (waiting for rank(s) {waiting})")

    def sync(self, iteration: int, timeout: float) -> HotSet:
        """The hot set of ``iteration``, once the previous iteration is complete (it may change the set)."""
        self.wait_complete(iteration - 1, timeout)
        with self._cond:
            if iteration > self._completed + 1:
                raise ValueError(f"table {self.spec.table}: iteration {iteration} is ahead of the job "
                                 f"({self._completed} complete)")
            return self.hot_set_at(iteration)

    def pull(self, iteration: int, keys: np.ndarray | None, timeout: float) -> tuple[np.ndarray, np.ndarray]:
        """The aggregate of ``iteration``: every pushed row (``keys`` None) or the asked rows (zeros if untouched)."""
        if keys is not None:
            check_rows(keys, np.empty((keys.size, 0), ROW_DTYPE), self.spec.num_rows, 0)
        self.wait_complete(iteration, timeout)
        with self._cond:
            entry = self._iterations.get(iteration)
            if entry is None or entry.keys is None or entry.rows is None:
                raise ValueError(f"table {self.spec.table}: iteration {iteration} is no longer kept "
                                 f"(the PS keeps the last {self.keep})")
            if keys is None:
                out_keys, out_rows = entry.keys, entry.rows
            else:
                out_keys, out_rows = keys, np.zeros((keys.size, self.spec.width), ROW_DTYPE)
                where = np.searchsorted(entry.keys, keys)
                found = where < entry.keys.size
                found[found] = entry.keys[where[found]] == keys[found]
                out_rows[found] = entry.rows[where[found]]
            self.stats.rows_out += out_keys.size
            return out_keys, out_rows


def pack_arrays(*arrays: np.ndarray) -> bytes:
    """Little-endian int64 keys / float32 rows and counts, back to back (the JSON header gives the counts)."""
    return b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def unpack_arrays(blob: bytes | bytearray | memoryview, *layout: tuple[np.dtype, int, int]) -> list[np.ndarray]:
    """Split a blob into arrays of ``(dtype, rows, columns)`` (columns 0: one-dimensional); exact length."""
    sizes = [np.dtype(dt).itemsize * rows * max(cols, 1) for dt, rows, cols in layout]
    if any(rows < 0 for _, rows, _ in layout) or sum(sizes) != len(blob):
        raise ValueError(f"blob of {len(blob)} bytes does not hold arrays of {sizes} bytes")
    out, start = [], 0
    for (dt, rows, cols), size in zip(layout, sizes, strict=True):
        array = np.frombuffer(blob, dt, rows * max(cols, 1), start).copy()
        out.append(array.reshape(rows, cols) if cols else array)
        start += size
    return out
