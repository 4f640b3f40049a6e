"""Libra's hot parameters: key frequencies sampled on the workers, merged at the PS, a versioned hot set.

Each worker counts the rows it touches in a :class:`FrequencySampler`: every iteration
the counts decay by ``decay`` and a Bernoulli sample (``sample_rate``) of the touched
keys adds ``1 / sample_rate`` each, so a count estimates the key's recent touches per
iteration divided by ``1 - decay``. Only the ``max_tracked`` largest counts are kept,
so the memory does not grow with the key space (up to 2**40 rows). Every
``report_every`` iterations a worker sends its largest counts to the PS with its push.

A report gives each key's estimated *touches per iteration* (the count times
``1 - decay``, at most 1 for one worker). The PS adds up the workers' latest reports
(:func:`merge_reports`: how many workers touch the key per iteration) and
:func:`choose_hot_set` takes the ``capacity`` most frequent keys among those touched by at
least ``min_touches`` workers per iteration: below that a row costs less as key/value data
on the PS's link than as a dense row on every worker's link. The new set replaces the
current one only if it covers ``min_gain`` more of the merged frequency mass, so a stable
distribution does not make the hot set flap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KEY_DTYPE = np.dtype("<i8")
COUNT_DTYPE = np.dtype("<f4")
#: The largest key space a sparse table may have (row ids must fit in int64 with room to spare).
MAX_ROWS = 1 << 40


@dataclass(frozen=True)
class HotSet:
    """The rows that go through the switch from iteration ``effective`` on; ``keys`` sorted, unique."""

    version: int
    effective: int
    keys: np.ndarray

    @classmethod
    def empty(cls) -> HotSet:
        return cls(0, 0, np.empty(0, KEY_DTYPE))


class FrequencySampler:
    """Decayed, sampled touch counts of one worker (see the module docstring)."""

    def __init__(self, decay: float = 0.9, sample_rate: float = 0.25, max_tracked: int = 8192,
                 seed: int = 0) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if max_tracked < 1:
            raise ValueError(f"max_tracked must be >= 1, got {max_tracked}")
        self.decay = float(decay)
        self.sample_rate = float(sample_rate)
        self.max_tracked = int(max_tracked)
        self._rng = np.random.default_rng(seed)
        self.keys = np.empty(0, KEY_DTYPE)
        self.counts = np.empty(0, np.float64)

    def observe(self, keys: np.ndarray) -> None:
        """One iteration's touched keys (unique): decay every count, add the sampled ones."""
        self.counts *= self.decay
        if self.sample_rate < 1.0:
            keys = keys[self._rng.random(keys.size) < self.sample_rate]
        if keys.size:
            merged = np.union1d(self.keys, keys)
            counts = np.zeros(merged.size, np.float64)
            counts[np.searchsorted(merged, self.keys)] = self.counts
            counts[np.searchsorted(merged, keys)] += 1.0 / self.sample_rate
            self.keys, self.counts = merged.astype(KEY_DTYPE, copy=False), counts
        if self.keys.size > self.max_tracked:
            keep = np.sort(_top(self.keys, self.counts, self.max_tracked))
            self.keys, self.counts = self.keys[keep], self.counts[keep]

    def report(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``size`` most touched keys as (sorted keys, float32 touches per iteration)."""
        keep = np.sort(_top(self.keys, self.counts, size))
        return self.keys[keep].copy(), (self.counts[keep] * (1.0 - self.decay)).astype(COUNT_DTYPE)


def merge_reports(reports: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The sum of several workers' (keys, counts) reports, as (sorted unique keys, float64 counts)."""
    if not reports:
        return np.empty(0, KEY_DTYPE), np.empty(0, np.float64)
    keys = np.concatenate([k for k, _ in reports])
    counts = np.concatenate([c.astype(np.float64) for _, c in reports])
    unique, inverse = np.unique(keys, return_inverse=True)
    return unique.astype(KEY_DTYPE, copy=False), np.bincount(inverse, weights=counts, minlength=unique.size)


def choose_hot_set(keys: np.ndarray, counts: np.ndarray, capacity: int, current: np.ndarray,
                   min_gain: float, min_touches: float = 0.0) -> np.ndarray | None:
    """The ``capacity`` most frequent keys with at least ``min_touches`` (sorted), or None when they do not
    beat ``current`` by ``min_gain``.

    Ties are broken by the smaller key, so every PS replica and rerun chooses the same set.
    """
    eligible = np.flatnonzero(counts >= min_touches)
    if capacity <= 0 or not eligible.size:
        return None
    top = eligible[_top(keys[eligible], counts[eligible], capacity)]
    candidate = np.sort(keys[top])
    gained = float(counts[top].sum())
    if gained <= 0.0 or np.array_equal(candidate, current):
        return None
    held = float(counts[np.isin(keys, current, assume_unique=True)].sum()) if current.size else 0.0
    if current.size and gained <= (1.0 + min_gain) * held:
        return None
    return candidate.astype(KEY_DTYPE, copy=False)


def _top(keys: np.ndarray, counts: np.ndarray, size: int) -> np.ndarray:
    """Indices of the ``size`` largest counts (ties: smaller key first)."""
    if keys.size <= size:
        return np.arange(keys.size)
    order = np.lexsort((keys, -counts))
    return order[:size]
