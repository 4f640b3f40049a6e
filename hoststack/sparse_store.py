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

With ``update="sgd"`` the PS owns the weights of the cold rows (a :class:`RowStore`;
rows start at a small random value derived from the key) and applies
``w -= lr / N * aggregate`` when an iteration completes; a pull returns weights. The
workers keep replicas of the hot rows and apply the same step to the switch's sums. At a
switch-over the weights move with the rows: the answer that announces a new hot set
carries the PS's weights of the rows that become hot, and rank 0's first push under the
new set hands over its weights of the rows that leave it, before that iteration can
complete, so no update is lost or applied twice.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from netagg.hoststack.hotset import MAX_ROWS, HotSet, choose_hot_set, merge_reports

#: What a pull returns: the iteration's aggregate, or the weights after the PS's SGD step.
UPDATES = ("sum", "sgd")
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
    update: str = "sum"
    lr: float = 0.0
    init_scale: float = 0.0
    seed: int = 0
    #: libra: a row is hot only if at least this many workers touch it per iteration (estimated).
    min_touches: float = 0.0

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
        if self.update not in UPDATES:
            raise ValueError(f"update {self.update!r} is not one of {', '.join(UPDATES)}")
        if not 0.0 <= self.min_touches <= 1e6:
            raise ValueError(f"min_touches {self.min_touches} not in 0..1e6")
        if not (np.isfinite(self.lr) and np.isfinite(self.init_scale) and self.init_scale >= 0):
            raise ValueError(f"lr {self.lr} and init_scale {self.init_scale} must be finite, init_scale >= 0")

    @classmethod
    def from_header(cls, header: dict) -> TableSpec:
        return cls(int(header["table"]), int(header["num_rows"]), int(header["width"]), str(header["placement"]),
                   int(header["capacity"]), int(header["report_every"]), float(header["min_gain"]),
                   str(header.get("update", "sum")), float(header.get("lr", 0.0)),
                   float(header.get("init_scale", 0.0)), int(header.get("seed", 0)),
                   float(header.get("min_touches", 0.0)))

    def fields(self) -> dict:
        """The spec as request fields (``from_header`` reads them back)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


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


def initial_rows(keys: np.ndarray, width: int, scale: float, seed: int) -> np.ndarray:
    """Each row's starting weights, uniform in [-scale, scale) and a function of (key, seed) only."""
    index = (keys.astype(np.uint64)[:, None] * np.uint64(width) + np.arange(width, dtype=np.uint64)) \
        ^ np.uint64(seed * 0x9E3779B97F4A7C15 % (1 << 64))
    with np.errstate(over="ignore"):  # splitmix64: wrapping multiplications are the point
        z = index + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    unit = (z >> np.uint64(40)).astype(np.float64) / float(1 << 24)
    return ((2.0 * unit - 1.0) * scale).astype(ROW_DTYPE)


class RowStore:
    """Weights of the rows touched so far, in a growing array indexed by a dict (a huge key space stays sparse)."""

    def __init__(self, width: int, init_scale: float, seed: int) -> None:
        self.width, self.init_scale, self.seed = width, init_scale, seed
        self._index: dict[int, int] = {}
        self._rows = np.empty((1024, width), ROW_DTYPE)

    def __len__(self) -> int:
        return len(self._index)

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        """Row positions of ``keys``, adding (initialized) rows for unseen ones."""
        index = self._index
        slots = np.fromiter((index.get(k, -1) for k in keys.tolist()), np.int64, keys.size)
        new = np.flatnonzero(slots < 0)
        if new.size:
            start = len(index)
            if start + new.size > self._rows.shape[0]:
                grown = np.empty((max(2 * self._rows.shape[0], start + new.size), self.width), ROW_DTYPE)
                grown[:start] = self._rows[:start]
                self._rows = grown
            for offset, key in enumerate(keys[new].tolist()):
                index[key] = start + offset
            slots[new] = np.arange(start, start + new.size)
            self._rows[start:start + new.size] = initial_rows(keys[new], self.width, self.init_scale, self.seed)
        return slots

    def get(self, keys: np.ndarray) -> np.ndarray:
        slots = self._slots(keys)  # first: it may replace the array
        return self._rows[slots]

    def set(self, keys: np.ndarray, rows: np.ndarray) -> None:
        slots = self._slots(keys)
        self._rows[slots] = rows

    def sgd(self, keys: np.ndarray, aggregate: np.ndarray, step: np.float32) -> None:
        """``w -= step * aggregate`` for unique ``keys`` (float32, like the workers' hot replicas)."""
        slots = self._slots(keys)
        self._rows[slots] -= step * aggregate


def check_keys(keys: np.ndarray, num_rows: int) -> None:
    """ValueError unless ``keys`` are one-dimensional, sorted, unique and in 0..num_rows-1."""
    check_rows(keys, np.empty((keys.size, 0), ROW_DTYPE), num_rows, 0)


