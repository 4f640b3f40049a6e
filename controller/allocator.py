"""First-fit allocation of contiguous ranges of switch memory, with coalescing of freed ranges.

Switch memory is counted in *cells* of ``wire.K`` values (docs/protocol.md, "Wide packets"): every range
here (``SlotRange``, capacities, ``largest_free``) is in cells. A job of width k takes ``wire.cells_of(k)``
cells per slot, so it asks for ``slots * cells`` cells with ``unit=cells``: a partial grant is then a whole
number of its slots.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


class AllocationError(ValueError):
    """A range could not be reserved or released (overlap, out of bounds, unknown)."""


@dataclass(frozen=True, order=True)
class SlotRange:
    """``count`` cells starting at cell ``base`` (for a narrow job, its slots)."""

    base: int
    count: int

    @property
    def end(self) -> int:
        return self.base + self.count


class SlotAllocator:
    """Free ranges of cells ``[0, capacity)`` kept sorted and coalesced.

    ``allocate(want, minimum, unit)`` is best effort, as in ATP: the first free range
    that holds ``want`` cells, else as much of the largest free range as is a whole
    number of ``unit``s if that holds at least ``minimum``, else None (the caller
    falls back to the parameter server).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._free: list[SlotRange] = [SlotRange(0, capacity)]

    @property
    def free_ranges(self) -> tuple[SlotRange, ...]:
        return tuple(self._free)

    @property
    def free_cells(self) -> int:
        return sum(r.count for r in self._free)

    #: The name from before wide packets (a cell is a narrow slot).
    free_slots = free_cells

    def largest_free(self) -> int:
        return max((r.count for r in self._free), default=0)

    def largest_free_units(self, unit: int = 1) -> int:
        """The most whole ``unit``s (a job's slots of ``unit`` cells each) one free range holds."""
        return self.largest_free() // unit

    def allocate(self, want: int, minimum: int | None = None, unit: int = 1) -> SlotRange | None:
        """Reserve up to ``want`` contiguous cells (at least ``minimum``, default ``want``), a whole number of
        ``unit``s (``want`` and ``minimum`` must be multiples of it)."""
        found = self._find(want, minimum, unit)
        return None if found is None else self._take(*found)

    def find(self, want: int, minimum: int | None = None, unit: int = 1) -> SlotRange | None:
        """The range :meth:`allocate` would reserve, reserving nothing."""
        found = self._find(want, minimum, unit)
        return None if found is None else SlotRange(self._free[found[0]].base, found[1])

    def is_free(self, cells: SlotRange) -> bool:
        """Whether every cell of ``cells`` is free."""
        return any(free.base <= cells.base and cells.end <= free.end for free in self._free)

    def _find(self, want: int, minimum: int | None, unit: int) -> tuple[int, int] | None:
        """(index of the free range, cells): the first that holds ``want``, else the largest, if its whole
        ``unit``s reach ``minimum``."""
        minimum = _check_request(want, minimum, unit)
        for i, free in enumerate(self._free):
            if free.count >= want:
                return i, want
        best = max(range(len(self._free)), key=lambda i: (self._free[i].count, -i), default=None)
        if best is not None:
            fits = self._free[best].count // unit * unit
            if fits >= minimum:
                return best, fits
        return None

    def _take(self, index: int, count: int) -> SlotRange:
        free = self._free[index]
        taken = SlotRange(free.base, count)
        if free.count == count:
            del self._free[index]
        else:
            self._free[index] = SlotRange(free.base + count, free.count - count)
        return taken

    def reserve(self, taken: SlotRange) -> None:
        """Mark a specific range used (restoring allocations from the database)."""
        if taken.count < 1 or taken.base < 0 or taken.end > self.capacity:
            raise AllocationError(f"range {taken} is outside 0..{self.capacity}")
        for i, free in enumerate(self._free):
            if free.base <= taken.base and taken.end <= free.end:
                pieces = [SlotRange(free.base, taken.base - free.base), SlotRange(taken.end, free.end - taken.end)]
                self._free[i:i + 1] = [p for p in pieces if p.count > 0]
                return
        raise AllocationError(f"range {taken} overlaps a used range")

    def release(self, used: SlotRange) -> None:
        """Give a range back, merging it with free neighbours."""
        if used.count < 1 or used.base < 0 or used.end > self.capacity:
            raise AllocationError(f"range {used} is outside 0..{self.capacity}")
        i = bisect.bisect_left(self._free, used)
        before = self._free[i - 1] if i > 0 else None
        after = self._free[i] if i < len(self._free) else None
        if (before and before.end > used.base) or (after and used.end > after.base):
            raise AllocationError(f"range {used} is (partly) free already")
        base, end = used.base, used.end
        start, stop = i, i
        if before and before.end == base:
            base, start = before.base, i - 1
        if after and after.base == end:
            end, stop = after.end, i + 1
        self._free[start:stop] = [SlotRange(base, end - base)]


