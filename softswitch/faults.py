"""Seeded fault injection for the software target: drop, duplicate, reorder."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class FaultStats:
    """How many packets the injector dropped, duplicated and held back."""

    seen: int = 0
    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0


@dataclass
class FaultInjector(Generic[T]):
    """Decides per packet whether it is lost, doubled or overtaken by the next one.

    Fractions are independent per packet. A reordered packet is held back and
    released right after the next packet (or by :meth:`flush`, which the switch
    calls when it has been idle for a moment), so reordering never delays a
    packet by more than one other packet or one idle tick.
    """

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    seed: int = 0
    stats: FaultStats = field(default_factory=FaultStats)
    _held: list[T] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "reorder"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"fault fraction {name}={value} must be in [0, 1)")
        self._rng = random.Random(self.seed)

    @property
    def active(self) -> bool:
        return bool(self.drop or self.duplicate or self.reorder)

    def filter(self, item: T) -> list[T]:
        """The packets to deliver now, in order, given that ``item`` just arrived."""
        self.stats.seen += 1
        held, self._held = self._held, []
        rng = self._rng
        if rng.random() < self.drop:
            self.stats.dropped += 1
            return held
        now = [item]
        if rng.random() < self.duplicate:
            self.stats.duplicated += 1
            now.append(item)
        if rng.random() < self.reorder:
            self.stats.reordered += 1
            self._held = now
            return held
        return now + held

    def flush(self) -> list[T]:
        """Release packets held back for reordering."""
        held, self._held = self._held, []
        return held