def positions(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``keys``: its index in ``sorted_keys`` and whether it is there."""
    where = np.searchsorted(sorted_keys, keys)
    found = where < sorted_keys.size
    found[found] = sorted_keys[where[found]] == keys[found]
    return where, found


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
        self.weights = RowStore(spec.width, spec.init_scale, spec.seed) if spec.update == "sgd" else None

    # -- hot sets ------------------------------------------------------------
    def hot_set_at(self, iteration: int) -> HotSet:
        """The hot set in effect for ``iteration`` (decided, at the latest, when iteration - 1 completed)."""
        return next(h for h in reversed(self._schedule) if h.effective <= iteration)

    @property
    def hot_set(self) -> HotSet:
        return self._schedule[-1]

    def leaving(self, hot: HotSet) -> np.ndarray:
        """Rows of the set before ``hot`` that ``hot`` no longer holds (their weights are handed over)."""
        before = next((h for h in reversed(self._schedule) if h.version == hot.version - 1), None)
        return np.empty(0, hot.keys.dtype) if before is None else np.setdiff1d(before.keys, hot.keys, True)

    def arriving(self, hot: HotSet, known_version: int) -> tuple[np.ndarray, np.ndarray]:
        """For a worker on ``known_version``: the rows ``hot`` adds and their weights (sgd; empty arrays for sum)."""
        if self.weights is None or known_version == hot.version:
            return hot.keys[:0], np.empty((0, self.spec.width), ROW_DTYPE)
        with self._cond:
            before = next((h for h in self._schedule if h.version == known_version), None)
            if before is None:
                raise StaleHotSet(f"table {self.spec.table}: hot-set version {known_version} is too old "
                                  f"(version {hot.version} is in effect)")
            keys = np.setdiff1d(hot.keys, before.keys, True)
            return keys, self.weights.get(keys)

    # -- operations ----------------------------------------------------------
    def push(self, rank: int, iteration: int, version: int, keys: np.ndarray, rows: np.ndarray,
             report: tuple[np.ndarray, np.ndarray] | None = None,
             handover: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Record ``rank``'s cold rows of ``iteration``; refuses out-of-order, stale or hot-row pushes.

        ``handover``: rank 0's weights of the rows that left the hot set at this iteration (sgd only).
        """
        check_rows(keys, rows, self.spec.num_rows, self.spec.width)
        with self._cond:
            try:
                self._check_push(rank, iteration, version, keys)
                self._take_handover(rank, iteration, handover)
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

    def _take_handover(self, rank: int, iteration: int, handover: tuple[np.ndarray, np.ndarray] | None) -> None:
        hot = self.hot_set_at(iteration)
        due = self.weights is not None and rank == 0 and hot.version > 0 and iteration == hot.effective
        if not due:
            if handover is not None:
                raise ValueError(f"table {self.spec.table}: unexpected handover from rank {rank} in iteration "
                                 f"{iteration}")
            return
        leaving = self.leaving(hot)
        if handover is None or not np.array_equal(handover[0], leaving):
            raise ValueError(f"table {self.spec.table}: rank 0's push of iteration {iteration} must hand over the "
                             f"weights of the {leaving.size} row(s) that left the hot set")
        check_rows(handover[0], handover[1], self.spec.num_rows, self.spec.width)
        assert self.weights is not None
        self.weights.set(*handover)

    def _complete(self, iteration: int, entry: _Iteration) -> None:
        parts = [entry.pushes[r] for r in range(self.num_workers)]
        keys = np.concatenate([k for k, _ in parts])
        rows = np.concatenate([r for _, r in parts]) if keys.size else np.empty((0, self.spec.width), ROW_DTYPE)
        entry.keys, inverse = np.unique(keys, return_inverse=True)
        entry.rows = np.zeros((entry.keys.size, self.spec.width), ROW_DTYPE)
        np.add.at(entry.rows, inverse, rows)  # one row at a time, in rank order: every reader gets the same floats
        entry.pushes.clear()
        if self.weights is not None:
            self.weights.sgd(entry.keys, entry.rows, np.float32(self.spec.lr / self.num_workers))
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
        chosen = choose_hot_set(keys, counts, spec.capacity, current, spec.min_gain, spec.min_touches)
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
            check_keys(keys, self.spec.num_rows)
        self.wait_complete(iteration, timeout)
        with self._cond:
            if self.weights is not None:
                if keys is None:
                    raise ValueError(f"table {self.spec.table}: a pull of weights names its rows")
                self.stats.rows_out += keys.size
                return keys, self.weights.get(keys)
            entry = self._iterations.get(iteration)
            if entry is None or entry.keys is None or entry.rows is None:
                raise ValueError(f"table {self.spec.table}: iteration {iteration} is no longer kept "
                                 f"(the PS keeps the last {self.keep})")
            if keys is None:
                out_keys, out_rows = entry.keys, entry.rows
            else:
                out_keys, out_rows = keys, np.zeros((keys.size, self.spec.width), ROW_DTYPE)
                where, found = positions(entry.keys, keys)
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
