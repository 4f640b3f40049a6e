"""Seeded fault injection for the software target: drop, duplicate, reorder, and burst loss."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
#: How long a burst loss lasts at most (a GSO send's datagrams arrive within microseconds of each other).
BURST_SECONDS = 0.002


@dataclass
class FaultStats:
    """How many packets the injector dropped, duplicated and held back."""

    seen: int = 0
    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0
    #: Bursts started (their packets are counted in ``dropped`` too).
    bursts: int = 0


@dataclass
class FaultInjector(Generic[T]):
    """Decides per packet whether it is lost, doubled or overtaken by the next one.

    Fractions are independent per packet. A reordered packet is held back and
    released right after the next packet (or by :meth:`flush`, which the switch
    calls when it has been idle for a moment), so reordering never delays a
    packet by more than one other packet or one idle tick. ``burst`` is the
    fraction of packets that start a burst loss: that packet and the next
    ``burst_length - 1`` are all lost, as when a whole UDP GSO send (up to 64
    datagrams that travel as one packet) is dropped; a burst covers only packets
    arriving within :data:`BURST_SECONDS` of its start (a GSO send's datagrams arrive
    back to back; a slow trickle of retransmissions afterwards is not part of it).
    """

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    seed: int = 0
    stats: FaultStats = field(default_factory=FaultStats)
    _held: list[T] = field(default_factory=list)
    burst: float = 0.0
    burst_length: int = 64
    _burst_left: int = 0
    _burst_until: float = 0.0

    def __post_init__(self) -> None:
        if self.burst_length < 1:
            raise ValueError(f"burst_length={self.burst_length} must be at least 1")
        for name in ("drop", "duplicate", "reorder", "burst"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"fault fraction {name}={value} must be in [0, 1)")
        self._rng = random.Random(self.seed)

    @property
    def active(self) -> bool:
        return bool(self.drop or self.duplicate or self.reorder or self.burst)

    def filter(self, item: T) -> list[T]:
        """The packets to deliver now, in order, given that ``item`` just arrived."""
        self.stats.seen += 1
        held, self._held = self._held, []
        rng = self._rng
        if self._burst_left:
            if time.monotonic() <= self._burst_until:
                self._burst_left -= 1
                self.stats.dropped += 1
                return held
            self._burst_left = 0
        if self.burst and rng.random() < self.burst:
            self.stats.bursts += 1
            self.stats.dropped += 1
            self._burst_left = self.burst_length - 1
            self._burst_until = time.monotonic() + BURST_SECONDS
            return held
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


@dataclass(frozen=True)
class Faults:
    """Fractions of packets dropped, duplicated and reordered, in and out; seeded."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    seed: int = 1
    #: Fraction of packets that start a burst of ``burst_length`` lost packets (a lost GSO send).
    burst: float = 0.0
    burst_length: int = 64

    def args(self) -> list[str]:
        """The ``netagg-softswitch`` options that inject these faults (none when there are none)."""
        if not (self.drop or self.duplicate or self.reorder or self.burst):
            return []
        return ["--drop", str(self.drop), "--duplicate", str(self.duplicate), "--reorder", str(self.reorder),
                "--seed", str(self.seed), "--burst", str(self.burst), "--burst-length", str(self.burst_length)]

    def injectors(self) -> tuple[FaultInjector, FaultInjector]:
        rx = FaultInjector(self.drop, self.duplicate, self.reorder, seed=self.seed, burst=self.burst,
                           burst_length=self.burst_length)
        tx = FaultInjector(self.drop, self.duplicate, self.reorder, seed=self.seed + 1, burst=self.burst,
                           burst_length=self.burst_length)
        return rx, tx