def _check_request(want: int, minimum: int | None, unit: int) -> int:
    """``minimum`` (default ``want``) once the request is checked: ``1 <= minimum <= want``, both whole ``unit``s."""
    if unit < 1:
        raise AllocationError(f"unit {unit} must be >= 1")
    if want < 1:
        raise AllocationError(f"cannot allocate {want} cells")
    minimum = want if minimum is None else minimum
    if not 1 <= minimum <= want:
        raise AllocationError(f"minimum {minimum} must be in 1..{want}")
    if want % unit or minimum % unit:
        raise AllocationError(f"{want} cells (at least {minimum}) are not whole slots of {unit} cells")
    return minimum


class FabricAllocator:
    """Cells on several switches at once: a job over a tree of switches takes the same number of cells (of
    slots, at its one width) on every switch of its tree, or none anywhere (docs/hierarchy.md). Each switch
    counts its own cells."""

    def __init__(self, capacities: dict[str, int]) -> None:
        self.allocators = {switch: SlotAllocator(capacity) for switch, capacity in capacities.items()}

    def allocate(self, switches: list[str], want: int, minimum: int | None = None,
                 unit: int = 1) -> dict[str, SlotRange] | None:
        """Reserve ``n`` contiguous cells on each of ``switches``, with ``n`` the most up to ``want`` that all of
        them have, a whole number of ``unit``s (at least ``minimum``, default ``want``); None, and nothing
        reserved, where they have not."""
        minimum = _check_request(want, minimum, unit)
        unknown = [s for s in switches if s not in self.allocators]
        if unknown or not switches:
            raise AllocationError(f"unknown switch(es) {unknown}" if unknown else "no switches")
        count = min(want, *(self.allocators[s].largest_free() for s in switches)) // unit * unit
        if count < minimum:
            return None
        taken: dict[str, SlotRange] = {}
        try:
            for switch in switches:
                got = self.allocators[switch].allocate(count)
                if got is None:  # cannot happen (the count fits every switch's largest range): undo anyway
                    raise AllocationError(f"switch {switch} could not give {count} slots")
                taken[switch] = got
        except BaseException:
            self.release(taken)
            raise
        return taken

    def release(self, taken: dict[str, SlotRange]) -> None:
        for switch, slots in taken.items():
            self.allocators[switch].release(slots)

    def reserve(self, taken: dict[str, SlotRange]) -> None:
        """Mark ranges used (restoring a tree job from the database)."""
        for switch, slots in taken.items():
            self.allocators[switch].reserve(slots)


@dataclass(frozen=True)
class TreeSlots:
    """The same number of cells on each switch of a job's tree (root first); ``base`` is the root's."""

    ranges: tuple[tuple[str, SlotRange], ...]

    @property
    def count(self) -> int:
        return self.ranges[0][1].count

    @property
    def base(self) -> int:
        return self.ranges[0][1].base

    def as_dict(self) -> dict[str, SlotRange]:
        return dict(self.ranges)


class TreeAllocator:
    """A :class:`FabricAllocator` seen by one job's tree (``switches``, root first): what admission takes its
    cells from, with the same calls as a :class:`SlotAllocator`."""

    def __init__(self, fabric: FabricAllocator, switches: list[str]) -> None:
        self.fabric = fabric
        self.switches = list(switches)

    def largest_free(self) -> int:
        """The most cells every switch of the tree has in one range."""
        return min(self.fabric.allocators[s].largest_free() for s in self.switches)

    def largest_free_units(self, unit: int = 1) -> int:
        """The most whole ``unit``s every switch of the tree has in one range."""
        return self.largest_free() // unit

    def allocate(self, want: int, minimum: int | None = None, unit: int = 1) -> TreeSlots | None:
        taken = self.fabric.allocate(self.switches, want, minimum, unit)
        return None if taken is None else TreeSlots(tuple((s, taken[s]) for s in self.switches))

    def release(self, taken: TreeSlots) -> None:
        self.fabric.release(taken.as_dict())
